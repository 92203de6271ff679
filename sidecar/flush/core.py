"""The flush core: what this daemon knows of each query's blob, and every decision made on
it. Pure and sans-IO, like the protocol: no event loop, no store, no Redis.

One door: :meth:`FlushCore.step` takes an event (``sidecar.flush.events``: a fact about a
query — its blob read, written, refused; an ack wanted; Redis' word; the lease lost) and
returns the actions that follow (answer these acks, wake the flush loop, read the blob now,
send the write begun, retry in so long). The shell (``sidecar.flush.blob_state`` and
``sidecar.flush.lease_manager``) performs the reads and writes, tells every outcome as an
event and carries out the actions; nothing else changes a record. Questions (what the blob
holds, whether a query is due, the plan for a row) are read-only methods::

    shell ──event──▶ step(records, event) ──actions──▶ shell ──I/O──▶ store, Redis
      ▲                    │ plan / floor / due (read-only)              │
      └────────────────────┴──────────────── outcome, as an event ◀──────┘

One :class:`QueryState` per query holds all of it: **what the blob holds** (``Blob``, one
value, moved only by ``sidecar.flush.blob.advance``, a closed table), the query's lease
(``sidecar.flush.lease.QueryLease``), the acks waiting, its place in a flush pass
(:class:`Flight`), the last row an apply returned (blob ack mode), its retry schedule and its
admin-op stamps. Retiring a query is one removal.

Invariants (``tests/unit/test_flush_simulation.py`` drives this module and the real flusher
through random interleavings and checks them after every step;
``tests/unit/test_flush_core_simulation.py`` drives this module alone against a model of the
store, Redis and another writer, with defects put back as mutants):

1. **Never backwards.** A write is planned only for a batch newer than what the blob is seen to
   hold, and only from :class:`Seen`: it names the blob's version (``If-Match``), so a blob
   another writer changed since is never overwritten — the store refuses, the core forgets
   (:class:`Unread`), and the blob is read again. No blob moves backwards except by an admin
   reset.
2. **A reset is never undone.** Every admin op (reset, retire) stamps its query. A Redis row
   read before the stamp is never flushed, and Redis' flushed batch read before it is no
   evidence of what the blob holds; a flush that had to read the blob reads its row again
   (the row may predate another owner's reset).
3. **An ack is answered only when its batch is in the blob**: known from a read, a write, a
   reset, or Redis' flushed batch read after the newest such evidence.
4. **Acknowledged batches become durable once faults stop**: a failed write is retried after
   a backoff; an ack that arrives while its query is in a pass wakes the loop when the pass
   ends, so it is never left for a whole interval.
5. **One writer per lease**: a write is planned only under a held lease (the shell checks its
   term right before the write); an ack of a query whose lease another daemon holds is
   answered ``not_owner`` at once, never left to time out.

**Redis ahead of the blob.** Redis' flushed batch above what the blob is seen to hold is
evidence of another writer only while this daemon does not hold the lease. Under the lease,
no one else writes the blob; so when the blob, *read under the lease held now*, holds a batch
below Redis' flushed one and no reset was recorded since, the blob went back by a way no
writer takes: the store lost writes (a crash that loses its last writes, an account failover,
a point-in-time or version restore), or a daemon on another Redis reset the query. The two
are told apart by the reset record: Redis keeps, with its flushed batch, the reset record of
the document that batch is in (``flushed_reset``); a blob whose document carries the same
record (or none, where Redis has none) is an older state of the same timeline — the store
lost writes: the newest acknowledged batch is written over it (If-Match on the version just
read; never below what it holds) and the query's :class:`Behind` is reported once. A
document carrying a reset record Redis never saw is another daemon's reset: it is never
written over (:attr:`Step.REFUSE`) until an operator resets the query here. A blob read
under the lease by another part (ingest's floor, an admin op) is compared the same way before
a flush writes over it (:attr:`Step.COMPARE`: the row read again). Where Redis has
no record (written by a version before it was kept), a document whose reset replaced a batch
at or above Redis' flushed one is taken for such a reset. A blob written here and contradicted
this way is read before anything else is decided. The lease's own calls tell the blob's
version too: a blob seen here at one version and reported at another by a renewal changed
under the lease, and a lease acquired anew leaves the blob unknown; either way the query is
*unverified* — due at the next flush check whatever its updates, read, and compared with
Redis — so an idle query's blob that went back is rewritten too.

Stamps: one counter for the whole daemon, advanced by every admin op (and retirement) and
every piece of evidence about a blob (a write's answer, a reset, a read kept). A read of Redis
or of the blob remembers the stamp at its start (:attr:`FlushCore.stamp`); what it returns is
kept for a query only if nothing newer happened to that query since.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

from sidecar.backoff import Backoff
from sidecar.buffer.lua import NO_BLOB
from sidecar.buffer.rows import PendingQuery
from sidecar.flush.blob import (
    Abandoned,
    Begin,
    Behind,
    Blob,
    BlobEvent,
    Created,
    Lapsed,
    Read,
    RedisSays,
    Refused,
    Seen,
    Unread,
    Unsure,
    Writing,
    Wrote,
    advance,
    reset_unrecorded,
)
from sidecar.flush.events import (
    AckGone,
    AckWanted,
    Action,
    AdminOp,
    Answer,
    BlobCreated,
    BlobRead,
    BlobWritten,
    Built,
    Checked,
    Do,
    Doubted,
    Event,
    Flushed,
    FlushFailed,
    FlushMarked,
    FlushStarted,
    HeldElsewhere,
    LeaseAcquired,
    LeaseAcquiring,
    LeaseLapsed,
    LeaseLetGo,
    LeaseRenewed,
    LeftPending,
    Listed,
    NotOwner,
    PassBegun,
    PassEnded,
    RecheckWanted,
    RedisSaid,
    RenewFailed,
    Report,
    Retired,
    RetryIn,
    RowsApplied,
    RowsVoid,
    Skipped,
    SnapshotTaken,
    UseRow,
    W,
    WriteBegun,
    WriteNotSent,
    WriteRefused,
    WriteUnsure,
)
from sidecar.flush.lease import LeaseState, QueryLease
from sidecar.model.document import SnapshotRef, Stored, follows

#: What the shell keeps of each query (its locks and flags, ``sidecar.flush.shell``): on the
#: query's record, dropped with it.
L = TypeVar("L")


# --- the record of one query ------------------------------------------------------------------


class Flight(enum.Enum):
    """A query's place in the flush loop."""

    IDLE = "idle"
    #: In a pass (read, or being written): a new ack waits for the pass to end.
    IN_PASS = "in pass"
    #: In a pass, and an ack arrived during it: wake the loop when it ends (group commit).
    DEFERRED = "deferred"


