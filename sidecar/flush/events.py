"""What the flush core is told, and what it asks the shell to do: the one door of
``sidecar.flush.core`` (:meth:`~sidecar.flush.core.FlushCore.step`).

Events are facts, named in the past tense, each about one query (or a batch of them); the
shell (``blob_state``, ``lease_manager``) tells every one of them, and nothing else changes a
record. An event's actions are what follows from it, for the shell to carry out::

    shell ── event ──▶ FlushCore.step ── actions ──▶ shell
                       (records, stamps)             Answer / NotOwner: settle waiting acks
                                                     Do.WAKE: wake the flush loop
                                                     Do.READ: read the blob now
                                                     Do.SEND: send the write begun
                                                     RetryIn, Report, UseRow, Do.LOG_THINNED

Questions (what the blob holds, whether a query is due, the plan for a row) are the core's
read-only methods: they change nothing.

Named tuples, not dataclasses: ~0.1 ms each to define against ~0.7, on the daemon's path to
ready. Actions without data are :class:`Do` members, so that two of them never compare equal.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

from sidecar.buffer.rows import PendingEntry, PendingQuery
from sidecar.flush.blob import Behind, Seen
from sidecar.model.document import SnapshotRef, Stored

#: A waiting ack's handle: whatever the shell settles when its batch is durable.
W = TypeVar("W")

# --- events: what happened ----------------------------------------------------------------


class BlobRead(NamedTuple):
    """The blob was read, begun at stamp ``since`` under lease term ``term`` (None: not held):
    it holds ``stored``."""

    query_id: str
    stored: Stored
    since: int
    term: int | None = None


class AckWanted(NamedTuple, Generic[W]):
    """An ack wants ``batch`` of the query in the blob; ``waiter``: what settles it."""

    query_id: str
    batch: int
    waiter: W


class AckGone(NamedTuple, Generic[W]):
    """An ack stopped waiting (answered, or its time ran out)."""

    query_id: str
    waiter: W


class HeldElsewhere(NamedTuple):
    """Another daemon holds the query's lease; ``holder``: who last wrote the blob, if known."""

    query_id: str
    holder: str | None = None


class RecheckWanted(NamedTuple):
    """The floor alone refused an update: ingest would read the blob again, at most every
    ``every_s``."""

    query_id: str
    every_s: float


class PassBegun(NamedTuple):
    """The query entered a pass of the flush loop."""

    query_id: str


class PassEnded(NamedTuple):
    """The pass is done with the query (written, nothing to write, or failed)."""

    query_id: str


class LeftPending(NamedTuple):
    """A previous run left these queries pending in Redis."""

    query_ids: frozenset[str]


class RedisSaid(NamedTuple):
    """Redis' flushed batch of the query (None: none), read at stamp ``since``, with its reset
    count and the reset record of the document that batch is in; ``judge``: the flush's own
    read, right after its read of the blob, under its lock (the check against Redis)."""

    query_id: str
    batch: int | None
    resets: int
    since: int
    recorded_reset: str | None = None
    judge: bool = False


class RowsApplied(NamedTuple):
    """Rows an apply returned (blob ack mode), its call begun at stamp ``since``."""

    rows: tuple[PendingQuery, ...]
    since: int


class RowsVoid(NamedTuple):
    """An apply failed and may have run: the rows kept of these queries may be stale."""

    query_ids: tuple[str, ...]


class Checked(NamedTuple):
    """A flush check, its Redis read begun at stamp ``since``, listed ``entries`` at Redis
    time ``now_ms``: which queries have updates pending, and Redis' flushed batch of each."""

    entries: tuple[PendingEntry, ...]
    since: int
    now_ms: int


class FlushStarted(NamedTuple):
    """A flush of the query starts: the row an apply kept is taken (it is as good as a read
    of Redis now only while an ack waits)."""

    query_id: str


class WriteBegun(NamedTuple):
    """A write planned from ``base`` (a flush's or an admin op's) is about to be sent."""

    query_id: str
    base: Seen


class BlobWritten(NamedTuple):
    """The write landed: the blob holds ``stored``; ``reset``: it was an admin reset's."""

    query_id: str
    stored: Stored
    reset: bool = False


class WriteRefused(NamedTuple):
    """The store refused the write: another writer changed the blob (or holds its lease)."""

    query_id: str


class WriteUnsure(NamedTuple):
    """The write's outcome is unknown; a reset's may have lowered the blob to ``lowered_to``."""

    query_id: str
    lowered_to: int | None = None


class WriteNotSent(NamedTuple):
    """A write was begun but not sent."""

    query_id: str


class FlushMarked(NamedTuple):
    """Redis recorded the flush: its flushed batch is the blob's again."""

    query_id: str


class Skipped(NamedTuple):
    """The blob, as seen, already held the row's batch: nothing written."""

    query_id: str


