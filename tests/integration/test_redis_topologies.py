"""The buffer on the Redis that production runs: Redis Cluster, Sentinel failover, and
acknowledgements that wait for replicas (``SIDECAR_REDIS_MIN_REPLICAS``).

Real redis-server processes (tests/redis_topologies.py): a 3-primary cluster, a cluster with
a replica per primary, a primary/replica pair under one sentinel. Daemons run in this event
loop; the invariant checked under every fault: each update acknowledged ``ok`` is in Redis
afterwards, and no query's batch ever goes backwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis

from sidecar.buffer.keys import Keys
from sidecar.config import Config
from sidecar.daemon.app import Daemon
from sidecar.ops.client import SidecarClient
from sidecar.wire.protocol import RETRIABLE_CODES
from tests.helpers import (
    ConfigFactory,
    blob_reader,
    eventually,
    running_daemon,
    sample,
    scrape,
    seed,
    wait_blob_batch,
    wait_for,
)
from tests.redis_topologies import RedisClusterNodes, RedisSentinelSet
from tests.services import DaemonProcess, RedisServer
from tests.sparkshapes import kafka_progress

pytestmark = pytest.mark.slow

QUERIES = [f"7090d000-0000-4000-8000-00000000000{i}" for i in range(3)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterNodes]:
    with RedisClusterNodes(masters=3) as nodes:
        yield nodes


def namespaces_on_distinct_nodes(cluster: RedisClusterNodes, count: int) -> list[str]:
    """Namespaces whose hash slots live on ``count`` different primaries."""
    chosen: dict[int, str] = {}
    for i in range(200):
        ns = f"app-{i}"
        chosen.setdefault(cluster.owner(Keys(ns).pending).port, ns)
        if len(chosen) == count:
            return list(chosen.values())
    raise AssertionError("no namespaces on distinct nodes")


async def stored_batch(url: str, namespace: str, query_id: str) -> int | None:
    """The batch id Redis holds, read from the node at ``url`` (a cluster node: its owner)."""
    r = aioredis.Redis.from_url(url)
    try:
        value = await r.hget(Keys(namespace).query(query_id), "batch_id")
    finally:
        await r.aclose()
    return int(value) if value is not None else None


class Load:
    """Pipelined-enough load: each query's batches in order, resent on retriable errors;
    remembers the highest batch acknowledged ok per query and every `get` answer."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.acked: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.stop = anyio.Event()

    async def run(self, queries: list[str], *, first: int = 1, last: int = 10**9) -> None:
        async with anyio.create_task_group() as tg:
            for query in queries:
                tg.start_soon(self._one, query, first, last)

    async def _one(self, query: str, first: int, last: int) -> None:
        batch = first
        client: SidecarClient | None = None
        while batch <= last and not self.stop.is_set():
            try:
                if client is None:
                    client = await SidecarClient.connect(self.socket_path)
                reply = await client.progress(kafka_progress(query, batch))
            except OSError:
                client = None
                await anyio.sleep(0.05)
                continue
            if reply.ok:
                self.acked[query] = batch
                batch += 1
                continue
            assert reply.error is not None and reply.error.code in RETRIABLE_CODES, reply
            self.errors[reply.error.code] = self.errors.get(reply.error.code, 0) + 1
            await anyio.sleep(0.02)
        if client is not None:
            await client.aclose()


