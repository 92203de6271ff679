"""The stateful-rewind rule: a query with state may not be moved back by hand unless forced.
Pure.

A stateful query (aggregations, joins, deduplication, ``transformWithState``: its progress
lists state operators) keeps its state store in Spark's checkpoint directory, versioned by
batch. Restarting it from earlier offsets while its state store stays at the later batch
counts the batches in between twice (or fails when the versions do not match). So moving
such a query back — ``reset`` to an earlier batch or to explicit offsets, ``starting-offsets
--batch/--before`` — is refused unless forced, with what to do instead. Forward moves and
stateless queries are never refused here.
"""

from __future__ import annotations

from sidecar.model.checkpoint import Checkpoint

#: What to do, in every refusal.
REMEDY = (
    "its state store must be rewound to the same batch (restore the checkpoint directory's "
    "state/ from a copy taken at that batch) or the query restarted on a fresh state (a new "
    "checkpointLocation: aggregates start empty); then pass --force"
)


def rewind_refusal(current: Checkpoint, *, to_batch: int | None, explicit: bool) -> str | None:
    """Why moving ``current``'s query to ``to_batch`` (or to explicit offsets) is refused;
    None when it is allowed (the query is not stateful, or the move is not backwards)."""
    if not current.stateful:
        return None
    label = current.name or current.query_id
    if explicit:
        what = "explicit offsets"
    elif to_batch is not None and to_batch < current.batch_id:
        what = f"batch {to_batch} (it is at batch {current.batch_id})"
    else:
        return None
    return (
        f"query {label} is stateful (its progress lists state operators): moving it to "
        f"{what} would leave its state ahead of its offsets; {REMEDY}"
    )
