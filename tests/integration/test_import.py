"""``import-spark-checkpoint``: the parser of Spark's checkpoint directory on small
hand-written directories (pure), and the command against Redis and Azurite, with no daemon
(under the tool's own lease) and through a running daemon (no Spark: see
``tests/integration/test_spark_import.py`` for directories written by real queries)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from sidecar.config import Config
from sidecar.model.checkpoint import (
    NULL,
    Checkpoint,
    SourceOffsets,
    as_builtins,
    offset_value,
    raw_offset,
)
from sidecar.model.offsets import kafka_offsets, kafka_starting_offsets
from sidecar.model.spark_dir import (
    SparkBatch,
    SparkCheckpointError,
    describe,
    parse_offsets,
    to_checkpoint,
)
from sidecar.model.stateful import State, state_of
from sidecar.ops import admin_tool
from sidecar.ops.client import SidecarClient
from sidecar.ops.spark_import import read_spark_checkpoint
from sidecar.store.blobs import BlobStore
from tests.helpers import acli, blob_reader, cli, read_blob, running_daemon, sample, wait_blob_batch
from tests.sparkshapes import kafka_progress

QID = "5f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0"
ADMIN = "checkpoint_sidecar_admin_ops_total"
META = '{"batchWatermarkMs":0,"batchTimestampMs":1795299045040,"conf":{}}'


def spark_dir(
    root: Path,
    offsets: dict[int, list[str]],
    commits: list[int],
    *,
    query_id: str = QID,
    header: str = "v1",
) -> Path:
    """A checkpoint directory as Spark writes it, with the checksum files of a local file
    system and a temp file left by an interrupted rename."""
    (root / "offsets").mkdir(parents=True)
    (root / "commits").mkdir()
    (root / "metadata").write_text(json.dumps({"id": query_id}) + "\n")
    (root / ".metadata.crc").write_bytes(b"crc")
    for batch, lines in offsets.items():
        (root / "offsets" / str(batch)).write_text("\n".join([header, META, *lines]))
        (root / "offsets" / f".{batch}.crc").write_bytes(b"crc")
    for batch in commits:
        (root / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')
        (root / "commits" / f".{batch}.crc").write_bytes(b"crc")
    return root


def kafka_line(offset: int) -> str:
    return json.dumps({"events": {"0": offset, "1": offset + 1}})


# --- the parser ------------------------------------------------------------------------------


def test_the_last_committed_batch_not_the_last_planned(tmp_path: Path) -> None:
    root = spark_dir(
        tmp_path / "ck",
        {b: [f'{{"offset":{10 * (b + 1)}}}', "-", kafka_line(b)] for b in range(4)},
        commits=[0, 1, 2],
    )
    (root / "commits" / ".3.8c0f6a1e-tmp.tmp").write_text("v1\n")  # a rename never done
    (root / "commits" / "3.compact").write_text("v1\n")
    batch = read_spark_checkpoint(root)
    assert batch == SparkBatch(
        query_id=QID,
        batch_id=2,
        timestamp="2026-11-21T22:10:45.040Z",
        end_offsets=({"offset": 30}, None, {"events": {"0": 2, "1": 3}}),
        uncommitted=(3,),
    )


def test_logs_v2_ordinal_lines_in_source_order_state_ids_mean_stateful(tmp_path: Path) -> None:
    """Spark 4's v2 offsets lines are ``<ordinal>:<offset>`` in no fixed order (4.3 wrote
    ``1:`` before ``0:``); a v2 commit with ``stateUniqueIds`` is a stateful query's."""
    root = spark_dir(tmp_path / "ck", {0: ['{"offset":1}']}, commits=[0])
    (root / "offsets" / "0").write_text(f'v2\n{META}\n1:{kafka_line(4)}\n0:{{"offset":30}}\n2:-\n')
    (root / "commits" / "0").write_text(
        'v2\n{"nextBatchWatermarkMs":0,"stateUniqueIds":{"0":[["bd59"],["f936"]]}}\n'
    )
    batch = read_spark_checkpoint(root)
    assert batch.end_offsets == ({"offset": 30}, {"events": {"0": 4, "1": 5}}, None)
    assert (batch.log_version, batch.source_ids, batch.stateful) == (2, ("0", "1", "2"), True)
    checkpoint = to_checkpoint(batch, "orders", describe(batch.end_offsets, None))
    assert (checkpoint.stateful, checkpoint.position) == (True, "committed")
    assert state_of(checkpoint) is State.STATEFUL
    # A stateless v2 commit (empty stateUniqueIds) and no state/: not known to have state,
    # and recorded as unknown, never as stateless (the usual copy leaves state/ out).
    (root / "commits" / "0").write_text('v2\n{"nextBatchWatermarkMs":0,"stateUniqueIds":{}}\n')
    assert read_spark_checkpoint(root).stateful is False
    unknown = to_checkpoint(read_spark_checkpoint(root), "orders", ["a", "b", "c"])
    assert state_of(unknown) is State.UNKNOWN and unknown.stateful is True
    (root / "state").mkdir()  # a v1 stateful query: its state store's directory
    assert read_spark_checkpoint(root).stateful is True


