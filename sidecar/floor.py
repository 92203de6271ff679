"""The blob as the floor: no update older than a query's blob is ever stored or returned.

Redis alone keeps a query's batch monotonic only while it remembers the query. Once it lost
its data (``FLUSHALL``, a restart without AOF, an older RDB file), an update older than the
blob would be applied and ``get`` would go backwards. So every update carries its query's
floor, the batch id the blob holds, into the apply script (``sidecar.lua``), which refuses
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
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio

from sidecar.errors import CorruptRecord

log = logging.getLogger(__name__)

#: The batch id a query's blob holds, None when it has no blob.
ReadBlobBatch = Callable[[str], Awaitable[int | None]]

NO_BLOB = -1


class BlobFloors:
    """The batch id each query's blob holds, as far as this daemon knows."""

    def __init__(self, read: ReadBlobBatch) -> None:
        self._read = read
        self._floors: dict[str, int] = {}
        #: One blob read per query at a time; concurrent first updates share it.
        self._reading: dict[str, anyio.Lock] = {}

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
        lock = self._reading.setdefault(query_id, anyio.Lock())
        try:
            async with lock:
                floor = self._floors.get(query_id)
                if floor is None:
                    floor = await self._read_floor(query_id)
                    self.raise_to(query_id, floor)
                    floor = self._floors[query_id]
        finally:
            if not lock.statistics().tasks_waiting:
                self._reading.pop(query_id, None)
        return floor

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
        """The blob now holds ``batch_id`` (read or written by the flusher)."""
        if batch_id > self._floors.get(query_id, NO_BLOB - 1):
            self._floors[query_id] = batch_id

    def forget(self, query_id: str) -> None:
        """Drop what is known of the query (retired): the next update reads the blob again."""
        self._floors.pop(query_id, None)
