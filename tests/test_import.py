"""``import-spark-checkpoint``: the parser of Spark's checkpoint directory on small
hand-written directories (pure), and the command against Azurite (no Spark: see
``tests/test_spark_import.py`` for directories written by real queries)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from sidecar import commands
from sidecar.adoption import read_spark_checkpoint
from sidecar.blobstore import BlobStore
from sidecar.checkpoint import Checkpoint, CheckpointDocument, SourceOffsets
from sidecar.config import Config
from sidecar.offsets import kafka_offsets, kafka_starting_offsets
from sidecar.sparklog import SparkBatch, SparkCheckpointError, describe, to_checkpoint
from tests.services import REPO_ROOT

QID = "5f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0"
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
    resume = kafka_starting_offsets(msgspec.to_builtins(checkpoint), source=1)
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
        (lambda r: (r / "offsets" / "1").write_text("v2\n{}\na:1\n"), "offsets log v2"),
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


# --- the command, against Azurite -----------------------------------------------------------


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        env={"PATH": "/usr/bin:/bin", **env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def read(env: dict[str, str], query_id: str = QID) -> CheckpointDocument | None:
    async def go() -> CheckpointDocument | None:
        store = BlobStore(Config.from_env(env))
        try:
            return await store.read(query_id)
        finally:
            await store.aclose()

    return anyio.run(go)


def seed(env: dict[str, str], batch: int, *, query_id: str = QID, name: str = "orders") -> None:
    """A checkpoint written by the sidecar before: Spark's own source descriptions."""
    checkpoint = Checkpoint(
        query_id=query_id,
        run_id="0e1c3f52-9d2b-4f7e-a3c4-5d6e7f809a1b",
        name=name,
        batch_id=batch,
        timestamp="2026-11-21T10:00:00.000Z",
        sources=[
            SourceOffsets("RateStreamV2[rowsPerSecond=10]", None, 1, None),
            SourceOffsets("KafkaV2[Subscribe[events]]", None, {"events": {"0": 1}}, None),
        ],
    )
    config = Config.from_env(env)
    anyio.run(lambda: commands._write(config, checkpoint, reason="seed", force=True))


def test_dry_run_then_import_then_show(daemon_env: dict[str, str], tmp_path: Path) -> None:
    root = spark_dir(tmp_path / "ck", {b: [str(b), kafka_line(b)] for b in range(3)}, [0, 1])
    args = ("import-spark-checkpoint", str(root), "--query-name", "orders")
    dry = cli(daemon_env, *args, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "last committed    batch 1 " in dry.stdout
    assert "; 2 planned, not committed" in dry.stdout
    assert "dry run: nothing written" in dry.stdout
    assert read(daemon_env) is None

    done = cli(daemon_env, *args, "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert (out["written"], out["batch_id"], out["blob_batch_id"]) == (True, 1, None)
    assert "reset: query orders" in done.stderr and "was empty" in done.stderr
    doc = read(daemon_env)
    assert doc is not None and doc.batch_id == 1 and doc.name == "orders"
    assert [s.end_offset for s in doc.sources] == [1, {"events": {"0": 1, "1": 2}}]
    resume = cli(daemon_env, "starting-offsets", "orders")
    assert resume.stdout.strip() == '{"events":{"0":1,"1":2}}'
    assert cli(daemon_env, "show", QID).returncode == 0


def test_descriptions_from_the_blob_a_newer_blob_refused_unless_forced(
    daemon_env: dict[str, str], tmp_path: Path
) -> None:
    seed(daemon_env, 9)
    root = spark_dir(tmp_path / "ck", {4: ["4", kafka_line(4)]}, [4])
    args = ("import-spark-checkpoint", str(root), "--query-name", "orders")
    dry = cli(daemon_env, *args, "--dry-run")
    assert "the blob holds a newer batch: the write is refused without --force" in dry.stdout
    refused = cli(daemon_env, *args)
    assert refused.returncode == 1
    assert "already holds batch 9, newer than batch 4: nothing written" in refused.stderr
    doc = read(daemon_env)
    assert doc is not None and doc.batch_id == 9

    forced = cli(daemon_env, *args, "--force")
    assert forced.returncode == 0, forced.stderr
    assert "described by its blob (batch 9)" in forced.stdout
    doc = read(daemon_env)
    assert doc is not None and doc.batch_id == 4
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
    doc = read(daemon_env)
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
    assert "is leased by another owner" in refused.stderr
    assert "nothing written" in refused.stderr
    doc = read(daemon_env)
    assert doc is not None and doc.batch_id == 1


def test_not_a_checkpoint_dir_exits_1(daemon_env: dict[str, str], tmp_path: Path) -> None:
    result = cli(daemon_env, "import-spark-checkpoint", str(tmp_path), "--query-name", "q")
    assert result.returncode == 1
    assert "is not a Spark checkpoint directory" in result.stderr
