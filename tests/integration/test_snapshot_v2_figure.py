"""A figure, not a check of `make test`: format v2 with changelog checkpointing as users run
it (Spark's default ``minBatchesToRetain`` 10, a 400 ms trigger), 40 s of a stateful count:
the last batch's snapshot is listed within 30 s of the stop, and no cut failed on the files
Spark's retention deleted meanwhile. ``make snapshot-v2-figure`` runs it (~1 min) and prints
the figure; `make test` keeps the stricter case (``minBatchesToRetain`` 2, no RocksDB zip:
every batch snapshotted) in tests/integration/test_snapshot_e2e.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

import spark_bridge
from tests.helpers import spark_conf, wait_for
from tests.integration.test_snapshot_e2e import listed, snapshotting
from tests.integration.test_snapshot_restore import COMMON, STORES
from tests.services import DaemonProcess

pytestmark = [
    pytest.mark.spark,
    pytest.mark.spark4,
    pytest.mark.skipif(
        not os.environ.get("SNAPSHOT_V2_FIGURE"), reason="a figure: make snapshot-v2-figure"
    ),
]

RUN_S = 40.0
LISTED_WITHIN_S = 30.0


def test_a_v2_changelog_query_on_a_400ms_trigger_has_its_last_batch_snapshotted(
    spark: SparkSession,
    daemon_env: dict[str, str],
    procs: list[DaemonProcess],
    short_tmp: Path,
    tmp_path: Path,
) -> None:
    root = tmp_path / "volume"
    ckpt = root / "app" / "fast"
    env, daemon = snapshotting(daemon_env, root, short_tmp / "d.log", procs)
    conf = (
        COMMON | STORES["rocksdb-changelog-v2"] | {"spark.sql.streaming.minBatchesToRetain": "10"}
    )
    handle = spark_bridge.attach(spark, env["SIDECAR_SOCKET_PATH"], listener="jvm")
    try:
        with spark_conf(spark, conf):
            df = spark.readStream.format("rate").option("rowsPerSecond", 50).load()
            counts = df.groupBy((df.value % 10).alias("k")).count()
            q = (
                counts.writeStream.format("noop")
                .outputMode("update")
                .option("checkpointLocation", str(ckpt))
                .trigger(processingTime="400 milliseconds")
                .start()
            )
            started = time.monotonic()
            time.sleep(RUN_S)
            q.stop()
        stopped = time.monotonic()
        query = str(q.id)
        commits = sorted(int(p.name) for p in (ckpt / "commits").iterdir() if p.name.isdigit())
        last = commits[-1]
        wait_for(
            lambda: listed(env, query)[:1] == [last],
            timeout_s=LISTED_WITHIN_S,
            what=f"the snapshot of batch {last}",
        )
        took = time.monotonic() - stopped
        kept = listed(env, query)
        log = daemon.log()
        failed = {r: log.count(r) for r in ("cut_missing_file", "off_timeline")}
        print(
            "\nv2 changelog, minBatchesToRetain 10, 400 ms trigger: "
            f"ran {stopped - started:.1f} s, batches 0..{last}, "
            f"Spark kept commits {commits[0]}..{last}; "
            f"the snapshot of {last} listed {took:.2f} s after the stop; "
            f"{len(kept)} snapshots listed; failed cuts {failed}"
        )
        assert failed == {"cut_missing_file": 0, "off_timeline": 0}
        assert commits[0] > 0, "Spark's retention deleted nothing: not the case measured"
    finally:
        handle.close()
