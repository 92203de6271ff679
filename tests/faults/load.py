"""The load harness of the fault sweep (``tests/faults/test_sweep.py``).

:func:`run_load` drives real daemons through their sockets and checks the sweep's invariant:
**every update acknowledged ``ok`` is durable after recovery, and no query's checkpoint ever
moves backwards in Redis, in the blob, or in a ``get`` reply.**

- *Senders*: ``connections`` client connections (spread over one or more daemons' sockets)
  pipeline windows of ``depth`` progress updates for ``queries`` queries, each update taking
  the query's next batch id from a counter shared by every connection, paced to
  ``rate_per_s`` in all. An ``ok`` reply (applied or stale: "the buffer holds this batch or
  newer") raises the query's highest acknowledged batch; a retriable error reply, and every
  update of a window whose connection broke, is resent in the next window, after a reconnect
  when needed (as the Spark listener does).
- *Watcher*: polls each query's ``batch_id`` in Redis, its ``get`` reply from every daemon and
  its blob, and records every value lower than one seen before. Errors while a service is
  down are counted, never fatal: the faults are the point.
- *Final check* (:meth:`Load.wait_durable`): each blob (and Redis) holds at least the highest
  acknowledged batch of its query.
"""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import cast

import anyio
import redis.asyncio as aioredis

from sidecar.buffer.keys import Keys
from sidecar.config import Config
from sidecar.errors import SidecarError
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore
from sidecar.wire.protocol import RETRIABLE_CODES, ProtocolViolation
from tests.helpers import metric_value
from tests.services import DaemonProcess
from tests.sparkshapes import kafka_progress

log = logging.getLogger("tests.sweep")

#: A window whose replies take longer than this is treated as a broken connection (resent).
WINDOW_TIMEOUT_S = 15.0
#: Pause before reconnecting, and after a window answered only with errors.
RETRY_PAUSE_S = 0.05
#: How often the watcher reads every query's Redis record, ``get`` replies and blob.
WATCH_EVERY_S = 0.1
#: Errors that mean "this connection is gone": reconnect and resend.
DISCONNECTED = (
    OSError,
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    ProtocolViolation,
    TimeoutError,
)


@dataclass
class QueryLoad:
    query_id: str
    name: str
    #: The next batch id to send (shared by every connection).
    next_batch: int = 0
    #: The highest batch acknowledged ``ok``; -1 before the first.
    acked: int = -1
    #: (when, batch) of acks not yet seen in the blob, oldest first (one per 50 ms at most).
    acked_at: deque[tuple[float, int]] = field(default_factory=deque)

    def ack(self, batch: int) -> None:
        if batch <= self.acked:
            return
        self.acked = batch
        now = time.monotonic()
        if self.acked_at and now - self.acked_at[-1][0] < 0.05:
            self.acked_at[-1] = (self.acked_at[-1][0], batch)  # the older time: lag not hidden
        else:
            self.acked_at.append((now, batch))


@dataclass
class Watched:
    """The highest value seen so far in one place (Redis, a daemon's ``get``, the blob)."""

    highest: int = -1
    #: The value of the previous read (a regression is recorded once, not at every poll).
    last: int | None = None
    reads: int = 0
    errors: int = 0


