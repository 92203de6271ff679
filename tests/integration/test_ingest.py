"""Socket → Redis ingest against a real redis-server, daemon running in-process."""

from __future__ import annotations

import random
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.lowlevel
import msgspec
import pytest
import redis.asyncio as aioredis

from sidecar.buffer.keys import Keys
from sidecar.buffer.redis_buffer import Outcome, RedisBuffer
from sidecar.buffer.refusals import OOM
from sidecar.config import Config
from sidecar.ingest import server
from sidecar.ops.client import SidecarClient
from sidecar.wire import endpoint
from sidecar.wire.protocol import encode_request
from tests.helpers import (
    ConfigFactory,
    acli,
    checkpoint_of,
    eventually,
    metric_value,
    running_daemon,
    sample,
    scrape,
)
from tests.services import RedisServer, free_port
from tests.sparkshapes import idle_progress_spark34, kafka_progress, rate_progress


async def stored(config: Config, query_id: str) -> dict[bytes, bytes]:
    r = aioredis.Redis.from_url(config.redis_url)
    try:
        row = await r.hgetall(Keys(config.namespace).query(query_id))
        # redis-py types replies as bytes | str; without decode_responses they are bytes.
        return cast(dict[bytes, bytes], row)
    finally:
        await r.aclose()


@pytest.mark.parametrize("make_progress", [rate_progress, kafka_progress])
async def test_progress_round_trips_through_redis(
    make_config: ConfigFactory, make_progress: Callable[[str, int], dict[str, Any]]
) -> None:
    config = make_config()
    progress = make_progress("0b7f6c9e-query", 7)
    async with running_daemon(config), await SidecarClient.connect(config.socket_path) as c:
        reply = await c.progress(progress)
        assert (reply.ok, reply.applied, reply.id) == (True, True, 1)

        row = await stored(config, "0b7f6c9e-query")
        assert row[b"batch_id"] == b"7"
        assert row[b"pending"] == b"1"
        doc = msgspec.json.decode(row[b"checkpoint"])
        assert doc["run_id"] == progress["runId"]
        assert [s["end_offset"] for s in doc["sources"]] == [
            s["endOffset"] for s in progress["sources"]
        ]

        got = await c.get("0b7f6c9e-query")
        assert got.ok and got.checkpoint is not None
        assert got.checkpoint["batch_id"] == 7
        assert got.checkpoint["name"] == progress["name"]
        assert got.checkpoint["timestamp"] == progress["timestamp"]
        for src, spark in zip(got.checkpoint["sources"], progress["sources"], strict=True):
            assert src["description"] == spark["description"]
            assert src["start_offset"] == spark["startOffset"]
            assert src["end_offset"] == spark["endOffset"]
            assert src["latest_offset"] == spark["latestOffset"]


async def test_get_unknown_query_is_null(make_config: ConfigFactory) -> None:
    config = make_config()
    async with running_daemon(config), await SidecarClient.connect(config.socket_path) as c:
        reply = await c.get("never-seen")
    assert reply.ok and reply.checkpoint is None


async def test_stale_and_duplicate_batches_are_not_applied(make_config: ConfigFactory) -> None:
    config = make_config()
    async with running_daemon(config), await SidecarClient.connect(config.socket_path) as c:
        results = [(await c.progress(kafka_progress("q", b))).applied for b in (5, 5, 4, 0, 6)]
        row = await stored(config, "q")
    assert results == [True, False, False, False, True]
    assert row[b"batch_id"] == b"6"
    assert msgspec.json.decode(row[b"checkpoint"])["batch_id"] == 6
    assert row[b"pending"] == b"2"  # only applied updates count towards the next flush


