"""The fault sweep (issue #9): one fault per test, injected under load at the lowest real
layer, against real processes (the daemon, redis-server, Azurite).

Each test drives the daemon with :func:`tests.faults.load.run_load` and checks its invariant:
every update acknowledged ``ok`` is durable after recovery (in Redis, and in the blob once
flushed), and no query's checkpoint ever moves backwards in Redis, in the blob, or in a
``get`` reply. Each prints its numbers (``-s``): updates acked, checkpoints durable, time to
recover.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from signal import SIGKILL

import anyio
import pytest
import redis.asyncio as aioredis
from azure.core.exceptions import ResourceExistsError
from azure.storage.blob.aio import BlobLeaseClient, BlobServiceClient

from sidecar.buffer.keys import Keys
from tests.faults.load import Load, metric, readyz, run_load
from tests.services import Azurite, DaemonProcess, RedisServer

log = logging.getLogger("tests.sweep")

#: Flush often, so that flushes are in flight whenever a fault strikes.
SWEEP = {"SIDECAR_COUNT_THRESHOLD": "25", "SIDECAR_TIME_THRESHOLD_S": "0.2"}
#: The store outage the issue asks for.
OUTAGE_S = 30.0
HELD = "checkpoint_sidecar_lease_held"
FLUSHES = "checkpoint_sidecar_flushes_total"
STORE_UP = "checkpoint_sidecar_store_up"
THIEF = "00000000-0000-4000-8000-0000000000ff"


@pytest.fixture
def own_azurite() -> Iterator[Azurite]:
    """An Azurite of this test's own, to stop and restart."""
    with Azurite() as server:
        yield server


async def start(procs: list[DaemonProcess], env: dict[str, str], log_path: Path) -> DaemonProcess:
    proc = DaemonProcess(env, log_path)
    procs.append(proc)
    await anyio.to_thread.run_sync(proc.start)
    return proc


async def until(
    what: str, predicate: Callable[[], Awaitable[bool] | bool], timeout_s: float = 30
) -> float:
    """Wait until ``predicate()`` (sync or async) is true; the seconds it took."""
    started = time.monotonic()
    while True:
        value = predicate()
        if not isinstance(value, bool):
            value = await value
        if value:
            break
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await anyio.sleep(0.05)
    return time.monotonic() - started


def report(fault: str, load: Load, **numbers: float) -> None:
    durable = len(load.queries)  # wait_durable returned: every query's blob holds its acks
    timings = ", ".join(f"{k} {v:.1f}s" for k, v in numbers.items())
    line = f"sweep [{fault}]: {load.acks} acked, {durable}/{durable} durable; {timings}; " + (
        load.summary()
    )
    log.info("%s", line)
    print(line)


async def ready(proc: DaemonProcess) -> bool:
    return (await readyz(proc) or (0, ""))[0] == 200


@pytest.mark.slow
async def test_kill_9_of_the_daemon_under_load(
    daemon_env: dict[str, str], short_tmp: Path, procs: list[DaemonProcess]
) -> None:
    env = {**daemon_env, **SWEEP}
    first = await start(procs, env, short_tmp / "first.log")
    async with run_load(env) as load:
        await load.wait_acks(1500)
        await load.wait_every_blob()
        before = load.acked()
        # Something acknowledged and not flushed yet (on a starved machine the senders can
        # stall until every flush has landed): the kill leaves the next daemon a fault.
        await load.wait_pending()
        first.signal(SIGKILL)  # mid-load: windows unanswered, flushes in flight
        assert await anyio.to_thread.run_sync(first.wait) == -SIGKILL
        killed_at = time.monotonic()
        acks_at_kill = load.acks

        second = DaemonProcess(first.settings, short_tmp / "second.log")
        procs.append(second)
        await anyio.to_thread.run_sync(lambda: second.start(wait=False))
        await load.wait_each_acked_above(before)  # the senders reconnected and resent
        acks_back_s = time.monotonic() - killed_at
        # Ready once the dead daemon's lease has expired and the new one holds every lease.
        await anyio.to_thread.run_sync(second.wait_ready, 60)
        ready_s = time.monotonic() - killed_at
        await load.stop_sending()
        await load.wait_durable()
        recovered_s = time.monotonic() - killed_at
    load.check()
    recovering = re.search(r"recovering (\d+) query", second.log())
    assert recovering, "the kill left no acknowledged update unflushed: no fault to recover"
    report(
        "kill -9 daemon",
        load,
        acks_resumed_after=acks_back_s,
        ready_after=ready_s,
        all_durable_after=recovered_s,
    )
    print(f"  acked before the kill: {acks_at_kill}; queries recovered: {recovering[1]}")
    assert await anyio.to_thread.run_sync(second.stop) == 0


