"""Offsets: the shapes of Spark's source offsets, and resuming from them. Pure.

Spark's Kafka source reports offsets as ``{"topic": {"partition": offset}}``;
:func:`kafka_offsets` flattens a checkpoint's Kafka sources for the Kafka committer and the
lag gauges; :func:`group_name` and :func:`commit_metadata` say where the committer commits
them and what it writes beside them. The Event Hubs connector reports the same shape, told
apart by its description: :func:`eventhubs_offsets` flattens those for the Event Hubs
checkpoints and lag. :func:`rewind` picks a retained checkpoint of a blob document.

Resuming a new query from a checkpoint (``startingOffsets``, the connector's
``eventhubs.startingPositions``) and the shapes' predicates are ``spark_bridge.resume``'s,
re-exported here: the Spark side runs them on a driver's Python (3.8+, without the daemon's
dependencies), so that module is their one source.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sidecar.model.checkpoint import Checkpoint, offset_value
from sidecar.model.document import CheckpointDocument, HistoryEntry

# The resume rules are the Spark side's, shared (pure, standard library only): one source for
# spark_bridge.starting_offsets on a driver's Python and for the CLI's starting-offsets.
from spark_bridge.resume import EVENTHUBS_SOURCE_PREFIXES as EVENTHUBS_SOURCE_PREFIXES
from spark_bridge.resume import KAFKA_SOURCE_PREFIXES as KAFKA_SOURCE_PREFIXES
from spark_bridge.resume import Missing as Missing
from spark_bridge.resume import ResumeError as ResumeError
from spark_bridge.resume import eventhubs_starting_positions as eventhubs_starting_positions
from spark_bridge.resume import is_eventhubs_offsets as is_eventhubs_offsets
from spark_bridge.resume import is_eventhubs_source as is_eventhubs_source
from spark_bridge.resume import is_kafka_offsets as is_kafka_offsets
from spark_bridge.resume import kafka_starting_offsets as kafka_starting_offsets
from spark_bridge.resume import starting_offsets as starting_offsets

#: Offsets of Kafka partitions: (topic, partition) → offset.
Offsets = dict[tuple[str, int], int]


def eventhubs_offsets(checkpoint: Checkpoint, which: str = "end_offset") -> Offsets:
    """Sequence numbers (``which``: end_offset or latest_offset) of the checkpoint's Event
    Hubs sources, as {(event hub, partition): sequence number}. An end offset is the next
    sequence number to read; the last one processed is one less."""
    out: Offsets = {}
    for source in checkpoint.sources:
        if not source.description.startswith(EVENTHUBS_SOURCE_PREFIXES):
            continue
        offsets = offset_value(getattr(source, which))
        if is_eventhubs_offsets(offsets):
            for eventhub, parts in offsets.items():
                for partition, number in parts.items():
                    out[(eventhub, int(partition))] = int(number)
    return out


def kafka_offsets(
    checkpoint: Checkpoint,
    extra_queries: frozenset[str] = frozenset(),
    which: str = "end_offset",
) -> Offsets:
    """Offsets (``which``: end_offset or latest_offset) of the checkpoint's Kafka sources, as
    {(topic, partition): offset}.

    A source counts when Spark describes it as Kafka, or — for queries named in
    ``extra_queries`` (by name or id) — when its offsets merely have the Kafka shape.
    """
    opted_in = bool({checkpoint.query_id, checkpoint.name} & extra_queries)
    out: Offsets = {}
    for source in checkpoint.sources:
        if not (source.description.startswith(KAFKA_SOURCE_PREFIXES) or opted_in):
            continue
        offsets = offset_value(getattr(source, which))  # kept as JSON text until needed
        if is_kafka_offsets(offsets):
            for topic, parts in offsets.items():
                for partition, offset in parts.items():
                    out[(topic, int(partition))] = int(offset)
    return out


def parse_time(value: str | datetime) -> datetime:
    """An ISO 8601 time (``2026-11-21T10:00:00Z``; without a zone: UTC), or a datetime.

    Raises:
        ResumeError: not an ISO 8601 time.
    """
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.strip())
        except ValueError:
            raise ResumeError(
                f"{value!r} is not an ISO 8601 time; e.g. 2026-11-21T10:00:00Z"
            ) from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _spark_time(entry: HistoryEntry) -> datetime | None:
    try:
        return parse_time(entry.timestamp)
    except ResumeError:
        return None


def describe_retained(retained: list[HistoryEntry]) -> str:
    """What a document retains, for messages: its batches (newest first) and their times."""
    ids = [str(e.batch_id) for e in retained]
    shown = ", ".join(ids if len(ids) <= 12 else [*ids[:6], "…", *ids[-3:]])
    return (
        f"{len(ids)} checkpoint(s) retained: batches {shown} (Spark timestamps "
        f"{retained[-1].timestamp} to {retained[0].timestamp})"
    )


def rewind(
    doc: CheckpointDocument, *, batch: int | None = None, before: str | datetime | None = None
) -> dict[str, Any]:
    """A retained checkpoint of ``doc`` (its own or one of its history), as ``get`` returns a
    checkpoint, with each source's ``end_offset`` of that batch.

    Args:
        batch: exactly this batch id.
        before: the newest checkpoint whose Spark timestamp (the batch's trigger time) is
            earlier than this time (ISO 8601 text, no zone meaning UTC, or a datetime).
        Neither: the document's own (latest) checkpoint.

    Raises:
        ResumeError: both given, a bad time, or no retained checkpoint matches (the message
            says what is retained).
    """
    if batch is not None and before is not None:
        raise ResumeError("pass batch or before, not both")
    retained = doc.retained()
    if before is not None:
        limit = parse_time(before)
        found = next((e for e in retained if (t := _spark_time(e)) and t < limit), None)
        asked = f"no checkpoint before {limit.isoformat()}"
    else:
        found = next((e for e in retained if batch in (None, e.batch_id)), None)
        asked = f"batch {batch} is not retained"
    if found is None:
        raise ResumeError(
            f"{asked} for query {doc.label!r}: {describe_retained(retained)}; "
            "SIDECAR_HISTORY_SIZE says how many flushed checkpoints a blob keeps"
        )
    sources = [
        {
            "description": doc.sources[i].description if i < len(doc.sources) else f"source {i}",
            "start_offset": None,
            "end_offset": offset_value(end),
            "latest_offset": None,
        }
        for i, end in enumerate(found.end_offsets)
    ]
    return {
        "query_id": doc.query_id,
        "run_id": doc.run_id,
        "name": doc.name,
        "batch_id": found.batch_id,
        "timestamp": found.timestamp,
        "written_at": found.written_at,
        "sources": sources,
    }


def group_name(template: str, checkpoint: Checkpoint, namespace: str) -> str:
    return template.format(
        query_name=checkpoint.label, query_id=checkpoint.query_id, namespace=namespace
    )


def commit_metadata(checkpoint: Checkpoint) -> str:
    return json.dumps(
        {
            "committer": "checkpoint-sidecar",
            "query_id": checkpoint.query_id,
            "run_id": checkpoint.run_id,
            "batch_id": checkpoint.batch_id,
        },
        separators=(",", ":"),
    )
