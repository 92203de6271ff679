"""The socket server: a thin I/O shell around :mod:`sidecar.protocol`.

Read bytes, feed the decoder, act on the events, write the replies — all protocol rules live
in the pure module. Per connection, every update of one read is submitted before any reply is
awaited, so updates pipelined by one client (and those of concurrent clients) share a Redis
round trip; replies still go out in request order. A ``get`` is answered after every earlier
request of its connection, so a client reads its own writes.

Stopping (``drain``): stop accepting, stop reading, answer what was already read, close.
"""

from __future__ import annotations

import logging
import stat
import time
from collections.abc import Sequence

import anyio
import msgspec
from anyio.abc import ByteStream, Listener, TaskStatus
from anyio.streams.stapled import MultiListener

from sidecar import checkpoint as ckpt
from sidecar.blobstore import BlobStore, newest_named
from sidecar.buffer import RedisBuffer, WriteCoalescer, _Slot
from sidecar.config import Config
from sidecar.errors import SidecarError, SocketInUse
from sidecar.flusher import Flusher
from sidecar.lag import LagTracker
from sidecar.metrics import Metrics
from sidecar.protocol import (
    BadRequest,
    ErrorCode,
    Event,
    Get,
    Ping,
    Progress,
    ServerConnection,
    encode_error,
    encode_ok,
)

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


class SocketServer:
    """Accepts connections and answers their requests until :meth:`drain`."""

    def __init__(
        self,
        config: Config,
        buffer: RedisBuffer,
        coalescer: WriteCoalescer,
        metrics: Metrics,
        *,
        store: BlobStore | None = None,
        flusher: Flusher | None = None,
        lag: LagTracker | None = None,
    ) -> None:
        self._config = config
        self._store = store
        self._lag = lag
        # Label children bound once: .labels() costs more than the increment on this path.
        self._applied = metrics.updates.labels("applied")
        self._stale = metrics.updates.labels("stale")
        self._no_offsets = metrics.updates.labels("no_offsets")
        self._rejected = metrics.updates.labels("rejected")
        self._flusher = flusher if config.ack_mode == "blob" else None
        self._buffer = buffer
        self._coalescer = coalescer
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
        # Submit every update of this read first, so they share one Redis round trip.
        staged: list[tuple[Event, _Slot | None, float]] = []
        for event in events:
            slot = None
            started = time.perf_counter()
            if isinstance(event, Progress) and ckpt.has_position(event.checkpoint):
                slot = await self._coalescer.submit(event.checkpoint)
            staged.append((event, slot, started))
        out = bytearray()
        for event, slot, started in staged:
            out += await self._reply(event, slot, started)
        return bytes(out)

    async def _reply(self, event: Event, slot: _Slot | None, started: float) -> bytes:
        m = self._metrics
        match event:
            case Progress(id=rid, checkpoint=c) if not ckpt.has_position(c):
                # Nothing to resume from (sidecar.checkpoint's position rule): not stored, and
                # acknowledged at once, even in blob ack mode (no blob will ever hold it), so
                # the client neither resends it nor counts it as failed.
                self._no_offsets.inc()
                log.debug(
                    "update query=%s batch=%d has no end offsets; not stored", c.label, c.batch_id
                )
                m.ack_seconds.observe(time.perf_counter() - started)
                return encode_ok(rid, applied=False)
            case Progress(id=rid, checkpoint=c):
                assert slot is not None
                try:
                    applied = await slot.wait()
                except SidecarError as exc:
                    self._rejected.inc()
                    return encode_error(rid, ErrorCode(exc.code), str(exc))
                except Exception:
                    log.exception("storing update query=%s batch=%d failed", c.label, c.batch_id)
                    self._rejected.inc()
                    return encode_error(rid, ErrorCode.INTERNAL, "internal error; see daemon log")
                (self._applied if applied else self._stale).inc()
                if applied and self._lag is not None:
                    self._lag.observe(c)
                if not applied:
                    log.debug("stale update query=%s batch=%d not applied", c.label, c.batch_id)
                if self._flusher is not None:  # ack_mode=blob: wait until the blob has it
                    with anyio.move_on_after(self._config.blob_ack_timeout_s):
                        await self._flusher.wait_durable(c.query_id, c.batch_id)
                        m.ack_seconds.observe(time.perf_counter() - started)
                        return encode_ok(rid, applied=applied)
                    return encode_error(
                        rid,
                        ErrorCode.NOT_DURABLE,
                        f"batch {c.batch_id} of query {c.label} is stored in Redis but not yet "
                        f"in the blob after {self._config.blob_ack_timeout_s}s (lease not held "
                        "or store unavailable; see /readyz); resending is safe",
                    )
                m.ack_seconds.observe(time.perf_counter() - started)
                return encode_ok(rid, applied=applied)
            case Get(id=rid, query_id=query_id, name=name):
                try:
                    raw = await self._lookup(query_id, name)
                except SidecarError as exc:
                    return encode_error(rid, ErrorCode(exc.code), str(exc))
                return encode_ok(rid, checkpoint=msgspec.Raw(raw) if raw else None)
            case Ping(id=rid):
                return encode_ok(rid)
            case BadRequest(id=rid, code=code, message=message, fatal=fatal, op=op):
                m.bad_requests.labels(code.value).inc()
                if op == "progress":
                    self._rejected.inc()
                log.log(
                    logging.WARNING if fatal else logging.INFO,
                    "bad request (%s): %s",
                    code.value,
                    message,
                )
                return encode_error(rid, code, message)
        raise AssertionError(f"unhandled event {event!r}")

    async def _lookup(self, query_id: str | None, name: str | None) -> bytes | None:
        """A checkpoint from Redis, else from the blob (Redis lost it, or never had it)."""
        if query_id is None and name is not None:
            query_id = await self._buffer.query_id_for(name)
        raw = await self._buffer.get(query_id) if query_id is not None else None
        if raw is not None or self._store is None:
            return raw
        if query_id is not None:
            doc = await self._store.read(query_id)
        else:
            assert name is not None
            doc = newest_named(await self._store.list(), name)
        return ckpt.encode(doc.checkpoint()) if doc is not None else None
