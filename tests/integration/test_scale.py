"""Many queries: lag computed at scrape time and capped, renewals spread, flush checks that read
only the due queries' checkpoints. Against real redis-server and Azurite, except the pure
schedules (renewal jitter, threshold spread) and the lag tracker's own bookkeeping."""

from __future__ import annotations

import math
import random
from typing import Any

import anyio
import msgspec

from sidecar.backoff import spread
from sidecar.flush.lease import EXPIRY_MARGIN_S, RENEW_JITTER, RENEW_RETRY_S, renew_delay
from sidecar.kafka.lag import LagTracker
from sidecar.model import checkpoint as ckpt
from sidecar.ops.client import SidecarClient
from sidecar.telemetry.metrics import FLUSH_RESULTS
from tests.helpers import (
    ConfigFactory,
    blob_reader,
    eventually,
    metric_value,
    running_daemon,
    sample,
    scrape,
)
from tests.sparkshapes import kafka_progress

LAG = "checkpoint_sidecar_kafka_lag_records"
QUERY_LAG = "checkpoint_sidecar_kafka_query_lag_records"
LAG_SECONDS = "checkpoint_sidecar_kafka_lag_seconds"
DROPPED = "checkpoint_sidecar_kafka_lag_series_dropped"
CHECKS = "checkpoint_sidecar_flush_checks_total"
BODIES = "checkpoint_sidecar_flush_bodies_read_total"
FLUSHES = "checkpoint_sidecar_flushes_total"


def qid(i: int) -> str:
    return f"5ca1e000-0000-4000-8000-{i:012d}"


def expected_lag(progress: dict[str, Any]) -> dict[tuple[str, str], int]:
    """What the per-partition lag gauges exported: Spark's latestOffset - endOffset."""
    source = progress["sources"][0]
    return {
        (topic, p): source["latestOffset"][topic][p] - end
        for topic, parts in source["endOffset"].items()
        for p, end in parts.items()
    }


async def test_lag_collected_at_scrape_time_equals_the_gauges_for_spark_shaped_progress(
    make_config: ConfigFactory,
) -> None:
    config = make_config()
    first = kafka_progress(qid(1), 4, name="wide", partitions=6, lag=7)
    second = kafka_progress(qid(1), 5, name="wide", partitions=6, lag=7)
    second["sources"][0]["latestOffset"]["events"]["2"] += 30  # one partition further behind
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(first)).applied
            await anyio.sleep(0.05)  # the rate needs the two positions apart in time
            assert (await c.progress(second)).applied
        status, text = await anyio.to_thread.run_sync(scrape, daemon)
    assert status == 200
    lag = expected_lag(second)
    assert lag[("events", "2")] == 37
    for (topic, partition), records in lag.items():
        labels = {"query": "wide", "topic": topic, "partition": partition}
        assert metric_value(text, LAG, **labels) == records
    assert metric_value(text, QUERY_LAG, query="wide") == sum(lag.values())
    # consuming (the position moved between the two progresses): a finite time
    assert 0 < metric_value(text, LAG_SECONDS, query="wide") < math.inf
    assert metric_value(text, DROPPED) == 0


async def test_partition_series_beyond_the_cap_become_per_topic_and_are_counted(
    make_config: ConfigFactory,
) -> None:
    config = make_config(kafka_lag_partition_series_max=5)
    narrow = kafka_progress(qid(2), 1, name="narrow", partitions=3, lag=2)
    wide = kafka_progress(qid(3), 1, name="wide", partitions=4, lag=7)
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(narrow)).applied  # first seen: keeps its partitions
            assert (await c.progress(wide)).applied  # 4 more would exceed the cap of 5
        status, text = await anyio.to_thread.run_sync(scrape, daemon)
    assert status == 200
    for p in range(3):
        assert metric_value(text, LAG, query="narrow", topic="events", partition=str(p)) == 2
    assert metric_value(text, LAG, query="wide", topic="events") == 28  # 4 partitions x 7
    assert 'query="wide",topic="events",partition=' not in text
    assert metric_value(text, DROPPED) == 4
    assert metric_value(text, QUERY_LAG, query="wide") == 28


def checkpoint(query_id: str, name: str, topic: str, batch: int = 1) -> ckpt.Checkpoint:
    progress = kafka_progress(query_id, batch, name=name, topic=topic, partitions=2)
    return ckpt.from_progress(
        msgspec.json.decode(msgspec.json.encode(progress), type=ckpt.SparkProgress)
    )


