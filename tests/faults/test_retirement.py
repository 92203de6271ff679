"""Idle queries are retired from memory (``sidecar.daemon.retirement``), against real redis-server,
Azurite and a Kafka-protocol broker.

Over weeks a daemon sees thousands of query ids (a new checkpoint directory is a new id); one
idle for ``SIDECAR_QUERY_IDLE_S`` with nothing pending is forgotten: its lease released (the
blob's lease is ``available``), its metric series gone from ``/metrics``, its Kafka consumer
closed, while its Redis record and its blob stay. When it sends again it is stored, flushed
under a newly acquired lease, and its series come back. A query with updates pending or an
acknowledgement waiting is kept, however long it has been quiet.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import anyio
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer

from sidecar.buffer.keys import Keys
from sidecar.config import Config
from sidecar.daemon.app import Daemon
from sidecar.daemon.retirement import Retirement
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore
from tests.helpers import (
    ConfigFactory,
    eventually,
    running_daemon,
    sample,
    scrape,
    wait_blob_batch,
)
from tests.kafkatools import (
    GROUP,
    committed,
    create_topic_with_records,
    end_offsets_of,
    group_reader,
    progress,
    wait_committed,
)
from tests.services import KafkaBroker
from tests.sparkshapes import kafka_progress

QID = "7e7e0000-0000-4000-8000-0000000000a1"
NEW_ID = "7e7e0000-0000-4000-8000-0000000000a2"
WAITING = "7e7e0000-0000-4000-8000-0000000000b1"
THEIRS = "00000000-0000-0000-0000-0000000000ee"  # another daemon's lease id
LEASE_HELD = "checkpoint_sidecar_lease_held"
BATCH = "checkpoint_sidecar_checkpoint_batch_id"
PENDING = "checkpoint_sidecar_pending_updates"
QUERY_LAG = "checkpoint_sidecar_kafka_query_lag_records"


def retired(caplog: pytest.LogCaptureFixture, label: str, query_id: str) -> bool:
    return f"retired query={label} (id {query_id})" in caplog.text


async def series_of(daemon: Daemon, label: str) -> list[str]:
    """Lines of ``/metrics`` (scraped over HTTP) carrying ``query="<label>"``."""
    status, text = await anyio.to_thread.run_sync(scrape, daemon)
    assert status == 200
    return [line for line in text.splitlines() if f'query="{label}"' in line]


async def redis_record(config: Config, query_id: str) -> dict[bytes, bytes]:
    r = aioredis.Redis.from_url(config.redis_url)
    try:
        return cast(dict[bytes, bytes], await r.hgetall(Keys(config.namespace).query(query_id)))
    finally:
        await r.aclose()


async def test_an_idle_query_is_retired_and_comes_back_under_a_new_lease(
    make_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "sidecar")
    config = make_config(query_idle_s=1, count_threshold=1)
    name = "orders-to-delta"
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(QID, 1, name=name))).applied
        await wait_blob_batch(daemon.store, QID, 1, timeout_s=10)
        # every kind of per-query series exists (lag from Spark's own latestOffset)
        await eventually(lambda: sample(daemon, QUERY_LAG, query=name) == 15)
        assert sample(daemon, LEASE_HELD, query=name) == 1
        assert await daemon.store.lease_state(QID) == "leased"

        await eventually(lambda: retired(caplog, name, QID), timeout_s=10)
        assert await series_of(daemon, name) == []
        assert await daemon.store.lease_state(QID) == "available"  # a standby may take it
        record = await redis_record(config, QID)
        assert record[b"batch_id"] == b"1" and record[b"pending"] == b"0"
        doc = await daemon.store.read(QID)
        assert doc is not None and doc.batch_id == 1
        assert QID not in daemon.retirement and daemon.retirement.retired == 1

        # It sends again: stored, flushed under a newly acquired lease, series back.
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(QID, 2, name=name))).applied
        await wait_blob_batch(daemon.store, QID, 2, timeout_s=10)
        assert await daemon.store.lease_state(QID) == "leased"
        await eventually(lambda: sample(daemon, QUERY_LAG, query=name) == 15)
        assert sample(daemon, LEASE_HELD, query=name) == 1
        assert sample(daemon, BATCH, query=name) == 2
        lease_logs = [m for m in caplog.messages if m.startswith(f"lease query={name} ")]
        assert lease_logs[-1] == f"lease query={name} ACQUIRING -> HELD: acquired for 15s"


async def test_with_admin_ops_a_query_still_reporting_is_kept_until_quiet_then_retired(
    make_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # An idle running query reports its last batch again (not applied). Admin ops refuse a
    # reset of a query heard within their quiet time, and that time lives on the query's
    # entry in the daemon's record: retirement keeps the entry while it is recent.
    caplog.set_level(logging.INFO, "sidecar")
    config = make_config(query_idle_s=1, count_threshold=1, admin_ops=True, admin_quiet_s=3)
    name = "orders-to-delta"
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(QID, 1, name=name))).applied
            await wait_blob_batch(daemon.store, QID, 1, timeout_s=10)
            for _ in range(8):  # 4 s of reports of the same batch: heard, never applied
                assert not (await c.progress(kafka_progress(QID, 1, name=name))).applied
                await anyio.sleep(0.5)
                assert QID in daemon.retirement and not retired(caplog, name, QID)
        entry = daemon.queries.get(QID)
        assert entry is not None and entry.heard_at > entry.seen_at  # heard after applied
        await eventually(lambda: retired(caplog, name, QID), timeout_s=10)
        assert QID not in daemon.queries and daemon.retirement.retired == 1


async def test_a_query_with_updates_pending_is_kept_while_another_daemon_holds_its_lease(
    make_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "sidecar.daemon.retirement")
    config = make_config(query_idle_s=1, count_threshold=1, ack_mode="blob", blob_ack_timeout_s=30)
    other = BlobStore(config)  # another daemon holding the waiting query's blob
    await other.ensure_container()
    await other.create_if_absent(WAITING)
    await other.acquire_lease(WAITING, THEIRS, 60)
    replies: list[Any] = []
    try:
        async with running_daemon(config) as daemon, anyio.create_task_group() as tg:

            async def send_waiting() -> None:
                async with await SidecarClient.connect(config.socket_path) as c:
                    replies.append(await c.progress(kafka_progress(WAITING, 1, name="waiting")))

            tg.start_soon(send_waiting)
            # Blob ack mode: answered not_owner at once (another daemon holds the lease),
            # buffered in Redis all the same.
            await eventually(lambda: len(replies) == 1, timeout_s=15)
            assert replies[0].error is not None and replies[0].error.code == "not_owner"
            await eventually(lambda: sample(daemon, PENDING, query="waiting") == 1)
            async with await SidecarClient.connect(config.socket_path) as c:
                assert (await c.progress(kafka_progress(QID, 1, name="idle"))).applied
            # Quiet for longer than the idle one, and looked at first by each pass (least
            # recently seen first), yet kept: its update is pending.
            await eventually(lambda: retired(caplog, "idle", QID), timeout_s=10)
            assert not retired(caplog, "waiting", WAITING)
            assert sample(daemon, PENDING, query="waiting") == 1
            assert WAITING in daemon.retirement

            await other.release_lease(WAITING, THEIRS)  # the daemon takes it and flushes
            await eventually(lambda: sample(daemon, PENDING, query="waiting") == 0, timeout_s=30)
            await eventually(lambda: retired(caplog, "waiting", WAITING), timeout_s=10)
            assert await series_of(daemon, "waiting") == []
            assert await daemon.store.lease_state(WAITING) == "available"
    finally:
        await other.aclose()


async def test_an_old_id_of_a_name_is_retired_without_the_series_of_the_new_id(
    make_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # A query restarted from a new checkpoint directory: same name, new id. Series and lag
    # are kept by name, so retiring the old id must leave them to the new one.
    caplog.set_level(logging.INFO, "sidecar.daemon.retirement")
    config = make_config(query_idle_s=1, count_threshold=1)
    name = "orders-to-delta"
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(QID, 7, name=name))).applied
            await wait_blob_batch(daemon.store, QID, 7, timeout_s=10)
            batch = 0
            while not retired(caplog, name, QID):  # the new id stays active meanwhile
                assert (await c.progress(kafka_progress(NEW_ID, batch, name=name))).applied
                batch += 1
                await wait_blob_batch(daemon.store, NEW_ID, batch - 1, timeout_s=10)
                await anyio.sleep(0.2)  # Spark's trigger interval, not a wait for a result
        assert await daemon.store.lease_state(QID) == "available"
        assert await daemon.store.lease_state(NEW_ID) == "leased"
        assert sample(daemon, LEASE_HELD, query=name) == 1
        assert sample(daemon, BATCH, query=name) == batch - 1
        assert await series_of(daemon, name) != []
        assert "metric series removed" not in caplog.text


async def test_a_retired_querys_kafka_consumer_is_closed_and_comes_back(
    make_config: ConfigFactory,
    broker: KafkaBroker,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, "sidecar.daemon.retirement")
    await create_topic_with_records(broker.bootstrap)
    stopped: list[AIOKafkaConsumer] = []
    original_stop = AIOKafkaConsumer.stop

    async def spy_stop(self: AIOKafkaConsumer) -> None:
        stopped.append(self)
        await original_stop(self)

    monkeypatch.setattr(AIOKafkaConsumer, "stop", spy_stop)
    config = make_config(
        kafka_bootstrap_servers=broker.bootstrap, count_threshold=1, query_idle_s=1
    )
    qid = (
        "4b1d0c2e-0000-4000-8000-00000000cafe"  # tests.integration.test_kafka's query, group GROUP
    )
    async with running_daemon(config) as daemon, group_reader(broker.bootstrap) as reader:
        assert daemon.committer is not None
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(3))).applied
        await wait_committed(reader, end_offsets_of(3))
        first = daemon.committer._groups[GROUP].consumer
        assert first is not None

        await eventually(lambda: retired(caplog, "orders-to-delta", qid), timeout_s=10)
        await eventually(lambda: first in stopped)  # closed while the daemon runs
        assert GROUP not in daemon.committer._groups
        assert await committed(reader) == end_offsets_of(3)  # what was committed stays

        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(4))).applied
        await wait_committed(reader, end_offsets_of(4))  # with a new consumer
        assert daemon.committer._groups[GROUP].consumer not in (None, first)


# --- the bookkeeping itself (pure logic, a fake clock) --------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Hooks:
    """Records what a Retirement asks of its components."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.released: list[str] = []
        self.forgotten: list[str] = []
        self.labels_forgotten: list[str] = []
        self.busy: set[str] = set()
        self.refuse_release = False

    async def release(self, query_id: str) -> bool:
        self.released.append(query_id)
        return not self.refuse_release


