"""Records that cannot be read — a query's Redis hash or its blob, written by another version,
cut short, or edited by hand — against real redis-server and Azurite.

A damaged record is quarantined: left exactly as it is, not flushed, counted once in
``checkpoint_sidecar_bad_records_total{where}`` and logged once, naming it; every other query
keeps flushing and the daemon stays up (also across a restart). A newer valid update of the
query replaces a damaged Redis record; the read side (``list``, ``show``,
``starting-offsets``, ``get``, ``load_checkpoint``) says which record is unreadable instead
of crashing or skipping it.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
import redis.asyncio as aioredis
from azure.storage.blob.aio import BlobLeaseClient, BlobServiceClient

import spark_bridge
from sidecar.buffer.keys import Keys
from sidecar.config import Config
from sidecar.flush import blob_state
from sidecar.model import checkpoint as ckpt
from sidecar.model.document import CheckpointDocument, Writer, encode_document
from sidecar.ops.client import SidecarClient
from tests.helpers import (
    ConfigFactory,
    blob_reader,
    checkpoint_of,
    cli,
    eventually,
    metric_value,
    post_progress,
    running_daemon,
    sample,
    seed,
    wait_blob,
    wait_blob_batch,
    wait_for,
)
from tests.services import DaemonProcess
from tests.sparkshapes import kafka_progress

BAD = "c0aa0000-0000-4000-8000-00000000baad"
GOOD = "c0aa0000-0000-4000-8000-000000009009"
OTHER = "c0aa0000-0000-4000-8000-000000000123"
FLUSH_CHECKS = "checkpoint_sidecar_flush_checks_total"
BAD_RECORDS = "checkpoint_sidecar_bad_records_total"
FLUSHES = "checkpoint_sidecar_flushes_total"
#: A record cut short: what a partial write or a careless edit leaves.
CUT_SHORT = b'{"query_id":"c0aa0000-0000-4000-8000-00000000baad","run_id":"r","na'
#: Not this version's blob document (a future schema, say).
FOREIGN_DOC = b'{"schema": 9, "position": {"events": {"0": 7}}}'
WRITER = Writer(host="test", pid=1, instance_id="test")


async def damage(redis_url: str, key: str, **fields: bytes) -> dict[bytes, bytes]:
    """Overwrite fields of a query's hash; the whole hash afterwards."""
    r = aioredis.Redis.from_url(redis_url)
    try:
        await r.hset(key, mapping=cast(Any, fields))
    finally:
        await r.aclose()
    return await record(redis_url, key)


async def record(redis_url: str, key: str) -> dict[bytes, bytes]:
    r = aioredis.Redis.from_url(redis_url)
    try:
        return cast(dict[bytes, bytes], await r.hgetall(key))
    finally:
        await r.aclose()


async def upload(
    connection_string: str, container: str, blob: str, body: bytes, **metadata: str
) -> None:
    async with BlobServiceClient.from_connection_string(connection_string) as service:
        client = service.get_container_client(container)
        if not await client.exists():
            await client.create_container()
        await client.upload_blob(blob, body, overwrite=True, metadata=metadata or None)


async def blob_body(config: Config, blob: str) -> bytes:
    assert config.azure_connection_string is not None
    async with BlobServiceClient.from_connection_string(config.azure_connection_string) as svc:
        stream = await svc.get_blob_client(config.container, blob).download_blob()
        return await stream.readall()


def errors_naming(caplog: pytest.LogCaptureFixture, key: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if key in r.getMessage() and r.levelno >= logging.ERROR]


async def test_an_unreadable_checkpoint_is_quarantined_and_a_newer_batch_replaces_it(
    make_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "sidecar.flush.flusher")
    caplog.set_level(logging.INFO, "sidecar.flush.quarantine")  # "... is no longer unreadable"
    config = make_config(count_threshold=1)
    key = await seed(config.redis_url, config.namespace, BAD, 3, "bad")
    damaged = await damage(config.redis_url, key, checkpoint=CUT_SHORT)
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(GOOD, 1, name="good"))).applied
            await wait_blob_batch(store, GOOD, 1)  # the other query flushes
            await eventually(lambda: sample(daemon, BAD_RECORDS, where="redis") == 1)
            checks = sample(daemon, FLUSH_CHECKS)  # 10 more flush passes meet the record
            await eventually(lambda: sample(daemon, FLUSH_CHECKS) >= checks + 10)
            assert sample(daemon, BAD_RECORDS, where="redis") == 1
            assert sample(daemon, BAD_RECORDS, where="blob") == 0
            assert await record(config.redis_url, key) == damaged  # left exactly as it was
            assert await store.read(BAD) is None  # and not flushed
            [logged] = errors_naming(caplog, key)
            assert "DEL " + key in logged.getMessage()
            assert "is not a checkpoint record" in logged.getMessage()

            # `get` names the record instead of sending its bytes along
            for reply in (await c.get(BAD), await c.request("get", name="bad")):
                assert reply.error is not None and reply.error.code == "internal"
                assert key in reply.error.message

            # the record's batch_id (3) is readable: an older batch is still stale ...
            assert (await c.progress(kafka_progress(BAD, 2, name="bad"))).applied is False
            assert await record(config.redis_url, key) == damaged
            # ... and the next newer batch replaces the damaged record, which then flushes
            assert (await c.progress(kafka_progress(BAD, 4, name="bad"))).applied
            doc = await wait_blob_batch(store, BAD, 4)
            got = await c.get(BAD)
        assert doc.batch_id == 4
        assert got.checkpoint is not None and got.checkpoint["batch_id"] == 4
        assert sample(daemon, BAD_RECORDS, where="redis") == 1
        assert f"redis {key} is no longer unreadable" in caplog.text
    assert len(errors_naming(caplog, key)) == 1


