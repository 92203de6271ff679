"""Blob-mode acknowledgements (``SIDECAR_ACK_MODE=blob``) and the event loop, against real
redis-server and Azurite.

An ack in blob mode still means "the blob holds this batch or a newer one"; these tests show
it no longer waits for the flush interval, that one connection's pipelined requests share
blob writes (group commit) and are answered in order, that the thresholds still govern the
updates nobody waits for, and that the daemon runs on either event loop.
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis

from sidecar import __version__
from sidecar.buffer.keys import Keys
from sidecar.cli.commands import use_uvloop
from sidecar.config import Config
from sidecar.errors import ConfigError
from sidecar.ops.client import SidecarClient
from tests.helpers import (
    ConfigFactory,
    blob_reader,
    eventually,
    metric_value,
    running_daemon,
    sample,
    seed,
)
from tests.services import Azurite, DaemonProcess
from tests.sparkshapes import kafka_progress

QID = "5f2c9a41-7a0e-4c7b-9d51-0f6a8e2b3c10"
OTHER = "7d0e4b8a-2c51-4f3e-9a6b-1e8d5c2f7a90"
FLUSHES = "checkpoint_sidecar_flushes_total"
BODIES = "checkpoint_sidecar_flush_bodies_read_total"
#: Flush tick and thresholds out of reach of these tests: only a waiting ack can flush.
NEVER = {"flush_interval_s": 60, "time_threshold_s": 60, "count_threshold": 1_000_000}


def writes(azurite: Azurite, config: Config, query_id: str = QID) -> int:
    return azurite.blob_writes(config.container, f"{config.namespace}/{query_id}.json")


async def test_a_blob_mode_ack_comes_with_the_write_not_at_the_flush_interval(
    make_config: ConfigFactory,
) -> None:
    config = make_config(ack_mode="blob", **NEVER)
    async with running_daemon(config), blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            for batch in range(3):  # one at a time, each acked well before the 60 s tick
                with anyio.fail_after(30):
                    reply = await c.progress(kafka_progress(QID, batch))
                assert (reply.ok, reply.applied) == (True, True)
                doc = await store.read(QID)
                assert doc is not None and doc.batch_id == batch  # in the blob when acked


async def test_a_blob_mode_ack_is_flushed_from_the_row_its_apply_returned(
    make_config: ConfigFactory,
) -> None:
    config = make_config(ack_mode="blob", **NEVER)
    key = Keys(config.namespace).query(QID)
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            for batch in range(3):
                with anyio.fail_after(30):
                    reply = await c.progress(kafka_progress(QID, batch))
                assert (reply.ok, reply.applied) == (True, True)
        doc = await store.read(QID)
        assert doc is not None and doc.batch_id == 2
        assert sample(daemon, FLUSHES, result="ok") == 3
        # No checkpoint was read back from Redis for them (one round trip less per ack) ...
        assert sample(daemon, BODIES) == 0
        # ... and each flush cleared what its row covered: nothing is left pending.
        r = aioredis.Redis.from_url(config.redis_url)
        try:
            await eventually(lambda: sample(daemon, "checkpoint_sidecar_pending_updates",
                                            query="orders-to-delta") == 0)  # fmt: skip
            assert await r.hmget(key, "pending", "flushed_batch_id") == [b"0", b"2"]
            assert await r.zscore(Keys(config.namespace).pending, QID) is None
        finally:
            await r.aclose()


async def test_pipelined_blob_mode_requests_share_writes_and_are_answered_in_order(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    config = make_config(ack_mode="blob", **NEVER)
    count = 200
    requests = [
        ("progress", {"progress": kafka_progress(QID, b, partitions=32)}) for b in range(count)
    ]
    async with running_daemon(config), blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            with anyio.fail_after(30):
                replies = await c.send_many(requests)  # ~350 KB: several reads
            doc = await store.read(QID)
    assert [(r.ok, r.applied) for r in replies] == [(True, True)] * count
    assert [r.id for r in replies] == list(range(1, count + 1))  # in request order
    assert doc is not None and doc.batch_id == count - 1
    assert 0 < writes(azurite, config) < count // 4  # written; acks joined writes (group commit)


async def test_a_woken_flush_leaves_updates_nobody_waits_for_to_the_thresholds(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    config = make_config(ack_mode="blob", **NEVER)
    async with blob_reader(config) as store:
        async with running_daemon(config):
            async with await SidecarClient.connect(config.socket_path) as c:
                with anyio.fail_after(30):  # acked: the start's recovery pass is over
                    assert (await c.progress(kafka_progress(QID, 1))).ok
                # Pending in Redis, no ack waiting (as another daemon of the namespace left it).
                await seed(config.redis_url, config.namespace, OTHER, 4)
                with anyio.fail_after(30):
                    assert (await c.progress(kafka_progress(QID, 2))).ok
            assert writes(azurite, config, QID) == 2
            assert await store.read(OTHER) is None  # below both thresholds: not due
        # The stop's final flush writes everything pending, thresholds or not.
        other = await store.read(OTHER)
    assert other is not None and other.batch_id == 4


async def test_a_blob_mode_resend_after_a_retire_through_the_daemon_is_answered_by_a_read(
    make_config: ConfigFactory,
) -> None:
    """An operator retired the query (its Redis record removed, the blob kept) while its
    driver still runs: a resend of a batch the blob holds is below the floor, so Redis never
    takes it and no flush of it comes; its ack is answered by a read of the blob, here the
    floor's. (Where news came between that read and the ack, the flush reads the blob for
    it: the flush simulation's case "a resend's ack after a retirement, late writes and a
    store that lost one".)"""
    config = make_config(
        ack_mode="blob", admin_ops="true", admin_quiet_s="0", blob_ack_timeout_s=300, **NEVER
    )
    async with running_daemon(config), blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            for batch in range(2):
                with anyio.fail_after(30):
                    assert (await c.progress(kafka_progress(QID, batch))).applied
            retired = await c.request("retire", query_id=QID, reason="moved")
            assert retired.ok, retired.error
            assert await aioredis_keys(config) == []
            with anyio.fail_after(30):
                reply = await c.progress(kafka_progress(QID, 1))  # the listener's resend
            assert (reply.ok, reply.applied) == (True, False)  # durable: the blob holds it
        doc = await store.read(QID)
    assert doc is not None and doc.batch_id == 1


