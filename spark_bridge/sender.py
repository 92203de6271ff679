"""Background sender: delivers the latest progress of each query to the daemon.

Spark's listener thread only calls :meth:`Sender.offer`, which stores the progress JSON in a
dict keyed by query id and wakes the sender thread: no I/O, no parsing, O(1). Offsets are
cumulative, so a newer progress of the same query supersedes an unsent older one
(conflation): memory is bounded by the number of queries, never by the event rate.

The sender thread speaks the daemon's protocol through :mod:`spark_bridge.wire` (the client's
subset of ``sidecar.wire.protocol``, checked against it), pipelines everything pending in one
write, reads the replies in order, and on a broken connection or a retriable error reply puts
the updates back (unless superseded meanwhile) and reconnects with capped exponential backoff,
jittered.

Only the sender thread touches the socket. ``close()`` asks it to stop through a flag and a
wake-up (a socket pair watched beside the connection), never by closing the socket under it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import selectors
import socket
import threading
import time

from spark_bridge.handle import SenderStats
from spark_bridge.wire import (
    CLOSING_CODES,
    RETRIABLE_CODES,
    ClientConnection,
    ProtocolViolation,
    Reply,
    encode_progress,
)

log = logging.getLogger(__name__)

BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 5.0
#: Queries tracked at most; beyond it the update is dropped and counted as failed.
MAX_QUERIES = 10_000


class Sender:
    """Owns one background thread and one connection to the daemon's Unix socket."""

    def __init__(self, socket_path: str, *, timeout_s: float = 60.0) -> None:
        """``timeout_s`` bounds one connect or reply wait; it must exceed the daemon's
        SIDECAR_BLOB_ACK_TIMEOUT_S in blob ack mode (a held ack is not a dead daemon)."""
        self.socket_path = socket_path
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        # Two conditions on one lock: the sender thread waits for work (offer, close) on
        # _work; flush() waits for delivery on _idle. One condition would let an offer's
        # notify wake a flush() caller instead of the sender thread.
        self._work = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._latest: dict[str, bytes] = {}
        self._tracking: dict[str, str] = {}  # query id → how it tracks progress, when known
        self._in_flight: set[str] = set()
        self._closing = False
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._failures = 0  # attempts failed in a row, for the backoff
        self._down_since: float | None = None
        self._connected_once = False
        self.offered = self.sent = self.conflated = self.failed = 0
        self.retried = self.reconnects = 0
        self.last_error: str | None = None
        # close() wakes the thread out of a socket wait by writing to _wake_w.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(
            target=self._run, name="checkpoint-sidecar-sender", daemon=True
        )
        self._thread.start()

    # --- Spark's thread ----------------------------------------------------------------------

    def offer(self, query_id: str, progress_json: bytes) -> None:
        """Queue the latest progress of ``query_id``. Never blocks on I/O, never raises."""
        with self._lock:
            self.offered += 1
            if self._closing:
                self.failed += 1
                self.last_error = "offered after close; dropped"
                return
            if query_id in self._latest:
                self.conflated += 1
            elif len(self._latest) >= MAX_QUERIES:
                self.failed += 1
                self.last_error = f"more than {MAX_QUERIES} queries pending; dropped"
                return
            self._latest[query_id] = progress_json
            self._work.notify()

    def set_tracking(self, query_id: str, tracking: str | None) -> None:
        """How ``query_id`` tracks progress ("sync", "async", "real_time"), sent with each of
        its updates; None: unknown (one entry per query the driver ran, kept past its end
        so that its last update, if retried, still says it)."""
        with self._lock:
            if tracking is None:
                self._tracking.pop(query_id, None)
            else:
                self._tracking[query_id] = tracking

    # --- control -----------------------------------------------------------------------------

    def stats(self) -> SenderStats:
        with self._lock:
            return SenderStats(
                self.offered,
                self.sent,
                self.conflated,
                self.failed,
                self.retried,
                self.reconnects,
                len(self._in_flight.union(self._latest)),
                self.last_error,
            )

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything offered so far is acknowledged; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._latest or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> bool:
        """Flush (bounded by ``timeout_s``), then stop the thread. True if all was sent."""
        done = self.flush(timeout_s)
        with self._lock:
            self._closing = True
            self._work.notify_all()
            self._idle.notify_all()
        with contextlib.suppress(OSError):  # already closed: the thread has ended
            self._wake_w.send(b"x")
        self._thread.join(timeout=1.0)
        return done

    # --- the sender thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._disconnect()
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._latest and not self._closing:
                    self._work.wait()
                if self._closing:
                    return
                batch, self._latest = self._latest, {}
                self._in_flight = set(batch)
            retry, sent, failed = self._deliver(batch)
            with self._lock:
                for query_id, payload in retry.items():
                    if query_id in self._latest:
                        self.conflated += 1  # superseded while in flight: the newer one wins
                    else:
                        self._latest[query_id] = payload
                self._in_flight = set()
                self.sent += sent
                self.failed += failed
                self.retried += len(retry)
                self._idle.notify_all()
            if retry:
                self._sleep_backoff()
            else:
                self._failures = 0

    def _sleep_backoff(self) -> None:
        """Wait out the backoff (exponential from BACKOFF_START_S to BACKOFF_MAX_S, each delay
        drawn between half and all of it); new offers do not cut it short, only close() does."""
        self._failures += 1
        nominal = min(BACKOFF_MAX_S, BACKOFF_START_S * 2 ** min(self._failures - 1, 32))
        deadline = time.monotonic() + nominal * (0.5 + 0.5 * random.random())
        with self._lock:
            while not self._closing and (left := deadline - time.monotonic()) > 0:
                self._work.wait(left)

    def _deliver(self, batch: dict[str, bytes]) -> tuple[dict[str, bytes], int, int]:
        """Send a batch; return (updates to retry, number sent, number refused for good)."""
        items = list(batch.items())
        ids = [next(self._ids) for _ in items]
        with self._lock:
            how = {q: self._tracking[q] for q, _ in items if q in self._tracking}
        replies: list[Reply] = []
        try:
            sock = self._connect()
            deadline = time.monotonic() + self._timeout_s
            self._send_all(
                sock,
                b"".join(
                    encode_progress(rid, payload, how.get(q))
                    for rid, (q, payload) in zip(ids, items)
                ),
                deadline,
            )
            conn = ClientConnection()
            while len(replies) < len(items):
                self._wait(sock, selectors.EVENT_READ, deadline)
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue  # a spurious wake-up
                if not data:
                    raise ConnectionError("the daemon closed the connection")
                for reply in conn.receive_data(data):
                    _check_id(reply, ids[len(replies)] if len(replies) < len(ids) else None)
                    replies.append(reply)
        except (OSError, ProtocolViolation) as exc:
            self._disconnect()
            with self._lock:
                self.last_error = str(exc) or type(exc).__name__
            if replies:
                # The daemon answered part of the batch before closing (e.g. it refused an
                # oversized frame with frame_too_large): settle those, retry only the rest,
                # so one bad update cannot wedge the queries queued behind it.
                retry, sent, failed = self._settle(items[: len(replies)], replies)
                retry.update(items[len(replies) :])
                return retry, sent, failed
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning(
                    "checkpoint-sidecar at %s unreachable (%s); keeping the latest "
                    "offsets of %d query(ies) and retrying",
                    self.socket_path,
                    exc,
                    len(batch),
                )
            return batch, 0, 0
        if any(r.error is not None and r.error.code in CLOSING_CODES for r in replies):
            self._disconnect()  # the daemon closes after such an error; do not write into it
        if self._down_since is not None:
            log.info(
                "checkpoint-sidecar at %s reachable again after %.1fs",
                self.socket_path,
                time.monotonic() - self._down_since,
            )
            self._down_since = None
        return self._settle(items, replies)

    def _settle(
        self, items: list[tuple[str, bytes]], replies: list[Reply]
    ) -> tuple[dict[str, bytes], int, int]:
        retry: dict[str, bytes] = {}
        sent = failed = 0
        for (query_id, payload), reply in zip(items, replies):  # as many of each
            if reply.ok:
                sent += 1
            elif reply.error is not None and reply.error.code in RETRIABLE_CODES:
                retry[query_id] = payload
            else:
                failed += 1
                with self._lock:
                    self.last_error = (
                        f"{reply.error.code}: {reply.error.message}" if reply.error else "refused"
                    )
                log.warning(
                    "checkpoint-sidecar refused the progress of query %s: %s",
                    query_id,
                    reply.error.message if reply.error else reply,
                )
        return retry, sent, failed

    def _wait(self, sock: socket.socket, events: int, deadline: float) -> None:
        """Wait until ``sock`` is ready; raise on timeout or when close() asks to stop."""
        key = self._selector.register(sock, events)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no answer from the daemon within {self._timeout_s}s")
                for ready, _ in self._selector.select(left):
                    if ready.fileobj is self._wake_r or self._closing:
                        raise InterruptedError("the sender is closing")
                    if ready is key or ready.fileobj is sock:
                        return
        finally:
            self._selector.unregister(sock)

    def _send_all(self, sock: socket.socket, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[sock.send(view) :]
            except BlockingIOError:
                self._wait(sock, selectors.EVENT_WRITE, deadline)

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout_s)
            try:
                sock.connect(self.socket_path)  # a local socket: refused or accepted at once
            except OSError:
                sock.close()
                raise
            sock.setblocking(False)
            self._sock = sock
            if self._connected_once:
                self.reconnects += 1
            self._connected_once = True
        return self._sock

    def _disconnect(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None


def _check_id(reply: Reply, expected: int | None) -> None:
    """Replies come in request order and echo the id (null only on errors such as
    frame_too_large, which the daemon cannot attribute); anything else is not our daemon."""
    if expected is None:
        raise ProtocolViolation("more replies than requests")
    if (reply.id is None and reply.ok) or (reply.id is not None and reply.id != expected):
        raise ProtocolViolation(f"reply id {reply.id!r} where {expected} was due")
