"""Snapshots end to end with a real PySpark query, its JVM listener, a daemon process, Redis and
Azurite: what a user sees when a stateful query's checkpoint volume is lost.

A count by key over a file source fed one known file per batch (test_snapshot_restore.py's
query: every output known in advance) runs with its checkpoint under ``SIDECAR_SNAPSHOT_ROOT``:

- after each batch Spark commits, its snapshot is listed by ``snapshots`` within 30 s;
- the checkpoint directory deleted and ``restore`` run, the query started again on it resumes
  at the next batch with its state: its next outputs equal the uninterrupted run's;
- restored at an earlier snapshot M, it resumes at M + 1 with M's state, and the sidecar's
  checkpoint moved back with it (a reset through the daemon) and on again as the query ran;
  the rewound timeline is snapshotted at once, the document's marker follows it, and a pod
  restart's ``restore --all`` keeps the rewound directory (the abandoned newest snapshot
  is listed as such, never restored over it).

For the HDFS store and for RocksDB with changelog checkpointing; under PySpark 4 and 3.5
(marker ``spark``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

import spark_bridge
from tests.helpers import cli, read_blob, spark_conf, wait_blob, wait_for
from tests.integration.test_snapshot_restore import (
    COMMON,
    STORES,
    V2,
    Run,
    expected,
    feed,
    remove_stopped,
)
from tests.services import DaemonProcess

pytestmark = pytest.mark.spark

#: The batch restored last (the newest snapshot), and the earlier one rewound to.
LAST, EARLIER = 4, 1
#: The batches run after each restore.
MORE = 2


def listed(env: dict[str, str], query: str) -> list[int]:
    """The batches of the query's snapshots, newest first."""
    done = cli(env, "snapshots", query, "--json")
    assert done.returncode == 0, done.stderr
    rows: list[dict[str, Any]] = json.loads(done.stdout)["snapshots"]
    return [r["batch_id"] for r in rows]


def snapshotting(
    daemon_env: dict[str, str], root: Path, log: Path, procs: list[DaemonProcess]
) -> tuple[dict[str, str], DaemonProcess]:
    """A daemon snapshotting the checkpoints under ``root``, admin ops on (restores move the
    checkpoint through it), started; its settings."""
    env = daemon_env | {
        "SIDECAR_SNAPSHOT_ROOT": str(root),
        "SIDECAR_COUNT_THRESHOLD": "1",
        "SIDECAR_ADMIN_OPS": "true",
        "SIDECAR_ADMIN_QUIET_S": "0",
    }
    daemon = DaemonProcess(env, log)
    procs.append(daemon)
    daemon.start()
    return env, daemon


def lines(env: dict[str, str], query: str) -> list[dict[str, Any]]:
    """The query's snapshots as ``snapshots --json`` lists them, newest first."""
    done = cli(env, "snapshots", query, "--json")
    assert done.returncode == 0, done.stderr
    rows: list[dict[str, Any]] = json.loads(done.stdout)["snapshots"]
    return rows


def run_batches(run: Run, inputs: Path, batches: range, env: dict[str, str], query: str) -> None:
    """Spark runs each batch of ``batches`` (one input file each); each is snapshotted."""
    for batch in batches:
        feed(inputs, "count", batch)
        run.drain()
        wait_for(
            lambda b=batch: bool(listed(env, query)) and listed(env, query)[0] == b,  # type: ignore[misc]
            30,
            f"the snapshot of batch {batch}",
        )


def resumed(spark: SparkSession, inputs: Path, checkpoint: Path, last: int) -> dict[int, Any]:
    """The query started again on ``checkpoint``, run until it has read batch ``last``'s
    input; the outputs of this run only."""
    run = Run(spark, "count", inputs, checkpoint)
    shutil.rmtree(run.out, ignore_errors=True)
    try:
        run.drain()
    finally:
        run.stop()
    assert run.query.lastProgress is not None
    assert run.query.lastProgress["batchId"] == last
    return run.outputs


