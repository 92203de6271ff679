"""Event Hubs checkpoints as the SDKs lay them out, and what to write. Pure.

Layout (``BlobCheckpointStore`` of azure-eventhub-checkpointstoreblob and its .NET, Java and
JavaScript siblings; KEDA's ``blobMetadata`` checkpoint strategy reads the same): one empty
blob per partition, ``<fully qualified namespace>/<event hub>/<consumer group>/checkpoint/
<partition id>``, lowercased as the Python and .NET SDKs do, whose metadata holds the
checkpoint: ``sequencenumber``, the last event processed, and ``offset``, its byte offset.

A checkpoint marks the last event processed: a processor resumes right after it, and KEDA
counts ``last enqueued - sequencenumber`` events of lag. Spark's ``endOffset`` is the next
sequence number to read, so the checkpoint is ``end - 1``; a partition whose end is 0 (or
-1) has had nothing processed and gets no checkpoint (KEDA then counts the whole partition,
as it does for any consumer that has not checkpointed).

Spark's connector tracks sequence numbers only and never learns byte offsets, so ``offset``
is written empty (:data:`OFFSET`): present, because the Python store's ``list_checkpoints``
requires the key, and empty, so that the .NET and Java processors, which fall back to the
sequence number when the offset does not parse, resume exactly after it. docs/eventhubs.md
has what each SDK and KEDA do with it, with the sources.

Never backwards, except on purpose: a partition whose stored sequence number is higher than
the new one keeps it (a query reset under the same name), as the Kafka committer skips such
partitions; a deliberate rewind (a reset through the daemon) writes its lower numbers, and a
partition another writer lowered is not raised again by the checkpoint current when that was
seen (``sidecar.model.positions``, the rules shared with Kafka). A rewind to a position where a
partition has processed nothing cannot say so (no checkpoint is written for it): its stored
checkpoint is kept, and named (``kept``).
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field

from sidecar.model import positions
from sidecar.model.checkpoint import Checkpoint
from sidecar.model.offsets import Offsets, group_name

#: The byte offset written: empty (Spark does not know it; see the module docstring).
OFFSET = ""
#: (event hub, partition) → the last sequence number processed.
Positions = dict[tuple[str, int], int]


def prefix(namespace: str, eventhub: str, consumer_group: str) -> str:
    """The blob name prefix of a consumer group's checkpoints on one event hub."""
    return f"{namespace}/{eventhub}/{consumer_group}/checkpoint/".lower()


def blob_name(namespace: str, eventhub: str, consumer_group: str, partition: int) -> str:
    """The checkpoint blob of one partition (the SDKs lowercase the whole name)."""
    return f"{prefix(namespace, eventhub, consumer_group)}{partition}"


def metadata(sequence_number: int) -> dict[str, str]:
    """The blob metadata of a checkpoint at ``sequence_number`` (the last event processed)."""
    return {"sequencenumber": str(sequence_number), "offset": OFFSET}


def consumer_group(template: str, checkpoint: Checkpoint, namespace: str) -> str:
    """The consumer group a query's checkpoints are written for (the Kafka groups' template
    placeholders: ``{query_name}``, ``{query_id}``, ``{namespace}``, the daemon's)."""
    return group_name(template, checkpoint, namespace)


def processed(ends: Offsets) -> Positions:
    """The last sequence number processed per partition, from Spark's end offsets (the next
    to read); partitions with nothing processed are left out."""
    return {key: end - 1 for key, end in ends.items() if end > 0}


def unprocessed(ends: Offsets) -> set[tuple[str, int]]:
    """The partitions of Spark's end offsets with nothing processed (no checkpoint says so)."""
    return {key for key, end in ends.items() if end <= 0}


def parse_stored(text: str | None) -> int | None:
    """A stored ``sequencenumber`` (decimal int64); None when absent or unreadable (then it
    is simply overwritten, as a consumer that never checkpointed would be)."""
    if text is None:
        return None
    text = text.strip()
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit()) or not -(2**63) <= int(text) < 2**63:
        return None
    return int(text)


@dataclass(frozen=True)
class Plan:
    """One write pass of a group: the partitions to write, and those not written (each
    ``str()`` for the log: ``"eh-0: 41 -> 7"``)."""

    #: (event hub, partition) → the sequence number to write.
    write: Positions
    #: Partitions that would move backwards, refused (not a rewind).
    lowered: list[positions.Move] = field(default_factory=list)
    #: Partitions moved backwards on purpose (a rewind): in ``write`` too.
    rewound: list[positions.Move] = field(default_factory=list)
    #: Partitions another writer lowered since, left as it set them.
    held: list[positions.Move] = field(default_factory=list)
    #: A rewind's partitions with nothing processed whose stored checkpoint stays ("eh-3: 41").
    kept: list[str] = field(default_factory=list)


def plan(
    wanted: Positions,
    stored: Mapping[tuple[str, int], int],
    *,
    rewind: bool = False,
    held: Set[tuple[str, int]] = frozenset(),
    unset: Set[tuple[str, int]] = frozenset(),
) -> Plan:
    """What to write for ``wanted`` given what the store holds (as far as we know): every
    partition whose stored number is lower or unknown; equal ones are already there, higher
    ones are lowered only by a ``rewind``; partitions in ``held`` (another writer lowered
    them) are left, unless for a rewind. ``unset``: the checkpoint's partitions with nothing
    processed, which a rewind names when a checkpoint is stored for them."""
    moves = positions.decide(wanted, stored, rewind=rewind, held=held)
    kept = [f"{k[0]}-{k[1]}: {stored[k]}" for k in sorted(unset) if rewind and k in stored]
    return Plan(moves.write, moves.regressed, moves.rewound, moves.held, kept)
