"""The daemon's snapshot loop (``SIDECAR_SNAPSHOT_ROOT``): after each committed batch of a
query it owns, a snapshot of that query's checkpoint (``sidecar.snapshot``), off Spark's path
and bounded.

Invariants:

- **Never on Spark's path.** The listener's progress of batch N (its commit is then in
  ``commits/N``) only records N as wanted (O(1) on the ingest path); the loop does the rest.
- **One snapshot in flight per query, coalescing to the newest batch**: when Spark is faster
  than uploads, the batches in between are skipped, never queued.
- **Only the owner writes.** A snapshot is taken only while this daemon holds the query's
  lease (``owns``: it acquires it if due, as the flusher does), checked again right before the
  index is written; another daemon's query is left alone (its owner snapshots it).
- **Bounded**: at most :data:`IN_FLIGHT` snapshots at once over all queries, each upload's
  memory bounded by the upload module.

- **On the document's timeline** (``sidecar.snapshot.lineage``). A snapshot is taken only
  once the document's marker is known (seen under the lease held now); each records its
  parent, found by content, and its timeline; a directory whose lineage leaves the marker's
  is not snapshotted (``off_timeline``). A new run of the query that starts below the
  newest snapshot (a rewind) is followed at once: its batches are wanted from there.

Each snapshot's outcome is counted and timed; the lag (batches and seconds behind Spark's
commits) is a gauge per query; the newest snapshot is told to the query's blob state, so the
next checkpoint document names it (if it follows the document's marker). Old snapshots are
pruned (retention by timeline, then a sweep of what no kept snapshot references, after a
grace period) at most every :data:`PRUNE_EVERY_S` per
query, and once at start for what a previous run left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping

import anyio
from anyio.abc import TaskGroup, TaskStatus

from sidecar.backoff import next_tick
from sidecar.daemon.queries import LiveQuery, Queries, SnapshotPart
from sidecar.errors import SidecarError
from sidecar.flush.lease import Ownership
from sidecar.model.checkpoint import Checkpoint
from sidecar.model.document import SnapshotRef
from sidecar.snapshot import lineage
from sidecar.snapshot.contents import Contents
from sidecar.snapshot.cut import Hints, v2_ids
from sidecar.snapshot.index import SnapshotIndex
from sidecar.snapshot.prune import prune
from sidecar.snapshot.reclaim import reclaim
from sidecar.snapshot.source import CheckpointSource, Location
from sidecar.snapshot.upload import failure_reason, upload_snapshot
from sidecar.store.snapshots import SnapshotBlobs
from sidecar.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

#: Snapshots under way at once, over all queries.
IN_FLIGHT = 2
#: How often the loop looks for wanted snapshots (and is woken at once by a progress it can
#: act on).
TICK_S = 1.0
#: A query's old snapshots are pruned at most this often (and once at start).
PRUNE_EVERY_S = 300.0
#: Orphans (packs of a snapshot in progress, or of one that failed) found unreferenced for
#: less than this are left alone by a prune: longer than an upload or a restore takes.
GRACE_S = 3600.0
#: A failed snapshot of a query is tried again after this long at the soonest (the next
#: progress brings a new batch anyway).
RETRY_S = 5.0
#: Checkpoint locations under the root are listed again at most this often when a query's
#: location is not known.
RELIST_S = 10.0
#: The snapshots of queries gone (retired, or their location reused) are looked for this long
#: after start, then this often (``sidecar.snapshot.reclaim``).
RECLAIM_FIRST_S = 5.0
RECLAIM_EVERY_S = 3600.0
#: Report times kept per query while its snapshots fail: the oldest (the lag) and the newest.
REPORTED_MAX = 64


class Snapshotter:
    """Snapshots of the queries this daemon owns (``SIDECAR_SNAPSHOT_ROOT``)."""

    def __init__(
        self,
        source: CheckpointSource,
        blobs: SnapshotBlobs,
        namespace: str,
        metrics: Metrics,
        *,
        owns: Callable[[str, str], Awaitable[Ownership | None]],
        taken: Callable[[str, SnapshotRef], None],
        marker: Callable[[str], tuple[bool, SnapshotRef | None]],
        retain: int,
        abandoned_keep_s: float = 7 * 86400.0,
        checkpoints: Callable[[], Awaitable[set[str]]] | None = None,
        queries: Queries | None = None,
    ) -> None:
        """``owns(query id, label)``: None when this daemon does not hold the query's lease,
        else a check that it still does (right before the index is written), with its term:
        what is known of the query's stored contents is loaded again under a new term (another
        owner may have pruned them in between); ``taken``: told
        each new snapshot (the blob state names it in the next document); ``marker``: the
        snapshot the query's document names (always kept; its timeline is the current one)
        and whether that is known; ``retain``: snapshots kept of the current timeline;
        ``abandoned_keep_s``: how long one of an abandoned timeline is kept, and the snapshots
        of a query gone; ``checkpoints()``: the ids of the queries with a checkpoint blob (None:
        gone queries are not looked for); ``queries``: the daemon's record of live queries,
        where each one's part is kept (``sidecar.daemon.queries``; its own when not given),
        and whose clock times retries and lags."""
        self._source = source
        self._blobs = blobs
        self._namespace = namespace
        self._metrics = metrics
        self._owns = owns
        self._taken = taken
        self._marker = marker
        self._retain = retain
        self._abandoned_keep_s = abandoned_keep_s
        self._checkpoints = checkpoints
        self._queries = queries if queries is not None else Queries()
        self._clock = self._queries.clock
        self._listed_at = float("-inf")
        self._wake = anyio.Event()
        self._limiter = anyio.CapacityLimiter(IN_FLIGHT)
        self._loop = anyio.CancelScope()
        #: Passes of the loop so far (tests wait on it, not on a fixed time).
        self.passes = 0

    # --- from the ingest path: O(1) ---------------------------------------------------------

    def committed(self, checkpoint: Checkpoint) -> None:
        """Spark committed ``checkpoint``'s batch (its progress arrived): snapshot it soon."""
        entry = self._queries.entry(checkpoint.query_id, checkpoint.label)
        q = entry.snapshot
        if q is None:
            q = entry.snapshot = SnapshotPart()
        if checkpoint.run_id != q.run_id:
            q.run_id = checkpoint.run_id
            if checkpoint.batch_id <= q.wanted:
                # A new run below the newest batch seen: rewound (a restore of an earlier
                # batch). Its timeline is followed from here, not once it passes the old one.
                q.wanted, q.done = -1, min(q.done, checkpoint.batch_id - 1)
                q.reported.clear()
                q.rewinds += 1
        if checkpoint.batch_id > q.wanted:
            q.wanted = checkpoint.batch_id
            if not q.elsewhere:
                q.reported.setdefault(checkpoint.batch_id, self._clock())
                if len(q.reported) > REPORTED_MAX:  # failing for long: keep the oldest
                    del q.reported[sorted(q.reported)[1]]
            if q.location is not None:
                self._metrics.snapshot_lag_batches.labels(entry.label).set(q.wanted - q.done)
            # Woken only for a snapshot it can start now: not for a query whose checkpoint is
            # elsewhere (looked for again by the tick), nor one in flight (its end wakes it).
            # Every progress of every query woke it before: a pass per update.
            if not q.elsewhere and not q.in_flight:
                self._wake.set()

    def lag_seconds(self, query_id: str) -> float:
        """How long the oldest batch Spark committed and no snapshot holds has waited."""
        entry = self._queries.get(query_id)
        return self._lag(entry.snapshot) if entry is not None else 0.0

    def _lag(self, q: SnapshotPart | None) -> float:
        if q is None or not q.reported:
            return 0.0
        return max(0.0, self._clock() - min(q.reported.values()))

    # --- the loop ------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Take wanted snapshots, every tick or when woken, until :meth:`stop`."""
        log.info("checkpoint snapshots on: root %s, keeping %d per query", self._source,
                 self._retain)  # fmt: skip
        with self._loop:
            async with anyio.create_task_group() as tg:
                task_status.started()
                if self._checkpoints is not None:
                    tg.start_soon(self._reclaim, self._checkpoints)
                while True:
                    with anyio.CancelScope(deadline=next_tick(anyio.current_time(), TICK_S)):
                        await self._wake.wait()
                    self._wake = anyio.Event()
                    self._start_due(tg)
                    self._show_lag()
                    self.passes += 1

    def stop(self) -> None:
        """No more snapshots (shutdown: a snapshot under way is cut; its packs, written
        before any index names them, are pruned after the grace period)."""
        self._loop.cancel()

    def _start_due(self, tg: TaskGroup) -> None:
        now = self._clock()
        for query_id, entry in self._queries:
            q = entry.snapshot
            if q is not None and q.wanted > q.done and not q.in_flight and now >= q.retry_at:
                q.in_flight = True
                tg.start_soon(self._snapshot, query_id, entry, q)

    def _show_lag(self) -> None:
        for _, entry in self._queries:
            if entry.snapshot is not None and entry.snapshot.location is not None:
                lag = self._lag(entry.snapshot)
                self._metrics.snapshot_lag_seconds.labels(entry.label).set(lag)

    async def _location(self, q: SnapshotPart) -> str | None:
        """The query's checkpoint location under the root. The root is listed for a query
        not looked for yet, and again at most every :data:`RELIST_S` for one not found; each
        listing fills in the location of every live query it finds."""
        if q.location is None and (not q.looked or self._clock() - self._listed_at >= RELIST_S):
            self._listed_at = self._clock()
            found: list[Location] = await self._source.locations()
            paths = {loc.query_id: loc.path for loc in found}
            for query_id, entry in self._queries:
                part = entry.snapshot
                if part is not None and query_id in paths:
                    part.location, part.looked = paths[query_id], True
                elif part is not None:
                    part.looked = True
        return q.location

    async def _snapshot(self, query_id: str, entry: LiveQuery, q: SnapshotPart) -> None:
        batch, rewinds = q.wanted, q.rewinds
        started = time.perf_counter()
        result = "error"
        try:
            async with self._limiter:
                still_owner = await self._owns(query_id, entry.label)
                if still_owner is None:
                    result = "not_owner"
                    return
                location = await self._location(q)
                if location is None:
                    # Its checkpoint is not under the root: nothing to snapshot (said once).
                    result = "no_location"
                    q.elsewhere = True
                    q.reported.clear()
                    if not q.told:
                        q.told = True
                        log.info(
                            "snapshot query=%s: no checkpoint location of this query under %s "
                            "(its checkpointLocation is elsewhere): not snapshotted",
                            entry.label,
                            self._source,
                        )
                    q.retry_at = self._clock() + RELIST_S
                    return
                q.location, q.elsewhere = location, False
                known, marker = self._marker(query_id)
                if not known:  # read under this lease first (the flusher does it soon)
                    result = "waiting"
                    q.retry_at = self._clock() + TICK_S
                    return
                if q.contents is None or q.contents_term != still_owner.term:
                    # Loaded again under a new term: another owner may have pruned packs
                    # since, and a snapshot must never name a pack that is gone.
                    q.contents = await Contents.load(self._blobs, self._namespace, query_id)
                    q.contents_term = still_owner.term
                upload = await upload_snapshot(
                    self._source,
                    location,
                    batch,
                    self._blobs,
                    self._namespace,
                    query_id,
                    q.contents,
                    owner=still_owner,
                    lineage=lambda batch, shas: self._lineage(query_id, q, batch, shas),
                    hints=_hints(q.contents, batch, marker),
                )
                self._done(query_id, entry, q, upload.index, rewinds)
                m = self._metrics
                m.snapshot_bytes.labels("content").inc(upload.uploaded_bytes)
                m.snapshot_bytes.labels("index").inc(upload.index_bytes)
                m.snapshot_files.labels("uploaded").inc(upload.new_files)
                m.snapshot_files.labels("reused").inc(upload.reused_files)
                m.snapshot_requests.inc(upload.request_count)
                result = "ok"
                if self._clock() - q.pruned_at >= PRUNE_EVERY_S and still_owner():
                    q.pruned_at = self._clock()
                    await self._prune(query_id, entry, q, still_owner)
        except Exception as exc:  # a snapshot's failure never stops the offsets' path
            reason = failure_reason(exc)
            if reason == "not_owner":
                result = "not_owner"
            elif reason == lineage.OFF_TIMELINE:
                self._metrics.snapshot_failures.labels(reason).inc()
                q.retry_at = self._clock() + RELIST_S  # the document is read again meanwhile
            else:
                self._metrics.snapshot_failures.labels(reason).inc()
            if reason == "other":  # a bug: its traceback
                log.exception("snapshot query=%s batch=%d failed unexpectedly", entry.label, batch)
            else:
                quiet = reason in ("file_changed", "cut_not_committed", "not_owner")
                if reason == lineage.OFF_TIMELINE:  # said once per query and timeline
                    quiet = q.off_said == str(exc)
                    q.off_said = str(exc)
                log.log(
                    logging.INFO if quiet else logging.WARNING,
                    "snapshot query=%s batch=%d not taken (%s): %s",
                    entry.label,
                    batch,
                    reason,
                    exc,
                )
        finally:
            q.in_flight = False
            if q.wanted > q.done and result == "ok":
                self._wake.set()  # Spark committed meanwhile: the newest batch at once
            if result not in ("no_location", "waiting"):
                self._metrics.snapshot_seconds.observe(time.perf_counter() - started)
                self._metrics.snapshots.labels(result).inc()
            if result == "error":
                q.retry_at = self._clock() + RETRY_S

    def _lineage(
        self, query_id: str, q: SnapshotPart, batch: int, shas: Mapping[str, bytes]
    ) -> tuple[str | None, str]:
        """A new snapshot's parent and timeline (``sidecar.snapshot.lineage``), against the
        document's marker as known now.

        Raises:
            OffTimeline: the directory left the marker's timeline.
        """
        known, marker = self._marker(query_id)
        if not known:
            raise lineage.OffTimeline(
                "the checkpoint document's marker is not known under the lease held now"
            )
        assert q.contents is not None
        parent = lineage.parent_of(batch, shas, q.contents.indexes())
        return (parent.id if parent is not None else None), lineage.place(parent, marker)

    def _done(
        self, query_id: str, entry: LiveQuery, q: SnapshotPart, index: SnapshotIndex, rewinds: int
    ) -> None:
        batch = index.batch
        q.off_said = None
        if rewinds != q.rewinds:  # of the timeline before a rewind: neither done nor named
            return
        q.done = max(q.done, batch)
        for reported in [b for b in q.reported if b <= q.done]:
            del q.reported[reported]
        self._metrics.snapshot_lag_batches.labels(entry.label).set(max(0, q.wanted - q.done))
        self._metrics.snapshot_batch.labels(entry.label).set(q.done)
        self._taken(query_id, SnapshotRef(batch, index.id, index.timeline))

    async def _reclaim(self, checkpoints: Callable[[], Awaitable[set[str]]]) -> None:
        """Now and then, the snapshots of queries gone (``sidecar.snapshot.reclaim``)."""
        await anyio.sleep(RECLAIM_FIRST_S)
        while True:
            busy = [
                query_id
                for query_id, entry in self._queries
                if entry.snapshot is not None and entry.snapshot.location is not None
            ]
            try:
                await reclaim(
                    self._blobs,
                    self._namespace,
                    checkpoints,
                    keep_s=self._abandoned_keep_s,
                    now=time.time(),
                    busy=busy,
                )
            except SidecarError as exc:
                log.warning("snapshots of gone queries not reclaimed (tried again later): %s", exc)
            except Exception:  # a bug: said, and never the end of the daemon
                log.exception("snapshots of gone queries: the pass failed unexpectedly")
            await anyio.sleep(RECLAIM_EVERY_S)

    async def _prune(
        self, query_id: str, entry: LiveQuery, q: SnapshotPart, owner: Ownership
    ) -> None:
        """Retention and the sweep, never beside an upload of the same query (the caller is
        that query's one snapshot in flight), only by the owner."""
        known, marker = self._marker(query_id)
        if not known:
            return  # what the document names is not known: nothing may be deleted
        try:
            pruned = await prune(
                self._blobs,
                self._namespace,
                query_id,
                retain=self._retain,
                named=marker,
                contents=q.contents,
                grace_s=GRACE_S,
                owner=owner,
                abandoned_s=self._abandoned_keep_s,
            )
        except SidecarError as exc:
            log.warning("snapshot query=%s: prune failed (tried again later): %s", entry.label, exc)
            return
        log.debug("snapshot query=%s: pruned %r", entry.label, pruned)
        broken = pruned.plan.broken  # deleted by this pass unless the document names it
        self._metrics.snapshots_broken.labels(entry.label).set(len(broken))
        self._metrics.snapshots_checked.labels(entry.label).set(time.time())
        if broken:
            log.error(
                "snapshot query=%s: %d snapshot(s) could not be restored (a pack they name is "
                "gone; deleted unless the checkpoint names it): %s; run 'checkpoint-sidecar "
                "snapshots %s --check', and look for who deletes blobs in the container",
                entry.label,
                len(broken),
                ", ".join(n.rsplit("/", 1)[-1] for n in broken),
                entry.label,
            )


def _hints(contents: Contents, batch: int, marker: SnapshotRef | None) -> tuple[str, Hints] | None:
    """Format v2: the state ids of the newest snapshot of the marker's line known at or below
    ``batch``, for the versions whose commit Spark's retention deleted (``cut_of``; the
    upload checks that the new snapshot follows it)."""
    indexes = contents.indexes()
    line = lineage.current(indexes, marker)
    known = [i for i in indexes if i.batch <= batch and i.checkpoint_format == 2 and i.id in line]
    if not known:
        return None
    newest = max(known, key=lambda i: (i.batch, i.created_at))
    return newest.id, v2_ids(f.path for f in newest.files)
