"""The Spark bridge with a real local PySpark, a real daemon process, Redis and Azurite.

Marked ``spark``: `make test` runs this module under PySpark 4 (.venv) and again under
PySpark 3.5 (.venv-spark35, the markers in docs/development.md). Tests of the Kafka-shaped
Python data source (``pyspark.sql.datasource``, PySpark 4 only) are also marked ``spark4``;
the others use ``rate-micro-batch``, a built-in source of both versions with deterministic
offsets (``{"offset": rowsPerBatch * batches, "timestamp": …}``).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any, Literal

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

import spark_bridge
from sidecar.model import checkpoint as ckpt
from spark_bridge.sender import Sender
from tests.helpers import as_json, spark_conf, wait_blob, wait_for
from tests.services import DaemonProcess
from tests.sparkshapes import kafka_progress

pytestmark = pytest.mark.spark

ROWS_PER_BATCH = 10


@pytest.fixture(scope="session")
def kafka_shaped(spark: SparkSession) -> SparkSession:
    """The session with the Kafka-shaped Python data source registered (PySpark 4 only)."""
    # Imported here, not at module level: pyspark.sql.datasource does not exist in PySpark 3.5,
    # where this module must still import.
    from spark_bridge.demo_source import KafkaShapedSource

    spark.dataSource.register(KafkaShapedSource)
    return spark


def start_rate(spark: SparkSession, name: str, checkpoint_dir: Path) -> StreamingQuery:
    """A ``rate-micro-batch`` query: ROWS_PER_BATCH rows per batch, unbounded."""
    return (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", str(ROWS_PER_BATCH))
        .load()
        .writeStream.format("memory")
        .queryName(name)
        .trigger(processingTime="100 milliseconds")
        .option("checkpointLocation", str(checkpoint_dir))
        .start()
    )


def start_kafka_shaped(
    spark: SparkSession,
    name: str,
    checkpoint_dir: Path,
    *,
    max_offset: int | None,
    partitions: int = 3,
    starting: str | None = None,
) -> StreamingQuery:
    reader = (
        spark.readStream.format("kafka_shaped")
        .option("partitions", str(partitions))
        .option("rowsPerBatch", str(ROWS_PER_BATCH))
    )
    if max_offset is not None:
        reader = reader.option("maxOffset", str(max_offset))
    if starting is not None:
        reader = reader.option("startingOffsets", starting)
    return (
        reader.load()
        .writeStream.format("memory")
        .queryName(name)
        .trigger(processingTime="100 milliseconds")
        .option("checkpointLocation", str(checkpoint_dir))
        .start()
    )


def end_offsets(progress: dict[str, Any]) -> Any:
    return as_json(progress["sources"][0]["endOffset"])


def batch_id(q: StreamingQuery) -> int:
    """The query's last finished batch, -1 before the first."""
    last = q.lastProgress
    return int(last["batchId"]) if last else -1


def stop_after(q: StreamingQuery, batches: int) -> dict[str, Any]:
    """Let the query finish ``batches`` batches (or more), stop it; its last progress."""
    try:
        wait_for(lambda: batch_id(q) >= batches - 1, what=f"{batches} batches")
    finally:
        q.stop()
    return last_progress(q)


def last_progress(q: StreamingQuery) -> dict[str, Any]:
    """The query's last progress, once there is one (a dict in PySpark 3, a dict subclass,
    ``StreamingQueryProgress``, in PySpark 4)."""
    last = q.lastProgress
    assert last is not None, "no progress yet"
    return last


def delivered(handle: spark_bridge.BridgeHandle, last: dict[str, Any]) -> None:
    """Wait until the listener saw the query's last batch (Spark's listener bus is async:
    lastProgress moves before the listener is called), then until the daemon acked it."""
    wait_for(lambda: handle.stats().offered >= last["batchId"] + 1, what="the last event")
    assert handle.flush(10)


def run_until_exhausted(q: StreamingQuery, max_offset: int) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        last = q.lastProgress
        if last and all(o == max_offset for o in end_offsets(last)["events"].values()):
            return last
        return None

    return wait_for(done, what=f"the query to read up to offset {max_offset}")


@pytest.fixture
def env(daemon_env: dict[str, str]) -> dict[str, str]:
    return {**daemon_env, "SIDECAR_COUNT_THRESHOLD": "1"}


@pytest.fixture
def daemon(env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path) -> DaemonProcess:
    proc = DaemonProcess(env, short_tmp / "daemon.log")
    procs.append(proc)
    proc.start()
    return proc


