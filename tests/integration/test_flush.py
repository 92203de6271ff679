"""Flushing to blobs under leases, against real redis-server and Azurite.

Write counts come from Azurite's own request log (``Azurite.blob_writes``), not from the
daemon's counters; blob contents are read back with the Azure SDK.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import cast

import anyio
import msgspec
import pytest
import redis.asyncio as aioredis
from azure.core.exceptions import HttpResponseError
from azure.storage.blob.aio import BlobLeaseClient, BlobServiceClient

from sidecar.buffer.keys import Keys
from sidecar.buffer.redis_buffer import Outcome, PendingQuery, RedisBuffer
from sidecar.config import Config
from sidecar.daemon.app import Daemon
from sidecar.model import checkpoint as ckpt
from sidecar.model.document import decode_document
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore
from tests.helpers import (
    ConfigFactory,
    blob_reader,
    checkpoint_of,
    eventually,
    metric_value,
    running_daemon,
    sample,
    scrape,
    seed,
    wait_blob_batch,
)
from tests.services import Azurite, RedisServer
from tests.sparkshapes import kafka_progress, rate_progress

FLUSH_CHECKS = "checkpoint_sidecar_flush_checks_total"
QID = "5f2c9a41-7a0e-4c7b-9d51-0f6a8e2b3c10"
FLUSHES = "checkpoint_sidecar_flushes_total"
PENDING = "checkpoint_sidecar_pending_updates"
AGE = "checkpoint_sidecar_checkpoint_age_seconds"


async def blob_batch(store: BlobStore, query_id: str = QID) -> int | None:
    doc = await store.read(query_id)
    return doc.batch_id if doc else None


def writes(azurite: Azurite, config: Config, query_id: str = QID) -> int:
    return azurite.blob_writes(config.container, f"{config.namespace}/{query_id}.json")


async def redis_field(config: Config, field: str, query_id: str = QID) -> bytes | None:
    r = aioredis.Redis.from_url(config.redis_url)
    try:
        value = await r.hget(Keys(config.namespace).query(query_id), field)
        # redis-py types replies as bytes | str; without decode_responses they are bytes.
        return cast(bytes | None, value)
    finally:
        await r.aclose()


async def metrics(daemon: Daemon) -> str:
    return (await anyio.to_thread.run_sync(scrape, daemon))[1]


async def a_pass_saw_pending(daemon: Daemon, pending: int, label: str = "orders-to-delta") -> None:
    """Wait until a flush pass has seen ``pending`` (> 0) updates of the query, and for the
    pass after it: whatever the first one decided to write has been written by then."""
    await eventually(lambda: sample(daemon, PENDING, query=label) == pending)
    # A pass sets the age of the oldest pending update before it flushes anything, and the
    # next pass starts only after the previous one's flushes: a new age is a new pass.
    age = sample(daemon, AGE, query=label)
    await eventually(lambda: sample(daemon, AGE, query=label) != age)


async def test_count_threshold_writes_exactly_once_per_threshold(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    config = make_config(count_threshold=5, time_threshold_s=3600)
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            for group in range(4):
                batches = range(group * 5, group * 5 + 5)
                replies = await c.send_many(
                    [("progress", {"progress": kafka_progress(QID, b)}) for b in batches]
                )
                assert all(r.applied for r in replies)
                await wait_blob_batch(store, QID, batches[-1])
            for b in range(20, 23):  # below the threshold: stays in Redis
                assert (await c.progress(kafka_progress(QID, b))).applied
        await a_pass_saw_pending(daemon, 3)
        assert await blob_batch(store) == 19
        assert await redis_field(config, "pending") == b"3"
        assert await redis_field(config, "flushed_batch_id") == b"19"
        text = await metrics(daemon)
        await eventually(lambda: writes(azurite, config) == 4)
    assert metric_value(text, "checkpoint_sidecar_flushes_total", result="ok") == 4
    assert metric_value(text, "checkpoint_sidecar_pending_updates", query="orders-to-delta") == 3
    assert (
        metric_value(text, "checkpoint_sidecar_checkpoint_batch_id", query="orders-to-delta") == 19
    )
    assert metric_value(text, "checkpoint_sidecar_lease_held", query="orders-to-delta") == 1
    assert metric_value(text, "checkpoint_sidecar_flush_check_seconds") > 0  # the last check's
    assert writes(azurite, config) == 5, "the graceful stop flushes the 3 pending updates once"


async def test_time_threshold_writes_once_when_the_oldest_update_is_old_enough(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    config = make_config(count_threshold=1000, time_threshold_s=1.0)
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            for b in range(3):
                assert (await c.progress(rate_progress(QID, b))).applied
            assert await blob_batch(store) is None  # not yet: neither threshold reached
            doc = await wait_blob_batch(store, QID, 2)
        # A write that must not happen has no event to wait for: let the flush checks of
        # the time threshold once more (1 s: 20 checks, every 0.05 s) find nothing pending.
        checks = sample(daemon, "checkpoint_sidecar_flush_checks_total")
        await eventually(
            lambda: sample(daemon, "checkpoint_sidecar_flush_checks_total") >= checks + 30
        )
        assert writes(azurite, config) == 1
        assert await redis_field(config, "pending") == b"0"
    assert doc.batch_id == 2
    assert ckpt.offset_value(doc.sources[0].end_offset) == 30


async def test_blob_document_holds_offsets_and_writer(make_config: ConfigFactory) -> None:
    config = make_config(count_threshold=1)
    progress = kafka_progress(QID, 41, partitions=4)
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress)).applied
        doc = await wait_blob_batch(store, QID, 41)
        assert doc.writer.instance_id == daemon.instance_id
    assert doc.schema_version == 2
    assert (doc.query_id, doc.run_id, doc.name) == (QID, progress["runId"], progress["name"])
    assert doc.timestamp == progress["timestamp"]
    source = progress["sources"][0]
    assert ckpt.offset_value(doc.sources[0].end_offset) == source["endOffset"]
    assert ckpt.offset_value(doc.sources[0].start_offset) == source["startOffset"]
    assert ckpt.offset_value(doc.sources[0].latest_offset) == source["latestOffset"]
    assert doc.checkpoint_id and doc.written_at


async def test_blob_is_leased_while_running_and_free_after_stop(
    make_config: ConfigFactory,
) -> None:
    config = make_config(count_threshold=1)
    async with blob_reader(config) as store:
        async with running_daemon(config), await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(rate_progress(QID, 1))).applied
            await wait_blob_batch(store, QID, 1)
            assert await store.lease_state(QID) == "leased"
        assert await store.lease_state(QID) == "available"


async def test_a_write_without_the_lease_is_refused_by_the_store(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    config = make_config(count_threshold=1)
    async with running_daemon(config), blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(rate_progress(QID, 7))).applied
        await wait_blob_batch(store, QID, 7)
        service = BlobServiceClient.from_connection_string(azurite.connection_string)
        async with service:
            blob = service.get_blob_client(config.container, f"{config.namespace}/{QID}.json")
            with pytest.raises(HttpResponseError) as refused:
                await blob.upload_blob(b'{"batch_id": 0}', overwrite=True)
        assert refused.value.status_code == 412
        assert await blob_batch(store) == 7


async def test_final_flush_on_stop_and_ack_count_below_threshold(
    make_config: ConfigFactory,
) -> None:
    config = make_config(count_threshold=1000, time_threshold_s=3600)
    async with blob_reader(config) as store:
        async with running_daemon(config), await SidecarClient.connect(config.socket_path) as c:
            for b in range(5):
                assert (await c.progress(kafka_progress(QID, b))).applied
            assert await blob_batch(store) is None
        assert await blob_batch(store) == 4
        assert await store.lease_state(QID) == "available"
    assert await redis_field(config, "pending") == b"0"


async def test_get_falls_back_to_the_blob_when_redis_has_nothing(
    make_config: ConfigFactory,
) -> None:
    config = make_config(count_threshold=1)
    async with running_daemon(config), blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(QID, 12))).applied
            await wait_blob_batch(store, QID, 12)
            r = aioredis.Redis.from_url(config.redis_url)
            await r.delete(Keys(config.namespace).query(QID))  # Redis lost its data
            await r.aclose()
            got = await c.get(QID)
    assert got.checkpoint is not None
    assert got.checkpoint["batch_id"] == 12
    assert got.checkpoint["sources"][0]["end_offset"] == {
        "events": {"0": 1300, "1": 1301, "2": 1302}
    }


async def test_ack_mode_blob_replies_only_once_the_blob_holds_the_batch(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    config = make_config(ack_mode="blob", count_threshold=1000, time_threshold_s=3600)
    async with running_daemon(config), blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            for b in range(3):
                reply = await c.progress(kafka_progress(QID, b))
                assert reply.ok and reply.applied
                assert await blob_batch(store) == b  # already durable when acknowledged
            # group commit: several acks waiting on one query are answered by one write
            before = writes(azurite, config)
            replies = await c.send_many(
                [("progress", {"progress": kafka_progress(QID, b)}) for b in range(3, 8)]
            )
            assert [r.applied for r in replies] == [True] * 5
            assert await blob_batch(store) == 7
            await eventually(lambda: writes(azurite, config) > before)
            assert writes(azurite, config) - before == 1


async def test_ack_mode_blob_says_not_owner_at_once_when_the_lease_is_elsewhere(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    # Never an ack that waits for its timeout (60 s here): another daemon holds the lease, so
    # this one cannot make the update durable, and says so at once (retriable).
    config = make_config(ack_mode="blob", blob_ack_timeout_s=60)
    async with blob_reader(config) as store:
        await store.ensure_container()
        await store.create_if_absent(QID)
        await store.acquire_lease(QID, "00000000-0000-0000-0000-0000000000aa", 60)
        async with running_daemon(config), await SidecarClient.connect(config.socket_path) as c:
            with anyio.fail_after(10):
                reply = await c.progress(kafka_progress(QID, 3))
        await store.release_lease(QID, "00000000-0000-0000-0000-0000000000aa")
    assert reply.error is not None and reply.error.code == "not_owner"
    assert "another daemon holds the lease" in reply.error.message
    assert await redis_field(config, "batch_id") == b"3"  # it is buffered all the same


async def test_two_daemons_one_owner_then_takeover_without_regression(
    make_config: ConfigFactory, short_tmp: Path
) -> None:
    # The owner flushes every 3 updates, the standby on every update: after the owner's
    # first flush, one more update makes only the standby try (and fail) to take the lease.
    first = make_config(count_threshold=3, time_threshold_s=3600, instance_id="owner")
    second = make_config(
        count_threshold=1, socket_path=str(short_tmp / "b.sock"), instance_id="standby"
    )
    async with blob_reader(first) as store, anyio.create_task_group() as tg:
        owner = Daemon(first)
        await tg.start(owner.run)
        async with await SidecarClient.connect(first.socket_path) as c:
            replies = await c.send_many(
                [("progress", {"progress": kafka_progress(QID, b)}) for b in range(3)]
            )
            assert all(r.applied for r in replies)
        doc = await wait_blob_batch(store, QID, 2)
        assert doc.writer.instance_id == owner.instance_id

        standby = Daemon(second)  # same namespace, same Redis, same container
        await tg.start(standby.run)
        async with await SidecarClient.connect(second.socket_path) as c:
            assert (await c.progress(kafka_progress(QID, 3))).applied
        await eventually(lambda: standby.flush.leases.not_owned() == ["orders-to-delta"])
        # the flush that found the lease elsewhere is counted once its lease check returned
        await eventually(lambda: sample(standby, FLUSHES, result="not_owned") >= 1)
        text = await metrics(standby)
        assert metric_value(text, "checkpoint_sidecar_lease_held", query="orders-to-delta") == 0
        status, body = await anyio.to_thread.run_sync(scrape, standby, "/readyz")
        assert status == 503 and "lease held by another daemon" in body
        assert "orders-to-delta (last written by" in body
        assert await blob_batch(store) == 2  # the standby wrote nothing

        owner.request_stop()  # final flush of batch 3, then it releases its lease
        await owner.stopped.wait()
        doc = await wait_blob_batch(store, QID, 3)
        assert doc.writer.instance_id == owner.instance_id
        async with await SidecarClient.connect(second.socket_path) as c:
            assert (await c.progress(kafka_progress(QID, 4))).applied
        doc = await wait_blob_batch(store, QID, 4)
        assert doc.writer.instance_id == standby.instance_id
        assert doc.batch_id == 4
        assert await store.lease_state(QID) == "leased"
        status, _ = await anyio.to_thread.run_sync(scrape, standby, "/readyz")
        assert status == 200
        standby.request_stop()


async def test_broken_lease_goes_not_owned_then_recovers(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    config = make_config(count_threshold=1)
    intruder = "00000000-0000-0000-0000-0000000000bb"
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(QID, 1))).applied
            await wait_blob_batch(store, QID, 1)

            service = BlobServiceClient.from_connection_string(azurite.connection_string)
            async with service:
                blob = service.get_blob_client(config.container, f"{config.namespace}/{QID}.json")
                await BlobLeaseClient(blob).break_lease(lease_break_period=0)
                await BlobLeaseClient(blob, lease_id=intruder).acquire(lease_duration=15)

                assert (await c.progress(kafka_progress(QID, 2))).applied
                await eventually(lambda: daemon.flush.leases.not_owned() == ["orders-to-delta"])
                # a later pass found the lease elsewhere and did not write either
                await eventually(lambda: sample(daemon, FLUSHES, result="not_owned") >= 1)
                assert await blob_batch(store) == 1  # nothing written without the lease
                text = await metrics(daemon)
                assert (
                    metric_value(text, "checkpoint_sidecar_lease_held", query="orders-to-delta")
                    == 0
                )
                assert (
                    metric_value(text, "checkpoint_sidecar_flushes_total", result="lease_lost") == 1
                )

                await BlobLeaseClient(blob, lease_id=intruder).release()
            await wait_blob_batch(store, QID, 2)  # re-acquired and caught up
            assert await store.lease_state(QID) == "leased"
        text = await metrics(daemon)
    assert metric_value(text, "checkpoint_sidecar_lease_held", query="orders-to-delta") == 1


@pytest.fixture
def own_azurite() -> Iterator[Azurite]:
    with Azurite() as server:
        yield server


async def test_store_outage_retries_and_loses_nothing(
    make_config: ConfigFactory, own_azurite: Azurite
) -> None:
    config = make_config(
        azure_connection_string=own_azurite.connection_string,
        count_threshold=1,
        write_timeout_s=1,
    )
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(QID, 1))).applied
            await wait_blob_batch(store, QID, 1)
            await anyio.to_thread.run_sync(own_azurite.stop)
            for b in range(2, 6):  # acknowledged from Redis while the store is down
                assert (await c.progress(kafka_progress(QID, b))).applied
            await eventually(lambda: sample(daemon, FLUSHES, result="error") >= 2)
            await anyio.to_thread.run_sync(own_azurite.start)
            doc = await wait_blob_batch(store, QID, 5)
    assert doc.batch_id == 5
    assert await redis_field(config, "pending") == b"0"


def test_rejects_monotonic_regression_in_blob(make_config: ConfigFactory) -> None:
    """The flusher never writes a batch older than the blob holds (e.g. another Redis)."""
    config = make_config(count_threshold=1)

    async def scenario() -> tuple[int | None, str]:
        async with blob_reader(config) as store:
            async with (
                running_daemon(config) as d,
                await SidecarClient.connect(config.socket_path) as c,
            ):
                assert (await c.progress(kafka_progress(QID, 9))).applied
                await wait_blob_batch(store, QID, 9)
            # Redis holds an older batch, pending (a restored or foreign buffer): the
            # daemon's ingest would refuse it (the blob is its floor), so it is put there.
            r = aioredis.Redis.from_url(config.redis_url)
            await r.delete(Keys(config.namespace).query(QID))
            await r.aclose()
            await seed(config.redis_url, config.namespace, QID, 4)
            async with running_daemon(config) as d:
                await eventually(lambda: sample(d, FLUSHES, result="skipped") == 1)
            return await blob_batch(store), d.instance_id

    batch, _ = anyio.run(scenario)
    assert batch == 9


async def test_an_error_retrying_cannot_fix_waits_the_full_cap_and_other_queries_flush(
    make_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A blob that is not a checkpoint document (written by something else) makes its
    query's flush fail with a non-retriable error: logged as an error, retried only after
    the backoff cap, while every other query keeps flushing."""
    config = make_config(count_threshold=1)
    other = QID[:-1] + "1"
    assert config.azure_connection_string is not None
    async with BlobServiceClient.from_connection_string(config.azure_connection_string) as svc:
        container = svc.get_container_client(config.container)
        if not await container.exists():
            await container.create_container()
        await container.upload_blob(f"{config.namespace}/{QID}.json", b"not a checkpoint doc")
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(rate_progress(QID, 1))).applied
            assert (await c.progress(rate_progress(other, 1))).applied
        await wait_blob_batch(store, other, 1)
        await eventually(lambda: "failed (retry 1 in 30.0s)" in caplog.text)
        text = await metrics(daemon)
    record = next(r for r in caplog.records if "failed (retry 1 in 30.0s)" in r.message)
    assert record.levelname == "ERROR" and "is not a checkpoint document" in record.message
    assert metric_value(text, "checkpoint_sidecar_flushes_total", result="error") == 1
    assert await redis_field(config, "checkpoint") is not None  # kept in Redis, not dropped