async def test_kill_9_of_redis_with_aof_under_load(
    daemon_env: dict[str, str],
    own_redis: RedisServer,
    short_tmp: Path,
    procs: list[DaemonProcess],
) -> None:
    env = {**daemon_env, **SWEEP, "SIDECAR_REDIS_URL": own_redis.url}
    proc = await start(procs, env, short_tmp / "daemon.log")
    keys = Keys(env["SIDECAR_NAMESPACE"])
    async with run_load(env) as load:
        await load.wait_acks(1500)
        await load.wait_every_blob()
        await anyio.to_thread.run_sync(own_redis.stop, SIGKILL)
        killed_at = time.monotonic()
        acked_at_kill = load.acked()  # nothing is acked while Redis is down
        errors = load.errors["unavailable"]
        # Down long enough for the senders' resends and the flusher's passes to fail too.
        await until(
            "unavailable replies and failed flush passes",
            lambda: (
                load.errors["unavailable"] > errors + 500 and "flush check skipped" in proc.log()
            ),
        )
        status, body = await readyz(proc) or (0, "")
        assert status == 503 and "is unreachable" in body, body
        assert proc.running

        await anyio.to_thread.run_sync(own_redis.start)  # same port, same data dir (AOF)
        restarted_at = time.monotonic()
        r = aioredis.Redis.from_url(own_redis.url)
        try:
            for query_id, batch in acked_at_kill.items():
                stored = await r.hget(keys.query(query_id), "batch_id")
                assert stored is not None and int(stored) >= batch, (query_id, stored, batch)
        finally:
            await r.aclose()
        # The daemon reconnected by itself: acks and readiness come back, no restart.
        await load.wait_each_acked_above(load.acked())
        acks_back_s = time.monotonic() - restarted_at
        await until("ready", lambda: ready(proc))
        await load.stop_sending()
        await load.wait_durable()
        recovered_s = time.monotonic() - restarted_at
        resets = await metric(proc, "checkpoint_sidecar_redis_resets_total")
    load.check()
    assert resets == 0, "with AOF the restarted Redis kept the namespace"
    text = proc.log()
    assert text.rfind("is reachable") > text.find("is unavailable") > 0, "outage logged, then end"
    report(
        "kill -9 redis (AOF)",
        load,
        down_for=restarted_at - killed_at,
        acks_resumed_after_restart=acks_back_s,
        all_durable_after_restart=recovered_s,
    )
    assert await anyio.to_thread.run_sync(proc.stop) == 0


@pytest.mark.slow
async def test_blob_store_down_30s_under_load(
    daemon_env: dict[str, str],
    own_azurite: Azurite,
    short_tmp: Path,
    procs: list[DaemonProcess],
) -> None:
    env = {
        **daemon_env,
        **SWEEP,
        "AZURE_STORAGE_CONNECTION_STRING": own_azurite.connection_string,
        "SIDECAR_WRITE_TIMEOUT_S": "1",
    }
    proc = await start(procs, env, short_tmp / "daemon.log")
    async with run_load(env) as load:
        await load.wait_acks(1500)
        await load.wait_every_blob()
        await anyio.to_thread.run_sync(own_azurite.stop)  # same port and data dir later
        down_at = time.monotonic()
        acks_at_stop = load.acks

        # The gauge says it within seconds (failed writes; SIDECAR_WRITE_TIMEOUT_S 1), while
        # acks go on from Redis and the pod stays ready: a store outage alone is not a reason
        # to take the driver's pod out of service. The leases lapse unrenewed (their
        # validity: SIDECAR_LEASE_DURATION_S 15 minus a 3 s margin) and nothing is written.
        first = load.queries[0]
        store_down_s = await until("store_up 0", lambda: _metric_is(proc, STORE_UP, 0))
        errors = await metric(proc, FLUSHES, result="error")
        assert errors is not None and errors > 0
        lapsed = {"query": first.name}
        lapsed_s = await until("the leases lapse", lambda: _metric_is(proc, HELD, 0, lapsed))
        await anyio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))  # the outage
        acked_while_down = load.acks - acks_at_stop
        assert acked_while_down > 0 and load.errors.total() == 0, load.summary()
        assert (await readyz(proc) or (0, ""))[0] == 200
        assert await metric(proc, STORE_UP) == 0

        await anyio.to_thread.run_sync(own_azurite.start)
        up_at = time.monotonic()
        store_up_s = await until("store_up 1", lambda: _metric_is(proc, STORE_UP, 1), 40)
        await load.stop_sending()
        await load.wait_durable()
        caught_up_s = time.monotonic() - up_at
    load.check()
    report(
        f"blob store down {OUTAGE_S:.0f}s",
        load,
        store_up_0_after=store_down_s,
        leases_lapsed_after=lapsed_s,
        outage=up_at - down_at,
        store_up_1_after_restart=store_up_s,
        all_durable_after_restart=caught_up_s,
    )
    print(f"  acked while the store was down: {acked_while_down}")
    assert await anyio.to_thread.run_sync(proc.stop) == 0


async def _not_ready(proc: DaemonProcess, reason: str) -> bool:
    answer = await readyz(proc)
    return answer is not None and answer[0] == 503 and reason in answer[1]


async def _metric_is(
    proc: DaemonProcess, name: str, value: float, labels: dict[str, str] | None = None
) -> bool:
    return await metric(proc, name, **(labels or {})) == value