@dataclass
class Load:
    socket_paths: Sequence[str]
    queries: list[QueryLoad]
    config: Config
    acks: int = 0
    stale_acks: int = 0
    #: ``ok`` replies per socket path (which daemon acknowledged).
    acks_by_socket: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    reconnects: int = 0
    #: Replies no client may ever get (a non-retriable error): each is a failure.
    unexpected: list[str] = field(default_factory=list)
    #: Every decrease the watcher saw: "where query: seen X, then Y".
    regressions: list[str] = field(default_factory=list)
    watched: dict[tuple[str, str], Watched] = field(default_factory=dict)
    sending: bool = True
    #: Sender tasks still running.
    senders: int = 0
    #: The longest any acknowledged batch waited until the watcher saw it in its blob.
    blob_lag_max_s: float = 0.0
    #: Raised by :meth:`store_went_back`: a blob read begun before is not judged.
    blob_epoch: int = 0

    # --- what the tests use ----------------------------------------------------------------

    def acked(self) -> dict[str, int]:
        """The highest batch acknowledged ``ok`` per query id."""
        return {q.query_id: q.acked for q in self.queries}

    async def wait_acks(self, count: int, timeout_s: float = 30) -> None:
        """Wait until ``count`` updates in all have been acknowledged ``ok``."""
        await self._wait(lambda: self.acks >= count, timeout_s, f"{count} acks ({self.acks})")

    async def wait_each_acked_above(
        self, batches: Mapping[str, int], timeout_s: float = 60
    ) -> None:
        """Wait until every query has an ack above its batch in ``batches``."""
        await self._wait(
            lambda: all(q.acked > batches[q.query_id] for q in self.queries),
            timeout_s,
            f"acks above {dict(batches)}",
        )

    async def stop_sending(self) -> None:
        """Stop the senders (their current windows are answered first)."""
        self.sending = False
        await self._wait(lambda: self.senders == 0, WINDOW_TIMEOUT_S + 5, "senders to stop")

    async def wait_durable(self, timeout_s: float = 60) -> float:
        """Wait until every query's blob and Redis record hold at least its highest acked
        batch; the seconds it took. Stop the senders first, or this chases a moving target.

        Raises:
            AssertionError: not durable within ``timeout_s``; names each query behind.
        """
        started = time.monotonic()
        behind: dict[str, str] = {}
        deadline = started + timeout_s
        async with self._store() as store, self._redis() as r:
            while True:
                behind = {}
                for q in self.queries:
                    blob = await _blob_batch(store, q.query_id)
                    # A restarted Redis is read once loaded: RedisServer.start waits for it.
                    stored = await _redis_batch(r, self.keys, q.query_id)
                    if blob is None or blob < q.acked or stored is None or stored < q.acked:
                        behind[q.name] = f"acked {q.acked}, blob {blob}, redis {stored}"
                if not behind:
                    return time.monotonic() - started
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"not durable after {timeout_s}s: {behind}; {self.summary()}"
                    )
                await anyio.sleep(0.1)

    async def wait_every_blob(self, timeout_s: float = 30) -> dict[str, int]:
        """Wait until every query has a checkpoint in its blob (flushes are running); the
        batch of each."""
        deadline = time.monotonic() + timeout_s
        while True:
            batches = await self.blob_batches()
            if all(b is not None for b in batches.values()):
                return {q: b for q, b in batches.items() if b is not None}
            if time.monotonic() > deadline:
                raise AssertionError(f"no blob after {timeout_s}s for some of {batches}")
            await anyio.sleep(0.1)

    async def wait_pending(self, timeout_s: float = 30) -> None:
        """Wait until Redis holds an acknowledged update not yet flushed (a query's
        ``pending`` above 0): a kill now leaves something for the next daemon to recover."""
        deadline = time.monotonic() + timeout_s
        keys = [self.keys.query(q.query_id) for q in self.queries]
        async with self._redis() as r:
            while True:
                counts = [await r.hget(key, "pending") for key in keys]
                if any(int(c or 0) > 0 for c in counts):
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(f"nothing pending in Redis after {timeout_s}s: {counts}")
                await anyio.sleep(0.005)

    async def blob_batches(self) -> dict[str, int | None]:
        """Each query's batch in its blob now (None: no readable document)."""
        async with self._store() as store:
            return {q.query_id: await _blob_batch(store, q.query_id) for q in self.queries}

    def store_went_back(self) -> None:
        """The store came back having lost writes (killed, restarted on its data): what each
        blob holds from now on is judged from what it holds then, not from before (a move back
        by the store itself is not a regression; any later one is)."""
        self.blob_epoch += 1
        for (where, _), w in self.watched.items():
            if where == "blob":
                w.highest, w.last = -1, None

    def check(self) -> None:
        """Fail on any backwards move seen or any reply no client should get."""
        assert not self.regressions, f"checkpoints moved backwards: {self.regressions}"
        assert not self.unexpected, f"unexpected replies: {self.unexpected[:5]}"

    def summary(self) -> str:
        errors = dict(self.errors) or "none"
        watched = ", ".join(
            f"{where}: {sum(w.reads for (k, _), w in self.watched.items() if k == where)} "
            f"reads, {sum(w.errors for (k, _), w in self.watched.items() if k == where)} failed"
            for where in sorted({k for k, _ in self.watched})
        )
        return (
            f"{self.acks} updates acked ok ({self.stale_acks} of them stale) over "
            f"{len(self.queries)} queries, highest acked {sorted(self.acked().values())}, "
            f"error replies {errors}, reconnects {self.reconnects}, "
            f"regressions {len(self.regressions)}; watched {watched}"
        )

    # --- senders ---------------------------------------------------------------------------

    @property
    def keys(self) -> Keys:
        return Keys(self.config.namespace)

    async def _send(self, socket_path: str, window_s: float, depth: int) -> None:
        resend: list[tuple[QueryLoad, int]] = []
        turn = 0
        self.senders += 1
        try:
            while self.sending:
                try:
                    client = await SidecarClient.connect(socket_path)
                except OSError:  # not (yet / again) listening: the daemon is down
                    await anyio.sleep(RETRY_PAUSE_S)
                    continue
                async with client:
                    next_at = anyio.current_time()
                    while self.sending:
                        window, resend = resend[:depth], resend[depth:]
                        while len(window) < depth:
                            q = self.queries[turn % len(self.queries)]
                            turn += 1
                            window.append((q, q.next_batch))
                            q.next_batch += 1
                        try:
                            with anyio.fail_after(WINDOW_TIMEOUT_S):
                                replies = await client.send_many(
                                    [
                                        (
                                            "progress",
                                            {
                                                "progress": kafka_progress(
                                                    q.query_id, b, name=q.name
                                                )
                                            },
                                        )
                                        for q, b in window
                                    ]
                                )
                        except DISCONNECTED:
                            resend = window + resend
                            self.reconnects += 1
                            break
                        failed = 0
                        for (q, b), reply in zip(window, replies, strict=True):
                            if reply.ok:
                                q.ack(b)
                                self.acks += 1
                                self.acks_by_socket[socket_path] += 1
                                self.stale_acks += reply.applied is False
                            elif reply.error is not None and reply.error.code in RETRIABLE_CODES:
                                self.errors[reply.error.code] += 1
                                resend.append((q, b))
                                failed += 1
                            else:
                                self.unexpected.append(f"{q.name} batch {b}: {reply}")
                        next_at += RETRY_PAUSE_S if failed == len(window) else window_s
                        await anyio.sleep(max(0.0, next_at - anyio.current_time()))
                        next_at = max(next_at, anyio.current_time() - window_s)
                if self.sending:
                    await anyio.sleep(RETRY_PAUSE_S)
        finally:
            self.senders -= 1

    # --- watcher ---------------------------------------------------------------------------

    def _see(self, where: str, q: QueryLoad, value: int | None) -> None:
        w = self.watched.setdefault((where, q.query_id), Watched())
        w.reads += 1
        if value is None and w.highest < 0:
            return  # nothing there yet
        if value is None or value < w.highest:
            # None after a batch: the record vanished, the farthest a checkpoint can go back.
            if value != w.last:
                self.regressions.append(f"{where} {q.name}: saw batch {w.highest}, then {value}")
                log.error("sweep: %s", self.regressions[-1])
        else:
            w.highest = value
        w.last = value

    def _in_blob(self, q: QueryLoad, batch: int | None) -> None:
        now = time.monotonic()
        while batch is not None and q.acked_at and q.acked_at[0][1] <= batch:
            self.blob_lag_max_s = max(self.blob_lag_max_s, now - q.acked_at.popleft()[0])

    def _failed(self, where: str, q: QueryLoad) -> None:
        self.watched.setdefault((where, q.query_id), Watched()).errors += 1

    async def _watch(self) -> None:
        clients: dict[str, SidecarClient | None] = dict.fromkeys(self.socket_paths)
        async with self._store() as store, self._redis() as r:
            try:
                while True:
                    for q in self.queries:
                        try:
                            with anyio.fail_after(2):
                                self._see("redis", q, await _redis_batch(r, self.keys, q.query_id))
                        except (aioredis.RedisError, OSError, TimeoutError):
                            self._failed("redis", q)
                        for i, path in enumerate(self.socket_paths):
                            where = f"get@daemon{i}"
                            try:
                                with anyio.fail_after(5):
                                    client = clients[path]
                                    if client is None:
                                        client = clients[path] = await SidecarClient.connect(path)
                                    reply = await client.get(q.query_id)
                            except DISCONNECTED:
                                if clients[path] is not None:
                                    await cast(SidecarClient, clients[path]).aclose()
                                clients[path] = None
                                self._failed(where, q)
                                continue
                            if reply.ok:
                                batch = reply.checkpoint["batch_id"] if reply.checkpoint else None
                                self._see(where, q, batch)
                            else:
                                self._failed(where, q)
                        try:
                            epoch = self.blob_epoch
                            batch = await _blob_batch(store, q.query_id)
                            if epoch == self.blob_epoch:  # else read before the store went back
                                self._see("blob", q, batch)
                                self._in_blob(q, batch)
                        except SidecarError:
                            self._failed("blob", q)
                    await anyio.sleep(WATCH_EVERY_S)
            finally:
                with anyio.CancelScope(shield=True):
                    for client in clients.values():
                        if client is not None:
                            await client.aclose()

    # --- clients of Redis and the store, with short timeouts ---------------------------------

    @asynccontextmanager
    async def _store(self) -> AsyncIterator[BlobStore]:
        store = BlobStore(self.config)
        try:
            yield store
        finally:
            with anyio.CancelScope(shield=True):
                await store.aclose()

    @asynccontextmanager
    async def _redis(self) -> AsyncIterator[aioredis.Redis]:
        r = aioredis.Redis.from_url(
            self.config.redis_url, socket_timeout=1, socket_connect_timeout=1
        )
        try:
            yield r
        finally:
            with anyio.CancelScope(shield=True):
                await r.aclose()

    async def _wait(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
            await anyio.sleep(0.02)


async def _blob_batch(store: BlobStore, query_id: str) -> int | None:
    doc = await store.read(query_id)
    return doc.batch_id if doc is not None else None


async def _redis_batch(r: aioredis.Redis, keys: Keys, query_id: str) -> int | None:
    value = await r.hget(keys.query(query_id), "batch_id")
    return int(value) if value is not None else None


def query_ids(count: int) -> list[QueryLoad]:
    return [QueryLoad(f"5eeb0000-0000-4000-8000-{i:012d}", f"sweep-{i}") for i in range(count)]


@asynccontextmanager
async def run_load(
    env: Mapping[str, str],
    socket_paths: Sequence[str] | None = None,
    *,
    queries: int = 6,
    connections: int = 3,
    depth: int = 16,
    rate_per_s: float = 1500.0,
) -> AsyncIterator[Load]:
    """Send load to the daemons of ``socket_paths`` (default: ``env``'s socket) and watch it.

    ``env`` is a daemon's settings (as for :class:`DaemonProcess`): the watcher and the final
    check reach Redis and the blobs with them (blob calls time out after 2 s). Leaving the
    block stops everything; :meth:`Load.check` is the test's to call.
    """
    settings = {**env, "SIDECAR_WRITE_TIMEOUT_S": "2"}
    settings.pop("SIDECAR_METRICS_PORT", None)
    config = Config.from_env(settings)
    paths = list(socket_paths or [config.socket_path])
    load = Load(paths, query_ids(queries), config)
    window_s = depth * connections / rate_per_s
    async with anyio.create_task_group() as tg:
        for i in range(connections):
            tg.start_soon(load._send, paths[i % len(paths)], window_s, depth)
        tg.start_soon(load._watch)
        try:
            yield load
        finally:
            load.sending = False
            tg.cancel_scope.cancel()
    log.info("sweep load: %s", load.summary())


# --- the daemon as a process: metrics and readiness -------------------------------------------

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def scrape_process(proc: DaemonProcess, path: str = "/metrics") -> tuple[int, str]:
    """GET an admin endpoint of a daemon process (blocking: call it in a thread)."""
    try:
        with _NO_PROXY.open(f"{proc.admin_url}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


async def metric(proc: DaemonProcess, name: str, **labels: str) -> float | None:
    """One sample of a daemon process's metrics; None when absent or the daemon is away."""
    try:
        _, text = await anyio.to_thread.run_sync(scrape_process, proc)
    except (urllib.error.URLError, OSError):
        return None
    try:
        return metric_value(text, name, **labels)
    except AssertionError:
        return None


async def readyz(proc: DaemonProcess) -> tuple[int, str] | None:
    return await anyio.to_thread.run_sync(proc.readyz)
