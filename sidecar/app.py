"""Wiring: one task group runs the daemon's components; stopping follows a fixed order.

Start:  admin endpoint (so /healthz answers at once) → wait for Redis → write coalescer →
        socket server. ``task_status.started()`` fires only when the socket is bound and
        Redis answered.
Stop:   stop accepting → answer requests already read → close Redis; all within
        ``shutdown_grace_s``, after which what is left is cancelled with a log line.
A crashing component brings the whole daemon down rather than leaving it half alive.
"""

from __future__ import annotations

import logging

import anyio
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry

from sidecar import __version__
from sidecar.admin import AdminServer
from sidecar.buffer import RedisBuffer, WriteCoalescer
from sidecar.config import Config
from sidecar.errors import BufferUnavailable
from sidecar.metrics import Metrics
from sidecar.server import SocketServer

log = logging.getLogger(__name__)

REDIS_RETRY_MAX_S = 10.0


class Daemon:
    """The checkpoint sidecar. ``await run()``; call :meth:`request_stop` to stop gracefully."""

    def __init__(self, config: Config, *, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.metrics = Metrics(registry)
        self.buffer = RedisBuffer(
            config.redis_url, config.namespace, timeout_s=config.redis_timeout_s
        )
        self.coalescer = WriteCoalescer(self.buffer)
        self.server = SocketServer(config, self.buffer, self.coalescer, self.metrics)
        self.admin = AdminServer(
            config.metrics_host,
            config.metrics_port,
            self.metrics,
            checks=[self._socket_ready, self._redis_ready],
        )
        self.metrics.buffer_queue.set_function(lambda: self.coalescer.queued)
        self.metrics.redis_up.set_function(lambda: 1.0 if self.buffer.available else 0.0)
        self._stop = anyio.Event()

    def request_stop(self) -> None:
        """Begin a graceful stop (idempotent; safe from a signal-handling task)."""
        self._stop.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        log.info("checkpoint-sidecar %s starting: %r", __version__, cfg)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.admin.run)
                if not await self._wait_for_redis():
                    tg.cancel_scope.cancel()
                    return
                await tg.start(self.coalescer.run)
                await tg.start(self.server.run)
                log.info("ready: namespace=%s socket=%s", cfg.namespace, cfg.socket_path)
                task_status.started()
                await self._stop.wait()
                await self._shutdown()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await self.buffer.aclose()
        log.info("stopped")

    async def _wait_for_redis(self) -> bool:
        """Block until Redis answers (True) or a stop is requested first (False)."""
        delay = 0.1
        while True:
            try:
                await self.buffer.ping()
                return True
            except BufferUnavailable as exc:
                log.warning("waiting for Redis (retry in %.1fs): %s", delay, exc)
            with anyio.move_on_after(delay):
                await self._stop.wait()
                return False
            delay = min(delay * 2, REDIS_RETRY_MAX_S)

    async def _shutdown(self) -> None:
        grace = self.config.shutdown_grace_s
        log.info(
            "stopping: no new connections, answering requests already read (grace %.1fs)", grace
        )
        with anyio.move_on_after(grace) as scope:
            await self.server.drain()
        if scope.cancelled_caught:
            log.warning(
                "grace period of %.1fs ran out; cutting %d connection(s) and %d queued "
                "update(s) (not acknowledged, so clients will resend)",
                grace,
                self.server.active_connections,
                self.coalescer.queued,
            )

    async def _socket_ready(self) -> str | None:
        return None if self.server.bound else "socket not bound"

    async def _redis_ready(self) -> str | None:
        try:
            with anyio.fail_after(1):
                await self.buffer.ping()
        except (BufferUnavailable, TimeoutError) as exc:
            return f"Redis unreachable: {exc}"
        return None
