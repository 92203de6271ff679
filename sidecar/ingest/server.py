"""The socket server: a thin I/O shell around :mod:`sidecar.wire.protocol` and a request handler.

Read bytes, feed the decoder, hand the events to the handler (``sidecar.ingest.handler``,
wired in ``sidecar.daemon.app``), write the replies — the protocol's rules live in the pure
``sidecar.wire.protocol``, the order and bound of owed replies in the pure
``sidecar.ingest.replies``, what a request does in the handler. Per connection, every event of
one read is begun before any reply is awaited, so updates pipelined by one client (and those
of concurrent clients) share a Redis round trip; replies still go out in request order. A
connection keeps reading while earlier replies are owed (at most ``MAX_OWED_REPLIES``): in
blob ack mode the acks of later reads join the next blob write instead of waiting for the
earlier ones' write to end. A ``get`` is answered after every earlier request of its
connection, so a client reads its own writes.

Each connection is one task group (``asyncio.TaskGroup``: a task per blob-mode ack costs a
fifth of an anyio task here) holding its answering task and every reply started at once;
the connection ends only when they have. The reading happens in the group's body.

Admin ops (``reset``, ``retire``) are refused per listener, before the handler sees them:
on the Unix socket unless ``SIDECAR_ADMIN_OPS``, on TCP unless ``SIDECAR_ADMIN_OPS_TCP`` too
(any local process can reach a loopback port; the socket file has permissions).

The loopback TCP listener (on by default, for JVMs without Unix sockets: ``SIDECAR_TCP_PORT``,
a free port unless one is given) accepts requests on a connection only after an ``auth`` with
this run's token, which it publishes with the port in the endpoint file beside the socket,
readable by whoever may connect to the socket (``sidecar.wire.endpoint``). A connection that
sends anything else first, or nothing within ``AUTH_TIMEOUT_S``, is answered
``unauthenticated`` and closed.

Stopping (``drain``): stop accepting, stop reading, answer what was already read, close.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
from collections.abc import Coroutine
from typing import Any, Protocol

import anyio
from anyio.abc import ByteStream, Listener, SocketAttribute, TaskGroup, TaskStatus

import sidecar.wire.endpoint as endpoint
from sidecar.config import Config
from sidecar.errors import SocketInUse
from sidecar.ingest.connection import Connection
from sidecar.ingest.replies import MAX_OWED_REPLIES, OwedReplies
from sidecar.telemetry.metrics import Metrics
from sidecar.wire.protocol import (
    INTERNAL_MESSAGE,
    ErrorCode,
    Event,
    RequestId,
    ServerConnection,
    encode_error,
)

log = logging.getLogger(__name__)

#: How long a TCP connection may take to authenticate before it is refused and closed: a
#: client sends ``auth`` first thing, so this only bounds what a stray or hostile local
#: process can hold open without the token.
AUTH_TIMEOUT_S = 10.0

#: accept() failures that are a passing shortage (descriptors, memory, an aborted
#: handshake): logged, and accepting goes on after a pause, as a loaded server must.
_ACCEPT_RETRY = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}

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


def _publish(path: str, mode: int, data: bytes) -> int:
    """Write ``data`` to ``path`` atomically with exactly ``mode`` (never readable by more,
    not even for a moment: created 0600, then set); return the new file's inode."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)  # left by a process of this pid that died writing it
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    return os.stat(path).st_ino


async def _remove_if_ours(path: str, inode: int) -> None:
    """Remove a file we made (the socket, the endpoint file) only if it is still ours (not
    a successor's)."""
    file = anyio.Path(path)
    try:
        if (await file.stat()).st_ino == inode:
            await file.unlink()
    except FileNotFoundError:
        pass


class Answer(Protocol):
    """A request's reply in the making (``sidecar.ingest.handler.Answer``)."""

    request_id: RequestId
    at_once: bool

    @property
    def make(self) -> Coroutine[Any, Any, bytes]: ...


class Handler(Protocol):
    """What the server needs of the request handler (``sidecar.ingest.handler.RequestHandler``)."""

    async def begin(self, event: Event) -> Answer: ...


