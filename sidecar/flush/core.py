"""The flush core: what this daemon knows of each query's blob, and every decision made on
it. Pure and sans-IO, like the protocol: no event loop, no store, no Redis. The shell
(``sidecar.flush.blob_state``) performs the reads and writes the core asks for and tells it
what happened; it is the one door in: nothing else calls the core, and nothing sets a field
of its records.

One :class:`QueryState` per query holds all of it: **what the blob holds** (:data:`Blob`, one
value: :class:`Unread`, :class:`Seen` or :class:`Writing`), the query's lease
(``sidecar.flush.lease.QueryLease``), the acks waiting, its place in a flush pass, the last
row an apply returned (blob ack mode), its retry schedule and its admin-op stamps. Retiring a
query is one removal.

What the blob holds moves only through :func:`advance`, a closed table of (value, event)::

    Unread(durable) ─Read──────────────────────────────────────▶ Seen(version, document)
    Seen ──Begin (a write names the version it read)───────────▶ Writing(base: Seen)
    Writing ─Wrote───▶ Seen(new version)   ─Abandoned (never sent)─▶ Seen (its base)
            ─Refused (412: another writer changed it)──────────▶ Unread(base's batch)
            ─Unsure (timed out, connection lost: landed or not)─▶ Unread(base's batch, or
                                                                   lower: a reset's target)
    Unread | Seen ─Lapsed (the lease lost: another may write)──▶ Unread(its batch)
    Unread | Seen ─Created (the lease's empty blob, made now)──▶ Seen(version, no document)
    Unread | Seen ─RedisSays(batch) above the one seen, or a reset─▶ Unread(batch)
    Seen read under the lease held now ─RedisSays(batch) above it──▶ Seen (kept: see below)
    Seen written here, the lease held ─RedisSays(batch) above it───▶ Unread(its batch)

Every other move raises :class:`IllegalMove`: a write from :class:`Unread` (no version to
name), a second write while one is in flight, an answer with no write in flight.

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
from sidecar.flush.lease import LeaseState, QueryLease
from sidecar.model.document import CheckpointDocument, SnapshotRef, Stored, follows

#: A waiting ack's handle: whatever the shell settles when its batch is durable.
W = TypeVar("W")
#: What the shell keeps of each query (its locks and flags, ``sidecar.flush.shell``): on the
#: query's record, dropped with it.
L = TypeVar("L")


class IllegalMove(RuntimeError):
    """What the blob holds was asked to make a move :func:`advance` does not allow (a bug)."""


# --- what the blob holds: one value ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Unread:
    """Not known: never read, or forgotten (a write refused as another writer's, a write
    whose outcome is unknown, Redis naming another batch). ``durable``: the newest batch known
    to have been in the blob when it was last known (what acks count)."""

    durable: int = NO_BLOB


@dataclass(frozen=True, slots=True)
class Seen:
    """The blob is at ``stored.version`` holding ``stored.document``, as read or written here;
    ``read_under``: the lease term it was read under, held at the read's start and end (None:
    written or created here, or read while the lease was not held)."""

    stored: Stored
    read_under: int | None = None

    @property
    def batch(self) -> int:
        """The batch the blob holds (``NO_BLOB``: no document)."""
        batch = self.stored.batch_id
        return NO_BLOB if batch is None else batch

    @property
    def durable(self) -> int:
        return self.batch


@dataclass(frozen=True, slots=True)
class Writing:
    """A write planned from ``base`` is in flight: until its answer the blob holds ``base``
    or the new document."""

    base: Seen

    @property
    def durable(self) -> int:
        return self.base.batch


#: What this daemon knows its query's blob holds.
Blob = Unread | Seen | Writing


@dataclass(frozen=True, slots=True)
class Read:
    """The blob was read: it holds ``stored``; ``term``: the lease term held throughout the
    read (None: not held)."""

    stored: Stored
    term: int | None = None


@dataclass(frozen=True, slots=True)
class Begin:
    """A write is sent, naming the version seen."""


@dataclass(frozen=True, slots=True)
class Wrote:
    """The write landed: the blob now holds ``stored``."""

    stored: Stored


@dataclass(frozen=True, slots=True)
class Refused:
    """The store refused the write: the blob is no longer the version it named."""


@dataclass(frozen=True, slots=True)
class Unsure:
    """The write's outcome is unknown (timed out, connection lost mid-call). A reset's write
    may have lowered the blob to ``lowered_to``."""

    lowered_to: int | None = None


@dataclass(frozen=True, slots=True)
class Abandoned:
    """A write was begun but not sent (the lease was lost meanwhile)."""


@dataclass(frozen=True, slots=True)
class Lapsed:
    """The lease was lost (refused, broken, expired): another writer may change the blob."""


@dataclass(frozen=True, slots=True)
class Created:
    """The lease's empty blob was created now, at ``version``: there was none."""

    version: str


