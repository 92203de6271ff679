"""Write coalescing: many connections' updates, one Redis round trip per batch.

Every ``progress`` of one read (and of concurrent connections) is submitted before any reply
is awaited; a single task drains the bounded submission queue (at most ``max_batch`` per
call, ``max_queued`` waiting) and applies the whole batch with one script call. Under load
that turns N round trips into one; at a low rate it adds nothing (the first update is sent at
once). When the queue is full, submitters wait, their connections stop reading, and
backpressure reaches the clients. In blob ack mode the rows the call returns go to the
flusher (:class:`RowSink`): the flush each ack waits for then reads nothing from Redis.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

import anyio
from anyio.abc import TaskStatus

from sidecar.buffer.redis_buffer import Outcome, PendingQuery, RedisBuffer
from sidecar.errors import BufferUnavailable
from sidecar.model.checkpoint import Checkpoint

log = logging.getLogger(__name__)

#: One update's outcome, set by the coalescer; the submitter awaits it (raises the buffer's
#: error instead when the call failed). A plain asyncio future: the hot path creates one per
#: update, and ``anyio.Event()`` costs a library lookup each (``docs/decisions.md``).
PendingWrite = asyncio.Future[Outcome]

_Submitted = tuple[Checkpoint, int | None, PendingWrite]


class RowSink(Protocol):
    """Who takes the rows of the updates applied (each query's blob state,
    ``sidecar.flush.blob_state``, for the flusher)."""

    def stamp(self) -> int:
        """Taken before each call: rows read before an admin op of their query are void."""

    def applied(self, rows: list[PendingQuery], since: int) -> None:
        """The rows of one call (in the order applied), which began at stamp ``since``."""

    def void(self, query_ids: list[str]) -> None:
        """A call failed, maybe after it ran: rows kept of these queries may be stale."""


class WriteCoalescer:
    """Coalesce concurrent updates from all connections into one Redis round trip.

    Submissions go through a bounded queue (``max_queued``): when Redis is slow the
    submitters wait, which stops their connections from reading — backpressure reaches the
    clients instead of growing memory. One task drains whatever is queued, up to
    ``max_batch``, and applies it with a single script call.

    asyncio primitives, not anyio's memory stream: its ``send`` forces a pass of the event
    loop per update, and its events cost a library lookup each. The daemon always runs on
    anyio's asyncio backend (asyncio's own loop or uvloop), so nothing is lost.
    """

    def __init__(
        self,
        buffer: RedisBuffer,
        *,
        max_batch: int = 256,
        max_queued: int = 4096,
        rows: RowSink | None = None,
    ) -> None:
        """``rows``: given the rows of the updates applied (blob ack mode)."""
        self._buffer = buffer
        self._rows = rows
        self._max_batch = max_batch
        self._max_queued = max_queued
        self._queue: deque[_Submitted] = deque()
        self._ready = asyncio.Event()  # something is queued
        self._room = asyncio.Event()  # the queue is below max_queued
        self._room.set()
        self._closed = False

    @property
    def queued(self) -> int:
        """Updates waiting for their round trip (for the fill-level gauge)."""
        return len(self._queue)

    async def submit(self, checkpoint: Checkpoint, floor: int | None = None) -> PendingWrite:
        """Queue one update with its query's floor (``RedisBuffer.apply``: the blob's batch,
        None when not known yet); await the returned future for its outcome.

        Raises:
            BufferUnavailable: the coalescer has stopped (the daemon is stopping).
        """
        while len(self._queue) >= self._max_queued:
            self._room.clear()
            await self._room.wait()
        if self._closed:
            raise BufferUnavailable("the daemon is stopping; resend to its successor")
        slot: PendingWrite = asyncio.get_running_loop().create_future()
        self._queue.append((checkpoint, floor, slot))
        self._ready.set()
        return slot

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        queue = self._queue
        try:
            while True:
                if not queue:
                    self._ready.clear()
                    await self._ready.wait()
                count = min(len(queue), self._max_batch)
                batch = [queue.popleft() for _ in range(count)]
                if not self._room.is_set() and len(queue) < self._max_queued:
                    self._room.set()
                await self._flush(batch)
        finally:
            # Stopped (the daemon's task group is cancelled): nobody is left waiting forever.
            self._closed = True
            self._room.set()
            gone = BufferUnavailable("the daemon stopped before this update was stored")
            while queue:
                _fail(queue.popleft()[2], gone)

    async def _flush(self, batch: list[_Submitted]) -> None:
        checkpoints, floors = [c for c, _, _ in batch], [f for _, f, _ in batch]
        applied = None
        try:
            if self._rows is None:
                results = await self._buffer.apply(checkpoints, floors)
            else:
                since = self._rows.stamp()
                applied = await self._buffer.apply_rows(checkpoints, floors)
                results = applied.outcomes
        except Exception as exc:  # every submitter gets the error; none is left waiting
            self._unknown(checkpoints)
            for _, _, slot in batch:
                _fail(slot, exc)
            return
        except BaseException:  # cancelled mid-call (stopping): the outcome is unknown
            self._unknown(checkpoints)
            gone = BufferUnavailable("the daemon stopped while storing this update; resend it")
            for _, _, slot in batch:
                _fail(slot, gone)
            raise
        if applied is not None and self._rows is not None:
            self._rows.applied(applied.rows, since)  # before the acks wait on the flusher
        for (_, _, slot), outcome in zip(batch, results, strict=True):
            if not slot.done():  # a submitter cancelled meanwhile cancels its future
                slot.set_result(outcome)

    def _unknown(self, checkpoints: list[Checkpoint]) -> None:
        if self._rows is not None:
            self._rows.void([c.query_id for c in checkpoints])


def _fail(slot: PendingWrite, exc: BaseException) -> None:
    if not slot.done():
        slot.set_exception(exc)
        slot.exception()  # retrieved: a submitter that went away must not log it at exit