@pytest.mark.parametrize(
    ("field", "value", "repair"),
    [
        # any valid update replaces a record whose batch id cannot be read
        ("batch_id", b"3x", 1),
        # a counter that is not an integer must not fail the other queries' updates
        ("pending", b"one", 4),
        ("checkpoint", ckpt.encode(checkpoint_of(OTHER, 3, "other")), 4),
    ],
    ids=["batch_id-unreadable", "pending-not-an-integer", "another-querys-checkpoint"],
)
async def test_a_damaged_field_is_quarantined_and_the_next_update_repairs_it(
    make_config: ConfigFactory, field: str, value: bytes, repair: int
) -> None:
    config = make_config(count_threshold=1)
    key = await seed(config.redis_url, config.namespace, BAD, 3, "bad")
    damaged = await damage(config.redis_url, key, **{field: value})
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        await eventually(lambda: sample(daemon, BAD_RECORDS, where="redis") == 1)
        assert await record(config.redis_url, key) == damaged
        async with await SidecarClient.connect(config.socket_path) as c:
            # one Redis call for both (the coalescer batches one read's updates)
            replies = await c.send_many(
                [
                    ("progress", {"progress": kafka_progress(BAD, repair, name="bad")}),
                    ("progress", {"progress": kafka_progress(GOOD, 1, name="good")}),
                ]
            )
            assert [r.applied for r in replies] == [True, True]
            await wait_blob_batch(store, GOOD, 1)
            doc = await wait_blob_batch(store, BAD, repair)
        assert doc.query_id == BAD and doc.batch_id == repair
        assert sample(daemon, BAD_RECORDS, where="redis") == 1
        assert await store.read(OTHER) is None


def scrape_metrics(daemon: DaemonProcess) -> str:
    with urllib.request.urlopen(f"{daemon.admin_url}/metrics", timeout=5) as resp:
        return cast(bytes, resp.read()).decode()


def counted(daemon: DaemonProcess) -> bool:
    return metric_value(scrape_metrics(daemon), BAD_RECORDS, where="redis") == 1


def test_a_daemon_restarted_with_an_unreadable_record_starts_ready_and_keeps_flushing(
    daemon_env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path
) -> None:
    env = {**daemon_env, "SIDECAR_COUNT_THRESHOLD": "1"}
    url, namespace = env["SIDECAR_REDIS_URL"], env["SIDECAR_NAMESPACE"]
    key = anyio.run(seed, url, namespace, BAD, 3, "bad")
    damaged = anyio.run(lambda: damage(url, key, checkpoint=CUT_SHORT))
    for run in range(2):  # the record stays; a restart must not crash on it either
        daemon = DaemonProcess(env, short_tmp / f"run{run}.log")
        procs.append(daemon)
        daemon.start()  # ready: /readyz answers 200
        good = kafka_progress(GOOD, 10 + run, name="good")
        assert post_progress(daemon.socket_path, good).applied
        wait_blob(env, GOOD, 10 + run)

        wait_for(functools.partial(counted, daemon), 10, "the unreadable record to be counted")
        # a quarantined record does not make the daemon unready
        assert (daemon.readyz() or (0, ""))[0] == 200
        with pytest.raises(spark_bridge.ResumeError, match="is not a checkpoint record") as err:
            spark_bridge.load_checkpoint(BAD, daemon.socket_path)
        assert key in str(err.value)
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
        errors = [line for line in daemon.log().splitlines() if key in line and "ERROR" in line]
        assert len(errors) == 1, errors
    assert anyio.run(record, url, key) == damaged