class Flushed(NamedTuple):
    """The flush is complete (the blob holds the row, Redis recorded it)."""

    query_id: str


class FlushFailed(NamedTuple):
    """A flush failed; ``retriable`` False: an operator must act first; ``retry_after_s``:
    the store's ``Retry-After``."""

    query_id: str
    retriable: bool
    retry_after_s: float | None = None


class Built(NamedTuple):
    """A document of the query was built; ``thinned``: its history was thinned to fit."""

    query_id: str
    thinned: bool


class SnapshotTaken(NamedTuple):
    """A snapshot of the query was written: its next document names it."""

    query_id: str
    ref: SnapshotRef


class Doubted(NamedTuple):
    """The query's blob may not hold what Redis says: read and compare it at the next check."""

    query_id: str


class Listed(NamedTuple):
    """The store's listing shows the query's blob at ``version`` (None: absent), another
    than its last flush left."""

    query_id: str
    version: str | None


class LeaseAcquiring(NamedTuple):
    """The lease, LOST, is tried again (its backoff elapsed, or at once)."""

    query_id: str
    reason: str


class LeaseAcquired(NamedTuple):
    """The store granted the lease under a new ``term``, the call begun at ``started``,
    reporting the blob at ``version`` (None: not reported)."""

    query_id: str
    term: int
    started: float
    duration_s: float
    renew_in_s: float
    version: str | None = None


class LeaseRenewed(NamedTuple):
    """A renewal begun at ``started`` succeeded, reporting the blob at ``version``."""

    query_id: str
    started: float
    duration_s: float
    renew_in_s: float
    version: str | None = None


class RenewFailed(NamedTuple):
    """A renewal failed without being refused: try again at ``retry_at`` (monotonic)."""

    query_id: str
    retry_at: float


class LeaseLapsed(NamedTuple):
    """The lease is not owned any more (refused, expired, never granted) at ``now``: retried
    after ``backoff(failures in a row)`` seconds (None: at once). ``contested``: the store
    said so (another lease holds the blob, or ours was broken)."""

    query_id: str
    reason: str
    now: float
    backoff: Callable[[int], float] | None = None
    contested: bool = False


class BlobCreated(NamedTuple):
    """The lease's empty blob was created now, at ``version`` (there was none)."""

    query_id: str
    version: str


class LeaseLetGo(NamedTuple):
    """The lease was released (shutdown, retired); ``anew``: the query stays (released for
    retirement, then seen again), and a new lease starts at its next write."""

    query_id: str
    reason: str
    anew: bool = False


class AdminOp(NamedTuple):
    """A reset or retire of the query begins, or ends."""

    query_id: str


class Retired(NamedTuple):
    """The query was retired: its record goes, in one removal."""

    query_id: str


Event = (
    BlobRead
    | AckWanted[W]
    | AckGone[W]
    | HeldElsewhere
    | RecheckWanted
    | PassBegun
    | PassEnded
    | LeftPending
    | RedisSaid
    | RowsApplied
    | RowsVoid
    | Checked
    | FlushStarted
    | WriteBegun
    | BlobWritten
    | WriteRefused
    | WriteUnsure
    | WriteNotSent
    | FlushMarked
    | Skipped
    | Flushed
    | FlushFailed
    | Built
    | SnapshotTaken
    | Doubted
    | Listed
    | LeaseAcquiring
    | LeaseAcquired
    | LeaseRenewed
    | RenewFailed
    | LeaseLapsed
    | BlobCreated
    | LeaseLetGo
    | AdminOp
    | Retired
)

# --- actions: what the shell does next -------------------------------------------------------


class Do(enum.Enum):
    #: Wake the flush loop now (an ack waits and nothing holds the query back).
    WAKE = "wake"
    #: Read the blob now: an ack waits for a read begun after it.
    READ = "read"
    #: Send the write just begun (without it: plan again, the blob was seen to change).
    SEND = "send"
    #: Log that the query's history was thinned (the first time in a row).
    LOG_THINNED = "log thinned"


class Answer(NamedTuple, Generic[W]):
    """The blob holds these acks' batches: answer them (they stop waiting)."""

    waiters: tuple[W, ...]


class NotOwner(NamedTuple, Generic[W]):
    """Another daemon holds the lease: answer these acks ``not_owner`` (they stop waiting)."""

    waiters: tuple[W, ...]


class RetryIn(NamedTuple):
    """The failed flush's next try, in seconds."""

    delay_s: float


class Report(NamedTuple):
    """A finding of the blob below Redis (:class:`~sidecar.flush.blob.Behind`), news once."""

    behind: Behind


class UseRow(NamedTuple):
    """The flush uses this row, kept from an apply begun at stamp ``since``: no read of Redis."""

    row: PendingQuery
    since: int


Action = Do | Answer[W] | NotOwner[W] | RetryIn | Report | UseRow