class Waiting(NamedTuple, Generic[W]):
    """An ack waiting for its batch in the blob."""

    batch: int
    waiter: W
    #: The stamp it was made at: evidence begun before it does not answer it.
    made: int


@dataclass(slots=True, eq=False)
class QueryState(Generic[W, L]):
    """Everything this daemon keeps of one query's blob. Only :class:`FlushCore` changes it."""

    query_id: str
    #: The shell's part (``sidecar.flush.shell.QueryShell``): the core never reads it.
    shell: L
    lease: QueryLease
    #: Stamp of the query's last admin op (at creation: the last one anywhere): Redis rows
    #: read before it are void.
    generation: int
    #: Stamp of the newest evidence about the blob or admin op: reads begun before are not
    #: kept.
    evidence: int
    label: str = ""
    blob: Blob = field(default_factory=Unread)
    #: Acks waiting for a batch to be durable; and those whose batch the blob held as last
    #: known here, which only a read or a write begun after them answers (memory may be
    #: stale: a twin on its own Redis may have reset the blob lower, or the store lost the
    #: batch since).
    acks: list[Waiting[W]] = field(default_factory=list)
    confirming: list[Waiting[W]] = field(default_factory=list)
    #: The stamp the evidence of what ``blob`` holds began at (a read's start, a write's
    #: begin, a creation): it answers only acks made at or before it.
    seen_since: int = 0
    #: The stamp the write in flight began at.
    write_began: int = 0

    @property
    def acks_wait(self) -> bool:
        return bool(self.acks or self.confirming)

    flight: Flight = Flight.IDLE
    #: The last row an apply returned (blob ack mode), with the stamp its call began at.
    row: tuple[PendingQuery, int] | None = None
    #: Left pending by a previous run: due whatever the thresholds until flushed.
    recovering: bool = False
    #: Updates pending (or an unreadable count) in Redis at the last flush check: not to be
    #: retired.
    pending: bool = False
    #: The last document written had its history thinned (logged once until it fits).
    thinned: bool = False
    #: When ingest last read the blob again after a refusal by the floor alone.
    rechecked_at: float = float("-inf")
    #: Failed flushes in a row, and when the next may start.
    failures: int = 0
    retry_at: float = 0.0
    #: Who last wrote the blob (host and pid), while another daemon holds its lease.
    holder: str | None = None
    #: Redis' count of the query's resets in the last row seen (None: none seen since this
    #: daemon's own reset, or ever).
    resets: int | None = None
    #: The query's newest checkpoint snapshot, which its next document names
    #: (``sidecar.snapshot``); and the one the document seen last names (kept by retention).
    snapshot: SnapshotRef | None = None
    named: SnapshotRef | None = None
    #: When ``snapshot`` was told (the core's clock): a query with nothing pending writes its
    #: document again to name it once that is older than the time threshold.
    snapshot_at: float = 0.0
    #: The blob, read under the lease, below Redis' flushed batch (module docstring); and
    #: the last such finding reported (each is said once).
    behind: Behind | None = None
    reported: Behind | None = None
    #: The blob's version, under the lease held now, is not known to be the one seen (the
    #: lease acquired anew, or a renewal reported another): due, to be read and compared
    #: with Redis, whatever its updates.
    unverified: bool = False
    #: The blob was read under the lease held now by another part than the flush (ingest's
    #: floor, an admin op) and not compared with Redis since: the flush compares it first
    #: (:attr:`Step.COMPARE`), else a blob that went back would be written over unreported.
    uncompared: bool = False

    @property
    def floor(self) -> int | None:
        """The batch the blob holds for ingest's purpose (no update older is stored): exact
        when seen; during a write, the one it replaces; None when not known."""
        match self.blob:
            case Seen():
                return self.blob.batch
            case Writing(base):
                return base.batch
        return None


