"""Stopping under pressure: the shutdown budgets, the final Kafka commit, SIGTERM under load.

Real redis-server, Azurite and the Kafka-protocol broker throughout. The daemon runs as a
process where the signal and the exit code are the point, in-process where the Kafka
clients it opens are counted. Numbers measured under load are printed with ``-s``.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer

from sidecar.buffer.keys import Keys
from sidecar.config import Config
from sidecar.daemon.app import Daemon
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore
from sidecar.wire.protocol import ClientConnection, encode_request
from tests.faults.test_hostile_clients import Client
from tests.helpers import ConfigFactory, eventually, read_blob, running_daemon, wait_blob, wait_for
from tests.kafkatools import (
    PARTS,
    TOPIC,
    committed,
    create_topic_with_records,
    end_offsets_of,
    group_reader,
)
from tests.services import Azurite, DaemonProcess, KafkaBroker
from tests.sparkshapes import kafka_progress

SUMMARY = re.compile(r"stopped in (\d+\.\d+)s .*: (.*)")
CUT = re.compile(r"(\w[\w ]*) \d+\.\d+s \(cut\)")


def query(n: int) -> str:
    return f"5d0e0000-0000-4000-8000-{n:012d}"


def start(procs: list[DaemonProcess], env: dict[str, str], tmp: Path) -> DaemonProcess:
    proc = DaemonProcess(env, tmp / f"daemon{len(procs)}.log")
    procs.append(proc)
    proc.start()
    return proc


def progress_frame(query_id: str, batch: int, rid: int, name: str) -> bytes:
    return encode_request("progress", rid, progress=kafka_progress(query_id, batch, name=name))


def lease_states(env: dict[str, str], query_ids: list[str]) -> dict[str, str]:
    async def read() -> dict[str, str]:
        store = BlobStore(Config.from_env(env))
        try:
            return {q: await store.lease_state(q) for q in query_ids}
        finally:
            await store.aclose()

    return anyio.run(read)


def mute_client(path: str) -> socket.socket:
    """A client that pipelines pings and never reads a reply, until the daemon is stuck
    writing to it: its writes block once the replies fill the kernel's buffers, and then it
    reads no more, so our send blocks too (for a whole second: the daemon has nothing else
    to do, so it is not merely busy)."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.settimeout(1.0)
    pings = b"".join(json.dumps({"op": "ping", "id": n}).encode() + b"\n" for n in range(2000))
    try:
        for _ in range(1000):  # ~50 MB at most: far more than any socket buffer
            s.sendall(pings)
    except TimeoutError:
        return s
    raise AssertionError("the daemon read 50 MB of pings without blocking on its replies")


def test_a_drain_stuck_on_a_client_that_never_reads_leaves_the_final_flush_its_share(
    daemon_env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path
) -> None:
    """Before the budgets, the drain could use the whole grace period and leave the final
    flush none: the pending updates stayed in Redis."""
    env = {
        **daemon_env,
        "SIDECAR_SHUTDOWN_GRACE_S": "4",
        "SIDECAR_COUNT_THRESHOLD": "1000",  # nothing is flushed before the stop
        "SIDECAR_TIME_THRESHOLD_S": "3600",
    }
    proc = start(procs, env, short_tmp)
    queries = [query(n) for n in range(3)]
    client = Client(proc.socket_path)
    rid = 0
    for q in queries:
        for batch in range(1, 4):
            rid += 1
            client.send(progress_frame(q, batch, rid, f"q{q[-1]}"))
    assert all(r.applied for r in client.replies(rid))
    client.close()
    assert all(read_blob(env, q) is None for q in queries)
    mute = mute_client(proc.socket_path)
    try:
        proc.signal(signal.SIGTERM)
        assert proc.wait() == 0
    finally:
        mute.close()
    blobs = {q: read_blob(env, q) for q in queries}
    assert {q: d.batch_id if d else None for q, d in blobs.items()} == dict.fromkeys(queries, 3)
    log = proc.log()
    assert "stop: drain cut at its deadline (1.6s): closing 1 connection(s)" in log  # 40 % of 4 s
    summary = SUMMARY.search(log)
    assert summary is not None
    assert CUT.findall(summary.group(2)) == ["drain"], "the final flush and release were not cut"
    assert lease_states(env, queries) == dict.fromkeys(queries, "available")
    print(f"\nslow drain: {summary.group(0)}")


