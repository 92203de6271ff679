"""Write coalescing: many connections' updates, one Redis round trip per batch.

Every ``progress`` of one read (and of concurrent connections) is submitted before any reply
is awaited; a single task drains the bounded submission stream (at most ``max_batch`` per
call, ``max_queued`` waiting) and applies the whole batch with one script call. Under load
that turns N round trips into one; at a low rate it adds nothing (the first update is sent at
once). When the stream is full, submitters wait, their connections stop reading, and
backpressure reaches the clients.
"""

from __future__ import annotations

import logging

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from sidecar.buffer import Outcome, RedisBuffer
from sidecar.checkpoint import Checkpoint

log = logging.getLogger(__name__)


class PendingWrite:
    """Where the coalescer puts one update's outcome; the submitter waits on it."""

    __slots__ = ("done", "error", "result")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.result = Outcome.STALE
        self.error: BaseException | None = None

    async def wait(self) -> Outcome:
        """The update's outcome; raises the buffer's error instead when the call failed."""
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


_Submitted = tuple[Checkpoint, int | None, PendingWrite]


class WriteCoalescer:
    """Coalesce concurrent updates from all connections into one Redis round trip.

    Submissions go through a bounded stream (``max_queued``): when Redis is slow the
    submitters wait, which stops their connections from reading — backpressure reaches the
    clients instead of growing memory. One task drains whatever is queued, up to
    ``max_batch``, and applies it with a single script call.
    """

    def __init__(self, buffer: RedisBuffer, *, max_batch: int = 256, max_queued: int = 4096):
        self._buffer = buffer
        self._max_batch = max_batch
        self._send: MemoryObjectSendStream[_Submitted]
        self._recv: MemoryObjectReceiveStream[_Submitted]
        self._send, self._recv = anyio.create_memory_object_stream(max_queued)

    @property
    def queued(self) -> int:
        """Updates waiting for their round trip (for the fill-level gauge)."""
        return self._send.statistics().current_buffer_used

    async def submit(self, checkpoint: Checkpoint, floor: int | None = None) -> PendingWrite:
        """Queue one update with its query's floor (``RedisBuffer.apply``: the blob's batch,
        None when not known yet); await the returned slot's ``wait()`` for its outcome."""
        slot = PendingWrite()
        await self._send.send((checkpoint, floor, slot))
        return slot

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._send, self._recv:
            async for first in self._recv:
                batch = [first]
                while len(batch) < self._max_batch:
                    try:
                        batch.append(self._recv.receive_nowait())
                    except anyio.WouldBlock:
                        break
                await self._flush(batch)

    async def _flush(self, batch: list[_Submitted]) -> None:
        try:
            results = await self._buffer.apply([c for c, _, _ in batch], [f for _, f, _ in batch])
        except Exception as exc:  # every submitter gets the error; none is left waiting
            for _, _, slot in batch:
                slot.error = exc
                slot.done.set()
            return
        for (_, _, slot), outcome in zip(batch, results, strict=True):
            slot.result = outcome
            slot.done.set()
