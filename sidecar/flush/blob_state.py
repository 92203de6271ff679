"""Each query's blob state, owned in one place: the I/O shell around ``sidecar.flush.core``.

Who asks and tells it (nothing else keeps a copy, nothing else calls the core)::

    FlushOwner (the daemon's door, ``owner``) ─ floor / acks / rows / admin / retire ─▶ ┐
    flusher ─── held / plan / read / write / skipped / failed / ... ─────────────────▶ ├ BlobStates
                                                                                         │
                                                                    FlushCore + leases ◀┘

The decisions are the core's; this module performs the reads and writes they need (the blob,
the namespace's listing, the lease through ``sidecar.flush.lease_manager``), holds each
waiting ack's future and the per-query locks (kept on the query's record: the flush/admin
lock, the floor read's, the lease's), and wakes the flush loop when an ack starts waiting.

Every write names the version it replaces (``If-Match``): :meth:`BlobStates.write` takes the
:class:`~sidecar.flush.blob.Seen` it was planned from, so there is no way to write a blob whose
version is not known. A write the store refuses as another writer's is counted
(``checkpoint_sidecar_write_conflicts_total``), the blob is read again (and its writer logged),
and the caller plans again from what it holds: never below it.

The floor, read lazily: an update of a query Redis does not know is applied with the floor
its blob holds, read at most once per query and daemon run (concurrent first updates share
the read), and only for a query that has a blob. Which queries have one is known from one
listing of the namespace (no downloads), refreshed at most every :data:`LISTING_MAX_AGE_S`
when needed: a client inventing query ids costs one listing, not a read each. When the
floor alone refuses an update that Redis would take, the blob may have been rewound by
another owner (a reset through a standby's peer): the floor is read again, at most every
:data:`RECHECK_EVERY_S` per query (each time in ack_mode=blob, whose ack would otherwise be
answered from the blob as last read), and replaced by what the blob holds.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Protocol

import anyio

from sidecar.backoff import Backoff
from sidecar.buffer.lua import NO_BLOB
from sidecar.buffer.rows import PendingEntry, PendingQuery
from sidecar.errors import (
    CorruptRecord,
    LeaseLost,
    NotOwner,
    SidecarError,
    StoreUnavailable,
    VersionConflict,
)
from sidecar.flush.blob import Behind, Seen
from sidecar.flush.core import FlushCore, Plan
from sidecar.flush.events import (
    AckGone,
    AckWanted,
    Action,
    AdminOp,
    Answer,
    BlobRead,
    BlobWritten,
    Built,
    Checked,
    Do,
    Doubted,
    Event,
    Flushed,
    FlushFailed,
    FlushMarked,
    FlushStarted,
    HeldElsewhere,
    LeftPending,
    Listed,
    PassBegun,
    PassEnded,
    RecheckWanted,
    RedisSaid,
    Report,
    Retired,
    RetryIn,
    RowsApplied,
    RowsVoid,
    Skipped,
    SnapshotTaken,
    UseRow,
    WriteBegun,
    WriteNotSent,
    WriteRefused,
    WriteUnsure,
)
from sidecar.flush.events import NotOwner as AnswerNotOwner
from sidecar.flush.lease import Held, Ownership
from sidecar.flush.lease_manager import LeaseManager, LeaseStore
from sidecar.flush.shell import QueryShell
from sidecar.model.document import CheckpointDocument, SnapshotRef, Stored
from sidecar.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

#: A failed flush is retried after RETRY_BASE_S, doubling up to RETRY_CAP_S (jittered).
RETRY_BASE_S = 0.5
RETRY_CAP_S = 30.0
#: A listing older than this is read again before it says "no blob" (another daemon on the
#: namespace may have created one since).
LISTING_MAX_AGE_S = 60.0
#: A query's floor is read again, after a refusal by the floor alone, at most this often.
RECHECK_EVERY_S = 5.0


class Replan(Exception):
    """What the blob holds was seen to change between a write's plan and its start: nothing
    was sent; plan again."""


class Durability(enum.Enum):
    """How a blob-mode ack's wait ended."""

    DURABLE = "durable"
    TIMED_OUT = "timed out"
    NOT_OWNER = "not owner"


#: A waiting ack's future.
Waiter = asyncio.Future[Durability]


