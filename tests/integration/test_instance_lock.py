"""The instance lock against a real redis-server (``sidecar.daemon.instance``): one live
daemon per identity, a dead predecessor on this host and port replaced at once, a live one
waited out, validity by the holder's own clock. The whole daemon killed and restarted, and
two live twins: tests/faults/test_instance.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from sidecar.buffer.redis_buffer import RedisBuffer
from sidecar.daemon.instance import LIVE_S, MARGIN_S, InstanceLock, identity, lease_id
from sidecar.telemetry.metrics import Metrics
from tests.helpers import Clock
from tests.services import RedisServer


@pytest.fixture
async def buffer(redis_server: RedisServer, namespace: str) -> AsyncIterator[RedisBuffer]:
    buffer = RedisBuffer(redis_server.url, namespace)
    yield buffer
    await buffer.aclose()


def lock(buffer: RedisBuffer, port: int | None, clock: Clock | None = None) -> InstanceLock:
    return InstanceLock(buffer, "pod-0", Metrics(), admin_port=lambda: port, clock=clock or Clock())


async def test_one_live_daemon_per_identity(buffer: RedisBuffer) -> None:
    first, twin = lock(buffer, 9400), lock(buffer, 9401)
    assert await first.claim() and first.held()
    assert await first.claim()  # a refresh
    assert not await twin.claim() and not twin.held()
    assert twin.other is not None and twin.other["port"] == 9400
    assert "held by another live daemon" in (twin.readiness() or "")
    raw = await buffer._redis.hget(buffer.keys.instance("pod-0"), "holder")
    assert raw is not None
    holder = json.loads(raw)
    assert holder["token"] == first.token and holder["port"] == 9400
    # A clean stop lets the twin in at once; a release by a stale token deletes nothing.
    await first.release()
    assert not first.held()
    assert not await first.claim()  # released: it claims no more (a refresh in flight neither)
    assert await twin.claim() and twin.readiness() is None
    assert not await buffer.release_instance("pod-0", first.token)
    assert not await first.claim()  # the twin holds it now


async def test_a_predecessor_on_this_host_and_admin_port_is_dead_and_replaced_at_once(
    buffer: RedisBuffer,
) -> None:
    killed = lock(buffer, 9400)
    assert await killed.claim()
    # Its container restarted: the new process bound the same admin port, which a live
    # predecessor would still hold.
    restarted = lock(buffer, 9400)
    assert await restarted.claim() and restarted.held()
    # Had it been alive after all (one host name in two network namespaces), it stops
    # writing, and does not take the lock back: only a first claim proves a holder dead.
    assert not await killed.claim() and not killed.held()
    assert await restarted.claim()
    # Without a bound port (0: ephemeral) nothing proves the holder dead: wait it out.
    unproven = lock(buffer, None)
    assert not await unproven.claim()
    # Nor does the same host name and port in another network namespace (a pod recreated
    # while the old one still runs on another node, with the pod's name as host name).
    elsewhere = lock(buffer, 9400)
    elsewhere._netns = "another-boot:4026532999"
    assert not await elsewhere.claim() and elsewhere.other is not None


async def test_validity_is_the_holders_own_clock_and_lapses_before_redis_ttl(
    buffer: RedisBuffer,
) -> None:
    clock = Clock()
    holder = lock(buffer, 9400, clock)
    assert await holder.claim()
    clock.now += LIVE_S - MARGIN_S - 0.1
    assert holder.held() and holder.live() == 1
    clock.now += 0.2  # not refreshed in time (Redis unreachable, a stalled loop)
    assert not holder.held() and holder.live() is None
    assert "not held" in (holder.readiness() or "")
    # Redis keeps it a write timeout (10 s) longer than the holder may start writes: a write
    # started last is over before anyone else could take the lock.
    ttl_ms = await buffer._redis.pttl(buffer.keys.instance("pod-0"))
    assert (LIVE_S - MARGIN_S) * 1000 + 10_000 < ttl_ms <= holder.ttl_s * 1000
    assert await holder.claim() and holder.live() == 2  # regained after a lapse: a new epoch


async def test_a_lock_lost_with_redis_data_is_taken_again_by_its_holder(
    buffer: RedisBuffer,
) -> None:
    holder = lock(buffer, 9400)
    assert await holder.claim()
    await buffer._redis.delete(buffer.keys.instance("pod-0"))  # FLUSHALL, a failover
    assert await holder.claim() and holder.held()


def test_lease_ids_are_stable_per_namespace_and_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    assert lease_id("ns", "pod-0") == lease_id("ns", "pod-0")
    assert len({lease_id("ns", "pod-0"), lease_id("ns", "pod-1"), lease_id("other", "pod-0")}) == 3
    monkeypatch.setenv("HOSTNAME", "driver-7f9c")
    assert identity(None) == "driver-7f9c" and identity("set") == "set"
