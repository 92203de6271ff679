"""The blob is the floor (issue #9, defect 3): after Redis lost its data, no update older than
a query's blob is applied and ``get`` never answers with less than the blob holds.

Real redis-server and Azurite; the daemon in this event loop (``running_daemon``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import anyio
import pytest
import redis.asyncio as aioredis

from sidecar.buffer.keys import Keys
from sidecar.buffer.redis_buffer import NO_BLOB
from sidecar.config import Config
from sidecar.errors import CorruptRecord
from sidecar.flush.floor import LISTING_MAX_AGE_S, BlobFloors
from sidecar.ops.client import SidecarClient
from tests.helpers import blob_reader, running_daemon, seed, wait_blob_batch
from tests.services import Azurite, RedisServer
from tests.sparkshapes import kafka_progress

ConfigFactory = Callable[..., Config]
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
        assert daemon.floors.known(QID) in (10, 12)  # read from the blob, then raised
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


# --- the floor cache itself (pure logic; the tests above run the same paths for real) --------


async def test_concurrent_first_updates_share_one_blob_read() -> None:
    reads: list[str] = []
    release = anyio.Event()

    async def read(query_id: str) -> int | None:
        reads.append(query_id)
        await release.wait()
        return 7

    floors = BlobFloors(read)
    got: list[int] = []

    async def load() -> None:
        got.append(await floors.load(QID))

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(load)
        await anyio.wait_all_tasks_blocked()
        release.set()
    assert reads == [QID] and got == [7] * 5
    floors.raise_to(QID, 5)  # never lowered
    assert floors.known(QID) == 7
    floors.raise_to(QID, 9)
    assert floors.known(QID) == 9
    floors.forget(QID)
    assert floors.known(QID) is None


async def test_a_blob_read_begun_before_a_reset_does_not_raise_its_floor_back() -> None:
    # The blob still held batch 9 when the read began; a reset to batch 4 lands meanwhile.
    release = anyio.Event()

    async def read(query_id: str) -> int | None:
        await release.wait()
        return 9

    floors = BlobFloors(read)
    got: list[int] = []

    async def load() -> None:
        got.append(await floors.load(QID))

    async with anyio.create_task_group() as tg:
        tg.start_soon(load)
        await anyio.wait_all_tasks_blocked()
        floors.reset_to(QID, 4)
        release.set()
    assert got == [4] and floors.known(QID) == 4  # batches 5..9 are stored again


async def test_no_blob_and_an_unreadable_blob_are_no_floor() -> None:
    async def missing(query_id: str) -> int | None:
        return None

    async def unreadable(query_id: str) -> int | None:
        raise CorruptRecord("blob", f"{query_id}.json", "is not a checkpoint document")

    assert await BlobFloors(missing).load(QID) == NO_BLOB
    assert await BlobFloors(unreadable).load(QID) == NO_BLOB


async def test_queries_without_a_blob_cost_one_listing_not_a_read_each() -> None:
    reads: list[str] = []
    listings: list[float] = []
    now = [0.0]

    async def read(query_id: str) -> int | None:
        reads.append(query_id)
        return 4

    async def listing() -> set[str]:
        listings.append(now[0])
        return {QID} if len(listings) == 1 else {QID, NEW}

    floors = BlobFloors(read, listing, clock=lambda: now[0])
    for i in range(1000):  # a client inventing query ids
        assert await floors.load(f"invented-{i}") == NO_BLOB
    assert await floors.load(QID) == 4
    assert (len(listings), reads) == (1, [QID])
    assert len(floors) == 1  # no floor kept for queries without a blob

    now[0] = LISTING_MAX_AGE_S + 1  # another daemon may have created NEW's blob since
    assert await floors.load(NEW) == 4
    assert listings == [0.0, LISTING_MAX_AGE_S + 1] and reads == [QID, NEW]
    floors.raise_to("written-here", 2)  # the flusher wrote a first blob: no listing needed
    assert await floors.load("written-here") == 2 and len(listings) == 2