def test_a_second_signal_cuts_the_stop_at_once_and_exits_130(
    daemon_env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path
) -> None:
    """The finalizers are shielded from the task group's cancellation, not from a forced
    stop: a second signal still ends the daemon without waiting out the grace period."""
    proc = start(procs, {**daemon_env, "SIDECAR_SHUTDOWN_GRACE_S": "300"}, short_tmp)
    mute = mute_client(proc.socket_path)  # holds the drain up (its share: 120 s)
    try:
        proc.signal(signal.SIGTERM)
        wait_for(lambda: "stopping: no new connections" in proc.log(), 30, "the stop to begin")
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == 130
    finally:
        mute.close()
    summary = SUMMARY.search(proc.log())
    assert summary is not None and CUT.findall(summary.group(2))[0] == "drain"


@pytest.fixture
def own_azurite() -> Iterator[Azurite]:
    with Azurite() as server:
        yield server


def test_a_final_flush_cut_by_a_store_outage_names_what_it_left_in_redis(
    daemon_env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path, own_azurite: Azurite
) -> None:
    env = {
        **daemon_env,
        "AZURE_STORAGE_CONNECTION_STRING": own_azurite.connection_string,
        "SIDECAR_SHUTDOWN_GRACE_S": "3",
        "SIDECAR_WRITE_TIMEOUT_S": "1",
        "SIDECAR_COUNT_THRESHOLD": "2",
        "SIDECAR_TIME_THRESHOLD_S": "3600",
    }
    proc = start(procs, env, short_tmp)
    q = query(1)
    client = Client(proc.socket_path)
    for batch in (1, 2):  # flushed: the lease is held
        client.send(progress_frame(q, batch, batch, "orders"))
    assert all(r.applied for r in client.replies(2))
    wait_blob(env, q, 2)
    assert client.request(json.loads(progress_frame(q, 3, 3, "orders"))).applied  # pending
    client.close()
    own_azurite.stop()  # the final flush retries its write until its deadline
    proc.signal(signal.SIGTERM)
    assert proc.wait() == 0
    log = proc.log()
    left = f"left unflushed (kept in Redis, flushed at the next start): {q} (1 updates, batch 3)"
    assert f"stop: final flush cut at its deadline (2.4s); {left}" in log
    summary = SUMMARY.search(log)
    assert summary is not None
    cut = CUT.findall(summary.group(2))
    # The release may be cut too (the store is down); the drain had nothing to wait for.
    assert "final flush" in cut and "drain" not in cut, summary.group(0)
    assert anyio.run(redis_fields, env, q) == {"pending": "1", "batch_id": "3"}


async def redis_fields(env: dict[str, str], query_id: str) -> dict[str, str]:
    """``pending`` and ``batch_id`` of the query's record in Redis."""
    config = Config.from_env(env)
    r = aioredis.Redis.from_url(config.redis_url, decode_responses=True)
    try:
        key = Keys(config.namespace).query(query_id)
        pending, batch = await r.hmget(key, ["pending", "batch_id"])
        return {"pending": str(pending), "batch_id": str(batch)}
    finally:
        await r.aclose()


async def test_an_outside_cancellation_during_the_stop_cuts_no_finalizer(
    make_config: ConfigFactory,
) -> None:
    """The task group running the daemon is cancelled (as when a component crashes) right
    after the drain: the final flush and the release, shielded, still finish. Before, they
    were cut at once, leaving most of the queries unflushed and their leases held."""
    config = make_config(count_threshold=1000, time_threshold_s=3600)
    queries = [query(n) for n in range(40)]
    daemon = Daemon(config)
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.run)
        async with await SidecarClient.connect(config.socket_path) as c:
            replies = await c.send_many(
                [("progress", {"progress": kafka_progress(q, 7, name=q[-4:])}) for q in queries]
            )
            assert all(r.applied for r in replies)
        daemon.request_stop()
        await eventually(lambda: not daemon.server.bound)  # drained: the finalizers run
        tg.cancel_scope.cancel()
    assert daemon.stopped.is_set()
    store = BlobStore(config)
    try:
        batches = {q: (doc.batch_id if (doc := await store.read(q)) else None) for q in queries}
        assert batches == dict.fromkeys(queries, 7)
        leases = {q: await store.lease_state(q) for q in queries}
    finally:
        await store.aclose()
    assert leases == dict.fromkeys(queries, "available")


@pytest.fixture
def daemon_consumers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, AIOKafkaConsumer]]:
    """(group, consumer) of every Kafka consumer started in this process, in start order."""
    started: list[tuple[str, AIOKafkaConsumer]] = []
    original = AIOKafkaConsumer.start

    async def start(self: AIOKafkaConsumer) -> None:
        started.append((self._group_id, self))
        await original(self)

    monkeypatch.setattr(AIOKafkaConsumer, "start", start)
    return started


