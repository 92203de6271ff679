"""The Spark bridge with a real local PySpark, a real daemon process, Redis and Azurite."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

import spark_bridge
from spark_bridge.demo_source import KafkaShapedSource
from tests.helpers import DaemonProcess, wait_blob, wait_for


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2]")
        .appName("checkpoint-sidecar-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    session.dataSource.register(KafkaShapedSource)
    yield session
    session.stop()


def start_query(
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
        .option("rowsPerBatch", "10")
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


def end_offsets(progress: dict[str, Any]) -> dict[str, Any]:
    # StreamingQuery.lastProgress stringifies offsets; the listener uses the raw JSON.
    return json.loads(progress["sources"][0]["endOffset"])  # type: ignore[no-any-return]


def delivered(handle: spark_bridge.BridgeHandle, last: dict[str, Any]) -> None:
    """Wait until the listener saw the query's last batch (Spark's listener bus is async:
    lastProgress moves before the listener is called), then until the daemon acked it."""
    wait_for(lambda: handle.stats().offered >= last["batchId"] + 1, what="the last event")
    assert handle.sender.flush(10)


def run_until_exhausted(q: StreamingQuery, max_offset: int) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        last = q.lastProgress
        if last and all(o == max_offset for o in end_offsets(last)["events"].values()):
            return last  # type: ignore[no-any-return]
        return None

    return wait_for(done, what=f"the query to read up to offset {max_offset}")  # type: ignore[no-any-return]


@pytest.fixture
def env(daemon_env: dict[str, str]) -> dict[str, str]:
    return {**daemon_env, "SIDECAR_COUNT_THRESHOLD": "1"}


@pytest.fixture
def daemon(env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path) -> DaemonProcess:
    proc = DaemonProcess(env, short_tmp / "daemon.log")
    procs.append(proc)
    proc.start()
    return proc


def test_blob_holds_sparks_last_batch_and_end_offsets(
    spark: SparkSession, env: dict[str, str], daemon: DaemonProcess, short_tmp: Path
) -> None:
    handle = spark_bridge.attach(spark, env["SIDECAR_SOCKET_PATH"])
    q = start_query(spark, "bridge_offsets", short_tmp / "ck", max_offset=50)
    try:
        last = run_until_exhausted(q, 50)
        delivered(handle, last)
    finally:
        q.stop()
        handle.close()
    doc = wait_blob(env, str(q.id), last["batchId"])
    assert doc.batch_id == last["batchId"] == 4  # 5 batches of 10 records per partition
    assert doc.name == "bridge_offsets"
    assert doc.sources[0].end_offset == end_offsets(last) == {"events": {"0": 50, "1": 50, "2": 50}}
    # ... and equal to what Spark itself logged in its checkpoint's offsets/ log
    offsets_log = (short_tmp / "ck" / "offsets" / str(doc.batch_id)).read_text().splitlines()
    assert json.loads(offsets_log[-1]) == doc.sources[0].end_offset
    stats = handle.stats()
    assert stats.sent >= 1 and stats.failed == 0 and stats.pending == 0
    assert handle.listener.errors == 0


def test_resume_from_saved_position_neither_skips_nor_repeats(
    spark: SparkSession,
    env: dict[str, str],
    daemon: DaemonProcess,
    short_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handle = spark_bridge.attach(spark, env["SIDECAR_SOCKET_PATH"])
    first = start_query(spark, "resume_first", short_tmp / "ck1", max_offset=30)
    try:
        last = run_until_exhausted(first, 30)
        delivered(handle, last)
    finally:
        first.stop()
        handle.close()
    wait_blob(env, str(first.id), last["batchId"])

    via_daemon = spark_bridge.starting_offsets("resume_first", env["SIDECAR_SOCKET_PATH"])
    # Spark's own checkpoint is "lost": a new checkpoint dir, so a new query id.
    second = start_query(
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
    q = start_query(spark, "bridge_restart", short_tmp / "ck", max_offset=None)
    try:
        wait_blob(env, str(q.id), 1)
        daemon.signal(signal.SIGKILL)
        daemon.wait()
        wait_for(lambda: handle.stats().retried > 0, what="the sender to notice")
        restarted = DaemonProcess(env, short_tmp / "restarted.log")
        procs.append(restarted)
        restarted.start()
        target = q.lastProgress["batchId"] + 2  # batches finished after the restart
        wait_for(lambda: q.lastProgress["batchId"] >= target, what="more batches")
    finally:
        q.stop()
    last = q.lastProgress
    delivered(handle, last)
    handle.close()
    doc = wait_blob(env, str(q.id), last["batchId"])  # after the dead daemon's lease expired
    assert doc.batch_id == last["batchId"]
    assert doc.sources[0].end_offset == end_offsets(last)
    assert handle.stats().reconnects >= 1
    assert q.exception() is None


def test_query_unaffected_when_the_daemon_is_absent(spark: SparkSession, short_tmp: Path) -> None:
    handle = spark_bridge.attach(spark, str(short_tmp / "nobody.sock"))
    q = start_query(spark, "bridge_absent", short_tmp / "ck", max_offset=40)
    try:
        last = run_until_exhausted(q, 40)
    finally:
        q.stop()
    assert q.exception() is None
    assert last["batchId"] == 3
    assert spark.sql("SELECT count(*) AS n FROM bridge_absent").collect()[0].n == 120
    wait_for(lambda: handle.stats().offered == 4, what="the last event")
    stats = handle.stats()
    assert stats.sent == 0 and stats.offered == 4
    assert stats.pending == 1  # only the latest progress is kept (conflation)
    assert stats.conflated + stats.pending == stats.offered
    started = time.monotonic()
    assert handle.close(timeout_s=0.5) is False
    assert time.monotonic() - started < 3  # close is bounded