@pytest.mark.parametrize("kind", ["jvm", "python"])
def test_blob_holds_sparks_last_batch_and_end_offsets(
    spark: SparkSession,
    env: dict[str, str],
    daemon: DaemonProcess,
    short_tmp: Path,
    kind: Literal["jvm", "python"],
) -> None:
    handle = spark_bridge.attach(spark, env["SIDECAR_SOCKET_PATH"], listener=kind)
    assert handle.kind == kind
    q = start_rate(spark, f"bridge_offsets_{kind}", short_tmp / "ck")
    last = stop_after(q, 5)
    delivered(handle, last)
    assert handle.close()
    doc = wait_blob(env, str(q.id), last["batchId"])
    assert doc.batch_id == last["batchId"] >= 4
    assert doc.name == f"bridge_offsets_{kind}"
    end = ckpt.offset_value(doc.sources[0].end_offset)
    assert end == end_offsets(last)
    assert end["offset"] == ROWS_PER_BATCH * (doc.batch_id + 1)
    assert (doc.position, doc.stateful) == ("committed", False)
    # ... and equal to what Spark itself logged in its checkpoint's offsets/ log
    offsets_log = (short_tmp / "ck" / "offsets" / str(doc.batch_id)).read_text().splitlines()
    assert json.loads(offsets_log[-1]) == end
    stats = handle.stats()
    assert stats.sent >= 1 and stats.failed == 0 and stats.pending == 0
    # Every progress event was handed over (a listener error would have dropped one).
    assert stats.offered == last["batchId"] + 1
    assert stats.last_error is None


