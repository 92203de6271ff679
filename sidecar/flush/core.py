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
from typing import Generic, NamedTuple, TypeVar

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
    LeaseLapsed,
    LeaseReleased,
    LeaseReported,
    LeftPending,
    Listed,
    NotOwner,
    PassBegun,
    PassEnded,
    RecheckWanted,
    RedisSaid,
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
        (``sidecar.flush.events``), in order. Each event's handler below says what it does."""
        match event:
            case BlobRead(query_id, stored, since, term):
                return self._read(query_id, stored, since, term)
            case AckWanted(query_id, batch, waiter):
                return self._ack(query_id, batch, waiter)
            case AckGone(query_id, waiter):
                self._ack_gone(query_id, waiter)
            case HeldElsewhere(query_id, holder):
                return self._held_elsewhere(query_id, holder)
            case RecheckWanted(query_id, every_s):
                return [Do.READ] if self._recheck_due(query_id, every_s) else []
            case PassBegun(query_id):
                self.record(query_id).flight = Flight.IN_PASS
            case PassEnded(query_id):
                return [Do.WAKE] if self._end(query_id) else []
            case LeftPending(query_ids):
                for query_id in query_ids:
                    self.record(query_id).recovering = True
            case RedisSaid(query_id, batch, resets, since, recorded, judge):
                return self._redis_says(query_id, batch, resets, since, recorded, judge=judge)
            case RowsApplied(rows, since):
                return self._applied(rows, since)
            case RowsVoid(query_ids):
                for query_id in query_ids:
                    if (q := self._queries.get(query_id)) is not None:
                        q.row = None
            case Checked(pending, now_ms):
                self._checked(pending, now_ms)
            case FlushStarted(query_id):
                return self._take_row(query_id)
            case WriteBegun(query_id, base):
                return [Do.SEND] if self._begin_write(query_id, base) else []
            case BlobWritten(query_id, stored, reset):
                return self._reset(query_id, stored) if reset else self._wrote(query_id, stored)
            case WriteRefused(query_id):
                self._evidence(q := self.record(query_id))
                self._advance(q, Refused())
            case WriteUnsure(query_id, lowered_to):
                self._evidence(q := self.record(query_id))  # a read begun before: no floor
                self._advance(q, Unsure(lowered_to))
            case WriteNotSent(query_id):
                if (q := self._queries.get(query_id)) is not None:
                    q.blob = advance(q.blob, Abandoned())
            case FlushMarked(query_id):
                # Redis' flushed batch is the blob's again: a Redis read begun before, which
                # may show the flushed batch before this write, is no evidence.
                if (q := self._queries.get(query_id)) is not None:
                    self._evidence(q)
            case Skipped(query_id):
                q = self._queries.get(query_id)
                return _answer(self._durable(q)) if q is not None else []
            case Flushed(query_id):
                # Its retry schedule starts over; a recovered query is no longer due for that.
                if (q := self._queries.get(query_id)) is not None:
                    q.failures, q.retry_at, q.recovering = 0, 0.0, False
            case FlushFailed(query_id, retriable, retry_after_s):
                return [RetryIn(self._failed(query_id, retriable, retry_after_s))]
            case Built(query_id, thinned):
                q = self.record(query_id)
                first = thinned and not q.thinned  # logged once until it fits again
                q.thinned = thinned
                return [Do.LOG_THINNED] if first else []
            case SnapshotTaken(query_id, ref):
                # Its next document names it if it follows the document's marker. A query's
                # snapshots are taken one at a time: the last told is the newest.
                if (q := self._queries.get(query_id)) is not None:
                    q.snapshot, q.snapshot_at = ref, self._clock()
            case Doubted(query_id):
                self.record(query_id).unverified = True
            case Listed(query_id, version):
                self._listed(query_id, version)
            case LeaseReported(query_id, version):
                self._lease_version(query_id, version)
            case LeaseLapsed(query_id):
                self._lapsed(query_id)
            case BlobCreated(query_id, version):
                self._evidence(q := self.record(query_id))
                self._advance(q, Created(version), self._stamp)
            case LeaseReleased(query_id):
                # Released for retirement, then seen again: a new lease starts in ACQUIRING.
                if (q := self._queries.get(query_id)) is not None:
                    q.lease = QueryLease(query_id, q.lease.label)
            case AdminOp(query_id):
                self._admin_op(query_id)
            case Retired(query_id):
                # One removal. Acks still waiting time out; anything begun before (a read, a
                # flush of a row read before) finds its record gone and keeps nothing.
                self._stamp += 1
                self._last_op = self._stamp
                self._queries.pop(query_id, None)
            case _:
                raise TypeError(f"not an event of the flush core: {event!r}")
        return []

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
        """The queries whose blob must be read and compared with Redis (:class:`LeaseReported`,
        :class:`Listed`, :class:`Doubted`)."""
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
                return Plan(Step.READ)  # compared with Redis first (LeaseReported, Doubted)
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

    # --- what the events do ---------------------------------------------------------------

    def _evidence(self, q: QueryState[W, L]) -> None:
        self._stamp += 1
        q.evidence = self._stamp

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

    def _held_term(self, q: QueryState[W, L]) -> int | None:
        return q.lease.term if q.lease.state is LeaseState.HELD else None

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

    def _read(self, query_id: str, stored: Stored, since: int, term: int | None) -> list[Action[W]]:
        """:class:`BlobRead`. Begun before newer evidence, an admin op or a retirement of the
        query, the read is not kept: it could raise a reset floor back. No record is made for
        a query without a blob. The floor to use after it is :meth:`floor` (None: the read's)."""
        q = self._queries.get(query_id)
        if q is None:
            if stored.version is None or self._last_op > since:
                return []
            q = self.record(query_id)
        elif q.evidence > since:
            return []
        held = term if term is not None and self._held_term(q) == term else None
        answered = self._advance(q, Read(stored, held), since)
        if not isinstance(q.blob, Writing):
            self._evidence(q)
        return _answer(answered)

    def _recheck_due(self, query_id: str, every_s: float) -> bool:
        """Whether ingest may read the blob again now (at most every ``every_s`` per query);
        if so, that read is counted from now."""
        q = self._queries.get(query_id)
        if q is None:
            return True
        now = self._clock()
        if now - q.rechecked_at < every_s:
            return False
        q.rechecked_at = now
        return True

    def _ack(self, query_id: str, batch: int, waiter: W) -> list[Action[W]]:
        """:class:`AckWanted`. Never answered from memory: a twin on its own Redis may have
        broken the lease and reset the blob lower since it was last seen here. A batch the
        blob held as last known is confirmed by a read (:attr:`Do.READ`, else the next flush
        check's); a newer one waits for its write (:attr:`Do.WAKE` unless the query is in a
        pass, then woken at its end, or backing off)."""
        q = self.record(query_id)
        if q.lease.held_elsewhere():
            return [NotOwner((waiter,))]
        # Its own stamp: a read or a write begun before it is no evidence for it (the store
        # may lose the batch between that read and this ack).
        self._stamp += 1
        made = self._stamp
        if q.blob.durable >= batch:
            q.confirming.append(Waiting(batch, waiter, made))
            q.unverified = True  # due at the next check, read there too if the shell's is not
            return [Do.READ]
        q.acks.append(Waiting(batch, waiter, made))
        if q.flight is not Flight.IDLE:
            q.flight = Flight.DEFERRED
            return []
        return [Do.WAKE] if self._clock() >= q.retry_at else []

    def _ack_gone(self, query_id: str, waiter: W) -> None:
        q = self._queries.get(query_id)
        if q is not None:
            q.acks = [a for a in q.acks if a.waiter is not waiter]
            q.confirming = [a for a in q.confirming if a.waiter is not waiter]

    def _held_elsewhere(self, query_id: str, holder: str | None) -> list[Action[W]]:
        """:class:`HeldElsewhere`: the acks waiting are answered ``not_owner``."""
        q = self._queries.get(query_id)
        if q is None:
            return []
        if holder is not None:
            q.holder = holder
        waiting = tuple(a.waiter for a in q.acks + q.confirming)
        q.acks, q.confirming = [], []
        return [NotOwner(waiting)] if waiting else []

    def _end(self, query_id: str) -> bool:
        """:class:`PassEnded`. True: an ack deferred meanwhile still waits, so wake the loop
        for the next write now (group commit); at most once per deferred ack, so nothing
        spins."""
        q = self._queries.get(query_id)
        if q is None:
            return False
        deferred = q.flight is Flight.DEFERRED
        q.flight = Flight.IDLE
        return deferred and q.acks_wait and self._clock() >= q.retry_at

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
        """:class:`LeaseReported`. A blob seen at another version changed under the lease (the
        store went back, or was restored): forgotten. Unless it is seen at that very version
        (or being written), the query is unverified: due, read and compared with Redis at the
        next flush check."""
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

    def _listed(self, query_id: str, version: str | None) -> None:
        """:class:`Listed`: what the blob was seen to hold is forgotten unless seen at that
        very version (or being written), and it is unverified."""
        q = self.record(query_id)
        if isinstance(q.blob, Seen) and q.blob.stored.version != version:
            self._evidence(q)  # a read begun before may hold the old version too
            q.blob, q.behind = Unread(q.blob.batch), None
        q.unverified = True

    def _applied(self, rows: tuple[PendingQuery, ...], since: int) -> list[Action[W]]:
        """:class:`RowsApplied`, in the order applied: the last of a query is its latest. Each
        row's flushed batch is Redis' word on the blob (another owner's reset sets it lower
        than what was seen here): the acks it answers."""
        actions: list[Action[W]] = []
        for row in rows:
            self.record(row.query_id).row = (row, since)
            if row.flushed_batch_id is not None:
                actions += self._redis_says(
                    row.query_id, row.flushed_batch_id, row.resets, since, row.flushed_reset
                )
        return actions

    def _take_row(self, query_id: str) -> list[Action[W]]:
        """:class:`FlushStarted`: the query's kept row, for a flush an ack waits on; taken
        either way (a row read for the flush is newer)."""
        q = self._queries.get(query_id)
        if q is None or q.row is None:
            return []
        (row, since), q.row = q.row, None
        return [UseRow(row, since)] if q.acks_wait else []

    def _checked(self, pending: frozenset[str], now_ms: int) -> None:
        """:class:`Checked`: each record says whether it is pending, and the rows of those no
        longer pending are dropped (flushed since they were applied)."""
        for q in self._queries.values():
            q.pending = q.query_id in pending
            if q.row is not None and q.row[0].snapshot_ms < now_ms and not q.pending:
                q.row = None

    def _begin_write(self, query_id: str, base: Seen) -> bool:
        """:class:`WriteBegun`; False, and nothing begun, when the blob is no longer seen as
        ``base`` (a read meanwhile found another writer's change, or forgot it): plan again."""
        q = self.record(query_id)
        if q.blob != base:
            return False
        q.blob = advance(q.blob, Begin())
        q.write_began = self._stamp
        return True

    def _wrote(self, query_id: str, stored: Stored) -> list[Action[W]]:
        q = self.record(query_id)
        self._evidence(q)
        q.holder = None
        return _answer(self._advance(q, Wrote(stored), q.write_began))

    def _reset(self, query_id: str, stored: Stored) -> list[Action[W]]:
        """A reset's write landed: acks follow it down, so later batches above it are stored
        and acknowledged again; its retries start over."""
        q = self.record(query_id)
        actions = self._wrote(query_id, stored)
        q.snapshot = stored.document.snapshot if stored.document is not None else None
        q.failures, q.retry_at, q.recovering = 0, 0.0, False
        q.resets = None  # this reset counted one more in Redis: news to no one here
        return actions

    def _lapsed(self, query_id: str) -> None:
        """:class:`LeaseLapsed`: what the blob holds may change under another writer."""
        q = self._queries.get(query_id)
        if q is not None:
            self._evidence(q)
            q.blob = advance(q.blob, Lapsed())
            q.behind, q.unverified = None, False  # judged again under the next term
            q.uncompared = False

    def _marker_stale(self, q: QueryState[W, L]) -> bool:
        blob = q.blob
        if not isinstance(blob, Seen) or blob.stored.document is None or q.snapshot is None:
            return False
        return (
            q.snapshot != q.named
            and follows(q.snapshot, q.named)
            and (q.snapshot.batch_id <= blob.stored.document.batch_id)
        )

    def _failed(self, query_id: str, retriable: bool, retry_after_s: float | None) -> float:
        """:class:`FlushFailed`: seconds until its next try. Not ``retriable`` (an operator
        must act first) waits the full cap; ``retry_after_s`` (the store's) at least that."""
        q = self.record(query_id)
        q.failures += 1
        delay = self._backoff.after(
            q.failures, give_up_ramp=not retriable, at_least_s=retry_after_s or 0.0
        )
        q.retry_at = self._clock() + delay
        return delay

    def _admin_op(self, query_id: str) -> None:
        """:class:`AdminOp`: rows read before now are void (for a query retired meanwhile,
        whose record is gone, every new record starts after it)."""
        self._stamp += 1
        self._last_op = self._stamp
        q = self._queries.get(query_id)
        if q is not None:
            q.generation = q.evidence = self._stamp


def _answer(waiters: list[W]) -> list[Action[W]]:
    return [Answer(tuple(waiters))] if waiters else []
