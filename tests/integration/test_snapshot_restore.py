"""The cut proven against real Spark: a query restarted from a copy of exactly the cut of
batch M continues as if it had never stopped.

Each query's every output is known in advance: a file source fed one known file per batch
(``maxFilesPerTrigger`` 1, so each batch reads exactly its file), a count by key, or a
stream-stream join of two such sources. The query runs to batch M; the cut of M is taken
(while it runs: Spark's maintenance may upload or delete files meanwhile) and its files, and
only those, are copied to a fresh directory; the query runs on to batch K, the reference.
Then the copy is started on the same inputs: its batches must be exactly M+1..K, each
output equal to the reference's and to the one computed here — counts continue from M's,
join matches find rows that arrived before M.

Stores: HDFS, RocksDB without and with changelog checkpointing, and (PySpark 4, ``spark4``)
checkpoint format v2. Also: a cut of an older batch after later ones ran; a cut refused
once Spark's maintenance deleted its files; a copy that fails when maintenance deletes a
file under it, and the next cut and copy that succeed. And (PySpark 4) a ``transformWithState``
count, whose operator metadata names its schema files by their full path, snapshotted to the
store (Azurite) and restored from it into another directory, the original gone.

One local SparkSession serves the run (``conftest.spark``: shuffle partitions are set per
query here; the state store maintenance runs every 500 ms).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from sidecar.config import Config
from sidecar.snapshot.contents import Contents
from sidecar.snapshot.cut import Cut, CutError, Role
from sidecar.snapshot.index import SnapshotIndex
from sidecar.snapshot.restore import find_snapshot, restore
from sidecar.snapshot.source import FileChanged, LocalSource
from sidecar.snapshot.upload import upload_snapshot
from sidecar.store.blobs import BlobStore
from sidecar.store.snapshots import SnapshotBlobs
from tests.helpers import ConfigFactory, spark_conf, wait_for
from tests.snapshots import copy_cut, snapshot_to

pytestmark = pytest.mark.spark

PROVIDER = "spark.sql.streaming.stateStore.providerClass"
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
HDFS = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
CHANGELOG = "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled"
FORMAT = "spark.sql.streaming.stateStore.checkpointFormatVersion"

#: Every query: few partitions, Spark's snapshots often (so cuts hold snapshots and deltas),
#: the file source's log compacted every 3 entries (so cuts hold a compaction: 2.compact).
COMMON = {
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.streaming.stateStore.minDeltasForSnapshot": "2",
    "spark.sql.streaming.fileSource.log.compactInterval": "3",
}
STORES: dict[str, dict[str, str]] = {
    "hdfs": {PROVIDER: HDFS},
    "rocksdb": {PROVIDER: ROCKSDB, CHANGELOG: "false"},
    "rocksdb-changelog": {PROVIDER: ROCKSDB, CHANGELOG: "true"},
    "rocksdb-changelog-v2": {PROVIDER: ROCKSDB, CHANGELOG: "true", FORMAT: "2"},
    "rocksdb-v2": {PROVIDER: ROCKSDB, CHANGELOG: "false", FORMAT: "2"},
}
V2 = pytest.mark.spark4  # checkpoint format v2: Spark 4

Rows = list[tuple[Any, ...]]


# -- the queries and what they must output ------------------------------------------------


def keys_of(batch: int) -> list[str]:
    """The keys of batch ``batch``'s file (left side of the join): k0..k<b mod 5>."""
    return [f"k{j}" for j in range(batch % 5 + 1)]


def right_keys_of(batch: int) -> list[str]:
    return [f"k{j}" for j in range(batch % 3, 5)]


def expected_counts(batch: int) -> Rows:
    """A count by key in update mode: each key of the batch with its count so far."""
    return sorted((k, sum(k in keys_of(c) for c in range(batch + 1))) for k in keys_of(batch))


def count_processor() -> Any:
    """The count by key as a ``transformWithState`` processor (PySpark 4.1's Row API): a value
    state per key, the rows seen so far; each batch outputs its keys with their counts (what
    :func:`expected_counts` says). Made here, not at module level: PySpark 3.5 has no
    ``StatefulProcessor``, and a class made in a function goes to the Python workers by value."""
    from pyspark.sql import Row
    from pyspark.sql.streaming.stateful_processor import (
        StatefulProcessor,
        StatefulProcessorHandle,
        TimerValues,
    )

    class CountByKey(StatefulProcessor):
        def init(self, handle: StatefulProcessorHandle) -> None:
            self.count = handle.getValueState("count", "n long")

        def handleInputRows(
            self, key: Any, rows: Iterator[Any], timerValues: TimerValues
        ) -> Iterator[Row]:
            stored = self.count.get()  # None: a key not seen before
            total = (stored[0] if stored is not None else 0) + sum(1 for _ in rows)
            self.count.update((total,))
            yield Row(k=key[0], count=total)

        def close(self) -> None:
            pass

    return CountByKey()


