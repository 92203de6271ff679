"""What :func:`spark_bridge.attach` returns, whichever listener it registered."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Literal

ListenerKind = Literal["jvm", "python"]


class BridgeError(RuntimeError):
    """The listener could not be set up; the message says what to do."""


@dataclass(frozen=True)
class SenderStats:
    """Delivery counters of a listener (``handle.stats()``)."""

    offered: int  # progress events handed to the listener
    sent: int  # acknowledged by the daemon (applied, or already stored)
    conflated: int  # superseded by a newer progress of the same query before being sent
    failed: int  # refused for good (bad request), or dropped (over the query cap, after close)
    retried: int  # updates put back to be sent again (daemon down, retriable error)
    reconnects: int  # connections made after the first one
    pending: int  # queries with an update not yet acknowledged
    last_error: str | None = None  # the most recent failure, for people

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> SenderStats:
        return cls(
            offered=int(values["offered"]),
            sent=int(values["sent"]),
            conflated=int(values["conflated"]),
            failed=int(values["failed"]),
            retried=int(values["retried"]),
            reconnects=int(values["reconnects"]),
            pending=int(values["pending"]),
            last_error=values.get("last_error"),
        )


class BridgeHandle(abc.ABC):
    """A registered listener: ``stats()`` while running, ``close()`` at the end."""

    #: "jvm": the Java listener in Spark's driver JVM; "python": the Python fallback.
    kind: ListenerKind

    @abc.abstractmethod
    def stats(self) -> SenderStats:
        """Delivery counters."""

    @abc.abstractmethod
    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything offered so far is acknowledged; False on timeout."""

    @abc.abstractmethod
    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop listening and deliver what is pending, within ``timeout_s``.

        First waits until every query the listener saw that is no longer active has had its
        terminated event (Spark's listener bus is asynchronous: ``query.stop()`` returns
        before the listener has seen the last progress), then unregisters the listener and
        flushes. Returns True when everything offered was acknowledged by the daemon.
        """
