"""Progress events shaped exactly like Spark's ``StreamingQueryProgress.json`` output.

Field names, nesting and value types follow what PySpark 4.x prints for a rate source and a
Kafka source (``KafkaV2[Subscribe[...]]``), including the fields the daemon ignores.
"""

from __future__ import annotations

from typing import Any


def _progress(
    query_id: str, batch_id: int, sources: list[dict[str, Any]], *, name: str | None, run_id: str
) -> dict[str, Any]:
    rows = sum(s["numInputRows"] for s in sources)
    return {
        "id": query_id,
        "runId": run_id,
        "name": name,
        "timestamp": f"2026-11-21T10:{batch_id // 60 % 60:02d}:{batch_id % 60:02d}.000Z",
        "batchId": batch_id,
        "batchDuration": 112,
        "numInputRows": rows,
        "inputRowsPerSecond": 100.0,
        "processedRowsPerSecond": 892.8571428571429,
        "durationMs": {
            "addBatch": 71,
            "commitOffsets": 13,
            "getBatch": 0,
            "latestOffset": 0,
            "queryPlanning": 7,
            "triggerExecution": 112,
            "walCommit": 15,
        },
        "stateOperators": [],
        "sources": sources,
        "sink": {
            "description": "org.apache.spark.sql.execution.streaming.ConsoleTable$@5c8a1",
            "numOutputRows": rows,
        },
        "observedMetrics": {},
    }


def rate_progress(
    query_id: str,
    batch_id: int,
    *,
    name: str | None = "rate-demo",
    run_id: str = "6b7d1d0a-3a39-4a58-9a44-0d4a6f0c0a11",
    rows_per_batch: int = 10,
) -> dict[str, Any]:
    """A rate-source progress: offsets are plain numbers."""
    start, end = batch_id * rows_per_batch, (batch_id + 1) * rows_per_batch
    return _progress(
        query_id,
        batch_id,
        [
            {
                "description": (
                    "RateStreamV2[rowsPerSecond=10, rampUpTimeSeconds=0, numPartitions=default"
                ),
                "startOffset": start,
                "endOffset": end,
                "latestOffset": end,
                "numInputRows": end - start,
                "inputRowsPerSecond": 10.0,
                "processedRowsPerSecond": 89.3,
            }
        ],
        name=name,
        run_id=run_id,
    )


def kafka_progress(
    query_id: str,
    batch_id: int,
    *,
    topic: str = "events",
    partitions: int = 3,
    name: str | None = "orders-to-delta",
    run_id: str = "0e1c3f52-9d2b-4f7e-a3c4-5d6e7f809a1b",
    per_partition: int = 100,
    lag: int = 5,
) -> dict[str, Any]:
    """A Kafka-source progress: offsets are ``{"topic": {"partition": offset}}`` objects."""

    def offsets(batch: int) -> dict[str, dict[str, int]]:
        return {topic: {str(p): batch * per_partition + p for p in range(partitions)}}

    end = offsets(batch_id + 1)
    latest = {topic: {p: o + lag for p, o in end[topic].items()}}
    return _progress(
        query_id,
        batch_id,
        [
            {
                "description": f"KafkaV2[Subscribe[{topic}]]",
                "startOffset": offsets(batch_id) if batch_id else None,
                "endOffset": end,
                "latestOffset": latest,
                "numInputRows": per_partition * partitions,
                "inputRowsPerSecond": 500.0,
                "processedRowsPerSecond": 2678.5,
                "metrics": {
                    "avgOffsetsBehindLatest": str(float(lag)),
                    "maxOffsetsBehindLatest": str(lag),
                    "minOffsetsBehindLatest": str(lag),
                },
            }
        ],
        name=name,
        run_id=run_id,
    )


def idle_progress_spark34(
    query_id: str,
    batch_id: int,
    *,
    topic: str = "events",
    name: str | None = "orders-to-delta",
    run_id: str = "0e1c3f52-9d2b-4f7e-a3c4-5d6e7f809a1b",
) -> dict[str, Any]:
    """What Spark 3.4 and older report for a trigger that ran no batch (an idle query).

    Every offset is null and ``batchId`` is the *next* batch's (Spark 3.5+ sends
    ``onQueryIdle`` instead). It carries no position, so the daemon must not store it.
    """
    progress = _progress(
        query_id,
        batch_id,
        [
            {
                "description": f"KafkaV2[Subscribe[{topic}]]",
                "startOffset": None,
                "endOffset": None,
                "latestOffset": None,
                "numInputRows": 0,
                "inputRowsPerSecond": 0.0,
                "processedRowsPerSecond": 0.0,
            }
        ],
        name=name,
        run_id=run_id,
    )
    progress["durationMs"] = {"latestOffset": 1, "triggerExecution": 1}
    return progress


EVENTHUBS_SOURCE = "org.apache.spark.sql.eventhubs.EventHubsSource@1a2b3c"


def eventhubs_progress(
    query_id: str,
    batch_id: int,
    *,
    eventhub: str = "telemetry",
    partitions: int = 4,
    name: str | None = "telemetry-to-delta",
    run_id: str = "3f6c2a10-7d1e-4b55-9e0a-2c4d6e8fa0b1",
    per_partition: int = 50,
    first: int = 0,
    lag: int | None = 5,
) -> dict[str, Any]:
    """An Event Hubs source's progress (azure-event-hubs-spark): offsets are
    ``{"<event hub>": {"<partition>": <next sequence number>}}`` and the description is the
    source's class name with a JVM object hash. Sequence numbers start at ``first`` and each
    partition p has read ``batch_id * per_partition + p`` events before this batch.
    ``latestOffset``: ``lag`` events past the end, or null (``lag=None``) as a source without
    admission control reports it."""

    def seqnos(batch: int) -> dict[str, dict[str, int]]:
        return {eventhub: {str(p): first + batch * per_partition + p for p in range(partitions)}}

    end = seqnos(batch_id + 1)
    latest = None if lag is None else {eventhub: {p: n + lag for p, n in end[eventhub].items()}}
    return _progress(
        query_id,
        batch_id,
        [
            {
                "description": EVENTHUBS_SOURCE,
                "startOffset": seqnos(batch_id),
                "endOffset": end,
                "latestOffset": latest,
                "numInputRows": per_partition * partitions,
                "inputRowsPerSecond": 500.0,
                "processedRowsPerSecond": 2678.5,
            }
        ],
        name=name,
        run_id=run_id,
    )
