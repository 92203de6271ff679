"""The blob store opened after readiness (issue #22): a store that refuses then (a role not
assigned yet: 403) leaves the daemon ready and running — logged and tried again, a new
query's update answered with an error the listener retries — and once the store answers the
update is stored and flushed; a missing container reads as empty only for the daemon,
which creates it — a tool reports it. Real Azurite behind the HTTP fault proxy."""

from __future__ import annotations

import logging

import anyio
import pytest

from sidecar.config import Config
from sidecar.daemon import app
from sidecar.errors import StoreError
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore
from sidecar.store.sdk import loaded as sdk_loaded
from sidecar.wire.protocol import RETRIABLE_CODES
from tests.faults.store_proxy import Fault, StoreFaultProxy
from tests.helpers import ConfigFactory, eventually, running_daemon, sample, wait_blob_batch
from tests.services import Azurite, azurite_connection_string
from tests.sparkshapes import kafka_progress

QID = "0bad5700-0000-4000-8000-000000000001"


async def test_a_store_refusing_at_start_leaves_the_daemon_ready_then_it_catches_up(
    make_config: ConfigFactory,
    azurite: Azurite,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(app, "STORE_OPEN_RETRY_CAP_S", 0.5)  # the 30 s cap, shortened
    with StoreFaultProxy(azurite.port) as proxy:
        proxy.faults = [Fault("status", status=403)]
        config = make_config(
            azure_connection_string=azurite_connection_string(proxy.port), count_threshold=1
        )
        with caplog.at_level(logging.WARNING, logger="sidecar.daemon.app"):
            async with running_daemon(config) as daemon:  # ready: the store is not part of it
                async with await SidecarClient.connect(config.socket_path) as c:
                    # A new query's floor is its blob's batch: while the store refuses, its
                    # first update is answered with an error the listener retries.
                    refused = await c.progress(kafka_progress(QID, 1))
                    assert refused.error is not None
                    assert refused.error.code in RETRIABLE_CODES
                    await eventually(lambda: "blob store not open yet" in caplog.text)
                    assert "403" in caplog.text and not daemon.stopped.is_set()
                    proxy.faults = []
                    retried = await c.progress(kafka_progress(QID, 1))
                    assert retried.ok and retried.applied
                doc = await wait_blob_batch(daemon.store, QID, 1, timeout_s=20)
                assert doc.batch_id == 1


async def test_a_missing_container_is_empty_for_the_daemon_and_an_error_for_a_tool(
    make_config: ConfigFactory,
) -> None:
    config: Config = make_config(container="never-created")
    daemons, tools = BlobStore(config, creates_container=True), BlobStore(config)
    try:
        assert await daemons.list() == [] and await daemons.query_ids() == set()
        with pytest.raises(StoreError, match="ContainerNotFound"):
            await tools.list()
        with pytest.raises(StoreError, match="ContainerNotFound"):
            await tools.query_ids()
    finally:
        await daemons.aclose()
        await tools.aclose()


async def test_updates_accepted_before_the_store_opens_are_not_a_previous_runs(
    make_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a previous run left pending is noted before the socket opens: this run's own
    updates, accepted while the store still opens, wait for their thresholds (before the fix
    the flusher's first pass took them for leftovers and flushed them at once)."""
    opened = anyio.Event()
    load = sdk_loaded

    async def slow_sdk(**kwargs: bool) -> object:  # the SDK's import, held until told
        await opened.wait()
        return await load(**kwargs)

    monkeypatch.setattr(app, "loaded_sdk", slow_sdk)
    config = make_config(count_threshold=1000, time_threshold_s=3600)
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            for batch in range(1, 4):
                assert (await c.progress(kafka_progress(QID, batch))).applied
        assert sample(daemon, "checkpoint_sidecar_flush_checks_total") == 0  # loop waits
        opened.set()
        await eventually(
            lambda: sample(daemon, "checkpoint_sidecar_flush_checks_total") > 0, timeout_s=10
        )
        checks = sample(daemon, "checkpoint_sidecar_flush_checks_total")
        await eventually(
            lambda: sample(daemon, "checkpoint_sidecar_flush_checks_total") >= checks + 5
        )
        assert await daemon.store.read(QID) is None  # pending in Redis, not due
        assert not any(
            sample(daemon, "checkpoint_sidecar_flushes_total", result=r) > 0
            for r in ("ok", "skipped", "not_owned", "lease_lost", "error")
        )