async def test_an_unreadable_blob_is_counted_and_logged_once_and_deleting_it_lets_it_be_rewritten(
    make_config: ConfigFactory, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Retry a failed flush within 0.2 s (not 30 s), so many retries meet the blob.
    monkeypatch.setattr(blob_state, "RETRY_BASE_S", 0.1)
    monkeypatch.setattr(blob_state, "RETRY_CAP_S", 0.2)
    caplog.set_level(logging.INFO, "sidecar.flush.flusher")
    caplog.set_level(logging.INFO, "sidecar.flush.quarantine")  # "... is no longer unreadable"
    config = make_config(count_threshold=1)
    assert config.azure_connection_string is not None
    blob = f"{config.namespace}/{BAD}.json"
    await upload(config.azure_connection_string, config.container, blob, FOREIGN_DOC)
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(BAD, 1, name="bad"))).applied
            assert (await c.progress(kafka_progress(GOOD, 1, name="good"))).applied
        await wait_blob_batch(store, GOOD, 1)
        await eventually(lambda: sample(daemon, FLUSHES, result="error") >= 5)
        assert sample(daemon, BAD_RECORDS, where="blob") == 1
        assert sample(daemon, BAD_RECORDS, where="redis") == 0
        [logged] = errors_naming(caplog, blob)
        assert "is not a checkpoint document" in logged.getMessage()
        assert "never overwrites a blob it cannot read" in logged.getMessage()
        assert await blob_body(config, blob) == FOREIGN_DOC  # never overwritten
        key = Keys(config.namespace).query(BAD)
        assert (await record(config.redis_url, key))[b"pending"] == b"1"  # kept in Redis

        # The operator deletes the blob (breaking the daemon's lease on it first): the
        # daemon writes the query's checkpoint from Redis again.
        async with BlobServiceClient.from_connection_string(config.azure_connection_string) as svc:
            client = svc.get_blob_client(config.container, blob)
            await BlobLeaseClient(client).break_lease(lease_break_period=0)
            await client.delete_blob()
        doc = await wait_blob_batch(store, BAD, 1)
    assert doc.query_id == BAD
    assert f"blob {blob} is no longer unreadable" in caplog.text
    assert len(errors_naming(caplog, blob)) == 1


async def test_get_names_an_unreadable_blob_and_a_stop_does_not_wait_on_it(
    make_config: ConfigFactory,
) -> None:
    config = make_config(count_threshold=1, shutdown_grace_s=10)
    assert config.azure_connection_string is not None
    blob = f"{config.namespace}/{BAD}.json"
    await upload(
        config.azure_connection_string,
        config.container,
        blob,
        FOREIGN_DOC,
        query_id=BAD,
        query_name="bad",
    )
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            # Redis has nothing of the query: the daemon answers from the blob, by id or name
            for reply in (await c.get(BAD), await c.request("get", name="bad")):
                assert reply.error is not None and reply.error.code == "internal"
                assert f"blob {blob} is not a checkpoint document" in reply.error.message
                assert "never overwrites" in reply.error.message
            assert (await c.get(GOOD)).checkpoint is None  # an unknown query is no error
            assert (await c.progress(kafka_progress(BAD, 1, name="bad"))).applied
        await eventually(lambda: sample(daemon, BAD_RECORDS, where="blob") == 1)
        stopping = time.monotonic()
    # The final flush does not retry the quarantined blob until the grace period (10 s) ends.
    assert time.monotonic() - stopping < 5
    assert await blob_body(config, blob) == FOREIGN_DOC


def test_list_show_starting_offsets_and_load_checkpoint_report_an_unreadable_blob(
    daemon_env: dict[str, str], short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = daemon_env
    connection, container = env["AZURE_STORAGE_CONNECTION_STRING"], env["SIDECAR_CONTAINER"]
    namespace = env["SIDECAR_NAMESPACE"]
    good = CheckpointDocument.of(checkpoint_of(GOOD, 5, "good"), WRITER)
    bad_blob = f"{namespace}/{BAD}.json"
    anyio.run(
        lambda: upload(connection, container, f"{namespace}/{GOOD}.json", encode_document(good))
    )
    anyio.run(lambda: upload(connection, container, bad_blob, CUT_SHORT, query_name="bad"))

    listed = cli(env, "list")
    assert listed.returncode == 0, listed.stderr
    rows = listed.stdout.splitlines()
    [bad_row] = [r for r in rows if BAD in r]
    assert bad_row.split()[:3] == ["bad", BAD, "?"]
    assert f"UNREADABLE: blob {bad_blob} is not a checkpoint document" in bad_row
    [good_row] = [r for r in rows if GOOD in r]
    assert good_row.split()[:3] == ["good", GOOD, "5"]

    as_json = {r["blob"]: r for r in json.loads(cli(env, "list", "--json").stdout)}
    assert as_json[bad_blob]["checkpoint"] is None
    assert as_json[bad_blob]["unreadable"].startswith("is not a checkpoint document")
    assert as_json[f"{namespace}/{GOOD}.json"]["unreadable"] is None

    for args in (("show", BAD), ("show", "bad"), ("starting-offsets", BAD)):
        result = cli(env, *args)
        assert result.returncode == 1, (args, result.stdout)
        assert f"blob {bad_blob} is not a checkpoint document" in result.stderr, args
        assert "Traceback" not in result.stderr
    assert cli(env, "show", GOOD).returncode == 0

    # The Spark side, with no daemon running: straight to the blobs.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    nowhere = str(short_tmp / "no-daemon.sock")
    for query in (BAD, "bad"):
        with pytest.raises(spark_bridge.ResumeError, match="is not a checkpoint document") as err:
            spark_bridge.load_checkpoint(query, nowhere)
        assert bad_blob in str(err.value)
    assert spark_bridge.load_checkpoint(GOOD, nowhere)["batch_id"] == 5
