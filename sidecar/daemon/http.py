"""The admin HTTP endpoint: ``/metrics`` (Prometheus text), ``/healthz``, ``/startupz``,
``/readyz``.

``/healthz`` answers 200 while the process is alive (liveness). ``/startupz`` answers 200 once
the socket accepts connections, whatever is down (Redis, the store): what a pod's startup
probe waits for before the driver starts, so nothing down keeps a driver from starting (its
listener keeps the newest position of each query and delivers it when the daemon can store
it). ``/readyz`` answers 200 only when every readiness check passes (socket bound, Redis
reachable, ...) and 503 with one line per failing check otherwise, so ``kubectl describe``
shows why a pod is not ready.

HTTP/1.1 is ``h11``'s (sans-IO: bytes in, events out), the I/O anyio's: three GET routes need
no web framework, and this endpoint is the first thing a pod's startup probe reaches, so it
must not wait for one to import (aiohttp's server took ~180 ms of the ~450 ms the daemon took
to import; issue #22). Keep-alive is honoured; a connection idle for :data:`IDLE_S` or
sending something that is not HTTP is closed.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable, Iterator
from http import HTTPStatus

import anyio
import h11
from anyio.abc import SocketAttribute, SocketStream, TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sidecar.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

#: A readiness check returns None when fine, or a sentence saying what is wrong.
ReadinessCheck = Callable[[], Awaitable[str | None]]

#: A connection with no complete request for this long is closed.
IDLE_S = 30.0
_TEXT = "text/plain; charset=utf-8"
#: How often the GIL changes hands while a page renders in a worker thread (Python's default
#: is 5 ms): the event loop, woken by a socket, waits for the GIL at most this long before it
#: runs, instead of up to 5 ms at each wake-up for as long as the render takes (~150 ms of CPU
#: at 1,000 queries x 100 partitions). Set for the render only.
RENDER_SWITCH_INTERVAL_S = 0.0005
#: What a client going away looks like.
_GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError)


class AdminServer:
    def __init__(
        self,
        host: str,
        port: int,
        metrics: Metrics,
        checks: list[ReadinessCheck],
        accepting: Callable[[], bool] = lambda: True,
    ) -> None:
        """``checks``: ``/readyz``'s; ``accepting``: whether the socket accepts connections
        (``/startupz``)."""
        self._host = host
        self._port = port
        self._metrics = metrics
        self._checks = checks
        self._accepting = accepting
        #: The bound port (differs from the configured one when that is 0).
        self.port: int | None = None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host=self._host, local_port=self._port)
        async with listener:
            self.port = listener.listeners[0].extra(SocketAttribute.local_port)
            log.info(
                "admin endpoint on http://%s:%d (/metrics /healthz /startupz /readyz)",
                self._host,
                self.port,
            )
            task_status.started()
            await listener.serve(self._connection)

    async def _connection(self, stream: SocketStream) -> None:
        """One client connection: requests answered in order until either side closes."""
        conn = h11.Connection(h11.SERVER)
        async with stream:
            try:
                while True:
                    request = await self._next_request(conn, stream)
                    if request is None:
                        return
                    try:
                        status, content_type, body = await self._answer(request)
                    except Exception:  # a bug in a check or a collector: answered, logged
                        log.exception("admin endpoint: %s failed", request.target.decode())
                        status, content_type, body = 500, _TEXT, b"internal error; see the log\n"
                    await self._send(conn, stream, status, content_type, body)
                    if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                        return
                    conn.start_next_cycle()
            except h11.RemoteProtocolError as exc:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    body = f"bad request: {exc}\n".encode()
                    with contextlib.suppress(*_GONE):
                        await self._send(conn, stream, exc.error_status_hint, _TEXT, body)
            except _GONE:
                return  # the client went away

    async def _next_request(self, conn: h11.Connection, stream: SocketStream) -> h11.Request | None:
        """The next request once its body (ignored) has ended; None when the client closed or
        stayed idle too long."""
        request = None
        with anyio.move_on_after(IDLE_S):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    try:
                        data = await stream.receive()
                    except anyio.EndOfStream:
                        data = b""
                    conn.receive_data(data)
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.EndOfMessage):
                    return request
                elif isinstance(event, h11.ConnectionClosed):
                    return None
        return None

    async def _answer(self, request: h11.Request) -> tuple[int, str, bytes]:
        if request.method != b"GET":
            return 405, _TEXT, b"only GET\n"
        path = request.target.split(b"?", 1)[0]
        if path == b"/metrics":
            # Rendered in a worker thread: with 1,000 queries the exposition (and the lag
            # computed by sidecar.kafka.lag's collector) takes tens of milliseconds, which on
            # the event loop would delay every acknowledgement behind it. The metrics are
            # thread-safe (prometheus_client's locks; sidecar.kafka.lag reads references only).
            with _short_switches():
                body = await anyio.to_thread.run_sync(generate_latest, self._metrics.registry)
            return 200, CONTENT_TYPE_LATEST, body
        if path == b"/healthz":
            return 200, _TEXT, b"ok\n"
        if path == b"/startupz":  # what a driver waits for: nothing down keeps it back
            if self._accepting():
                return 200, _TEXT, b"accepting connections\n"
            return 503, _TEXT, b"not accepting connections yet: the socket is not bound\n"
        if path == b"/readyz":
            problems = [p for check in self._checks if (p := await check()) is not None]
            if problems:
                return 503, _TEXT, "".join(f"not ready: {p}\n" for p in problems).encode()
            return 200, _TEXT, b"ready\n"
        return 404, _TEXT, b"not found: /metrics, /healthz, /startupz or /readyz\n"

    @staticmethod
    async def _send(
        conn: h11.Connection, stream: SocketStream, status: int, content_type: str, body: bytes
    ) -> None:
        headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
        reason = HTTPStatus(status).phrase.encode()
        out = conn.send(h11.Response(status_code=status, headers=headers, reason=reason))
        out += conn.send(h11.Data(data=body)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        await stream.send(out or b"")


#: Pages being rendered in this process (any admin server's), and Python's switch interval
#: from before the first of them. Changed on event-loop threads only, between awaits.
_rendering = 0
_interval = sys.getswitchinterval()


@contextlib.contextmanager
def _short_switches() -> Iterator[None]:
    """:data:`RENDER_SWITCH_INTERVAL_S` while any render runs, the interval from before the
    first one after the last."""
    global _rendering, _interval
    if not _rendering:
        _interval = sys.getswitchinterval()
        sys.setswitchinterval(RENDER_SWITCH_INTERVAL_S)
    _rendering += 1
    try:
        yield
    finally:
        _rendering -= 1
        if not _rendering:
            sys.setswitchinterval(_interval)