def expected_join(batch: int) -> Rows:
    """An inner join: every pair of a left and a right row with the same key whose later
    row arrived in this batch."""
    rows = []
    for lb in range(batch + 1):
        for rb in range(batch + 1):
            if max(lb, rb) == batch:
                rows += [(k, f"L{lb}", k, f"R{rb}") for k in keys_of(lb) if k in right_keys_of(rb)]
    return sorted(rows)


class Run:
    """A streaming query over ``inputs`` checkpointed in ``checkpoint``; each batch's output is
    written by Spark as JSON under ``checkpoint``'s sibling ``out-<name>/<batch>`` (read back
    here without ``collect()``, whose socket PySpark 3.5 leaves unclosed)."""

    def __init__(self, spark: SparkSession, kind: str, inputs: Path, checkpoint: Path) -> None:
        self.kind, self.inputs = kind, inputs
        self.out = checkpoint.with_name(f"out-{checkpoint.name}")
        for side in ("left", "right"):
            (inputs / side).mkdir(parents=True, exist_ok=True)
        reader = spark.readStream.option("maxFilesPerTrigger", 1)
        left = reader.schema("k string, v string").json(str(inputs / "left"))
        df: DataFrame
        if kind == "count":
            df, mode = left.groupBy("k").count(), "update"
        elif kind == "tws":
            tws = left.groupBy("k").transformWithState(
                count_processor(), "k string, count long", "Update", "None"
            )
            df, mode = tws, "update"
        else:
            right = reader.schema("k2 string, w string").json(str(inputs / "right"))
            df, mode = left.join(right, F.expr("k = k2")), "append"
        out = str(self.out)

        def write(batch: DataFrame, batch_id: int) -> None:
            batch.coalesce(1).write.mode("overwrite").json(f"{out}/{batch_id}")

        self._writer = (
            df.writeStream.outputMode(mode)
            .option("checkpointLocation", str(checkpoint))
            .foreachBatch(write)
        )
        self.query: StreamingQuery = self._writer.start()

    def feed(self, batch: int) -> None:
        """Batch ``batch``'s input. A join's two files are two events for a running query, which
        may start a batch between them: it is stopped while they are written."""
        if self.kind == "join":
            self.stop()
        feed(self.inputs, self.kind, batch)
        if self.kind == "join":
            self.query = self._writer.start()

    @property
    def outputs(self) -> dict[int, Rows]:
        """Each batch's output rows, sorted."""
        columns = ("k", "v", "k2", "w") if self.kind == "join" else ("k", "count")
        found: dict[int, Rows] = {}
        for batch in self.out.iterdir() if self.out.is_dir() else ():
            rows = [
                json.loads(line)
                for part in batch.glob("part-*")
                for line in part.read_text().splitlines()
            ]
            found[int(batch.name)] = sorted(tuple(r[c] for c in columns) for r in rows)
        return found

    def drain(self) -> None:
        self.query.processAllAvailable()
        assert self.query.exception() is None

    def stop(self) -> None:
        self.query.stop()
        assert self.query.exception() is None


def remove_stopped(checkpoint: Path, quiet_s: float = 1.0) -> None:
    """Delete a stopped query's checkpoint for good. Spark's state store maintenance (every
    500 ms here) may still write in it for a moment after the stop: a snapshot it was taking
    before it unloads the query's stores, which recreates the directories it writes in."""

    def gone_and_quiet() -> bool:
        shutil.rmtree(checkpoint, ignore_errors=True)
        if checkpoint.exists():
            return False
        time.sleep(quiet_s)
        return not checkpoint.exists()

    wait_for(gone_and_quiet, 30, f"Spark to stop writing in {checkpoint}")


def feed(inputs: Path, kind: str, batch: int) -> None:
    """Batch ``batch``'s input files (written once: the restored run reads the same ones)."""
    left = [{"k": k, "v": f"L{batch}"} for k in keys_of(batch)]
    write_whole(inputs / "left" / f"{batch:04d}.json", left)
    if kind == "join":
        right = [{"k2": k, "w": f"R{batch}"} for k in right_keys_of(batch)]
        write_whole(inputs / "right" / f"{batch:04d}.json", right)