@pytest.mark.parametrize("ack_mode", ["redis", "blob"])
async def test_progress_without_end_offsets_is_acknowledged_and_never_stored(
    make_config: ConfigFactory, ack_mode: str
) -> None:
    # blob mode: the reply comes at once, not as not_durable after the timeout (no blob will
    # ever hold such an update, so waiting for one would make clients resend it forever).
    config = make_config(ack_mode=ack_mode, blob_ack_timeout_s=30, count_threshold=1)
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            with anyio.fail_after(5):
                reply = await c.progress(idle_progress_spark34("q-idle", 0))
            assert (reply.ok, reply.applied, reply.error) == (True, False, None)
            assert (await c.get("q-idle")).checkpoint is None
            assert await stored(config, "q-idle") == {}

            # An idle trigger after batch 3 comes as batch 4: it must neither replace batch 3's
            # offsets with nulls nor make the real batch 4 look stale.
            assert (await c.progress(kafka_progress("q-idle", 3))).applied is True
            with anyio.fail_after(5):
                reply = await c.progress(idle_progress_spark34("q-idle", 4))
            assert (reply.ok, reply.applied) == (True, False)
            got = await c.get("q-idle")
            assert got.checkpoint is not None and got.checkpoint["batch_id"] == 3
            end = kafka_progress("q-idle", 3)["sources"][0]["endOffset"]
            assert got.checkpoint["sources"][0]["end_offset"] == end
            assert (await c.progress(kafka_progress("q-idle", 4))).applied is True
        _, text = await anyio.to_thread.run_sync(scrape, daemon)
    assert metric_value(text, "checkpoint_sidecar_updates_total", result="no_offsets") == 2
    assert metric_value(text, "checkpoint_sidecar_updates_total", result="rejected") == 0


async def test_batch_ids_beyond_double_precision_stay_ordered(make_config: ConfigFactory) -> None:
    config = make_config()
    big = 2**60
    async with running_daemon(config), await SidecarClient.connect(config.socket_path) as c:
        assert (await c.progress(rate_progress("q", big + 1))).applied is True
        # big and big+1 are the same double; a float comparison would call this "not stale"
        # and a string comparison of unequal lengths would get 9 vs 10 wrong.
        assert (await c.progress(rate_progress("q", big))).applied is False
        assert (await c.progress(rate_progress("q", 9))).applied is False
        assert (await stored(config, "q"))[b"batch_id"] == str(big + 1).encode()


async def test_concurrent_connections_never_regress_a_query(make_config: ConfigFactory) -> None:
    config = make_config()
    batches = list(range(300))
    seen: list[int] = []
    done = anyio.Event()

    async def writer(seed: int) -> None:
        order = batches[:]
        random.Random(seed).shuffle(order)
        async with await SidecarClient.connect(config.socket_path) as c:
            for start in range(0, len(order), 10):
                chunk = order[start : start + 10]
                replies = await c.send_many(
                    [("progress", {"progress": rate_progress("race", b)}) for b in chunk]
                )
                assert all(r.ok for r in replies)

    async def watcher() -> None:
        r = aioredis.Redis.from_url(config.redis_url)
        key = Keys(config.namespace).query("race")
        while not done.is_set():
            value = await r.hget(key, "batch_id")
            if value is not None:
                seen.append(int(value))
            await anyio.lowlevel.checkpoint()
        await r.aclose()

    async with running_daemon(config):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watcher)
            async with anyio.create_task_group() as writers:
                for seed in range(8):
                    writers.start_soon(writer, seed)
            done.set()
        row = await stored(config, "race")
    assert row[b"batch_id"] == b"299"
    assert seen == sorted(seen), "the stored batch id went backwards"
    assert len(seen) > 10


async def test_several_frames_in_one_write_and_one_frame_in_many(
    make_config: ConfigFactory,
) -> None:
    config = make_config()
    frames = b"".join(
        encode_request("progress", i, progress=kafka_progress("q", i)) for i in range(5)
    )
    single = encode_request("progress", "split", progress=kafka_progress("q", 9))
    async with running_daemon(config), await SidecarClient.connect(config.socket_path) as c:
        await c.send_raw(frames)
        replies = await c.receive(5)
        assert [(r.id, r.applied) for r in replies] == [(i, True) for i in range(5)]
        for i in range(0, len(single), 7):
            await c.send_raw(single[i : i + 7])
            await anyio.lowlevel.checkpoint()
        (reply,) = await c.receive(1)
        assert (reply.id, reply.applied) == ("split", True)
        assert (await stored(config, "q"))[b"batch_id"] == b"9"