@pytest.mark.spark4
def test_resume_from_saved_position_neither_skips_nor_repeats(
    kafka_shaped: SparkSession,
    env: dict[str, str],
    daemon: DaemonProcess,
    short_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spark = kafka_shaped
    handle = spark_bridge.attach(spark, env["SIDECAR_SOCKET_PATH"])
    first = start_kafka_shaped(spark, "resume_first", short_tmp / "ck1", max_offset=30)
    try:
        last = run_until_exhausted(first, 30)
        delivered(handle, last)
    finally:
        first.stop()
        handle.close()
    wait_blob(env, str(first.id), last["batchId"])

    via_daemon = spark_bridge.starting_offsets("resume_first", env["SIDECAR_SOCKET_PATH"])
    # As on a driver the shipped templates configure: the socket named by the session's Spark
    # conf only (no argument, no SIDECAR_SOCKET_PATH).
    monkeypatch.delenv("SIDECAR_SOCKET_PATH", raising=False)
    with spark_conf(spark, {spark_bridge.SOCKET_CONF: env["SIDECAR_SOCKET_PATH"]}):
        assert spark_bridge.starting_offsets("resume_first") == via_daemon
    # Spark's own checkpoint is "lost": a new checkpoint dir, so a new query id.
    second = start_kafka_shaped(
        spark, "resume_second", short_tmp / "ck2", max_offset=60, starting=via_daemon
    )
    try:
        run_until_exhausted(second, 60)
    finally:
        second.stop()
    assert second.id != first.id
    assert json.loads(via_daemon) == {"events": {"0": 30, "1": 30, "2": 30}}
    rows = spark.sql(
        "SELECT partition, offset FROM resume_first UNION ALL "
        "SELECT partition, offset FROM resume_second"
    ).collect()
    for p in range(3):
        offsets = sorted(r.offset for r in rows if r.partition == p)
        assert offsets == list(range(60)), f"partition {p}: gap or overlap"
    second_min = spark.sql("SELECT min(offset) AS m FROM resume_second").collect()[0].m
    assert second_min == 30

    # The same answer without the daemon, read from the blob directly.
    daemon.signal(signal.SIGTERM)
    assert daemon.wait() == 0
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert spark_bridge.starting_offsets("resume_first", env["SIDECAR_SOCKET_PATH"]) == via_daemon


def test_daemon_killed_and_restarted_mid_query_the_blob_catches_up(
    spark: SparkSession,
    env: dict[str, str],
    daemon: DaemonProcess,
    short_tmp: Path,
    procs: list[DaemonProcess],
) -> None:
    handle = spark_bridge.attach(spark, env["SIDECAR_SOCKET_PATH"])
    q = start_rate(spark, "bridge_restart", short_tmp / "ck")
    try:
        wait_blob(env, str(q.id), 1)
        daemon.signal(signal.SIGKILL)
        daemon.wait()
        wait_for(lambda: handle.stats().retried > 0, what="the sender to notice")
        restarted = DaemonProcess(env, short_tmp / "restarted.log")
        procs.append(restarted)
        restarted.start()
        target = batch_id(q) + 2  # batches finished after the restart
        wait_for(lambda: batch_id(q) >= target, what="more batches")
    finally:
        q.stop()
    last = last_progress(q)
    delivered(handle, last)
    assert handle.close()
    doc = wait_blob(env, str(q.id), last["batchId"])  # after the dead daemon's lease expired
    assert doc.batch_id == last["batchId"]
    assert ckpt.offset_value(doc.sources[0].end_offset) == end_offsets(last)
    assert handle.stats().reconnects >= 1
    assert q.exception() is None


def test_the_bridge_finds_the_daemon_by_the_sessions_spark_conf_alone(
    spark: SparkSession,
    env: dict[str, str],
    daemon: DaemonProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``starting_offsets`` with no socket argument and no ``SIDECAR_SOCKET_PATH``, in a
    session whose conf names the socket (what the shipped templates set): the daemon's saved
    offsets. Under both PySparks (``SparkSession.getActiveSession`` and ``conf.get``); a
    driver with only the bridge's wheel does the same under PySpark 4 in test_dist.py."""
    query_id = "5e1d0000-0000-4000-8000-0000000000cd"
    progress = kafka_progress(query_id, 6)
    sender = Sender(env["SIDECAR_SOCKET_PATH"], timeout_s=10)
    sender.offer(query_id, json.dumps(progress).encode())
    assert sender.close(15)
    monkeypatch.delenv("SIDECAR_SOCKET_PATH", raising=False)
    with spark_conf(spark, {spark_bridge.SOCKET_CONF: env["SIDECAR_SOCKET_PATH"]}):
        offsets = spark_bridge.starting_offsets(query_id)
    assert json.loads(offsets) == progress["sources"][0]["endOffset"]


def test_query_unaffected_when_the_daemon_is_absent(spark: SparkSession, short_tmp: Path) -> None:
    handle = spark_bridge.attach(spark, str(short_tmp / "nobody.sock"))
    q = start_rate(spark, "bridge_absent", short_tmp / "ck")
    last = stop_after(q, 4)
    assert q.exception() is None
    batches = last["batchId"] + 1
    # count() answers over Py4J; collect() would read rows through a local socket that
    # PySpark 3.5 leaves unclosed (a ResourceWarning, an error here).
    assert spark.table("bridge_absent").count() == ROWS_PER_BATCH * batches
    wait_for(lambda: handle.stats().offered == batches, what="the last event")
    stats = handle.stats()
    assert stats.sent == 0 and stats.offered == batches
    assert stats.pending == 1  # only the latest progress is kept (conflation)
    assert stats.conflated + stats.pending == stats.offered
    started = time.monotonic()
    assert handle.close(timeout_s=0.5) is False
    assert time.monotonic() - started < 3  # close is bounded


@pytest.mark.spark4
@pytest.mark.parametrize("kind", ["jvm", "python"])
def test_async_progress_tracking_and_state_are_recorded_in_the_checkpoint(
    spark: SparkSession,
    env: dict[str, str],
    daemon: DaemonProcess,
    short_tmp: Path,
    kind: Literal["jvm", "python"],
) -> None:
    """The listener tells how each query tracks progress (read from its execution in the
    JVM): an ``asyncProgressTrackingEnabled`` query's checkpoint is the *processed* position
    (Spark's own logs are written once a second), a default query's the *committed* one; a
    query with an aggregation is marked stateful."""
    handle = spark_bridge.attach(spark, env["SIDECAR_SOCKET_PATH"], listener=kind)
    source = spark.readStream.format("rate-micro-batch").option("rowsPerBatch", "10").load()
    fast = (
        source.selectExpr("value")
        .writeStream.format("noop")
        .queryName(f"async_{kind}")
        .trigger(processingTime="100 milliseconds")
        .option("checkpointLocation", str(short_tmp / "async"))
        .option("asyncProgressTrackingEnabled", "true")
        .option("asyncProgressTrackingCheckpointIntervalMs", "1000")
        .start()
    )
    counted = (
        source.groupBy((source.value % 3).alias("key"))
        .count()
        .writeStream.format("noop")
        .outputMode("update")
        .queryName(f"stateful_{kind}")
        .trigger(processingTime="100 milliseconds")
        .option("checkpointLocation", str(short_tmp / "stateful"))
        .start()
    )
    lasts = [stop_after(q, 6) for q in (fast, counted)]
    for last in lasts:
        delivered(handle, last)
    assert handle.close()
    async_doc = wait_blob(env, str(fast.id), lasts[0]["batchId"])
    stateful_doc = wait_blob(env, str(counted.id), lasts[1]["batchId"])
    assert (async_doc.position, async_doc.stateful) == ("processed", False)
    assert (stateful_doc.position, stateful_doc.stateful) == ("committed", True)
    # Spark's own commit log of the async query is never ahead of the sidecar's position.
    commits = [int(p.name) for p in (short_tmp / "async" / "commits").iterdir() if p.name.isdigit()]
    assert max(commits) <= async_doc.batch_id