def write_whole(path: Path, rows: list[dict[str, str]]) -> None:
    """A file that appears whole: written under a name the file source skips, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    hidden = path.with_name(f".{path.name}.tmp")
    hidden.write_text("".join(json.dumps(row) + "\n" for row in rows))
    hidden.rename(path)


def expected(kind: str, batch: int) -> Rows:
    return expected_join(batch) if kind == "join" else expected_counts(batch)


def store_dirs(checkpoint: Path) -> list[Path]:
    """Every state store's directory (a join: four per partition)."""
    found = set()
    for f in (checkpoint / "state").rglob("*"):
        if f.suffix in (".delta", ".snapshot", ".zip", ".changelog"):
            found.add(f.parent)
    return sorted(found)


def has_snapshot_at_most(store: Path, version: int) -> bool:
    return any(
        f.suffix in (".snapshot", ".zip") and int(f.name.split(".")[0].split("_")[0]) <= version
        for f in store.iterdir()
    )


def spark_snapshotted(checkpoint: Path, version: int) -> bool:
    """Every store has a snapshot (HDFS ``.snapshot``, RocksDB ``.zip``) at or below
    ``version``: written by Spark's maintenance, asynchronously."""
    stores = store_dirs(checkpoint)
    return bool(stores) and all(has_snapshot_at_most(s, version) for s in stores)


def restored_outputs(spark: SparkSession, kind: str, inputs: Path, copy: Path) -> dict[int, Rows]:
    run = Run(spark, kind, inputs, copy)
    try:
        run.drain()
    finally:
        run.stop()
    return run.outputs


def assert_cut_shape(cut: Cut, store: str, kind: str, batch: int) -> None:
    """The cut holds what the store's rules say (so each test exercises them)."""
    roles = {f.role for f in cut.files}
    stores_per_partition = 1 if kind == "count" else 4
    assert len(cut.stores) == 2 * stores_per_partition
    assert {s.version for s in cut.stores} == {batch + 1}
    assert cut.checkpoint_format == (2 if store.endswith("v2") else 1)
    if store == "hdfs":
        assert Role.DELTA in roles or Role.SNAPSHOT in roles
        assert all(s.provider == "hdfs" for s in cut.stores)
    else:
        assert all(s.provider == "rocksdb" for s in cut.stores)
        assert {Role.ZIP, Role.SST} <= roles or Role.CHANGELOG in roles
    if "changelog" not in store and store != "hdfs":  # a zip for every version: no replay
        assert all(s.base == batch + 1 and s.replayed == 0 for s in cut.stores)
    assert not [f for f in cut.files if f.path.endswith((".crc", ".tmp"))]
    assert cut.ignored == ()
    log = [
        f.path for f in cut.files if f.role == Role.SOURCE_LOG and f.path.startswith("sources/0/")
    ]
    assert log == [f"sources/0/{b}" + (".compact" if b == 2 else "") for b in range(batch + 1)]


# -- the proof ----------------------------------------------------------------------------


#: (query, store): the count with every store; the join (four stores per partition) with
#: HDFS and RocksDB with changelogs, whose files it multiplies.
SCENARIOS = [
    ("count", "hdfs"),
    ("count", "rocksdb"),
    ("count", "rocksdb-changelog"),
    pytest.param("count", "rocksdb-changelog-v2", marks=V2),
    pytest.param("count", "rocksdb-v2", marks=V2),
    ("join", "hdfs"),
    ("join", "rocksdb-changelog"),
    pytest.param("join", "rocksdb-changelog-v2", marks=V2),
]