BAD_LINES = [
    (b"{nope\n", None, "bad_json"),
    (b"\xff\xfe\n", None, "bad_json"),
    (b"[1,2]\n", None, "bad_request"),
    (b'{"id":"a"}\n', "a", "bad_request"),
    (b'{"op":"progress","id":"b","progress":{"id":"q","batchId":"x"}}\n', "b", "bad_request"),
    (b'{"op":"get","id":"c"}\n', "c", "bad_request"),
    (b'{"op":"flush","id":"d"}\n', "d", "unknown_op"),
]


async def test_bad_requests_get_errors_and_lose_nothing(make_config: ConfigFactory) -> None:
    config = make_config()
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress("q", 3))).applied
            for line, rid, code in BAD_LINES:
                await c.send_raw(line)
                (reply,) = await c.receive(1)
                assert (reply.ok, reply.id) == (False, rid)
                assert reply.error is not None and reply.error.code == code
                assert reply.error.message
            # the same connection still works, and the stored update is untouched
            assert (await c.ping()).ok
            got = await c.get("q")
            assert got.checkpoint is not None and got.checkpoint["batch_id"] == 3
            assert (await c.progress(kafka_progress("q", 4))).applied
        _, text = await anyio.to_thread.run_sync(scrape, daemon)
    assert metric_value(text, "checkpoint_sidecar_bad_requests_total", code="bad_json") == 2
    assert metric_value(text, "checkpoint_sidecar_bad_requests_total", code="bad_request") == 4
    assert metric_value(text, "checkpoint_sidecar_bad_requests_total", code="unknown_op") == 1
    assert metric_value(text, "checkpoint_sidecar_updates_total", result="rejected") == 1
    assert metric_value(text, "checkpoint_sidecar_updates_total", result="applied") == 2


async def test_oversized_frame_gets_error_then_close(make_config: ConfigFactory) -> None:
    config = make_config(max_frame_bytes=4096)
    async with running_daemon(config):
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(rate_progress("q", 1))).applied
            await c.send_raw(b'{"op":"ping","pad":"' + b"x" * 5000)
            (reply,) = await c.receive(1)
            assert reply.error is not None and reply.error.code == "frame_too_large"
            with pytest.raises(anyio.EndOfStream):
                await c.receive(1)
        # other connections and stored updates are unaffected
        async with await SidecarClient.connect(config.socket_path) as c:
            got = await c.get("q")
            assert got.checkpoint is not None and got.checkpoint["batch_id"] == 1


async def test_metrics_after_known_traffic(make_config: ConfigFactory) -> None:
    config = make_config()
    async with running_daemon(config) as daemon:
        async with (
            await SidecarClient.connect(config.socket_path) as c1,
            await SidecarClient.connect(config.socket_path) as c2,
        ):
            for b in range(4):
                await c1.progress(rate_progress("a", b))
            await c2.progress(rate_progress("a", 1))  # stale
            await c2.send_raw(b"garbage\n")
            await c2.receive(1)
            await eventually(lambda: sample(daemon, "checkpoint_sidecar_connections") == 2)
            status, text = await anyio.to_thread.run_sync(scrape, daemon)
            assert status == 200
            assert metric_value(text, "checkpoint_sidecar_connections") == 2
        assert metric_value(text, "checkpoint_sidecar_updates_total", result="applied") == 4
        assert metric_value(text, "checkpoint_sidecar_updates_total", result="stale") == 1
        assert metric_value(text, "checkpoint_sidecar_updates_total", result="rejected") == 0
        assert metric_value(text, "checkpoint_sidecar_ack_seconds_count") == 5
        assert metric_value(text, "checkpoint_sidecar_bad_requests_total", code="bad_json") == 1
        assert metric_value(text, "checkpoint_sidecar_redis_up") == 1
        await eventually(lambda: daemon.server.active_connections == 0)
        _, text = await anyio.to_thread.run_sync(scrape, daemon)
        assert metric_value(text, "checkpoint_sidecar_connections") == 0


async def test_health_and_readiness(make_config: ConfigFactory) -> None:
    config = make_config()
    async with running_daemon(config) as daemon:
        assert await anyio.to_thread.run_sync(scrape, daemon, "/healthz") == (200, "ok\n")
        assert await anyio.to_thread.run_sync(scrape, daemon, "/readyz") == (200, "ready\n")


