"""Whether a query keeps state, and the stateful-rewind rule. Pure.

A stateful query (aggregations, joins, deduplication, ``transformWithState``: its progress
lists state operators) keeps its state store in Spark's checkpoint directory, versioned by
batch. Restarting it from earlier offsets while its state store stays at the later batch
counts the batches in between twice (or fails when the versions do not match). So moving
such a query back — ``reset`` to an earlier batch or to explicit offsets, ``starting-offsets
--batch/--before``, ``spark_bridge.starting_offsets``, an import of an older cut — is refused
unless the caller says the state moved too (``--state-rewound``, ``state_rewound=True``). A
flag that names state, on purpose: ``--force`` (the quiet time, a newer blob) never does.

What a record says of state is one of three (:class:`State`), and it is sticky:

- **stateful** once a progress listed state operators or an import saw ``state/`` or state
  ids: nothing lowers it but a reset with ``--state-rewound``;
- **unknown** after an import whose directory has no ``state/`` (the usual copy of metadata,
  offsets and commits): never recorded as stateless; moving it back needs the flag too;
- **stateless** once the listener's first progress says so (a progress with no state
  operators is a stateless query): it settles "unknown" either way.

Records store it as ``stateful`` plus ``state_unknown`` (``sidecar.model.checkpoint``);
records written before have no ``state_unknown`` and read as they did (true: stateful).
"""

from __future__ import annotations

import enum

import msgspec

from sidecar.model.checkpoint import Checkpoint


class State(enum.Enum):
    STATELESS = "stateless"
    STATEFUL = "stateful"
    UNKNOWN = "unknown"


def state_of(checkpoint: Checkpoint) -> State:
    """What ``checkpoint`` says of its query's state."""
    if checkpoint.state_unknown:
        return State.UNKNOWN
    return State.STATEFUL if checkpoint.stateful else State.STATELESS


def with_state(checkpoint: Checkpoint, state: State) -> Checkpoint:
    """``checkpoint`` saying ``state`` (unknown is stored as stateful for older readers)."""
    return msgspec.structs.replace(
        checkpoint, stateful=state is not State.STATELESS, state_unknown=state is State.UNKNOWN
    )


def carried(previous: State | None, new: State) -> State:
    """The state a record says when ``new`` replaces what said ``previous`` (None: nothing):
    stateful sticks, unknown never hides what was known, a known state settles unknown."""
    if previous is State.STATEFUL:
        return State.STATEFUL
    if new is State.UNKNOWN and previous is not None:
        return previous
    return new


def carry(previous: Checkpoint | None, checkpoint: Checkpoint) -> Checkpoint:
    """``checkpoint`` with the state :func:`carried` from ``previous`` (the record it replaces)."""
    state = carried(state_of(previous) if previous is not None else None, state_of(checkpoint))
    return checkpoint if state is state_of(checkpoint) else with_state(checkpoint, state)


#: What to do, in every refusal.
REMEDY = (
    "its state store must move to the same batch: restore the checkpoint directory's state/ "
    "from a snapshot of that batch (`checkpoint-sidecar restore QUERY DIR --batch N` restores "
    "the whole directory), or restart the query on a fresh state (a new checkpointLocation: "
    "aggregates start empty); then pass --state-rewound (--force does not: it is for the "
    "quiet time and a newer blob)"
)


def rewind_refusal(current: Checkpoint, *, to_batch: int | None, explicit: bool) -> str | None:
    """Why moving ``current``'s query to ``to_batch`` (or to explicit offsets) is refused
    without ``--state-rewound``; None when it is allowed (the query is stateless, or the move
    is not backwards)."""
    state = state_of(current)
    if state is State.STATELESS:
        return None
    label = current.name or current.query_id
    if explicit:
        what = "explicit offsets"
    elif to_batch is not None and to_batch < current.batch_id:
        what = f"batch {to_batch} (it is at batch {current.batch_id})"
    else:
        return None
    why = (
        "is stateful (its progress lists state operators)"
        if state is State.STATEFUL
        else "may be stateful (imported without its state/: unknown until its next progress)"
    )
    return (
        f"query {label} {why}: moving it to {what} would leave its state store ahead of its "
        f"offsets; {REMEDY}"
    )