@asynccontextmanager
async def under_load(config: Config, queries: list[str]) -> AsyncIterator[Load]:
    load = Load(config.socket_path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(load.run, queries)
        await eventually(lambda: all(load.acked.get(q, 0) >= 3 for q in queries), 30)
        yield load
        load.stop.set()


async def readiness(daemon: Daemon, seen: list[int], stop: anyio.Event) -> None:
    """Record /readyz's status every 50 ms until ``stop``."""
    while not stop.is_set():
        status, _ = await anyio.to_thread.run_sync(scrape, daemon, "/readyz")
        seen.append(status)
        await anyio.sleep(0.05)


# --- Redis Cluster ----------------------------------------------------------------------


async def test_daemons_on_three_cluster_nodes_each_run_the_whole_chain(
    cluster: RedisClusterNodes, make_config: ConfigFactory, short_tmp: Path
) -> None:
    namespaces = namespaces_on_distinct_nodes(cluster, 3)
    configs = [
        make_config(
            redis_url=cluster.url,
            redis_mode="cluster",
            namespace=ns,
            socket_path=str(short_tmp / f"{i}.sock"),
            count_threshold=1,
        )
        for i, ns in enumerate(namespaces)
    ]
    recovered = QUERIES[2]
    for config in configs:  # what a crashed daemon left pending, on the namespace's node
        owner = cluster.owner(Keys(config.namespace).pending)
        await seed(owner.url, config.namespace, recovered, 7)

    async with running_daemon(configs[0]), running_daemon(configs[1]), running_daemon(configs[2]):
        for config in configs:
            async with await SidecarClient.connect(config.socket_path) as c:
                for batch in range(1, 6):
                    assert (await c.progress(kafka_progress(QUERIES[0], batch))).applied
                got = await c.get(QUERIES[0])
            assert got.checkpoint is not None and got.checkpoint["batch_id"] == 5
            async with blob_reader(config) as store:
                await wait_blob_batch(store, QUERIES[0], 5)
                await wait_blob_batch(store, recovered, 7)  # crash recovery, on its node

    for config in configs:  # the flush was marked on the namespace's own node
        owner = cluster.owner(Keys(config.namespace).pending)
        r = aioredis.Redis.from_url(owner.url)
        try:
            record = await r.hgetall(Keys(config.namespace).query(QUERIES[0]))
        finally:
            await r.aclose()
        assert record[b"batch_id"] == b"5" and record[b"flushed_batch_id"] == b"5"
        assert record[b"pending"] == b"0"


async def test_a_live_slot_migration_under_load_loses_and_rewinds_nothing(
    cluster: RedisClusterNodes, make_config: ConfigFactory
) -> None:
    ns = namespaces_on_distinct_nodes(cluster, 1)[0]
    config = make_config(redis_url=cluster.url, redis_mode="cluster", namespace=ns)
    key = Keys(ns).pending
    source = cluster.owner(key)
    target = next(n for n in cluster.primaries() if n is not source)
    async with running_daemon(config), under_load(config, QUERIES) as load:
        before = dict(load.acked)
        await anyio.to_thread.run_sync(cluster.move_slot, key, source, target)
        await eventually(lambda: all(load.acked[q] >= before[q] + 5 for q in QUERIES), 30)
    assert cluster.owner(key) is target
    for query in QUERIES:
        assert await stored_batch(target.url, ns, query) == load.acked[query]


async def test_a_slot_left_half_moved_is_retried_until_the_move_ends_and_loses_nothing(
    cluster: RedisClusterNodes, make_config: ConfigFactory
) -> None:
    """A reshard that stalls between MIGRATE steps: the namespace's index on one node, some
    of its queries on the other. Scripts meet keys that are not local and redis-py runs out
    of redirections ("TTL exhausted"); both are a retriable refusal, never a crash."""
    ns = "app-half-moved"  # its own: the module's cluster keeps other tests' batches
    config = make_config(redis_url=cluster.url, redis_mode="cluster", namespace=ns)
    keys = Keys(ns)
    source = cluster.owner(keys.pending)
    target = next(n for n in cluster.primaries() if n is not source)
    async with running_daemon(config) as daemon, under_load(config, QUERIES) as load:
        slot = cluster.begin_move(keys.pending, source, target)
        cluster.migrate(source, target, keys.pending, keys.query(QUERIES[0]))
        checks_before = sample(daemon, "checkpoint_sidecar_flush_checks_total")
        await anyio.sleep(3)  # checks, flushes and acks meet the half-moved slot meanwhile
        assert load.errors.get("unavailable", 0) > 0, load.errors
        before = dict(load.acked)
        await anyio.to_thread.run_sync(lambda: cluster.migrate_keys(slot, source, target, 1000))
        cluster.end_move(slot, target)
        await eventually(lambda: all(load.acked[q] >= before[q] + 5 for q in QUERIES), 30)
        assert sample(daemon, "checkpoint_sidecar_flush_checks_total") > checks_before
    for query in QUERIES:
        assert await stored_batch(target.url, ns, query) == load.acked[query]


# --- misconfigured topologies ---------------------------------------------------------------


def test_standalone_mode_against_a_cluster_node_says_to_set_cluster_mode(
    cluster: RedisClusterNodes, daemon_env: dict[str, str], short_tmp: Path
) -> None:
    ns = "app-elsewhere"
    wrong = next(n for n in cluster.primaries() if n is not cluster.owner(Keys(ns).pending))
    env = {**daemon_env, "SIDECAR_NAMESPACE": ns, "SIDECAR_REDIS_URL": wrong.url}
    proc = DaemonProcess(env, short_tmp / "d.log")
    proc.start(wait=False)
    try:
        wait_for(lambda: "set SIDECAR_REDIS_MODE=cluster" in proc.log(), 30, "the hint")
        status = proc.readyz()
        assert status is not None and status[0] == 503 and "Redis" in status[1]
    finally:
        proc.kill()


def test_standalone_mode_against_a_replica_says_it_is_read_only(
    daemon_env: dict[str, str], short_tmp: Path
) -> None:
    with RedisServer() as primary:
        replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)])
        with replica:
            proc = DaemonProcess(
                {**daemon_env, "SIDECAR_REDIS_URL": replica.url}, short_tmp / "d.log"
            )
            proc.start(wait=False)
            try:
                wait_for(lambda: "it is a read-only replica" in proc.log(), 30, "the hint")
                status = proc.readyz()
                assert status is not None and status[0] == 503
            finally:
                proc.kill()


# --- failover with replica-acknowledged writes ---------------------------------------------