async def test_redis_outage_gives_unavailable_and_recovers(
    own_redis: RedisServer, make_config: ConfigFactory
) -> None:
    config = make_config(redis_url=own_redis.url, redis_timeout_s=0.5)
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress("q", 1))).applied

            await anyio.to_thread.run_sync(own_redis.stop)
            reply = await c.progress(kafka_progress("q", 2))
            assert not reply.ok and reply.error is not None
            assert reply.error.code == "unavailable"
            assert "retry" in reply.error.message
            status, body = await anyio.to_thread.run_sync(scrape, daemon, "/readyz")
            assert status == 503 and "is unreachable" in body
            assert (await c.ping()).ok  # the connection survives the outage

            await anyio.to_thread.run_sync(own_redis.start)
            with anyio.fail_after(10):
                while True:
                    reply = await c.progress(kafka_progress("q", 2))
                    if reply.ok:
                        break
                    await anyio.sleep(0.1)
            assert reply.applied is True
            got = await c.get("q")
            assert got.checkpoint is not None and got.checkpoint["batch_id"] == 2
        _, text = await anyio.to_thread.run_sync(scrape, daemon)
    assert metric_value(text, "checkpoint_sidecar_updates_total", result="rejected") >= 1
    assert metric_value(text, "checkpoint_sidecar_redis_up") == 1


async def test_connections_pooled_before_a_redis_restart_are_replaced_not_failed(
    own_redis: RedisServer,
) -> None:
    """Each idle pooled connection the restarted server closed is replaced at checkout: no
    call fails after Redis is back (redis-py 8.1 with maintenance notifications on fails
    one call per such connection: redis/redis-py#4252)."""
    buffer = RedisBuffer(own_redis.url, "ns", timeout_s=0.5)
    try:
        assert await buffer.apply([checkpoint_of("q", 1)]) == [Outcome.APPLIED]
        calls = 4  # at once: the pool holds this many connections
        assert await gather_gets(buffer, calls) == [None] * calls
        await anyio.to_thread.run_sync(own_redis.stop)
        await anyio.to_thread.run_sync(own_redis.start)
        assert await gather_gets(buffer, calls) == [None] * calls
        assert buffer.available is True
    finally:
        await buffer.aclose()


async def gather_gets(buffer: RedisBuffer, calls: int) -> list[BaseException | None]:
    """``calls`` reads of query q at once: each one's error, or None when it read batch 1."""
    out: list[BaseException | None] = [None] * calls

    async def one(i: int) -> None:
        try:
            got = await buffer.get("q")
            assert got is not None and msgspec.json.decode(got)["batch_id"] == 1
        except Exception as exc:  # each call's outcome is the result
            out[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(calls):
            tg.start_soon(one, i)
    return out


async def test_redis_refusing_writes_is_unavailable_not_fatal(
    own_redis: RedisServer, make_config: ConfigFactory
) -> None:
    config = make_config(redis_url=own_redis.url)
    admin = aioredis.Redis.from_url(own_redis.url)
    async with running_daemon(config) as daemon:
        c = await SidecarClient.connect(config.socket_path)
        assert (await c.progress(kafka_progress("q", 1))).applied
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.config_set("maxmemory", "1")  # every write now fails with OOM
        reply = await c.progress(kafka_progress("q", 2))
        assert reply.error is not None and reply.error.code == "unavailable"
        assert OOM in reply.error.message  # named, with Redis' own words
        status, body = await anyio.to_thread.run_sync(scrape, daemon, "/readyz")
        assert status == 503 and OOM in body
        doctor = (await acli(config, "doctor")).stdout
        assert any(OOM in line and "-> raise maxmemory" in line for line in doctor.splitlines())
        await admin.config_set("maxmemory", "0")
        assert (await c.progress(kafka_progress("q", 2))).applied
        await c.aclose()
    await admin.aclose()


async def test_the_tcp_listener_serves_a_client_with_the_published_token(
    make_config: ConfigFactory,
) -> None:
    """By default the daemon also listens on a free loopback port, published with a token
    beside the socket (mode and group of the socket's readers); a client that sends the token
    first is served, and the file goes at a clean stop."""
    config = make_config(socket_mode="660")
    published = anyio.Path(endpoint.path_for(config.socket_path))
    async with running_daemon(config) as daemon:
        found = endpoint.decode(await published.read_bytes())
        assert found.port == daemon.server.tcp_port and found.host == "127.0.0.1"
        assert stat.S_IMODE((await published.stat()).st_mode) == 0o640
        socket_file = await anyio.Path(config.socket_path).stat()
        assert (await published.stat()).st_gid == socket_file.st_gid
        async with await SidecarClient.connect(config.socket_path, tcp=True) as c:
            assert (await c.progress(rate_progress("tcp", 1))).applied
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.get("tcp")).checkpoint is not None
            # On the Unix socket auth is not needed, and harmless.
            assert (await c.request("auth", token="anything")).ok
    assert not await published.exists()


