"""Prometheus metrics. Names and labels are part of the contract dashboards rely on.

The metrics are declared in one table, ``_SPECS``: a row per metric, in the order they are
exported. :class:`Metrics` builds them from it; what is not a declaration (the build info,
Redis' AOF gauge, the per-query helpers) is written out on the class.

Each daemon owns its registry (tests run several daemons in one process). Label values come
from closed sets (results, error codes), so cardinality stays bounded, except the ``query``
label: its series are removed when the query is retired (:meth:`Metrics.forget_query`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from sidecar import __version__
from sidecar.wire.protocol import ErrorCode

UPDATE_RESULTS = ("applied", "stale", "no_offsets", "rejected")
#: ok: written; skipped: the blob already held that batch or newer; not_owned: lease held
#: elsewhere; lease_lost: the store refused our lease; conflict: the blob changed since read
#: (another writer; read again, never lowered); error: store/Redis failure (retried).
FLUSH_RESULTS = ("ok", "skipped", "not_owned", "lease_lost", "conflict", "error")
RENEWAL_RESULTS = ("ok", "lost", "error")
#: Kafka consumer-group commits' and Event Hubs checkpoint writes' results.
COMMIT_RESULTS = ("ok", "regressed", "rewound", "error")
#: What a conditional write refused as another writer's was writing.
WRITE_CONFLICT_WHAT = ("checkpoint", "reset", "archive", "eventhubs")
#: Where an unreadable record was found (sidecar.errors.CorruptRecord.where).
BAD_RECORD_WHERE = ("redis", "blob")
#: sidecar.snapshot.upload.FAILURE_REASONS but not_owner (a result of its own, not a failure).
SNAPSHOT_FAILURE_REASONS = (
    "file_changed",
    "cut_not_committed",
    "cut_missing_file",
    "cut_unreadable",
    "cut_unsupported",
    "source",
    "store_unavailable",
    "store_refused",
    "store",
    "wrong_query",
    "off_timeline",
    "other",
)
FLUSH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

# Acks are a local socket plus one Redis round trip: sub-millisecond when healthy, seconds
# only when Redis is struggling (the Redis timeout caps the tail).
ACK_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


@dataclass(frozen=True)
class _Spec:
    """One metric: the :class:`Metrics` attribute that holds it, and its declaration."""

    attr: str
    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    help: str
    labels: tuple[str, ...] = ()
    #: Label values exported from the start, one tuple per label (every combination), so
    #: rate() and alerts see a 0, not a gap.
    values: tuple[tuple[str, ...], ...] = ()
    buckets: tuple[float, ...] = Histogram.DEFAULT_BUCKETS  # a Histogram's only

    def declare(self, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
        """The metric, registered on ``registry``, its known series exported."""
        metric: Counter | Gauge | Histogram
        if self.kind is Histogram:
            metric = Histogram(
                self.name, self.help, self.labels, registry=registry, buckets=self.buckets
            )
        else:
            metric = self.kind(self.name, self.help, self.labels, registry=registry)
        if self.values:
            for series in itertools.product(*self.values):
                metric.labels(*series)
        return metric


_SPECS: tuple[_Spec, ...] = (
    _Spec(
        "updates",
        Counter,
        "checkpoint_sidecar_updates",
        "Progress updates received, by result: applied (stored), stale (batch not newer "
        "than the stored one), no_offsets (no source reports an end offset, e.g. an idle "
        "query on Spark 3.4: not stored), rejected (invalid, or not stored because Redis "
        "failed)",
        labels=("result",),
        values=(UPDATE_RESULTS,),
    ),
    _Spec(
        "ack_seconds",
        Histogram,
        "checkpoint_sidecar_ack_seconds",
        "Time from reading a progress request to its reply being ready, seconds",
        buckets=ACK_BUCKETS,
    ),
    _Spec("connections", Gauge, "checkpoint_sidecar_connections", "Open client connections"),
    _Spec(
        "bad_requests",
        Counter,
        "checkpoint_sidecar_bad_requests",
        "Requests answered with an error, by error code",
        labels=("code",),
        values=(tuple(code.value for code in ErrorCode),),
    ),
    _Spec(
        "not_durable",
        Counter,
        "checkpoint_sidecar_not_durable",
        "not_durable and not_owner replies by reason: replicas (fewer Redis replicas than "
        "SIDECAR_REDIS_MIN_REPLICAS confirmed in time), blob (ack_mode=blob: not in the "
        "blob within SIDECAR_BLOB_ACK_TIMEOUT_S), not_owner (ack_mode=blob: another "
        "daemon holds the query's lease)",
        labels=("reason",),
        values=(("replicas", "blob", "not_owner"),),
    ),
    _Spec(
        "redis_replicas_acked",
        Histogram,
        "checkpoint_sidecar_redis_replicas_acked",
        "Replicas that confirmed a batch of updates (WAIT's answer; only with "
        "SIDECAR_REDIS_MIN_REPLICAS > 0)",
        buckets=(0, 1, 2, 3, 4, 6, 8, 16),
    ),
    _Spec(
        "buffer_queue",
        Gauge,
        "checkpoint_sidecar_buffer_queue",
        "Updates waiting for their Redis round trip (bounded; full means backpressure)",
    ),
    _Spec("redis_up", Gauge, "checkpoint_sidecar_redis_up", "1 when the last Redis call succeeded"),
    _Spec(
        "store_up",
        Gauge,
        "checkpoint_sidecar_store_up",
        "1 when the daemon can use the blob store: its last call was answered (pinged "
        "when idle), and none was refused for the daemon's credentials or a missing "
        "container in the last minute; 0 otherwise (the log says which)",
    ),
    _Spec(
        "store_failures",
        Counter,
        "checkpoint_sidecar_store_failures",
        "Blob store calls not answered or refusing the daemon, by call and reason: "
        "timeout, connection, credential (no token), or the status and Azure error code "
        "(503 ServerBusy, 403 AuthorizationFailure, 404 ContainerNotFound, ...)",
        labels=("call", "reason"),
    ),
    _Spec(
        "listener_seen",
        Gauge,
        "checkpoint_sidecar_listener_seen",
        "1 once a Spark listener has sent this daemon a progress update since it started "
        "(the listener connects at its query's first progress), 0 until then",
    ),
    _Spec(
        "last_update",
        Gauge,
        "checkpoint_sidecar_last_update_timestamp_seconds",
        "When the last progress update of any Spark listener arrived, Unix seconds (0 "
        "before the first): a listener that connected and went quiet shows as its age",
    ),
    _Spec(
        "redis_resets",
        Counter,
        "checkpoint_sidecar_redis_resets",
        "Times Redis lost the namespace's data while the daemon ran (restart without AOF, "
        "FLUSHALL, a replaced instance): acknowledged updates may be lost; see the log",
    ),
    # --- flushing to the blob store (per-query series are labelled by query name/id) -------
    _Spec(
        "flushes",
        Counter,
        "checkpoint_sidecar_flushes",
        "Flush attempts of one query's checkpoint, by result",
        labels=("result",),
        values=(FLUSH_RESULTS,),
    ),
    _Spec(
        "flush_checks",
        Counter,
        "checkpoint_sidecar_flush_checks",
        "Flush checks: reads of the pending queries' flush state (not their checkpoints), "
        "every SIDECAR_FLUSH_INTERVAL_S",
    ),
    _Spec(
        "flush_check_seconds",
        Gauge,
        "checkpoint_sidecar_flush_check_seconds",
        "The daemon loop's CPU time during the last flush check (Redis' listing of the "
        "pending queries parsed, and the decision on each); checks are spaced so they take "
        "at most a fifth of the loop",
    ),
    _Spec(
        "flush_bodies_read",
        Counter,
        "checkpoint_sidecar_flush_bodies_read",
        "Checkpoints read from Redis to be flushed (only those of due queries, and once "
        "for a query not seen yet)",
    ),
    _Spec(
        "flush_seconds",
        Histogram,
        "checkpoint_sidecar_flush_seconds",
        "Duration of one checkpoint blob write, seconds",
        buckets=FLUSH_BUCKETS,
    ),
    _Spec(
        "checkpoint_batch_id",
        Gauge,
        "checkpoint_sidecar_checkpoint_batch_id",
        "Last batch id durable in the query's blob",
        labels=("query",),
    ),
    _Spec(
        "checkpoint_age",
        Gauge,
        "checkpoint_sidecar_checkpoint_age_seconds",
        "Age of the oldest applied update not yet durable in the blob (0: up to date)",
        labels=("query",),
    ),
    _Spec(
        "pending_updates",
        Gauge,
        "checkpoint_sidecar_pending_updates",
        "Applied updates buffered in Redis and not yet flushed to the blob",
        labels=("query",),
    ),
    _Spec(
        "bad_records",
        Counter,
        "checkpoint_sidecar_bad_records",
        "Stored records found unreadable (another version's, cut short, edited by hand), "
        "by where: redis (a query's hash) or blob (a query's document). Each is counted "
        "once, left as it is and not flushed; the log names it",
        labels=("where",),
        values=(BAD_RECORD_WHERE,),
    ),
    _Spec(
        "lease_held",
        Gauge,
        "checkpoint_sidecar_lease_held",
        "1 while this daemon holds the lease on the query's blob",
        labels=("query",),
    ),
    _Spec(
        "write_conflicts",
        Counter,
        "checkpoint_sidecar_write_conflicts",
        "Conditional writes the store refused because the blob had changed since this "
        "daemon read or wrote it (another writer: a predecessor's late write, a second "
        "daemon, an operator), by what was written: checkpoint, reset, archive, eventhubs. "
        "Nothing was overwritten; the blob is read again and never lowered",
        labels=("what",),
        values=(WRITE_CONFLICT_WHAT,),
    ),
    _Spec(
        "store_lost_writes",
        Counter,
        "checkpoint_sidecar_store_lost_writes",
        "Times a query's blob, read under this daemon's lease, held a batch below the one "
        "Redis records as flushed, with no reset since: the blob store lost writes (a crash, "
        "an account failover, a restore of an older version). The newest acknowledged "
        "batch is written over it; the log names the query and both batches",
    ),
    _Spec(
        "resets_unrecorded",
        Gauge,
        "checkpoint_sidecar_blob_resets_unrecorded",
        "Queries whose blob holds a reset that this daemon's Redis never recorded (another "
        "daemon on the namespace, with its own Redis): nothing is written over it until an "
        "operator resets the query here; /readyz and the log name each",
    ),
    _Spec(
        "lease_elsewhere",
        Gauge,
        "checkpoint_sidecar_lease_held_elsewhere",
        "1 while another daemon holds the lease on the query's blob (this one buffers its "
        "updates in Redis and writes nothing); writer: who last wrote the blob (host and "
        "pid), the likely owner",
        labels=("query", "writer"),
    ),
    _Spec(
        "lease_renewals",
        Counter,
        "checkpoint_sidecar_lease_renewals",
        "Lease renewals, by result (lost: refused by the store)",
        labels=("result",),
        values=(RENEWAL_RESULTS,),
    ),
    # --- Kafka consumer-group commits and lag -----------------------------------------------
    _Spec(
        "kafka_commits",
        Counter,
        "checkpoint_sidecar_kafka_commits",
        "Consumer-group commits, by result (regressed: some partitions skipped because "
        "the commit would have lowered their committed offset; rewound: some partitions "
        "lowered on purpose, a reset by the daemon)",
        labels=("result",),
        values=(COMMIT_RESULTS,),
    ),
    _Spec(
        "kafka_partitions_skipped",
        Counter,
        "checkpoint_sidecar_kafka_partitions_skipped",
        "Partitions not committed because that would have moved them backwards",
    ),
    _Spec(
        "kafka_up", Gauge, "checkpoint_sidecar_kafka_up", "1 when the last Kafka commit succeeded"
    ),
    # Lag (checkpoint_sidecar_kafka_lag_records, _query_lag_records, _lag_seconds) is
    # computed at collection time by sidecar.kafka.lag's collector, registered on this registry.
    # --- Event Hubs checkpoints (and lag: checkpoint_sidecar_eventhubs_lag_*, the same
    # collector's) --------------------------------------------------------------------------
    _Spec(
        "eventhubs_checkpoints",
        Counter,
        "checkpoint_sidecar_eventhubs_checkpoints",
        "Event Hubs checkpoint writes of one consumer group, by result (regressed: some "
        "partitions skipped because the write would have lowered their sequence number; "
        "rewound: some partitions lowered on purpose, a reset by the daemon)",
        labels=("result",),
        values=(COMMIT_RESULTS,),
    ),
    _Spec(
        "eventhubs_partitions_skipped",
        Counter,
        "checkpoint_sidecar_eventhubs_partitions_skipped",
        "Event Hubs partitions not checkpointed because that would have moved them backwards",
    ),
    _Spec(
        "eventhubs_up",
        Gauge,
        "checkpoint_sidecar_eventhubs_up",
        "1 when the last Event Hubs checkpoint write succeeded",
    ),
    # --- checkpoint snapshots (SIDECAR_SNAPSHOT_ROOT; sidecar.snapshot) --------------------
    _Spec(
        "snapshots",
        Counter,
        "checkpoint_sidecar_snapshots",
        "Checkpoint snapshots attempted, by result: ok, not_owner (another daemon holds "
        "the query's lease: its owner snapshots it), error (see snapshot_failures_total)",
        labels=("result",),
        values=(("ok", "not_owner", "error"),),
    ),
    _Spec(
        "snapshot_failures",
        Counter,
        "checkpoint_sidecar_snapshot_failures",
        "Snapshots that failed, by reason: file_changed (Spark changed a file mid-copy: the "
        "next one is taken), cut_not_committed, cut_missing_file, cut_unreadable, "
        "cut_unsupported (the cut), source (the checkpoint volume), store_unavailable, "
        "store_refused, store (the blob store), wrong_query, other (a bug: see the log)",
        labels=("reason",),
        values=(SNAPSHOT_FAILURE_REASONS,),
    ),
    _Spec(
        "snapshot_seconds",
        Histogram,
        "checkpoint_sidecar_snapshot_seconds",
        "Duration of one snapshot (cut, hashing, uploads, index), seconds",
        buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
    ),
    _Spec(
        "snapshot_bytes",
        Counter,
        "checkpoint_sidecar_snapshot_bytes",
        "Bytes uploaded by snapshots, by kind: content (files' bytes, each once) or index",
        labels=("kind",),
        values=(("content", "index"),),
    ),
    _Spec(
        "snapshot_files",
        Counter,
        "checkpoint_sidecar_snapshot_files",
        "Files of snapshots, by kind: uploaded (new content) or reused (stored already)",
        labels=("kind",),
        values=(("uploaded", "reused"),),
    ),
    _Spec(
        "snapshot_requests",
        Counter,
        "checkpoint_sidecar_snapshot_requests",
        "Storage requests made by snapshots (blocks, puts, commits, listings, reads)",
    ),
    _Spec(
        "snapshot_batch",
        Gauge,
        "checkpoint_sidecar_snapshot_batch_id",
        "Batch of the query's newest snapshot",
        labels=("query",),
    ),
    _Spec(
        "snapshot_lag_batches",
        Gauge,
        "checkpoint_sidecar_snapshot_lag_batches",
        "Batches Spark committed since the query's newest snapshot",
        labels=("query",),
    ),
    _Spec(
        "snapshot_lag_seconds",
        Gauge,
        "checkpoint_sidecar_snapshot_lag_seconds",
        "How long the oldest batch Spark committed and no snapshot holds has waited, seconds",
        labels=("query",),
    ),
    _Spec(
        "snapshots_broken",
        Gauge,
        "checkpoint_sidecar_snapshots_broken",
        "The query's snapshots that cannot be restored (an index naming a pack that is "
        "gone), as its owner's last prune pass found them (every 5 minutes at most)",
        labels=("query",),
    ),
    _Spec(
        "snapshots_checked",
        Gauge,
        "checkpoint_sidecar_snapshots_checked_timestamp_seconds",
        "When the query's owner last checked its snapshots (a prune pass: every index "
        "read, every pack it names listed), Unix time",
        labels=("query",),
    ),
    # --- restores (checkpoint-sidecar restore, often an init container nothing scrapes:
    # its figures come through its reset, kept in Redis; sidecar.model.restored) --------------
    _Spec(
        "restore_seconds",
        Gauge,
        "checkpoint_sidecar_restore_duration_seconds",
        "How long the query's last restore from a snapshot took to write its checkpoint "
        "directory (downloads, checksums, renames), seconds",
        labels=("query",),
    ),
    _Spec(
        "restore_bytes",
        Gauge,
        "checkpoint_sidecar_restore_bytes",
        "Bytes of the files the query's last restore from a snapshot wrote",
        labels=("query",),
    ),
    _Spec(
        "restore_files",
        Gauge,
        "checkpoint_sidecar_restore_files",
        "Files the query's last restore from a snapshot wrote",
        labels=("query",),
    ),
    _Spec(
        "restore_time",
        Gauge,
        "checkpoint_sidecar_restore_timestamp_seconds",
        "When the query's last restore from a snapshot finished writing, Unix time",
        labels=("query",),
    ),
    _Spec(
        "config_check",
        Gauge,
        "checkpoint_sidecar_config_check",
        "Result of each configuration check run at start (checkpoint-sidecar doctor): "
        "1 ok, 0 warn or fail (the log says which, and what to do)",
        labels=("check",),
    ),
    _Spec(
        "admin_ops",
        Counter,
        "checkpoint_sidecar_admin_ops",
        "Admin ops (checkpoint-sidecar reset / retire) by op and result: ok (done), "
        "refused (forbidden, query running, lease held elsewhere, not found, bad request: "
        "nothing changed), error (Redis or the store failed); each one is logged at WARNING",
        labels=("op", "result"),
        values=(("reset", "retire"), ("ok", "refused", "error")),
    ),
)


class Metrics:
    """The daemon's metrics, registered on ``registry`` (a fresh one by default)."""

    registry: CollectorRegistry
    # One attribute per row of _SPECS, in its order; __init__ sets them.
    updates: Counter
    ack_seconds: Histogram
    connections: Gauge
    bad_requests: Counter
    not_durable: Counter
    redis_replicas_acked: Histogram
    buffer_queue: Gauge
    redis_up: Gauge
    store_up: Gauge
    store_failures: Counter
    listener_seen: Gauge
    last_update: Gauge
    redis_resets: Counter
    flushes: Counter
    flush_checks: Counter
    flush_check_seconds: Gauge
    flush_bodies_read: Counter
    flush_seconds: Histogram
    checkpoint_batch_id: Gauge
    checkpoint_age: Gauge
    pending_updates: Gauge
    bad_records: Counter
    lease_held: Gauge
    write_conflicts: Counter
    store_lost_writes: Counter
    resets_unrecorded: Gauge
    lease_elsewhere: Gauge
    lease_renewals: Counter
    kafka_commits: Counter
    kafka_partitions_skipped: Counter
    kafka_up: Gauge
    eventhubs_checkpoints: Counter
    eventhubs_partitions_skipped: Counter
    eventhubs_up: Gauge
    snapshots: Counter
    snapshot_failures: Counter
    snapshot_seconds: Histogram
    snapshot_bytes: Counter
    snapshot_files: Counter
    snapshot_requests: Counter
    snapshot_batch: Gauge
    snapshot_lag_batches: Gauge
    snapshot_lag_seconds: Gauge
    snapshots_broken: Gauge
    snapshots_checked: Gauge
    restore_seconds: Gauge
    restore_bytes: Gauge
    restore_files: Gauge
    restore_time: Gauge
    config_check: Gauge
    admin_ops: Counter
    #: The version, and the event loop once the daemon runs (``Daemon.run``).
    build_info: Info
    #: ``checkpoint_sidecar_redis_aof_enabled``, once Redis has said (:meth:`set_redis_aof`).
    _aof: Gauge | None

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._aof = None
        for spec in _SPECS:
            setattr(self, spec.attr, spec.declare(self.registry))
        self.build_info = Info(
            "checkpoint_sidecar_build",
            "Version of the daemon, and its event loop",
            registry=self.registry,
        )
        self.build_info.info({"version": __version__})

    def forget_query(self, label: str) -> None:
        """Remove every series labelled ``query=label`` (a retired query's): one removal per
        metric, whatever the number of queries (lag series are ``sidecar.kafka.lag``'s)."""
        for gauge in (
            self.checkpoint_batch_id,
            self.checkpoint_age,
            self.pending_updates,
            self.lease_held,
        ):
            gauge.remove(label)
        for gauge in self._restore_gauges:
            if (label,) in gauge._metrics:
                gauge.remove(label)
        for labels in list(self.lease_elsewhere._metrics):  # by query and writer
            if labels[0] == label:
                self.lease_elsewhere.remove(*labels)
        self.forget_snapshot_series(label)

    @property
    def _restore_gauges(self) -> tuple[Gauge, ...]:
        return (self.restore_seconds, self.restore_bytes, self.restore_files, self.restore_time)

    def restored(self, label: str, *, seconds: float, bytes: int, files: int, at: float) -> None:
        """Query ``label``'s last restore (``checkpoint_sidecar_restore_*``): how long it took,
        what it wrote, when it finished (Unix seconds)."""
        self.restore_seconds.labels(label).set(seconds)
        self.restore_bytes.labels(label).set(bytes)
        self.restore_files.labels(label).set(files)
        self.restore_time.labels(label).set(at)

    def forget_snapshot_series(self, label: str) -> None:
        """Remove the snapshot series of query ``label`` (retired)."""
        for gauge in (
            self.snapshot_batch,
            self.snapshot_lag_batches,
            self.snapshot_lag_seconds,
            self.snapshots_broken,
            self.snapshots_checked,
        ):
            if (label,) in gauge._metrics:
                gauge.remove(label)

    def set_redis_aof(self, enabled: bool | None) -> None:
        """``checkpoint_sidecar_redis_aof_enabled``: 1/0, absent while unknown (CONFIG
        refused, as on some managed services): an absent series is not a false alarm."""
        if enabled is None:
            if self._aof is not None:
                self.registry.unregister(self._aof)
                self._aof = None
            return
        if self._aof is None:
            self._aof = Gauge(
                "checkpoint_sidecar_redis_aof_enabled",
                "1 when Redis has appendonly on (acks survive a Redis restart), 0 when off",
                registry=self.registry,
            )
        self._aof.set(1 if enabled else 0)
