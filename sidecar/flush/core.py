"""The flush core: what this daemon knows of each query's blob, and every decision made on
it. Pure and sans-IO, like the protocol: no event loop, no store, no Redis. The shell
(``sidecar.flush.blob_state`` and the flusher) performs the reads and writes the core asks
for and tells it what happened.

One :class:`QueryBlob` per query holds it all: the floor (the batch the blob holds, as
ingest needs it), the durable batch (what acks wait for), the document last read or written
and the lease term it is valid for, the acks waiting, whether the query is in a flush pass,
its retry schedule and its admin-op stamp. Nothing else keeps a copy.

Invariants (``tests/unit/test_flush_simulation.py`` drives this module and the real flusher
through random interleavings and checks them after every step):

1. **Never backwards.** A write is planned only for a batch newer than what the blob holds,
   and what the blob holds is known only from a read or a write under the *same* lease term.
   A lease lost and re-acquired, or a write whose outcome is unknown, forgets it (read again
   before the next write). So no blob moves backwards except by an admin reset.
2. **A reset is never undone.** Every admin op (reset, retire) stamps its query. A Redis row
   read before the stamp is never flushed, and Redis' flushed batch read before it is no
   evidence of what the blob holds.
3. **An ack is answered only when its batch is in the blob**: known from a read or a write
   under the lease, a reset, or Redis' flushed batch read after the newest such evidence.
4. **Acknowledged batches become durable once faults stop**: a failed write is retried after
   a backoff; an ack that arrives while its query is in a pass wakes the loop when the pass
   ends, so it is never left for a whole interval.
5. **One writer per lease**: a write is planned only for a held lease's term.

Stamps: one counter for the whole daemon, advanced by every admin op (and retirement) and
every piece of evidence from the lease (read, write, reset). A read of Redis or of the blob
without the lease remembers the stamp at its start (:attr:`FlushCore.stamp`); what it returns
is kept for a query only if nothing newer happened to that query since.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from sidecar.backoff import Backoff
from sidecar.buffer.lua import NO_BLOB
from sidecar.model.document import CheckpointDocument

#: A waiting ack's handle: whatever the shell settles when its batch is durable.
W = TypeVar("W")


@dataclass(slots=True, eq=False)
class QueryBlob(Generic[W]):
    """What this daemon knows of one query's blob."""

    query_id: str
    #: Stamp of the query's last admin op (at creation: the last one anywhere): Redis rows
    #: read before it are void.
    generation: int
    #: Stamp of the newest evidence from the lease (read, write, reset) or admin op: reads
    #: without the lease begun before it are not kept.
    evidence: int
    #: The query's name for logs and metrics ("" until a Redis row told it).
    label: str = ""
    #: The batch the blob holds as last read or written here (NO_BLOB: none); None: not read.
    floor: int | None = None
    #: The newest batch known to be in the blob: what blob-mode acks wait for.
    durable: int = NO_BLOB
    #: The lease term under which :attr:`document` is what the blob holds; None: unknown, so
    #: read the blob before writing.
    term: int | None = None
    #: The document the blob holds (None: empty, or unknown): its history rides along.
    document: CheckpointDocument | None = None
    #: Acks waiting for a batch to be durable: (batch id, handle).
    waiters: list[tuple[int, W]] = field(default_factory=list)
    #: In a flush pass (read, or being written): a new ack waits for the pass to end.
    in_flight: bool = False
    #: An ack arrived during the pass: wake the loop when it ends.
    deferred: bool = False
    #: Left pending by a previous run: due whatever the thresholds until flushed.
    recovering: bool = False
    #: The last document written had its history thinned (logged once until it fits).
    thinned: bool = False
    #: When ingest last re-read the floor (a refusal by the floor alone: a rewind elsewhere?).
    rechecked_at: float = float("-inf")


class Step(enum.Enum):
    #: Read the blob first: what it holds under this lease term is not known.
    READ = "read"
    #: The blob already holds this batch or a newer one: record it as flushed, write nothing.
    SKIP = "skip"
    #: Write a document of the row's checkpoint, carrying ``previous``'s history.
    WRITE = "write"


@dataclass(frozen=True, slots=True)
class Plan:
    step: Step
    #: What the blob holds (SKIP: the batch to record as flushed).
    blob_batch: int = NO_BLOB
    previous: CheckpointDocument | None = None


class Ack(enum.Enum):
    #: The batch is in the blob already: answer now.
    DURABLE = "durable"
    #: Waiting; the flush loop should wake for it now.
    WAKE = "wake"
    #: Waiting; the loop is busy with the query or must not flush it yet (backing off).
    WAIT = "wait"