class BlobStore(LeaseStore, Protocol):
    """What this module reads and writes of the blob store (``sidecar.store.blobs``)."""

    async def read_stored(self, query_id: str) -> Stored: ...

    async def query_ids(self) -> set[str]: ...

    async def listed_versions(self) -> dict[str, str]: ...

    async def write(
        self, query_id: str, body: bytes, *, lease_id: str, query_name: str | None, version: str
    ) -> str: ...


class BlobStates:
    """Every query's blob state: ask it, tell it. One per daemon."""

    def __init__(
        self,
        store: BlobStore,
        lease_id: str,
        lease_duration_s: int,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
        backoff: Backoff | None = None,
    ) -> None:
        """``lease_id``: this process's (``sidecar.daemon.ownership``); ``clock``: monotonic
        seconds for the leases, retries and rechecks; ``jitter``: uniform in [0, 1)."""
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._core: FlushCore[Waiter, QueryShell] = FlushCore(
            backoff or Backoff(RETRY_BASE_S, RETRY_CAP_S, clock=clock, jitter=jitter),
            clock=clock,
            shell=QueryShell,
        )
        self.leases = LeaseManager(
            store,
            self._core,
            lease_id,
            lease_duration_s,
            metrics,
            clock=clock,
            jitter=jitter,
            tell=self._do,
        )
        #: Set when the flush loop should run a pass now (an ack started waiting, or one
        #: deferred during a pass still waits at its end); the loop clears it.
        self.wake = asyncio.Event()
        #: Ids with a blob as last listed; None: not listed yet.
        self._with_blob: set[str] | None = None
        self._listed_at = 0.0
        self._listing = anyio.Lock()
        metrics.resets_unrecorded.set_function(lambda: len(self.refused()))

    def __len__(self) -> int:
        """Queries with a record."""
        return len(self._core)

    def __contains__(self, query_id: object) -> bool:
        return query_id in self._core

    @property
    def lease_id(self) -> str:
        return self.leases.lease_id

    # --- the floor (ingest: ``sidecar.ingest.handler.Floors``) -----------------------------

    def known(self, query_id: str) -> int | None:
        """The query's floor (``NO_BLOB``: no blob), None while it is not known."""
        return self._core.floor(query_id)

    async def load(self, query_id: str) -> int:
        """The query's floor, read from its blob unless known.

        Raises:
            SidecarError: the blob store cannot be read now (``StoreUnavailable``: retry).
        """
        floor = self._core.floor(query_id)
        if floor is not None:
            return floor
        if not await self._may_have_blob(query_id):
            return NO_BLOB
        return await self._read_floor(query_id, again=False)

    async def recheck(self, query_id: str, *, always: bool = False) -> int | None:
        """The floor alone refused an update Redis would take: read the blob again and use
        what it holds (lower after a rewind elsewhere). None: read too recently to read again
        (unless ``always``: an ack waits on the answer, which must not come from a blob
        rewound since the last read).

        Raises:
            SidecarError: the blob store cannot be read now.
        """
        due = Do.READ in self._do(RecheckWanted(query_id, RECHECK_EVERY_S))
        if not (due or always):
            return None
        return await self._read_floor(query_id, again=True)

    async def _read_floor(self, query_id: str, *, again: bool) -> int:
        # Only a query the listing says has a blob gets here: it has a record from now.
        async with self._core.record(query_id).shell.floor:
            floor = self._core.floor(query_id)
            if floor is not None and not again:
                return floor  # read by whoever held the lock before us
            since, term = self._core.stamp, self._core.held_term(query_id)
            try:
                stored = await self._store.read_stored(query_id)
            except CorruptRecord as exc:
                # The flusher never overwrites an unreadable blob and reports it; updates
                # are stored in Redis meanwhile, as if there were no blob.
                log.warning("query=%s: no floor from an unreadable blob: %s", query_id, exc)
                return NO_BLOB
            floor = self._told_read(query_id, stored, since, term)
            if floor != NO_BLOB and self._with_blob is not None:
                self._with_blob.add(query_id)
            return floor

    async def _may_have_blob(self, query_id: str) -> bool:
        """False when the namespace's listing (fresh enough) has no blob of the query."""
        async with self._listing:  # one listing at a time, shared by every waiting update
            stale = self._clock() - self._listed_at > LISTING_MAX_AGE_S
            if self._with_blob is None or (stale and query_id not in self._with_blob):
                self._with_blob = await self._store.query_ids()
                self._listed_at = self._clock()
        # A lease held or wanted created the blob if absent: a listing made before must not
        # say "no blob" (a write of unknown outcome may have filled it).
        q = self._core.get(query_id)
        return query_id in self._with_blob or (q is not None and q.lease.term > 0)

    # --- blob-mode acks -------------------------------------------------------------------

    async def wait_durable(self, query_id: str, batch_id: int, timeout_s: float | None) -> bool:
        """True once the query's blob holds ``batch_id`` or a newer batch; False when
        ``timeout_s`` passed first. Starting to wait wakes the flush loop (unless the query is
        in a pass, or backing off).

        Raises:
            NotOwner: another daemon holds the query's lease (now, or once it turns out so
                while the ack waits): this daemon cannot make it durable.
        """
        loop = asyncio.get_running_loop()
        waiter: Waiter = loop.create_future()
        if Do.READ in self._do(AckWanted(query_id, batch_id, waiter)):
            # The batch was in the blob as last known: a read now says if it still is.
            try:
                await self.read(query_id)
            except SidecarError as exc:  # the flush's next read answers it, or the time
                log.debug("query=%s: the blob not read for an ack: %s", query_id, exc)
                self._do(Doubted(query_id))
        timer = (
            None
            if timeout_s is None
            else loop.call_later(timeout_s, _settle, waiter, Durability.TIMED_OUT)
        )
        try:
            outcome = await waiter
        finally:
            if timer is not None:
                timer.cancel()
            self._do(AckGone(query_id, waiter))
        if outcome is Durability.NOT_OWNER:
            raise self._not_owner(query_id, batch_id)
        return outcome is Durability.DURABLE

    def _not_owner(self, query_id: str, batch_id: int) -> NotOwner:
        q = self._core.get(query_id)
        label = (q.label if q is not None else "") or query_id
        holder = q.holder if q is not None else None
        return NotOwner(
            f"batch {batch_id} of query {label} is stored in Redis, but another daemon holds "
            f"the lease on its blob (last written by {holder or 'an unknown writer'}): this "
            "daemon cannot make it durable; resend to the daemon that owns the query, or again "
            "once ownership moves (see /readyz)"
        )

    def _do(self, event: Event[Waiter]) -> list[Action[Waiter]]:
        """Tell the core ``event`` and carry out what every caller does alike: settle the
        acks it answers, wake the flush loop. The actions, for the caller's own part."""
        actions = self._core.step(event)
        for action in actions:
            match action:
                case Answer(waiters):
                    for waiter in waiters:
                        _settle(waiter, Durability.DURABLE)
                case AnswerNotOwner(waiters):
                    for waiter in waiters:
                        _settle(waiter, Durability.NOT_OWNER)
                case Do.WAKE:
                    self.wake.set()
        return actions

    def _told_read(self, query_id: str, stored: Stored, since: int, term: int | None = None) -> int:
        """Tell the core a read of the blob; the floor to use after it."""
        self._do(BlobRead(query_id, stored, since, term))
        floor = self._core.floor(query_id)
        if floor is not None:
            return floor
        return NO_BLOB if stored.batch_id is None else stored.batch_id

    # --- the rows applies return (``sidecar.ingest.coalescer.RowSink``, blob ack mode) --------

    def stamp(self) -> int:
        """Take it before a Redis read: what the read returns is judged against it."""
        return self._core.stamp

    def applied(self, rows: list[PendingQuery], since: int) -> None:
        self._do(RowsApplied(tuple(rows), since))

    def void(self, query_ids: list[str]) -> None:
        self._do(RowsVoid(tuple(query_ids)))

    def take_row(self, query_id: str) -> tuple[PendingQuery, int] | None:
        """The row the last apply returned, for a flush an ack waits on (no Redis read for
        it); None otherwise."""
        for action in self._do(FlushStarted(query_id)):
            if isinstance(action, UseRow):
                return action.row, action.since
        return None

    def checked(self, entries: list[PendingEntry], since: int, now_ms: int) -> None:
        """A flush check listed ``entries`` (its read begun at stamp ``since``): which are
        pending, and Redis' flushed batch of each, in one event."""
        self._do(Checked(tuple(entries), since, now_ms))

    # --- what the flusher asks and tells ---------------------------------------------------

    def label(self, query_id: str) -> str | None:
        """The query's name as a Redis row told it; None while not told."""
        return self._core.label(query_id)

    def seen(self, query_id: str, label: str) -> None:
        """A Redis row of the query was read: it has a record from now, named ``label``."""
        self._core.record(query_id, label)

    def waiting(self) -> list[str]:
        """The queries acks wait on."""
        return self._core.waiting()

    def ready(self, query_id: str) -> bool:
        """Whether the query may be flushed now (not backing off after a failure)."""
        return self._core.ready(query_id)

    def marker_due(self, query_id: str, older_than_s: float) -> bool:
        """Whether the query's document is written again to name its newest snapshot."""
        return self._core.marker_due(query_id, older_than_s)

    def markers_due(self, older_than_s: float) -> list[str]:
        """The queries whose document is written again to name their newest snapshot."""
        return self._core.markers_due(older_than_s)

    def due(self, query_id: str) -> bool:
        """Due whatever the thresholds: an ack waits on it, or a previous run left it."""
        return self._core.due(query_id)

    def recovering(self, query_ids: set[str]) -> None:
        """What a previous run left pending: due until flushed."""
        self._do(LeftPending(frozenset(query_ids)))

    def busy(self, query_id: str) -> bool:
        """Updates pending in Redis at the last check, an ack waits on the query, or it is in
        a flush pass: not to be retired now."""
        q = self._core.get(query_id)
        return q is not None and (q.pending or q.acks_wait or self._core.in_flight(query_id))

    def in_flight(self, query_id: str) -> bool:
        return self._core.in_flight(query_id)

    def begin(self, query_ids: list[str]) -> None:
        """The queries enter a pass of the flush loop."""
        for query_id in query_ids:
            self._do(PassBegun(query_id))

    def end(self, query_id: str) -> None:
        """The pass is done with the query; an ack deferred meanwhile wakes the loop."""
        self._do(PassEnded(query_id))

    def current(self, query_id: str, since: int) -> bool:
        """Whether a Redis row of the query read at stamp ``since`` may still be flushed."""
        return self._core.current(query_id, since)

    def flushed_in_redis(
        self,
        query_id: str,
        batch_id: int | None,
        resets: int,
        since: int,
        recorded_reset: str | None = None,
        *,
        judge: bool = False,
    ) -> None:
        """Redis' flushed batch of the query, its reset count and the reset record of the
        document that batch is in, read at stamp ``since``; ``judge``: read by a flush right
        after its read of the blob (the event ``RedisSaid``)."""
        told = RedisSaid(query_id, batch_id, resets, since, recorded_reset, judge)
        for action in self._do(told):
            if isinstance(action, Report):  # only a judging read finds the blob behind
                self._report(query_id, action.behind)

    def _report(self, query_id: str, behind: Behind) -> None:
        """Say, once per finding, that the query's blob was found below Redis
        (``sidecar.flush.blob.Behind``): what happened, in an operator's words, and what
        follows."""
        label = self._core.label(query_id) or query_id
        if behind.reset is None:
            self._metrics.store_lost_writes.inc()
            log.error(
                "query=%s: the blob store lost writes: the blob held batch %s, Redis had "
                "flushed %s (no reset since); rewriting it with the newest acknowledged batch",
                label,
                _batch(behind.held),
                _batch(behind.flushed),
                extra={"query_id": query_id},
            )
            return
        doc = behind.reset
        log.error(
            "query=%s: the blob holds a reset that this daemon's Redis never recorded (to batch "
            "%s from %s, at %s, by %s): another daemon on this namespace with its own Redis? "
            "Nothing is written over it; Redis keeps batch %s and later. Stop the other daemon, "
            "then run 'checkpoint-sidecar reset' here to the position wanted",
            label,
            _batch(behind.held),
            _batch(doc.reset_from),
            doc.reset_at,
            _writer_of(doc),
            _batch(behind.flushed),
            extra={"query_id": query_id},
        )

    def behind(self, query_id: str, batch_id: int) -> bool:
        """Whether the blob is known to hold a batch below ``batch_id`` (a row with nothing
        pending is still owed a write then: the store went back)."""
        floor = self._core.floor(query_id)
        return floor is not None and floor < batch_id

    def refused(self) -> dict[str, str]:
        """By query label, the reset each refused blob holds (``/readyz``)."""
        out = {}
        for q in self._core:
            if q.behind is not None and q.behind.reset is not None:
                doc = q.behind.reset
                out[q.label or q.query_id] = (
                    f"reset to batch {_batch(q.behind.held)} at {doc.reset_at} by {_writer_of(doc)}"
                )
        return out

    def unverified(self) -> list[str]:
        """The queries whose blob must be read and compared with Redis now."""
        return self._core.unverified()

    async def audit(self, recorded: dict[str, tuple[int, str]]) -> list[str]:
        """Hold the store's listing against ``recorded``: Redis' flushed batch and the blob's
        version that flush left, by query. A blob missing, or at another version than that
        flush left and not seen here at it holding that flush's batch or newer (a store that
        went back or was restored, a blob deleted; a blob only read here, never compared with
        Redis, proves nothing), is unverified: read and compared with Redis at the next flush
        check, even with nothing pending. Returns those queries.

        Raises:
            SidecarError: the store cannot be listed now.
        """
        listed = await self._store.listed_versions()
        odd = []
        for query_id, (flushed, version) in recorded.items():
            now = listed.get(query_id)
            if now != version and not self._core.seen_at(query_id, now, flushed):
                self._do(Listed(query_id, now))
                odd.append(query_id)
        return odd

    async def held(self, query_id: str, label: str) -> Held | None:
        """The query's lease when HELD (acquired if due), else None: do not write. Held by
        another daemon: its waiting acks are answered ``not_owner``, and who last wrote the
        blob is shown (``/readyz``, ``checkpoint_sidecar_lease_held_elsewhere``)."""
        held = await self.leases.ensure_held(query_id, label)
        if held is not None:
            self._owned(query_id)
        elif self.leases.held_elsewhere(query_id):
            await self._learn_holder(query_id, label)
        return held

    def _owned(self, query_id: str) -> None:
        q = self._core.get(query_id)
        if q is not None and q.shell.elsewhere is not None:
            self._metrics.lease_elsewhere.remove(*q.shell.elsewhere)
            q.shell.elsewhere = None

    async def _learn_holder(self, query_id: str, label: str) -> None:
        """Who last wrote the blob, read once per query while another holds its lease."""
        q = self._core.record(query_id)
        if q.shell.elsewhere is not None:
            return
        since = self._core.stamp
        try:
            stored = await self._store.read_stored(query_id)
        except Exception as exc:
            log.debug("query=%s: the blob's writer not read: %s", query_id, exc)
            return
        self._told_read(query_id, stored, since)
        holder = _writer_of(stored.document)
        self._do(HeldElsewhere(query_id, holder))
        if self._core.get(query_id) is not q:
            return  # retired while the blob was read
        q.shell.elsewhere = (label, holder)
        self._metrics.lease_elsewhere.labels(label, holder).set(1)
        log.warning(
            "query=%s: another daemon holds the lease on its blob (last written by %s at batch "
            "%s): this daemon buffers its updates in Redis and writes nothing until it is free",
            label,
            holder,
            stored.batch_id,
        )

    def holders(self) -> dict[str, str]:
        """By query label, who last wrote the blob of each query whose lease another daemon
        holds (for ``/readyz``)."""
        return dict(q.shell.elsewhere for q in self._core if q.shell.elsewhere is not None)

    def plan(self, query_id: str, batch_id: int) -> Plan:
        """What to do with a due row of ``batch_id`` (read the blob first, skip, write)."""
        return self._core.plan(query_id, batch_id)

    async def read(self, query_id: str) -> Stored:
        """Read what the query's blob holds now (the flush's READ step, or after a conflict).

        Raises:
            CorruptRecord: the blob is not a checkpoint document of the query.
            SidecarError: the store cannot be read now.
        """
        since, term = self._core.stamp, self._core.held_term(query_id)
        stored = await self._store.read_stored(query_id)
        self._told_read(query_id, stored, since, term)
        return stored

    async def stored(self, query_id: str) -> Seen:
        """What the query's blob holds, read unless seen (an admin op, under the lease and
        :meth:`exclusive`).

        Raises:
            CorruptRecord, SidecarError: as :meth:`read`.
        """
        for _ in range(2):
            plan = self._core.plan(query_id, NO_BLOB)  # SKIP when seen
            if plan.base is not None and plan.base.stored.version is not None:
                return plan.base  # (seen absent: the lease has created it since; read it)
            await self.read(query_id)
        raise VersionConflict(f"query {query_id}: its blob changed while it was read")

    # --- snapshots (``sidecar.snapshot``) -------------------------------------------------

    def snapshot_taken(self, query_id: str, ref: SnapshotRef) -> None:
        """A snapshot of the query was written: its next document names it."""
        self._do(SnapshotTaken(query_id, ref))

    def snapshot_of(self, query_id: str) -> SnapshotRef | None:
        """The newest snapshot of the query known here (the next document names it)."""
        return self._core.snapshot_of(query_id)

    def snapshot_marker(self, query_id: str) -> tuple[bool, SnapshotRef | None]:
        """The snapshot the query's document names (its marker: always kept), and whether
        that is known (seen under the lease held now; else the blob is read soon)."""
        known, marker = self._core.snapshot_marker(query_id)
        if not known and query_id in self._core:
            self._do(Doubted(query_id))  # read at the next flush check
        return known, marker

    async def owner_check(self, query_id: str, label: str) -> Ownership | None:
        """None unless this daemon holds the query's lease (acquired if due); else a check,
        to make right before a write that must be the owner's, that it still does, with the
        term it holds."""
        held = await self.held(query_id, label)
        if held is None:
            return None
        return Ownership(held.term, lambda: self.leases.holds(held))

    def note_thinned(self, query_id: str, thinned: bool) -> bool:
        """Whether a document's history was thinned; True the first time in a row."""
        return Do.LOG_THINNED in self._do(Built(query_id, thinned))

    async def write(
        self, query_id: str, lease: Held, base: Seen, doc: CheckpointDocument, body: bytes
    ) -> Stored | None:
        """Write ``doc`` (encoded: ``body``) over ``base`` under ``lease``: the store refuses it
        unless the lease holds the blob and it is still at ``base``'s version. What the blob
        holds now; None when the lease was lost before it could be sent (nothing sent).

        Raises:
            Replan: the blob was seen to change since ``base`` (a read meanwhile): nothing
                sent; plan again.
            VersionConflict: another writer changed the blob: it was read again (what it
                holds is known now; plan again from it).
            StoreUnavailable: the outcome is unknown (read before the next write).
            SidecarError: refused (``LeaseLost``: the lease is lost too); nothing written.
        """
        if not self.leases.holds(lease):
            return None  # lost (and maybe taken again) since the plan: the next pass starts over
        if Do.SEND not in self._do(WriteBegun(query_id, base)):  # no await since holds()
            raise Replan(f"query {query_id}: its blob was seen changed since the plan")
        assert base.stored.version is not None  # a plan never writes a blob seen absent
        try:
            version = await self._store.write(
                query_id,
                body,
                lease_id=self.leases.lease_id,
                query_name=doc.name,
                version=base.stored.version,
            )
        except VersionConflict:
            self._do(WriteRefused(query_id))
            await self._conflict(query_id, "checkpoint", doc.batch_id)
            raise
        except (StoreUnavailable, anyio.get_cancelled_exc_class()):
            self._do(WriteUnsure(query_id))  # it may have landed
            raise
        except LeaseLost:
            self._do(WriteRefused(query_id))  # not written; another owner may write now
            raise
        except BaseException:
            self._do(WriteNotSent(query_id))
            raise
        stored = Stored(version, doc)
        self._do(BlobWritten(query_id, stored))
        return stored

    async def _conflict(self, query_id: str, what: str, batch_id: int) -> None:
        """A conditional write was refused: count it, read the blob again and say who wrote it."""
        self._metrics.write_conflicts.labels(what).inc()
        try:
            stored = await self.read(query_id)
        except Exception as exc:
            log.warning(
                "query=%s: %s of batch %d refused, the blob changed since it was read; reading it "
                "again failed: %s",
                query_id,
                what,
                batch_id,
                exc,
            )
            return
        log.warning(
            "query=%s: %s of batch %d refused: the blob changed since it was read (now batch %s, "
            "written by %s); nothing overwritten, never written below what it holds",
            self._core.label(query_id) or query_id,
            what,
            batch_id,
            stored.batch_id,
            _writer_of(stored.document),
        )

    def marked(self, query_id: str) -> None:
        """Redis recorded the flush (``mark_flushed``): its flushed batch is the blob's again."""
        self._do(FlushMarked(query_id))

    def skipped(self, query_id: str) -> None:
        """The blob already held the row's batch (or newer): acks answered."""
        self._do(Skipped(query_id))

    def flushed(self, query_id: str) -> None:
        """The flush is complete: its retry schedule starts over."""
        self._do(Flushed(query_id))

    def failed(
        self, query_id: str, *, retriable: bool, retry_after_s: float | None = None
    ) -> float:
        """A flush failed: seconds until its next try."""
        for action in self._do(FlushFailed(query_id, retriable, retry_after_s)):
            if isinstance(action, RetryIn):
                return action.delay_s
        raise AssertionError("a failed flush is always given its next try")

    def failures(self, query_id: str) -> int:
        return self._core.failures(query_id)

    def lost(self, query_id: str, reason: str) -> None:
        """The store refused the lease on a write: stop writing until it is re-acquired."""
        self.leases.lost(query_id, reason)

    @asynccontextmanager
    async def flushing(self, query_id: str) -> AsyncIterator[None]:
        """Hold the query for a flush: no admin op of it runs meanwhile."""
        async with self._core.record(query_id).shell.flush:
            yield

    # --- admin ops -------------------------------------------------------------------------

    @asynccontextmanager
    async def exclusive(self, query_id: str) -> AsyncIterator[None]:
        """Hold the query for an admin op: no flush of it runs inside, and none of a Redis
        row read before it ends runs after (a row read while the op was under way, before it
        wrote Redis, is as stale as one read before it began)."""
        async with self._core.record(query_id).shell.flush:
            self._do(AdminOp(query_id))
            try:
                yield
            finally:
                self._do(AdminOp(query_id))

    def begin_write(self, query_id: str, lease: Held, base: Seen) -> bool:
        """An admin op's write over ``base`` is about to be sent under ``lease``: False (and
        nothing begun) when the lease was lost, or the blob seen to change, since it was read."""
        return self.leases.holds(lease) and Do.SEND in self._do(WriteBegun(query_id, base))

    def reset(self, query_id: str, stored: Stored) -> None:
        """A reset's write landed: the floor and acks follow it down."""
        self._do(BlobWritten(query_id, stored, reset=True))

    def archived(self, query_id: str) -> None:
        """An admin op moved the blob away (retire --archive): there is none now."""
        self._do(BlobWritten(query_id, Stored(None, None)))

    async def write_refused(self, query_id: str, what: str, batch_id: int) -> None:
        """An admin op's write was refused as another writer's (read again, counted)."""
        self._do(WriteRefused(query_id))
        await self._conflict(query_id, what, batch_id)

    def unknown(self, query_id: str, *, lowered_to: int | None = None) -> None:
        """An admin op's write has an unknown outcome (a reset's may have lowered the blob to
        ``lowered_to``): read the blob again before the next write."""
        self._do(WriteUnsure(query_id, lowered_to))

    def not_sent(self, query_id: str) -> None:
        """An admin op's write was refused before it ran (nothing written)."""
        self._do(WriteNotSent(query_id))

    # --- retirement --------------------------------------------------------------------------

    async def release(self, query_id: str) -> bool:
        """Release the query's lease (retiring it); False when a renewal is under way."""
        return await self.leases.retire(query_id)

    def forget(self, query_id: str) -> None:
        """Drop everything known of the query (retired): its record, with its lease, row,
        acks and retries, in one removal; read again if it returns (its blob stays: a
        listing made before this daemon created it must not say "no blob" then)."""
        q = self._core.get(query_id)
        had_blob = q is not None and (q.lease.term > 0 or q.floor not in (None, NO_BLOB))
        if had_blob and self._with_blob is not None:
            self._with_blob.add(query_id)
        self._owned(query_id)  # its series too
        self._do(Retired(query_id))


def _writer_of(doc: CheckpointDocument | None) -> str:
    """Who wrote a document, for logs and the owner's metric."""
    if doc is None:
        return "nobody (empty blob)"
    return f"{doc.writer.host} pid {doc.writer.pid}"


def _batch(batch_id: int | None) -> str:
    """A batch id as an operator reads it: grouped thousands; 'none' for no document."""
    return "none" if batch_id is None or batch_id == NO_BLOB else f"{batch_id:,}"


def _settle(waiter: Waiter, outcome: Durability) -> None:
    if not waiter.done():
        waiter.set_result(outcome)