@dataclass(frozen=True, slots=True)
class RedisSays:
    """Redis records ``batch`` as the blob's (its flushed batch, read after the newest other
    evidence); ``reset``: a reset was recorded in Redis since the last row seen (another owner
    may have lowered the blob to it); ``term``: the lease term held when it was read (None:
    not held)."""

    batch: int
    reset: bool = False
    term: int | None = None


BlobEvent = Read | Begin | Wrote | Refused | Unsure | Abandoned | Lapsed | Created | RedisSays


def advance(blob: Blob, event: BlobEvent) -> Blob:
    """What the blob holds after ``event``: the one transition table (module docstring).

    Raises:
        IllegalMove: a move the table does not allow.
    """
    match event, blob:
        case Read(stored, term), Unread() | Seen():
            return Seen(stored, term)
        case Read(), Writing():
            return blob  # the write's answer will say; a read under it proves neither outcome
        case Begin(), Seen():
            return Writing(blob)
        case Wrote(stored), Writing():
            return Seen(stored)
        case Refused(), Writing():
            return Unread(blob.durable)
        case Unsure(lowered_to), Writing():
            lowest = blob.durable if lowered_to is None else min(blob.durable, lowered_to)
            return Unread(lowest)
        case Abandoned(), Writing():
            return blob.base
        case Lapsed(), Unread() | Seen():
            return Unread(blob.durable)
        case Lapsed(), Writing():
            return blob  # its answer will say (refused for the lease: forgotten then)
        case Created(version), Unread() | Seen():
            return Seen(Stored(version, None))
        case Created(), Writing():
            return blob  # the write in flight will fail (no blob was there to name)
        case RedisSays(batch), Unread():
            return Unread(batch)
        case RedisSays(batch, reset, term), Seen():
            # Lower: Redis only lags (a write it has not recorded yet), unless a reset was
            # recorded since: then the blob may have been lowered.
            if reset:
                return Unread(batch)
            if batch <= blob.batch:
                return blob
            # Higher, the lease not held: another writer. Held: nobody else writes the blob,
            # so Redis' batch is not the blob's (module docstring): a blob read under this
            # term holds what was read; one written here may not hold it any more: read it.
            if term is None:
                return Unread(batch)
            return blob if blob.read_under == term else Unread(blob.batch)
        case RedisSays(), Writing():
            return blob
    raise IllegalMove(f"{type(event).__name__} while the blob is {type(blob).__name__}")


@dataclass(frozen=True, slots=True)
class Behind:
    """The blob, read under the lease held now, holds batch ``held``, below the ``flushed``
    batch Redis records, and no reset was recorded since: the store went back (it lost
    writes, or was restored), and the newest acknowledged batch is written over it. With
    ``reset``: the document read carries a reset that this Redis never recorded (another
    daemon's, on another Redis): nothing is written over it."""

    held: int
    flushed: int
    reset: CheckpointDocument | None = None


