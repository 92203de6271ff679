"""Per-query exclusion between flushes and admin ops (``reset``, ``retire``).

A flush holds its query's lock while it writes; an admin op holds it too and bumps the
query's generation. A flush of a row read before an op (an older generation) is dropped when
it finally gets the lock: written, it would undo the op.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio


class QueryLocks:
    def __init__(self) -> None:
        self._locks: dict[str, anyio.Lock] = {}
        self._generations: dict[str, int] = {}

    def generations(self) -> dict[str, int]:
        """Every query's generation now: take it before reading the rows to flush."""
        return dict(self._generations)

    def changed_since(self, query_id: str, generations: dict[str, int]) -> bool:
        """True if an admin op ran on the query after ``generations`` was taken."""
        return self._generations.get(query_id) != generations.get(query_id)

    @asynccontextmanager
    async def exclusive(self, query_id: str) -> AsyncIterator[None]:
        """Hold the query (an admin op): no flush of it runs inside, and none of a row read
        before it runs after."""
        async with self.held(query_id):
            self._generations[query_id] = self._generations.get(query_id, 0) + 1
            yield

    @asynccontextmanager
    async def held(self, query_id: str) -> AsyncIterator[None]:
        """Hold the query's lock (a flush); dropped from memory when nobody holds or waits."""
        lock = self._locks.setdefault(query_id, anyio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.statistics().tasks_waiting and not lock.locked():
                self._locks.pop(query_id, None)
