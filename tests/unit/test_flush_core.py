"""What the blob holds, as the flush core's one closed value (``sidecar.flush.blob.advance``),
and the core's decisions on it, told events through its one door (``FlushCore.step``):
every (value, event) pair, the moves it allows and the ones it refuses. The same table runs
under the real flusher in the simulation (test_flush_simulation.py) and against Azurite in
tests/faults/test_fencing.py."""

from __future__ import annotations

import itertools
import typing

import msgspec
import pytest

from sidecar.backoff import Backoff
from sidecar.buffer.lua import NO_BLOB
from sidecar.buffer.rows import PendingEntry
from sidecar.flush import core as core_module
from sidecar.flush.blob import (
    Abandoned,
    Begin,
    Behind,
    Blob,
    BlobEvent,
    Created,
    IllegalMove,
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
from sidecar.flush.core import FlushCore, Step
from sidecar.flush.events import (
    AckGone,
    AckWanted,
    Answer,
    BlobRead,
    BlobWritten,
    Checked,
    Do,
    Doubted,
    Event,
    LeaseAcquired,
    LeaseLapsed,
    LeaseRenewed,
    Listed,
    RedisSaid,
    Report,
    Retired,
    SnapshotTaken,
    WriteBegun,
)
from sidecar.model.document import SnapshotRef, Stored, reset_document
from tests.unit.fakes import WRITER, checkpoint, document

Q = "core"
AT_3 = Seen(Stored('"v3"', document(Q, 3)))
AT_7 = Stored('"v7"', document(Q, 7))
#: Seen at batch 3, read under lease term 4 (the term the lease is held under below).
READ_3 = Seen(AT_3.stored, read_under=4)
VALUES: list[Blob] = [Unread(2), AT_3, Writing(AT_3), READ_3]
EVENTS: list[BlobEvent] = [
    Read(AT_7),
    Begin(),
    Wrote(AT_7),
    Refused(),
    Unsure(),
    Unsure(lowered_to=1),
    Abandoned(),
    Created('"v0"'),
    RedisSays(3),
    RedisSays(5),
    Lapsed(),
    RedisSays(1),
    RedisSays(1, reset=True),
    Read(AT_7, term=4),
    RedisSays(5, term=4),  # the lease held under term 4
    RedisSays(5, term=9),  # held under a term the blob was not read under
]

#: Every allowed move: (value, event) → the value after it. Anything else is refused.
ALLOWED: dict[tuple[int, int], Blob] = {
    # a read: seen exactly, unless a write is in flight (its answer will say)
    (0, 0): Seen(AT_7),
    (1, 0): Seen(AT_7),
    (2, 0): Writing(AT_3),
    # a write names the version seen: only from Seen, one at a time
    (1, 1): Writing(AT_3),
    # its answers, only while it is in flight
    (2, 2): Seen(AT_7),
    (2, 3): Unread(3),
    (2, 4): Unread(3),
    (2, 5): Unread(1),  # a reset's write of unknown outcome: acks wait again
    (2, 6): AT_3,
    # the lease's empty blob, created now
    (0, 7): Seen(Stored('"v0"', None)),
    (1, 7): Seen(Stored('"v0"', None)),
    (2, 7): Writing(AT_3),
    # Redis' flushed batch, read after the newest evidence
    (0, 8): Unread(3),
    (0, 9): Unread(5),
    (1, 8): AT_3,
    (1, 9): Unread(5),  # another writer's batch: forget what was seen, read it again
    (0, 11): Unread(1),
    (1, 11): AT_3,  # lower: Redis only lags behind a write it has not recorded yet
    (2, 11): Writing(AT_3),
    (0, 12): Unread(1),
    (1, 12): Unread(1),  # a reset was recorded since: the blob may have been lowered
    (2, 12): Writing(AT_3),
    (2, 8): Writing(AT_3),
    (2, 9): Writing(AT_3),
    # the lease lost: another may write; a write in flight will say
    (0, 10): Unread(2),
    (1, 10): Unread(3),
    (2, 10): Writing(AT_3),
    # a read under the lease held now remembers its term
    (0, 13): Seen(AT_7, read_under=4),
    (1, 13): Seen(AT_7, read_under=4),
    (2, 13): Writing(AT_3),
    (3, 13): Seen(AT_7, read_under=4),
    # Redis above the blob while the lease is held: nobody else wrote it. Read under this
    # term: what the blob holds (the store went back: the core judges it); written here, or
    # read under another term: read it before anything else
    (0, 14): Unread(5),
    (0, 15): Unread(5),
    (1, 14): Unread(3),
    (1, 15): Unread(3),
    (2, 14): Writing(AT_3),
    (2, 15): Writing(AT_3),
    (3, 14): READ_3,
    (3, 15): Unread(3),
    # read under the held term, the other events as for any Seen
    (3, 0): Seen(AT_7),
    (3, 1): Writing(READ_3),
    (3, 7): Seen(Stored('"v0"', None)),
    (3, 8): READ_3,
    (3, 9): Unread(5),  # the lease not held: another writer's batch
    (3, 10): Unread(3),
    (3, 11): READ_3,
    (3, 12): Unread(1),
}


@pytest.mark.parametrize(
    ("value", "event"), list(itertools.product(range(len(VALUES)), range(len(EVENTS))))
)
def test_every_move_of_what_the_blob_holds(value: int, event: int) -> None:
    blob, happened = VALUES[value], EVENTS[event]
    if (value, event) in ALLOWED:
        assert advance(blob, happened) == ALLOWED[value, event]
    else:
        with pytest.raises(IllegalMove):
            advance(blob, happened)


def test_what_acks_count_follows_the_value() -> None:
    assert Unread().durable == NO_BLOB and Unread(4).durable == 4
    assert AT_3.durable == 3 and Writing(AT_3).durable == 3
    assert Seen(Stored('"v0"', None)).batch == NO_BLOB


def test_a_snapshot_taken_is_named_next_and_never_brings_a_retired_query_back() -> None:
    core: FlushCore[object, None] = FlushCore(Backoff(1, 2), clock=lambda: 0.0, shell=lambda: None)
    core.record(Q)
    core.step(SnapshotTaken(Q, SnapshotRef(5, "s5", "t1")))
    core.step(SnapshotTaken(Q, SnapshotRef(6, "s6", "t1")))  # one at a time: the last is newest
    assert core.snapshot_of(Q) == SnapshotRef(6, "s6", "t1")
    core.step(Retired(Q))  # retired while a snapshot was in flight
    core.step(SnapshotTaken(Q, SnapshotRef(7, "s7", "t1")))
    assert Q not in core and core.snapshot_of(Q) is None


def marked(batch: int, marker: SnapshotRef | None, version: str) -> Stored:
    return Stored(version, msgspec.structs.replace(document(Q, batch), snapshot=marker))


def test_the_marker_is_known_only_as_seen_under_the_lease_held_now() -> None:
    core = held_core()
    assert core.snapshot_marker(Q) == (False, None)  # not read yet under this lease
    assert core.unverified() == []  # a question changes nothing: the shell tells Doubted
    rewind_point = SnapshotRef(50, "s50", "t2")
    core.step(BlobRead(Q, marked(50, rewind_point, '"v50"'), core.stamp, term=4))
    assert core.snapshot_marker(Q) == (True, rewind_point)
    core.step(LeaseLapsed(Q, "lost", 0.0))  # the lease lost: another process may reset it meanwhile
    assert core.snapshot_marker(Q)[0] is False


def test_a_reset_to_another_timeline_drops_the_snapshot_the_next_flush_would_name() -> None:
    core = held_core()
    core.step(
        BlobRead(Q, marked(100, SnapshotRef(100, "s100", "t1"), '"v100"'), core.stamp, term=4)
    )
    core.step(SnapshotTaken(Q, SnapshotRef(101, "s101", "t1")))
    # A restore to batch 50 (another process's reset, read back): a new timeline.
    at_50 = marked(50, SnapshotRef(50, "s50", "t2"), '"v50"')
    core.step(BlobRead(Q, at_50, core.stamp, term=4))
    assert core.snapshot_of(Q) is None
    # A reset of this daemon's own names its marker, the snapshot the next flush names.
    core.step(SnapshotTaken(Q, SnapshotRef(51, "s51", "t2")))
    assert core.step(WriteBegun(Q, Seen(at_50, read_under=4))) == [Do.SEND]
    core.step(BlobWritten(Q, marked(20, None, '"v20"'), reset=True))
    assert core.snapshot_of(Q) is None


def held_core(term: int = 4) -> FlushCore[object, None]:
    """A core whose query Q has its lease HELD under ``term``."""
    core: FlushCore[object, None] = FlushCore(Backoff(1, 2), clock=lambda: 0.0, shell=lambda: None)
    core.record(Q)
    core.step(LeaseAcquired(Q, term, 0.0, 60.0, 20.0))
    assert core.held_term(Q) == term
    return core


def test_a_blob_read_under_the_lease_below_redis_went_back_and_is_written_over() -> None:
    core = held_core()
    since = core.stamp
    core.step(BlobRead(Q, AT_3.stored, since, term=4))
    # Redis' flushed batch 6, its document without a reset record, as this one: said once
    assert core.step(RedisSaid(Q, 6, 0, core.stamp, "", judge=True)) == [Report(Behind(3, 6))]
    plan = core.plan(Q, 7)
    assert plan.step is Step.WRITE and plan.base == READ_3
    # again before the write: no news
    assert core.step(RedisSaid(Q, 6, 0, core.stamp, "", judge=True)) == []
    assert core.behind(Q) == Behind(3, 6)
    assert core.step(WriteBegun(Q, READ_3)) == [Do.SEND]
    core.step(BlobWritten(Q, AT_7))
    assert core.behind(Q) is None


def test_a_blob_read_by_ingest_under_the_lease_is_compared_with_redis_before_a_write() -> None:
    core = held_core()
    core.step(BlobRead(Q, AT_3.stored, core.stamp, term=4))  # ingest's floor, not the flush's READ
    # The tick's own read of Redis (not judging) keeps the blob as read: held under the lease
    core.step(RedisSaid(Q, 6, 0, core.stamp, ""))
    plan = core.plan(Q, 7)
    assert plan.step is Step.COMPARE and plan.base == READ_3 and core.behind(Q) is None
    reread = RedisSaid(Q, 6, 0, core.stamp, "", judge=True)  # the flush's reread
    assert core.step(reread) == [Report(Behind(3, 6))]
    assert core.plan(Q, 7).step is Step.WRITE
    assert core.plan(Q, 3).step is Step.SKIP  # holding the row's batch: nothing to compare


def test_a_blob_written_here_needs_no_comparison() -> None:
    core = held_core()
    core.step(BlobRead(Q, AT_3.stored, core.stamp, term=4))
    core.step(RedisSaid(Q, 3, 0, core.stamp, "", judge=True))
    assert core.step(WriteBegun(Q, READ_3)) == [Do.SEND]
    core.step(BlobWritten(Q, AT_7))
    assert core.plan(Q, 9).step is Step.WRITE


def test_a_read_begun_under_another_term_proves_nothing() -> None:
    core = held_core(term=5)
    core.step(BlobRead(Q, AT_3.stored, core.stamp, term=4))  # begun before the lease came back
    core.step(RedisSaid(Q, 6, 0, core.stamp, "", judge=True))
    assert core.behind(Q) is None and core.plan(Q, 7).step is Step.READ


def test_a_reset_this_redis_never_recorded_is_never_written_over() -> None:
    core = held_core()
    reset = reset_document(document(Q, 9), checkpoint(Q, 3), WRITER, reason="twin", history_size=4)
    core.step(BlobRead(Q, Stored('"r3"', reset), core.stamp, term=4))
    [report] = core.step(RedisSaid(Q, 6, 0, core.stamp, "", judge=True))
    assert isinstance(report, Report) and report.behind.reset == reset
    assert core.plan(Q, 7).step is Step.REFUSE
    assert core.plan(Q, 3).step is Step.SKIP  # nothing to write anyway


def test_a_reset_is_told_from_a_store_that_went_back_by_its_record() -> None:
    old = reset_document(document(Q, 9), checkpoint(Q, 3), WRITER, reason="r", history_size=4)
    assert old.reset_at is not None
    assert not reset_unrecorded(None, 6, "")  # no document: the store lost it whole
    assert not reset_unrecorded(document(Q, 3), 6, "")  # no reset record, none recorded
    assert not reset_unrecorded(old, 6, old.reset_at)  # the record Redis kept: same timeline
    assert reset_unrecorded(old, 6, "")  # Redis flushed with no reset: a new one
    assert reset_unrecorded(old, 6, "2020-01-01T00:00:00.000+00:00")  # another reset
    # Not recorded (a row of a version before it was kept): a reset that replaced a batch at
    # or above Redis' flushed one came after that flush
    assert reset_unrecorded(old, 9, None) and not reset_unrecorded(old, 10, None)


def test_a_renewal_reporting_another_version_makes_the_blob_unverified() -> None:
    core = held_core()
    core.step(BlobRead(Q, AT_3.stored, core.stamp, term=4))
    core.step(RedisSaid(Q, 3, 0, core.stamp, "", judge=True))
    core.step(LeaseRenewed(Q, 0.0, 60.0, 20.0, '"v3"'))  # the version seen: nothing to check
    assert core.unverified() == [] and core.plan(Q, 7).step is Step.WRITE
    core.step(LeaseRenewed(Q, 0.0, 60.0, 20.0, '"v9"'))  # changed under the lease
    assert core.unverified() == [Q] and core.due(Q) and core.plan(Q, 7).step is Step.READ
    core.step(BlobRead(Q, AT_3.stored, core.stamp, term=4))
    core.step(RedisSaid(Q, 3, 0, core.stamp, "", judge=True))  # compared: nothing behind
    assert core.unverified() == [] and core.behind(Q) is None
    core.step(Doubted(Q))  # an ack's confirming read failed: read at the next check
    core.step(LeaseLapsed(Q, "lost", 0.0))  # then the lease is lost: whoever holds it next judges
    assert core.unverified() == []


def test_a_resend_confirmed_by_its_own_read_is_compared_once_then_no_longer_due() -> None:
    # A resend of a batch the blob held: the shell's read answers it. The blob, read under
    # the lease but not by a flush, is unverified: compared with Redis by one flush (the row
    # alone), then not due any more. (It stayed due for ever: a flush every check.)
    core = held_core()
    core.step(BlobRead(Q, AT_3.stored, core.stamp, term=4))
    core.step(RedisSaid(Q, 3, 0, core.stamp, "", judge=True))
    waiter = object()
    assert core.step(AckWanted(Q, 3, waiter)) == [Do.READ] and core.due(Q)
    read = BlobRead(Q, AT_3.stored, core.stamp, term=4)
    assert core.step(read) == [Answer((waiter,))]  # answered
    core.step(AckGone(Q, waiter))
    plan = core.plan(Q, 3)
    assert plan.step is Step.COMPARE and plan.base == READ_3
    core.step(RedisSaid(Q, 3, 0, core.stamp, "", judge=True))  # the flush's reread
    assert not core.due(Q) and core.plan(Q, 3).step is Step.SKIP


def test_a_listing_at_another_version_forgets_what_the_blob_was_seen_to_hold() -> None:
    core = held_core()
    core.step(BlobRead(Q, AT_3.stored, core.stamp, term=4))
    core.step(RedisSaid(Q, 3, 0, core.stamp, "", judge=True))
    core.step(Listed(Q, '"v3"'))  # at the version seen: kept, compared once
    assert core.plan(Q, 3).step is Step.COMPARE
    core.step(Listed(Q, None))  # deleted since: read again, whatever the row
    assert core.due(Q) and core.plan(Q, 3).step is Step.READ and core.floor(Q) is None


def test_an_idle_query_writes_its_document_again_to_name_its_newest_snapshot() -> None:
    clock = [100.0]
    core: FlushCore[object, None] = FlushCore(
        Backoff(1, 2), clock=lambda: clock[0], shell=lambda: None
    )
    core.record(Q)
    core.step(LeaseAcquired(Q, 4, 0.0, 60.0, 20.0))
    core.step(BlobRead(Q, marked(6, SnapshotRef(5, "s5", "t"), '"v6"'), core.stamp, term=4))
    assert not core.marker_due(Q, 10.0) and core.plan(Q, 6).step is Step.SKIP
    core.step(SnapshotTaken(Q, SnapshotRef(7, "s7", "t")))  # ahead of the document: not yet
    assert not core.marker_due(Q, 0.0)
    core.step(SnapshotTaken(Q, SnapshotRef(6, "s6", "t")))  # its last batch's, nothing pending
    assert not core.marker_due(Q, 10.0)  # for the time threshold
    clock[0] += 10.0
    assert core.marker_due(Q, 10.0)
    plan = core.plan(Q, 6)
    assert plan.step is Step.WRITE  # the same batch again, naming it
    assert plan.base is not None and core.step(WriteBegun(Q, plan.base)) == [Do.SEND]
    core.step(BlobWritten(Q, marked(6, SnapshotRef(6, "s6", "t"), '"v6b"')))
    assert not core.marker_due(Q, 0.0) and core.plan(Q, 6).step is Step.SKIP
    # Of another timeline than the document's (a reset since): never.
    core.step(SnapshotTaken(Q, SnapshotRef(6, "x6", "old")))
    assert not core.marker_due(Q, 0.0)


def test_every_event_has_one_handler_and_anything_else_is_refused() -> None:
    kinds = {typing.get_origin(arg) or arg for arg in typing.get_args(Event)}
    assert len(kinds) == 35 and kinds == set(core_module._HANDLERS)
    with pytest.raises(TypeError, match="not an event of the flush core"):
        held_core().step(("core", 1))  # type: ignore[arg-type]


def test_a_flush_check_tells_every_listed_query_in_one_event() -> None:
    core = held_core()
    core.record("other")
    core.step(BlobRead(Q, AT_3.stored, core.stamp))
    core.step(BlobRead("other", Stored('"o2"', document("other", 2)), core.stamp))
    since = core.stamp
    waiter = object()
    core.step(AckWanted("other", 2, waiter))  # held as last seen: confirmed by a read
    entries = (
        PendingEntry(Q, 4, 1_000, flushed_batch_id=3),  # as seen: kept, pending
        PendingEntry("other", 0, None, flushed_batch_id=5),  # another writer's 5: forgotten
    )
    assert core.step(Checked(entries, since, now_ms=2_000)) == []
    assert core.get(Q).blob == AT_3 and core.get(Q).pending  # type: ignore[union-attr]
    other = core.get("other")
    assert other is not None and other.blob == Unread(5) and not other.pending
    # Begun before newer evidence (a read after ``since``), Redis' word is no evidence.
    core.step(BlobRead(Q, AT_7, core.stamp))
    core.step(Checked((PendingEntry(Q, 0, None, flushed_batch_id=1),), since, now_ms=3_000))
    assert core.get(Q).blob == Seen(AT_7)  # type: ignore[union-attr]
