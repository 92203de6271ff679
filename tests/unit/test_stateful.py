"""What a record says of its query's state, and how it sticks (``sidecar.model.stateful``):
the table of :func:`carried` and the refusals. Against a daemon and real PySpark:
tests/integration/test_reset.py and tests/integration/test_spark_import.py."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.errors import AdminRefused
from sidecar.model.document import CheckpointDocument
from sidecar.model.stateful import State, carried, rewind_refusal, state_of, with_state
from sidecar.ops.admin_steps import target_of
from sidecar.wire.protocol import Reset, SourceSpec
from tests.unit.fakes import WRITER, checkpoint

S, U, N = State.STATEFUL, State.UNKNOWN, State.STATELESS


@pytest.mark.parametrize(
    ("previous", "new", "kept"),
    [
        (None, S, S),
        (None, U, U),
        (None, N, N),
        (S, N, S),  # sticky: a progress without state operators never lowers it
        (S, U, S),  # an import without state/ never lowers it either
        (U, N, N),  # the listener's first progress settles "unknown" either way
        (U, S, S),
        (N, U, N),  # an import without state/ does not hide what the listener said
        (N, S, S),
    ],
)
def test_what_a_record_says_of_state_sticks(
    previous: State | None, new: State, kept: State
) -> None:
    assert carried(previous, new) is kept


def test_unknown_reads_as_stateful_to_older_readers_and_as_unknown_here() -> None:
    c = with_state(checkpoint("q", 5), U)
    assert c.stateful is True and c.state_unknown is True and state_of(c) is U
    assert state_of(checkpoint("q", 5)) is N  # an older record, as today
    assert state_of(with_state(checkpoint("q", 5), S)) is S


def test_a_stateful_or_unknown_query_is_not_moved_back_without_the_state_flag() -> None:
    for state, why in ((S, "is stateful"), (U, "may be stateful")):
        current = with_state(checkpoint("q", 5, name="orders"), state)
        refusal = rewind_refusal(current, to_batch=3, explicit=False)
        assert refusal is not None and f"query orders {why}" in refusal
        assert "--state-rewound" in refusal and "--force does not" in refusal
        assert rewind_refusal(current, to_batch=None, explicit=True) is not None
        assert rewind_refusal(current, to_batch=5, explicit=False) is None  # not backwards
    assert rewind_refusal(checkpoint("q", 5), to_batch=3, explicit=False) is None


def test_spark_imports_are_judged_like_any_other_rewind() -> None:
    # ``target_of`` for an import (``from_spark``): the guard must not be dodged by leaving
    # out the batch, nor by a document that said stateless before the directory's state/.
    stateful_doc = CheckpointDocument.of(with_state(checkpoint("q", 5, name="orders"), S), WRITER)
    stateless_doc = CheckpointDocument.of(checkpoint("q", 5, name="orders"), WRITER)
    offsets = (SourceSpec(end_offset=1, description="rate"),)

    def imported(**fields: Any) -> Reset:
        return Reset(reason="r", query_id="q", sources=offsets, from_spark=True, **fields)

    with pytest.raises(AdminRefused, match="explicit offsets"):
        target_of(imported(), "q", "orders", stateful_doc)  # offsets with no batch
    with pytest.raises(AdminRefused, match="batch 3"):
        target_of(imported(batch_id=3, stateful=True), "q", "orders", stateless_doc)
    # Allowed: Spark's batch not older, a stateless query's, the state moved with it.
    assert target_of(imported(batch_id=6), "q", "orders", stateful_doc).batch_id == 6
    assert target_of(imported(batch_id=3), "q", "orders", stateless_doc).batch_id == 3
    rewound = imported(batch_id=3, stateful=True, state_rewound=True)
    assert target_of(rewound, "q", "orders", stateful_doc).batch_id == 3
