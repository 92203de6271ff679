"""The lease lifecycle: the transition table (pure) and leases against real Azurite."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest

from sidecar.flush.lease import RENEW_JITTER, IllegalTransition, LeaseState, QueryLease
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore
from sidecar.telemetry.metrics import Metrics
from tests.helpers import (
    Clock,
    ConfigFactory,
    eventually,
    lease_manager,
    metric_value,
    running_daemon,
    sample,
    scrape,
)
from tests.sparkshapes import rate_progress

RENEWALS = "checkpoint_sidecar_lease_renewals_total"
OURS = "11111111-2222-3333-4444-555555555555"
THEIRS = "99999999-8888-7777-6666-555555555555"


def _lease_in(state: LeaseState) -> QueryLease:
    lease = QueryLease("q", "q")
    if state is not LeaseState.ACQUIRING:
        lease.acquired(1, 0.0, 15, 5)
    if state in (LeaseState.LOST, LeaseState.RELEASED):
        lease.lost("test", 0.0)
    if state is LeaseState.RELEASED:
        lease.released("test")
    assert lease.state is state
    return lease


@pytest.mark.parametrize(
    ("start", "move"),
    [
        (LeaseState.RELEASED, lambda lease: lease.acquiring("test")),
        (LeaseState.RELEASED, lambda lease: lease.acquired(2, 0.0, 15, 5)),
        (LeaseState.LOST, lambda lease: lease.acquired(2, 0.0, 15, 5)),  # only via ACQUIRING
        (LeaseState.HELD, lambda lease: lease.acquiring("test")),
    ],
)
def test_illegal_transitions_are_refused(
    start: LeaseState, move: Callable[[QueryLease], None]
) -> None:
    lease = _lease_in(start)
    with pytest.raises(IllegalTransition):
        move(lease)
    assert lease.state is start


def test_the_normal_lifecycle_is_allowed() -> None:
    lease = QueryLease("q", "q")
    lease.acquired(1, 0.0, 15, 5)
    assert lease.lost("refused", 1.0, contested=True) and lease.held_elsewhere()
    lease.acquiring("retry")
    lease.acquired(2, 2.0, 15, 5)
    assert lease.valid(3.0) and not lease.not_owned()
    lease.released("test")
    assert lease.state is LeaseState.RELEASED


async def test_conflict_expiry_and_reacquire_against_azurite(make_config: ConfigFactory) -> None:
    config = make_config()
    store = BlobStore(config)
    await store.ensure_container()
    clock = Clock()
    ours = lease_manager(store, OURS, clock=clock)
    theirs = lease_manager(store, THEIRS)
    try:
        lease = await ours.ensure_held("q1", "query-one")
        assert lease is not None and ours.state("q1") is LeaseState.HELD and ours.holds(lease)
        assert await store.lease_state("q1") == "leased"

        assert await theirs.ensure_held("q1", "query-one") is None
        assert theirs.state("q1") is LeaseState.LOST
        assert theirs.not_owned() == ["query-one"]

        # Past the renewal deadline without a renewal we can no longer be sure the lease is
        # ours: it is treated as lost, then re-acquired with our id (nobody else took it).
        term = lease.term
        clock.now += 15
        assert not ours.holds(lease)  # no write under it now
        again = await ours.ensure_held("q1", "query-one")
        assert again is not None and ours.state("q1") is LeaseState.HELD
        assert again.term != term  # a new term: what was known of the blob must be re-read
        assert ours.holds(again) and not ours.holds(lease)

        await ours.release_all()
        assert ours.state("q1") is LeaseState.RELEASED
        assert await store.lease_state("q1") == "available"
        assert await ours.ensure_held("q1", "query-one") is None  # released is final
    finally:
        await store.aclose()


async def test_leases_are_renewed_in_the_background_past_their_duration(
    make_config: ConfigFactory,
) -> None:
    config = make_config(count_threshold=1, lease_duration_s=15)
    clock = Clock()  # the lease deadlines' clock, moved by hand: no 21 s of waiting
    async with running_daemon(config, lease_clock=clock) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(rate_progress("q", 1))).applied
        await eventually(lambda: daemon.flush.leases.state("q") is LeaseState.HELD)
        # Past the lease's duration (3 x 6.25 s > 15 s), a renewal delay at its jittered
        # longest each time: only renewals, each accepted by the store, keep it.
        for renewed in range(1, 4):
            clock.now += daemon.flush.leases.renew_every_s * (1 + RENEW_JITTER)
            await eventually(lambda n=renewed: sample(daemon, RENEWALS, result="ok") >= n)  # type: ignore[misc]
        assert daemon.flush.leases.state("q") is LeaseState.HELD
        assert await daemon.store.lease_state("q") == "leased"
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(rate_progress("q", 2))).applied
        with anyio.fail_after(5):
            while (doc := await daemon.store.read("q")) is None or doc.batch_id < 2:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        _, text = await anyio.to_thread.run_sync(scrape, daemon)
    assert metric_value(text, "checkpoint_sidecar_lease_renewals_total", result="ok") >= 3
    assert metric_value(text, "checkpoint_sidecar_lease_renewals_total", result="lost") == 0
    assert metric_value(text, "checkpoint_sidecar_flushes_total", result="lease_lost") == 0


async def test_overlapping_acquire_and_release_never_break_the_state_machine(
    make_config: ConfigFactory,
) -> None:
    config = make_config()
    store = BlobStore(config)
    await store.ensure_container()
    theirs = lease_manager(store, THEIRS)
    ours = lease_manager(store, OURS)
    try:
        assert await theirs.ensure_held("q2", "q2") is not None
        # two passes (a tick and the final flush) racing on a lease held elsewhere
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(ours.ensure_held, "q2", "q2")
        assert ours.state("q2") is LeaseState.LOST
        await theirs.release_all()
        # an acquisition racing with shutdown's release: the lease ends released, not held
        async with anyio.create_task_group() as tg:
            ours._core.record("q2").lease.retry_at = 0
            tg.start_soon(ours.ensure_held, "q2", "q2")
            tg.start_soon(ours.release_all)
        assert ours.state("q2") is LeaseState.RELEASED
        assert await store.lease_state("q2") == "available"
    finally:
        await store.aclose()


async def test_a_lost_lease_is_taken_back_by_the_loop_without_a_flush(
    make_config: ConfigFactory,
) -> None:
    # An idle query flushes nothing, so only the manager's own loop can make it owned (and
    # the daemon ready) again once the other owner lets go.
    config = make_config()
    store = BlobStore(config)
    await store.ensure_container()
    theirs = lease_manager(store, THEIRS)
    metrics = Metrics()
    ours = lease_manager(store, OURS, metrics=metrics)
    try:
        assert await theirs.ensure_held("q3", "q3") is not None
        assert await ours.ensure_held("q3", "q3") is None
        assert ours.not_owned() == ["q3"]
        async with anyio.create_task_group() as tg:
            await tg.start(ours.run)
            await eventually(lambda: ours.ticks >= 2)
            assert ours.not_owned() == ["q3"]  # retried (and refused) meanwhile, still lost
            await theirs.release_all()
            with anyio.fail_after(10):
                while ours.state("q3") is not LeaseState.HELD:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            assert ours.not_owned() == []
            assert (
                metrics.registry.get_sample_value("checkpoint_sidecar_lease_held", {"query": "q3"})
                == 1
            )
            tg.cancel_scope.cancel()
        await ours.release_all()
        assert await store.lease_state("q3") == "available"
    finally:
        await store.aclose()