async def test_a_lease_stolen_under_load(
    daemon_env: dict[str, str], azurite: Azurite, short_tmp: Path, procs: list[DaemonProcess]
) -> None:
    env = {**daemon_env, **SWEEP}
    proc = await start(procs, env, short_tmp / "daemon.log")
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    async with service, run_load(env) as load:
        victim, others = load.queries[0], load.queries[1:]
        await load.wait_acks(1500)
        await load.wait_every_blob()
        blob = service.get_blob_client(
            env["SIDECAR_CONTAINER"], f"{env['SIDECAR_NAMESPACE']}/{victim.query_id}.json"
        )
        thief = BlobLeaseClient(blob, lease_id=THIEF)
        while True:  # break the daemon's lease, take it (unless the daemon is quicker)
            await BlobLeaseClient(blob).break_lease(lease_break_period=0)
            try:
                await thief.acquire(lease_duration=60)
                break
            except ResourceExistsError:
                continue
        stolen_at = time.monotonic()
        # The thief writes under its lease: from now on the blob must stay exactly this.
        body = await (await blob.download_blob()).readall()
        props = await blob.get_blob_properties()
        written = await blob.upload_blob(
            body,
            overwrite=True,
            lease=thief,
            metadata=props.metadata,
            content_settings=props.content_settings,
        )
        thief_batch = json.loads(body)["batch_id"]
        others_at_theft = {q.query_id: q.acked for q in others}

        async def blob_untouched() -> None:
            now = await blob.get_blob_properties()
            assert now.etag == written["etag"], "the daemon wrote without the lease"

        async def noticed() -> bool:
            await blob_untouched()
            return await metric(proc, HELD, query=victim.name) == 0 and await _not_ready(
                proc, victim.name
            )

        lost_s = await until("the lease shown lost", noticed)
        not_owned = await metric(proc, FLUSHES, result="not_owned") or 0.0

        async def refused_while_acked() -> bool:
            # Acks go on and flush passes keep finding the lease elsewhere, well past
            # what the thief wrote; the other queries keep flushing.
            await blob_untouched()
            flushed = await load.blob_batches()
            return (
                victim.acked > thief_batch + 500
                and (await metric(proc, FLUSHES, result="not_owned") or 0.0) >= not_owned + 10
                and all((flushed[q] or -1) > batch for q, batch in others_at_theft.items())
            )

        await until("flushes refused while acks go on", refused_while_acked)
        assert await (await blob.download_blob()).readall() == body
        held_for = time.monotonic() - stolen_at

        await thief.release()
        released_at = time.monotonic()
        await until("the lease held again", lambda: _held(proc, victim.name))
        await until("/readyz 200", lambda: ready(proc))
        ready_s = time.monotonic() - released_at
        await load.stop_sending()
        await load.wait_durable()
        caught_up_s = time.monotonic() - released_at
    load.check()
    report(
        "lease stolen",
        load,
        noticed_after=lost_s,
        stolen_for=held_for,
        ready_after_release=ready_s,
        all_durable_after_release=caught_up_s,
    )
    assert await anyio.to_thread.run_sync(proc.stop) == 0


async def _held(proc: DaemonProcess, label: str) -> bool:
    return await metric(proc, HELD, query=label) == 1


async def test_two_daemons_on_one_namespace_under_load(
    daemon_env: dict[str, str], short_tmp: Path, procs: list[DaemonProcess]
) -> None:
    env_a = {**daemon_env, **SWEEP}
    env_b = {**env_a, "SIDECAR_SOCKET_PATH": str(short_tmp / "b.sock")}
    async with anyio.create_task_group() as tg:  # start both at once: both race for leases
        tg.start_soon(start, procs, env_a, short_tmp / "a.log")
        tg.start_soon(start, procs, env_b, short_tmp / "b.log")
    daemons = list(procs)
    paths = [env_a["SIDECAR_SOCKET_PATH"], env_b["SIDECAR_SOCKET_PATH"]]
    async with run_load(env_a, paths, connections=4) as load:
        await load.wait_acks(3000)
        await load.wait_every_blob()
        await until("acks from both", lambda: min(load.acks_by_socket[p] for p in paths) > 500)

        async def one_owner_each() -> bool:
            for q in load.queries:
                held = [await metric(d, HELD, query=q.name) or 0.0 for d in daemons]
                if sorted(held) != [0.0, 1.0]:
                    return False
            return True

        await until("exactly one owner per query", one_owner_each)
        await load.stop_sending()
        durable_s = await load.wait_durable()
        assert await one_owner_each()
        assert load.errors.total() == 0, load.summary()
        # Every update was acked: the blob ends at the newest batch sent, which was acked.
        assert await load.blob_batches() == load.acked()
    load.check()
    owners = {
        d.socket_path: [q.name for q in load.queries if await _held(d, q.name)] for d in daemons
    }
    report("two daemons, one namespace", load, all_durable_after_stop=durable_s)
    print(f"  acked per daemon: {dict(load.acks_by_socket)}; leases: {owners}")
    for d in daemons:
        assert await anyio.to_thread.run_sync(d.stop) == 0