def reset_unrecorded(doc: CheckpointDocument | None, flushed: int, recorded: str | None) -> bool:
    """Whether ``doc``, found below Redis' ``flushed`` batch, holds a reset that Redis never
    recorded: a reset record other than ``recorded`` (the reset record of the document Redis'
    flushed batch is in; None: not kept, then a reset that replaced a batch at or above
    ``flushed`` counts). A store that lost writes goes back to an older document of the same
    timeline, whose reset record is the same, or none."""
    if doc is None or doc.reset_at is None:
        return False
    if recorded is not None:
        return doc.reset_at != recorded
    return doc.reset_from is not None and doc.reset_from >= flushed


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
    blob: Blob = Unread()
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


class Ack(enum.Enum):
    #: The batch is in the blob already: answer now.
    DURABLE = "durable"
    #: Waiting; the flush loop should wake for it now.
    WAKE = "wake"
    #: Waiting; the loop is busy with the query or must not flush it yet (backing off).
    WAIT = "wait"
    #: Another daemon holds the query's lease: answer ``not_owner`` now.
    NOT_OWNER = "not_owner"
    #: Waiting; the blob held the batch as last known here: read it now, the read answers.
    CONFIRM = "confirm"


class FlushCore(Generic[W, L]):
    """Every query's record, and the decisions on it."""

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
        """The query's record, created empty when new; ``label`` updates its name."""
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

    def new_lease(self, query_id: str) -> None:
        """The query's lease was released while the query stays (released for retirement,
        then seen again): a new one starts in ACQUIRING at its next write."""
        q = self._queries.get(query_id)
        if q is not None:
            q.lease = QueryLease(query_id, q.lease.label)

    def label(self, query_id: str) -> str | None:
        """The query's name as a Redis row told it; None while not told."""
        q = self._queries.get(query_id)
        return q.label or None if q is not None else None

    def forget(self, query_id: str) -> None:
        """Drop the query (retired): one removal. Acks still waiting time out; anything begun
        before (a read, a flush of a row read before) finds its record gone and keeps nothing."""
        self._stamp += 1
        self._last_op = self._stamp
        self._queries.pop(query_id, None)

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

    def held_term(self, query_id: str) -> int | None:
        """The query's lease term while HELD (None: not held): take it before a read."""
        q = self._queries.get(query_id)
        return self._held_term(q) if q is not None else None

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

    # --- the floor (ingest) ----------------------------------------------------------------

    def floor(self, query_id: str) -> int | None:
        """The batch the query's blob holds as far as known, without I/O; None: not known."""
        q = self._queries.get(query_id)
        return q.floor if q is not None else None

    def read(
        self, query_id: str, stored: Stored, since: int, term: int | None = None
    ) -> tuple[int, list[W]]:
        """The blob was read (begun at stamp ``since``, under lease term ``term``: see
        :meth:`held_term`): it holds ``stored``. Begun before newer evidence, an admin op or a
        retirement of the query, the read is returned, not kept: it could raise a reset floor
        back. No record is made for a query without a blob. Returns the floor to use, and the
        acks the read answers."""
        batch = NO_BLOB if stored.batch_id is None else stored.batch_id
        q = self._queries.get(query_id)
        if q is None:
            if stored.version is None or self._last_op > since:
                return batch, []
            q = self.record(query_id)
        elif q.evidence > since:
            return (q.floor if q.floor is not None else batch), []
        held = term if term is not None and self._held_term(q) == term else None
        answered = self._advance(q, Read(stored, held), since)
        if not isinstance(q.blob, Writing):
            self._evidence(q)
        return (q.floor if q.floor is not None else batch), answered

    def recheck_due(self, query_id: str, every_s: float) -> bool:
        """Whether ingest may read the blob again now (a refusal by the floor alone; at most
        every ``every_s`` per query); if so, that read is counted from now."""
        q = self._queries.get(query_id)
        if q is None:
            return True
        now = self._clock()
        if now - q.rechecked_at < every_s:
            return False
        q.rechecked_at = now
        return True

    # --- acks -----------------------------------------------------------------------------

    def ack(self, query_id: str, batch: int, waiter: W) -> Ack:
        """An ack wants ``batch`` of the query in the blob. Never answered from memory: a twin
        on its own Redis may have broken the lease and reset the blob lower since it was last
        seen here. A batch the blob held as last known is confirmed by a read (the next flush
        check's); a newer one waits for its write."""
        q = self.record(query_id)
        if q.lease.held_elsewhere():
            return Ack.NOT_OWNER
        # Its own stamp: a read or a write begun before it is no evidence for it (the store
        # may lose the batch between that read and this ack).
        self._stamp += 1
        made = self._stamp
        if q.blob.durable >= batch:
            # Held already, as far as known here: answered by a read begun after it (a
            # resend, rare; new batches wait for their write).
            q.confirming.append(Waiting(batch, waiter, made))
            q.unverified = True  # due at the next check, read there too if the shell's is not
            return Ack.CONFIRM
        q.acks.append(Waiting(batch, waiter, made))
        if q.flight is not Flight.IDLE:
            q.flight = Flight.DEFERRED
            return Ack.WAIT
        return Ack.WAKE if self._clock() >= q.retry_at else Ack.WAIT

    def ack_gone(self, query_id: str, waiter: W) -> None:
        """An ack stopped waiting (answered, or its time ran out)."""
        q = self._queries.get(query_id)
        if q is not None:
            q.acks = [a for a in q.acks if a.waiter is not waiter]
            q.confirming = [a for a in q.confirming if a.waiter is not waiter]

    def held_elsewhere(self, query_id: str, holder: str | None) -> list[W]:
        """Another daemon holds the query's lease (``holder``: who last wrote the blob, when
        known): the acks waiting, to be answered ``not_owner`` (they stop waiting)."""
        q = self._queries.get(query_id)
        if q is None:
            return []
        if holder is not None:
            q.holder = holder
        waiting = [a.waiter for a in q.acks + q.confirming]
        q.acks, q.confirming = [], []
        return waiting

    def waiting(self) -> list[str]:
        """The queries acks wait on."""
        return [q.query_id for q in self._queries.values() if q.acks_wait]

    # --- a flush pass ----------------------------------------------------------------------

    def begin(self, query_id: str) -> None:
        """The query enters a pass of the flush loop (never two at once)."""
        self.record(query_id).flight = Flight.IN_PASS

    def in_flight(self, query_id: str) -> bool:
        q = self._queries.get(query_id)
        return q is not None and q.flight is not Flight.IDLE

    def end(self, query_id: str) -> bool:
        """The pass is done with the query (written, or no write needed, or failed). True:
        an ack deferred meanwhile still waits, so wake the loop for the next write now (group
        commit); at most once per deferred ack, so nothing spins."""
        q = self._queries.get(query_id)
        if q is None:
            return False
        deferred = q.flight is Flight.DEFERRED
        q.flight = Flight.IDLE
        return deferred and q.acks_wait and self._clock() >= q.retry_at

    def due(self, query_id: str) -> bool:
        """Due whatever the thresholds: an ack waits on it, a previous run left it pending, or
        its blob is unverified."""
        q = self._queries.get(query_id)
        return q is not None and (q.acks_wait or q.recovering or q.unverified)

    def recovering(self, query_ids: set[str]) -> None:
        """A previous run left these pending: due until flushed."""
        for query_id in query_ids:
            self.record(query_id).recovering = True

    def current(self, query_id: str, since: int) -> bool:
        """Whether a Redis row of the query read at stamp ``since`` may still be flushed (no
        admin op on it since; for a query not known then, none anywhere)."""
        q = self._queries.get(query_id)
        return (q.generation if q is not None else self._last_op) <= since

    def redis_says(
        self,
        query_id: str,
        batch: int | None,
        resets: int,
        since: int,
        recorded_reset: str | None = None,
        *,
        judge: bool = False,
    ) -> list[W]:
        """Redis says the blob got ``batch`` (its flushed batch id, None: none recorded; read
        at stamp ``since``, with the query's reset count ``resets`` and the reset record of the
        document that batch is in, ``recorded_reset``): evidence unless newer evidence arrived
        since; the acks it answers. With ``judge`` (the flush's own read of Redis after its
        read of the blob, under its lock: no admin op is half done), after a read under the
        lease held now, it is the check of the blob against Redis: a blob below it, or with a
        reset Redis never kept, is :class:`Behind` (:meth:`take_behind`)."""
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
        return answered

    def take_behind(self, query_id: str) -> Behind | None:
        """What the blob was last found below Redis (:class:`Behind`), once per finding; None
        when there is none or it was taken already."""
        q = self._queries.get(query_id)
        if q is None or q.behind is None or q.behind == q.reported:
            return None
        q.reported = q.behind
        return q.behind

    def behind(self, query_id: str) -> Behind | None:
        """The blob's current finding below Redis, reported or not."""
        q = self._queries.get(query_id)
        return q.behind if q is not None else None

    def lease_version(self, query_id: str, version: str | None) -> None:
        """The query's lease was acquired or renewed, the store reporting the blob at
        ``version`` (None: not reported). A blob seen at another version changed under the
        lease (the store went back, or was restored): forgotten. Unless it is seen at that very
        version (or being written), the query is unverified: due, read and compared with Redis
        at the next flush check."""
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

    def unverify(self, query_id: str) -> None:
        """The query's blob may not hold what Redis says: due, read and compared with Redis
        at the next flush check."""
        self.record(query_id).unverified = True

    def listed(self, query_id: str, version: str | None) -> None:
        """The store's listing shows the query's blob at ``version`` (None: absent), another
        than its last flush left: what the blob was seen to hold is forgotten unless seen at
        that very version (or being written), and it is unverified: read and compared with
        Redis at the next flush check."""
        q = self.record(query_id)
        if isinstance(q.blob, Seen) and q.blob.stored.version != version:
            self._evidence(q)  # a read begun before may hold the old version too
            q.blob, q.behind = Unread(q.blob.batch), None
        q.unverified = True

    def seen_at(self, query_id: str, version: str | None, batch: int) -> bool:
        """Whether the blob was seen here at ``version`` (None: seen absent) holding ``batch``
        or a newer one. Not seen at all is never a match: a blob this daemon never read may
        have gone since its last flush; nor is one seen below ``batch``."""
        q = self._queries.get(query_id)
        blob = q.blob if q is not None else None
        return isinstance(blob, Seen) and blob.stored.version == version and blob.batch >= batch

    def unverified(self) -> list[str]:
        """The queries whose blob must be read and compared with Redis (:meth:`lease_version`)."""
        return [q.query_id for q in self._queries.values() if q.unverified]

    # --- the rows applies return (blob ack mode) --------------------------------------------

    def applied(self, rows: list[PendingQuery], since: int) -> list[W]:
        """Rows an apply returned (its call began at stamp ``since``), in the order applied:
        the last of a query is its latest. Each row's flushed batch is Redis' word on the blob
        (another owner's reset sets it lower than what was seen here): the acks it answers."""
        answered: list[W] = []
        for row in rows:
            self.record(row.query_id).row = (row, since)
            if row.flushed_batch_id is not None:
                answered += self.redis_says(
                    row.query_id, row.flushed_batch_id, row.resets, since, row.flushed_reset
                )
        return answered

    def rows_void(self, query_ids: list[str]) -> None:
        """An apply failed and may have run: a row kept may be older than what Redis holds."""
        for query_id in query_ids:
            q = self._queries.get(query_id)
            if q is not None:
                q.row = None

    def take_row(self, query_id: str) -> tuple[PendingQuery, int] | None:
        """The query's kept row, for a flush an ack waits on (as good as a read now); None
        otherwise. It is taken either way: a row read for the flush is newer."""
        q = self._queries.get(query_id)
        if q is None or q.row is None:
            return None
        row, q.row = q.row, None
        return row if q.acks_wait else None

    def checked(self, pending: set[str], now_ms: int) -> None:
        """A flush check at Redis time ``now_ms`` found ``pending`` (with updates pending or
        an unreadable count): each record says whether it is, and the rows of those no longer
        pending are dropped (flushed since they were applied)."""
        for q in self._queries.values():
            q.pending = q.query_id in pending
            if q.row is not None and q.row[0].snapshot_ms < now_ms and not q.pending:
                q.row = None

    # --- one flush ----------------------------------------------------------------------------

    def plan(self, query_id: str, batch: int) -> Plan:
        """What to do with a due row of ``batch``."""
        q = self.record(query_id)
        blob = q.blob
        match blob:
            case Seen() if q.confirming:
                return Plan(Step.READ)  # an ack waits for a read made after it
            case Seen() if q.unverified and blob.read_under != self._held_term(q):
                return Plan(Step.READ)  # compared with Redis first (lease_version, unverify)
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

    def begin_write(self, query_id: str, base: Seen) -> bool:
        """A write planned from ``base`` is sent (a flush's or a reset's); False, and nothing
        begun, when the blob is no longer seen as ``base`` (a read meanwhile found another
        writer's change, or forgot it): plan again."""
        q = self.record(query_id)
        if q.blob != base:
            return False
        q.blob = advance(q.blob, Begin())
        q.write_began = self._stamp
        return True

    def wrote(self, query_id: str, stored: Stored) -> list[W]:
        """The write landed; the acks it answers."""
        q = self.record(query_id)
        self._evidence(q)
        q.holder = None
        return self._advance(q, Wrote(stored), q.write_began)

    def refused(self, query_id: str) -> None:
        """The store refused the write: another writer changed the blob."""
        q = self.record(query_id)
        self._evidence(q)
        self._advance(q, Refused())

    def unsure(self, query_id: str, *, lowered_to: int | None = None) -> None:
        """The write's outcome is unknown (a reset's may have lowered the blob to
        ``lowered_to``: acks are then answered only once it is read or written again)."""
        q = self.record(query_id)
        self._evidence(q)  # a read begun before cannot set the floor back either
        self._advance(q, Unsure(lowered_to))

    def lapsed(self, query_id: str) -> None:
        """The query's lease was lost: what the blob holds may change under another writer."""
        q = self._queries.get(query_id)
        if q is not None:
            self._evidence(q)
            q.blob = advance(q.blob, Lapsed())
            q.behind, q.unverified = None, False  # judged again under the next term
            q.uncompared = False

    def abandoned(self, query_id: str) -> None:
        """The write was not sent (the lease was lost meanwhile)."""
        q = self._queries.get(query_id)
        if q is not None:
            q.blob = advance(q.blob, Abandoned())

    def created(self, query_id: str, version: str) -> None:
        """The lease's empty blob was created now (there was none)."""
        q = self.record(query_id)
        self._evidence(q)
        self._advance(q, Created(version), self._stamp)

    def marked(self, query_id: str) -> None:
        """Redis recorded the flush (its flushed batch is the blob's again): a Redis read that
        began before, which may show the flushed batch before this write, is no evidence."""
        q = self._queries.get(query_id)
        if q is not None:
            self._evidence(q)

    def skipped(self, query_id: str) -> list[W]:
        """The blob, as seen, already held the row's batch: the acks that answers."""
        q = self._queries.get(query_id)
        return self._durable(q) if q is not None else []

    def snapshot_taken(self, query_id: str, ref: SnapshotRef) -> None:
        """A snapshot of the query was written: its next document names it if it follows the
        document's marker (``follows``; a query retired meanwhile stays forgotten). A query's
        snapshots are taken one at a time, so the last told is the newest."""
        q = self._queries.get(query_id)
        if q is not None:
            q.snapshot, q.snapshot_at = ref, self._clock()

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

    def _marker_stale(self, q: QueryState[W, L]) -> bool:
        blob = q.blob
        if not isinstance(blob, Seen) or blob.stored.document is None or q.snapshot is None:
            return False
        return (
            q.snapshot != q.named
            and follows(q.snapshot, q.named)
            and (q.snapshot.batch_id <= blob.stored.document.batch_id)
        )

    def snapshot_marker(self, query_id: str) -> tuple[bool, SnapshotRef | None]:
        """The marker of the query's document, and whether it is known: the blob seen (read
        or written) while this daemon holds its lease — it moves only under that lease. Not
        known (another process may have reset it meanwhile): the blob is read at the next
        flush check."""
        q = self._queries.get(query_id)
        if q is None:
            return False, None
        blob = q.blob.base if isinstance(q.blob, Writing) else q.blob
        if self._held_term(q) is None or not isinstance(blob, Seen):
            q.unverified = True
            return False, None
        return True, q.named

    def snapshot_of(self, query_id: str) -> SnapshotRef | None:
        q = self._queries.get(query_id)
        return q.snapshot if q is not None else None

    def thinned(self, query_id: str, thinned: bool) -> bool:
        """Whether the history of the document just built was thinned; True the first time in
        a row (log it once until it fits again)."""
        q = self.record(query_id)
        first = thinned and not q.thinned
        q.thinned = thinned
        return first

    # --- retries ---------------------------------------------------------------------------------

    def ready(self, query_id: str) -> bool:
        """Whether the query may be flushed now (not backing off after a failure)."""
        q = self._queries.get(query_id)
        return q is None or self._clock() >= q.retry_at

    def failures(self, query_id: str) -> int:
        q = self._queries.get(query_id)
        return q.failures if q is not None else 0

    def flushed(self, query_id: str) -> None:
        """The flush is complete (the blob holds the row, Redis recorded it): its retry
        schedule starts over, and a recovered query is no longer due for that alone."""
        q = self._queries.get(query_id)
        if q is not None:
            q.failures, q.retry_at, q.recovering = 0, 0.0, False

    def failed(
        self, query_id: str, *, retriable: bool, retry_after_s: float | None = None
    ) -> float:
        """A flush failed: seconds until its next try. Not ``retriable`` (an operator must act
        first) waits the full cap; ``retry_after_s`` (the store's ``Retry-After``) at least
        that long."""
        q = self.record(query_id)
        q.failures += 1
        delay = self._backoff.after(
            q.failures, give_up_ramp=not retriable, at_least_s=retry_after_s or 0.0
        )
        q.retry_at = self._clock() + delay
        return delay

    # --- admin ops -------------------------------------------------------------------------------

    def admin_op(self, query_id: str) -> None:
        """A reset or retire of the query begins, or ends: rows read before now are void (for
        a query retired meanwhile, whose record is gone, every new record starts after it)."""
        self._stamp += 1
        self._last_op = self._stamp
        q = self._queries.get(query_id)
        if q is not None:
            q.generation = q.evidence = self._stamp

    def reset(self, query_id: str, stored: Stored) -> list[W]:
        """A reset's write landed: the blob holds ``stored``; acks follow it down, so later
        batches above it are stored and acknowledged again; its retries start over."""
        q = self.record(query_id)
        answered = self.wrote(query_id, stored)
        q.snapshot = stored.document.snapshot if stored.document is not None else None
        q.failures, q.retry_at, q.recovering = 0, 0.0, False
        q.resets = None  # this reset counted one more in Redis: news to no one here
        return answered