def test_named_v2_sources_keep_the_logs_order_and_their_names() -> None:
    data = f'v2\n{META}\nbeta:{{"offset":5}}\nalpha:{kafka_line(1)}\n'.encode()
    read = parse_offsets(data, "offsets/3")
    assert read.source_ids == ("beta", "alpha")
    assert read.end_offsets == ({"offset": 5}, {"events": {"0": 1, "1": 2}})
    assert describe(read.end_offsets, ["x", "y"], read.source_ids) == [
        "source 'beta' (from Spark's offsets log)",
        "KafkaV2[events] source 'alpha' (from Spark's offsets log)",
    ]


def test_a_kafka_shaped_source_is_named_kafka_so_commits_and_resume_work() -> None:
    batch = SparkBatch(QID, 7, "", ({"offset": 3}, {"events": {"0": 5}, "audit": {"0": 1}}))
    names = describe(batch.end_offsets, None)
    assert names == [
        "source[0] (from Spark's offsets log)",
        "KafkaV2[audit,events] (from Spark's offsets log)",
    ]
    checkpoint = to_checkpoint(batch, "orders", names)
    assert checkpoint.run_id == "spark-checkpoint-import"
    assert kafka_offsets(checkpoint) == {("events", 0): 5, ("audit", 0): 1}
    resume = kafka_starting_offsets(as_builtins(checkpoint), source=1)
    assert json.loads(resume) == {"audit": {"0": 1}, "events": {"0": 5}}
    # Known descriptions are taken only when there is one per source.
    assert describe(batch.end_offsets, ["a", "b"]) == ["a", "b"]
    assert describe(batch.end_offsets, ["a"]) == names


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: (r / "metadata").unlink(), "is not a Spark checkpoint directory"),
        (lambda r: (r / "metadata").write_text('{"id":"../x"}'), "is not Spark's query metadata"),
        (lambda r: (r / "commits" / "1").unlink(), "no committed batch in commits/"),
        (lambda r: (r / "offsets" / "1").unlink(), "offsets/1 is missing"),
        (lambda r: (r / "commits" / "1").write_text(""), "commits/1 is empty"),
        (lambda r: (r / "offsets" / "1").write_text("v3\n{}\na:1\n"), "offsets log v3"),
        (lambda r: (r / "offsets" / "1").write_text("v2\n{}\n1\n"), "is not '<source id>:"),
        (lambda r: (r / "offsets" / "1").write_text("v2\n{}\n0:1\n0:2\n"), "source '0' twice"),
        (lambda r: (r / "commits" / "1").write_text("v3\n{}\n"), "commit log v3"),
        (lambda r: (r / "offsets" / "1").write_text("{}\n{}\n1\n"), "not a log version"),
        (lambda r: (r / "offsets" / "1").write_text(f"v1\n{META}\n"), "has 2 line(s)"),
        (
            lambda r: (r / "offsets" / "1").write_text(f'v1\n{META}\n1\n{{"events":'),
            "line 4 ('{\"events\":') is not a source offset",
        ),
        (lambda r: (r / "offsets" / "1").write_text(f"v1\n{META}\n-\n-\n"), "no offset for any"),
    ],
)
def test_what_cannot_be_imported_says_why(tmp_path: Path, mutate: Any, message: str) -> None:
    root = spark_dir(tmp_path / "ck", {1: ["1", "2"]}, commits=[1])
    mutate(root)
    with pytest.raises(SparkCheckpointError) as caught:
        batch = read_spark_checkpoint(root)
        to_checkpoint(batch, "q", describe(batch.end_offsets, None))
    assert message in str(caught.value)


