"""Blob lease ownership: the calls to the store that acquire, renew and release each query's
lease, and the loop that keeps them. The state machine itself is ``sidecar.flush.lease``;
each lease hangs off its query's record in ``sidecar.flush.core``, so this module keeps no
map of its own: retiring a query drops its lease with everything else. It asks the records
and tells the core every outcome as an event (``sidecar.flush.events``), through the shell,
which carries out what follows (a lease refused as another's answers the acks waiting).

Each daemon process has its own lease id (``sidecar.daemon.ownership``: handed over only to
the same container restarted in its pod), so two daemons never both hold a query's lease,
whatever their identity settings and whichever Redis each uses.

Every state change the loop makes happens under the lease's lock, so it never interleaves
with ``ensure_held`` or a release. The loop runs renewals and retries as tasks, so a hanging
store call never delays the validity timers.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus

from sidecar.backoff import Backoff, next_tick
from sidecar.errors import LeaseConflict, LeaseLost, SidecarError
from sidecar.flush.core import FlushCore, QueryState
from sidecar.flush.events import (
    BlobCreated,
    Event,
    LeaseAcquired,
    LeaseAcquiring,
    LeaseLapsed,
    LeaseLetGo,
    LeaseRenewed,
    RenewFailed,
)
from sidecar.flush.lease import (
    CHECK_EVERY_S,
    RENEW_RETRY_S,
    Held,
    LeaseState,
    QueryLease,
    renew_delay,
)
from sidecar.flush.shell import QueryShell
from sidecar.telemetry.metrics import Metrics

log = logging.getLogger("sidecar.flush.lease")


class LeaseStore(Protocol):
    """The lease calls of the blob store (``sidecar.store.blobs.BlobStore``)."""

    async def create_if_absent(self, query_id: str) -> str | None: ...

    async def acquire_lease(self, query_id: str, lease_id: str, duration_s: int) -> str | None:
        """The blob's version as the store reports it with the lease (None: not reported)."""

    async def renew_lease(self, query_id: str, lease_id: str) -> str | None:
        """Likewise."""

    async def release_lease(self, query_id: str, lease_id: str) -> None: ...


#: A query's record; its ``shell.lease`` serialises this module's calls on the query's lease,
#: its ``shell.renewing`` says one is under way in the loop.
Record = QueryState[Any, QueryShell]