@pytest.mark.parametrize(("kind", "store"), SCENARIOS)
def test_a_query_restarted_from_a_cut_continues_as_the_original(
    spark: SparkSession, tmp_path: Path, store: str, kind: str
) -> None:
    """The cut of batch M, taken as M is committed, and (a count) the cut of an older batch
    taken after later ones ran: each copy, restarted alone, runs the original's next batches."""
    m, k, older = 3, 6, 1
    inputs, checkpoint = tmp_path / "in", tmp_path / "ck"
    copies = {m: tmp_path / "copy", older: tmp_path / "copy-older"}
    cuts = {}
    with spark_conf(spark, COMMON | STORES[store]):
        run = Run(spark, kind, inputs, checkpoint)
        try:
            for batch in range(k + 1):
                run.feed(batch)
                run.drain()
                if batch == m:
                    if store not in ("rocksdb", "rocksdb-v2"):
                        # a snapshot by Spark's maintenance, so the cut has a base and the
                        # deltas or changelogs after it (not all of them from version 1)
                        wait_for(lambda: spark_snapshotted(checkpoint, m + 1), 30, "a snapshot")
                    cuts[m] = snapshot_to(checkpoint, m, copies[m])
            if kind == "count":  # Spark still keeps the files of batch 1
                cuts[older] = snapshot_to(checkpoint, older, copies[older])
        finally:
            run.stop()
        assert run.outputs == {b: expected(kind, b) for b in range(k + 1)}
        # Spark 4.1+ writes its checksums of state files under format v2 only; a cut leaves
        # them out (a missing one is a warning to Spark, a stale one would fail the load).
        assert bool(spark_checksums(checkpoint)) == store.endswith("v2")
        remove_stopped(checkpoint)  # each copy stands alone
        for batch, cut in cuts.items():
            assert_cut_shape(cut, store, kind, batch)
            assert files_under(copies[batch]) == [f.path for f in cut.files]
        assert any(s.base > 0 for s in cuts[m].stores)

        for batch in cuts:
            restored = restored_outputs(spark, kind, inputs, copies[batch])
            assert sorted(restored) == list(range(batch + 1, k + 1)), "it resumes at the next"
            for b in range(batch + 1, k + 1):
                assert restored[b] == run.outputs[b] == expected(kind, b), f"batch {b}"
            # ... and writes them again for the state files it writes from then on
            assert bool(spark_checksums(copies[batch])) == store.endswith("v2")


def spark_checksums(checkpoint: Path) -> list[Path]:
    """Spark's own checksum files (``<name>.crc``; Hadoop's local ones are ``.<name>.crc``)."""
    return [p for p in checkpoint.rglob("*.crc") if not p.name.startswith(".") and p.is_file()]


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def cut_now(checkpoint: Path, batch: int) -> Cut:
    return anyio.run(LocalSource(checkpoint).cut, "", batch)


def copy_now(checkpoint: Path, cut: Cut, dest: Path) -> None:
    anyio.run(copy_cut, LocalSource(checkpoint), "", cut, dest)


@pytest.mark.parametrize("store", ["hdfs", "rocksdb-changelog"])
def test_maintenance_deleting_files_refuses_old_cuts_and_fails_a_copy_under_way(
    spark: SparkSession, tmp_path: Path, store: str
) -> None:
    """Spark keeps 2 batches: a cut of batch 1 works at first; once maintenance deleted its
    files, it is refused (``missing_file``); a copy of a cut whose files maintenance deletes
    meanwhile fails (``FileChanged``), and the next cut and copy succeed."""
    inputs, checkpoint = tmp_path / "in", tmp_path / "ck"
    conf = COMMON | STORES[store] | {"spark.sql.streaming.minBatchesToRetain": "2"}
    conf["spark.sql.streaming.stateStore.minDeltasForSnapshot"] = "1"
    with spark_conf(spark, conf):
        run = Run(spark, "count", inputs, checkpoint)
        try:
            for batch in range(3):
                feed(inputs, "count", batch)
                run.drain()
            early = cut_now(checkpoint, 1)  # retained: fine
            assert {s.version for s in early.stores} == {2}
            for batch in range(3, 7):
                feed(inputs, "count", batch)
                run.drain()
            state_of_early = [
                checkpoint / f.path for f in early.files if f.path.startswith("state/")
            ]
            wait_for(
                lambda: any(not p.exists() for p in state_of_early),
                30,
                "maintenance to delete the state files of batch 1",
            )
            with pytest.raises(CutError) as caught:
                cut_now(checkpoint, 1)
            assert caught.value.reason == "missing_file"

            # a cut taken now, copied after Spark ran on and its maintenance deleted a file
            latest = cut_now(checkpoint, 6)
            latest_state = [
                checkpoint / f.path for f in latest.files if f.path.startswith("state/")
            ]
            # Batches until maintenance has deleted one of its files: when it writes the
            # store's snapshots (and so may delete) varies with the load, 4 batches at least.
            last = 6
            while last < 10 or (last < 16 and all(p.exists() for p in latest_state)):
                last += 1
                feed(inputs, "count", last)
                run.drain()
            wait_for(lambda: any(not p.exists() for p in latest_state), 30, "maintenance to delete")
            with pytest.raises(FileChanged) as changed:
                copy_now(checkpoint, latest, tmp_path / "failed-copy")
            assert changed.value.reason == "gone"
            snapshot_to(checkpoint, last, tmp_path / "copy")  # the next one succeeds
        finally:
            run.stop()
        restored = Run(spark, "count", inputs, tmp_path / "copy")
        try:
            feed(inputs, "count", last + 1)
            restored.drain()
        finally:
            restored.stop()
    assert restored.outputs == {last + 1: expected_counts(last + 1)}