async def aioredis_keys(config: Config) -> list[bytes]:
    """The namespace's Redis keys naming the query (its record, its history)."""
    r = aioredis.Redis.from_url(config.redis_url)
    try:
        return [k async for k in r.scan_iter(f"{config.namespace}*{QID}*")]
    finally:
        await r.aclose()


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
async def test_the_daemon_runs_and_acks_on_the_event_loop_asked_for(
    daemon_env: dict[str, str], short_tmp: Path, procs: list[DaemonProcess], event_loop: str
) -> None:
    env = {**daemon_env, "SIDECAR_EVENT_LOOP": event_loop, "SIDECAR_ACK_MODE": "blob"}
    proc = DaemonProcess(env, short_tmp / "daemon.log")
    procs.append(proc)
    await anyio.to_thread.run_sync(proc.start)
    async with await SidecarClient.connect(proc.socket_path) as c:
        with anyio.fail_after(30):
            replies = await c.send_many(
                [("progress", {"progress": kafka_progress(QID, b)}) for b in range(5)]
            )
    assert [(r.ok, r.applied) for r in replies] == [(True, True)] * 5

    def scrape() -> str:
        with urllib.request.urlopen(f"{proc.admin_url}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    text = await anyio.to_thread.run_sync(scrape)
    info = "checkpoint_sidecar_build_info"
    assert metric_value(text, info, version=__version__, event_loop=event_loop) == 1
    assert await anyio.to_thread.run_sync(proc.stop) == 0
    assert f"ack_mode=blob event_loop={event_loop}" in proc.log()


def test_uvloop_asked_for_but_not_installed_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` now fails
    with pytest.raises(ConfigError, match=r"pip install 'checkpoint-sidecar\[uvloop\]'"):
        use_uvloop("uvloop")
    assert use_uvloop("auto") is False  # auto falls back to asyncio's own loop
    assert use_uvloop("asyncio") is False