class LeaseManager:
    """Acquires, renews and releases the leases of every query this daemon flushes."""

    def __init__(
        self,
        store: LeaseStore,
        core: FlushCore[Any, QueryShell],
        lease_id: str,
        duration_s: int,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
        tell: Callable[[Event[Any]], object] | None = None,
    ) -> None:
        """``core``: the records the leases hang off, asked here, told through ``tell`` (the
        shell's, which carries out the actions: a lease refused as another's answers the acks
        waiting ``not_owner``; default: the core's own step); ``clock``: monotonic seconds,
        for every lease deadline; ``jitter``: uniform in [0, 1), spreads renewals
        (:func:`renew_delay`)."""
        self._store = store
        self._core = core
        self.lease_id = lease_id
        self._duration_s = duration_s
        self._metrics = metrics
        self._clock = clock
        self._jitter = jitter
        self._tell = tell or core.step
        #: Set when a lease is first wanted: with none, the loop has nothing to time and
        #: sleeps until then (an idle daemon does not wake four times a second).
        self._first = anyio.Event()
        self._terms = itertools.count(1)
        #: The loop's checks so far (tests and debugging wait on it, not on a fixed time).
        self.ticks = 0
        # The cap keeps a standby's takeover within about a third of a lease duration after
        # the owner lets go.
        self._backoff = Backoff(1.0, self.renew_every_s, clock=clock, jitter=jitter)

    def use(self, lease_id: str) -> None:
        """This process's lease id, known once the daemon starts (``sidecar.daemon.ownership``);
        before any lease is wanted."""
        if any(q.lease.term for q in self._core):
            raise RuntimeError("the lease id is set before any lease is acquired")
        self.lease_id = lease_id

    @property
    def renew_every_s(self) -> float:
        """The nominal renewal interval; each renewal is jittered around it."""
        return self._duration_s / 3

    def _leases(self) -> list[QueryLease]:
        return [q.lease for q in self._core]

    def not_owned(self) -> list[str]:
        """Labels of the queries whose lease this daemon wants but does not hold: LOST, or
        being re-acquired after a loss (not a first acquisition, which is not a failure)."""
        return [lease.label for lease in self._leases() if lease.not_owned()]

    def contested(self) -> list[str]:
        """Labels of the not-owned queries the store refused: another lease holds the blob,
        or ours was broken. A store that does not answer is not here: that is the store's
        health (``BlobStore.available``), not ownership."""
        return [lease.label for lease in self._leases() if lease.held_elsewhere()]

    def held(self) -> list[str]:
        """Labels of the queries whose lease this daemon holds (after a stop: not released)."""
        return [lease.label for lease in self._leases() if lease.state is LeaseState.HELD]

    def state(self, query_id: str) -> LeaseState | None:
        q = self._core.get(query_id)
        return q.lease.state if q is not None else None

    def held_elsewhere(self, query_id: str) -> bool:
        q = self._core.get(query_id)
        return q is not None and q.lease.held_elsewhere()

    def holds(self, held: Held) -> bool:
        """Whether ``held``'s term is still HELD and valid: no write without it, right before
        the write (no await between)."""
        q = self._core.get(held.query_id)
        return q is not None and q.lease.term == held.term and q.lease.valid(self._clock())

    async def ensure_held(self, query_id: str, label: str) -> Held | None:
        """The query's lease when HELD (acquiring it if due), else None: do not write."""
        while True:
            q = self._core.record(query_id, label)
            self._first.set()
            async with q.shell.lease:
                if self._core.get(query_id) is q:
                    lease = await self._ensure_held(q)
                    return None if lease is None else Held(query_id, lease.term)
            # Retired while we waited for its lock: start again with a new record.

    async def _ensure_held(self, q: Record) -> QueryLease | None:
        lease = q.lease
        now = self._clock()
        if lease.state is LeaseState.HELD:
            if now < lease.valid_until:
                return lease
            self._expire(lease)
        if lease.state is LeaseState.RELEASED:
            return None
        if lease.state is LeaseState.LOST:
            if now < lease.retry_at:
                return None
            self._tell(LeaseAcquiring(q.query_id, f"retry {lease.failures}"))
        query_id = q.query_id
        try:
            version = await self._store.create_if_absent(query_id)
            if version is not None:
                self._tell(BlobCreated(query_id, version))
            started = self._clock()
            reported = await self._store.acquire_lease(query_id, self.lease_id, self._duration_s)
        except LeaseConflict:
            self._lose(lease, "another owner holds the lease", contested=True)
            return None
        except SidecarError as exc:
            self._lose(lease, f"could not acquire: {exc}")
            return None
        # A new term: a write planned under an earlier one is not made under this one.
        renew_in = renew_delay(self.renew_every_s, self._jitter())
        term = next(self._terms)
        self._tell(LeaseAcquired(query_id, term, started, self._duration_s, renew_in, reported))
        self._metrics.lease_held.labels(lease.label).set(1)
        return lease

    def lost(self, query_id: str, reason: str) -> None:
        """A write was refused for the lease: stop writing until it is re-acquired."""
        q = self._core.get(query_id)
        if q is not None and q.lease.state is LeaseState.HELD:
            self._lose(q.lease, reason, contested=True)

    def _expire(self, lease: QueryLease) -> None:
        """HELD past its validity: we can no longer be sure it is ours. Try again at once
        (it may only have been a slow renewal)."""
        self._lose(
            lease,
            f"not renewed within {self._duration_s}s minus a margin; it may have lapsed",
            immediately=True,
        )

    def _lose(
        self, lease: QueryLease, reason: str, *, immediately: bool = False, contested: bool = False
    ) -> None:
        backoff = None if immediately else self._backoff.delay
        held = lease.state is not LeaseState.LOST
        # Another writer may change the blob now; contested, the acks waiting are not ours.
        self._tell(LeaseLapsed(lease.query_id, reason, self._clock(), backoff, contested))
        if held:
            self._metrics.lease_held.labels(lease.label).set(0)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep the leases, until cancelled (with none, sleep until the first is wanted):
        every :data:`CHECK_EVERY_S`, a HELD lease past its validity goes LOST (its own timer,
        whatever its renewal is doing), a HELD lease is renewed a third of its duration after
        its last renewal, and a LOST one is re-acquired once its backoff has elapsed."""
        async with anyio.create_task_group() as tg:
            task_status.started()
            while True:
                if not any(q.lease.state is not LeaseState.ACQUIRING for q in self._core):
                    self._first = anyio.Event()
                    with anyio.move_on_after(self.renew_every_s):
                        await self._first.wait()
                await anyio.sleep_until(next_tick(anyio.current_time(), CHECK_EVERY_S))
                self._tick(tg)
                self.ticks += 1

    def _tick(self, tg: TaskGroup) -> None:
        self.expire_lapsed()
        now = self._clock()
        for q in self._core:
            lease = q.lease
            if q.shell.renewing:
                continue
            if lease.state is LeaseState.HELD and now >= lease.renew_at:
                q.shell.renewing = True
                tg.start_soon(self._renew, q)
            elif lease.state is LeaseState.LOST and now >= lease.retry_at:
                q.shell.renewing = True
                tg.start_soon(self._reacquire, q)

    def expire_lapsed(self) -> list[str]:
        """The timer's step: mark LOST every HELD lease past its validity (a renewal that
        hangs or timed out rather than being refused); return their labels. Metrics and
        ``/readyz`` follow at once, not at the query's next write."""
        lapsed = []
        for q in self._core:
            lease = q.lease
            if lease.state is not LeaseState.HELD or self._clock() < lease.valid_until:
                continue
            # Under the lease's lock, but never waiting for it: whoever holds it
            # (ensure_held, a release) decides the state itself, and the next check is soon.
            try:
                q.shell.lease.acquire_nowait()
            except anyio.WouldBlock:
                continue
            try:
                self._expire(lease)
                lapsed.append(lease.label)
            finally:
                q.shell.lease.release()
        return lapsed

    async def _reacquire(self, q: Record) -> None:
        try:
            async with q.shell.lease:
                if self._core.get(q.query_id) is q:
                    await self._ensure_held(q)
        finally:
            q.shell.renewing = False

    async def _renew(self, q: Record) -> None:
        lease = q.lease
        try:
            started = self._clock()
            try:
                reported = await self._store.renew_lease(q.query_id, self.lease_id)
            except LeaseLost as exc:
                self._metrics.lease_renewals.labels("lost").inc()
                async with q.shell.lease:
                    if lease.state is LeaseState.HELD:
                        self._lose(lease, f"renewal refused: {exc}", contested=True)
                return
            except SidecarError as exc:
                self._metrics.lease_renewals.labels("error").inc()
                self._tell(RenewFailed(q.query_id, self._clock() + RENEW_RETRY_S))
                log.warning(
                    "lease query=%s renewal failed (retry in %.0fs; valid for %.1fs more): %s",
                    lease.label,
                    RENEW_RETRY_S,
                    max(0.0, lease.valid_until - self._clock()),
                    exc,
                )
                return
            self._metrics.lease_renewals.labels("ok").inc()
            async with q.shell.lease:
                renew_in = renew_delay(self.renew_every_s, self._jitter())
                self._tell(LeaseRenewed(q.query_id, started, self._duration_s, renew_in, reported))
        finally:
            q.shell.renewing = False

    async def release_all(self) -> None:
        """Release every held lease (shutdown), so a successor need not wait for expiry."""
        async with anyio.create_task_group() as tg:
            for q in self._core:
                tg.start_soon(self._release, q)

    async def retire(self, query_id: str) -> bool:
        """Release the query's lease (the query is idle), so a standby can take it at once;
        its record, with the lease, is dropped next (the event ``Retired``). False when a
        renewal or re-acquisition is under way: try again later.
        ``checkpoint_sidecar_lease_held`` is left as it is (its series is the retirement's
        to remove: another id of the same name may hold its own lease)."""
        q = self._core.get(query_id)
        if q is None:
            return True
        if q.shell.renewing:
            return False
        q.shell.renewing = True  # no renewal starts while it is being released
        try:
            async with q.shell.lease:
                # Dropped with its record next; if the query stays instead (seen again
                # meanwhile), its next write acquires a new lease.
                await self._release_locked(q, "query retired (idle)", metric=False, anew=True)
        finally:
            q.shell.renewing = False
        return True

    async def _release(self, q: Record) -> None:
        async with q.shell.lease:
            await self._release_locked(q)

    async def _release_locked(
        self, q: Record, reason: str = "shutdown", *, metric: bool = True, anew: bool = False
    ) -> None:
        lease = q.lease
        if lease.state is LeaseState.HELD:
            try:
                await self._store.release_lease(q.query_id, self.lease_id)
            except SidecarError as exc:
                log.warning(
                    "lease query=%s release failed (it expires by itself): %s", lease.label, exc
                )
        released = lease.state is LeaseState.RELEASED
        self._tell(LeaseLetGo(q.query_id, reason, anew))
        if not released and metric:
            self._metrics.lease_held.labels(lease.label).set(0)
