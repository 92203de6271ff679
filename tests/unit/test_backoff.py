"""Unit tests of sidecar.backoff (pure): the one retry schedule every loop uses."""

from __future__ import annotations

import pytest

from sidecar.backoff import Backoff


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_delays_double_from_the_base_up_to_the_cap() -> None:
    backoff = Backoff(0.5, 4.0, jitter=lambda: 1.0)  # no jitter: the nominal delays
    assert [backoff.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.delay(10_000) == 4.0  # no overflow on long outages


def test_jitter_draws_between_half_and_all_of_the_nominal_delay() -> None:
    assert Backoff(1.0, 8.0, jitter=lambda: 0.0).delay(3) == 2.0
    assert Backoff(1.0, 8.0, jitter=lambda: 0.5).delay(3) == 3.0


def test_failures_are_counted_per_key_and_gate_the_next_attempt() -> None:
    clock = Clock()
    backoff = Backoff(1.0, 30.0, clock=clock, jitter=lambda: 1.0)
    assert backoff.ready("a") and backoff.failures("a") == 0
    assert backoff.failed("a") == 1.0
    assert backoff.failed("a") == 2.0
    assert backoff.failures("a") == 2 and backoff.failures("b") == 0
    assert not backoff.ready("a") and backoff.ready("b")
    clock.now += 1.99
    assert not backoff.ready("a")
    clock.now += 0.01
    assert backoff.ready("a")
    backoff.succeeded("a")
    assert backoff.failures("a") == 0 and backoff.failed("a") == 1.0  # starts over


def test_an_error_retrying_will_not_fix_waits_the_whole_cap_at_once() -> None:
    backoff = Backoff(0.5, 30.0, jitter=lambda: 0.0)
    assert backoff.failed("q", give_up_ramp=True) == 30.0


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 5.0)])
def test_a_schedule_that_cannot_work_is_refused(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="0 < base_s <= cap_s"):
        Backoff(base, cap)