class Step(enum.Enum):
    #: Read the blob first: what it holds is not known.
    READ = "read"
    #: The blob already holds this batch or a newer one: record it as flushed, write nothing.
    SKIP = "skip"
    #: Write a document of the row's checkpoint over ``base`` (naming its version).
    WRITE = "write"
    #: Write nothing: the blob holds a reset this daemon's Redis never recorded
    #: (:class:`Behind`); an operator decides.
    REFUSE = "refuse"
    #: Read the row again before writing: the blob was read under the lease by another part
    #: (ingest's floor, an admin op) and is compared with Redis first (:class:`Behind`).
    COMPARE = "compare"


@dataclass(frozen=True, slots=True)
class Plan:
    step: Step
    #: What the blob is seen to hold (SKIP, WRITE).
    base: Seen | None = None


class FlushCore(Generic[W, L]):
    """Every query's record, and the decisions on it: told events through :meth:`step`,
    asked questions through its read-only methods."""

    def __init__(
        self,
        backoff: Backoff,
        *,
        clock: Callable[[], float],
        shell: Callable[[], L],
    ) -> None:
        """``backoff``: the delays of failed flushes (its schedule; the count is per query
        here); ``clock``: monotonic seconds; ``shell``: makes a new query's shell part."""
        self._backoff = backoff
        self._clock = clock
        self._make_shell = shell
        self._queries: dict[str, QueryState[W, L]] = {}
        self._stamp = 0
        #: Stamp of the last admin op or retirement, of any query.
        self._last_op = 0

    # --- the door in ----------------------------------------------------------------------

    def step(self, event: Event[W]) -> list[Action[W]]:
        """Apply ``event`` to the records; the actions that follow, for the shell to carry out
        (``sidecar.flush.events``), in order. Each event has one handler below, found by its
        type (:data:`_HANDLERS`): one lookup a step, however many kinds of event there are."""
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"not an event of the flush core: {event!r}")
        return handler(self, event)

    # --- questions (read-only) ------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._queries)

    def __contains__(self, query_id: object) -> bool:
        return query_id in self._queries

    def __iter__(self) -> Iterator[QueryState[W, L]]:
        return iter(list(self._queries.values()))

    @property
    def stamp(self) -> int:
        """Take it before a read: what the read returns is judged against it."""
        return self._stamp

    def get(self, query_id: str) -> QueryState[W, L] | None:
        return self._queries.get(query_id)

    def record(self, query_id: str, label: str | None = None) -> QueryState[W, L]:
        """The query's record, created empty when new (for the shell's locks on it, before
        any event); ``label`` updates its name."""
        q = self._queries.get(query_id)
        if q is None:
            q = self._queries[query_id] = QueryState(
                query_id,
                self._make_shell(),
                QueryLease(query_id, label or query_id),
                self._last_op,
                self._last_op,
            )
        if label:
            q.label = q.lease.label = label
        return q

    def label(self, query_id: str) -> str | None:
        """The query's name as a Redis row told it; None while not told."""
        q = self._queries.get(query_id)
        return q.label or None if q is not None else None

    def held_term(self, query_id: str) -> int | None:
        """The query's lease term while HELD (None: not held): take it before a read."""
        q = self._queries.get(query_id)
        return self._held_term(q) if q is not None else None

    def floor(self, query_id: str) -> int | None:
        """The batch the query's blob holds as far as known, without I/O; None: not known."""
        q = self._queries.get(query_id)
        return q.floor if q is not None else None

    def waiting(self) -> list[str]:
        """The queries acks wait on."""
        return [q.query_id for q in self._queries.values() if q.acks_wait]

    def in_flight(self, query_id: str) -> bool:
        q = self._queries.get(query_id)
        return q is not None and q.flight is not Flight.IDLE

    def due(self, query_id: str) -> bool:
        """Due whatever the thresholds: an ack waits on it, a previous run left it pending, or
        its blob is unverified."""
        q = self._queries.get(query_id)
        return q is not None and (q.acks_wait or q.recovering or q.unverified)

    def current(self, query_id: str, since: int) -> bool:
        """Whether a Redis row of the query read at stamp ``since`` may still be flushed (no
        admin op on it since; for a query not known then, none anywhere)."""
        q = self._queries.get(query_id)
        return (q.generation if q is not None else self._last_op) <= since

    def behind(self, query_id: str) -> Behind | None:
        """The blob's current finding below Redis, reported or not."""
        q = self._queries.get(query_id)
        return q.behind if q is not None else None

    def seen_at(self, query_id: str, version: str | None, batch: int) -> bool:
        """Whether the blob was seen here at ``version`` (None: seen absent) holding ``batch``
        or a newer one. Not seen at all is never a match: a blob this daemon never read may
        have gone since its last flush; nor is one seen below ``batch``."""
        q = self._queries.get(query_id)
        blob = q.blob if q is not None else None
        return isinstance(blob, Seen) and blob.stored.version == version and blob.batch >= batch

    def unverified(self) -> list[str]:
        """The queries whose blob must be read and compared with Redis (:class:`LeaseAcquired`,
        :class:`LeaseRenewed`, :class:`Listed`, :class:`Doubted`)."""
        return [q.query_id for q in self._queries.values() if q.unverified]

    def plan(self, query_id: str, batch: int) -> Plan:
        """What to do with a due row of ``batch``."""
        q = self._queries.get(query_id)
        if q is None:
            return Plan(Step.READ)
        blob = q.blob
        match blob:
            case Seen() if q.confirming:
                return Plan(Step.READ)  # an ack waits for a read made after it
            case Seen() if q.unverified and blob.read_under != self._held_term(q):
                return Plan(Step.READ)  # compared with Redis first (a lease call, Doubted)
            case Seen() if q.unverified:
                # Read under this term by another part (an ack's read) and not compared with
                # Redis since: the row alone, then judged. A SKIP would leave it due for ever.
                return Plan(Step.COMPARE, blob)
            case Seen() if batch <= blob.batch and not (
                batch == blob.batch and self._marker_stale(q)
            ):
                return Plan(Step.SKIP, blob)
            case Seen() if q.behind is not None and q.behind.reset is not None:
                return Plan(Step.REFUSE, blob)
            case Seen() if (
                q.uncompared and batch > blob.batch and blob.read_under == self._held_term(q)
            ):
                return Plan(Step.COMPARE, blob)  # (Redis' flushed batch is at most the row's)
            case Seen() if blob.stored.version is not None:
                return Plan(Step.WRITE, blob)
        # Not seen, or seen absent (before the lease created it): no version to name.
        return Plan(Step.READ)

    def ready(self, query_id: str) -> bool:
        """Whether the query may be flushed now (not backing off after a failure)."""
        q = self._queries.get(query_id)
        return q is None or self._clock() >= q.retry_at

    def failures(self, query_id: str) -> int:
        q = self._queries.get(query_id)
        return q.failures if q is not None else 0

    def marker_due(self, query_id: str, older_than_s: float) -> bool:
        """Whether the query's document should be written again, with nothing pending, to
        name its newest snapshot (told over ``older_than_s`` ago, not named, on the marker's
        timeline): a query gone idle still names the snapshot of its last batch."""
        q = self._queries.get(query_id)
        return (
            q is not None
            and self._marker_stale(q)
            and self._clock() - q.snapshot_at >= older_than_s
        )

    def markers_due(self, older_than_s: float) -> list[str]:
        """The queries :meth:`marker_due` says so of."""
        return [q for q in self._queries if self.marker_due(q, older_than_s)]

    def snapshot_marker(self, query_id: str) -> tuple[bool, SnapshotRef | None]:
        """The marker of the query's document, and whether it is known: the blob seen (read
        or written) while this daemon holds its lease — it moves only under that lease. Not
        known (another process may have reset it meanwhile): tell :class:`Doubted`, and the
        blob is read at the next flush check."""
        q = self._queries.get(query_id)
        if q is None:
            return False, None
        blob = q.blob.base if isinstance(q.blob, Writing) else q.blob
        if self._held_term(q) is None or not isinstance(blob, Seen):
            return False, None
        return True, q.named

    def snapshot_of(self, query_id: str) -> SnapshotRef | None:
        q = self._queries.get(query_id)
        return q.snapshot if q is not None else None

    # --- what each event does (one handler an event, :data:`_HANDLERS`) ---------------------

    def _on_blob_read(self, e: BlobRead) -> list[Action[W]]:
        """Begun before newer evidence, an admin op or a retirement of the query, the read is
        not kept: it could raise a reset floor back. No record is made for a query without a
        blob. The floor to use after it is :meth:`floor` (None: the read's)."""
        q = self._queries.get(e.query_id)
        if q is None:
            if e.stored.version is None or self._last_op > e.since:
                return []
            q = self.record(e.query_id)
        elif q.evidence > e.since:
            return []
        held = e.term if e.term is not None and self._held_term(q) == e.term else None
        answered = self._advance(q, Read(e.stored, held), e.since)
        if not isinstance(q.blob, Writing):
            self._evidence(q)
        return _answer(answered)

    def _on_ack_wanted(self, e: AckWanted[W]) -> list[Action[W]]:
        """Never answered from memory: a twin on its own Redis may have broken the lease and
        reset the blob lower since it was last seen here. A batch the blob held as last known
        is confirmed by a read (:attr:`Do.READ`, else the next flush check's); a newer one
        waits for its write (:attr:`Do.WAKE` unless the query is in a pass, then woken at its
        end, or backing off)."""
        q = self.record(e.query_id)
        if q.lease.held_elsewhere():
            return [NotOwner((e.waiter,))]
        # Its own stamp: a read or a write begun before it is no evidence for it (the store
        # may lose the batch between that read and this ack).
        self._stamp += 1
        made = self._stamp
        if q.blob.durable >= e.batch:
            q.confirming.append(Waiting(e.batch, e.waiter, made))
            q.unverified = True  # due at the next check, read there too if the shell's is not
            return [Do.READ]
        q.acks.append(Waiting(e.batch, e.waiter, made))
        if q.flight is not Flight.IDLE:
            q.flight = Flight.DEFERRED
            return []
        return [Do.WAKE] if self._clock() >= q.retry_at else []

    def _on_ack_gone(self, e: AckGone[W]) -> list[Action[W]]:
        q = self._queries.get(e.query_id)
        if q is not None:
            q.acks = [a for a in q.acks if a.waiter is not e.waiter]
            q.confirming = [a for a in q.confirming if a.waiter is not e.waiter]
        return []

    def _on_held_elsewhere(self, e: HeldElsewhere) -> list[Action[W]]:
        return self._not_owner(e.query_id, e.holder)

    def _on_recheck_wanted(self, e: RecheckWanted) -> list[Action[W]]:
        """Ingest may read the blob again now (at most every ``every_s`` per query); if so,
        that read is counted from now."""
        q = self._queries.get(e.query_id)
        if q is None:
            return [Do.READ]
        now = self._clock()
        if now - q.rechecked_at < e.every_s:
            return []
        q.rechecked_at = now
        return [Do.READ]

    def _on_pass_begun(self, e: PassBegun) -> list[Action[W]]:
        self.record(e.query_id).flight = Flight.IN_PASS
        return []

    def _on_pass_ended(self, e: PassEnded) -> list[Action[W]]:
        """An ack deferred meanwhile still waits: wake the loop for the next write now (group
        commit); at most once per deferred ack, so nothing spins."""
        q = self._queries.get(e.query_id)
        if q is None:
            return []
        deferred = q.flight is Flight.DEFERRED
        q.flight = Flight.IDLE
        return [Do.WAKE] if deferred and q.acks_wait and self._clock() >= q.retry_at else []

    def _on_left_pending(self, e: LeftPending) -> list[Action[W]]:
        for query_id in e.query_ids:
            self.record(query_id).recovering = True
        return []

    def _on_redis_said(self, e: RedisSaid) -> list[Action[W]]:
        return self._redis_says(
            e.query_id, e.batch, e.resets, e.since, e.recorded_reset, judge=e.judge
        )

    def _on_rows_applied(self, e: RowsApplied) -> list[Action[W]]:
        """In the order applied: the last row of a query is its latest. Each row's flushed
        batch is Redis' word on the blob (another owner's reset sets it lower than what was
        seen here): the acks it answers."""
        actions: list[Action[W]] = []
        for row in e.rows:
            self.record(row.query_id).row = (row, e.since)
            if row.flushed_batch_id is not None:
                actions += self._redis_says(
                    row.query_id, row.flushed_batch_id, row.resets, e.since, row.flushed_reset
                )
        return actions

    def _on_rows_void(self, e: RowsVoid) -> list[Action[W]]:
        for query_id in e.query_ids:
            if (q := self._queries.get(query_id)) is not None:
                q.row = None
        return []

    def _on_checked(self, e: Checked) -> list[Action[W]]:
        """Each record says whether it is pending, and the rows of those no longer pending are
        dropped (flushed since they were applied); each listed query's flushed batch is Redis'
        word on its blob: the acks it answers. One event a check, however many queries."""
        pending = {entry.query_id for entry in e.entries if entry.pending != 0}
        for q in self._queries.values():
            q.pending = q.query_id in pending
            if q.row is not None and q.row[0].snapshot_ms < e.now_ms and not q.pending:
                q.row = None
        actions: list[Action[W]] = []
        for entry in e.entries:
            actions += self._redis_says(
                entry.query_id, entry.flushed_batch_id, entry.resets, e.since, entry.flushed_reset
            )
        return actions

    def _on_flush_started(self, e: FlushStarted) -> list[Action[W]]:
        """The query's kept row, for a flush an ack waits on; taken either way (a row read for
        the flush is newer)."""
        q = self._queries.get(e.query_id)
        if q is None or q.row is None:
            return []
        (row, since), q.row = q.row, None
        return [UseRow(row, since)] if q.acks_wait else []

    def _on_write_begun(self, e: WriteBegun) -> list[Action[W]]:
        """Nothing begun when the blob is no longer seen as ``base`` (a read meanwhile found
        another writer's change, or forgot it): plan again."""
        q = self.record(e.query_id)
        if q.blob != e.base:
            return []
        q.blob = advance(q.blob, Begin())
        q.write_began = self._stamp
        return [Do.SEND]

    def _on_blob_written(self, e: BlobWritten) -> list[Action[W]]:
        q = self.record(e.query_id)
        actions = self._wrote(q, e.stored)
        if e.reset:
            # A reset's write landed: acks follow it down, so later batches above it are
            # stored and acknowledged again; its retries start over.
            q.snapshot = e.stored.document.snapshot if e.stored.document is not None else None
            q.failures, q.retry_at, q.recovering = 0, 0.0, False
            q.resets = None  # this reset counted one more in Redis: news to no one here
        return actions

    def _on_write_refused(self, e: WriteRefused) -> list[Action[W]]:
        self._evidence(q := self.record(e.query_id))
        self._advance(q, Refused())
        return []

    def _on_write_unsure(self, e: WriteUnsure) -> list[Action[W]]:
        self._evidence(q := self.record(e.query_id))  # a read begun before: no floor
        self._advance(q, Unsure(e.lowered_to))
        return []

    def _on_write_not_sent(self, e: WriteNotSent) -> list[Action[W]]:
        if (q := self._queries.get(e.query_id)) is not None:
            q.blob = advance(q.blob, Abandoned())
        return []

    def _on_flush_marked(self, e: FlushMarked) -> list[Action[W]]:
        # Redis' flushed batch is the blob's again: a Redis read begun before, which may show
        # the flushed batch before this write, is no evidence.
        if (q := self._queries.get(e.query_id)) is not None:
            self._evidence(q)
        return []

    def _on_skipped(self, e: Skipped) -> list[Action[W]]:
        q = self._queries.get(e.query_id)
        return _answer(self._durable(q)) if q is not None else []

    def _on_flushed(self, e: Flushed) -> list[Action[W]]:
        # Its retry schedule starts over; a recovered query is no longer due for that.
        if (q := self._queries.get(e.query_id)) is not None:
            q.failures, q.retry_at, q.recovering = 0, 0.0, False
        return []

    def _on_flush_failed(self, e: FlushFailed) -> list[Action[W]]:
        """Seconds until its next try (:class:`RetryIn`). Not ``retriable`` (an operator must
        act first) waits the full cap; ``retry_after_s`` (the store's) at least that."""
        q = self.record(e.query_id)
        q.failures += 1
        delay = self._backoff.after(
            q.failures, give_up_ramp=not e.retriable, at_least_s=e.retry_after_s or 0.0
        )
        q.retry_at = self._clock() + delay
        return [RetryIn(delay)]

    def _on_built(self, e: Built) -> list[Action[W]]:
        q = self.record(e.query_id)
        first = e.thinned and not q.thinned  # logged once until it fits again
        q.thinned = e.thinned
        return [Do.LOG_THINNED] if first else []

    def _on_snapshot_taken(self, e: SnapshotTaken) -> list[Action[W]]:
        # Its next document names it if it follows the document's marker. A query's snapshots
        # are taken one at a time: the last told is the newest.
        if (q := self._queries.get(e.query_id)) is not None:
            q.snapshot, q.snapshot_at = e.ref, self._clock()
        return []

    def _on_doubted(self, e: Doubted) -> list[Action[W]]:
        self.record(e.query_id).unverified = True
        return []

    def _on_listed(self, e: Listed) -> list[Action[W]]:
        """What the blob was seen to hold is forgotten unless seen at that very version (or
        being written), and it is unverified."""
        q = self.record(e.query_id)
        if isinstance(q.blob, Seen) and q.blob.stored.version != e.version:
            self._evidence(q)  # a read begun before may hold the old version too
            q.blob, q.behind = Unread(q.blob.batch), None
        q.unverified = True
        return []

    def _on_lease(
        self, e: LeaseAcquired | LeaseRenewed | LeaseAcquiring | RenewFailed | LeaseLetGo
    ) -> list[Action[W]]:
        """The lease's own moves (``sidecar.flush.lease``: its table refuses the rest); those
        that report the blob's version check what was seen of it."""
        q = self._queries.get(e.query_id)
        if q is None:
            return []
        lease = q.lease
        match e:
            case LeaseAcquiring(_, reason):
                lease.acquiring(reason)
            case LeaseAcquired(query_id, term, started, duration_s, renew_in_s, version):
                lease.acquired(term, started, duration_s, renew_in_s)
                # Whatever was known of the blob before this term is checked against it.
                self._lease_version(query_id, version)
            case LeaseRenewed(query_id, started, duration_s, renew_in_s, version):
                if lease.renewed(started, duration_s, renew_in_s):
                    # The blob changed under the lease (a store that went back, a restore)?
                    self._lease_version(query_id, version)
            case RenewFailed(_, retry_at):
                lease.renew_again_at(retry_at)
            case LeaseLetGo(query_id, reason, anew):
                lease.released(reason)
                if anew:  # released for retirement, then seen again: a new one, ACQUIRING
                    q.lease = QueryLease(query_id, lease.label)
        return []

    def _on_lease_lapsed(self, e: LeaseLapsed) -> list[Action[W]]:
        """LOST (``sidecar.flush.lease``), and what the blob holds may change under another
        writer now; contested, the acks waiting are answered ``not_owner``: this daemon cannot
        make them durable."""
        q = self._queries.get(e.query_id)
        if q is None:
            return []
        q.lease.lost(e.reason, e.now, e.backoff, contested=e.contested)
        self._evidence(q)
        q.blob = advance(q.blob, Lapsed())
        q.behind, q.unverified = None, False  # judged again under the next term
        q.uncompared = False
        return self._not_owner(e.query_id, None) if e.contested else []

    def _on_blob_created(self, e: BlobCreated) -> list[Action[W]]:
        self._evidence(q := self.record(e.query_id))
        self._advance(q, Created(e.version), self._stamp)
        return []

    def _on_admin_op(self, e: AdminOp) -> list[Action[W]]:
        """Rows read before now are void (for a query retired meanwhile, whose record is gone,
        every new record starts after it)."""
        self._stamp += 1
        self._last_op = self._stamp
        if (q := self._queries.get(e.query_id)) is not None:
            q.generation = q.evidence = self._stamp
        return []

    def _on_retired(self, e: Retired) -> list[Action[W]]:
        # One removal. Acks still waiting time out; anything begun before (a read, a flush of
        # a row read before) finds its record gone and keeps nothing.
        self._stamp += 1
        self._last_op = self._stamp
        self._queries.pop(e.query_id, None)
        return []

    # --- what several handlers do ------------------------------------------------------------

    def _evidence(self, q: QueryState[W, L]) -> None:
        self._stamp += 1
        q.evidence = self._stamp

    def _held_term(self, q: QueryState[W, L]) -> int | None:
        return q.lease.term if q.lease.state is LeaseState.HELD else None

    def _not_owner(self, query_id: str, holder: str | None) -> list[Action[W]]:
        """The acks waiting on the query are answered ``not_owner``."""
        q = self._queries.get(query_id)
        if q is None:
            return []
        if holder is not None:
            q.holder = holder
        waiting = tuple(a.waiter for a in q.acks + q.confirming)
        q.acks, q.confirming = [], []
        return [NotOwner(waiting)] if waiting else []

    def _wrote(self, q: QueryState[W, L], stored: Stored) -> list[Action[W]]:
        self._evidence(q)
        q.holder = None
        return _answer(self._advance(q, Wrote(stored), q.write_began))

    def _durable(self, q: QueryState[W, L]) -> list[W]:
        """The acks what the blob holds answers (they stop waiting): only by what was read or
        written (``Seen``, or the base of a write in flight), never by a batch remembered or
        said by Redis (``Unread``: a twin on its own Redis may have reset the blob lower);
        and only acks made before that evidence began. One made after, whose batch it holds,
        waits for a read begun after it (the store may have lost the batch meanwhile)."""
        blob = q.blob.base if isinstance(q.blob, Writing) else q.blob
        batch = blob.batch if isinstance(blob, Seen) else NO_BLOB
        held = [a for a in q.acks if a.batch <= batch]
        if not held:
            return []
        q.acks = [a for a in q.acks if a.batch > batch]
        late = [a for a in held if a.made > q.seen_since]
        if late:
            q.confirming.extend(late)
            q.unverified = True  # read at the next check, if the shell does not first
        return [a.waiter for a in held if a.made <= q.seen_since]

    def _advance(self, q: QueryState[W, L], event: BlobEvent, began: int | None = None) -> list[W]:
        """``event`` applied to what the blob holds; ``began``: the stamp the evidence began
        at (a read, a write, a creation); the acks answered."""
        before, q.blob = q.blob, advance(q.blob, event)
        if began is not None and isinstance(q.blob, Seen):
            q.seen_since = began if q.blob != before else max(q.seen_since, began)
        if isinstance(event, Read | Wrote) and isinstance(q.blob, Seen) and q.confirming:
            # News of the blob, kept (not a read during a write: its base is memory): it answers
            q.acks.extend(q.confirming)
            q.confirming = []
        if q.blob != before:
            q.behind = None  # judged again against Redis' next word
            q.uncompared = isinstance(q.blob, Seen) and q.blob.read_under is not None
            if isinstance(event, Wrote):
                q.reported = None  # written: a later finding is news again
        if isinstance(q.blob, Seen) and q.blob.stored.document is not None:
            q.named = q.blob.stored.document.snapshot
            ours = q.snapshot
            if ours is not None and ours != q.named and not follows(ours, q.named):
                q.snapshot = None  # of another timeline than the document's (a reset's)
        return self._durable(q)

    def _redis_says(
        self,
        query_id: str,
        batch: int | None,
        resets: int,
        since: int,
        recorded_reset: str | None = None,
        *,
        judge: bool = False,
    ) -> list[Action[W]]:
        """:class:`RedisSaid`: evidence unless newer evidence arrived since; the acks it
        answers. With ``judge``, after a read under the lease held now, it is the check of the
        blob against Redis: a blob below it, or with a reset Redis never kept, is
        :class:`Behind` (:class:`Report`, once per finding)."""
        q = self._queries.get(query_id)
        if q is None or q.evidence > since:
            return []
        reset = q.resets is not None and resets != q.resets
        q.resets = resets
        term = self._held_term(q)
        answered = [] if batch is None else self._advance(q, RedisSays(batch, reset, term))
        blob = q.blob
        if judge and isinstance(blob, Seen) and term is not None and blob.read_under == term:
            q.unverified = q.uncompared = False  # read under the lease, then Redis: compared
            if batch is not None and not reset and batch > blob.batch:
                doc = blob.stored.document
                foreign = reset_unrecorded(doc, batch, recorded_reset)
                q.behind = Behind(blob.batch, batch, doc if foreign else None)
        actions = _answer(answered)
        if judge and q.behind is not None and q.behind != q.reported:
            q.reported = q.behind
            actions.append(Report(q.behind))
        return actions

    def _lease_version(self, query_id: str, version: str | None) -> None:
        """A lease call reported the blob at ``version``. A blob seen at another version
        changed under the lease (the store went back, or was restored): forgotten. Unless it
        is seen at that very version (or being written), the query is unverified: due, read
        and compared with Redis at the next flush check."""
        q = self._queries.get(query_id)
        if q is None or version is None:
            return
        match q.blob:
            case Writing():
                return
            case Seen() if q.blob.stored.version == version:
                return
            case Seen():
                self._evidence(q)  # a read begun before may hold the old version too
                q.blob, q.behind = Unread(q.blob.batch), None
        q.unverified = True

    def _marker_stale(self, q: QueryState[W, L]) -> bool:
        blob = q.blob
        if not isinstance(blob, Seen) or blob.stored.document is None or q.snapshot is None:
            return False
        return (
            q.snapshot != q.named
            and follows(q.snapshot, q.named)
            and (q.snapshot.batch_id <= blob.stored.document.batch_id)
        )