#: Offsets as a client may spell them: topics and partitions in no sorted order, spaces, a
#: number written "2.50". Stored byte for byte: the JSON text of each value, from its first to
#: its last byte (a decode and re-encode would sort nothing but would drop the spaces and
#: spell 2.5).
START = b'{"orders": {"10": 990, "2": 988,"1":987}, "audit":{"0":1}}'
ENDS = [b'{"orders": {"10": 1000, "2": 998,"1":997}, "audit":{"0":2}}', b'{"orders":{"10":1010}}']
LATEST = b'{ "orders" : { "10" : 1020 } }'
RATE = b"2.50"


def progress_text(batch: int, end: bytes) -> msgspec.Raw:
    """A Kafka progress whose offsets are the given JSON texts, plus a source with ``RATE``."""
    progress = kafka_progress(QID, batch)
    kafka = progress["sources"][0] | {"startOffset": "@S", "endOffset": "@E", "latestOffset": "@L"}
    rate = {"description": "RateStreamV2[x]", "endOffset": "@R"}
    progress["sources"] = [kafka, rate]
    body = msgspec.json.encode(progress)
    for mark, text in ((b"@S", START), (b"@E", end), (b"@L", LATEST), (b"@R", RATE)):
        body = body.replace(b'"' + mark + b'"', text)
    return msgspec.Raw(body)


