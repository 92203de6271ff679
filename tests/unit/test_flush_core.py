"""What the blob holds, as the flush core's one closed value (``sidecar.flush.core.advance``):
every (value, event) pair, the moves it allows and the ones it refuses. The same table runs
under the real flusher in the simulation (test_flush_simulation.py) and against Azurite in
tests/faults/test_fencing.py."""

from __future__ import annotations

import itertools

import pytest

from sidecar.backoff import Backoff
from sidecar.buffer.lua import NO_BLOB
from sidecar.flush.core import (
    Abandoned,
    Begin,
    Blob,
    BlobEvent,
    Created,
    FlushCore,
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
)
from sidecar.model.document import SnapshotRef, Stored
from tests.unit.fakes import document

Q = "core"
AT_3 = Seen(Stored('"v3"', document(Q, 3)))
AT_7 = Stored('"v7"', document(Q, 7))
VALUES: list[Blob] = [Unread(2), AT_3, Writing(AT_3)]
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


def test_a_snapshot_names_the_newest_and_never_brings_a_retired_query_back() -> None:
    core: FlushCore[object, None] = FlushCore(Backoff(1, 2), clock=lambda: 0.0, locks=lambda: None)
    core.record(Q)
    core.snapshot_taken(Q, SnapshotRef(5, "s5"))
    core.snapshot_taken(Q, SnapshotRef(4, "s4"))  # an older one finishing late
    assert core.snapshot_of(Q) == SnapshotRef(5, "s5")
    core.forget(Q)  # retired while a snapshot was in flight
    core.snapshot_taken(Q, SnapshotRef(6, "s6"))
    assert Q not in core and core.snapshot_of(Q) is None
