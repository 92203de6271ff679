"""Unit tests of sidecar.backoff (pure): the one retry schedule every loop uses, and the grid
their periodic ticks share."""

from __future__ import annotations

import pytest

from sidecar.backoff import Backoff, next_tick


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


# --- the tick grid -----------------------------------------------------------------------------


@pytest.mark.parametrize("now", [0.0, 0.1, 0.999, 1.0, 1.0004, 7.25, 123456.789])
def test_a_tick_comes_within_one_period_and_never_at_once(now: float) -> None:
    for every_s in (0.25, 1.0, 10.0):
        tick = next_tick(now, every_s, phase_s=0.3)
        assert now < tick <= now + every_s + 1e-9
        assert (tick - 0.3) / every_s == pytest.approx(round((tick - 0.3) / every_s))


def test_loops_of_periods_that_divide_each_other_wake_at_the_same_instants() -> None:
    """A 1 s loop, a 0.25 s loop and a 10 s loop, each sleeping until its next tick from where
    it woke: every 1 s tick is a 0.25 s tick, every 10 s tick a 1 s tick (one wake for all)."""

    def ticks(every_s: float, until: float) -> set[float]:
        now, out = 5.123, set()
        while (now := next_tick(now, every_s, phase_s=0.42)) < until:
            out.add(round(now, 6))
        return out

    quarter, second, ten = ticks(0.25, 60), ticks(1.0, 60), ticks(10.0, 60)
    assert len(second) == 55 and second <= quarter  # 5.42, 6.42 … 59.42
    assert len(ten) == 5 and ten <= second  # 10.42 … 50.42


def test_a_tick_fired_a_hair_early_is_that_tick_not_a_reason_for_another() -> None:
    """Timers may fire a rounding error before their instant: the next tick is a period on."""
    tick = next_tick(3.7, 1.0, phase_s=0.5)
    assert tick == pytest.approx(4.5)
    assert next_tick(tick - 1e-9, 1.0, phase_s=0.5) == pytest.approx(5.5)


def test_processes_take_their_own_place_on_the_grid() -> None:
    """Sidecars on one node share a monotonic clock; each process's phase keeps them apart."""
    a = next_tick(100.0, 1.0, phase_s=0.1)
    b = next_tick(100.0, 1.0, phase_s=0.6)
    assert a - 100.0 == pytest.approx(0.1) and b - 100.0 == pytest.approx(0.6)


def test_flush_checks_keep_to_the_grid_unless_they_would_take_over_a_fifth_of_the_loop() -> None:
    from sidecar.flush.flusher import CHECK_SHARE, next_check_at

    began = next_tick(100.0, 1.0)  # the loop wakes on the grid: a tick of both periods below
    # A check of a few queries (2 ms) keeps to the interval's grid.
    assert next_check_at(began, 0.002, 0.05) == next_tick(began, 0.05)
    # One over thousands (60 ms, longer than the 50 ms interval): 300 ms after it began.
    assert next_check_at(began, 0.060, 0.05) == pytest.approx(began + 0.060 / CHECK_SHARE)
    assert CHECK_SHARE == 0.2
    # The same check on a 1 s interval is a small share: the grid still rules.
    assert next_check_at(began, 0.060, 1.0) == next_tick(began, 1.0)
