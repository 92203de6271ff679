"""The socket server: a thin I/O shell around :mod:`sidecar.protocol` and a request handler.

Read bytes, feed the decoder, hand the events to the handler (``sidecar.handler``, wired in
``sidecar.app``), write the replies — the protocol's rules live in the pure module, what a
request does lives in the handler. Per connection, every event of one read is begun before
any reply is awaited, so updates pipelined by one client (and those of concurrent clients)
share a Redis round trip; replies still go out in request order. A ``get`` is answered after
every earlier request of its connection, so a client reads its own writes.

Stopping (``drain``): stop accepting, stop reading, answer what was already read, close.
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import anyio
from anyio.abc import ByteStream, Listener, TaskStatus
from anyio.streams.stapled import MultiListener

from sidecar.config import Config
from sidecar.errors import SocketInUse
from sidecar.metrics import Metrics
from sidecar.protocol import Event, ServerConnection

log = logging.getLogger(__name__)

_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError)


async def bind_unix_socket(path: str, mode: int) -> Listener[ByteStream]:
    """Listen on ``path``: replace a stale socket file, never steal a live one.

    Raises:
        SocketInUse: another process answers on ``path``, or ``path`` is not a socket.
    """
    file = anyio.Path(path)
    try:
        existing: int | None = (await file.lstat()).st_mode
    except FileNotFoundError:
        existing = None
    if existing is not None:
        if not stat.S_ISSOCK(existing):
            raise SocketInUse(
                f"{path} exists and is not a socket; refusing to replace it. Remove it or set "
                "SIDECAR_SOCKET_PATH to another path"
            )
        try:
            probe = await anyio.connect_unix(path)
        except OSError:
            log.info("replacing stale socket file %s (no process listens on it)", path)
            await file.unlink(missing_ok=True)
        else:
            await probe.aclose()
            raise SocketInUse(
                f"another process is serving {path}; stop it first or set SIDECAR_SOCKET_PATH "
                "to another path (two daemons must not share one socket)"
            )
    await file.parent.mkdir(parents=True, exist_ok=True)
    listener: Listener[ByteStream] = await anyio.create_unix_listener(path, mode=mode)
    return listener


async def _remove_if_ours(path: str, inode: int) -> None:
    """Remove the socket file only if it is still the one we bound (not a successor's)."""
    file = anyio.Path(path)
    try:
        if (await file.stat()).st_ino == inode:
            await file.unlink()
    except FileNotFoundError:
        pass


class Handler(Protocol):
    """What the server needs of the request handler (``sidecar.handler.RequestHandler``)."""

    async def begin(self, event: Event) -> Callable[[], Awaitable[bytes]]: ...


class SocketServer:
    """Accepts connections and answers their requests until :meth:`drain`."""

    def __init__(self, config: Config, handler: Handler, metrics: Metrics) -> None:
        self._config = config
        self._handler = handler
        self._metrics = metrics
        self._accepting = anyio.CancelScope()
        self._readers: set[anyio.CancelScope] = set()
        self._stopping = False
        self._active = 0
        self._all_closed = anyio.Event()
        self.bound = False
        #: The loopback TCP port actually bound, when TCP is enabled.
        self.tcp_port: int | None = None

    @property
    def active_connections(self) -> int:
        return self._active

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        cfg = self._config
        listeners: list[Listener[ByteStream]] = [
            await bind_unix_socket(cfg.socket_path, cfg.socket_mode)
        ]
        inode = (await anyio.Path(cfg.socket_path).stat()).st_ino
        if cfg.tcp_port is not None:
            tcp = await anyio.create_tcp_listener(local_host=cfg.tcp_host, local_port=cfg.tcp_port)
            self.tcp_port = tcp.extra(anyio.abc.SocketAttribute.local_port)
            listeners.append(tcp)
        log.info(
            "listening on unix:%s (mode %o)%s",
            cfg.socket_path,
            cfg.socket_mode,
            f" and tcp:{cfg.tcp_host}:{self.tcp_port}" if self.tcp_port else "",
        )
        listener = MultiListener(listeners)
        try:
            async with anyio.create_task_group() as connections:
                with self._accepting:
                    self.bound = True
                    task_status.started()
                    await listener.serve(self._handle, task_group=connections)
                # Accepting stopped: close the listeners now, then the task group waits for
                # the open connections to be answered.
                self.bound = False
                with anyio.CancelScope(shield=True):
                    await listener.aclose()
        finally:
            self.bound = False
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            with anyio.CancelScope(shield=True):
                await _remove_if_ours(cfg.socket_path, inode)

    async def drain(self) -> None:
        """Stop accepting and reading; return once every connection has been answered."""
        self._stopping = True
        self._accepting.cancel()
        for scope in list(self._readers):
            scope.cancel()
        if self._active:
            log.info("waiting for %d connection(s) to receive their replies", self._active)
            await self._all_closed.wait()

    async def _handle(self, stream: ByteStream) -> None:
        self._active += 1
        self._metrics.connections.inc()
        conn = ServerConnection(self._config.max_frame_bytes)
        try:
            async with stream:
                while not self._stopping and not conn.closed:
                    with anyio.CancelScope() as reading:
                        self._readers.add(reading)
                        if self._stopping:
                            reading.cancel()
                        try:
                            data = await stream.receive()
                        except _GONE:
                            return
                        finally:
                            self._readers.discard(reading)
                    if reading.cancelled_caught:
                        return
                    events = conn.receive_data(data)
                    if not events:
                        continue
                    replies = await self._answer(events)
                    try:
                        await stream.send(replies)
                    except _GONE:
                        return  # the client left; what it sent is stored regardless
        finally:
            self._active -= 1
            self._metrics.connections.dec()
            if self._stopping and self._active == 0:
                self._all_closed.set()

    async def _answer(self, events: Sequence[Event]) -> bytes:
        # Begin every request of this read first (updates share one Redis round trip), then
        # collect the replies in request order.
        replies = [await self._handler.begin(event) for event in events]
        out = bytearray()
        for reply in replies:
            out += await reply()
        return bytes(out)