# -- transformWithState: full paths in its metadata, a restore elsewhere ------------------


async def upload_to_store(
    config: Config, namespace: str, checkpoint: Path, batch: int, query_id: str
) -> SnapshotIndex:
    """The snapshot of ``batch`` stored, as the daemon stores it (a store of its own)."""
    store = BlobStore(config, creates_container=True)
    await store.ensure_container()
    try:
        blobs = SnapshotBlobs(store.account)
        source = LocalSource(checkpoint)
        result = await upload_snapshot(source, "", batch, blobs, namespace, query_id, Contents())
    finally:
        await store.aclose()
    return result.index


async def restore_from_store(config: Config, namespace: str, query_id: str, dest: Path) -> None:
    """The newest snapshot found and restored into ``dest``, as ``restore`` on a new pod does."""
    store = BlobStore(config)
    try:
        blobs = SnapshotBlobs(store.account)
        await restore(await find_snapshot(blobs, namespace, query_id), blobs, namespace, dest)
    finally:
        await store.aclose()


def schema_paths(checkpoint: Path, batch: int) -> list[str]:
    """The state schema files operator 0's metadata of ``batch`` names."""
    text = (checkpoint / f"state/0/_metadata/v2/{batch}").read_text()
    head, _, body = text.partition("\n")
    assert head == "v2"
    stores = json.loads(body)["stateStoreInfo"]
    return [path for store in stores for path in store["stateSchemaFilePaths"]]


@V2
def test_transform_with_state_restored_into_another_directory_keeps_its_state(
    spark: SparkSession, tmp_path: Path, make_config: ConfigFactory, namespace: str
) -> None:
    """A ``transformWithState`` query names its schema files by their full path in its operator
    metadata, which a restart opens as written. Its snapshot of batch M, stored and restored
    from the store into another directory once the original is gone (another pod), restarts
    there with its state: batches M+1..K equal the uninterrupted run's."""
    m, k = 1, 2
    inputs, checkpoint = tmp_path / "in", tmp_path / "ck"
    elsewhere = tmp_path / "another-pod" / "ck"
    config = make_config()
    # One partition, a zip each version (no wait for maintenance): a Python worker per batch
    # is what this query costs. Another store changes nothing of the paths.
    conf = COMMON | STORES["rocksdb"] | {"spark.sql.shuffle.partitions": "1"}
    with spark_conf(spark, conf):
        run = Run(spark, "tws", inputs, checkpoint)
        query_id = str(run.query.id)
        try:
            for batch in range(k + 1):
                run.feed(batch)
                run.drain()
                if batch == m:
                    index = anyio.run(upload_to_store, config, namespace, checkpoint, m, query_id)
        finally:
            run.stop()
        assert run.outputs == {b: expected("tws", b) for b in range(k + 1)}
        recorded = schema_paths(checkpoint, 0)
        assert [p.rpartition("/state/")[0] for p in recorded] == [f"file:{checkpoint}"]
        paths = [f.path for f in index.files]
        assert {"state/0/_metadata/v2/0", f"state/0/0/{m + 1}.zip"} <= set(paths)
        assert [p for p in paths if "/_stateSchema/" in p] == [
            p.rpartition(f"{checkpoint}/")[2] for p in recorded
        ]
        assert not [p for p in paths if p.endswith((".crc", ".tmp"))]
        remove_stopped(checkpoint)

        anyio.run(restore_from_store, config, namespace, query_id, elsewhere)
        moved = [p.replace(f"file:{checkpoint}/", f"file:{elsewhere}/") for p in recorded]
        assert schema_paths(elsewhere, 0) == moved
        restored = restored_outputs(spark, "tws", inputs, elsewhere)
    assert sorted(restored) == list(range(m + 1, k + 1)), "it resumes at the next batch"
    for b in range(m + 1, k + 1):
        assert restored[b] == run.outputs[b] == expected("tws", b), f"batch {b}"
    # Spark carried the (moved) paths into the metadata of the batch it ran first.
    assert schema_paths(elsewhere, m + 1) == moved
