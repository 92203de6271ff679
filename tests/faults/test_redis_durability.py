"""What an ack is worth, against real redis-server processes: AOF on, off, or unknown; Redis
losing the namespace's data while the daemon runs (FLUSHALL, a restart without AOF)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis

from sidecar.daemon.app import Daemon
from sidecar.ops.client import SidecarClient
from tests.helpers import ConfigFactory, eventually, running_daemon, sample
from tests.services import DaemonProcess, RedisServer, ServiceError
from tests.sparkshapes import kafka_progress

Q1 = "5e1d0000-0000-4000-8000-0000000000a1"
Q2 = "5e1d0000-0000-4000-8000-0000000000a2"


@pytest.fixture
def volatile_redis() -> Iterator[RedisServer]:
    """A redis-server without any persistence: a restart loses everything."""
    with RedisServer(appendonly=False) as server:
        yield server


async def flushall(url: str) -> None:
    r = aioredis.Redis.from_url(url)
    try:
        await r.flushall()
    finally:
        await r.aclose()


async def test_appendonly_off_is_exported_and_warned_about(
    make_config: ConfigFactory, volatile_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(redis_url=volatile_redis.url)
    async with running_daemon(config) as daemon:
        assert sample(daemon, "checkpoint_sidecar_redis_aof_enabled") == 0
    assert "has appendonly off: an ack means 'in Redis memory'" in caplog.text


async def test_appendonly_on_is_exported(make_config: ConfigFactory) -> None:
    async with running_daemon(make_config()) as daemon:
        assert sample(daemon, "checkpoint_sidecar_redis_aof_enabled") == 1


@pytest.mark.parametrize(
    ("renamed", "gauge"), [(["CONFIG"], 1.0), (["CONFIG", "INFO"], None)], ids=["config", "info"]
)
async def test_a_redis_that_refuses_config_is_read_through_info_else_the_gauge_is_absent(
    make_config: ConfigFactory, renamed: list[str], gauge: float | None
) -> None:
    # Managed services often disable CONFIG but answer INFO; with neither, AOF is unknown.
    args = [arg for command in renamed for arg in ("--rename-command", command, "")]
    with RedisServer(extra_args=args) as locked:
        async with running_daemon(make_config(redis_url=locked.url)) as daemon:
            async with await SidecarClient.connect(daemon.config.socket_path) as c:
                assert (await c.progress(kafka_progress(Q1, 1))).applied
            value = daemon.metrics.registry.get_sample_value("checkpoint_sidecar_redis_aof_enabled")
    assert value == gauge


def test_require_aof_refuses_to_start_on_a_redis_without_it(
    daemon_env: dict[str, str],
    volatile_redis: RedisServer,
    short_tmp: Path,
    procs: list[DaemonProcess],
) -> None:
    env = {
        **daemon_env,
        "SIDECAR_REDIS_URL": volatile_redis.url,
        "SIDECAR_REDIS_REQUIRE_AOF": "true",
    }
    proc = DaemonProcess(env, short_tmp / "d.log")
    procs.append(proc)
    with pytest.raises(ServiceError, match="exited with code 2"):
        proc.start(timeout_s=30)
    assert "appendonly off and SIDECAR_REDIS_REQUIRE_AOF=true" in proc.log()
    assert "Traceback" not in proc.log()


async def test_redis_emptied_while_running_is_counted_and_names_what_was_lost(
    make_config: ConfigFactory, own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Nothing reaches the blobs (thresholds never met): the loss is total for Q1.
    config = make_config(redis_url=own_redis.url, count_threshold=1000, time_threshold_s=3600)
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            for batch in range(1, 6):
                assert (await c.progress(kafka_progress(Q1, batch))).applied
        await flushall(own_redis.url)
        await eventually(
            lambda: sample(daemon, "checkpoint_sidecar_redis_resets_total") == 1, timeout_s=5
        )
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(Q1, 6))).applied  # goes on
    lost = [r for r in caplog.records if "Redis lost the namespace's data" in r.getMessage()]
    assert len(lost) == 1 and lost[0].levelname == "ERROR"
    assert "(acked batch 5, now none)" in lost[0].getMessage()


def reset_counts(daemons: list[Daemon]) -> list[float]:
    return [sample(d, "checkpoint_sidecar_redis_resets_total") for d in daemons]


async def checked(daemons: list[Daemon], *, passes: int, since: list[int] | None = None) -> None:
    """Each daemon's durability watch completed ``passes`` more checks than ``since`` (by
    default: than now)."""
    start = since if since is not None else [d.durability.checks for d in daemons]
    await eventually(
        lambda: all(d.durability.checks >= s + passes for d, s in zip(daemons, start, strict=True)),
        timeout_s=15,
    )


async def test_two_daemons_of_one_namespace_share_its_marker_and_both_see_a_loss(
    make_config: ConfigFactory,
    own_redis: RedisServer,
    short_tmp: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A standby beside its owner (one Redis, one namespace): neither reads the other's start
    # as a loss. A FLUSHALL is a loss to both, counted once by each.
    first = make_config(redis_url=own_redis.url, count_threshold=1000, time_threshold_s=3600)
    second = make_config(
        redis_url=own_redis.url,
        socket_path=str(short_tmp / "second.sock"),
        count_threshold=1000,
        time_threshold_s=3600,
    )
    async with running_daemon(first) as one, running_daemon(second) as two:
        await checked([one, two], passes=3)
        assert reset_counts([one, two]) == [0, 0]
        assert not [r for r in caplog.records if "Redis lost" in r.getMessage()]
        await flushall(own_redis.url)
        await eventually(lambda: reset_counts([one, two]) == [1, 1], timeout_s=5)
        await checked([one, two], passes=3)
        assert reset_counts([one, two]) == [1, 1]


@pytest.mark.parametrize(("redis_fixture", "resets"), [("volatile_redis", 1), ("own_redis", 0)])
async def test_a_restart_without_aof_is_detected_and_one_with_aof_is_not(
    make_config: ConfigFactory, request: pytest.FixtureRequest, redis_fixture: str, resets: int
) -> None:
    server: RedisServer = request.getfixturevalue(redis_fixture)
    config = make_config(redis_url=server.url, count_threshold=1000, time_threshold_s=3600)
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(Q2, 1))).applied
        before = daemon.durability.checks
        await anyio.to_thread.run_sync(server.stop)
        await anyio.to_thread.run_sync(server.start)
        # two completed passes after the restart: the marker was looked at
        await checked([daemon], passes=2, since=[before])
        assert sample(daemon, "checkpoint_sidecar_redis_resets_total") == resets
