"""Blob lease ownership, one lease per query blob, held until the query is retired (idle,
``sidecar.daemon.retirement``) or the daemon stops.

Invariant: **a checkpoint blob is written only while its lease is HELD.** The flusher gets a
lease only from :meth:`LeaseManager.ensure_held`, which returns a :class:`Held` (the query and
its term) only in HELD and only while the lease is known to be valid (renewed in time); right
before it writes, :meth:`LeaseManager.holds` checks that the same term is still HELD and valid
(a read may have taken long enough for the lease to be lost and taken again). Every write
also carries the lease id, so the store itself refuses a stale owner.

States and transitions (anything else raises :class:`IllegalTransition`)::

    ACQUIRING ──acquired──────────▶ HELD ──renewed──▶ HELD
        │                            │
        │ another owner / store down │ renewal or write refused, or its validity ran out
        ▼                            ▼
       LOST ◀────────────────────────┘
        │ backoff elapsed
        └──────────▶ ACQUIRING
    ACQUIRING | HELD | LOST ──release (shutdown, retired)──▶ RELEASED (final)

A retired query's lease is released and forgotten: if the query writes again, a new lease
starts in ACQUIRING.

Each acquisition starts a new **term** (a number no other acquisition of this manager has).
Whatever was learnt of the blob under one term (``sidecar.flush.core``) is void under the
next: someone else may have written the blob while we did not hold it. This module knows
nothing of what the blob holds.

LOST is "not owned": nothing is written, updates stay buffered in Redis, the state shows
in ``checkpoint_sidecar_lease_held{query}``, logs and ``/readyz``, and acquisition is
retried with capped exponential backoff and jitter (by the manager's own loop, so an idle
query's lease comes back too).

Validity is a timer, not a question asked at the next write: a lease whose last successful
acquire or renew started more than its duration minus :data:`EXPIRY_MARGIN_S` ago is LOST
within :data:`CHECK_EVERY_S`, also while its renewal hangs (a store that stopped answering
times a call out only after ``SIDECAR_WRITE_TIMEOUT_S``). Every state change the loop makes
happens under the lease's lock, so it never interleaves with ``ensure_held`` or a release.
"""

from __future__ import annotations

import enum
import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus

from sidecar.backoff import Backoff
from sidecar.errors import LeaseConflict, LeaseLost, SidecarError
from sidecar.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

#: A lease is treated as lost this long before it would expire without a renewal, so a
#: write never starts on a lease that may lapse while the request is in flight.
EXPIRY_MARGIN_S = 3.0
#: How often the manager's loop looks at its leases: a lease whose validity ran out is LOST
#: (metrics, ``/readyz``) within this long, and due renewals and retries start within it.
CHECK_EVERY_S = 0.25
#: A renewal that failed without being refused (store unreachable, timed out) is tried again
#: this soon, while the lease may still be valid.
RENEW_RETRY_S = 1.0
#: Each renewal comes after the renewal interval (a third of the duration) times a random
#: factor within ±this share: 1,000 leases acquired together (queries started at once) then
#: renew spread over half the interval the first time, and drift further apart each round,
#: instead of 1,000 blob calls in the same instant every interval. The mean stays one
#: interval (no extra blob transactions); the latest renewal, at 5/12 of the duration,
#: leaves a 15 s lease (the shortest) 5.75 s of validity for retries of a failed one.
RENEW_JITTER = 0.25


def renew_delay(interval_s: float, rand: float) -> float:
    """Seconds from a successful acquire or renewal to the next renewal: ``interval_s``
    scaled by a factor in [1 - RENEW_JITTER, 1 + RENEW_JITTER), ``rand`` in [0, 1)."""
    return interval_s * (1 - RENEW_JITTER + 2 * RENEW_JITTER * rand)


class LeaseState(enum.Enum):
    ACQUIRING = "acquiring"
    HELD = "held"
    LOST = "lost"
    RELEASED = "released"


