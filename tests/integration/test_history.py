"""Checkpoint history in the blob (schema version 2) and rewinding to it, against real
redis-server and Azurite: the flusher carries the history forward in its one write per
flush, ``history`` / ``starting-offsets --batch|--before`` and
``spark_bridge.starting_offsets(batch=, before=)`` read it, version 1 blobs still read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

import spark_bridge
from sidecar.config import Config
from sidecar.errors import CorruptRecord
from sidecar.model import checkpoint as ckpt
from sidecar.model.document import (
    HISTORY_MAX_BYTES,
    CheckpointDocument,
    HistoryEntry,
    Writer,
    carry_history,
    decode_document,
    encode_document,
)
from sidecar.model.offsets import ResumeError
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore
from tests.helpers import (
    ConfigFactory,
    blob_reader,
    checkpoint_from,
    eventually,
    running_daemon,
    sample,
)
from tests.services import REPO_ROOT, Azurite
from tests.sparkshapes import kafka_progress

QID = "3a7c5e10-2b4d-4f6a-8c9e-1d2f3a4b5c6d"
NAME = "orders-to-delta"
BATCH = "checkpoint_sidecar_checkpoint_batch_id"


def values(offsets: tuple[ckpt.Offset, ...]) -> tuple[Any, ...]:
    return tuple(ckpt.offset_value(o) for o in offsets)


def end_of(batch: int, **kw: Any) -> Any:
    """The Kafka end offset ``kafka_progress`` reports for ``batch``."""
    return kafka_progress(QID, batch, **kw)["sources"][0]["endOffset"]


async def flush_each(config: Config, batches: range, **progress: Any) -> None:
    """Run a daemon and have it flush each batch in its own write (waited on through the
    daemon's batch gauge, so the test itself reads no blob meanwhile)."""
    async with (
        running_daemon(config) as daemon,
        await SidecarClient.connect(config.socket_path) as c,
    ):
        for b in batches:
            assert (await c.progress(kafka_progress(QID, b, **progress))).applied
            await eventually(lambda b=b: sample(daemon, BATCH, query=NAME) == b)  # type: ignore[misc]


async def read_doc(config: Config) -> CheckpointDocument:
    async with blob_reader(config) as store:
        doc = await store.read(QID)
    assert doc is not None
    return doc


def blob_requests(azurite: Azurite, config: Config, method: str) -> int:
    """Requests of ``method`` on the query's blob (not on its lease), from Azurite's log."""
    url = f"/{config.container}/{config.namespace}/{QID}.json"
    with open(azurite.dir / "debug.log", errors="replace") as log:
        return sum(
            1
            for line in log
            if f"RequestMethod={method}" in line
            and url + " " in line  # the document itself: not ?comp=lease, ?comp=metadata
        )


def test_history_is_kept_newest_first_bounded_in_the_same_single_write(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    config = make_config(count_threshold=1, history_size=5)
    anyio.run(flush_each, config, range(12))
    doc = anyio.run(read_doc, config)
    assert doc.schema_version == 2 and doc.batch_id == 11
    assert [h.batch_id for h in doc.history] == [10, 9, 8, 7, 6]  # newest first, 5 kept
    assert [values(h.end_offsets) for h in doc.history] == [(end_of(b),) for b in range(10, 5, -1)]
    assert [h.timestamp for h in doc.history] == [
        kafka_progress(QID, b)["timestamp"] for b in range(10, 5, -1)
    ]
    written = [doc.written_at, *(h.written_at for h in doc.history)]
    assert written == sorted(written, reverse=True)
    # One write per flush, and no read for the history: it came from the document this
    # daemon had just written. No read before the first write either: the namespace's listing
    # had no blob of the query (no floor to read), and the lease's create (If-None-Match: *)
    # told the version of the empty blob it made, which the first write names. The one read
    # is this test's.
    assert azurite.blob_writes(config.container, f"{config.namespace}/{QID}.json") == 12
    assert blob_requests(azurite, config, "GET") == 1
    # What get / starting-offsets return by default is the latest checkpoint, as before.
    assert "history" not in ckpt.as_builtins(doc.checkpoint())


def test_a_new_daemon_carries_the_history_it_reads_and_size_0_drops_it(
    make_config: ConfigFactory,
) -> None:
    anyio.run(flush_each, make_config(count_threshold=1, history_size=3), range(4))
    # A new daemon (a new lease owner) reads the blob after acquiring and carries on.
    anyio.run(flush_each, make_config(count_threshold=1, history_size=3), range(4, 6))
    config = make_config(count_threshold=1, history_size=3)
    assert [h.batch_id for h in anyio.run(read_doc, config).history] == [4, 3, 2]
    anyio.run(flush_each, make_config(count_threshold=1, history_size=0), range(6, 8))
    doc = anyio.run(read_doc, config)
    assert doc.batch_id == 7 and doc.history == ()
    assert len(doc.retained()) == 1


def test_a_history_too_wide_for_the_cap_is_thinned_oldest_first() -> None:
    """Pure: carry_history under HISTORY_MAX_BYTES, for a query of 2000 partitions."""
    writer = Writer("h", 1, "i")

    def doc(batch: int, history: tuple[HistoryEntry, ...]) -> CheckpointDocument:
        progress = kafka_progress(QID, batch, partitions=2000, per_partition=10**9)
        cp = checkpoint_from(progress)
        return CheckpointDocument.of(cp, writer, history)

    previous, thinned = doc(0, ()), 0
    for batch in range(1, 30):
        history, thinned = carry_history(previous, batch, 20)
        previous = doc(batch, history)
    entry = len(msgspec.json.encode(previous.history[0]))
    assert entry > 36_000  # ~18 bytes per partition
    assert len(previous.history) == HISTORY_MAX_BYTES // (entry + 1)
    assert thinned == 1  # each write drops the one entry that no longer fits
    assert len(msgspec.json.encode(previous.history)) <= HISTORY_MAX_BYTES
    assert [h.batch_id for h in previous.history] == list(range(28, 28 - len(previous.history), -1))


V1_DOC: dict[str, Any] = {
    "query_id": QID,
    "run_id": "0e1c3f52-9d2b-4f7e-a3c4-5d6e7f809a1b",
    "name": NAME,
    "batch_id": 2,
    "timestamp": "2026-11-21T10:00:02.000Z",
    "sources": [
        {
            "description": "KafkaV2[Subscribe[events]]",
            "start_offset": {"events": {"0": 200, "1": 201, "2": 202}},
            "end_offset": {"events": {"0": 300, "1": 301, "2": 302}},
            "latest_offset": {"events": {"0": 305, "1": 306, "2": 307}},
            "num_input_rows": 300,
        }
    ],
    "schema_version": 1,
    "checkpoint_id": "3239074033c044328e2d947bb9f30d86",
    "writer": {"host": "driver-pod-7f9c", "pid": 12, "instance_id": "b99f2f34"},
    "written_at": "2026-11-21T10:00:02.512+00:00",
}


class V1Source(msgspec.Struct, frozen=True):
    """A source as version 1 declared it: offsets decoded into JSON values."""

    description: str
    start_offset: Any
    end_offset: Any
    latest_offset: Any
    num_input_rows: int | None = None


class V1Document(msgspec.Struct, frozen=True):
    """The document as version 1 of checkpoint-sidecar declared it (its reader, after a
    rollback)."""

    query_id: str
    run_id: str
    name: str | None
    batch_id: int
    timestamp: str
    sources: list[V1Source]
    schema_version: int
    checkpoint_id: str
    writer: Writer
    written_at: str


async def put_blob(config: Config, body: bytes) -> None:
    """Write a blob by hand, as the previous version left it."""
    store = BlobStore(config)
    try:
        await store.ensure_container()
        await store.create_if_absent(QID)
        await store.acquire_lease(QID, "11111111-2222-3333-4444-555555555555", 15)
        version = (await store.read_stored(QID)).version
        assert version is not None
        await store.write(
            QID,
            body,
            lease_id="11111111-2222-3333-4444-555555555555",
            query_name=NAME,
            version=version,
        )
        await store.release_lease(QID, "11111111-2222-3333-4444-555555555555")
    finally:
        await store.aclose()


def blob_env(config: Config) -> dict[str, str]:
    """The settings the read side needs: where the blobs are."""
    return {
        "AZURE_STORAGE_CONNECTION_STRING": config.azure_connection_string or "",
        "SIDECAR_CONTAINER": config.container,
        "SIDECAR_NAMESPACE": config.namespace,
    }


def cli(config: Config, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), **blob_env(config)}
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_version_1_blobs_are_read_and_carried_into_the_history_and_v1_reads_version_2(
    make_config: ConfigFactory,
) -> None:
    config = make_config(count_threshold=1)
    anyio.run(put_blob, config, json.dumps(V1_DOC).encode())
    shown = json.loads(cli(config, "show", NAME, "--json").stdout)
    assert shown["schema_version"] == 1 and shown["history"] == []
    listed = cli(config, "history", NAME, "--json")
    assert listed.returncode == 0, listed.stderr
    assert [c["batch_id"] for c in json.loads(listed.stdout)["checkpoints"]] == [2]
    resume = cli(config, "starting-offsets", NAME, "--batch", "2")
    assert json.loads(resume.stdout) == V1_DOC["sources"][0]["end_offset"]

    anyio.run(flush_each, config, range(3, 5))  # the daemon reads the v1 blob, writes v2
    doc = anyio.run(read_doc, config)
    assert (doc.schema_version, doc.batch_id) == (2, 4)
    assert [h.batch_id for h in doc.history] == [3, 2]
    entry = doc.history[1]
    assert (entry.batch_id, entry.timestamp, entry.written_at) == (
        2,
        V1_DOC["timestamp"],
        V1_DOC["written_at"],
    )
    assert values(entry.end_offsets) == (end_of(2),)
    # Rolled back, version 1 reads the version 2 document (it ignores the history).
    body = encode_document(doc)
    old = msgspec.json.decode(body, type=V1Document)
    assert (old.batch_id, old.sources) == (4, [V1Source(**ckpt.as_builtins(doc)["sources"][0])])
    assert old.sources[0].end_offset == end_of(4)
    # A version this one does not know is refused, never overwritten.
    newer = encode_document(msgspec.structs.replace(doc, schema_version=3))
    with pytest.raises(CorruptRecord, match="schema version 3"):
        decode_document(newer)


def test_rewind_by_batch_and_by_time_through_the_cli_and_the_bridge(
    make_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch, short_tmp: Path
) -> None:
    config = make_config(count_threshold=1, history_size=4)
    anyio.run(flush_each, config, range(10, 17))  # retains 16 (current), 15, 14, 13, 12

    table = cli(config, "history", NAME)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == f"query {NAME} ({QID}): 5 checkpoint(s) retained, newest first"
    assert lines[1].split() == ["BATCH", "SPARK", "TIMESTAMP", "WRITTEN", "AT", "END", "OFFSETS"]
    assert [row.split()[0] for row in lines[2:-1]] == ["16", "15", "14", "13", "12"]
    assert lines[-1] == (
        "position not reported (a listener that cannot tell; Spark's default is committed); "
        "stateless"
    )
    assert lines[2].endswith(f"{json.dumps(end_of(16), separators=(',', ':'))} (current)")
    got = json.loads(cli(config, "history", QID, "--json").stdout)
    assert (got["query_id"], got["name"], got["schema_version"]) == (QID, NAME, 2)
    assert [(c["batch_id"], c["current"]) for c in got["checkpoints"]] == [
        (16, True),
        (15, False),
        (14, False),
        (13, False),
        (12, False),
    ]
    assert got["checkpoints"][3]["end_offsets"] == [end_of(13)]
    assert got["checkpoints"][3]["timestamp"] == "2026-11-21T10:00:13.000Z"

    def offsets(*args: str) -> Any:
        result = cli(config, "starting-offsets", NAME, *args)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    assert offsets() == end_of(16)  # the default is unchanged: the latest checkpoint
    assert offsets("--batch", "13") == end_of(13)
    assert offsets("--batch", "16") == end_of(16)
    # Batch 13 triggered at 10:00:13: "before 10:00:14" is batch 13, "before 10:00:13" is 12.
    assert offsets("--before", "2026-11-21T10:00:14Z") == end_of(13)
    assert offsets("--before", "2026-11-21T10:00:13") == end_of(12)  # no zone: UTC
    assert offsets("--before", "2026-11-21T11:00:13+01:00") == end_of(12)
    assert offsets("--before", "2030-01-01T00:00:00Z") == end_of(16)
    assert offsets("--batch", "14", "--partitions", "events=4", "--missing", "latest") == {
        "events": {**end_of(14)["events"], "3": -1}
    }

    gone = cli(config, "starting-offsets", NAME, "--batch", "11")
    assert gone.returncode == 1
    assert "batch 11 is not retained for query 'orders-to-delta'" in gone.stderr
    assert "5 checkpoint(s) retained: batches 16, 15, 14, 13, 12" in gone.stderr
    early = cli(config, "starting-offsets", NAME, "--before", "2026-11-21T10:00:12Z")
    assert (
        early.returncode == 1 and "no checkpoint before 2026-11-21T10:00:12+00:00" in early.stderr
    )
    bad = cli(config, "starting-offsets", NAME, "--before", "yesterday")
    assert bad.returncode == 1 and "'yesterday' is not an ISO 8601 time" in bad.stderr
    both = cli(config, "starting-offsets", NAME, "--batch", "3", "--before", "2026-11-21")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr

    # The bridge: the same, read from the blobs with the daemon's environment variables.
    for key, value in blob_env(config).items():
        monkeypatch.setenv(key, value)
    socket_path = str(short_tmp / "none.sock")  # no daemon there
    assert json.loads(spark_bridge.starting_offsets(NAME, socket_path, batch=14)) == end_of(14)
    got_before = spark_bridge.starting_offsets(NAME, socket_path, before="2026-11-21T10:00:13Z")
    assert json.loads(got_before) == end_of(12)
    with pytest.raises(ResumeError, match=r"batch 3 is not retained .* batches 16, 15, 14"):
        spark_bridge.starting_offsets(NAME, socket_path, batch=3)
    with pytest.raises(ResumeError, match="batch or before, not both"):
        spark_bridge.starting_offsets(NAME, socket_path, batch=14, before="2026-11-21")