async def test_offsets_reach_redis_and_the_blob_byte_for_byte_as_the_client_sent_them(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    config = make_config(count_threshold=1)
    async with running_daemon(config), blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            for batch, end in enumerate(ENDS):
                assert (await c.request("progress", progress=progress_text(batch, end))).applied
                await wait_blob_batch(store, QID, batch)
            record = await redis_field(config, "checkpoint")
            got = await c.get(QID)
        service = BlobServiceClient.from_connection_string(azurite.connection_string)
        async with service:
            blob = service.get_blob_client(config.container, f"{config.namespace}/{QID}.json")
            body = await (await blob.download_blob()).readall()
    assert record is not None
    for stored in (record, body):
        assert b'"start_offset":' + START + b',"end_offset":' + ENDS[1] in stored
        assert b'"latest_offset":' + LATEST in stored
        assert b'"end_offset":' + RATE + b',"latest_offset":null' in stored
    assert b'"end_offsets":[' + ENDS[0] + b"," + RATE + b"]" in body  # history: as sent too
    # Readers get the values: the reply to get, the document's offsets decoded on demand.
    assert got.checkpoint is not None
    assert got.checkpoint["sources"][0]["end_offset"] == {"orders": {"10": 1010}}
    assert got.checkpoint["sources"][1]["end_offset"] == 2.5
    doc = decode_document(body)
    assert doc is not None and ckpt.offset_value(doc.history[0].end_offsets[0])["audit"] == {"0": 2}


async def test_marking_a_flush_never_clears_a_batch_newer_than_the_blobs(
    redis_server: RedisServer, namespace: str
) -> None:
    # Redis lost the record while its batch 1 was being flushed, and an update re-created it
    # with batch 2: its counters restarted, so its version equals the flushed row's. The mark
    # of batch 1 must leave batch 2 pending (the real scripts, on a real redis-server).
    buffer = RedisBuffer(redis_server.url, namespace)
    try:
        assert await buffer.apply([checkpoint_of(QID, 1)]) == [Outcome.APPLIED]
        (row,) = (await buffer.snapshot()).queries
        r = aioredis.Redis.from_url(redis_server.url)
        await r.delete(buffer.keys.query(QID), buffer.keys.pending)
        await r.aclose()
        assert await buffer.apply([checkpoint_of(QID, 2)]) == [Outcome.APPLIED]
        assert await buffer.mark_flushed(row, 1, None) == 1  # still owed a write
        (left,) = (await buffer.snapshot()).queries
        assert (left.batch_id, left.pending, left.flushed_batch_id) == (2, 1, 1)
        assert await buffer.mark_flushed(left, 2, None) == 0  # that write clears it
        assert (await buffer.snapshot()).queries == []
    finally:
        await buffer.aclose()


async def test_the_rows_an_apply_returns_are_what_a_snapshot_reads_right_after(
    redis_server: RedisServer, namespace: str
) -> None:
    # Blob ack mode flushes from these rows instead of reading Redis again: each must be the
    # snapshot's row of that moment, field for field (the real scripts, a real redis-server).
    buffer = RedisBuffer(redis_server.url, namespace)
    other = "7d0e4b8a-2c51-4f3e-9a6b-1e8d5c2f7a90"
    try:
        first = await buffer.apply_rows([checkpoint_of(QID, 1), checkpoint_of(other, 7)])
        assert first.outcomes == [Outcome.APPLIED, Outcome.APPLIED]
        snap = await buffer.snapshot()

        def fields(r: PendingQuery) -> tuple[object, ...]:  # all but the time it was read
            return (r.query_id, r.pending, r.first_pending_ms, r.version, r.batch_id,
                    r.checkpoint, r.flushed_batch_id)  # fmt: skip

        assert sorted(map(fields, first.rows)) == sorted(map(fields, snap.queries))
        assert all(r.snapshot_ms <= snap.now_ms for r in first.rows)
        row = first.rows[0]
        assert await buffer.mark_flushed(row, 1, None) == 0
        # A stale update and one below the floor return no row; applied ones count on.
        later = await buffer.apply_rows(
            [checkpoint_of(QID, 1), checkpoint_of(QID, 3), checkpoint_of(QID, 4)], [None, 5, 5]
        )
        assert later.outcomes == [Outcome.STALE, Outcome.BELOW_FLOOR, Outcome.BELOW_FLOOR]
        assert later.rows == []
        last = await buffer.apply_rows([checkpoint_of(QID, 2), checkpoint_of(QID, 3)])
        assert [(r.batch_id, r.pending, r.flushed_batch_id) for r in last.rows] == [
            (2, 1, 1),
            (3, 2, 1),
        ]
        (read,) = (await buffer.snapshot([QID], only=True)).queries
        assert (read.version, read.pending, read.first_pending_ms) == (
            last.rows[1].version,
            2,
            last.rows[0].snapshot_ms,  # pending since the first of the two
        )
        assert await buffer.mark_flushed(last.rows[1], 3, None) == 0  # the row covers both
        assert [q.query_id for q in (await buffer.snapshot()).queries] == [other]
    finally:
        await buffer.aclose()


async def restore_older(store: BlobStore, lease_id: str, doc: bytes, version: str) -> str:
    """Write ``doc`` over the blob at ``version`` under ``lease_id``, as a restore of an older
    version would put it back (its new version)."""
    return await store.write(QID, doc, lease_id=lease_id, query_name=None, version=version)


async def test_a_blob_restored_below_redis_while_no_daemon_ran_is_rewritten_at_start(
    make_config: ConfigFactory,
) -> None:
    # An idle query's blob goes back (batch 5 -> 2: a restore, a store that lost writes)
    # while its daemon is stopped. The new daemon has nothing pending for it; its audit at
    # start holds the store's listing against Redis' record of the last flush, reads the blob
    # and writes batch 5 back over it, logged and counted once.
    config = make_config(count_threshold=1)
    async with blob_reader(config) as store:
        async with running_daemon(config), await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(rate_progress(QID, 2))).applied
            older = await wait_blob_batch(store, QID, 2)
            assert (await c.progress(rate_progress(QID, 5))).applied
            await wait_blob_batch(store, QID, 5)
        other = "0e0e0e0e-0000-4000-8000-00000000000b"
        await store.acquire_lease(QID, other, 15)
        now = (await store.read_stored(QID)).version
        assert now is not None
        await restore_older(store, other, msgspec.json.encode(older), now)
        await store.release_lease(QID, other)
        assert await blob_batch(store) == 2
        async with running_daemon(config) as daemon:
            doc = await wait_blob_batch(store, QID, 5)
            assert sample(daemon, "checkpoint_sidecar_store_lost_writes_total") == 1
        assert doc.batch_id == 5 and doc.history[0].batch_id == 2  # written over what it held