@pytest.fixture
def sentinel_set() -> Iterator[RedisSentinelSet]:
    with RedisSentinelSet() as nodes:
        yield nodes


@pytest.fixture
def sentinel_config(sentinel_set: RedisSentinelSet, make_config: ConfigFactory) -> Config:
    """A daemon on the sentinels' primary that acknowledges only replicated updates."""
    return make_config(
        redis_mode="sentinel",
        redis_sentinels=sentinel_set.sentinels,
        redis_sentinel_master=sentinel_set.master_name,
        redis_min_replicas=1,
        redis_timeout_s=1,
    )


async def test_sentinel_failover_keeps_every_ack_and_the_daemon_follows(
    sentinel_set: RedisSentinelSet, sentinel_config: Config
) -> None:
    config = sentinel_config
    seen: list[int] = []
    stop = anyio.Event()
    async with running_daemon(config) as daemon, under_load(config, QUERIES) as load:
        async with anyio.create_task_group() as tg:
            tg.start_soon(readiness, daemon, seen, stop)
            new = await anyio.to_thread.run_sync(sentinel_set.kill_primary_and_await_failover)
            at_failover = dict(load.acked)
            # No replica left: updates are stored but answered not_durable until one is back.
            await eventually(lambda: load.errors.get("not_durable", 0) > 0, 30)
            await anyio.to_thread.run_sync(sentinel_set.rejoin_old_primary)
            await eventually(lambda: all(load.acked[q] >= at_failover[q] + 5 for q in QUERIES), 30)
            await eventually(lambda: seen[-1] == 200, 30)
            stop.set()
        load.stop.set()
    for query in QUERIES:  # what was acked before the kill survived the promotion
        assert (await stored_batch(new.url, config.namespace, query) or 0) >= at_failover[query]
        assert await stored_batch(new.url, config.namespace, query) == load.acked[query]
    assert 503 in seen and seen[-1] == 200


async def test_too_few_replicas_answers_not_durable_until_the_replica_is_back(
    sentinel_set: RedisSentinelSet, sentinel_config: Config
) -> None:
    config = sentinel_config
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(QUERIES[0], 1))).applied
            await anyio.to_thread.run_sync(sentinel_set.replica.stop)
            refused = await c.progress(kafka_progress(QUERIES[0], 2))
            await anyio.to_thread.run_sync(sentinel_set.replica.start)
            await eventually(lambda: sample(daemon, "checkpoint_sidecar_redis_up") == 1, 30)
            resent = await c.progress(kafka_progress(QUERIES[0], 2))
            for _ in range(100):  # the replica resyncs within a few seconds
                if resent.ok:
                    break
                await anyio.sleep(0.1)
                resent = await c.progress(kafka_progress(QUERIES[0], 2))
        assert sample(daemon, "checkpoint_sidecar_not_durable_total", reason="replicas") >= 1
        zero = sample(daemon, "checkpoint_sidecar_redis_replicas_acked_bucket", le="0.0")
    assert not refused.ok and refused.error is not None
    assert refused.error.code == "not_durable" and "0 of SIDECAR_REDIS_MIN_REPLICAS=1" in (
        refused.error.message
    )
    assert resent.ok  # stored the first time: the resend is stale, and now replicated
    assert zero is not None and zero >= 1


@pytest.fixture
def replicated_cluster() -> Iterator[RedisClusterNodes]:
    with RedisClusterNodes(masters=3, replicas=1) as nodes:
        yield nodes


async def test_cluster_failover_keeps_every_ack_and_the_daemon_follows(
    replicated_cluster: RedisClusterNodes, make_config: ConfigFactory
) -> None:
    cluster = replicated_cluster
    ns = "app-failover"
    config = make_config(
        redis_url=cluster.url,
        redis_mode="cluster",
        namespace=ns,
        redis_min_replicas=1,
        redis_timeout_s=1,
    )
    primary = cluster.owner(Keys(ns).pending)
    async with running_daemon(config), under_load(config, QUERIES) as load:
        promoted = await anyio.to_thread.run_sync(cluster.kill_and_await_failover, primary)
        at_failover = dict(load.acked)
        await eventually(lambda: load.errors.get("not_durable", 0) > 0, 30)  # no replica left
        await anyio.to_thread.run_sync(cluster.rejoin, primary)
        await eventually(lambda: all(load.acked[q] >= at_failover[q] + 5 for q in QUERIES), 60)
    for query in QUERIES:
        assert await stored_batch(promoted.url, ns, query) == load.acked[query]


def test_doctor_reads_the_namespaces_own_node_of_a_cluster(
    cluster: RedisClusterNodes, daemon_env: dict[str, str]
) -> None:
    """The first call of a fresh cluster client (doctor's INFO) finds the slot's node."""
    env = {**daemon_env, "SIDECAR_REDIS_URL": cluster.url, "SIDECAR_REDIS_MODE": "cluster"}
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "doctor", "--json"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in result.stderr, result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    writable = next(c for name, c in checks.items() if "writ" in name)
    assert writable["status"] == "ok", writable
