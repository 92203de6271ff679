"""The flusher: moves each query's latest checkpoint from Redis to its blob.

Every ``flush_interval_s`` a check reads the pending queries' flush state from Redis (not
their checkpoints); a query is due with ``count_threshold`` updates pending, when its oldest
is ``time_threshold_s`` times a factor of its own in [1 - THRESHOLD_JITTER, 1] old (queries
started together drift apart instead of flushing together every time), or when an ack waits
on it (``ack_mode=blob``). A new waiting ack does not wait for the interval: it wakes the
loop at once. Group commit: while a query's write is in flight, later acks of that query wait
for the next one, which starts as soon as that write ends and answers all of them. Only due
queries' checkpoints are read, :data:`ROWS_PER_READ` at a time, and flushed in the
background while checks go on: a query in one flush at a time, ``flush_concurrency`` writes.

A flush writes only under the query's lease and never moves a blob backwards: what to do
with a due row (read the blob first, skip, write) and what follows a write (acks answered, a
retry scheduled, the blob read again) are decided by the pure core (``sidecar.flush.core``)
through the one owner of each query's blob state (``sidecar.flush.blob_state``); this module
performs them. A failed write is retried with capped exponential backoff and jitter (errors
that are not ``retriable`` wait the full cap and are logged as errors); nothing is dropped,
because the pending state in Redis is cleared only after the write succeeded, and only as far
as the written snapshot covered.

At start the first tick flushes whatever a previous run left pending (crash recovery); at
stop :meth:`final_flush` flushes everything owned, whatever the thresholds.

In blob ack mode each apply hands its rows over (``FlushOwner.applying``, the ingest side's
``RowSink``): the flush an ack waits for takes the row from there and reads nothing from
Redis, one round trip less per ack; a row is kept per query until a flush takes it, the
latest replacing the earlier.

A record that cannot be read is quarantined (``sidecar.flush.quarantine``): every other query
keeps flushing. The document written carries the history (``sidecar.flush.documents``).
A Redis row read before an admin op (reset, retire) of its query is never flushed.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus

from sidecar.backoff import next_tick, spread
from sidecar.buffer.redis_buffer import PendingEntry, PendingQuery, RedisBuffer, Snapshot
from sidecar.config import Config
from sidecar.errors import (
    CorruptRecord,
    LeaseLost,
    SidecarError,
    StoreUnavailable,
    UnrecordedReset,
    VersionConflict,
)
from sidecar.flush.blob_state import BlobStates, Replan
from sidecar.flush.core import Step
from sidecar.flush.documents import DocumentBuilder
from sidecar.flush.lease import Held
from sidecar.flush.quarantine import Quarantine
from sidecar.model import checkpoint as ckpt
from sidecar.model.document import CheckpointDocument, Writer, encode_document
from sidecar.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

#: Each query's time threshold is scaled by a factor of its own in [1 - this, 1].
THRESHOLD_JITTER = 0.25
#: Due queries whose checkpoints are read in one Redis call, and such reads in memory at
#: once (of every flush pass): bounds the checkpoints held, whatever the number due.
ROWS_PER_READ, ROW_READS = 64, 2
#: Writes of one flush when another writer keeps changing the blob (each refused write is
#: read again and planned again); then the flush fails and backs off.
WRITE_TRIES = 3
#: How often the store's listing is held against Redis' record of each query's last flush
#: (the first time at start): a blob that went back while no daemon was writing it (a store
#: that lost writes before a restart, a restore of an idle query's blob) is found within this.
#: One listing of the namespace (no download) and one Redis script a minute.
AUDIT_EVERY_S = 60.0
#: The share of the event loop flush checks may take at most: the next check waits at least
#: the loop's CPU time during the last one over this, whatever ``flush_interval_s``. A check
#: lists every query with updates pending and decides on each (~15-30 µs a query here):
#: thousands of queries on a short interval would otherwise take the loop that answers the
#: socket, and a slower loop leaves more pending, which makes checks slower still.
CHECK_SHARE = 0.2


@dataclass(frozen=True, slots=True)
class _Landed:
    """What a flush left the blob holding: the row it flushed (maybe read again on the way),
    the row's batch or the newer one the blob held, the document it is in, its version, and
    how (``ok``: written; ``skipped``: held already)."""

    row: PendingQuery
    durable: int
    document: CheckpointDocument | None
    version: str | None
    result: str


class Flusher:
    def __init__(
        self,
        config: Config,
        buffer: RedisBuffer,
        blobs: BlobStates,
        metrics: Metrics,
        writer: Writer,
        *,
        on_durable: Callable[[ckpt.Checkpoint], None] | None = None,
        track: Callable[[str, str], None] | None = None,
        audit_every_s: float = AUDIT_EVERY_S,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        """``blobs``: each query's blob state (lease, floor, acks), asked and told here.
        ``track(query_id, label)``: called for each query a pass finds pending, so that
        idle-query retirement knows every query the flusher holds state for.
        ``audit_every_s``: the period of the store's audit against Redis. ``cpu_clock``: the
        loop's CPU time, which spaces checks out (:data:`CHECK_SHARE`); a simulation's is
        constant, so its checks keep the interval's grid whatever the machine's load."""
        self._config = config
        self._buffer = buffer
        self._blobs = blobs
        self._metrics = metrics
        self._documents = DocumentBuilder(writer, config.history_size)
        #: Called with each checkpoint once it is in the blob (Kafka commits follow it).
        self._on_durable = on_durable
        self._track = track
        self._audit_every_s = audit_every_s
        self._cpu_clock = cpu_clock
        self._limiter = anyio.CapacityLimiter(config.flush_concurrency)
        self._row_reads = anyio.CapacityLimiter(ROW_READS)
        self._quarantined = Quarantine(metrics)
        #: Whether the first snapshot (recovery: what a previous run left pending) was read.
        self._recovered = False
        self._loop = anyio.CancelScope()
        self._loop_done = anyio.Event()
        self._started = False
        #: Checks spaced beyond the interval (CHECK_SHARE): said when it begins and ends.
        self._paced = False

    # --- retirement of idle queries (sidecar.daemon.retirement) ----------------------------

    def busy(self, query_id: str) -> bool:
        """True while the query must not be retired: updates pending in Redis at the last
        pass, an acknowledgement waiting on its blob, a flush in progress, or a quarantined
        record."""
        return query_id in self._quarantined or self._blobs.busy(query_id)

    # --- the loop --------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """A flush check every ``flush_interval_s``; the due queries it finds are flushed in
        the background, so the next check neither waits for them nor flushes them twice. A
        waiting ack wakes the loop between checks: its queries are flushed at once, without
        a check (they are due by definition; one Redis round trip less per ack)."""
        next_check = next_audit = 0.0
        self._started = True
        with self._loop:
            async with anyio.create_task_group() as tg:
                task_status.started()
                while True:
                    if anyio.current_time() >= next_audit:
                        next_audit = anyio.current_time() + self._audit_every_s
                        tg.start_soon(self._audit)
                    if anyio.current_time() >= next_check:
                        began, cpu = anyio.current_time(), self._cpu_clock()
                        checked = await self._check()
                        found = checked or []
                        if checked is None:  # Redis not read: nothing to measure, the grid
                            next_check = next_tick(began, self._config.flush_interval_s)
                        else:  # the loop's CPU time meanwhile: waiting on Redis costs nothing
                            next_check = self._next_check(began, self._cpu_clock() - cpu)
                    else:
                        found = [q for q in self._blobs.waiting() if self._blobs.ready(q)]
                    due = [q for q in found if not self._blobs.in_flight(q)]
                    if due:
                        self._blobs.begin(due)
                        tg.start_soon(self._flush_in_background, due)
                    wake = self._blobs.wake
                    with anyio.move_on_after(next_check - anyio.current_time()):
                        await wake.wait()
                    wake.clear()  # before the pass: a wake during it starts one more
        self._loop_done.set()

    def _next_check(self, began: float, took_s: float) -> float:
        """When the check after one begun at ``began`` that took ``took_s`` of the loop's CPU
        time is due (:func:`next_check_at`; a waiting ack still wakes the loop at once)."""
        self._metrics.flush_check_seconds.set(took_s)
        interval = self._config.flush_interval_s
        at = next_check_at(began, took_s, interval)
        # Said when it begins, and when checks would take under half their share again (not
        # at every check near the edge).
        spaced = took_s / CHECK_SHARE
        paced = spaced > interval or (self._paced and spaced > interval / 2)
        if paced and not self._paced:
            log.warning(
                "a flush check took %.0f ms (%d queries tracked): checks are now spaced "
                "%.2f s apart instead of every %s s, so they take at most %d%% of the loop; "
                "with this many queries pending, raise SIDECAR_FLUSH_INTERVAL_S",
                took_s * 1000,
                len(self._blobs),
                spaced,
                interval,
                round(CHECK_SHARE * 100),
            )
        elif self._paced and not paced:
            log.info("flush checks are back to every %s s", interval)
        self._paced = paced
        return at

    async def _audit(self) -> None:
        """Hold the store's listing against Redis' record of each query's last flush; a blob
        that differs from both is read and compared at the next check (``BlobStates.audit``)."""
        try:
            odd = await self._blobs.audit(await self._buffer.flushed())
        except SidecarError as exc:
            log.warning("audit of the blobs against Redis skipped: %s", exc)
            return
        if odd:
            log.info(
                "audit: %d blob(s) not at the version their last flush left, read and compared "
                "with Redis now: %s",
                len(odd),
                ", ".join(sorted(odd)),
            )
            self._blobs.wake.set()

    async def stop_loop(self) -> None:
        """Stop the periodic checks and their flushes (and wait for them) before the final
        flush, so two passes never race on the same query's lease."""
        self._loop.cancel()
        if self._started:  # never started: the store never opened (the daemon stopped first)
            await self._loop_done.wait()

    async def tick(self, *, final: bool = False) -> int:
        """One check, then flush what is due (``final``: all); failures left pending."""
        due = await self._check(final=final)
        return 1 if due is None else await self._flush_due(due, final=final)

    async def _flush_in_background(self, due: list[str]) -> None:
        """The loop's flush of ``due`` (all in flight): each query is released when its own
        write ends, or when it turns out not to need one."""
        unstarted = set(due)
        try:
            await self._flush_due(due, unstarted=unstarted)
        finally:
            for query_id in unstarted:
                self._blobs.end(query_id)

    async def recover(self) -> None:
        """Note what a previous run acknowledged but did not flush, before this daemon accepts
        updates (the daemon calls it then: the flusher itself starts once the store is open,
        and by then this run's own updates are pending too). Those queries are due at once,
        whatever the thresholds, and stay due until flushed (e.g. once the dead daemon's
        lease has expired). Redis not answering: the first check does it instead."""
        try:
            _, entries = await self._buffer.pending()
        except SidecarError as exc:
            log.warning("recovery deferred to the first flush check: %s", exc)
            return
        self._recovering({e.query_id for e in entries if e.pending != 0})

    def _recovering(self, pending: set[str]) -> None:
        self._recovered = True
        self._blobs.recovering(pending)
        if pending:
            log.info(
                "recovering %d query(ies) left pending by a previous run: %s",
                len(pending),
                ", ".join(sorted(pending)),
            )

    async def _check(self, *, final: bool = False) -> list[str] | None:
        """The due queries, oldest first, from their flush state alone (no checkpoint is
        read); None when Redis could not be read."""
        since = self._blobs.stamp()  # before the read: an admin op after it voids what it says
        # Beside the pending queries: those acks wait on, and those whose blob must be read
        # and compared with Redis (the lease acquired anew, or its blob changed under it).
        unverified = self._blobs.unverified()
        waiting = self._blobs.waiting()
        # Those too whose document names a snapshot older than the newest (nothing pending
        # then: Redis lists only pending queries unless asked).
        renaming = self._blobs.markers_due(self._config.time_threshold_s)
        try:
            now_ms, entries = await self._buffer.pending(extra=[*waiting, *unverified, *renaming])
        except SidecarError as exc:
            log.warning("flush check skipped: %s", exc)
            return None
        m = self._metrics
        m.flush_checks.inc()
        pending = {e.query_id for e in entries if e.pending != 0}  # None: unreadable
        for query_id in self._quarantined.in_redis():
            if query_id not in pending:
                self._quarantined.readable(query_id, "redis")  # flushed or deleted meanwhile
        # Redis' word on every listed query, told at once: which are pending (rows flushed
        # since they were applied are dropped) and each one's flushed batch.
        self._blobs.checked(entries, since, now_ms)
        if not self._recovered:
            self._recovering(pending)
        due: list[tuple[float, str]] = []
        for e in entries:
            query_id, count = e.query_id, e.pending
            label = self._blobs.label(query_id)
            first_ms = now_ms if count == 0 or e.first_pending_ms is None else e.first_pending_ms
            age_s = max(0.0, (now_ms - first_ms) / 1000)
            if label is not None:
                if self._track is not None:
                    self._track(query_id, label)
                m.pending_updates.labels(label).set(count or 0)
                m.checkpoint_age.labels(label).set(age_s)
            # Nothing pending is skipped unless an ack waits on it (answered only by a read or
            # a write of the blob: Redis' flushed batch is not evidence) or its blob must be
            # read and compared with Redis.
            renamed = count == 0 and self._blobs.marker_due(query_id, self._config.time_threshold_s)
            asked = query_id in unverified or query_id in waiting
            if (count == 0 and not asked and not renamed) or not (
                final or self._blobs.ready(query_id)
            ):
                continue
            # Read the row of an unreadable count (quarantined then), of a query not seen yet
            # (its row tells its name, then whether it is due), of an unknown age (due now).
            if (
                final
                or renamed
                or None in (count, label, e.first_pending_ms)
                or self._due(e, age_s)
            ):
                due.append((-age_s, query_id))
        # An ack waits on a query Redis holds nothing of (retired here, then a resend below
        # the floor, which Redis never took): no row will come, the blob read answers it.
        known = {e.query_id for e in entries}
        due += [(0.0, q) for q in waiting if q not in known and self._blobs.ready(q)]
        return [query_id for _, query_id in sorted(due)]

    def _due(self, q: PendingEntry | PendingQuery, age_s: float) -> bool:
        cfg, factor = self._config, 1 - THRESHOLD_JITTER * spread(q.query_id)
        if (q.pending or 0) >= cfg.count_threshold or age_s >= cfg.time_threshold_s * factor:
            return True
        return self._blobs.due(q.query_id)

    async def _flush_due(
        self, due: list[str], *, final: bool = False, unstarted: set[str] | None = None
    ) -> int:
        """Read the checkpoints of ``due`` :data:`ROWS_PER_READ` at a time (at most
        :data:`ROW_READS` such reads in memory) and flush them; the failures left pending.
        ``unstarted``: the loop's queries not yet released."""
        failed = 0

        async def flush(q: PendingQuery, since: int) -> None:
            nonlocal failed
            try:
                async with self._limiter, self._blobs.flushing(q.query_id):
                    if not self._blobs.current(q.query_id, since):
                        return  # reset or retired since the snapshot: this flush would undo it
                    if not await self._flush(q):
                        failed += 1
            finally:
                if unstarted is not None:
                    self._blobs.end(q.query_id)

        for i in range(0, len(due), ROWS_PER_READ):
            async with self._row_reads:
                ids = due[i : i + ROWS_PER_READ]
                rows = await self._read_rows(ids)
                if rows is None:
                    return failed + len(due) - i
                started = set()
                waiting = set(self._blobs.waiting())
                asked = {*self._blobs.unverified(), *waiting}
                rowless = set(ids) - {q.query_id for q, _ in rows}
                async with anyio.create_task_group() as tg:
                    for q, since in rows:
                        self._note_row(q, since)
                        if self._row_due(q, asked, final=final):
                            started.add(q.query_id)
                            tg.start_soon(flush, q, since)
                    for query_id in rowless & waiting:
                        started.add(query_id)
                        tg.start_soon(self._confirm, query_id, unstarted is not None)
                    if unstarted is not None:  # read, and not due after all
                        for query_id in unstarted.intersection(ids) - started:
                            self._blobs.end(query_id)
                        unstarted.difference_update(ids)
        return failed

    async def _confirm(self, query_id: str, ends_pass: bool) -> None:
        """Acks wait on a query Redis has no row of (nothing to write): the blob read, which
        answers those it holds the batch of; retried after a backoff when it cannot be
        read. ``ends_pass``: the loop's pass, released here."""
        try:
            async with self._limiter, self._blobs.flushing(query_id):
                try:
                    await self._blobs.read(query_id)
                except SidecarError as exc:
                    delay = self._blobs.failed(query_id, retriable=exc.retriable)
                    log.warning(
                        "blob of query %s not read for the acks waiting on it (retry in %.1fs): %s",
                        self._blobs.label(query_id) or query_id,
                        delay,
                        exc,
                    )
                else:
                    self._blobs.flushed(query_id)
        finally:
            if ends_pass:
                self._blobs.end(query_id)

    async def _read_rows(self, ids: list[str]) -> list[tuple[PendingQuery, int]] | None:
        """The rows of ``ids``, each with the stamp it was read at: an apply's row where one
        was handed over, the others read from Redis in one call (the unreadable records
        quarantined). None: Redis could not be read (logged)."""
        # An apply's row (blob ack mode) is as good as one read now for a query an ack
        # waits on (due whatever its age): no read for it. The others are read; a row
        # they had is older than that read.
        taken = {q: row for q in ids if (row := self._blobs.take_row(q))}
        unread = [q for q in ids if q not in taken]
        read_at = self._blobs.stamp()  # before the read: an admin op after it voids it
        try:
            rows = Snapshot(0, [], {})
            if unread:
                rows = await self._buffer.snapshot(unread, only=True)
        except SidecarError as exc:
            log.warning("flush of %d due query(ies) skipped: %s", len(ids), exc)
            return None
        self._metrics.flush_bodies_read.inc(len(rows.queries) + len(rows.corrupt))
        for query_id, bad in rows.corrupt.items():
            if self._quarantined.add(query_id, bad):
                log.error("flush query=%s skipped, record unreadable: %s", query_id, bad)
        return [*taken.values(), *((q, read_at) for q in rows.queries)]

    def _note_row(self, q: PendingQuery, since: int) -> None:
        """A row read at stamp ``since``: its record readable, its query tracked, and what
        Redis says of its last flush told to the blob state."""
        self._quarantined.readable(q.query_id, "redis")
        self._blobs.seen(q.query_id, q.checkpoint.label)  # tracked from now
        self._blobs.flushed_in_redis(
            q.query_id, q.flushed_batch_id, q.resets, since, q.flushed_reset
        )

    def _row_due(self, q: PendingQuery, asked: set[str], *, final: bool) -> bool:
        """Whether the row is flushed now: something is owed to its blob (updates pending,
        ``asked``: its blob unverified or an ack waiting on it, a snapshot to name) and it
        is due (``final``: whatever the thresholds)."""
        age_s = (q.snapshot_ms - (q.first_pending_ms or 0)) / 1000
        # An unverified blob is read and compared with Redis even with nothing pending:
        # the store may have lost its last writes. So is one an ack waits on: only a read
        # or a write answers it.
        owed = q.pending > 0 or q.query_id in asked
        # A snapshot to name, nothing pending: its document written again.
        renamed = self._blobs.marker_due(q.query_id, self._config.time_threshold_s)
        owed = owed or renamed
        return owed and (final or renamed or self._due(q, age_s))

    async def final_flush(self) -> None:
        """Flush everything pending that this daemon owns; retry until done or cancelled."""
        while await self.tick(final=True):  # noqa: ASYNC110 - a pause between flush passes
            await anyio.sleep(0.2)

    # --- one query ---------------------------------------------------------------------------

    async def _reread(self, q: PendingQuery) -> PendingQuery | None:
        """The query's row read again (None: nothing pending any more)."""
        since = self._blobs.stamp()
        rows = await self._buffer.snapshot([q.query_id], only=True)
        self._metrics.flush_bodies_read.inc(len(rows.queries))
        fresh = next((r for r in rows.queries if r.query_id == q.query_id), None)
        if fresh is not None:  # the blob was read just before, under this flush's lock
            self._blobs.flushed_in_redis(
                q.query_id,
                fresh.flushed_batch_id,
                fresh.resets,
                since,
                fresh.flushed_reset,
                judge=True,
            )
        # Nothing pending, yet the blob below the row: the store lost what was flushed.
        if fresh is None or (
            fresh.pending == 0 and not self._blobs.behind(q.query_id, fresh.batch_id)
        ):
            log.debug("flush query=%s: nothing pending any more", q.checkpoint.label)
            return None
        return fresh

    async def _flush(self, q: PendingQuery) -> bool:
        """Flush one query. False when it failed and must be retried (not: not owned, or a
        quarantined blob)."""
        label = q.checkpoint.label
        m = self._metrics
        lease = await self._blobs.held(q.query_id, label)
        if lease is None:
            m.flushes.labels("not_owned").inc()
            log.debug("flush query=%s batch=%d skipped: lease not held", label, q.batch_id)
            return True
        try:
            landed = await self._land(q, lease)
            if landed is None:
                return True
            q, doc = landed.row, landed.document
            reset_at = doc.reset_at if doc is not None else None
            left = await self._buffer.mark_flushed(q, landed.durable, reset_at, landed.version)
            self._blobs.marked(q.query_id)
        except LeaseLost as exc:
            m.flushes.labels("lease_lost").inc()
            self._blobs.lost(q.query_id, str(exc))
            return True
        except SidecarError as exc:
            return self._failed(q, exc)
        self._blobs.flushed(q.query_id)
        m.flushes.labels(landed.result).inc()
        m.checkpoint_batch_id.labels(label).set(landed.durable)
        m.pending_updates.labels(label).set(left)
        if left == 0:
            m.checkpoint_age.labels(label).set(0)
        log.debug(
            "flushed query=%s batch=%d (%d updates; %d still pending)",
            label,
            landed.durable,
            q.pending,
            left,
        )
        if self._on_durable is not None and landed.durable == q.checkpoint.batch_id:
            # Also for "skipped" when the blob holds this very batch (e.g. written before a
            # Redis failure prevented mark_flushed): these offsets are durable. Not when it
            # holds a newer one (another writer's, or ours before the row was reset): its
            # offsets are the groups' to hold, committed by its writer; ours, older, would
            # move them back (a committer knows only what it committed itself).
            try:
                self._on_durable(q.checkpoint)
            except Exception:
                log.exception(
                    "after flushing query=%s batch=%d: durable hook failed",
                    label,
                    q.checkpoint.batch_id,
                )
        return True

    async def _land(self, q: PendingQuery, lease: Held) -> _Landed | None:
        """Read, plan and write until the blob holds the row's batch; None: nothing is owed
        any more, or the lease was lost meanwhile (the next pass starts over).

        Raises:
            UnrecordedReset: the blob holds a reset this daemon's Redis never recorded.
            VersionConflict: no write landed in ``WRITE_TRIES`` tries.
            LeaseLost, SidecarError: the store or Redis refused or failed (:meth:`_flush`).
        """
        checkpoint = q.checkpoint
        label = checkpoint.label
        m = self._metrics
        for _ in range(WRITE_TRIES):
            plan = self._blobs.plan(q.query_id, checkpoint.batch_id)
            if plan.step is Step.READ or plan.step is Step.COMPARE:
                # What the blob holds is not known (first flush, a write of unknown
                # outcome, another writer's write): read it, then the row again: a row read
                # before may predate another owner's reset (Redis first, then the blob).
                # Read by ingest or an admin op under this lease: the row alone, compared.
                if plan.step is Step.READ:
                    await self._blobs.read(q.query_id)
                fresh = await self._reread(q)
                if fresh is None:
                    return None
                q, checkpoint = fresh, fresh.checkpoint
                plan = self._blobs.plan(q.query_id, checkpoint.batch_id)
            self._quarantined.readable(q.query_id, "blob")
            if plan.step is Step.REFUSE:
                raise UnrecordedReset(
                    f"blob of query {label}: it holds a reset this daemon's Redis never "
                    "recorded; nothing written over it (see the error logged when it was "
                    "found: stop the other daemon, then run 'checkpoint-sidecar reset' here)"
                )
            if plan.step is Step.SKIP:
                assert plan.base is not None
                log.info(
                    "flush query=%s batch=%d: blob already holds batch %d, not writing",
                    label,
                    checkpoint.batch_id,
                    plan.base.batch,
                )
                self._blobs.skipped(q.query_id)
                base = plan.base.stored
                return _Landed(q, plan.base.batch, base.document, base.version, "skipped")
            if plan.step is Step.READ or plan.step is Step.COMPARE:
                continue  # read again meanwhile (a write in flight elsewhere ended unsure)
            assert plan.base is not None
            doc = self._documents.build(
                checkpoint,
                plan.base.stored.document,
                functools.partial(self._blobs.note_thinned, q.query_id),
                self._blobs.snapshot_of(q.query_id),
            )
            started = time.perf_counter()
            try:
                # Waiting acks are answered as it lands, not after the bookkeeping that
                # follows, whose failure retries the flush.
                stored = await self._blobs.write(
                    q.query_id, lease, plan.base, doc, encode_document(doc)
                )
            except Replan:
                continue  # seen changed since the plan (a read meanwhile): plan again
            except VersionConflict:
                # Another writer changed the blob (read again by now): plan again from
                # what it holds, never below it, with the row read again too.
                m.flushes.labels("conflict").inc()
                fresh = await self._reread(q)
                if fresh is None:
                    return None
                q, checkpoint = fresh, fresh.checkpoint
                continue
            if stored is None:
                # Lost (and maybe taken again, under a new term) since the blob was read:
                # the next pass starts over.
                m.flushes.labels("not_owned").inc()
                log.info("flush query=%s batch=%d: lease lost meanwhile", label, q.batch_id)
                return None
            m.flush_seconds.observe(time.perf_counter() - started)
            return _Landed(q, checkpoint.batch_id, doc, stored.version, "ok")
        raise VersionConflict(
            f"blob of query {label}: no write landed in {WRITE_TRIES} tries: the store "
            "refused each as made over a version it no longer has (each refusal is logged "
            "with who last wrote the blob), or the blob was read again meanwhile; retried "
            "after a backoff"
        )

    def _failed(self, q: PendingQuery, exc: SidecarError) -> bool:
        """A flush of ``q`` failed with ``exc``: counted, logged, retried after a backoff.
        Whether the final flush may stop retrying it (:meth:`_flush`'s answer)."""
        self._metrics.flushes.labels("error").inc()
        # A retriable error (store or Redis down) retries soon; any other (a refused
        # credential, a bad request) waits the full cap: it needs an operator first.
        delay = self._blobs.failed(
            q.query_id,
            retriable=exc.retriable,
            retry_after_s=exc.retry_after_s if isinstance(exc, StoreUnavailable) else None,
        )
        level = logging.WARNING if exc.retriable else logging.ERROR
        if isinstance(exc, CorruptRecord) and not self._quarantined.add(q.query_id, exc):
            level = logging.DEBUG  # logged once, when it was first found unreadable
        if isinstance(exc, UnrecordedReset):
            level = logging.DEBUG  # logged once, in full, when it was found
        log.log(
            level,
            "flush query=%s batch=%d failed (retry %d in %.1fs): %s",
            q.checkpoint.label,
            q.batch_id,
            self._blobs.failures(q.query_id),
            delay,
            exc,
            extra={"retry_in_s": round(delay, 1), "query_id": q.query_id},  # JSON logs
        )
        # A quarantined blob, or one holding a reset this Redis never recorded, is not a
        # failure the final flush should keep retrying until the grace period ends: only
        # an operator can fix it (the update stays in Redis).
        return isinstance(exc, CorruptRecord | UnrecordedReset)


def next_check_at(began: float, took_s: float, interval_s: float) -> float:
    """The next flush check after one begun at ``began`` that took ``took_s``: at the next
    tick of the interval's grid (``sidecar.backoff.next_tick``), unless checks would then
    take over :data:`CHECK_SHARE` of the loop; then ``took_s / CHECK_SHARE`` after it began."""
    return max(next_tick(began, interval_s), began + took_s / CHECK_SHARE)
