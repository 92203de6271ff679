"""Retiring idle queries: the daemon's memory follows the queries that are active.

A new Spark checkpoint directory means a new query id, so over weeks a daemon sees thousands
of them. Each one left state behind: the flusher's maps, a lease renewed forever, lag state,
a Kafka consumer, the durability watch's last ack and a dozen metric series. This module
remembers when each query was last seen and retires the ones idle for ``query_idle_s``.

Invariant: **a query is retired only when nothing it holds is unfinished**: no update seen
for ``query_idle_s`` and no component ``busy`` with it (updates pending in Redis at the last
flush pass, an acknowledgement waiting on its blob, a quarantined record, a Kafka commit not
yet made). Retiring drops memory only: its Redis record and its blob stay, and when it sends
again every component re-creates what it needs (the flusher acquires its lease again at its
next write, the series come back with their first value).

Order: the lease is released first (so a standby can take it at once), then every ``forget``
hook runs with the query id, and, once no live query carries its label (a query restarted
from a new checkpoint directory keeps its name but has a new id), every ``forget_label`` hook
(metric series, lag state, both kept by label). One INFO line per retired query.

Components never import this module: ``sidecar.daemon.app`` wires ``seen`` (each applied update),
``track`` (each query a flush pass sees), ``busy`` and the hooks, as callables.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskStatus

from sidecar.backoff import next_tick
from sidecar.daemon.queries import Queries

log = logging.getLogger(__name__)

#: How often idle queries are looked for, at most (a query is retired within this long after
#: its idle time ran out); a quarter of the idle time when that is shorter.
CHECK_EVERY_MAX_S = 30.0

#: Release a query's lease and forget it; False when it cannot be done now (a renewal is
#: under way): the query stays and is tried at the next pass.
Release = Callable[[str], Awaitable[bool]]


class Retirement:
    """Retires idle queries from the daemon's record of them (``queries``, created here when
    not given).

    ``busy``: predicates by query id, any true keeps the query; ``forget``: hooks by query id
    (the flush owner, ``sidecar.flush.owner``, registers here too); ``forget_label``: hooks
    by label, run once no live query carries it. Append to them before :meth:`run` starts.
    """

    def __init__(
        self,
        idle_s: float,
        *,
        queries: Queries | None = None,
        release: Release | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle_s = idle_s
        self.queries = queries if queries is not None else Queries(clock)
        self._release = release
        self.busy: list[Callable[[str], bool]] = []
        self.forget: list[Callable[[str], None]] = []
        self.forget_label: list[Callable[[str], None]] = []
        self._loop = anyio.CancelScope()
        #: Queries retired so far, and completed passes (tests, benchmarks, debugging).
        self.retired = 0
        self.passes = 0

    def __len__(self) -> int:
        """Live queries: seen or tracked, not retired."""
        return len(self.queries)

    def __contains__(self, query_id: object) -> bool:
        return query_id in self.queries

    def seen(self, query_id: str, label: str) -> None:
        """An update of the query was received (called on the ingest path: O(1))."""
        q = self.queries.entry(query_id, label)
        q.seen_at = self.queries.clock()
        if q.label != label:  # renamed (a restart with the same checkpoint directory)
            renamed_from, q.label = q.label, label
            self._drop_label(renamed_from)

    def track(self, query_id: str, label: str) -> None:
        """The query holds state here without an update seen (e.g. recovered at start, or
        another daemon's update): track it from now on, but do not refresh it."""
        if query_id not in self.queries:
            self.seen(query_id, label)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Retire idle queries, every quarter of the idle time (at most
        :data:`CHECK_EVERY_MAX_S`), until cancelled or :meth:`stop`."""
        with self._loop:
            task_status.started()
            while True:
                every_s = min(self.idle_s / 4, CHECK_EVERY_MAX_S)
                await anyio.sleep_until(next_tick(anyio.current_time(), every_s))
                await self.retire_idle()

    def stop(self) -> None:
        """No more retirements (shutdown: the final flush and commit own the queries now)."""
        self._loop.cancel()

    async def retire_idle(self) -> list[str]:
        """One pass: retire every idle query nothing is busy with; their labels."""
        deadline = self.queries.clock() - self.idle_s
        due = [
            query_id
            for query_id, q in self.queries
            if q.seen_at <= deadline and not self._busy(query_id)
        ]
        retired = [label for query_id in due if (label := await self._retire(query_id))]
        self.passes += 1
        return retired

    async def drop(self, query_id: str, label: str) -> None:
        """Retire the query now, busy or not (``checkpoint-sidecar retire``: its Redis keys
        are gone): release its lease, then the ``forget`` and ``forget_label`` hooks, as for an
        idle query. Its lease is released even when a renewal is under way (retried)."""
        while self._release is not None and not await self._release(query_id):  # noqa: ASYNC110
            await anyio.sleep(0.05)  # a renewal in flight: it ends within one store call
        entry = self.queries.remove(query_id)
        for forget in self.forget:
            self._call(forget, query_id, label)
        if entry is not None:
            self._drop_label(entry.label)
        log.info("retired query=%s (id %s) by request; lease released", label, query_id)

    def _busy(self, query_id: str) -> bool:
        return any(busy(query_id) for busy in self.busy)

    async def _retire(self, query_id: str) -> str | None:
        entry = self.queries.get(query_id)
        if entry is None:
            return None
        at = entry.seen_at
        if self._release is not None and not await self._release(query_id):
            return None
        # The release awaited the store: the query may have come back meanwhile. Then it
        # stays; its lease is acquired again at its next write.
        if self.queries.get(query_id) is not entry or entry.seen_at != at or self._busy(query_id):
            log.debug("query=%s active again while being retired; kept", entry.label)
            return None
        self.queries.remove(query_id)
        label = entry.label
        for forget in self.forget:
            self._call(forget, query_id, label)
        gone = self._drop_label(label)
        self.retired += 1
        log.info(
            "retired query=%s (id %s): idle for %.0fs with nothing pending; lease released%s; "
            "its Redis record and blob stay",
            label,
            query_id,
            self.queries.clock() - at,
            ", metric series removed" if gone else "",
        )
        return label

    def _drop_label(self, label: str) -> bool:
        """One live id fewer carries ``label``; True when it was the last (hooks run)."""
        if self.queries.carries(label):
            return False
        for forget in self.forget_label:
            self._call(forget, label, label)
        return True

    @staticmethod
    def _call(hook: Callable[[str], None], key: str, label: str) -> None:
        # Forgetting is housekeeping: a failing hook (a bug) leaves some memory behind and
        # says so, rather than stopping the daemon.
        try:
            hook(key)
        except Exception:
            log.exception("retiring query=%s: a forget hook failed", label)
