"""When loops wake: one retry schedule for every loop (capped exponential backoff with jitter,
per key), and one grid for their periodic ticks. Pure.

Used by the flusher (per query), the lease manager (per query blob), the Kafka committer (per
group), the daemon's start-up waits and the Spark-side sender. Jitter (each delay drawn between
half and all of the nominal one) keeps many queries that failed together from retrying in lockstep.
Whether to retry at all is the caller's decision, read from the error's ``retriable``
attribute (``sidecar.errors``); this module only says *when* — and :class:`Retries`, how a
background writer (Kafka commits, Event Hubs checkpoints) logs each failure.

The periodic loops (the flush check, the durability check, the snapshot and sink passes, the
lease checks, retirement) tick on one grid (:func:`next_tick`): ticks of every period fall on
the same instants, so an idle daemon wakes once a second for all of them, not once per loop.
An idle sidecar's CPU is its number of wakes (docs/benchmarks.md), not the work in them.
"""

from __future__ import annotations

import logging
import math
import random
import time
import zlib
from collections.abc import Callable, Hashable

#: This process's place on the grid, in seconds: sidecars started on one node together (one
#: monotonic clock) do not all tick at the same instant, at Redis or at the store. Read at
#: each tick: a simulation sets it, so that the same steps always tick at the same instants.
GRID_PHASE_S = random.random()
#: A tick fired a hair early (timer rounding) is still that tick, not a reason for another.
_EARLY = 1e-6


def next_tick(now: float, every_s: float, *, phase_s: float | None = None) -> float:
    """The first instant after ``now`` (the loop's clock) on this process's grid of period
    ``every_s``: ``phase_s + k * every_s`` (:data:`GRID_PHASE_S` unless given). Periods that
    divide each other share instants (a 0.25 s grid holds every 1 s tick), so loops that sleep
    until their next tick wake together. The wait is at most ``every_s``; a loop woken early
    (an event) keeps to the grid."""
    phase = GRID_PHASE_S if phase_s is None else phase_s
    k = math.floor((now - phase) / every_s + _EARLY) + 1
    return phase + k * every_s


def spread(key: str) -> float:
    """A fraction in [0, 1) of its own for ``key``, the same on every call and every run:
    jitter for schedules that must stay apart (queries' flush thresholds), not drift."""
    return zlib.crc32(key.encode()) / 2**32


class Backoff:
    """Delays ``base_s``, 2·``base_s``, 4·``base_s`` … capped at ``cap_s``, jittered, per key."""

    def __init__(
        self,
        base_s: float,
        cap_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"backoff needs 0 < base_s <= cap_s, got {base_s}, {cap_s}")
        self.base_s = base_s
        self.cap_s = cap_s
        self._clock = clock
        self._jitter = jitter
        self._failures: dict[Hashable, int] = {}
        self._retry_at: dict[Hashable, float] = {}

    def delay(self, failures: int) -> float:
        """The jittered delay after the ``failures``-th failure in a row (1 = the first)."""
        nominal: float = min(self.cap_s, self.base_s * 2 ** min(max(failures, 1) - 1, 32))
        return nominal * (0.5 + 0.5 * self._jitter())

    def failed(
        self, key: Hashable = None, *, give_up_ramp: bool = False, at_least_s: float = 0.0
    ) -> float:
        """Record a failure of ``key``; return the delay before its next attempt.

        ``give_up_ramp``: wait the full cap at once (for errors that retrying soon will not
        fix, e.g. a refused credential, which an operator must correct first). ``at_least_s``:
        the server asked for that long (``Retry-After``; capped at ``cap_s`` too).
        """
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        delay = self.after(failures, give_up_ramp=give_up_ramp, at_least_s=at_least_s)
        self._retry_at[key] = self._clock() + delay
        return delay

    def after(self, failures: int, *, give_up_ramp: bool = False, at_least_s: float = 0.0) -> float:
        """The delay after the ``failures``-th failure in a row, for a caller that keeps its
        own count (:meth:`failed`'s rules, nothing recorded here)."""
        delay = self.cap_s if give_up_ramp else self.delay(failures)
        return max(delay, min(at_least_s, self.cap_s))

    def succeeded(self, key: Hashable = None) -> None:
        """Forget ``key``'s failures: its next failure starts from ``base_s`` again."""
        self._failures.pop(key, None)
        self._retry_at.pop(key, None)

    def failures(self, key: Hashable = None) -> int:
        """Failures of ``key`` in a row so far."""
        return self._failures.get(key, 0)

    def ready(self, key: Hashable = None) -> bool:
        """True when ``key`` may be tried now (no failure pending, or its delay elapsed)."""
        return self._clock() >= self._retry_at.get(key, 0.0)

    def forget(self, key: Hashable) -> None:
        """Drop everything about ``key`` (it is gone)."""
        self.succeeded(key)


class Retries(Backoff):
    """A :class:`Backoff` per key that also logs each failure as the background writers do
    (Kafka commits, Event Hubs checkpoints): ours at WARNING when retriable, else ERROR (the
    cap at once); an unexpected exception at ERROR, with its traceback once per failure
    streak, not at every retry."""

    def __init__(
        self,
        base_s: float,
        cap_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        super().__init__(base_s, cap_s, clock=clock, jitter=jitter)
        #: By key: the unexpected error of the current failure streak (traceback logged).
        self._unexpected: dict[Hashable, type[BaseException]] = {}

    def log_failure(self, key: Hashable, what: str, exc: Exception, log: logging.Logger) -> None:
        """Back ``key`` off after ``exc`` (honouring a server's ``retry_after_s``) and log it.
        Ours are the errors that say whether to retry (``sidecar.errors.SidecarError``'s
        ``retriable``; read by name: this module imports nothing of the daemon's)."""
        ours = isinstance(getattr(exc, "retriable", None), bool)
        retriable = bool(getattr(exc, "retriable", True))
        asked = getattr(exc, "retry_after_s", None) or 0.0
        delay = self.failed(key, give_up_ramp=not retriable, at_least_s=asked)
        retry = f"retry {self.failures(key)} in {delay:.1f}s"
        if ours:
            log.log(
                logging.WARNING if retriable else logging.ERROR,
                "%s failed (%s): %s",
                what,
                retry,
                exc,
            )
            return
        first = self._unexpected.get(key) is not type(exc)
        self._unexpected[key] = type(exc)
        again = "" if first else " (again; the traceback was logged at its first occurrence)"
        log.error(
            "%s failed unexpectedly (%s): %r%s",
            what,
            retry,
            exc,
            again,
            exc_info=exc if first else None,
        )

    def succeeded(self, key: Hashable = None) -> None:
        super().succeeded(key)
        self._unexpected.pop(key, None)