def retirement_with_hooks() -> tuple[Retirement, Hooks, Clock]:
    hooks = Hooks()
    r = Retirement(60, release=hooks.release, clock=hooks.clock)
    r.busy.append(lambda q: q in hooks.busy)
    r.forget.append(hooks.forgotten.append)
    r.forget_label.append(hooks.labels_forgotten.append)
    return r, hooks, hooks.clock


async def test_retirement_waits_the_idle_time_and_skips_busy_queries() -> None:
    r, hooks, clock = retirement_with_hooks()
    r.seen("a", "A")
    r.seen("b", "B")
    clock.now += 59
    assert await r.retire_idle() == []
    r.seen("a", "A")  # a is refreshed
    clock.now += 2
    hooks.busy.add("b")
    assert await r.retire_idle() == []
    hooks.busy.clear()
    assert await r.retire_idle() == ["B"]
    assert (hooks.released, hooks.forgotten, hooks.labels_forgotten) == (["b"], ["b"], ["B"])
    clock.now += 60
    assert await r.retire_idle() == ["A"] and len(r) == 0 and r.retired == 2


async def test_a_label_is_forgotten_with_the_last_id_that_carries_it() -> None:
    r, hooks, clock = retirement_with_hooks()
    r.seen("old", "orders")
    clock.now += 30
    r.seen("new", "orders")
    clock.now += 31
    assert await r.retire_idle() == ["orders"]
    assert hooks.forgotten == ["old"] and hooks.labels_forgotten == []
    clock.now += 60
    assert await r.retire_idle() == ["orders"]
    assert hooks.forgotten == ["old", "new"] and hooks.labels_forgotten == ["orders"]


async def test_a_renamed_query_forgets_its_old_label() -> None:
    r, hooks, _ = retirement_with_hooks()
    r.seen("q", "before")
    r.seen("q", "after")
    assert hooks.labels_forgotten == ["before"] and hooks.forgotten == []


async def test_tracking_does_not_refresh_and_a_refused_release_is_tried_again() -> None:
    r, hooks, clock = retirement_with_hooks()
    r.seen("q", "Q")
    clock.now += 61
    r.track("q", "Q")  # the flusher saw it: not an update, so it is not refreshed
    hooks.refuse_release = True  # a renewal under way
    assert await r.retire_idle() == [] and "q" in r
    hooks.refuse_release = False
    assert await r.retire_idle() == ["Q"] and hooks.released == ["q", "q"]


async def test_a_query_seen_while_its_lease_is_released_is_kept() -> None:
    clock = Clock()
    forgotten: list[str] = []

    async def release(query_id: str) -> bool:
        r.seen(query_id, "Q")  # an update arrives while the store call is in flight
        return True

    r = Retirement(60, release=release, clock=clock)
    r.forget.append(forgotten.append)
    r.seen("q", "Q")
    clock.now += 61
    assert await r.retire_idle() == [] and "q" in r and forgotten == []
