"""A discrete-event asyncio loop for simulations: virtual time, no real waiting.

The loop's clock (``loop.time()``, and so ``anyio.current_time()``, ``asyncio.sleep``,
``call_later``) starts at 0 and jumps straight to the next timer whenever nothing is ready to
run, so a simulation of minutes of leases, renewals and backoffs runs in milliseconds, and
the same steps always interleave the same way (nothing here reads the wall clock). Only
in-memory I/O belongs on it (fakes at the SDK edges): a real socket would be polled, never
waited for.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any

#: Passes of the loop with nothing ready and no timer before it is called a deadlock.
MAX_IDLE_PASSES = 1000
#: Passes of the loop without its clock moving before it is called a livelock (something
#: busy-loops: in production it would spin a core).
MAX_BUSY_PASSES = 200_000


class _Selector:
    """The loop's selector, asked never to block: an empty answer with a timeout moves the
    loop's clock forward by that timeout instead."""

    def __init__(self, selector: selectors.BaseSelector, loop: VirtualTimeLoop) -> None:
        self._selector = selector
        self._loop = loop
        self._idle = 0
        self._busy = 0

    def select(self, timeout: float | None = None) -> list[Any]:
        events = self._selector.select(0)
        if timeout == 0:
            self._busy += 1
            if self._busy > MAX_BUSY_PASSES:
                raise RuntimeError(
                    f"simulation livelocked: {self._busy} loop passes without its clock moving"
                )
        else:
            self._busy = 0
        if events:
            self._idle = 0
        elif timeout is None:
            self._idle += 1
            if self._idle > MAX_IDLE_PASSES:
                raise RuntimeError("simulation deadlocked: nothing can run and no timer is due")
        elif timeout > 0:
            self._idle = 0
            self._loop.advance(timeout)
        return events

    def __getattr__(self, name: str) -> Any:
        return getattr(self._selector, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        selector: Any = self._selector  # type: ignore[has-type]
        self._selector = _Selector(selector, self)

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds
