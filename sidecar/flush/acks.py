"""Blob-mode acknowledgements: who waits for which batch of which query to be in its blob.

``ack_mode=blob`` replies to a ``progress`` only once the query's blob holds that batch or a
newer one. Each waiting ack is a future here, settled True by :meth:`DurableAcks.durable`
(the flusher, after a write under the lease succeeded or a snapshot showed the batch already
flushed) or False when its time runs out. Registering a wait sets :attr:`DurableAcks.wake`
(unless the query's write is in flight, or it may not be flushed now), so the flusher writes at once
instead of at its next interval tick.

asyncio futures and a timer, not anyio events and cancel scopes: one of each per update
costs a library lookup on the hot path, and the daemon always runs on anyio's asyncio
backend (``docs/architecture.md``, event loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator


class DurableAcks:
    def __init__(self, *, ready: Callable[[str], bool] = lambda _: True) -> None:
        """``ready(query_id)``: whether the query may be flushed now (not backing off)."""
        self._ready = ready
        #: Queries in a pass of the flush loop (read, or written): a new ack of one does not
        #: wake the loop but is deferred; the query's release (:meth:`release`) wakes it.
        self.in_flight: set[str] = set()
        self._deferred: set[str] = set()
        #: Set when an ack starts waiting; the flusher clears it before each pass.
        self.wake = asyncio.Event()
        #: The newest batch known to be in each query's blob.
        self._durable: dict[str, int] = {}
        #: Waiting acks by query id: (batch id, future set to True once durable).
        self._waiters: dict[str, list[tuple[int, asyncio.Future[bool]]]] = {}

    def __contains__(self, query_id: str) -> bool:
        """Whether an ack waits on the query."""
        return query_id in self._waiters

    def __iter__(self) -> Iterator[str]:
        """The queries acks wait on."""
        return iter(list(self._waiters))

    async def wait(self, query_id: str, batch_id: int, timeout_s: float | None = None) -> bool:
        """True once the query's blob holds ``batch_id`` or a newer batch; False when
        ``timeout_s`` passed first."""
        if self._durable.get(query_id, -1) >= batch_id:
            return True
        loop = asyncio.get_running_loop()
        entry: tuple[int, asyncio.Future[bool]] = (batch_id, loop.create_future())
        self._waiters.setdefault(query_id, []).append(entry)
        if query_id in self.in_flight:
            self._deferred.add(query_id)
        elif self._ready(query_id):
            self.wake.set()
        timer = None if timeout_s is None else loop.call_later(timeout_s, _settle, entry[1], False)
        try:
            return await entry[1]
        finally:
            if timer is not None:
                timer.cancel()
            waiting = self._waiters.get(query_id)
            if waiting and entry in waiting:
                waiting.remove(entry)
            if not waiting:
                self._waiters.pop(query_id, None)

    def durable(self, query_id: str, batch_id: int) -> None:
        """The query's blob holds ``batch_id``: answer every ack waiting for it or older."""
        if batch_id > self._durable.get(query_id, -1):
            self._durable[query_id] = batch_id
        for wanted, waiter in self._waiters.get(query_id, ()):
            if wanted <= batch_id:
                _settle(waiter, True)

    def release(self, query_id: str) -> None:
        """The loop's pass is done with the query (its write ended, or it needed none): an
        ack deferred meanwhile and still waiting wakes the loop for the next write at once
        (group commit); at most one wake per deferred ack, so nothing spins."""
        self.in_flight.discard(query_id)
        if query_id in self._deferred:
            self._deferred.discard(query_id)
            if self._ready(query_id) and any(
                not waiter.done() for _, waiter in self._waiters.get(query_id, ())
            ):
                self.wake.set()

    def forget(self, query_id: str) -> None:
        """Drop what is known of a retired query's blob (nothing waits on it)."""
        self._durable.pop(query_id, None)


def _settle(waiter: asyncio.Future[bool], durable: bool) -> None:
    if not waiter.done():
        waiter.set_result(durable)
