"""Offsets: the shapes of Spark's source offsets, and resuming from them. Pure.

Spark's Kafka source reports offsets as ``{"topic": {"partition": offset}}``;
:func:`kafka_offsets` flattens a checkpoint's Kafka sources for the Kafka committer and the
lag gauges, :func:`kafka_starting_offsets` turns a saved checkpoint into a new query's
``startingOffsets``; :func:`group_name` and :func:`commit_metadata` say where the committer
commits them and what it writes beside them.

The Event Hubs connector (azure-event-hubs-spark) reports the same shape,
``{"<event hub>": {"<partition>": <sequence number>}}``, so its sources are told apart by
their description (the connector's class name, :data:`EVENTHUBS_SOURCE_PREFIXES`), never by
shape alone: :func:`eventhubs_offsets` flattens them for the Event Hubs checkpoints and lag,
:func:`eventhubs_starting_positions` gives the connector's ``eventhubs.startingPositions``
JSON, and :func:`starting_offsets` picks whichever the chosen source needs.

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
#: Descriptions of the Event Hubs connector's source: its class name, followed by a JVM object
#: hash that the daemon strips (``org.apache.spark.sql.eventhubs.EventHubsSource@1a2b3c``).
EVENTHUBS_SOURCE_PREFIXES = ("org.apache.spark.sql.eventhubs.EventHubsSource",)
#: The connector's positions (``EventPosition`` as json4s writes it): a sequence number, the
#: start of the stream (offset "-1") and its end (offset "@latest", exclusive, as the
#: connector's own ``EventPosition.fromEndOfStream``). Starting positions are inclusive.
_EH_START = {"offset": "-1", "seqNo": -1, "enqueuedTime": None, "isInclusive": True}
_EH_END = {"offset": "@latest", "seqNo": -1, "enqueuedTime": None, "isInclusive": False}
_EH_MISSING = {"earliest": _EH_START, "latest": _EH_END}


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


def _sequence_number(o: Any) -> bool:
    """An Event Hubs sequence number: an int64 (-1: the connector's "none yet")."""
    return isinstance(o, int) and not isinstance(o, bool) and -1 <= o < 2**63


def is_eventhubs_offsets(value: Any) -> bool:
    """True for offsets shaped like the Event Hubs connector's: ``{"eh": {"0": 42, ...}}``
    (event hub name -> partition id -> the next sequence number to read)."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(
            isinstance(parts, dict)
            and bool(parts)
            and all(_partition(p) and _sequence_number(o) for p, o in parts.items())
            for parts in value.values()
        )
    )


def is_eventhubs_source(description: str | None, offsets: Any) -> bool:
    """True for a source the Event Hubs connector describes, with offsets of its shape."""
    return (
        isinstance(description, str)
        and description.startswith(EVENTHUBS_SOURCE_PREFIXES)
        and is_eventhubs_offsets(offsets)
    )


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


def _pick_source(
    checkpoint: Mapping[str, Any], candidates: list[int], source: int | None, kind: str
) -> int:
    """The index of the source to resume: ``source`` when it is a candidate, else the one
    candidate. ``kind`` names the candidates in messages ("Kafka", "Event Hubs").

    Raises:
        ResumeError: ``source`` is not a candidate, or there is not exactly one.
    """
    sources = checkpoint.get("sources") or []
    if source is not None:
        if source not in candidates:
            raise ResumeError(
                f"source {source} of query {checkpoint.get('name')!r} has no "
                f"{kind}-shaped end offset; {kind} sources: {candidates}"
            )
        return source
    if len(candidates) == 1:
        return candidates[0]
    described = [f"{i}: {sources[i].get('description')}" for i in candidates]
    raise ResumeError(
        f"query {checkpoint.get('name')!r} has {len(candidates)} {kind}-shaped sources "
        f"({'; '.join(described) or 'none'}); choose one with source=<index>"
    )


def _is_eventhubs(source: Mapping[str, Any]) -> bool:
    return is_eventhubs_source(source.get("description"), source.get("end_offset"))


def _check_missing(missing: str) -> None:
    if missing not in ("earliest", "latest", "error"):
        raise ResumeError(f"missing={missing!r}: use 'earliest', 'latest' or 'error'")


def starting_offsets(
    checkpoint: Mapping[str, Any],
    *,
    source: int | None = None,
    partitions: Mapping[str, int] | None = None,
    missing: Missing = "earliest",
) -> str:
    """The JSON that resumes the chosen source of ``checkpoint``: the Kafka source's
    ``startingOffsets`` (:func:`kafka_starting_offsets`) or, for an Event Hubs source, the
    connector's ``eventhubs.startingPositions`` (:func:`eventhubs_starting_positions`).
    The source is chosen among both kinds (their offsets have one shape); arguments and
    errors as theirs.
    """
    _check_missing(missing)
    sources = checkpoint.get("sources") or []
    candidates = [i for i, s in enumerate(sources) if is_kafka_offsets(s.get("end_offset"))]
    index = _pick_source(checkpoint, candidates, source, "Kafka")
    resume = (
        eventhubs_starting_positions if _is_eventhubs(sources[index]) else kafka_starting_offsets
    )
    return resume(checkpoint, source=index, partitions=partitions, missing=missing)


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
        ResumeError: no (or an ambiguous) Kafka source, the source chosen is the Event Hubs
            connector's (:func:`eventhubs_starting_positions` resumes it), or absent
            partitions with "error".
    """
    _check_missing(missing)
    sources = checkpoint.get("sources") or []
    candidates = [i for i, s in enumerate(sources) if is_kafka_offsets(s.get("end_offset"))]
    index = _pick_source(checkpoint, candidates, source, "Kafka")
    if _is_eventhubs(sources[index]):
        raise ResumeError(
            f"source {index} of query {checkpoint.get('name')!r} is an Event Hubs source "
            f"({sources[index].get('description')}): it resumes from the connector's "
            "eventhubs.startingPositions, not a Kafka startingOffsets; use "
            "sidecar.model.offsets.starting_offsets or `checkpoint-sidecar starting-offsets`"
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


def eventhubs_starting_positions(
    checkpoint: Mapping[str, Any],
    *,
    source: int | None = None,
    partitions: Mapping[str, int] | None = None,
    missing: Missing = "earliest",
) -> str:
    r"""The Event Hubs connector's ``eventhubs.startingPositions`` JSON for the Event Hubs
    source of ``checkpoint``: one entry per partition, keyed by the connector's
    ``NameAndPartition`` JSON, each an ``EventPosition`` at the saved end sequence number,
    inclusive (the next event to read: nothing skipped, nothing read twice), e.g.
    ``{"{\"ehName\":\"eh\",\"partitionId\":0}":{"offset":null,"seqNo":42,
    "enqueuedTime":null,"isInclusive":true}}``. A partition the connector saved as -1 (nothing
    read yet) starts at the start of the stream.

    Args:
        checkpoint: a checkpoint as ``get`` returns it (``sources[].end_offset``).
        source: index of the source in the query; needed only when several are Event Hubs'.
        partitions: event hub → current partition count, to name partitions absent from the
            checkpoint. The connector does not need every partition named (it starts the
            others at ``eventhubs.startingPosition``, by default the start of the stream).
        missing: what absent partitions start from: "earliest" (the start of the stream),
            "latest" (its end: only new events), or "error".

    Raises:
        ResumeError: no (or an ambiguous) Event Hubs source, or absent partitions with
            "error".
    """
    _check_missing(missing)
    sources = checkpoint.get("sources") or []
    candidates = [i for i, s in enumerate(sources) if _is_eventhubs(s)]
    index = _pick_source(checkpoint, candidates, source, "Event Hubs")
    numbers: dict[tuple[str, int], int | None] = {
        (eventhub, int(p)): n
        for eventhub, parts in sources[index]["end_offset"].items()
        for p, n in parts.items()
    }
    absent = [
        f"{eventhub}-{p}"
        for eventhub, count in (partitions or {}).items()
        for p in range(count)
        if numbers.setdefault((eventhub, p), None) is None
    ]
    if absent and missing == "error":
        raise ResumeError(
            f"the checkpoint has no sequence numbers for {', '.join(absent)}; pass "
            "missing='earliest' or 'latest' to choose where they start"
        )
    positions = {}
    for (eventhub, p), n in sorted(numbers.items()):
        key = json.dumps({"ehName": eventhub, "partitionId": p}, separators=(",", ":"))
        if n is None:
            positions[key] = _EH_MISSING[missing]
        elif n < 0:
            positions[key] = _EH_START
        else:
            positions[key] = {"offset": None, "seqNo": n, "enqueuedTime": None, "isInclusive": True}
    return json.dumps(positions, separators=(",", ":"))


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