def samples(tracker: LagTracker) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for m in tracker.collect() for s in m.samples]


def test_forgetting_a_query_removes_its_series_and_end_offsets_no_other_query_reads() -> None:
    tracker = LagTracker()
    tracker.observe(checkpoint(qid(4), "a", "shared"))
    tracker.observe(checkpoint(qid(5), "b", "shared"))
    tracker.observe(checkpoint(qid(6), "c", "own"))
    tracker.durable("b", {("shared", 0): 10, ("shared", 1): 10})
    tracker.durable("c", {("own", 0): 10, ("own", 1): 10})
    tracker.end_offsets({("shared", 0): 15, ("shared", 1): 15, ("own", 0): 12, ("own", 1): 12})
    assert {s[1].get("query") for s in samples(tracker)} == {"a", "b", "c", None}

    tracker.forget("c")
    tracker.forget("a")
    assert {s[1].get("query") for s in samples(tracker)} == {"b", None}
    assert tracker.lag("b") == {("shared", 0): 5, ("shared", 1): 5}  # ends kept: b reads them
    assert ("own", 0) not in tracker._ends and ("own", 1) not in tracker._ends


def test_renewals_are_spread_around_the_interval_and_stay_within_the_validity() -> None:
    duration_s, interval_s = 15, 5.0  # the shortest lease: the tightest margin
    assert renew_delay(interval_s, 0.0) == interval_s * (1 - RENEW_JITTER)
    latest = renew_delay(interval_s, math.nextafter(1.0, 0.0))
    assert interval_s < latest <= interval_s * (1 + RENEW_JITTER)
    # the latest renewal leaves time for 5 retries of a failed one before it may lapse
    assert duration_s - EXPIRY_MARGIN_S - latest > 5 * RENEW_RETRY_S
    # 1,000 leases acquired in the same instant renew spread over half the interval
    rng = random.Random(14)
    first = [renew_delay(interval_s, rng.random()) for _ in range(1000)]
    assert max(first) - min(first) > 0.45 * interval_s
    assert abs(sum(first) / len(first) - interval_s) < 0.05 * interval_s  # no extra renewals


def test_flush_time_thresholds_are_spread_per_query_and_stable() -> None:
    factors = [spread(qid(i)) for i in range(1000)]
    assert all(0 <= f < 1 for f in factors)
    assert min(factors) < 0.05 and max(factors) > 0.95  # queries started together drift apart
    assert factors == [spread(qid(i)) for i in range(1000)]  # the same query, the same factor


async def test_a_flush_check_reads_the_checkpoints_of_the_due_queries_only(
    make_config: ConfigFactory,
) -> None:
    # Count threshold 5, the time threshold far away: one update leaves a query pending and
    # not due.
    config = make_config(count_threshold=5, time_threshold_s=3600)
    quiet, busy = [qid(10 + i) for i in range(20)], [qid(40), qid(41)]
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            for i, query_id in enumerate(quiet + busy):
                assert (await c.progress(kafka_progress(query_id, 1, name=f"q{i}"))).applied
            # each query's checkpoint is read once, to learn its name; none is due
            await eventually(lambda: sample(daemon, BODIES) == 22)
            checks = sample(daemon, CHECKS)
            await eventually(lambda: sample(daemon, CHECKS) >= checks + 10)
            assert sample(daemon, BODIES) == 22
            # 4 more (5 pending with batch 1): the count threshold is reached by the last one, so
            # the flush it makes due writes batch 5 (were it reached earlier, a flush of the row
            # then would leave the last updates pending below the threshold)
            for batch in range(2, 6):
                for query_id in busy:
                    assert (await c.progress(kafka_progress(query_id, batch))).applied
            for query_id in busy:
                with anyio.fail_after(10):
                    while (doc := await store.read(query_id)) is None or doc.batch_id < 5:  # noqa: ASYNC110 - polls the blob
                        await anyio.sleep(0.02)
            checks = sample(daemon, CHECKS)
            await eventually(lambda: sample(daemon, CHECKS) >= checks + 10)
        # checkpoints read again: those of the due queries, one per flush, nothing else
        flushes = sum(sample(daemon, FLUSHES, result=r) for r in FLUSH_RESULTS)
        assert flushes >= 2 and sample(daemon, BODIES) == 22 + flushes
        for query_id in quiet:
            assert await store.read(query_id) is None