async def test_a_fixed_tcp_port_is_used_and_published(make_config: ConfigFactory) -> None:
    port = free_port()
    config = make_config(tcp_port=port)
    async with running_daemon(config) as daemon:
        assert daemon.server.tcp_port == port
        published = anyio.Path(endpoint.path_for(config.socket_path))
        assert endpoint.decode(await published.read_bytes()).port == port
        async with await SidecarClient.connect(config.socket_path, tcp=True) as c:
            assert (await c.progress(rate_progress("tcp", 1))).applied


async def test_two_daemons_on_one_host_listen_on_ports_of_their_own(
    make_config: ConfigFactory, short_tmp: Path
) -> None:
    first = make_config()
    second = make_config(socket_path=str(short_tmp / "second.sock"))
    async with running_daemon(first) as one, running_daemon(second) as two:
        assert None not in (one.server.tcp_port, two.server.tcp_port)
        assert one.server.tcp_port != two.server.tcp_port
        for config in (first, second):
            async with await SidecarClient.connect(config.socket_path, tcp=True) as c:
                assert (await c.request("ping")).ok


async def test_tcp_off_publishes_nothing_and_removes_a_predecessors_file(
    make_config: ConfigFactory,
) -> None:
    config = make_config(tcp_port="off")
    stale = anyio.Path(endpoint.path_for(config.socket_path))
    await stale.write_bytes(endpoint.encode(endpoint.Endpoint("127.0.0.1", 9, "old", 1)))
    async with running_daemon(config) as daemon:
        assert daemon.server.tcp_port is None
        assert not await stale.exists()


@pytest.mark.parametrize(
    "first",
    [
        b'{"op":"progress","id":1,"progress":{}}\n',
        b'{"op":"ping","id":1}\n',
        b'{"op":"retire","id":1,"name":"q"}\n',
        b'{"op":"auth","id":1,"token":"not-the-token"}\n',
        b"not json\n",
    ],
    ids=["progress", "ping", "admin", "wrong-token", "bad-line"],
)
async def test_a_tcp_client_without_the_token_is_refused_and_disconnected(
    make_config: ConfigFactory, first: bytes
) -> None:
    config = make_config(admin_ops="true", admin_ops_tcp="true")
    async with running_daemon(config) as daemon:
        assert daemon.server.tcp_port is not None
        async with await SidecarClient.connect(tcp_port=daemon.server.tcp_port) as c:
            # What follows the refused request is never read: the connection is closed.
            await c.send_raw(
                first + encode_request("progress", 2, progress=rate_progress("tcp", 1))
            )
            (reply,) = await c.receive(1)
            assert reply.error is not None and reply.error.code == "unauthenticated"
            assert endpoint.path_for(config.socket_path) in reply.error.message
            with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                await c.receive(1)
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.get("tcp")).checkpoint is None  # nothing was stored
        assert sample(daemon, "checkpoint_sidecar_bad_requests_total", code="unauthenticated") == 1


async def test_a_tcp_client_that_sends_nothing_is_closed_after_the_auth_timeout(
    make_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "AUTH_TIMEOUT_S", 0.2)
    config = make_config()
    async with running_daemon(config) as daemon:
        assert daemon.server.tcp_port is not None
        async with await SidecarClient.connect(tcp_port=daemon.server.tcp_port) as c:
            (reply,) = await c.receive(1)
            assert reply.error is not None and reply.error.code == "unauthenticated"
            assert "no auth within 0.2s" in reply.error.message
            with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                await c.receive(1)
        await eventually(lambda: daemon.server.active_connections == 0)
