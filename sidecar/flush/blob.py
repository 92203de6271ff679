"""What a query's blob holds, as this daemon knows it: one value, moved only by
:func:`advance`, a closed table of (value, event). Pure, like the rest of the flush core
(``sidecar.flush.core``, which keeps one such value per query and decides on it)::

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

Redis ahead of the blob under the lease (the core's docstring says why that is not another
writer) is judged by the core: :class:`Behind`, :func:`reset_unrecorded`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.buffer.lua import NO_BLOB
from sidecar.model.document import CheckpointDocument, Stored


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