_ALLOWED: dict[LeaseState, frozenset[LeaseState]] = {
    LeaseState.ACQUIRING: frozenset({LeaseState.HELD, LeaseState.LOST, LeaseState.RELEASED}),
    LeaseState.HELD: frozenset({LeaseState.HELD, LeaseState.LOST, LeaseState.RELEASED}),
    LeaseState.LOST: frozenset({LeaseState.ACQUIRING, LeaseState.RELEASED}),
    LeaseState.RELEASED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A lease was asked to make a move the state table does not allow (a bug)."""


@dataclass
class QueryLease:
    """The lease on one query's blob, as this daemon sees it."""

    query_id: str
    label: str
    state: LeaseState = LeaseState.ACQUIRING
    #: Monotonic time after which the lease may have lapsed (valid while HELD).
    valid_until: float = 0.0
    #: Monotonic time of the next renewal (while HELD).
    renew_at: float = 0.0
    #: Monotonic time of the next acquisition attempt (while LOST).
    retry_at: float = 0.0
    failures: int = 0
    #: The current acquisition (0: never acquired); new on every acquisition, so knowledge
    #: of the blob tied to an older term is known to be stale.
    term: int = 0
    #: Not owned because the store said so — another lease holds the blob, or ours was
    #: broken — rather than because the store did not answer (``LeaseManager.contested``).
    contested: bool = False
    #: The instance lock's epoch it was acquired under (``LeaseManager``'s ``live``).
    epoch: int | None = None
    #: Serialises acquire, release and the loop's state changes of this lease (a flush tick,
    #: the final flush and the lease loop may overlap).
    lock: anyio.Lock = field(default_factory=anyio.Lock)

    def to(self, new: LeaseState, reason: str) -> None:
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(f"lease of {self.label}: {self.state.name} -> {new.name}")
        if new is not self.state:
            level = logging.WARNING if new is LeaseState.LOST else logging.INFO
            log.log(
                level,
                "lease query=%s %s -> %s: %s",
                self.label,
                self.state.name,
                new.name,
                reason,
                extra={"lease_state": new.name, "query_id": self.query_id},  # JSON logs
            )
        self.state = new


@dataclass(frozen=True, slots=True)
class Held:
    """A lease as :meth:`LeaseManager.ensure_held` returned it: what was learnt under it is
    valid only while :meth:`LeaseManager.holds` says the same term is still held."""

    query_id: str
    term: int


class LeaseStore(Protocol):
    """The lease calls of the blob store (``sidecar.store.blobs.BlobStore``)."""

    async def create_if_absent(self, query_id: str) -> None: ...

    async def acquire_lease(self, query_id: str, lease_id: str, duration_s: int) -> None: ...

    async def renew_lease(self, query_id: str, lease_id: str) -> None: ...

    async def release_lease(self, query_id: str, lease_id: str) -> None: ...


class LeaseManager:
    """Acquires, renews and releases the leases of every query this daemon flushes."""

    def __init__(
        self,
        store: LeaseStore,
        lease_id: str,
        duration_s: int,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
        live: Callable[[], int | None] = lambda: 0,
    ) -> None:
        """``clock``: monotonic seconds, for every lease deadline (tests inject their own);
        ``jitter``: uniform in [0, 1), spreads renewals (:func:`renew_delay`); ``live``:
        the epoch of this daemon's instance lock while it is the live daemon of its lease id
        (``sidecar.daemon.instance``), None while not — then no lease is acquired, written
        under or released; a lease acquired under an older epoch is acquired again (a new
        term) before it is written under."""
        self._store = store
        self.lease_id = lease_id
        self._duration_s = duration_s
        self._metrics = metrics
        self._clock = clock
        self._jitter = jitter
        self._live = live
        self._leases: dict[str, QueryLease] = {}
        #: Set when the first lease is registered: with none, the loop has nothing to time
        #: and sleeps until then (an idle daemon does not wake four times a second).
        self._first = anyio.Event()
        self._terms = itertools.count(1)
        #: Queries with a renewal or a re-acquisition under way in the loop (one at a time).
        self._busy: set[str] = set()
        #: The loop's checks so far (tests and debugging wait on it, not on a fixed time).
        self.ticks = 0
        # The cap keeps a standby's takeover within about a third of a lease duration after
        # the owner lets go.
        self._backoff = Backoff(1.0, self.renew_every_s, clock=clock, jitter=jitter)

    @property
    def renew_every_s(self) -> float:
        """The nominal renewal interval; each renewal is jittered around it."""
        return self._duration_s / 3

    def not_owned(self) -> list[str]:
        """Labels of the queries whose lease this daemon wants but does not hold: LOST, or
        being re-acquired after a loss (not a first acquisition, which is not a failure)."""
        return [
            q.label
            for q in self._leases.values()
            if q.state is LeaseState.LOST or (q.state is LeaseState.ACQUIRING and q.failures)
        ]

    def contested(self) -> list[str]:
        """Labels of the not-owned queries (:meth:`not_owned`) the store refused: another
        lease holds the blob, or ours was broken. A store that does not answer is not here:
        that is the store's health (``BlobStore.available``), not ownership."""
        return [
            q.label
            for q in self._leases.values()
            if q.contested
            and (q.state is LeaseState.LOST or (q.state is LeaseState.ACQUIRING and q.failures))
        ]

    def held(self) -> list[str]:
        """Labels of the queries whose lease this daemon holds (after a stop: not released)."""
        return [q.label for q in self._leases.values() if q.state is LeaseState.HELD]

    def state(self, query_id: str) -> LeaseState | None:
        lease = self._leases.get(query_id)
        return lease.state if lease else None

    def holds(self, held: Held) -> bool:
        """Whether ``held``'s term is still HELD and valid: no write without it, right before
        the write (no await between)."""
        lease = self._leases.get(held.query_id)
        return (
            lease is not None
            and lease.epoch is not None
            and lease.epoch == self._live()
            and lease.state is LeaseState.HELD
            and lease.term == held.term
            and self._clock() < lease.valid_until
        )

    async def ensure_held(self, query_id: str, label: str) -> Held | None:
        """The query's lease when HELD (acquiring it if due), else None: do not write."""
        while True:
            lease = self._leases.get(query_id)
            if lease is None:
                lease = self._leases[query_id] = QueryLease(query_id, label)
                self._first.set()
            lease.label = label
            async with lease.lock:
                if self._leases.get(query_id) is lease:
                    held = await self._ensure_held(lease)
                    return None if held is None else Held(query_id, held.term)
            # Retired while we waited for its lock: start again with a new lease.

    async def _ensure_held(self, lease: QueryLease) -> QueryLease | None:
        epoch = self._live()
        if epoch is None:
            return None
        query_id = lease.query_id
        now = self._clock()
        if lease.state is LeaseState.HELD:
            if lease.epoch != epoch:
                # Held through a time this daemon was not live: acquire again, a new term.
                self._lose(lease, "the instance lock lapsed meanwhile", immediately=True)
                lease.to(LeaseState.ACQUIRING, "the instance lock is back")
            elif now < lease.valid_until:
                return lease
            else:
                self._expire(lease)
        if lease.state is LeaseState.RELEASED:
            return None
        if lease.state is LeaseState.LOST:
            if now < lease.retry_at:
                return None
            lease.to(LeaseState.ACQUIRING, f"retry {lease.failures}")
        try:
            await self._store.create_if_absent(query_id)
            started = self._clock()
            await self._store.acquire_lease(query_id, self.lease_id, self._duration_s)
        except LeaseConflict:
            self._lose(lease, "another owner holds the lease", contested=True)
            return None
        except SidecarError as exc:
            self._lose(lease, f"could not acquire: {exc}")
            return None
        lease.valid_until = started + self._duration_s - EXPIRY_MARGIN_S
        lease.renew_at = started + renew_delay(self.renew_every_s, self._jitter())
        lease.failures, lease.contested = 0, False
        lease.epoch = epoch
        lease.term = next(self._terms)  # someone else may have written while we did not own it
        lease.to(LeaseState.HELD, f"acquired for {self._duration_s}s")
        self._metrics.lease_held.labels(lease.label).set(1)
        return lease

    def lost(self, query_id: str, reason: str) -> None:
        """A write was refused for the lease: stop writing until it is re-acquired."""
        lease = self._leases.get(query_id)
        if lease is not None and lease.state is LeaseState.HELD:
            self._lose(lease, reason, contested=True)

    def _expire(self, lease: QueryLease) -> None:
        """HELD past its validity: we can no longer be sure it is ours. Try again at once
        (it may only have been a slow renewal)."""
        self._lose(
            lease,
            f"not renewed within {self._duration_s}s minus a {EXPIRY_MARGIN_S:g}s margin; "
            "it may have lapsed",
            immediately=True,
        )

    def _lose(
        self, lease: QueryLease, reason: str, *, immediately: bool = False, contested: bool = False
    ) -> None:
        lease.contested = contested
        if lease.state is LeaseState.LOST:
            return
        lease.to(LeaseState.LOST, reason)
        self._metrics.lease_held.labels(lease.label).set(0)
        self._schedule_retry(lease, self._clock(), immediately=immediately)

    def _schedule_retry(self, lease: QueryLease, now: float, immediately: bool = False) -> None:
        lease.failures += 1
        if immediately:
            lease.retry_at = now
            return
        lease.retry_at = now + self._backoff.delay(lease.failures)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep the leases, until cancelled (with none, sleep until the first is registered):
        every :data:`CHECK_EVERY_S`, a HELD lease past
        its validity goes LOST (its own timer, whatever its renewal is doing), a HELD lease
        is renewed a third of its duration after its last renewal, and a LOST one is
        re-acquired once its backoff has elapsed. Renewals and retries run as tasks of this
        loop, so a hanging store call never delays the timers."""
        async with anyio.create_task_group() as tg:
            task_status.started()
            while True:
                if not self._leases:
                    self._first = anyio.Event()
                    await self._first.wait()
                await anyio.sleep(CHECK_EVERY_S)
                self._tick(tg)
                self.ticks += 1

    def _tick(self, tg: TaskGroup) -> None:
        self.expire_lapsed()
        now = self._clock()
        for lease in list(self._leases.values()):
            if lease.query_id in self._busy:
                continue
            if lease.state is LeaseState.HELD and now >= lease.renew_at:
                self._busy.add(lease.query_id)
                tg.start_soon(self._renew, lease)
            elif lease.state is LeaseState.LOST and now >= lease.retry_at:
                self._busy.add(lease.query_id)
                tg.start_soon(self._reacquire, lease)

    def expire_lapsed(self) -> list[str]:
        """The timer's step: mark LOST every HELD lease past its validity (a renewal that
        hangs or timed out rather than being refused); return their labels. Metrics and
        ``/readyz`` follow at once, not at the query's next write."""
        lapsed = []
        for lease in list(self._leases.values()):
            if lease.state is not LeaseState.HELD or self._clock() < lease.valid_until:
                continue
            # Under the lease's lock, but never waiting for it: whoever holds it
            # (ensure_held, a release) decides the state itself, and the next check is soon.
            try:
                lease.lock.acquire_nowait()
            except anyio.WouldBlock:
                continue
            try:
                self._expire(lease)
                lapsed.append(lease.label)
            finally:
                lease.lock.release()
        return lapsed

    async def _reacquire(self, lease: QueryLease) -> None:
        try:
            async with lease.lock:
                await self._ensure_held(lease)
        finally:
            self._busy.discard(lease.query_id)

    async def _renew(self, lease: QueryLease) -> None:
        try:
            started = self._clock()
            try:
                await self._store.renew_lease(lease.query_id, self.lease_id)
            except LeaseLost as exc:
                self._metrics.lease_renewals.labels("lost").inc()
                async with lease.lock:
                    if lease.state is LeaseState.HELD:
                        self._lose(lease, f"renewal refused: {exc}", contested=True)
                return
            except SidecarError as exc:
                self._metrics.lease_renewals.labels("error").inc()
                lease.renew_at = self._clock() + RENEW_RETRY_S
                log.warning(
                    "lease query=%s renewal failed (retry in %.0fs; valid for %.1fs more): %s",
                    lease.label,
                    RENEW_RETRY_S,
                    max(0.0, lease.valid_until - self._clock()),
                    exc,
                )
                return
            self._metrics.lease_renewals.labels("ok").inc()
            async with lease.lock:
                # Only a lease still HELD is extended: one that expired meanwhile must go
                # through ACQUIRING again (the state table allows no LOST -> HELD).
                if lease.state is LeaseState.HELD:
                    lease.valid_until = max(
                        lease.valid_until, started + self._duration_s - EXPIRY_MARGIN_S
                    )
                    lease.renew_at = started + renew_delay(self.renew_every_s, self._jitter())
        finally:
            self._busy.discard(lease.query_id)

    async def release_all(self) -> None:
        """Release every held lease (shutdown), so a successor need not wait for expiry."""
        async with anyio.create_task_group() as tg:
            for lease in list(self._leases.values()):
                tg.start_soon(self._release, lease)

    async def retire(self, query_id: str) -> bool:
        """Release the query's lease and forget it (the query is idle), so a standby can take
        it at once. False when a renewal or re-acquisition is under way: try again later.
        ``checkpoint_sidecar_lease_held`` is left as it is (its series is the retirement's
        to remove: another id of the same name may hold its own lease)."""
        lease = self._leases.get(query_id)
        if lease is None:
            return True
        if query_id in self._busy:
            return False
        self._busy.add(query_id)  # no renewal starts while it is being released
        try:
            async with lease.lock:
                await self._release_locked(lease, "query retired (idle)", metric=False)
                if self._leases.get(query_id) is lease:
                    del self._leases[query_id]
        finally:
            self._busy.discard(query_id)
        return True

    async def _release(self, lease: QueryLease) -> None:
        async with lease.lock:
            await self._release_locked(lease)

    async def _release_locked(
        self, lease: QueryLease, reason: str = "shutdown", *, metric: bool = True
    ) -> None:
        # Not the live daemon of this lease id: the lease is the other daemon's to release.
        if lease.state is LeaseState.HELD and self._live() is not None:
            try:
                await self._store.release_lease(lease.query_id, self.lease_id)
            except SidecarError as exc:
                log.warning(
                    "lease query=%s release failed (it expires by itself): %s", lease.label, exc
                )
        if lease.state is not LeaseState.RELEASED:
            lease.to(LeaseState.RELEASED, reason)
            if metric:
                self._metrics.lease_held.labels(lease.label).set(0)