def test_not_a_directory_or_not_local(tmp_path: Path) -> None:
    with pytest.raises(SparkCheckpointError, match="is not a directory"):
        read_spark_checkpoint(tmp_path / "absent")
    with pytest.raises(SparkCheckpointError, match="only a local directory is read"):
        read_spark_checkpoint("abfss://c@acct.dfs.core.windows.net/ck")


# --- the command, against Redis and Azurite ------------------------------------------------


def seed(env: dict[str, str], batch: int, *, query_id: str = QID, name: str = "orders") -> None:
    """A checkpoint written by the sidecar before: Spark's own source descriptions."""
    checkpoint = Checkpoint(
        query_id=query_id,
        run_id="0e1c3f52-9d2b-4f7e-a3c4-5d6e7f809a1b",
        name=name,
        batch_id=batch,
        timestamp="2026-11-21T10:00:00.000Z",
        sources=[
            SourceOffsets("RateStreamV2[rowsPerSecond=10]", NULL, raw_offset(1), NULL),
            SourceOffsets(
                "KafkaV2[Subscribe[events]]", NULL, raw_offset({"events": {"0": 1}}), NULL
            ),
        ],
    )
    config = Config.from_env(env)  # no daemon on its socket: under a lease of its own
    anyio.run(lambda: admin_tool.apply_reset(config, checkpoint, reason="seed", force=True))


