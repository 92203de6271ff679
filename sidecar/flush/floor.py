"""The blob as the floor: no update older than a query's blob is ever stored or returned.

Redis alone keeps a query's batch monotonic only while it remembers the query. Once it lost
its data (``FLUSHALL``, a restart without AOF, an older RDB file), an update older than the
blob would be applied and ``get`` would go backwards. So every update carries its query's
floor, the batch id the blob holds, into the apply script (``sidecar.buffer.lua``), which refuses
anything not newer::

    update ─▶ floor known? ─yes─▶ apply(floor) ─▶ applied / stale
                  │ no
                  ▼
              apply("?") ─▶ Redis knows the query ─▶ applied / stale (Redis' batch decides)
                  │ Redis does not
                  ▼ NEEDS_FLOOR (nothing written)
              read the blob (once per query, shared by concurrent updates) ─▶ apply(floor)

A floor is read from the blob at most once per query and daemon run, and only for a query
Redis does not know, so a daemon restarted during a blob-store outage keeps acknowledging
the queries Redis holds; an unknown query's update meanwhile answers ``unavailable`` (the
client resends). The flusher raises the floor after every read or write of the blob.

Which queries have a blob at all is known from one listing of the namespace's blob names
(no downloads), refreshed at most every :data:`LISTING_MAX_AGE_S` when needed: a new query
costs no blob read, and a client inventing query ids costs one listing, not one read each.
Only floors of queries that have a blob are kept.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio

from sidecar.buffer.redis_buffer import NO_BLOB
from sidecar.errors import CorruptRecord

log = logging.getLogger(__name__)

#: The batch id a query's blob holds, None when it has no blob.
ReadBlobBatch = Callable[[str], Awaitable[int | None]]
#: The ids of the queries that have a blob.
ListBlobs = Callable[[], Awaitable[set[str]]]

#: A listing older than this is read again before it says "no blob" (another daemon on the
#: namespace may have created one since).
LISTING_MAX_AGE_S = 60.0


class BlobFloors:
    """The batch id each query's blob holds, as far as this daemon knows."""

    def __init__(
        self,
        read: ReadBlobBatch,
        list_blobs: ListBlobs | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._list = list_blobs
        self._clock = clock
        self._floors: dict[str, int] = {}
        #: Bumped by every reset and retirement: a blob read begun before one is not kept
        #: (it could raise a reset floor back), only returned.
        self._epoch = 0
        #: One blob read per query at a time; concurrent first updates share it.
        self._reading: dict[str, anyio.Lock] = {}
        #: Ids with a blob as last listed, and when (monotonic); None: not listed yet.
        self._with_blob: set[str] | None = None
        self._listed_at = 0.0
        self._listing = anyio.Lock()

    def __len__(self) -> int:
        return len(self._floors)

    def known(self, query_id: str) -> int | None:
        """The query's floor (``NO_BLOB``: no blob), None while it was not read."""
        return self._floors.get(query_id)

    async def load(self, query_id: str) -> int:
        """The query's floor, read from its blob unless known.

        Raises:
            SidecarError: the blob store cannot be read now (``BlobUnavailable``: retry).
        """
        floor = self._floors.get(query_id)
        if floor is not None:
            return floor
        if not await self._may_have_blob(query_id):
            return NO_BLOB
        lock = self._reading.setdefault(query_id, anyio.Lock())
        try:
            async with lock:
                floor = self._floors.get(query_id)
                if floor is None:
                    epoch = self._epoch
                    floor = await self._read_floor(query_id)
                    if self._epoch != epoch:  # a reset or retirement meanwhile
                        return self._floors.get(query_id, floor)
                    self.raise_to(query_id, floor)
        finally:
            if not lock.statistics().tasks_waiting:
                self._reading.pop(query_id, None)
        return floor

    async def _may_have_blob(self, query_id: str) -> bool:
        """False when the namespace's listing (fresh enough) has no blob of the query."""
        if self._list is None:
            return True
        async with self._listing:  # one listing at a time, shared by every waiting update
            stale = self._clock() - self._listed_at > LISTING_MAX_AGE_S
            if self._with_blob is None or (stale and query_id not in self._with_blob):
                self._with_blob = await self._list()
                self._listed_at = self._clock()
        return query_id in self._with_blob

    async def _read_floor(self, query_id: str) -> int:
        try:
            batch_id = await self._read(query_id)
        except CorruptRecord as exc:
            # The flusher never overwrites an unreadable blob and reports it; updates are
            # stored in Redis meanwhile, as if there were no blob.
            log.warning("query=%s: no floor from an unreadable blob: %s", query_id, exc)
            return NO_BLOB
        return NO_BLOB if batch_id is None else batch_id

    def raise_to(self, query_id: str, batch_id: int) -> None:
        """The blob now holds ``batch_id`` (read or written by the flusher); NO_BLOB keeps
        nothing (a query without a blob has no floor)."""
        if batch_id > self._floors.get(query_id, NO_BLOB):
            self._floors[query_id] = batch_id
            if self._with_blob is not None:
                self._with_blob.add(query_id)

    def reset_to(self, query_id: str, batch_id: int) -> None:
        """The blob now holds ``batch_id`` after a reset (``sidecar.ops.admin_steps``): the floor is
        set to it, lower or not, so batches above it are stored again."""
        self._floors[query_id] = batch_id
        self._epoch += 1
        if self._with_blob is not None:
            self._with_blob.add(query_id)

    def forget(self, query_id: str) -> None:
        """Drop what is known of the query (retired): the next update reads the blob again."""
        self._floors.pop(query_id, None)
        self._epoch += 1