def _answer(waiters: list[W]) -> list[Action[W]]:
    return [Answer(tuple(waiters))] if waiters else []


#: Each event's handler, by the event's type: :meth:`FlushCore.step` looks one up a step (a
#: ``match`` over every case costs a test per case before the one that fits: ~1.5 µs a step,
#: paid for each of thousands of queries a flush check).
_HANDLERS: dict[type, Callable[[FlushCore[Any, Any], Any], list[Action[Any]]]] = {
    BlobRead: FlushCore._on_blob_read,
    AckWanted: FlushCore._on_ack_wanted,
    AckGone: FlushCore._on_ack_gone,
    HeldElsewhere: FlushCore._on_held_elsewhere,
    RecheckWanted: FlushCore._on_recheck_wanted,
    PassBegun: FlushCore._on_pass_begun,
    PassEnded: FlushCore._on_pass_ended,
    LeftPending: FlushCore._on_left_pending,
    RedisSaid: FlushCore._on_redis_said,
    RowsApplied: FlushCore._on_rows_applied,
    RowsVoid: FlushCore._on_rows_void,
    Checked: FlushCore._on_checked,
    FlushStarted: FlushCore._on_flush_started,
    WriteBegun: FlushCore._on_write_begun,
    BlobWritten: FlushCore._on_blob_written,
    WriteRefused: FlushCore._on_write_refused,
    WriteUnsure: FlushCore._on_write_unsure,
    WriteNotSent: FlushCore._on_write_not_sent,
    FlushMarked: FlushCore._on_flush_marked,
    Skipped: FlushCore._on_skipped,
    Flushed: FlushCore._on_flushed,
    FlushFailed: FlushCore._on_flush_failed,
    Built: FlushCore._on_built,
    SnapshotTaken: FlushCore._on_snapshot_taken,
    Doubted: FlushCore._on_doubted,
    Listed: FlushCore._on_listed,
    LeaseAcquiring: FlushCore._on_lease,
    LeaseAcquired: FlushCore._on_lease,
    LeaseRenewed: FlushCore._on_lease,
    RenewFailed: FlushCore._on_lease,
    LeaseLetGo: FlushCore._on_lease,
    LeaseLapsed: FlushCore._on_lease_lapsed,
    BlobCreated: FlushCore._on_blob_created,
    AdminOp: FlushCore._on_admin_op,
    Retired: FlushCore._on_retired,
}
