"""Offsets: the shapes of Spark's source offsets, and resuming from them. Pure.

Spark's Kafka source reports offsets as ``{"topic": {"partition": offset}}``;
:func:`kafka_offsets` flattens a checkpoint's Kafka sources for the Kafka committer and the
lag gauges, :func:`kafka_starting_offsets` turns a saved checkpoint into a new query's
``startingOffsets``; :func:`group_name` and :func:`commit_metadata` say where the committer
commits them and what it writes beside them.

Spark's ``endOffset`` of a finished batch is the next offset to read, so starting a new query
from it neither skips nor repeats a committed batch.

Spark's Kafka source refuses a ``startingOffsets`` JSON that does not name every partition
of the subscribed topics ("you must specify all TopicPartitions"). Partitions the checkpoint
does not know (a topic added to the subscription, partitions added to a topic) are filled
according to ``missing``: ``"earliest"`` (-2: read them from the start; nothing is skipped),
``"latest"`` (-1: only new records), or ``"error"``. Pass ``partitions`` (topic → partition
count) to say which partitions exist now; without it only the checkpoint's are named.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from sidecar.errors import SidecarError
from sidecar.model.checkpoint import Checkpoint, offset_value
from sidecar.model.document import CheckpointDocument, HistoryEntry

Missing = Literal["earliest", "latest", "error"]
#: Offsets of Kafka partitions: (topic, partition) → offset.
Offsets = dict[tuple[str, int], int]
#: Descriptions of Spark's Kafka sources (v1 KafkaSource, v2 KafkaV2 / KafkaMicroBatchStream).
KAFKA_SOURCE_PREFIXES = ("KafkaV2", "KafkaSource", "KafkaMicroBatchStream", "KafkaTable")
_SPECIAL = {"earliest": -2, "latest": -1}


class ResumeError(SidecarError):
    """The checkpoint cannot give starting offsets as asked; the message says why."""


def _partition(p: Any) -> bool:
    """A Kafka partition number as Spark writes it: ASCII digits, within int32."""
    return isinstance(p, str) and p.isascii() and p.isdigit() and int(p) < 2**31


def _offset(o: Any) -> bool:
    """A Kafka offset: an int64 (-2/-1 are Spark's earliest/latest markers)."""
    return isinstance(o, int) and not isinstance(o, bool) and -2 <= o < 2**63


def is_kafka_offsets(value: Any) -> bool:
    """True for offsets shaped like Spark's Kafka source: ``{"topic": {"0": 42, ...}}``."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(
            isinstance(parts, dict) and all(_partition(p) and _offset(o) for p, o in parts.items())
            for parts in value.values()
        )
    )


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


def kafka_starting_offsets(
    checkpoint: Mapping[str, Any],
    *,
    source: int | None = None,
    partitions: Mapping[str, int] | None = None,
    missing: Missing = "earliest",
) -> str:
    """The ``startingOffsets`` JSON for the Kafka source of ``checkpoint``.

    Args:
        checkpoint: a checkpoint as ``get`` returns it (``sources[].end_offset``).
        source: index of the source in the query; needed only when several are Kafka-shaped.
        partitions: topic → current partition count, to name partitions absent from the
            checkpoint (and topics newly subscribed).
        missing: what absent partitions start from: "earliest", "latest", or "error".

    Raises:
        ResumeError: no (or an ambiguous) Kafka source, or absent partitions with "error".
    """
    if missing not in ("earliest", "latest", "error"):
        raise ResumeError(f"missing={missing!r}: use 'earliest', 'latest' or 'error'")
    sources = checkpoint.get("sources") or []
    candidates = [i for i, s in enumerate(sources) if is_kafka_offsets(s.get("end_offset"))]
    if source is not None:
        if source not in candidates:
            raise ResumeError(
                f"source {source} of query {checkpoint.get('name')!r} has no "
                f"Kafka-shaped end offset; Kafka sources: {candidates}"
            )
        index = source
    elif len(candidates) == 1:
        index = candidates[0]
    else:
        described = [f"{i}: {sources[i].get('description')}" for i in candidates]
        raise ResumeError(
            f"query {checkpoint.get('name')!r} has {len(candidates)} Kafka-shaped sources "
            f"({'; '.join(described) or 'none'}); choose one with source=<index>"
        )
    offsets: dict[str, dict[str, int]] = {
        topic: dict(parts) for topic, parts in sources[index]["end_offset"].items()
    }
    absent: list[str] = []
    for topic, count in (partitions or {}).items():
        known = offsets.setdefault(topic, {})
        for p in range(count):
            if str(p) not in known:
                absent.append(f"{topic}-{p}")
                if missing != "error":
                    known[str(p)] = _SPECIAL[missing]
    if absent and missing == "error":
        raise ResumeError(
            f"the checkpoint has no offsets for {', '.join(absent)}; pass "
            "missing='earliest' or 'latest' to choose where they start"
        )
    ordered = {
        t: dict(sorted(parts.items(), key=lambda kv: int(kv[0])))
        for t, parts in sorted(offsets.items())
    }
    return json.dumps(ordered, separators=(",", ":"))


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
