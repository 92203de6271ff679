"""The socket server: a thin I/O shell around :mod:`sidecar.protocol` and a request handler.

Read bytes, feed the decoder, hand the events to the handler (``sidecar.handler``, wired in
``sidecar.app``), write the replies — the protocol's rules live in the pure module, what a
request does lives in the handler. Per connection, every event of one read is begun before
any reply is awaited, so updates pipelined by one client (and those of concurrent clients)
share a Redis round trip; replies still go out in request order. A ``get`` is answered after
every earlier request of its connection, so a client reads its own writes.

Admin ops (``reset``, ``retire``) are refused per listener, before the handler sees them:
on the Unix socket unless ``SIDECAR_ADMIN_OPS``, on TCP unless ``SIDECAR_ADMIN_OPS_TCP`` too
(any local process can reach a loopback port; the socket file has permissions).

Stopping (``drain``): stop accepting, stop reading, answer what was already read, close.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import anyio
from anyio.abc import ByteStream, Listener, TaskStatus
from anyio.streams.stapled import MultiListener

from sidecar.config import Config
from sidecar.errors import SocketInUse
from sidecar.metrics import Metrics
from sidecar.protocol import ErrorCode, Event, ServerConnection, encode_error

log = logging.getLogger(__name__)

_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError)

ADMIN_OFF = (
    "reset and retire are admin ops, off on this daemon: set SIDECAR_ADMIN_OPS=true "
    "(--admin-ops) to allow them on its Unix socket (with no daemon running, the CLI performs "
    "them itself under the blob's lease)"
)
ADMIN_OFF_TCP = (
    "reset and retire are refused on the TCP listener, which any local process can reach (no "
    "file permissions guard it): use the Unix socket, or set SIDECAR_ADMIN_OPS_TCP=true"
)


def _lock_socket_path(path: str) -> int:
    """Take ``<path>.lock`` (an exclusive, non-blocking flock) and return its descriptor.

    The lock is held for the daemon's lifetime and dies with the process (even on kill -9), so
    of two daemons started at once on one path exactly one gets it: the probe-then-bind below
    cannot race another starter. The lock file is left in place: deleting it would reopen the
    race for whoever holds an old descriptor.
    """
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SocketInUse(
            f"another process is serving {path} (it holds {path}.lock); stop it first or set "
            "SIDECAR_SOCKET_PATH to another path (two daemons must not share one socket)"
        ) from None
    return fd


async def bind_unix_socket(path: str, mode: int) -> tuple[Listener[ByteStream], int]:
    """Listen on ``path``: replace a stale socket file, never steal a live one.

    Returns the listener and the descriptor of the held ``<path>.lock`` (close it after the
    listener).

    Raises:
        SocketInUse: another daemon holds the path, another process answers on it, or
            ``path`` is not a socket.
    """
    file = anyio.Path(path)
    await file.parent.mkdir(parents=True, exist_ok=True)
    lock = await anyio.to_thread.run_sync(_lock_socket_path, path)
    try:
        try:
            existing: int | None = (await file.lstat()).st_mode
        except FileNotFoundError:
            existing = None
        if existing is not None:
            if not stat.S_ISSOCK(existing):
                raise SocketInUse(
                    f"{path} exists and is not a socket; refusing to replace it. Remove it or "
                    "set SIDECAR_SOCKET_PATH to another path"
                )
            try:
                probe = await anyio.connect_unix(path)
            except OSError:
                log.info("replacing stale socket file %s (no process listens on it)", path)
                await file.unlink(missing_ok=True)
            else:  # a live server that takes no lock (an older version): never steal
                await probe.aclose()
                raise SocketInUse(
                    f"another process is serving {path}; stop it first or set "
                    "SIDECAR_SOCKET_PATH to another path (two daemons must not share one socket)"
                )
        listener: Listener[ByteStream] = await anyio.create_unix_listener(path, mode=mode)
    except BaseException:
        os.close(lock)
        raise
    return listener, lock


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
        self._internal = metrics.bad_requests.labels(ErrorCode.INTERNAL.value)
        self._connections = 0  # connections accepted so far, to name them in logs
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
        unix, lock = await bind_unix_socket(cfg.socket_path, cfg.socket_mode)
        listeners: list[Listener[ByteStream]] = [unix]
        inode = (await anyio.Path(cfg.socket_path).stat()).st_ino
        if cfg.tcp_port is not None:
            try:
                tcp = await anyio.create_tcp_listener(
                    local_host=cfg.tcp_host, local_port=cfg.tcp_port
                )
            except OSError as exc:
                with anyio.CancelScope(shield=True):
                    await unix.aclose()
                    await _remove_if_ours(cfg.socket_path, inode)
                os.close(lock)
                raise SocketInUse(
                    f"cannot listen on tcp:{cfg.tcp_host}:{cfg.tcp_port} ({exc.strerror}); "
                    "another process has the port: stop it or set SIDECAR_TCP_PORT to a free one"
                ) from None
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
            os.close(lock)  # after the socket file is gone: a successor may take the path now

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
        self._connections += 1
        number = self._connections
        self._metrics.connections.inc()
        conn = ServerConnection(self._config.max_frame_bytes, self._admin_refusal(stream))
        failures = _Failures(number)
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
                    replies = await self._answer(events, failures)
                    try:
                        await stream.send(replies)
                    except _GONE:
                        return  # the client left; what it sent is stored regardless
        except Exception:
            # No error of one connection may end the daemon. Here the stream's state is
            # unknown (the failure was outside a request), so the connection is closed.
            self._internal.inc()
            log.exception("connection %d failed outside a request; closing it", number)
        finally:
            self._active -= 1
            self._metrics.connections.dec()
            if self._stopping and self._active == 0:
                self._all_closed.set()

    def _admin_refusal(self, stream: ByteStream) -> str | None:
        """Why this connection may not send admin ops; None: it may."""
        cfg = self._config
        if not cfg.admin_ops:
            return ADMIN_OFF
        unix = stream.extra(anyio.abc.SocketAttribute.family, None) == socket.AF_UNIX
        return None if unix or cfg.admin_ops_tcp else ADMIN_OFF_TCP

    async def _answer(self, events: Sequence[Event], failures: _Failures) -> bytes:
        # Begin every request of this read first (updates share one Redis round trip), then
        # collect the replies in request order. A request that fails unexpectedly (a bug)
        # answers `internal`; the connection and the other requests go on.
        replies: list[Callable[[], Awaitable[bytes]] | None] = []
        for event in events:
            try:
                replies.append(await self._handler.begin(event))
            except Exception:
                failures.log(event)
                replies.append(None)
        out = bytearray()
        for event, reply in zip(events, replies, strict=True):
            try:
                if reply is not None:
                    out += await reply()
                    continue
            except Exception:
                failures.log(event)
            self._internal.inc()
            out += encode_error(event.id, ErrorCode.INTERNAL, "internal error; see the daemon log")
        return bytes(out)


class _Failures:
    """Unexpected errors of one connection: the first is logged with its traceback."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.count = 0

    def log(self, event: Event) -> None:
        self.count += 1
        if self.count == 1:
            log.exception(
                "connection %d: request id=%r failed unexpectedly; answered `internal` "
                "(further failures on this connection are counted, not logged)",
                self.number,
                event.id,
            )