async def test_a_blob_restored_below_redis_under_the_daemons_lease_is_rewritten(
    make_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # The daemon holds the lease of an idle query at batch 5; the blob goes back to batch 2
    # under that very lease (the store lost the write). No write of the daemon's is refused,
    # nothing is pending: the next renewal reports another version than the one written,
    # and the blob is read, found below Redis, and written back over.
    config = make_config(count_threshold=1, lease_duration_s=15)
    async with blob_reader(config) as store:
        async with running_daemon(config) as daemon:
            async with await SidecarClient.connect(config.socket_path) as c:
                assert (await c.progress(rate_progress(QID, 2))).applied
                older = await wait_blob_batch(store, QID, 2)
                assert (await c.progress(rate_progress(QID, 5))).applied
                await wait_blob_batch(store, QID, 5)
            now = (await store.read_stored(QID)).version
            assert now is not None
            lease_id = daemon.flush.leases.lease_id
            await restore_older(store, lease_id, msgspec.json.encode(older), now)
            assert await blob_batch(store) == 2
            doc = await wait_blob_batch(store, QID, 5, timeout_s=15)  # within a renewal
            assert sample(daemon, "checkpoint_sidecar_store_lost_writes_total") == 1
        assert doc.history[0].batch_id == 2
    said = [r.getMessage() for r in caplog.records if "lost writes" in r.getMessage()]
    assert said == [
        "query=rate-demo: the blob store lost writes: the blob held batch 2, Redis had "
        "flushed 5 (no reset since); rewriting it with the newest acknowledged batch"
    ]
