"""The daemon's record of each live query: one entry per query id, with every part of the
daemon's memory of it, so that retiring a query is one removal.

The flush owner keeps its own record (``sidecar.flush.core.QueryState``: the blob, the lease,
the acks) behind its door; this one holds what the daemon's other parts keep of a query:

::

    ingest ── seen / heard / acked ──▶ LiveQuery ◀── snapshot part ── snapshot loop
                                          │
        retirement: idle and nothing busy ┴─▶ removed (and the flush owner told)

- ``seen_at``: the last update applied (retirement's idle clock; a query only *tracked* —
  state held here without an update, e.g. recovered at start — is not refreshed);
- ``heard_at``: the last progress heard, applied or not (an idle running query still reports;
  the admin ops refuse a reset or retire within their quiet time);
- ``acked``: the last batch acknowledged to a client (the durability watch names what Redis lost);
- ``snapshot``: the snapshot loop's part (``sidecar.daemon.snapshots``), created at its
  first committed batch.

Only :class:`~sidecar.daemon.retirement.Retirement` removes entries. The table also knows,
without a map of its own, whether a label is still carried by a live id (a query restarted
from a new checkpoint directory keeps its name but has a new id): a scan, made only when a
query is retired or renamed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the snapshot code is imported only when snapshots are on
    from sidecar.snapshot.contents import Contents


@dataclass(slots=True)
class SnapshotPart:
    """What the snapshot loop keeps of one query."""

    #: The run (Spark's run id) whose progress set ``wanted``, and how many rewinds were
    #: followed (a snapshot begun before one does not move ``done``).
    run_id: str | None = None
    rewinds: int = 0
    #: Its checkpoint location under the root (None: not found there yet), and whether the
    #: root was listed since the query was first wanted (a new query lists it at once).
    location: str | None = None
    looked: bool = False
    #: The newest batch Spark committed (from its progress), and when each not yet in a
    #: snapshot was reported (for the lag in seconds; bounded, the oldest always kept).
    wanted: int = -1
    reported: dict[int, float] = field(default_factory=dict)
    #: The newest snapshot's batch (-1: none yet).
    done: int = -1
    in_flight: bool = False
    #: Its checkpoint was not under the root at the last look (nothing to wait for: no lag
    #: kept), and whether that was said (once).
    elsewhere: bool = False
    told: bool = False
    retry_at: float = 0.0
    #: The last off-timeline refusal said (said again only when it changes).
    off_said: str | None = None
    pruned_at: float = float("-inf")
    contents: Contents | None = None
    #: The lease term ``contents`` was loaded under.
    contents_term: int = -1


@dataclass(slots=True)
class LiveQuery:
    """The daemon's memory of one live query (see the module's docstring)."""

    label: str
    seen_at: float
    heard_at: float = float("-inf")
    acked: int = -1
    snapshot: SnapshotPart | None = None


class Queries:
    """Live queries by id. Creating and updating are O(1) (the ingest path)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._live: dict[str, LiveQuery] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, query_id: object) -> bool:
        return query_id in self._live

    def __iter__(self) -> Iterator[tuple[str, LiveQuery]]:
        """(query id, entry) pairs, over a copy: entries may come and go meanwhile."""
        return iter(list(self._live.items()))

    def get(self, query_id: str) -> LiveQuery | None:
        return self._live.get(query_id)

    def entry(self, query_id: str, label: str) -> LiveQuery:
        """The query's entry, created (seen now, named ``label``) when new. A rename is
        retirement's to make (``Retirement.seen``): it drops the old name's series."""
        q = self._live.get(query_id)
        if q is None:
            q = self._live[query_id] = LiveQuery(label, self.clock())
        return q

    def remove(self, query_id: str) -> LiveQuery | None:
        """Retirement's one removal."""
        return self._live.pop(query_id, None)

    def carries(self, label: str) -> bool:
        """Whether a live id still carries ``label`` (O(queries): on retirement only)."""
        return any(q.label == label for q in self._live.values())