def test_dry_run_then_import_then_show(daemon_env: dict[str, str], tmp_path: Path) -> None:
    root = spark_dir(tmp_path / "ck", {b: [str(b), kafka_line(b)] for b in range(3)}, [0, 1])
    args = ("import-spark-checkpoint", str(root), "--query-name", "orders")
    dry = cli(daemon_env, *args, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "last committed    batch 1 " in dry.stdout
    assert "; 2 planned, not committed" in dry.stdout
    assert "dry run: nothing written" in dry.stdout
    assert read_blob(daemon_env, QID) is None

    done = cli(daemon_env, *args, "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert (out["written"], out["via"], out["batch_id"], out["blob_batch_id"]) == (
        True,
        "lease",
        1,
        None,
    )
    assert "WARNING sidecar.ops.admin_steps: admin reset by " in done.stderr
    assert "from batch none to batch 1 under the tool's own lease" in done.stderr
    doc = read_blob(daemon_env, QID)
    assert doc is not None and doc.batch_id == 1 and doc.name == "orders"
    assert doc.reset_from is None
    assert doc.reset_reason == f"imported from Spark checkpoint {root} (last committed batch)"
    assert [offset_value(s.end_offset) for s in doc.sources] == [1, {"events": {"0": 1, "1": 2}}]
    resume = cli(daemon_env, "starting-offsets", "orders")
    assert resume.stdout.strip() == '{"events":{"0":1,"1":2}}'
    shown = cli(daemon_env, "show", QID)
    assert shown.returncode == 0, shown.stderr
    assert f"reset       from nothing at {doc.reset_at}: imported from Spark" in shown.stdout


def test_descriptions_from_the_blob_a_newer_blob_refused_unless_forced(
    daemon_env: dict[str, str], tmp_path: Path
) -> None:
    seed(daemon_env, 9)
    root = spark_dir(tmp_path / "ck", {4: ["4", kafka_line(4)]}, [4])
    args = ("import-spark-checkpoint", str(root), "--query-name", "orders")
    dry = cli(daemon_env, *args, "--dry-run")
    assert "the write would be refused: blob " in dry.stdout
    refused = cli(daemon_env, *args)
    assert refused.returncode == 1
    assert "already holds batch 9, newer than batch 4: nothing written" in refused.stderr
    assert "pass --force to move the query back to batch 4" in refused.stderr
    doc = read_blob(daemon_env, QID)
    assert doc is not None and doc.batch_id == 9

    forced = cli(daemon_env, *args, "--force")
    assert forced.returncode == 0, forced.stderr
    assert "described by its blob (batch 9)" in forced.stdout
    assert "as a reset, under the tool's own lease" in forced.stdout
    doc = read_blob(daemon_env, QID)
    assert doc is not None and (doc.batch_id, doc.reset_from) == (4, 9)
    assert [s.description for s in doc.sources] == [
        "RateStreamV2[rowsPerSecond=10]",
        "KafkaV2[Subscribe[events]]",
    ]


def test_descriptions_from_the_newest_blob_of_that_name(
    daemon_env: dict[str, str], tmp_path: Path
) -> None:
    other = "0a0b0c0d-1111-4222-8333-444455556666"  # the query before its checkpoint was lost
    seed(daemon_env, 30, query_id=other, name="orders")
    root = spark_dir(tmp_path / "ck", {2: ["2", kafka_line(2)]}, [2])
    done = cli(daemon_env, "import-spark-checkpoint", str(root), "--query-name", "orders")
    assert done.returncode == 0, done.stderr
    assert f"described by the blob of query {other} (batch 30)" in done.stdout
    doc = read_blob(daemon_env, QID)
    assert doc is not None and doc.sources[1].description == "KafkaV2[Subscribe[events]]"


def test_refused_while_another_owner_holds_the_lease(
    daemon_env: dict[str, str], tmp_path: Path
) -> None:
    seed(daemon_env, 1)
    config = Config.from_env(daemon_env)

    async def hold() -> None:
        store = BlobStore(config)
        try:
            await store.acquire_lease(QID, "9e9e9e9e-0000-4000-8000-000000000001", 15)
        finally:
            await store.aclose()

    anyio.run(hold)
    root = spark_dir(tmp_path / "ck", {5: ["5", kafka_line(5)]}, [5])
    refused = cli(daemon_env, "import-spark-checkpoint", str(root), "--query-name", "orders")
    assert refused.returncode == 1
    assert "another owner holds the lease on" in refused.stderr
    assert "nothing was changed" in refused.stderr
    doc = read_blob(daemon_env, QID)
    assert doc is not None and doc.batch_id == 1


async def test_through_a_running_daemon_and_refused_while_it_hears_the_query(
    make_config: Callable[..., Config], tmp_path: Path
) -> None:
    config = make_config(admin_ops="true", count_threshold=1)
    first = spark_dir(tmp_path / "a", {3: [kafka_line(3)]}, [3])
    later = spark_dir(tmp_path / "b", {8: [kafka_line(8)]}, [8])
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        # A query running without the listener: the daemon never heard of it.
        done = await acli(config, "import-spark-checkpoint", str(first), "--query-name", "orders")
        assert done.returncode == 0, done.stderr
        assert "wrote batch 3 of query 'orders' as a reset, by the daemon" in done.stdout
        doc = await store.read(QID)
        assert doc is not None and (doc.batch_id, doc.reset_from) == (3, None)
        assert doc.reset_reason == f"imported from Spark checkpoint {first} (last committed batch)"
        assert offset_value(doc.sources[0].end_offset) == {"events": {"0": 3, "1": 4}}
        assert await store.lease_state(QID) == "leased"  # the daemon's, kept
        assert sample(daemon, ADMIN, op="reset", result="ok") == 1

        # Now the listener reports batch 4: the daemon tracks the query.
        async with await SidecarClient.connect(config.socket_path) as c:
            reply = await c.progress(kafka_progress(QID, 4, name="orders", partitions=2))
            assert reply.applied, reply
        await wait_blob_batch(store, QID, 4)
        args = ("import-spark-checkpoint", str(later), "--query-name", "orders")
        refused = await acli(config, *args)
        assert refused.returncode == 1
        assert "may still be running: this daemon received a progress" in refused.stderr
        assert sample(daemon, ADMIN, op="reset", result="refused") == 1
        forced = await acli(config, *args, "--force")
        assert forced.returncode == 0, forced.stderr
        doc = await store.read(QID)
        assert doc is not None and (doc.batch_id, doc.reset_from) == (8, 4)
        assert sample(daemon, ADMIN, op="reset", result="ok") == 2


async def test_refused_by_a_daemon_without_admin_ops(
    make_config: Callable[..., Config], tmp_path: Path
) -> None:
    config = make_config()  # SIDECAR_ADMIN_OPS off: the default
    root = spark_dir(tmp_path / "ck", {2: [kafka_line(2)]}, [2])
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        refused = await acli(config, "import-spark-checkpoint", str(root), "--query-name", "q")
        assert refused.returncode == 2
        assert "reset and retire are admin ops, off on this daemon" in refused.stderr
        assert "SIDECAR_ADMIN_OPS=true" in refused.stderr
        assert await store.read(QID) is None
        assert sample(daemon, ADMIN, op="reset", result="refused") == 1


def test_not_a_checkpoint_dir_exits_1(daemon_env: dict[str, str], tmp_path: Path) -> None:
    result = cli(daemon_env, "import-spark-checkpoint", str(tmp_path), "--query-name", "q")
    assert result.returncode == 1
    assert "is not a Spark checkpoint directory" in result.stderr
