"""The order and bound of the replies a connection owes (``sidecar.ingest.replies``), tested
three ways like the decoder: everything settled at once, one reply at a time in every order,
and with replies still owed at the end."""

from __future__ import annotations

import itertools

import pytest

from sidecar.ingest.replies import OwedReplies

REPLIES = [b"r0\n", b"r1\n", b"r2\n", b"r3\n"]


def drain(owed: OwedReplies[str]) -> list[bytes]:
    """Take what is ready, awaiting (here: settling) pending heads in their turn."""
    out: list[bytes] = []
    while owed:
        if ready := owed.take():
            out += ready
        elif head := owed.head():
            slot, pending = head
            owed.settle(slot, pending.encode())
        else:
            break
    return out


def test_settled_all_at_once_they_leave_together_in_request_order() -> None:
    owed: OwedReplies[str] = OwedReplies()
    slots = [owed.owe() for _ in REPLIES]
    for slot in reversed(slots):
        owed.settle(slot, REPLIES[slot])
    assert owed.take() == REPLIES
    assert len(owed) == 0 and owed.take() == [] and owed.head() is None


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_settled_one_at_a_time_in_any_order_each_leaves_in_its_turn(
    order: tuple[int, ...],
) -> None:
    owed: OwedReplies[str] = OwedReplies()
    slots = [owed.owe() for _ in REPLIES]
    sent: list[bytes] = []
    for i in order:
        owed.settle(slots[i], REPLIES[i])
        ready = owed.take()
        assert ready == REPLIES[len(sent) : len(sent) + len(ready)]  # a prefix, in order
        sent += ready
        assert len(sent) == len(REPLIES) or slots[len(sent)] not in order[: order.index(i) + 1]
    assert sent == REPLIES


def test_with_replies_still_owed_only_the_settled_head_leaves() -> None:
    owed: OwedReplies[str] = OwedReplies()
    first, second, third = owed.owe(), owed.owe("pending"), owed.owe()
    owed.settle(third, b"third\n")
    owed.settle(first, b"first\n")
    assert owed.take() == [b"first\n"]  # the second is owed: the third waits for it
    assert owed.head() == (second, "pending")
    assert drain(owed) == [b"pending", b"third\n"]
    late = owed.owe("late")
    assert owed.drop() == ["late"] and len(owed) == 0  # cut: never awaited
    owed.settle(late, b"gone\n")  # settled after the cut: ignored
    assert owed.take() == []


def test_pending_and_settled_replies_interleave_in_request_order() -> None:
    owed: OwedReplies[str] = OwedReplies()
    owed.owe("a")
    settled = owed.owe()
    owed.owe("c")
    owed.settle(settled, b"b")
    assert drain(owed) == [b"a", b"b", b"c"]


def test_the_bound_is_reached_and_left() -> None:
    owed: OwedReplies[str] = OwedReplies(limit=2)
    a = owed.owe()
    assert not owed.full
    owed.owe()
    assert owed.full  # stop reading
    owed.settle(a, b"a")
    assert owed.take() == [b"a"] and not owed.full
    with pytest.raises(ValueError, match="never owed"):
        owed.settle(5, b"x")
    with pytest.raises(ValueError, match="at least one"):
        OwedReplies(limit=0)
