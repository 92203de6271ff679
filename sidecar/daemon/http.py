"""The admin HTTP endpoint: ``/metrics`` (Prometheus text), ``/healthz``, ``/readyz``.

``/healthz`` answers 200 while the process is alive (liveness). ``/readyz`` answers 200 only
when every readiness check passes (socket bound, Redis reachable, ...) and 503 with one line
per failing check otherwise, so ``kubectl describe`` shows why a pod is not ready.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
from aiohttp import web
from anyio.abc import TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sidecar.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

#: A readiness check returns None when fine, or a sentence saying what is wrong.
ReadinessCheck = Callable[[], Awaitable[str | None]]


class AdminServer:
    def __init__(
        self, host: str, port: int, metrics: Metrics, checks: list[ReadinessCheck]
    ) -> None:
        self._host = host
        self._port = port
        self._metrics = metrics
        self._checks = checks
        #: The bound port (differs from the configured one when that is 0).
        self.port: int | None = None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics_page)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self._host, self._port)
            await site.start()
            self.port = runner.addresses[0][1]
            log.info(
                "admin endpoint on http://%s:%d (/metrics /healthz /readyz)", self._host, self.port
            )
            task_status.started()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await runner.cleanup()

    async def _metrics_page(self, request: web.Request) -> web.Response:
        # Rendered in a worker thread: with 1,000 queries the exposition (and the lag
        # computed by sidecar.kafka.lag's collector) takes tens of milliseconds, which on the
        # event loop would delay every acknowledgement behind it. The metrics are
        # thread-safe (prometheus_client's locks; sidecar.kafka.lag reads references only).
        body = await anyio.to_thread.run_sync(generate_latest, self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        problems = [p for check in self._checks if (p := await check()) is not None]
        if problems:
            return web.Response(status=503, text="".join(f"not ready: {p}\n" for p in problems))
        return web.Response(text="ready\n")