class SocketServer:
    """Accepts connections and answers their requests until :meth:`drain`."""

    def __init__(self, config: Config, handler: Handler, metrics: Metrics) -> None:
        self._config = config
        self._handler = handler
        self._metrics = metrics
        self._internal = metrics.bad_requests.labels(ErrorCode.INTERNAL.value)
        self._connections = 0  # connections accepted so far, to name them in logs
        self._accepting = anyio.CancelScope()
        self._open: set[Connection] = set()
        self._stopping = False
        self._active = 0
        self._all_closed = anyio.Event()
        self.bound = False
        #: The loopback TCP port actually bound, when TCP is enabled.
        self.tcp_port: int | None = None
        #: Where the TCP listener's port and token are published (``sidecar.wire.endpoint``).
        self.endpoint_path = endpoint.path_for(config.socket_path)
        self._token: str | None = None
        self._auth_hint = (
            f"The token is in {self.endpoint_path}, beside the socket, readable by those "
            "who may connect to it"
        )

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
            self.tcp_port = tcp.extra(SocketAttribute.local_port)
            listeners.extend(tcp.listeners)
        published: int | None = None
        try:
            if self.tcp_port is not None:
                self._token = endpoint.new_token()
                ep = endpoint.Endpoint(cfg.tcp_host, self.tcp_port, self._token, os.getpid())
                published = await anyio.to_thread.run_sync(
                    _publish,
                    self.endpoint_path,
                    endpoint.mode_for(cfg.socket_mode),
                    endpoint.encode(ep),
                )
            else:  # a file there is a dead predecessor's (we hold the lock): it would mislead
                await anyio.Path(self.endpoint_path).unlink(missing_ok=True)
            log.info(
                "listening on unix:%s (mode %o)%s",
                cfg.socket_path,
                cfg.socket_mode,
                f" and tcp:{cfg.tcp_host}:{self.tcp_port} (auth token in {self.endpoint_path})"
                if self.tcp_port
                else "",
            )
            await self._serve(listeners, task_status)
        finally:
            with anyio.CancelScope(shield=True):
                if published is not None:
                    await _remove_if_ours(self.endpoint_path, published)
                for listener in listeners:
                    await listener.aclose()
                await _remove_if_ours(cfg.socket_path, inode)
            os.close(lock)  # after the socket file is gone: a successor may take the path now

    async def _serve(
        self, listeners: list[Listener[ByteStream]], task_status: TaskStatus[None]
    ) -> None:
        """Accept on ``listeners`` until :meth:`drain`; return once the connections are
        answered."""
        try:
            async with anyio.create_task_group() as connections:
                with self._accepting:
                    self.bound = True
                    task_status.started()
                    async with anyio.create_task_group() as accepting:
                        for listener in listeners:
                            raw = listener.extra(SocketAttribute.raw_socket)
                            accepting.start_soon(self._accept, raw, connections)
                # Accepting stopped: close the listeners now, then the task group waits for
                # the open connections to be answered.
                self.bound = False
                with anyio.CancelScope(shield=True):
                    for listener in listeners:
                        await listener.aclose()
        finally:
            self.bound = False

    async def _accept(self, listening: socket.socket, connections: TaskGroup) -> None:
        """Accept connections on one listening socket, each served in ``connections``."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listening)
            except OSError as exc:
                if exc.errno not in _ACCEPT_RETRY:
                    raise
                log.warning("accepting a connection failed (retrying in 0.1s): %s", exc)
                await anyio.sleep(0.1)
                continue
            connections.start_soon(self._handle, sock)

    async def drain(self) -> None:
        """Stop accepting and reading; return once every connection has been answered."""
        self._stopping = True
        self._accepting.cancel()
        for conn in list(self._open):
            conn.stop_reading()
        if self._active:
            log.info("waiting for %d connection(s) to receive their replies", self._active)
            await self._all_closed.wait()

    async def _handle(self, sock: socket.socket) -> None:
        self._active += 1
        self._connections += 1
        self._metrics.connections.inc()
        failures = _Failures(self._connections)
        owed: OwedReplies[Answer] = OwedReplies(MAX_OWED_REPLIES)
        conn: Connection | None = None
        closed = False
        try:
            conn = await Connection.accepted(sock)
            self._open.add(conn)
            if self._stopping:
                conn.stop_reading()
            turn = _Turns()
            async with asyncio.TaskGroup() as replies:
                replies.create_task(self._answer(conn, owed, turn, failures))
                await self._read(conn, owed, turn, failures, self._decoder(sock), replies)
            conn.close()  # after the replies still queued
            closed = True
        except Exception:
            # No error of one connection may end the daemon. Here the connection's state is
            # unknown (the failure was outside a request), so it is closed.
            self._internal.inc()
            log.exception("connection %d failed outside a request; closing it", failures.number)
        finally:
            if conn is None:
                sock.close()
            else:
                self._open.discard(conn)
                if not closed:
                    conn.abort()
            for answer in owed.drop():  # cut (the daemon's stop): nobody will await these
                answer.make.close()
            self._active -= 1
            self._metrics.connections.dec()
            if self._stopping and self._active == 0:
                self._all_closed.set()

    def _decoder(self, sock: socket.socket) -> ServerConnection:
        """The protocol's side of a new connection: on TCP it must authenticate first."""
        tcp = sock.family != socket.AF_UNIX
        return ServerConnection(
            self._config.max_frame_bytes,
            self._admin_refusal(sock),
            auth_token=self._token if tcp else None,
            auth_hint=self._auth_hint,
        )

    def _admin_refusal(self, sock: socket.socket) -> str | None:
        """Why this connection may not send admin ops; None: it may."""
        cfg = self._config
        if not cfg.admin_ops:
            return ADMIN_OFF
        unix = sock.family == socket.AF_UNIX
        return None if unix or cfg.admin_ops_tcp else ADMIN_OFF_TCP

    async def _read(
        self,
        conn: Connection,
        owed: OwedReplies[Answer],
        turn: _Turns,
        f: _Failures,
        decoder: ServerConnection,
        replies: asyncio.TaskGroup,
    ) -> None:
        """Read and begin every request (a request that fails to begin, a bug, answers
        ``internal``) until the input ends or the protocol closes the connection."""
        auth_deadline = anyio.current_time() + AUTH_TIMEOUT_S
        try:
            while not decoder.closed:
                data = await self._next(conn, decoder, auth_deadline)
                if data is None:
                    why = f"no auth within {AUTH_TIMEOUT_S:g}s"
                    events: list[Event] = [decoder.refuse_unauthenticated(why)]
                elif data:
                    events = decoder.receive_data(data)
                else:
                    break  # the input ended
                for event in events:
                    try:
                        answer = await self._handler.begin(event)
                    except Exception:
                        f.log(event.id)
                        owed.settle(owed.owe(), self._internal_error(event.id))
                    else:
                        if answer.at_once:
                            slot = owed.owe()
                            replies.create_task(self._settle(answer, slot, owed, turn, f))
                        else:
                            owed.owe(answer)
                    turn.more.set()
                    while owed.full:
                        turn.room.clear()
                        await turn.room.wait()
        finally:
            turn.reading = False
            turn.more.set()

    @staticmethod
    async def _next(conn: Connection, decoder: ServerConnection, deadline: float) -> bytes | None:
        """What :meth:`Connection.read` gives; None when a connection that must authenticate
        has sent nothing complete by ``deadline``."""
        if decoder.authenticated:
            return await conn.read()
        with anyio.move_on_after(deadline - anyio.current_time()):
            return await conn.read()
        return None

    async def _settle(
        self, answer: Answer, slot: int, owed: OwedReplies[Answer], turn: _Turns, f: _Failures
    ) -> None:
        """A reply started at once: settled in its slot when ready, written in its turn."""
        owed.settle(slot, await self._made(answer, f))
        turn.more.set()

    async def _made(self, answer: Answer, f: _Failures) -> bytes:
        try:
            return await answer.make
        except Exception:
            f.log(answer.request_id)
            return self._internal_error(answer.request_id)

    def _internal_error(self, request_id: RequestId) -> bytes:
        self._internal.inc()
        return encode_error(request_id, ErrorCode.INTERNAL, INTERNAL_MESSAGE)

    async def _answer(
        self, conn: Connection, owed: OwedReplies[Answer], turn: _Turns, f: _Failures
    ) -> None:
        """Answer the requests in order; replies that are ready together leave together.
        When the client has left, the replies are still awaited (what it sent is stored
        regardless), not written."""
        while owed or turn.reading:
            if out := owed.take():
                if not owed.full:
                    turn.room.set()
                conn.write(out[0] if len(out) == 1 else b"".join(out))
                if conn.full:
                    await conn.drain()
            elif head := owed.head():
                slot, answer = head
                owed.settle(slot, await self._made(answer, f))
            else:
                turn.more.clear()
                await turn.more.wait()


class _Turns:
    """What the reading and the answering task of one connection tell each other."""

    __slots__ = ("more", "reading", "room")

    def __init__(self) -> None:
        self.more = asyncio.Event()  # a request was read (or the reading ended)
        self.room = asyncio.Event()  # fewer than MAX_OWED_REPLIES are owed
        self.reading = True


class _Failures:
    """Unexpected errors of one connection: the first is logged with its traceback."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.count = 0

    def log(self, request_id: RequestId) -> None:
        self.count += 1
        if self.count == 1:
            log.exception(
                "connection %d: request id=%r failed unexpectedly; answered `internal` "
                "(further failures on this connection are counted, not logged)",
                self.number,
                request_id,
            )
