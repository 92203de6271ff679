"""``import-spark-checkpoint`` on checkpoint directories written by real PySpark queries: a
rate source, the Kafka-shaped Python source, and both in one query (a union).

Each query runs a few batches and stops; the import must write the last batch in
``commits/`` with the lines of ``offsets/<that batch>`` as end offsets — and that must be
where Spark's own restart resumes: the same query restarted from the same directory runs
its first new batch from exactly those offsets. The blob (Azurite) then holds that position
for ``show`` and ``starting-offsets``.

One local SparkSession serves the whole run (``conftest.spark``); queries write to the
``noop`` sink, which, unlike ``memory``, restarts from its checkpoint in append mode.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

import spark_bridge
from tests.helpers import as_json, spark_conf, wait_blob, wait_for
from tests.services import REPO_ROOT, DaemonProcess

pytestmark = pytest.mark.spark

Source = Callable[[SparkSession], DataFrame]


@pytest.fixture(scope="module")
def kafka_shaped(spark: SparkSession) -> SparkSession:
    """The session with the Kafka-shaped Python data source registered (PySpark 4 only)."""
    from spark_bridge.demo_source import KafkaShapedSource

    spark.dataSource.register(KafkaShapedSource)
    return spark


def rate(spark: SparkSession) -> DataFrame:
    return (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", "10")
        .load()
        .selectExpr("value")
    )


def kafka(spark: SparkSession) -> DataFrame:
    return (
        spark.readStream.format("kafka_shaped")
        .option("partitions", "3")
        .option("rowsPerBatch", "10")
        .load()
        .selectExpr("offset AS value")
    )


def union(spark: SparkSession) -> DataFrame:
    return rate(spark).union(kafka(spark))


def start(spark: SparkSession, source: Source, name: str, ck: Path) -> StreamingQuery:
    return (
        source(spark)
        .writeStream.format("noop")
        .queryName(name)
        .trigger(processingTime="100 milliseconds")
        .option("checkpointLocation", str(ck))
        .start()
    )


def run_batches(q: StreamingQuery, batches: int) -> None:
    """Let the query finish ``batches`` batches (or more), then stop it."""
    try:
        wait_for(
            lambda: q.lastProgress is not None and q.lastProgress["batchId"] >= batches - 1,
            what=f"{batches} batches",
        )
    finally:
        q.stop()
    assert q.exception() is None


def sparks_log(ck: Path, version: str = "v1") -> tuple[int, list[Any]]:
    """Read independently of the code under test: the highest batch in commits/ and the
    source lines of offsets/<that batch> (the version and metadata lines skipped; a v2 log's
    ``<ordinal>:<offset>`` lines put in ordinal order)."""
    committed = max(int(p.name) for p in (ck / "commits").iterdir() if p.name.isdigit())
    lines = (ck / "offsets" / str(committed)).read_text().splitlines()
    assert lines[0] == version
    if version == "v2":
        by_id = dict(line.split(":", 1) for line in lines[2:])
        lines = lines[:2] + [by_id[k] for k in sorted(by_id, key=int)]
    return committed, [None if line == "-" else json.loads(line) for line in lines[2:]]


def first_new_batch(spark: SparkSession, source: Source, name: str, ck: Path, batch: int) -> Any:
    """Restart the query from ``ck``; the progress of its batch ``batch`` (the first one
    after the last committed), then stop it."""
    q = start(spark, source, name, ck)
    try:
        found = wait_for(
            lambda: next((p for p in q.recentProgress if p["batchId"] == batch), None),
            what=f"batch {batch} after the restart",
        )
    finally:
        q.stop()
    assert q.exception() is None
    return found


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        env={"PATH": "/usr/bin:/bin", **env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result


def import_json(env: dict[str, str], ck: Path, name: str) -> dict[str, Any]:
    """``import-spark-checkpoint CK --query-name NAME --json``, parsed."""
    out = cli(env, "import-spark-checkpoint", str(ck), "--query-name", name, "--json").stdout
    return dict(json.loads(out))


def import_and_check(
    spark: SparkSession,
    env: dict[str, str],
    source: Source,
    name: str,
    ck: Path,
    version: str = "v1",
) -> dict[str, Any]:
    """Run the query, import its checkpoint, check the import against Spark's log, Spark's
    restart and the blob; the imported checkpoint (as ``show --json`` prints it)."""
    q = start(spark, source, name, ck)
    query_id = str(q.id)
    run_batches(q, 3)
    committed, ends = sparks_log(ck, version)

    out = import_json(env, ck, name)
    assert out["written"] is True
    assert out["checkpoint"]["query_id"] == query_id
    assert out["batch_id"] == committed >= 2
    assert out["offsets_log_version"] == int(version[1:])
    assert [s["end_offset"] for s in out["checkpoint"]["sources"]] == ends

    # Spark's own restart from the same directory starts its next batch where the import says.
    restarted = first_new_batch(spark, source, name, ck, committed + 1)
    assert [as_json(s["startOffset"]) for s in restarted["sources"]] == ends

    shown = json.loads(cli(env, "show", name, "--json").stdout)
    assert (shown["query_id"], shown["batch_id"]) == (query_id, committed)
    assert [s["end_offset"] for s in shown["sources"]] == ends
    return dict(shown)


def test_rate_source_then_the_query_adopts_the_sidecar(
    spark: SparkSession,
    daemon_env: dict[str, str],
    short_tmp: Path,
    procs: list[DaemonProcess],
) -> None:
    ck = short_tmp / "ck"
    shown = import_and_check(spark, daemon_env, rate, "import_rate", ck)
    imported = shown["batch_id"]
    assert shown["sources"][0]["description"] == "source[0] (from Spark's offsets log)"
    assert shown["sources"][0]["end_offset"]["offset"] == 10 * (imported + 1)

    # Adoption: the daemon and the listener, the query restarted from the same directory.
    # The blob's batch is the floor, so the batches after it are stored on top of it.
    daemon = DaemonProcess({**daemon_env, "SIDECAR_COUNT_THRESHOLD": "1"}, short_tmp / "d.log")
    procs.append(daemon)
    daemon.start()
    handle = spark_bridge.attach(spark, daemon_env["SIDECAR_SOCKET_PATH"])
    try:
        q = start(spark, rate, "import_rate", ck)
        run_batches(q, imported + 4)
        last = q.lastProgress
        assert last is not None
    finally:
        assert handle.close()  # waits for the stopped query's last batch
    doc = wait_blob(daemon_env, shown["query_id"], last["batchId"])
    assert doc.batch_id == last["batchId"]
    assert "offsets log" not in doc.sources[0].description  # Spark's own description now
    retained = [e.batch_id for e in doc.retained()]
    assert imported in retained and retained[0] == last["batchId"]


@pytest.mark.spark4
def test_kafka_shaped_source(
    kafka_shaped: SparkSession, daemon_env: dict[str, str], short_tmp: Path
) -> None:
    shown = import_and_check(kafka_shaped, daemon_env, kafka, "import_kafka", short_tmp / "ck")
    source = shown["sources"][0]
    assert source["description"] == "KafkaV2[events] (from Spark's offsets log)"
    resume = cli(daemon_env, "starting-offsets", "import_kafka").stdout
    assert json.loads(resume) == source["end_offset"]
    n = 10 * (shown["batch_id"] + 1)
    assert source["end_offset"] == {"events": {"0": n, "1": n, "2": n}}


@pytest.mark.spark4
def test_two_sources_in_one_query(
    kafka_shaped: SparkSession, daemon_env: dict[str, str], short_tmp: Path
) -> None:
    shown = import_and_check(kafka_shaped, daemon_env, union, "import_union", short_tmp / "ck")
    assert [s["description"] for s in shown["sources"]] == [
        "source[0] (from Spark's offsets log)",
        "KafkaV2[events] (from Spark's offsets log)",
    ]
    resume = cli(daemon_env, "starting-offsets", "import_union", "--source", "1").stdout
    assert json.loads(resume) == shown["sources"][1]["end_offset"]


# --- Spark 4: offsets log v2, commit log v2 (state store checkpoint ids) ------------------


def two_rates(spark: SparkSession) -> DataFrame:
    return rate(spark).union(
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", "5")
        .load()
        .selectExpr("value")
    )


def counts(spark: SparkSession) -> DataFrame:
    """A stateful query: a running count per key (state kept in Spark's state store)."""
    return rate(spark).groupBy((F.col("value") % 3).alias("key")).count()


def start_update(spark: SparkSession, source: Source, name: str, ck: Path) -> StreamingQuery:
    return (
        source(spark)
        .writeStream.format("noop")
        .outputMode("update")
        .queryName(name)
        .trigger(processingTime="100 milliseconds")
        .option("checkpointLocation", str(ck))
        .start()
    )


V2 = {"spark.sql.streaming.offsetLog.formatVersion": "2"}


@pytest.mark.spark4
def test_offsets_log_v2_two_sources(
    spark: SparkSession, daemon_env: dict[str, str], short_tmp: Path
) -> None:
    """v2 lines are ``<ordinal>:<offset>`` in no fixed order (Spark 4.3 wrote ``1:`` first
    here); the import puts them in source order, as Spark's restart reads them."""
    ck = short_tmp / "ck"
    with spark_conf(spark, V2):
        shown = import_and_check(spark, daemon_env, two_rates, "import_v2", ck, "v2")
    batch = shown["batch_id"]
    assert [s["end_offset"]["offset"] for s in shown["sources"]] == [
        10 * (batch + 1),
        5 * (batch + 1),
    ]
    # No state/: not known to be stateless (the usual copy leaves state/ out): unknown.
    assert shown["state_unknown"] is True and shown["position"] == "committed"


@pytest.mark.spark4
def test_stateful_query_with_state_store_checkpoint_v2_is_imported_as_stateful(
    spark: SparkSession, daemon_env: dict[str, str], short_tmp: Path
) -> None:
    """RocksDB with state store checkpoint format v2 writes ``commits/<N>`` as v2 with
    ``stateUniqueIds``: read, and the imported checkpoint is marked stateful, so moving it
    back by hand is refused without --force."""
    ck = short_tmp / "ck"
    conf = {
        **V2,
        "spark.sql.streaming.stateStore.providerClass": (
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
        ),
        "spark.sql.streaming.stateStore.checkpointFormatVersion": "2",
    }
    with spark_conf(spark, conf):
        q = start_update(spark, counts, "import_stateful", ck)
        run_batches(q, 3)
    committed, ends = sparks_log(ck, "v2")
    commit = (ck / "commits" / str(committed)).read_text().splitlines()
    assert commit[0] == "v2" and json.loads(commit[1])["stateUniqueIds"]

    out = import_json(daemon_env, ck, "import_stateful")
    assert out["written"] is True and out["stateful"] is True
    assert out["batch_id"] == committed
    assert [s["end_offset"] for s in out["checkpoint"]["sources"]] == ends
    shown = json.loads(cli(daemon_env, "show", "import_stateful", "--json").stdout)
    assert shown["stateful"] is True
    text = cli(daemon_env, "show", "import_stateful").stdout
    assert "stateful (rewinding it needs its state store rewound" in text

    # An explicit-offsets reset moves a stateful query by hand: refused, the blob unchanged.
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "reset",
            "import_stateful",
            "--offsets",
            json.dumps([{"offset": 0, "timestamp": 0}]),
            "--reason",
            "test",
        ],
        env={"PATH": "/usr/bin:/bin", **daemon_env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1, refused.stderr
    assert "is stateful" in refused.stderr and "state/" in refused.stderr
    again = json.loads(cli(daemon_env, "show", "import_stateful", "--json").stdout)
    assert again["batch_id"] == committed and again["sources"] == shown["sources"]


@pytest.mark.spark4
def test_named_sources_of_source_evolution(
    spark: SparkSession, daemon_env: dict[str, str], short_tmp: Path
) -> None:
    """With source evolution, sources are named (``.name()``) and the v2 lines carry names:
    the import keeps the log's order and shows the names; Spark's restart agrees."""
    ck = short_tmp / "ck"

    def named(s: SparkSession) -> DataFrame:
        alpha = s.readStream.format("rate-micro-batch").option("rowsPerBatch", "10")
        beta = s.readStream.format("rate-micro-batch").option("rowsPerBatch", "5")
        return (
            alpha.name("alpha")
            .load()
            .selectExpr("value")
            .union(beta.name("beta").load().selectExpr("value"))
        )

    conf = {"spark.sql.streaming.queryEvolution.enableSourceEvolution": "true"}
    with spark_conf(spark, conf):
        q = start(spark, named, "import_named", ck)
        run_batches(q, 3)
        committed = max(int(p.name) for p in (ck / "commits").iterdir() if p.name.isdigit())
        lines = (ck / "offsets" / str(committed)).read_text().splitlines()
        assert lines[0] == "v2"
        logged = dict(line.split(":", 1) for line in lines[2:])
        assert set(logged) == {"alpha", "beta"}
        out = import_json(daemon_env, ck, "import_named")
        assert out["source_ids"] == [line.split(":", 1)[0] for line in lines[2:]]
        by_name = {
            i: s for i, s in zip(out["source_ids"], out["checkpoint"]["sources"], strict=True)
        }
        for source_id, source in by_name.items():
            assert source["end_offset"] == json.loads(logged[source_id])
            assert source["description"] == f"source {source_id!r} (from Spark's offsets log)"
        restarted = first_new_batch(spark, named, "import_named", ck, committed + 1)
    starts = sorted(as_json(s["startOffset"])["offset"] for s in restarted["sources"])
    assert starts == sorted(json.loads(v)["offset"] for v in logged.values())


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI, whatever its exit code."""
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        env={"PATH": "/usr/bin:/bin", **env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_import_or_reset_never_lowers_a_stateful_querys_guard(
    spark: SparkSession, daemon_env: dict[str, str], short_tmp: Path, procs: list[DaemonProcess]
) -> None:
    """A real stateful aggregation reported by the JVM listener (recorded stateful); its
    directory copied as docs say for an import (metadata, offsets, commits: no state/) and cut
    back 3 batches. The import of that older cut and a plain reset are refused naming the
    state store, even with --force; the query stays stateful. With --state-rewound both go
    through, and it still is."""
    env = {
        **daemon_env,
        "SIDECAR_COUNT_THRESHOLD": "1",
        "SIDECAR_ADMIN_OPS": "true",
        "SIDECAR_ADMIN_QUIET_S": "0",
    }
    daemon = DaemonProcess(env, short_tmp / "daemon.log")
    procs.append(daemon)
    daemon.start()
    handle = spark_bridge.attach(spark, env["SIDECAR_SOCKET_PATH"], listener="jvm")
    ck = short_tmp / "ck"
    q = start_update(spark, counts, "guarded", ck)
    try:
        wait_for(lambda: q.lastProgress is not None and q.lastProgress["batchId"] >= 7, what="8")
    finally:
        q.stop()
    last = int(q.lastProgress["batchId"])  # type: ignore[index]
    wait_for(lambda: handle.stats().offered >= last + 1, what="the last event")
    assert handle.flush(10) and handle.close()
    doc = wait_blob(env, str(q.id), last)
    assert doc.stateful is True and not doc.state_unknown

    committed, _ = sparks_log(ck)
    cut = short_tmp / "cut"
    (cut / "offsets").mkdir(parents=True)
    (cut / "commits").mkdir()
    (cut / "metadata").write_bytes((ck / "metadata").read_bytes())
    for log in ("offsets", "commits"):
        for f in (ck / log).iterdir():
            if f.name.isdigit() and int(f.name) <= committed - 3:
                (cut / log / f.name).write_bytes(f.read_bytes())
    older = committed - 3

    refused = run_cli(
        env, "import-spark-checkpoint", str(cut), "--query-name", "guarded", "--force"
    )
    assert refused.returncode == 1
    assert "is stateful" in refused.stderr and "state store" in refused.stderr
    assert "--state-rewound" in refused.stderr
    reset = run_cli(env, "reset", "guarded", "--to-batch", str(older), "--force")
    assert reset.returncode == 1 and "is stateful" in reset.stderr
    shown = json.loads(cli(env, "show", "guarded", "--json").stdout)
    assert (shown["batch_id"], shown["stateful"], shown["state_unknown"]) == (last, True, False)

    imported = cli(
        env,
        "import-spark-checkpoint",
        str(cut),
        "--query-name",
        "guarded",
        "--force",
        "--state-rewound",
    )
    assert "wrote batch" in imported.stdout
    shown = json.loads(cli(env, "show", "guarded", "--json").stdout)
    # An import without state/ (unknown) never lowers what the blob knew.
    assert (shown["batch_id"], shown["stateful"], shown["state_unknown"]) == (older, True, False)
    again = run_cli(env, "reset", "guarded", "--to-batch", str(older - 1), "--state-rewound")
    assert again.returncode == 0, again.stderr
    shown = json.loads(cli(env, "show", "guarded", "--json").stdout)
    assert (shown["batch_id"], shown["stateful"]) == (older - 1, True)
