"""The blob store's health within seconds (``sidecar.daemon.store_watch``): a store that stops
answering turns ``checkpoint_sidecar_store_up`` to 0 while the daemon is idle — no write, no
renewal due — and the pod stays ready while Redis buffers; the store answering again turns it
back to 1 and the flush catches up. Real Azurite behind the stalling TCP proxy of
tests/faults/test_lease_faults.py; the same outage under load: tests/faults/test_sweep.py."""

from __future__ import annotations

import math

import anyio

from sidecar.daemon.app import Daemon
from sidecar.ops.client import SidecarClient
from tests.faults.test_lease_faults import StallingProxy, readyz
from tests.helpers import ConfigFactory, eventually, sample
from tests.services import Azurite, azurite_connection_string
from tests.sparkshapes import kafka_progress

QID = "5707e000-0000-4000-8000-000000000001"
STORE_UP = "checkpoint_sidecar_store_up"
FAILURES = "checkpoint_sidecar_store_failures_total"
CHECK = "checkpoint_sidecar_config_check"


async def test_an_idle_daemon_shows_a_stalled_store_within_seconds_and_stays_ready(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    async with anyio.create_task_group() as tg:
        proxy = StallingProxy(azurite.port)
        await tg.start(proxy.run)
        config = make_config(
            azure_connection_string=azurite_connection_string(proxy.port),
            count_threshold=1,
            lease_duration_s=60,  # no renewal falls in the test: only the ping can tell
            write_timeout_s=1,
        )
        daemon = Daemon(config)
        await tg.start(daemon.run)
        try:
            async with await SidecarClient.connect(config.socket_path) as c:
                assert (await c.progress(kafka_progress(QID, 1))).applied
            with anyio.fail_after(10):
                await daemon.flush.ack(QID, 1, None)
            # The start-up config checks (doctor's storage probe) are done, and a call since
            # answered: from here on only the ping calls the store.
            await eventually(lambda: not math.isnan(sample(daemon, CHECK, check="storage_probe")))
            await eventually(lambda: sample(daemon, STORE_UP) == 1)

            proxy.stall()  # idle from here: nothing to flush, the next renewal 20 s away
            stalled_at = anyio.current_time()
            await eventually(lambda: sample(daemon, STORE_UP) == 0, timeout_s=15)
            print(f"store_up 0 after {anyio.current_time() - stalled_at:.2f}s (write timeout 1s)")
            # The ping told (no write, no renewal was due).
            assert sample(daemon, FAILURES, call="ping", reason="timeout") >= 1
            assert math.isnan(sample(daemon, FAILURES, call="write checkpoint", reason="timeout"))
            assert (await readyz(daemon)) == (200, "ready\n")
            async with await SidecarClient.connect(config.socket_path) as c:
                assert (await c.progress(kafka_progress(QID, 2))).applied  # buffered

            proxy.resume()
            await eventually(lambda: sample(daemon, STORE_UP) == 1, timeout_s=15)
            with anyio.fail_after(15):
                await daemon.flush.ack(QID, 2, None)
        finally:
            proxy.resume()
            daemon.request_stop()
            await daemon.stopped.wait()
            tg.cancel_scope.cancel()
