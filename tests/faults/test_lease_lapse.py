"""A lease whose renewals time out (not refused) lapses by the lease manager's own timer:
its metric shows it at once, not at the query's next write, and /readyz stays 200 (a store
that does not answer is the store gauge's to show, not a lost ownership). Real Azurite."""

from __future__ import annotations

import anyio
import pytest

from sidecar.errors import StoreUnavailable
from sidecar.flush.lease import LeaseState
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore
from sidecar.telemetry.metrics import Metrics
from tests.helpers import (
    Clock,
    ConfigFactory,
    eventually,
    lease_manager,
    running_daemon,
    sample,
    scrape,
)
from tests.sparkshapes import kafka_progress

OURS = "00000000-0000-0000-0000-0000000000bb"


async def test_a_lease_past_its_validity_is_lost_by_the_timer_then_reacquired(
    make_config: ConfigFactory,
) -> None:
    store = BlobStore(make_config())
    await store.ensure_container()
    clock, metrics = Clock(1000.0), Metrics()
    leases = lease_manager(store, OURS, metrics=metrics, clock=clock)
    try:
        assert await leases.ensure_held("q-lapse", "lapse") is not None
        held = metrics.registry.get_sample_value
        assert held("checkpoint_sidecar_lease_held", {"query": "lapse"}) == 1
        clock.now += 11.9  # valid for duration - margin = 12 s after the acquisition began
        assert leases.expire_lapsed() == []
        clock.now += 0.2
        assert leases.expire_lapsed() == ["lapse"]
        assert leases.state("q-lapse") is LeaseState.LOST
        assert held("checkpoint_sidecar_lease_held", {"query": "lapse"}) == 0
        assert leases.not_owned() == ["lapse"]
        # The store never refused it: the next write re-acquires it at once, with our id.
        assert await leases.ensure_held("q-lapse", "lapse") is not None
        assert held("checkpoint_sidecar_lease_held", {"query": "lapse"}) == 1
    finally:
        await leases.release_all()
        await store.aclose()


@pytest.mark.slow
async def test_an_idle_query_whose_renewals_time_out_shows_not_owned_within_a_second_still_ready(
    make_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(count_threshold=1, lease_duration_s=15)
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress("q-idle", 1))).applied
        await eventually(
            lambda: sample(daemon, "checkpoint_sidecar_lease_held", query="orders-to-delta") == 1
        )

        async def renewal_times_out(query_id: str, lease_id: str) -> None:
            # What BlobStore._call raises when the store does not answer in time.
            raise StoreUnavailable("blob store: renew lease timed out after 10s")

        async def acquisition_times_out(query_id: str, lease_id: str, duration_s: int) -> None:
            # The store is down for every lease call: the lease manager's own retries of
            # the lapsed lease must not make it look held either.
            raise StoreUnavailable("blob store: acquire lease timed out after 10s")

        monkeypatch.setattr(daemon.store, "renew_lease", renewal_times_out)
        monkeypatch.setattr(daemon.store, "acquire_lease", acquisition_times_out)
        lease = daemon.flush.leases._core.record("q-idle").lease
        # valid_until is on the monotonic clock; lapse is due then, and shown within ~1 s.
        await anyio.sleep(max(0.0, lease.valid_until - anyio.current_time()))
        await eventually(
            lambda: sample(daemon, "checkpoint_sidecar_lease_held", query="orders-to-delta") == 0,
            timeout_s=1.5,
        )
        # Not owned, and nothing written under it; the pod stays ready: the store did not
        # answer, nobody else holds the lease, and Redis buffers meanwhile.
        assert daemon.flush.leases.contested() == []
        status, body = await anyio.to_thread.run_sync(scrape, daemon, "/readyz")
        assert (status, body) == (200, "ready\n")
        monkeypatch.undo()  # the store answers again: the next update re-acquires
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress("q-idle", 2))).applied
        await eventually(
            lambda: sample(daemon, "checkpoint_sidecar_lease_held", query="orders-to-delta") == 1
        )
        status, _ = await anyio.to_thread.run_sync(scrape, daemon, "/readyz")
        assert status == 200
