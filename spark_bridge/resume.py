"""Where a new query resumes: a saved checkpoint turned into its source's starting position.
Pure, standard library only (Python 3.8+).

Spark's Kafka source takes ``startingOffsets`` as ``{"topic": {"partition": offset}}``;
:func:`kafka_starting_offsets` builds it from a checkpoint as the daemon's ``get`` returns it
(``sources[].end_offset``, Spark's ``endOffset``: the next offset to read, so nothing is
skipped or read twice). The Event Hubs connector (azure-event-hubs-spark) reports the same
shape, so its sources are told apart by their description (the connector's class name,
:data:`EVENTHUBS_SOURCE_PREFIXES`), never by shape alone; :func:`eventhubs_starting_positions`
gives its ``eventhubs.startingPositions``, and :func:`starting_offsets` picks whichever the
chosen source needs.

Spark's Kafka source refuses a ``startingOffsets`` JSON that does not name every partition
of the subscribed topics ("you must specify all TopicPartitions"). Partitions the checkpoint
does not know (a topic added to the subscription, partitions added to a topic) are filled
according to ``missing``: ``"earliest"`` (-2: read them from the start; nothing is skipped),
``"latest"`` (-1: only new records), or ``"error"``. Pass ``partitions`` (topic → partition
count) to say which partitions exist now; without it only the checkpoint's are named.

One source for both sides: the Spark side (``spark_bridge.starting_offsets``, on the driver's
Python) and the daemon's CLI (``checkpoint-sidecar starting-offsets``, through
``sidecar.model.offsets``, which re-exports these names) run this module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

Missing = Literal["earliest", "latest", "error"]
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


class ResumeError(ValueError):
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
            "spark_bridge.starting_offsets or `checkpoint-sidecar starting-offsets`"
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
