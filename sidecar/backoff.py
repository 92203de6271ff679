"""One retry schedule for every loop: capped exponential backoff with jitter, per key. Pure.

Used by the flusher (per query), the lease manager (per query blob), the Kafka committer (per
group), the daemon's start-up waits and the Spark-side sender. Jitter (each delay drawn between
half and all of the nominal one) keeps many queries that failed together from retrying in lockstep.
Whether to retry at all is the caller's decision, read from the error's ``retriable``
attribute (``sidecar.errors``); this module only says *when*.
"""

from __future__ import annotations

import random
import time
import zlib
from collections.abc import Callable, Hashable


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
        delay = self.cap_s if give_up_ramp else self.delay(failures)
        delay = max(delay, min(at_least_s, self.cap_s))
        self._retry_at[key] = self._clock() + delay
        return delay

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
