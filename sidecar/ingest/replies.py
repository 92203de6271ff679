"""The replies one connection owes, in request order and bounded. Pure: no event loop.

A connection reads on while replies are owed (in blob ack mode a reply waits for a blob
write, and later requests must join the next write instead of waiting for this one), so
replies can become ready out of order; they still leave strictly in the order the requests
came, and the ones ready together leave in one write::

    owe() ─▶ [slot 7: pending] [slot 8: b"..."] [slot 9: pending] ...
                  │ head, awaited in its turn (or settled by a task of its own)
    take() ─▶ the settled run at the head: [] until slot 7 is settled, then [r7, r8]

A reply is either *pending* — something the shell awaits when the request's turn comes (a
reply that needs nothing but Redis' answer) — or *settled* when it is ready, in any order
(a reply run concurrently, or one that failed to begin). At most ``limit`` are owed: a
client pipelining without reading its replies meets backpressure (the connection stops
reading), not a growing queue.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

#: Replies one connection may owe (requests read, not yet answered) before it stops reading.
MAX_OWED_REPLIES = 4096

#: What the shell awaits for a pending reply (a coroutine, in the daemon).
P = TypeVar("P")


class _Slot(Generic[P]):
    __slots__ = ("pending", "reply")

    def __init__(self, pending: P | None) -> None:
        self.pending = pending
        self.reply: bytes | None = None


class OwedReplies(Generic[P]):
    def __init__(self, limit: int = MAX_OWED_REPLIES) -> None:
        if limit < 1:
            raise ValueError(f"at least one reply must be owed, got limit {limit}")
        self.limit = limit
        self._slots: deque[_Slot[P]] = deque()
        #: The number of the slot at the head of the queue (slots are numbered from 0).
        self._first = 0

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def full(self) -> bool:
        """``limit`` replies are owed: read no more requests until one leaves."""
        return len(self._slots) >= self.limit

    def owe(self, pending: P | None = None) -> int:
        """A request was read: its slot number. ``pending``: what to await in its turn;
        None: it will be :meth:`settle`\\ d."""
        self._slots.append(_Slot(pending))
        return self._first + len(self._slots) - 1

    def settle(self, slot: int, reply: bytes) -> None:
        """The reply of request ``slot`` is ready. A slot already gone (taken, or dropped at
        the end) is ignored.

        Raises:
            ValueError: ``slot`` was never owed.
        """
        index = slot - self._first
        if index >= len(self._slots):
            raise ValueError(
                f"reply {slot} was never owed (owed up to {self._first + len(self) - 1})"
            )
        if index >= 0:
            entry = self._slots[index]
            entry.pending, entry.reply = None, reply

    def head(self) -> tuple[int, P] | None:
        """The first owed reply when it is pending (await it, then :meth:`settle` it); None
        when nothing is owed, or the first one is settled or being settled elsewhere."""
        if not self._slots or self._slots[0].pending is None:
            return None
        return self._first, self._slots[0].pending

    def take(self) -> list[bytes]:
        """The replies ready at the head, in request order (they leave the queue)."""
        out: list[bytes] = []
        slots = self._slots
        while slots and slots[0].reply is not None:
            out.append(slots.popleft().reply)  # type: ignore[arg-type]
            self._first += 1
        return out

    def drop(self) -> list[P]:
        """Owe nothing any more (the connection is cut): the pending replies never awaited."""
        pending = [s.pending for s in self._slots if s.pending is not None]
        self._first += len(self._slots)
        self._slots.clear()
        return pending