async def test_the_final_commit_waits_for_the_stopped_loop_one_consumer_per_group_all_closed(
    make_config: ConfigFactory,
    broker: KafkaBroker,
    daemon_consumers: list[tuple[str, AIOKafkaConsumer]],
) -> None:
    """Before the fix the final commit ran beside the commit loop, which the final flush had
    just woken: both opened a consumer for the same group, and one was never closed."""
    await create_topic_with_records(broker.bootstrap)
    config = make_config(
        kafka_bootstrap_servers=broker.bootstrap, count_threshold=1000, time_threshold_s=3600
    )
    names = [f"orders-{n}" for n in range(3)]
    async with running_daemon(config):
        async with await SidecarClient.connect(config.socket_path) as c:
            for n, name in enumerate(names):
                for batch in range(1, 6):
                    p = kafka_progress(
                        query(n), batch, name=name, topic=TOPIC, partitions=PARTS, per_partition=10
                    )
                    assert (await c.progress(p)).applied
        # Nothing was flushed yet, so no group has a consumer: the stop's final flush makes
        # every checkpoint durable, and the final commit is each group's first.
        assert daemon_consumers == []
    opened = [group for group, _ in daemon_consumers]
    assert sorted(opened) == [f"spark-{name}" for name in names], "one consumer per group"
    assert [group for group, consumer in daemon_consumers if not consumer._closed] == []
    for name in names:
        async with group_reader(broker.bootstrap, f"spark-{name}") as reader:
            assert await committed(reader) == end_offsets_of(5)


class Loader(threading.Thread):
    """One client pipelining updates for its queries (a window at a time) until the daemon
    closes the connection; remembers the last batch acknowledged ``ok`` per query."""

    WINDOW = 64

    def __init__(self, path: str, queries: list[str]) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.queries = queries
        self.acked: dict[str, int] = {}
        self.count = 0
        self.refused: set[str] = set()

    def run(self) -> None:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(30)
        sock.connect(self.path)
        conn = ClientConnection()
        batch, rid = 0, 0
        try:
            while True:
                sent: dict[int, tuple[str, int]] = {}
                frames = []
                for _ in range(self.WINDOW // len(self.queries)):
                    batch += 1
                    for q in self.queries:
                        rid += 1
                        sent[rid] = (q, batch)
                        frames.append(progress_frame(q, batch, rid, f"load-{q[-2:]}"))
                sock.sendall(b"".join(frames))
                answered = 0
                while answered < len(sent):
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    for reply in conn.receive_data(data):
                        answered += 1
                        q, b = sent[int(str(reply.id))]
                        if reply.ok:
                            self.acked[q] = max(b, self.acked.get(q, -1))
                            self.count += 1
                        elif reply.error is not None:
                            self.refused.add(reply.error.code)
        except OSError:
            return  # reset while stopping: what was not answered was not acknowledged
        finally:
            sock.close()


def test_sigterm_under_heavy_load_flushes_every_ack_releases_every_lease_exits_0(
    daemon_env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path
) -> None:
    proc = start(procs, daemon_env, short_tmp)
    queries = [query(n) for n in range(20)]
    loaders = [Loader(proc.socket_path, queries[i::4]) for i in range(4)]
    for loader in loaders:
        loader.start()
    started = time.monotonic()

    def loaded() -> bool:
        return all(len(lo.acked) == len(lo.queries) for lo in loaders) and (
            sum(lo.count for lo in loaders) >= 20_000
        )

    deadline = started + 60
    while not loaded():
        assert time.monotonic() < deadline, "the load never got going"
        assert all(lo.is_alive() for lo in loaders), "a loader stopped before the signal"
        time.sleep(0.05)
    rate = sum(lo.count for lo in loaders) / (time.monotonic() - started)
    signalled = time.monotonic()
    proc.signal(signal.SIGTERM)
    assert proc.wait() == 0
    stopped_s = time.monotonic() - signalled
    for loader in loaders:
        loader.join(30)
        assert not loader.is_alive()
    acked = {q: b for lo in loaders for q, b in lo.acked.items()}
    assert len(acked) == 20
    blobs = {q: read_blob(daemon_env, q) for q in queries}
    behind = {
        q: (b, blobs[q].batch_id if blobs[q] else None)  # type: ignore[union-attr]
        for q, b in acked.items()
        if blobs[q] is None or blobs[q].batch_id < b  # type: ignore[union-attr]
    }
    assert behind == {}, "acknowledged but not in the blob: (acked, blob)"
    assert lease_states(daemon_env, queries) == dict.fromkeys(queries, "available")
    log = proc.log()
    summary = SUMMARY.search(log)
    assert summary is not None, log[-3000:]
    print(
        f"\nload: {sum(lo.count for lo in loaders)} acks at {rate:.0f}/s before SIGTERM; "
        f"exit after {stopped_s:.2f}s; {summary.group(0)}"
    )
