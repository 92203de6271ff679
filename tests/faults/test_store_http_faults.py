"""Cloud-shaped blob store faults under load, against a real daemon process, redis-server and
Azurite behind the HTTP-aware fault proxy (``tests/faults/store_proxy.py``): throttling
(503 ServerBusy with Retry-After), 500 OperationTimedOut after the call ran, connections
reset mid-response, responses held past the write timeout — on uploads, lease renewals, or
both. Each scenario: nothing acknowledged is lost, no checkpoint moves backwards (the sweep's
watcher: Redis, ``get`` and the blob), and the daemon's metrics count exactly what the proxy
injected."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from tests.faults.load import metric, run_load, scrape_process
from tests.faults.store_proxy import Fault, StoreFaultProxy
from tests.helpers import eventually
from tests.services import Azurite, DaemonProcess

FAILURES = "checkpoint_sidecar_store_failures_total"
FLUSHES = "checkpoint_sidecar_flushes_total"
UPLOAD, RENEW = frozenset({"upload"}), frozenset({"renew"})

SCENARIOS = {
    # Throttled: the call never ran. The flush's backoff honours Retry-After.
    "503 ServerBusy on a third of uploads and renewals": (
        [Fault("status", UPLOAD | RENEW, share=0.33, status=503)],
        {("status 503", "upload"): ("write checkpoint", "503 ServerBusy"),
         ("status 503", "renew"): ("renew lease", "503 ServerBusy")},
    ),
    # The write ran, then the client was told it timed out: its outcome is unknown, so the
    # blob is read again before the next write.
    "500 OperationTimedOut after a third of uploads ran": (
        [Fault("status", UPLOAD, share=0.33, status=500, forward=True)],
        {("status 500", "upload"): ("write checkpoint", "500 OperationTimedOut")},
    ),
    # The write ran, the connection dropped mid-response. aiohttp resends an idempotent
    # request (PUT) once by itself when a reused keep-alive connection drops, so the daemon
    # sees only some of these: those on a fresh connection, or whose resend dropped too.
    "connection reset mid-response on a quarter of uploads": (
        [Fault("reset", UPLOAD, share=0.25)],
        {("reset", "upload"): ("write checkpoint", "connection")},
    ),
    # Responses held past SIDECAR_WRITE_TIMEOUT_S (1 s): the calls time out.
    "responses held 1.5 s on a fifth of uploads": (
        [Fault("delay_headers", UPLOAD, share=0.2, delay_s=1.5)],
        {("delay_headers", "upload"): ("write checkpoint", "timeout")},
    ),
}  # fmt: skip


@pytest.fixture
def proxy(azurite: Azurite) -> Iterator[StoreFaultProxy]:
    with StoreFaultProxy(azurite.port, seed=20261125) as p:
        yield p


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS), ids=list(SCENARIOS))
async def test_cloud_store_faults_under_load_lose_nothing_and_are_counted(
    scenario: str,
    proxy: StoreFaultProxy,
    daemon_env: dict[str, str],
    short_tmp: Path,
    procs: list[DaemonProcess],
) -> None:
    faults, counted = SCENARIOS[scenario]
    env = daemon_env | {
        "AZURE_STORAGE_CONNECTION_STRING": proxy.connection_string(),
        "SIDECAR_COUNT_THRESHOLD": "25",
        "SIDECAR_TIME_THRESHOLD_S": "0.2",
        "SIDECAR_WRITE_TIMEOUT_S": "1",
    }
    proc = DaemonProcess(env, short_tmp / "daemon.log")
    procs.append(proc)
    await anyio.to_thread.run_sync(proc.start)
    # The watcher and the final check read Azurite directly: the truth, not the proxy's.
    async with run_load(daemon_env, [proc.socket_path], rate_per_s=600) as load:
        await load.wait_acks(300)
        proxy.faults = faults
        await load.wait_acks(load.acks + 2500, timeout_s=60)
        # Every kind of fault struck (renewals come every ~5 s).
        await eventually(lambda: all(proxy.injected[key] for key in counted), timeout_s=60)
        proxy.faults = []
        await load.stop_sending()
        await load.wait_durable()
    load.check()  # nothing acknowledged lost, nothing moved backwards
    assert load.errors.total() == 0, load.summary()  # acks went on: Redis buffered

    injected = {key: n for key, n in proxy.injected.items() if n}
    assert set(injected) == set(counted), injected  # each scenario's faults did strike
    page = (await anyio.to_thread.run_sync(scrape_process, proc))[1]
    failures = [line for line in page.splitlines() if line.startswith(FAILURES)]
    for key, (call, reason) in counted.items():
        seen = await metric(proc, FAILURES, call=call, reason=reason)
        if key[0] == "reset":  # aiohttp's own resend hides some (above)
            assert seen is not None and 0 < seen <= injected[key], (key, injected, failures)
        else:
            assert seen == injected[key], (key, injected, failures)
    errors = await metric(proc, FLUSHES, result="error")
    assert errors is not None and errors > 0
    assert await anyio.to_thread.run_sync(proc.stop) == 0
