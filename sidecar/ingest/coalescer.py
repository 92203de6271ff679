"""Write coalescing: many connections' updates, one Redis round trip per batch.

Every ``progress`` of one read (and of concurrent connections) is submitted before any reply
is awaited; a single task drains the bounded submission queue (at most ``max_batch`` per
call, ``max_queued`` waiting) and applies the whole batch with one script call. Under load
that turns N round trips into one; at a low rate it adds nothing (the first update is sent at
once). When the queue is full, submitters wait, their connections stop reading, and
backpressure reaches the clients. The call goes through the :class:`Applier` (the flush
owner, ``sidecar.flush.owner``): it fills in the floors it knows and, in blob ack mode, keeps
the rows the call returns, so the flush each ack waits for reads nothing from Redis.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

import anyio
from anyio.abc import TaskStatus

from sidecar.buffer.redis_buffer import Outcome
from sidecar.errors import BufferUnavailable
from sidecar.model.checkpoint import Checkpoint

log = logging.getLogger(__name__)

#: One update's outcome, set by the coalescer; the submitter awaits it (raises the buffer's
#: error instead when the call failed). A plain asyncio future: the hot path creates one per
#: update, and ``anyio.Event()`` costs a library lookup each (``docs/decisions.md``).
PendingWrite = asyncio.Future[Outcome]

_Submitted = tuple[Checkpoint, int | None, PendingWrite]


class Applier(Protocol):
    """Where a batch of updates is applied: one Redis round trip (``RedisBuffer.apply``)
    through the flush owner (``sidecar.flush.owner.FlushOwner.apply``)."""

    async def apply(self, checkpoints: list[Checkpoint], floors: list[int | None]) -> list[Outcome]:
        """Each update's outcome, in order. A floor of None: the one the applier knows (the
        batch the query's blob holds, or still unknown). Raises the buffer's errors."""


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

    def __init__(self, applier: Applier, *, max_batch: int = 256, max_queued: int = 4096) -> None:
        self._applier = applier
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
        as read by the caller; None: what the applier knows when it applies it); await the
        returned future for its outcome.

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
        try:
            results = await self._applier.apply(checkpoints, floors)
        except Exception as exc:  # every submitter gets the error; none is left waiting
            for _, _, slot in batch:
                _fail(slot, exc)
            return
        except BaseException:  # cancelled mid-call (stopping): the outcome is unknown
            gone = BufferUnavailable("the daemon stopped while storing this update; resend it")
            for _, _, slot in batch:
                _fail(slot, gone)
            raise
        for (_, _, slot), outcome in zip(batch, results, strict=True):
            if not slot.done():  # a submitter cancelled meanwhile cancels its future
                slot.set_result(outcome)


def _fail(slot: PendingWrite, exc: BaseException) -> None:
    if not slot.done():
        slot.set_exception(exc)
        slot.exception()  # retrieved: a submitter that went away must not log it at exit
