"""The blob is the floor (issue #9, defect 3): after Redis lost its data, no update older than
a query's blob is applied and ``get`` never answers with less than the blob holds.

Real redis-server and Azurite; the daemon in this event loop (``running_daemon``).
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest
import redis.asyncio as aioredis

from sidecar.buffer.keys import Keys
from sidecar.config import Config
from sidecar.ops.client import SidecarClient
from tests.helpers import ConfigFactory, blob_reader, running_daemon, seed, wait_blob_batch
from tests.services import Azurite, RedisServer
from tests.sparkshapes import kafka_progress

QID = "5e1d0000-0000-4000-8000-0000000000f1"
NEW = "5e1d0000-0000-4000-8000-0000000000f2"


async def flushall(url: str) -> None:
    r = aioredis.Redis.from_url(url)
    try:
        await r.flushall()
    finally:
        await r.aclose()


async def redis_batch(config: Config, query_id: str) -> bytes | None:
    r = aioredis.Redis.from_url(config.redis_url)
    try:
        value = await r.hget(Keys(config.namespace).query(query_id), "batch_id")
        assert value is None or isinstance(value, bytes)
        return value
    finally:
        await r.aclose()


async def flush_to_blob(config: Config, last: int) -> None:
    """Run a daemon that stores batches 1..``last`` of QID and flushes them to the blob."""
    async with running_daemon(config), blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            for batch in range(1, last + 1):
                assert (await c.progress(kafka_progress(QID, batch))).applied
        await wait_blob_batch(store, QID, last)


async def test_after_flushall_an_older_batch_is_refused_and_get_keeps_the_blobs(
    make_config: ConfigFactory, own_redis: RedisServer
) -> None:
    config = make_config(redis_url=own_redis.url, count_threshold=1)
    async with running_daemon(config), blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            for batch in range(1, 11):
                assert (await c.progress(kafka_progress(QID, batch))).applied
            await wait_blob_batch(store, QID, 10)
            await flushall(own_redis.url)

            older = await c.progress(kafka_progress(QID, 5))
            got = await c.get(QID)
            newer = await c.progress(kafka_progress(QID, 11))
            after = await c.get(QID)
        doc = await wait_blob_batch(store, QID, 11)
    assert older.ok and older.applied is False
    assert got.checkpoint is not None and got.checkpoint["batch_id"] == 10  # from the blob
    assert newer.ok and newer.applied is True
    assert after.checkpoint is not None and after.checkpoint["batch_id"] == 11
    assert doc.batch_id == 11


async def test_a_daemon_started_on_an_emptied_redis_reads_the_floor_from_the_blob(
    make_config: ConfigFactory, own_redis: RedisServer
) -> None:
    config = make_config(redis_url=own_redis.url, count_threshold=1)
    await flush_to_blob(config, 10)
    await flushall(own_redis.url)
    async with running_daemon(config) as daemon:  # knows nothing of QID
        async with await SidecarClient.connect(config.socket_path) as c:
            replies = await c.send_many(
                [("progress", {"progress": kafka_progress(QID, b)}) for b in (4, 10, 3)]
            )
            stored = await redis_batch(config, QID)
            newer = await c.progress(kafka_progress(QID, 12))
        assert await daemon.flush.read_floor(QID) in (10, 12)  # read from the blob, then raised
    assert [(r.ok, r.applied) for r in replies] == [(True, False)] * 3
    assert stored is None  # none of them reached Redis
    assert newer.applied is True
    assert await redis_batch(config, QID) == b"12"


async def test_get_answers_with_the_blob_when_redis_holds_an_older_batch(
    make_config: ConfigFactory, own_redis: RedisServer
) -> None:
    config = make_config(redis_url=own_redis.url, count_threshold=1)
    await flush_to_blob(config, 10)
    # Redis restored from an older file: it holds batch 4 of the query.
    await flushall(own_redis.url)
    await seed(config.redis_url, config.namespace, QID, 4)
    async with running_daemon(config):
        async with await SidecarClient.connect(config.socket_path) as c:
            got = await c.get(QID)
            older = await c.progress(kafka_progress(QID, 6))  # the floor is known now
    assert got.checkpoint is not None and got.checkpoint["batch_id"] == 10
    assert older.applied is False
    assert await redis_batch(config, QID) == b"4"


@pytest.fixture
def own_azurite() -> Iterator[Azurite]:
    with Azurite() as server:
        yield server


async def test_while_the_store_is_down_known_queries_are_acked_and_a_new_one_waits(
    make_config: ConfigFactory, own_azurite: Azurite
) -> None:
    config = make_config(azure_connection_string=own_azurite.connection_string, write_timeout_s=1)
    await seed(config.redis_url, config.namespace, QID, 1)  # Redis knows QID, the daemon not
    async with running_daemon(config), blob_reader(config) as store:
        await anyio.to_thread.run_sync(own_azurite.stop)
        async with await SidecarClient.connect(config.socket_path) as c:
            known = await c.progress(kafka_progress(QID, 2))
            new = await c.progress(kafka_progress(NEW, 1))  # which blobs exist is unknown
            await anyio.to_thread.run_sync(own_azurite.start)
            resent = await c.progress(kafka_progress(NEW, 1))
        await wait_blob_batch(store, NEW, 1, timeout_s=40)
    assert known.ok and known.applied is True
    assert not new.ok and new.error is not None and new.error.code == "unavailable"
    assert resent.ok and resent.applied is True
