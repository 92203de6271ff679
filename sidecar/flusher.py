"""The flusher: moves each query's latest checkpoint from Redis to its blob.

Every ``flush_interval_s`` it reads a snapshot of the pending queries from Redis and flushes
a query when it has ``count_threshold`` updates pending, when its oldest pending update is
``time_threshold_s`` old, or when an acknowledgement waits on it (``ack_mode=blob``: one
write answers every waiting ack of that query — group commit). Queries flush concurrently,
at most ``flush_concurrency`` at a time, each write time-limited.

A flush writes only under the query's lease (``sidecar.lease``) and never moves a blob
backwards: after acquiring a lease it reads the blob, and a snapshot not newer than what the
blob holds is recorded as flushed without a write. A failed write is retried with capped
exponential backoff and jitter (``sidecar.backoff``; errors that are not ``retriable`` wait
the full cap and are logged as errors); nothing is dropped, because the pending state in Redis is
cleared only after the write succeeded, and only as far as the written snapshot covered.

Each document also carries the query's earlier flushed checkpoints (``history``, at most
``history_size``, newest first), taken from the document the blob holds — the one read after
acquiring the lease, or the one this daemon last wrote under it (``QueryLease.blob_document``)
— so keeping history costs no extra blob read or write.

At start the first tick flushes whatever a previous run left pending (crash recovery); at
stop :meth:`final_flush` flushes everything owned, whatever the thresholds.

A record that cannot be read (:class:`~sidecar.errors.CorruptRecord`: a query's Redis hash or
its blob, written by another version, cut short, edited by hand) is quarantined: left as it
is, not flushed, counted once in ``checkpoint_sidecar_bad_records_total{where}`` and logged
once as an error naming it, until it is readable again; every other query keeps flushing.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
from anyio.abc import TaskStatus

from sidecar import checkpoint as ckpt
from sidecar.backoff import Backoff
from sidecar.blobstore import BlobStore
from sidecar.buffer import PendingQuery, RedisBuffer
from sidecar.config import Config
from sidecar.errors import CorruptRecord, LeaseLost, SidecarError
from sidecar.floor import BlobFloors
from sidecar.lease import LeaseManager, QueryLease
from sidecar.metrics import Metrics

log = logging.getLogger(__name__)

RETRY_BASE_S = 0.5
RETRY_CAP_S = 30.0


class Flusher:
    def __init__(
        self,
        config: Config,
        buffer: RedisBuffer,
        store: BlobStore,
        leases: LeaseManager,
        metrics: Metrics,
        writer: ckpt.Writer,
        *,
        on_durable: Callable[[ckpt.Checkpoint], None] | None = None,
        floors: BlobFloors | None = None,
        track: Callable[[str, str], None] | None = None,
    ) -> None:
        """``track(query_id, label)``: called for each query a pass finds pending, so that
        idle-query retirement knows every query the flusher holds state for."""
        self._config = config
        self._buffer = buffer
        self._store = store
        self._leases = leases
        self._metrics = metrics
        self._writer = writer
        #: Called with each checkpoint once it is in the blob (Kafka commits follow it).
        self._on_durable = on_durable
        #: What the blobs hold, kept current for the ingest path (``sidecar.floor``).
        self._floors = floors
        self._track = track
        self._limiter = anyio.CapacityLimiter(config.flush_concurrency)
        self._backoff = Backoff(RETRY_BASE_S, RETRY_CAP_S)
        self._waiters: dict[str, list[tuple[int, anyio.Event]]] = defaultdict(list)
        self._durable: dict[str, int] = {}
        #: Unreadable records, by query id: {where: Redis key or blob name}, each counted and
        #: logged once, until the record is readable again.
        self._quarantined: dict[str, dict[str, str]] = defaultdict(dict)
        #: Queries a previous run left pending: due whatever the thresholds until flushed
        #: (None until the first snapshot has been read).
        self._recovering: set[str] | None = None
        #: Queries with updates pending (or an unreadable record) at the last snapshot read.
        self._pending: set[str] = set()
        #: Queries whose history was last thinned to fit ``HISTORY_MAX_BYTES`` (logged once).
        self._thinned: set[str] = set()
        #: Per query: a lock held by each flush and by an admin op, and how many admin ops ran
        #: (a flush of a snapshot read before one is dropped: it would undo it).
        self._locks: dict[str, anyio.Lock] = {}
        self._admin_ops: dict[str, int] = {}
        self._loop = anyio.CancelScope()
        self._loop_done = anyio.Event()

    # --- acknowledgements in blob mode -----------------------------------------------------

    async def wait_durable(self, query_id: str, batch_id: int) -> None:
        """Return once the query's blob holds ``batch_id`` or a newer batch."""
        if self._durable.get(query_id, -1) >= batch_id:
            return
        entry = (batch_id, anyio.Event())
        self._waiters[query_id].append(entry)
        try:
            await entry[1].wait()
        finally:
            waiting = self._waiters.get(query_id)
            if waiting and entry in waiting:
                waiting.remove(entry)
            if not waiting:
                self._waiters.pop(query_id, None)

    def _durable_now(self, query_id: str, batch_id: int) -> None:
        if batch_id > self._durable.get(query_id, -1):
            self._durable[query_id] = batch_id
        for wanted, event in self._waiters.get(query_id, []):
            if wanted <= batch_id:
                event.set()

    # --- retirement of idle queries (sidecar.retirement) -----------------------------------

    def busy(self, query_id: str) -> bool:
        """True while the query must not be retired: updates pending in Redis at the last
        pass, an acknowledgement waiting on its blob, or a quarantined record."""
        return any(query_id in held for held in (self._pending, self._waiters, self._quarantined))

    def forget(self, query_id: str) -> None:
        """Drop what is kept about a retired query (it is recreated if it comes back)."""
        self._durable.pop(query_id, None)
        self._backoff.forget(query_id)
        self._thinned.discard(query_id)
        if self._recovering:
            self._recovering.discard(query_id)

    @asynccontextmanager
    async def exclusive(self, query_id: str) -> AsyncIterator[None]:
        """No flush of the query runs inside (an admin op: reset, retire), and none of a
        snapshot read before it runs after."""
        async with self._lock(query_id):
            self._admin_ops[query_id] = self._admin_ops.get(query_id, 0) + 1
            yield

    @asynccontextmanager
    async def _lock(self, query_id: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(query_id, anyio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.statistics().tasks_waiting and not lock.locked():
                self._locks.pop(query_id, None)

    # --- the loop --------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with self._loop:
            task_status.started()
            while True:
                await self.tick()
                await anyio.sleep(self._config.flush_interval_s)
        self._loop_done.set()

    async def stop_loop(self) -> None:
        """Stop the periodic ticks (and wait for one in progress) before the final flush,
        so two passes never race on the same query's lease."""
        self._loop.cancel()
        await self._loop_done.wait()

    async def tick(self, *, final: bool = False) -> int:
        """One pass. Returns how many owned queries are still left pending by a failure."""
        admin_ops = dict(self._admin_ops)  # before the snapshot: an op after it voids it
        try:
            snapshot = await self._buffer.snapshot(extra=list(self._waiters))
        except SidecarError as exc:
            log.warning("flush check skipped: %s", exc)
            return 1
        cfg = self._config
        self._pending = {q.query_id for q in snapshot.queries if q.pending > 0}
        self._pending.update(snapshot.corrupt)
        if self._recovering is None:
            # Recovery: whatever a previous run acknowledged but did not flush is due now,
            # whatever the thresholds, and stays due until flushed (e.g. once the dead
            # daemon's lease has expired).
            self._recovering = {q.query_id for q in snapshot.queries if q.pending > 0}
            if self._recovering:
                log.info(
                    "recovering %d query(ies) left pending by a previous run: %s",
                    len(self._recovering),
                    ", ".join(sorted(self._recovering)),
                )
        for query_id, bad in snapshot.corrupt.items():
            if self._quarantine(query_id, bad):
                log.error("flush query=%s skipped, record unreadable: %s", query_id, bad)
        for query_id, where in list(self._quarantined.items()):
            if "redis" in where and query_id not in snapshot.corrupt:
                self._readable(query_id, "redis")  # replaced by a newer batch, or deleted
        due: list[PendingQuery] = []
        for q in snapshot.queries:
            label = q.checkpoint.label
            if self._track is not None:
                self._track(q.query_id, label)
            age_s = 0.0
            if q.pending > 0 and q.first_pending_ms is not None:
                age_s = max(0.0, (snapshot.now_ms - q.first_pending_ms) / 1000)
            self._metrics.pending_updates.labels(label).set(q.pending)
            self._metrics.checkpoint_age.labels(label).set(age_s)
            if q.flushed_batch_id is not None:
                self._durable_now(q.query_id, q.flushed_batch_id)
            if q.pending <= 0:
                continue
            if not final and not self._backoff.ready(q.query_id):
                continue
            if (
                final
                or q.pending >= cfg.count_threshold
                or age_s >= cfg.time_threshold_s
                or q.query_id in self._waiters
                or q.query_id in self._recovering
                or q.first_pending_ms is None  # unknown age (a damaged record): due now
            ):
                due.append(q)
        failed = 0

        async def flush(q: PendingQuery) -> None:
            nonlocal failed
            async with self._limiter, self._lock(q.query_id):
                if self._admin_ops.get(q.query_id) != admin_ops.get(q.query_id):
                    return  # reset or retired since the snapshot: this flush would undo it
                if not await self._flush(q):
                    failed += 1

        async with anyio.create_task_group() as tg:
            for q in due:
                tg.start_soon(flush, q)
        return failed

    async def final_flush(self) -> None:
        """Flush everything pending that this daemon owns; retry until done or cancelled."""
        while await self.tick(final=True):  # noqa: ASYNC110 - a pause between flush passes
            await anyio.sleep(0.2)

    # --- one query -------------------------------------------------------------------------

    def _quarantine(self, query_id: str, exc: CorruptRecord) -> bool:
        """Count an unreadable record once; True the first time (the caller logs it)."""
        if self._quarantined[query_id].get(exc.where) == exc.key:
            return False
        self._quarantined[query_id][exc.where] = exc.key
        self._metrics.bad_records.labels(exc.where).inc()
        return True

    def _readable(self, query_id: str, where: str) -> None:
        """The query's record in ``where`` was read fine: out of quarantine, if it was in."""
        quarantined = self._quarantined.get(query_id)
        if quarantined is None:
            return
        key = quarantined.pop(where, None)
        if key is not None:
            log.info("query=%s: %s %s is no longer unreadable", query_id, where, key)
        if not quarantined:
            del self._quarantined[query_id]

    def _blob_holds(
        self, lease: QueryLease, query_id: str, batch_id: int, doc: ckpt.CheckpointDocument | None
    ) -> None:
        lease.record_blob(batch_id, doc)
        if self._floors is not None:
            self._floors.raise_to(query_id, batch_id)

    def _document(
        self, checkpoint: ckpt.Checkpoint, previous: ckpt.CheckpointDocument | None
    ) -> ckpt.CheckpointDocument:
        """The document replacing ``previous`` (what the blob holds) with ``checkpoint``."""
        size = self._config.history_size
        history, thinned = ckpt.carry_history(previous, checkpoint.batch_id, size)
        query_id = checkpoint.query_id
        if thinned and query_id not in self._thinned:
            self._thinned.add(query_id)
            log.warning(
                "flush query=%s batch=%d: history thinned to %d of %d checkpoints to stay "
                "within %d bytes (wide offsets); lower SIDECAR_HISTORY_SIZE to silence this",
                checkpoint.label,
                checkpoint.batch_id,
                len(history),
                len(history) + thinned,
                ckpt.HISTORY_MAX_BYTES,
            )
        elif not thinned:
            self._thinned.discard(query_id)
        return ckpt.CheckpointDocument.of(checkpoint, self._writer, history, reset_of=previous)

    async def _flush(self, q: PendingQuery) -> bool:
        """Flush one query. False when it failed and must be retried (not: not owned, or a
        quarantined blob)."""
        checkpoint = q.checkpoint
        label = checkpoint.label
        m = self._metrics
        lease = await self._leases.ensure_held(q.query_id, label)
        if lease is None:
            m.flushes.labels("not_owned").inc()
            log.debug("flush query=%s batch=%d skipped: lease not held", label, q.batch_id)
            return True
        try:
            blob_batch_id = lease.blob_batch_id
            if blob_batch_id is None:
                doc = await self._store.read(q.query_id)
                self._readable(q.query_id, "blob")
                blob_batch_id = doc.batch_id if doc is not None else -1
                self._blob_holds(lease, q.query_id, blob_batch_id, doc)
            if checkpoint.batch_id <= blob_batch_id:
                durable = blob_batch_id
                result = "skipped"
                log.info(
                    "flush query=%s batch=%d: blob already holds batch %d, not writing",
                    label,
                    checkpoint.batch_id,
                    durable,
                )
            else:
                doc = self._document(checkpoint, lease.blob_document)
                body = ckpt.encode_document(doc)
                started = time.perf_counter()
                await self._store.write(
                    q.query_id, body, lease_id=self._leases.lease_id, query_name=checkpoint.name
                )
                m.flush_seconds.observe(time.perf_counter() - started)
                durable = checkpoint.batch_id
                self._blob_holds(lease, q.query_id, durable, doc)
                result = "ok"
            left = await self._buffer.mark_flushed(q, durable)
        except LeaseLost as exc:
            m.flushes.labels("lease_lost").inc()
            self._leases.lost(q.query_id, str(exc))
            return True
        except SidecarError as exc:
            m.flushes.labels("error").inc()
            # A retriable error (store or Redis down) retries soon; any other (a refused
            # credential, a bad request) waits the full cap: it needs an operator first.
            delay = self._backoff.failed(q.query_id, give_up_ramp=not exc.retriable)
            level = logging.WARNING if exc.retriable else logging.ERROR
            if isinstance(exc, CorruptRecord) and not self._quarantine(q.query_id, exc):
                level = logging.DEBUG  # logged once, when it was first found unreadable
            log.log(
                level,
                "flush query=%s batch=%d failed (retry %d in %.1fs): %s",
                label,
                q.batch_id,
                self._backoff.failures(q.query_id),
                delay,
                exc,
            )
            # A quarantined blob is not a failure the final flush should keep retrying until
            # the grace period ends: only an operator can fix it (the update stays in Redis).
            return isinstance(exc, CorruptRecord)
        self._backoff.succeeded(q.query_id)
        if self._recovering:
            self._recovering.discard(q.query_id)
        m.flushes.labels(result).inc()
        m.checkpoint_batch_id.labels(label).set(durable)
        m.pending_updates.labels(label).set(left)
        if left == 0:
            m.checkpoint_age.labels(label).set(0)
        log.debug(
            "flushed query=%s batch=%d (%d updates; %d still pending)",
            label,
            durable,
            q.pending,
            left,
        )
        self._durable_now(q.query_id, durable)
        if self._on_durable is not None:
            # Also for "skipped": the blob holds this batch or newer (e.g. written before a
            # Redis failure prevented mark_flushed), so these offsets are durable; the Kafka
            # committer itself refuses to move a group backwards.
            try:
                self._on_durable(checkpoint)
            except Exception:
                log.exception(
                    "after flushing query=%s batch=%d: durable hook failed",
                    label,
                    checkpoint.batch_id,
                )
        return True