class FlushCore(Generic[W]):
    """Every query's blob state, and the decisions on it."""

    def __init__(self, backoff: Backoff) -> None:
        #: The retry schedule of failed flushes, per query id.
        self.backoff = backoff
        self._queries: dict[str, QueryBlob[W]] = {}
        self._stamp = 0
        #: Stamp of the last admin op or retirement, of any query.
        self._last_op = 0

    def __len__(self) -> int:
        return len(self._queries)

    def __contains__(self, query_id: object) -> bool:
        return query_id in self._queries

    @property
    def stamp(self) -> int:
        """Take it before a Redis read: what the read returns is judged against it."""
        return self._stamp

    def get(self, query_id: str) -> QueryBlob[W] | None:
        return self._queries.get(query_id)

    def view(self, query_id: str, label: str | None = None) -> QueryBlob[W]:
        """The query's state, created empty when new; ``label`` updates its name."""
        q = self._queries.get(query_id)
        if q is None:
            q = self._queries[query_id] = QueryBlob(query_id, self._last_op, self._last_op)
        if label:
            q.label = label
        return q

    def forget(self, query_id: str) -> None:
        """Drop the query (retired). Acks still waiting time out; anything begun before
        (a floor read, a flush of a row read before) finds its state gone and keeps nothing."""
        self._stamp += 1
        self._last_op = self._stamp
        self._queries.pop(query_id, None)
        self.backoff.forget(query_id)

    def _evidence(self, q: QueryBlob[W]) -> None:
        self._stamp += 1
        q.evidence = self._stamp

    # --- the floor (ingest) ----------------------------------------------------------------

    def floor(self, query_id: str) -> int | None:
        """The batch the query's blob holds as far as known, without I/O; None: not read."""
        q = self._queries.get(query_id)
        return q.floor if q is not None else None

    def floor_read(
        self, query_id: str, batch: int, since: int, *, exact: bool
    ) -> tuple[int, list[W]]:
        """A blob read done without the lease, begun at stamp ``since``: ``batch`` (NO_BLOB:
        no blob) raises the floor, or with ``exact`` replaces it (a re-read after a refusal by
        the floor alone: the blob may have been rewound by another owner). Begun before newer
        evidence, an admin op or a retirement of the query, the read is returned, not kept: it
        could raise a reset floor back. No floor is kept for a query without a blob. Returns
        the floor to use, and the acks the read answers."""
        q = self._queries.get(query_id)
        if q is None:
            if batch == NO_BLOB or self._last_op > since:
                return batch, []
            q = self.view(query_id)
        elif q.evidence > since:
            return (q.floor if q.floor is not None else batch), []
        if exact or q.floor is None or batch > q.floor:
            q.floor = batch
        # The blob held it when read: an ack of that batch or older need not wait for a write
        # (after Redis lost its data, nothing may be left to write), nor one waiting already.
        # Read again exactly, it may be lower than what was durable (rewound by another
        # owner): an ack of a batch above it waits for a write again.
        return q.floor, self._durable(q, batch if exact else max(q.durable, batch))

    # --- acks -----------------------------------------------------------------------------

    def ack(self, query_id: str, batch: int, waiter: W) -> Ack:
        """An ack wants ``batch`` of the query in the blob."""
        q = self.view(query_id)
        if q.durable >= batch:
            return Ack.DURABLE
        q.waiters.append((batch, waiter))
        if q.in_flight:
            q.deferred = True
            return Ack.WAIT
        return Ack.WAKE if self.backoff.ready(query_id) else Ack.WAIT

    def ack_gone(self, query_id: str, waiter: W) -> None:
        """An ack stopped waiting (answered, or its time ran out)."""
        q = self._queries.get(query_id)
        if q is not None:
            q.waiters = [(b, w) for b, w in q.waiters if w is not waiter]

    def waiting(self) -> list[str]:
        """The queries acks wait on."""
        return [q.query_id for q in self._queries.values() if q.waiters]

    def _durable(self, q: QueryBlob[W], batch: int) -> list[W]:
        """The blob holds ``batch``: the acks it answers (they stop waiting)."""
        q.durable = batch
        answered = [w for b, w in q.waiters if b <= batch]
        if answered:
            q.waiters = [(b, w) for b, w in q.waiters if b > batch]
        return answered

    # --- a flush pass ----------------------------------------------------------------------

    def begin(self, query_id: str) -> None:
        """The query enters a pass of the flush loop (never two at once)."""
        self.view(query_id).in_flight = True

    def in_flight(self, query_id: str) -> bool:
        q = self._queries.get(query_id)
        return q is not None and q.in_flight

    def end(self, query_id: str) -> bool:
        """The pass is done with the query (written, or no write needed, or failed). True:
        an ack deferred meanwhile still waits, so wake the loop for the next write now (group
        commit); at most once per deferred ack, so nothing spins."""
        q = self._queries.get(query_id)
        if q is None:
            return False
        q.in_flight = False
        deferred, q.deferred = q.deferred, False
        return deferred and bool(q.waiters) and self.backoff.ready(query_id)

    def current(self, query_id: str, since: int) -> bool:
        """Whether a Redis row of the query read at stamp ``since`` may still be flushed (no
        admin op on it since; for a query not known then, none anywhere)."""
        q = self._queries.get(query_id)
        return (q.generation if q is not None else self._last_op) <= since

    def flushed_in_redis(self, query_id: str, batch: int, since: int) -> list[W]:
        """Redis says the blob got ``batch`` (its flushed batch id, read at stamp ``since``):
        evidence unless the lease gave newer; the acks it answers."""
        q = self._queries.get(query_id)
        if q is None or q.evidence > since or batch == q.durable:
            return []
        return self._durable(q, batch)

    def plan(self, query_id: str, batch: int, term: int) -> Plan:
        """What to do with a due row of ``batch``, the lease held at ``term``."""
        q = self.view(query_id)
        if q.term != term or q.floor is None:
            return Plan(Step.READ)
        if batch <= q.floor:
            return Plan(Step.SKIP, q.floor)
        return Plan(Step.WRITE, q.floor, q.document)

    def read(self, query_id: str, term: int, doc: CheckpointDocument | None) -> list[W]:
        """The blob, read under the lease at ``term``, holds ``doc``: the floor follows it
        exactly (a rewind by another owner lowers it too); the acks it answers."""
        q = self.view(query_id)
        self._evidence(q)
        q.term, q.document = term, doc
        q.floor = doc.batch_id if doc is not None else NO_BLOB
        return self._durable(q, q.floor)

    def written(self, query_id: str, term: int, doc: CheckpointDocument) -> list[W]:
        """``doc`` was written under the lease at ``term``; the acks it answers."""
        q = self.view(query_id)
        self._evidence(q)
        q.term, q.document, q.floor = term, doc, doc.batch_id
        return self._durable(q, doc.batch_id)

    def skipped(self, query_id: str) -> list[W]:
        """The blob, as known under the lease, already held the row's batch: the acks that
        answers."""
        q = self._queries.get(query_id)
        if q is None or q.floor is None:
            return []
        return self._durable(q, q.floor)

    def flushed(self, query_id: str) -> None:
        """The flush is complete (the blob holds the row, Redis recorded it): its retry
        schedule starts over, and a recovered query is no longer due for that alone."""
        self.backoff.succeeded(query_id)
        q = self._queries.get(query_id)
        if q is not None:
            q.recovering = False

    def failed(
        self,
        query_id: str,
        *,
        retriable: bool,
        outcome_unknown: bool,
        retry_after_s: float | None = None,
    ) -> float:
        """A flush failed: seconds until its next try. Not ``retriable`` (an operator must act
        first) waits the full cap; ``retry_after_s`` (the store's ``Retry-After``) at least
        that long. ``outcome_unknown`` (timed out, connection lost mid-call, a 5xx): the blob
        may hold the write or not, so read it again before the next one."""
        if outcome_unknown:
            self.unknown(query_id)
        return self.backoff.failed(
            query_id, give_up_ramp=not retriable, at_least_s=retry_after_s or 0.0
        )

    def unknown(self, query_id: str, *, lowered_to: int | None = None) -> None:
        """What the blob holds is unknown until read again: the store refused the lease, or
        a write's outcome is unknown (it timed out, or lost its connection mid-call). The
        floor is forgotten too: the write may have raised the blob (ingest reads it again
        before it stores an update Redis does not know: after Redis lost its data, an older
        batch must not pass under a write that landed). A write that may have lowered the
        blob (a reset to ``lowered_to``) lowers the durable batch: an ack is then answered
        only once the blob is read or written again."""
        q = self._queries.get(query_id)
        if q is None:
            return
        self._evidence(q)  # a read begun before cannot set the floor back either
        q.term = None
        q.floor = None
        if lowered_to is not None:
            q.durable = min(q.durable, lowered_to)

    # --- admin ops ---------------------------------------------------------------------------

    def admin_op(self, query_id: str) -> None:
        """A reset or retire of the query begins, or ends: rows read before now are void."""
        self._stamp += 1
        self._last_op = self._stamp
        q = self.view(query_id)
        q.generation = q.evidence = self._stamp

    def reset(self, query_id: str, term: int, doc: CheckpointDocument) -> list[W]:
        """A reset wrote ``doc`` under the lease at ``term``: the floor and the durable batch
        follow it down, so later batches above it are stored and acknowledged again."""
        q = self.view(query_id)
        self._evidence(q)
        q.term, q.document, q.floor = term, doc, doc.batch_id
        self.backoff.forget(query_id)
        q.recovering = False
        return self._durable(q, doc.batch_id)
