"""Each query's blob state, owned in one place: the I/O shell around ``sidecar.flush.core``.

Who asks and who tells (nothing else keeps a copy)::

    ingest (handler) ── known / load / recheck ──▶ the floor: no update older than the blob
                     ── wait_durable ───────────▶ blob-mode acks
    flusher ─────────── held / document / written / skipped / failed / lost ─▶ ┐
    admin ops ───────── exclusive / held / document / reset ───────────────▶ ├ BlobStates
    retirement ──────── release (the lease), forget (everything else) ──────▶ ┘   │
                                                                               FlushCore
                                                                        (pure decisions)

The decisions are the core's; this module performs the reads they need (the blob, the
namespace's listing, the lease through ``sidecar.flush.lease``), holds each waiting ack's
future and the per-query lock that keeps a flush and an admin op apart, and wakes the
flush loop when an ack starts waiting.

The floor, read lazily: an update of a query Redis does not know is applied with the floor
its blob holds, read at most once per query and daemon run (concurrent first updates share
the read), and only for a query that has a blob. Which queries have one is known from one
listing of the namespace (no downloads), refreshed at most every :data:`LISTING_MAX_AGE_S`
when needed: a client inventing query ids costs one listing, not a read each. When the
floor alone refuses an update that Redis would take, the blob may have been rewound by
another owner (a reset through a standby's peer): the floor is read again, at most every
:data:`RECHECK_EVERY_S` per query, and replaced by what the blob holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Protocol

import anyio

from sidecar.backoff import Backoff
from sidecar.buffer.lua import NO_BLOB
from sidecar.errors import CorruptRecord
from sidecar.flush.core import Ack, FlushCore
from sidecar.flush.lease import Held, LeaseManager
from sidecar.model.document import CheckpointDocument

log = logging.getLogger(__name__)

#: A failed flush is retried after RETRY_BASE_S, doubling up to RETRY_CAP_S (jittered).
RETRY_BASE_S = 0.5
RETRY_CAP_S = 30.0
#: A listing older than this is read again before it says "no blob" (another daemon on the
#: namespace may have created one since).
LISTING_MAX_AGE_S = 60.0
#: A query's floor is read again, after a refusal by the floor alone, at most this often.
RECHECK_EVERY_S = 5.0

#: A waiting ack's future: True once its batch is in the blob, False when its time ran out.
Waiter = asyncio.Future[bool]


class BlobReads(Protocol):
    """What this module reads of the blob store (``sidecar.store.blobs.BlobStore``)."""

    async def read(self, query_id: str) -> CheckpointDocument | None: ...

    async def query_ids(self) -> set[str]: ...


class BlobStates:
    """Every query's blob state: ask it, tell it. One per daemon."""

    def __init__(
        self,
        store: BlobReads,
        leases: LeaseManager,
        *,
        clock: Callable[[], float] = time.monotonic,
        backoff: Backoff | None = None,
    ) -> None:
        self._store = store
        self.leases = leases
        self._clock = clock
        self.core: FlushCore[Waiter] = FlushCore(backoff or Backoff(RETRY_BASE_S, RETRY_CAP_S))
        #: Set when the flush loop should run a pass now (an ack started waiting, or one
        #: deferred during a pass still waits at its end); the loop clears it.
        self.wake = asyncio.Event()
        #: Per query: held by each flush and by each admin op (never both at once).
        self._locks: dict[str, anyio.Lock] = {}
        #: One blob read per query at a time for the floor; concurrent updates share it.
        self._reading: dict[str, anyio.Lock] = {}
        #: Ids with a blob as last listed, and when (monotonic); None: not listed yet.
        self._with_blob: set[str] | None = None
        #: Queries whose blob this daemon's lease acquisition created (or found).
        self._leased: set[str] = set()
        self._listed_at = 0.0
        self._listing = anyio.Lock()

    # --- the floor (ingest: ``sidecar.ingest.handler.Floors``) -----------------------------

    def known(self, query_id: str) -> int | None:
        """The query's floor (``NO_BLOB``: no blob), None while it was not read."""
        return self.core.floor(query_id)

    async def load(self, query_id: str) -> int:
        """The query's floor, read from its blob unless known.

        Raises:
            SidecarError: the blob store cannot be read now (``StoreUnavailable``: retry).
        """
        floor = self.core.floor(query_id)
        if floor is not None:
            return floor
        if not await self._may_have_blob(query_id):
            return NO_BLOB
        return await self._read_floor(query_id, exact=False)

    async def recheck(self, query_id: str) -> int | None:
        """The floor alone refused an update Redis would take: read the blob again and use
        what it holds (lower after a rewind elsewhere). None: read too recently to read again.

        Raises:
            SidecarError: the blob store cannot be read now.
        """
        q = self.core.get(query_id)
        now = self._clock()
        if q is not None:
            if now - q.rechecked_at < RECHECK_EVERY_S:
                return None
            q.rechecked_at = now
        return await self._read_floor(query_id, exact=True)

    async def _read_floor(self, query_id: str, *, exact: bool) -> int:
        lock = self._reading.setdefault(query_id, anyio.Lock())
        try:
            async with lock:
                floor = self.core.floor(query_id)
                if floor is not None and not exact:
                    return floor  # read by whoever held the lock before us
                since = self.core.stamp
                try:
                    doc = await self._store.read(query_id)
                except CorruptRecord as exc:
                    # The flusher never overwrites an unreadable blob and reports it; updates
                    # are stored in Redis meanwhile, as if there were no blob.
                    log.warning("query=%s: no floor from an unreadable blob: %s", query_id, exc)
                    doc = None
                batch = doc.batch_id if doc is not None else NO_BLOB
                floor, answered = self.core.floor_read(query_id, batch, since, exact=exact)
                self._answer(answered)
                if floor != NO_BLOB and self._with_blob is not None:
                    self._with_blob.add(query_id)
                return floor
        finally:
            if not lock.statistics().tasks_waiting:
                self._reading.pop(query_id, None)

    async def _may_have_blob(self, query_id: str) -> bool:
        """False when the namespace's listing (fresh enough) has no blob of the query."""
        async with self._listing:  # one listing at a time, shared by every waiting update
            stale = self._clock() - self._listed_at > LISTING_MAX_AGE_S
            if self._with_blob is None or (stale and query_id not in self._with_blob):
                self._with_blob = await self._store.query_ids()
                self._listed_at = self._clock()
        return query_id in self._with_blob or query_id in self._leased

    # --- blob-mode acks -------------------------------------------------------------------

    async def wait_durable(self, query_id: str, batch_id: int, timeout_s: float | None) -> bool:
        """True once the query's blob holds ``batch_id`` or a newer batch; False when
        ``timeout_s`` passed first. Starting to wait wakes the flush loop (unless the query is
        in a pass, or backing off)."""
        loop = asyncio.get_running_loop()
        waiter: Waiter = loop.create_future()
        match self.core.ack(query_id, batch_id, waiter):
            case Ack.DURABLE:
                return True
            case Ack.WAKE:
                self.wake.set()
        timer = None if timeout_s is None else loop.call_later(timeout_s, _settle, waiter, False)
        try:
            return await waiter
        finally:
            if timer is not None:
                timer.cancel()
            self.core.ack_gone(query_id, waiter)

    def _answer(self, waiters: list[Waiter]) -> None:
        for waiter in waiters:
            _settle(waiter, True)

    # --- what the flusher asks and tells ---------------------------------------------------

    def waiting(self) -> list[str]:
        """The queries acks wait on."""
        return self.core.waiting()

    def ready(self, query_id: str) -> bool:
        """Whether the query may be flushed now (not backing off after a failure)."""
        return self.core.backoff.ready(query_id)

    def busy(self, query_id: str) -> bool:
        """An ack waits on the query, or it is in a flush pass: not to be retired now."""
        q = self.core.get(query_id)
        return q is not None and (bool(q.waiters) or q.in_flight)

    def begin(self, query_ids: list[str]) -> None:
        """The queries enter a pass of the flush loop."""
        for query_id in query_ids:
            self.core.begin(query_id)

    def end(self, query_id: str) -> None:
        """The pass is done with the query; an ack deferred meanwhile wakes the loop."""
        if self.core.end(query_id):
            self.wake.set()

    def flushed_in_redis(self, query_id: str, batch_id: int, since: int) -> None:
        """Redis' flushed batch of the query, read at stamp ``since``."""
        self._answer(self.core.flushed_in_redis(query_id, batch_id, since))

    async def held(self, query_id: str, label: str) -> Held | None:
        """The query's lease when HELD (acquired if due), else None: do not write."""
        held = await self.leases.ensure_held(query_id, label)
        if held is not None:
            # Acquiring created the blob if absent: a listing made before (or under way) must
            # not say "no blob" any more (a write of unknown outcome may have filled it).
            self._leased.add(query_id)
        return held

    async def document(self, query_id: str, lease: Held) -> CheckpointDocument | None:
        """What the query's blob holds, read under ``lease`` unless known for its term.

        Raises:
            CorruptRecord: the blob is not a checkpoint document of the query.
            SidecarError: the store cannot be read now.
        """
        q = self.core.get(query_id)
        if q is None or q.term != lease.term or q.floor is None:
            doc = await self._store.read(query_id)
            self._answer(self.core.read(query_id, lease.term, doc))
            return doc
        return q.document

    def written(self, query_id: str, lease: Held, doc: CheckpointDocument) -> None:
        """``doc`` is in the blob: acks waiting for it or older are answered now."""
        self._answer(self.core.written(query_id, lease.term, doc))

    def skipped(self, query_id: str) -> None:
        """The blob already held the row's batch (or newer) under the lease: acks answered."""
        self._answer(self.core.skipped(query_id))

    def failed(
        self,
        query_id: str,
        *,
        retriable: bool,
        outcome_unknown: bool,
        retry_after_s: float | None = None,
    ) -> float:
        """A flush failed: seconds until its next try."""
        return self.core.failed(
            query_id,
            retriable=retriable,
            outcome_unknown=outcome_unknown,
            retry_after_s=retry_after_s,
        )

    def lost(self, query_id: str, reason: str) -> None:
        """The store refused the lease on a write: stop writing until it is re-acquired."""
        self.core.unknown(query_id)
        self.leases.lost(query_id, reason)

    def unknown(self, query_id: str, *, lowered_to: int | None = None) -> None:
        """A write's outcome is unknown (a reset's: it may have lowered the blob to
        ``lowered_to``): read the blob again before the next one."""
        self.core.unknown(query_id, lowered_to=lowered_to)

    @asynccontextmanager
    async def flushing(self, query_id: str) -> AsyncIterator[None]:
        """Hold the query for a flush: no admin op of it runs meanwhile."""
        async with self._lock(query_id):
            yield

    # --- admin ops -------------------------------------------------------------------------

    @asynccontextmanager
    async def exclusive(self, query_id: str) -> AsyncIterator[None]:
        """Hold the query for an admin op: no flush of it runs inside, and none of a Redis
        row read before it ends runs after (a row read while the op was under way, before it
        wrote Redis, is as stale as one read before it began)."""
        async with self._lock(query_id):
            self.core.admin_op(query_id)
            try:
                yield
            finally:
                self.core.admin_op(query_id)

    def reset(self, query_id: str, lease: Held, doc: CheckpointDocument) -> None:
        """A reset wrote ``doc`` under ``lease``: floor and acks follow it down."""
        self._answer(self.core.reset(query_id, lease.term, doc))

    # --- retirement --------------------------------------------------------------------------

    async def release(self, query_id: str) -> bool:
        """Release the query's lease (retiring it); False when a renewal is under way."""
        return await self.leases.retire(query_id)

    def forget(self, query_id: str) -> None:
        """Drop everything known of the query's blob (retired); read again if it returns."""
        self.core.forget(query_id)
        self._leased.discard(query_id)

    @asynccontextmanager
    async def _lock(self, query_id: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(query_id, anyio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.statistics().tasks_waiting and not lock.locked():
                self._locks.pop(query_id, None)


def _settle(waiter: Waiter, durable: bool) -> None:
    if not waiter.done():
        waiter.set_result(durable)