@pytest.mark.parametrize("store", ["hdfs", "rocksdb-changelog"])
def test_a_lost_checkpoint_is_restored_and_rewound_with_its_state(
    spark: SparkSession,
    daemon_env: dict[str, str],
    procs: list[DaemonProcess],
    short_tmp: Path,
    tmp_path: Path,
    store: str,
) -> None:
    root, inputs = tmp_path / "volume", tmp_path / "inputs"
    checkpoint = root / "app" / f"counts-{store}"
    env, daemon = snapshotting(daemon_env, root, short_tmp / "daemon.log", procs)
    handle = spark_bridge.attach(spark, env["SIDECAR_SOCKET_PATH"], listener="jvm")
    try:
        with spark_conf(spark, COMMON | STORES[store]):
            run = Run(spark, "count", inputs, checkpoint)
            query = str(run.query.id)
            try:
                run_batches(run, inputs, range(LAST + 1), env, query)
            finally:
                run.stop()
            assert run.outputs == {b: expected("count", b) for b in range(LAST + 1)}
            assert listed(env, query) == list(range(LAST, -1, -1))  # one per batch
            doc = wait_blob(env, query, LAST)
            assert doc.stateful

            # The volume is lost: the newest snapshot restored, the query resumes after it.
            remove_stopped(checkpoint)
            done = cli(env, "restore", query, str(checkpoint), "--json")
            assert done.returncode == 0, done.stderr + daemon.log()
            assert json.loads(done.stdout)["batch_id"] == LAST
            for batch in range(LAST + 1, LAST + 1 + MORE):
                feed(inputs, "count", batch)
            end = LAST + MORE
            outputs = resumed(spark, inputs, checkpoint, end)
            assert outputs == {b: expected("count", b) for b in range(LAST + 1, end + 1)}
            wait_blob(env, query, end)

            # Rewound to an earlier snapshot: M's state, from M + 1 on, over what is there.
            done = cli(env, "restore", query, str(checkpoint), "--batch", str(EARLIER), "--force")
            assert done.returncode == 0, done.stderr + daemon.log()
            moved = read_blob(env, query)
            assert moved is not None and moved.batch_id == EARLIER
            assert moved.reset_reason is not None and "restored snapshot" in moved.reset_reason
            outputs = resumed(spark, inputs, checkpoint, end)
            assert outputs == {b: expected("count", b) for b in range(EARLIER + 1, end + 1)}
            assert wait_blob(env, query, end).batch_id == end  # the sidecar followed

            # The rewound timeline is followed at once (not once it passes the abandoned
            # snapshots' batches); the document's marker names its newest snapshot; a pod
            # restart's restore --all keeps the rewound directory (it restored the abandoned
            # newest over it before).
            wait_for(
                lambda: (
                    [r["batch_id"] for r in lines(env, query) if r["line"] == "current"][:1]
                    == [end]
                ),
                30,
                "the rewound timeline's snapshot of its newest batch",
            )
            rows = lines(env, query)
            head = rows[[r["line"] for r in rows].index("current")]
            abandoned = [r for r in rows if r["line"] == "abandoned"]
            assert LAST in [r["batch_id"] for r in abandoned]  # the batches after the rewind
            assert all(r["batch_id"] > EARLIER for r in abandoned)
            assert {r["timeline"] for r in abandoned}.isdisjoint({head["timeline"]})
            wait_for(
                lambda: (
                    (marker := read_blob(env, query).snapshot) is not None  # type: ignore[union-attr]
                    and (marker.id, marker.timeline) == (head["id"], head["timeline"])
                ),
                30,
                "the document's marker on the rewound timeline's newest snapshot",
            )
            kept = cli(env, "restore", "--all", str(root), "--json")
            assert kept.returncode == 0, kept.stderr
            (row,) = [json.loads(line) for line in kept.stdout.splitlines()]
            assert (row["outcome"], row["batch_id"], row["snapshot"]) == ("newer", end, head["id"])
            assert wait_blob(env, query, end).batch_id == end  # nothing moved
    finally:
        assert handle.close()


@V2
def test_v2_changelog_snapshots_go_on_after_spark_deleted_the_commits_naming_the_ids(
    spark: SparkSession,
    daemon_env: dict[str, str],
    procs: list[DaemonProcess],
    short_tmp: Path,
    tmp_path: Path,
) -> None:
    """Format v2 with changelog checkpointing, Spark keeping 2 batches of logs and making no
    RocksDB snapshot (zip): the cut of each batch needs every version's id back to version
    1, whose commits Spark deleted. Each batch is snapshotted all the same (the ids an earlier
    snapshot held stand in), and the newest restores with its state."""
    root, inputs = tmp_path / "volume", tmp_path / "inputs"
    checkpoint = root / "app" / "counts-v2"
    env, daemon = snapshotting(daemon_env, root, short_tmp / "daemon.log", procs)
    conf = COMMON | STORES["rocksdb-changelog-v2"]
    conf |= {
        "spark.sql.streaming.minBatchesToRetain": "2",
        "spark.sql.streaming.stateStore.minDeltasForSnapshot": "1000",  # no zip
    }
    handle = spark_bridge.attach(spark, env["SIDECAR_SOCKET_PATH"], listener="jvm")
    batches = 7
    try:
        with spark_conf(spark, conf):
            run = Run(spark, "count", inputs, checkpoint)
            query = str(run.query.id)
            try:
                run_batches(run, inputs, range(batches), env, query)
            finally:
                run.stop()
            assert not (checkpoint / "commits" / "0").exists()  # Spark's retention
            assert not list(checkpoint.glob("state/0/0/*.zip"))
            remove_stopped(checkpoint)
            done = cli(env, "restore", query, str(checkpoint), "--json")
            assert done.returncode == 0, done.stderr + daemon.log()
            assert json.loads(done.stdout)["batch_id"] == batches - 1
            feed(inputs, "count", batches)
            assert resumed(spark, inputs, checkpoint, batches) == {
                batches: expected("count", batches)
            }
    finally:
        assert handle.close()
