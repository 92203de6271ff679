"""Wiring: one task group runs the daemon's components; stopping follows a fixed order.

Start:  this process's lease id (``sidecar.daemon.ownership``) → admin endpoint (so /healthz
        answers at once) → wait for Redis → write coalescer → lease renewer → Kafka committer
        → Event Hubs checkpointer → idle-query
        retirement → what a previous run left pending noted → socket server → ready
        (``task_status.started()``: the socket bound, Redis answered; the store is not part
        of readiness) → then, in the background: the Azure
        SDK imported in a worker thread → wait for the blob container → store watch →
        flusher (its first pass flushes what a previous run left pending). The config checks
        (``sidecar.ops.doctor``: logged and exported, never fatal) run once the first attempt
        to open the store has ended, either way, and again if the store opens later. Modules
        are imported when configured: the Kafka client only with Kafka, identity only with an
        account URL.
Stop:   stop accepting → answer requests already read (drain) → stop the flush, Kafka
        commit and Event Hubs checkpoint loops, final flush of everything pending → final
        Kafka commit and Event Hubs checkpoints → release leases → close Redis, the store and
        Kafka. Each phase has its own deadline within ``shutdown_grace_s``
        (``sidecar.daemon.shutdown``: the drain ends by 40 %, the final flush
        keeps at least 40 %, commit and release 10 % each); the last three are shielded
        finalizers. A cut phase logs what it left undone (what is unflushed stays in Redis
        for the next start); one line sums up the stop.
A crashing component brings the whole daemon down rather than leaving it half alive.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus
from prometheus_client import CollectorRegistry

from sidecar import __version__
from sidecar.backoff import Backoff
from sidecar.buffer.redis_buffer import RedisBuffer
from sidecar.buffer.topology import Topology
from sidecar.config import Config
from sidecar.daemon import ownership
from sidecar.daemon.admin_ops import DaemonAdmin, export_restores
from sidecar.daemon.durability import DurabilityWatch
from sidecar.daemon.http import AdminServer
from sidecar.daemon.queries import Queries
from sidecar.daemon.retirement import Retirement
from sidecar.daemon.shutdown import StopBudget
from sidecar.daemon.store_watch import StoreWatch
from sidecar.errors import BufferRefused, SidecarError
from sidecar.eventhubs.checkpointer import EventHubsCheckpointer
from sidecar.flush.owner import FlushOwner
from sidecar.ingest.coalescer import WriteCoalescer
from sidecar.ingest.handler import RequestHandler
from sidecar.ingest.server import SocketServer
from sidecar.kafka.lag import EVENTHUBS, LagTracker
from sidecar.model import checkpoint as ckpt
from sidecar.model.document import Writer
from sidecar.sinks.loop import PositionSink
from sidecar.store.blobs import BlobStore
from sidecar.store.eventhubs import EventHubsBlobs
from sidecar.store.sdk import loaded as loaded_sdk

if TYPE_CHECKING:
    from sidecar.daemon.snapshots import Snapshotter
    from sidecar.kafka.committer import KafkaCommitter
from sidecar.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

RETRY_MAX_S = 10.0
#: The start-up config checks give up after this long (each call has its own timeout too).
DOCTOR_TIMEOUT_S = 60.0


#: The longest wait between attempts to open the blob store after readiness, seconds.
STORE_OPEN_RETRY_CAP_S = 30.0


class DurableHook(Protocol):
    """The flusher's ``on_durable(checkpoint)`` and the admin ops' ``on_rewind(checkpoint,
    why)`` (``rewind``: why a reset moved the query back on purpose)."""

    def __call__(self, checkpoint: ckpt.Checkpoint, rewind: str | None = None) -> None: ...


class Daemon:
    """The checkpoint sidecar. ``await run()``; call :meth:`request_stop` to stop gracefully."""

    def __init__(
        self,
        config: Config,
        *,
        registry: CollectorRegistry | None = None,
        lease_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``lease_clock``: the monotonic clock of the lease deadlines (tests inject one).
        The parts are built in this order, each from those before it."""
        self.config = config
        #: This daemon's name (the pod name), in logs and in the documents it writes.
        self.identity = self.instance_id = ownership.identity(config.instance_id)
        #: Where this process's lease id is kept for a restart of its container, locked while
        #: it runs (``sidecar.daemon.ownership``); the id is claimed when :meth:`run` starts.
        self.lease_file = ownership.lease_file(config.state_dir, config.socket_path)
        self._lease_id: ownership.LeaseId | None = None
        #: This process (the durability marker's token).
        self.run_id = str(uuid.uuid4())
        self.writer = Writer(host=socket.gethostname(), pid=os.getpid(), instance_id=self.identity)
        self.metrics = Metrics(registry)
        self.lag, self.eventhubs_lag = self._lag_trackers()
        self.committer = self._kafka_committer()
        self.buffer = _redis_buffer(config)
        self.store = BlobStore(config, creates_container=True)
        self.eventhubs = self._eventhubs_checkpointer()
        #: The position sinks configured, in the order they start and stop.
        self.sinks: list[PositionSink] = [
            s for s in (self.committer, self.eventhubs) if s is not None
        ]
        self.store_watch = StoreWatch(self.store, config.write_timeout_s)
        self.store.on_failure = lambda call, reason: self.metrics.store_failures.labels(
            call, reason
        ).inc()
        #: The daemon's record of each live query (the flush owner keeps its own behind its
        #: door): retirement removes an entry in one step.
        self.queries = Queries()
        self.retirement = Retirement(
            config.query_idle_s, queries=self.queries, release=self._release
        )
        #: The flush owner: each query's record (what its blob holds, its lease, the acks
        #: waiting, the last row applied) and the flush loop, behind one door.
        self.flush = FlushOwner(
            config,
            self.buffer,
            self.store,
            self.metrics,
            self.writer,
            on_durable=self._durable_hook(),
            track=self.retirement.track,
            clock=lease_clock,
        )
        #: Set once the blob store is open: the flush loop starts then.
        self._store_open = anyio.Event()
        #: Checkpoint snapshots (``SIDECAR_SNAPSHOT_ROOT``), made once the store is open.
        self.snapshots = self._snapshotter()
        self._build_ingest()
        self._wire_retirement()
        self._build_admin()
        self._stop = anyio.Event()
        self._budget: StopBudget | None = None
        #: Set once :meth:`run` has returned (stopped, cleanly or not).
        self.stopped = anyio.Event()

    def _lag_trackers(self) -> tuple[LagTracker, LagTracker]:
        """Kafka sources' lag and Event Hubs sources' (Spark's view), both registered."""
        config = self.config
        lag = LagTracker(
            config.kafka_query_set,
            per_partition=config.kafka_lag_per_partition,
            partition_series_max=config.kafka_lag_partition_series_max,
        )
        self.metrics.registry.register(lag)  # lag is computed when /metrics is collected
        # Event Hubs sources' lag (Spark's view): the same collector, with its own names.
        eventhubs_lag = LagTracker(
            per_partition=config.kafka_lag_per_partition,
            partition_series_max=config.kafka_lag_partition_series_max,
            family=EVENTHUBS,
        )
        self.metrics.registry.register(eventhubs_lag)
        return lag, eventhubs_lag

    def _kafka_committer(self) -> KafkaCommitter | None:
        """The Kafka committer, with Kafka configured (aiokafka is imported only then)."""
        if not self.config.kafka_bootstrap_servers:
            return None
        from sidecar.kafka.committer import KafkaCommitter

        return KafkaCommitter(
            self.config,
            self.metrics,
            on_committable=self.lag.durable,
            on_end_offsets=self.lag.end_offsets,
        )

    def _eventhubs_checkpointer(self) -> EventHubsCheckpointer | None:
        """The Event Hubs checkpointer, with a namespace configured: it writes to the store."""
        if not self.config.eventhubs_namespace:
            return None
        return EventHubsCheckpointer(self.config, self.metrics, EventHubsBlobs(self.store.account))

    def _snapshotter(self) -> Snapshotter | None:
        """The snapshotter, with a snapshot root configured (its modules are imported only
        then)."""
        config = self.config
        if not config.snapshot_root:
            return None
        from sidecar.daemon.snapshots import Snapshotter
        from sidecar.snapshot.source import configured_source
        from sidecar.store.snapshots import SnapshotBlobs

        source = configured_source(config)
        assert source is not None
        return Snapshotter(
            source,
            SnapshotBlobs(self.store.account),
            config.namespace,
            self.metrics,
            owns=self.flush.owns,
            taken=self.flush.snapshot_taken,
            marker=self.flush.snapshot_marker,
            retain=config.snapshot_retain,
            abandoned_keep_s=config.snapshot_abandoned_keep_s,
            checkpoints=self._checkpoint_ids,
            queries=self.queries,
        )

    def _build_ingest(self) -> None:
        """What answers the Spark side: the write coalescer, the durability watch, the admin
        ops, the request handler over them, and the socket server."""
        config = self.config
        # Through the flush owner: the floors it knows, and (blob ack mode) the rows each
        # apply returns, kept for the flush an ack waits on (no Redis read per ack).
        self.coalescer = WriteCoalescer(self.flush)
        self.durability = DurabilityWatch(
            self.buffer,
            self.metrics,
            token=self.run_id,
            require_aof=config.redis_require_aof,
            blob_batch=self._blob_batch,
            queries=self.queries,
        )
        # Admin ops (reset, retire), refused by the server unless SIDECAR_ADMIN_OPS is set.
        self.admin_ops = DaemonAdmin(
            config,
            self.buffer,
            self.store,
            self.flush,
            self.retirement,
            self.metrics,
            self.writer,
            on_rewind=self._durable_hook(),
        )
        self.handler = RequestHandler(
            self.coalescer,
            self.buffer,
            self.metrics,
            observe=self._applied,
            wait_durable=self.flush.ack if config.ack_mode == "blob" else None,
            blob_ack_timeout_s=config.blob_ack_timeout_s,
            lookup_blob=self._lookup_blob,
            floors=self.flush,
            admin=self.admin_ops,
        )
        self.server = SocketServer(config, self.handler, self.metrics)

    def _wire_retirement(self) -> None:
        """What outside the daemon's record (``self.queries``, which retirement removes
        from itself) keeps of a query, for idle-query retirement (the lease is released first,
        by ``Retirement`` itself): the flush owner's record and the sinks' groups."""
        r = self.retirement
        r.busy.append(self.flush.busy)
        if self.config.admin_ops:  # a reset must still be refused: its heard time is kept
            r.busy.append(self.admin_ops.heard_lately)
        r.forget.append(self.flush.forget)
        r.forget += [sink.forget for sink in self.sinks]
        r.forget_label += [self.lag.forget, self.eventhubs_lag.forget, self.metrics.forget_query]

    def _build_admin(self) -> None:
        """The admin endpoint (metrics, health checks) and the gauges read when it is
        scraped."""
        self.admin = AdminServer(
            self.config.metrics_host,
            self.config.metrics_port,
            self.metrics,
            checks=[
                self._socket_ready,
                self._started_ready,
                self._redis_ready,
                self._leases_ready,
                self._blobs_ready,
            ],
            accepting=lambda: self.server.bound,
        )
        self.metrics.buffer_queue.set_function(lambda: self.coalescer.queued)
        self.buffer.on_replicas = self.metrics.redis_replicas_acked.observe
        self.metrics.redis_up.set_function(lambda: 1.0 if self.buffer.available else 0.0)
        self.metrics.store_up.set_function(lambda: 1.0 if self.store.up else 0.0)

    async def _release(self, query_id: str) -> bool:
        """Retirement's first step: the query's lease released (a standby may take it)."""
        return await self.flush.release(query_id)

    async def _checkpoint_ids(self) -> set[str]:
        """The queries of the namespace with a checkpoint blob (one listing)."""
        return {info.query_id for info in await self.store.list()}

    def _durable_hook(self) -> DurableHook | None:
        """What the flusher tells of each checkpoint durable in its blob, and the admin ops
        of a reset's (with why: a deliberate rewind, which lowers their positions on
        purpose): the Kafka committer and the Event Hubs checkpointer, those configured (each
        contains its own failures; one raising must not keep the other from hearing of the
        checkpoint)."""
        hooks = [sink.durable for sink in self.sinks]
        if not hooks:
            return None

        def durable(checkpoint: ckpt.Checkpoint, rewind: str | None = None) -> None:
            for hook in hooks:
                try:
                    hook(checkpoint, rewind=rewind)
                except Exception:
                    log.exception(
                        "after %s query=%s batch=%d: durable hook %s failed",
                        "flushing" if rewind is None else "resetting",
                        checkpoint.label,
                        checkpoint.batch_id,
                        getattr(hook, "__qualname__", hook),
                    )

        return durable

    def request_stop(self) -> None:
        """Begin a graceful stop (idempotent; safe from a signal-handling task)."""
        self._stop.set()

    def force_stop(self) -> None:
        """Cut the graceful stop's phases now, shielded finalizers included (a second
        signal); the caller then cancels :meth:`run`."""
        if self._budget is not None:
            self._budget.force()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        loop = event_loop_name()
        self.metrics.build_info.info({"version": __version__, "event_loop": loop})
        # (a local file, off the loop all the same; refused: the CLI says why)
        self._lease_id = await anyio.to_thread.run_sync(ownership.claim, self.lease_file)
        log.info(
            "checkpoint-sidecar %s starting (instance %s, lease id %s %s %s, %s event loop): %r",
            __version__,
            self.identity,
            self._lease_id.lease_id,
            "taken over from the dead daemon of" if self._lease_id.inherited else "new, kept in",
            self.lease_file,
            loop,
            cfg,
        )
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.admin.run)
                # The socket first, whatever is down (/startupz): a driver waits only for it.
                # Until the daemon has started (Redis reached, a previous run's pending
                # recovered), every update is answered unavailable: its listener keeps it.
                self.handler.starting = "the daemon is starting: waiting for Redis; retry"
                await tg.start(self.server.run)
                if not await self._wait_for("Redis", self.buffer.ping):
                    tg.cancel_scope.cancel()
                    return
                self.handler.starting = "the daemon is starting (Redis reached); retry"
                await self.durability.start()  # AOF check (may refuse to start), marker
                await tg.start(self.durability.run)
                await tg.start(self.coalescer.run)
                for sink in self.sinks:
                    await tg.start(sink.run)  # Kafka's builds its TLS context once
                await tg.start(self.retirement.run)
                # The leases kept, and what a previous run left pending noted, before the gate
                # opens (only a previous run's is pending then); the flush loop waits for the
                # store to open.
                await tg.start(self.flush.run, self._lease_id.lease_id, self._store_open)
                await self._restores()
                self.handler.starting = None
                # Start-up objects (modules, clients) never die: move them out of the
                # collector's reach so full collections stay short (they caused 20-40 ms
                # ack-latency spikes in bench/ingest.py). Again once the store is open. No
                # collection first: it took 15-21 ms of the start and found ~50-85 garbage
                # objects of ~48,600 (kept now, once).
                gc.freeze()
                log.info(
                    "ready: namespace=%s socket=%s container=%s ack_mode=%s event_loop=%s "
                    "(the blob store is opened next)",
                    cfg.namespace,
                    cfg.socket_path,
                    cfg.container,
                    cfg.ack_mode,
                    loop,
                )
                opening = anyio.CancelScope()
                tg.start_soon(self._open_store, tg, opening)
                task_status.started()
                await self._stop.wait()
                opening.cancel()  # a stop while the store opens: nothing more starts
                self.retirement.stop()  # the final flush and commit own every query now
                await self._shutdown()
                tg.cancel_scope.cancel()
        finally:
            budget = self._budget or StopBudget(cfg.shutdown_grace_s)
            with budget.closing():
                for sink in self.sinks:
                    await sink.aclose()
                await self.buffer.aclose()
                await self.store.aclose()
            # The leases are released: the next daemon of this directory may take the id over.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._lease_id.close)
            self.stopped.set()
            log.info("%s", budget.summary())

    async def _open_store(self, tg: TaskGroup, scope: anyio.CancelScope) -> None:
        """After readiness (which the store is not part of: docs/flush-owner.md): import the
        Azure SDK off the event loop, wait for the container, then start what writes to it —
        the store watch, the flusher (whose first pass recovers what a previous run left
        pending). Updates are accepted and buffered meanwhile. A stop cancels ``scope``:
        nothing starts after it. A store that refuses (credentials, a role not assigned yet)
        is logged and tried again at the backoff cap: the daemon is ready and buffering, and
        its stop stays graceful. The config checks start when the first attempt has ended,
        either way, so a store that refuses does not hold back their results (they say why);
        they run again when the store opens after that."""
        with scope:
            backoff = Backoff(0.5, STORE_OPEN_RETRY_CAP_S)
            checked = False
            while True:
                try:
                    await loaded_sdk(identity=not self.config.azure_connection_string)
                    await self.store.ensure_container()
                    break
                except Exception as exc:  # not fatal: the daemon is ready and buffering
                    retriable = getattr(exc, "retriable", False)
                    delay = backoff.failed(give_up_ramp=not retriable)
                    log.log(
                        logging.WARNING if retriable else logging.ERROR,
                        "blob store not open yet (retry in %.1fs): %s",
                        delay,
                        exc,
                        exc_info=not isinstance(exc, SidecarError),
                    )
                    if not checked:
                        checked = True
                        tg.start_soon(self._doctor)
                    await anyio.sleep(delay)
            await tg.start(self.store_watch.run)
            self._store_open.set()
            if self.snapshots is not None:
                await tg.start(self.snapshots.run)
            gc.freeze()  # the SDK's modules too (no collection here: acks are being served)
            log.info("blob store open: container %s", self.store.where)
            tg.start_soon(self._doctor)  # (again) in the background: logged, exported, never fatal

    async def _restores(self) -> None:
        """The restores done while no daemon ran (an init container's, nothing scraped it),
        exported from what their resets kept in Redis; a failure costs the metric only."""
        try:
            await export_restores(self.buffer, self.metrics)
        except SidecarError as exc:
            log.warning("restore records not read from Redis (not exported): %s", exc)

    async def _doctor(self) -> None:
        """``checkpoint-sidecar doctor``'s checks, once: logged and exported, never fatal."""
        from sidecar.ops import doctor  # after readiness: not on the start path

        try:
            with anyio.fail_after(DOCTOR_TIMEOUT_S):
                checks = await doctor.run_checks(
                    self.config,
                    self.buffer,
                    self.store,
                    self.committer.client_options if self.committer else None,
                )
        except Exception:  # a bug or a hung service must not stop the daemon
            log.exception("config checks did not complete")
            return
        doctor.log_results(checks)
        for check in checks:
            self.metrics.config_check.labels(check.name).set(1 if check.status == "ok" else 0)

    def _applied(self, checkpoint: ckpt.Checkpoint, applied: bool) -> None:
        """A progress handled, ``applied`` when stored in Redis (ingest path: O(1) each)."""
        if self.config.admin_ops:  # an idle running query reports too: no reset meanwhile
            self.admin_ops.heard(checkpoint.query_id, checkpoint.label)
        if not applied:
            return
        self.lag.observe(checkpoint)
        self.eventhubs_lag.observe(checkpoint)
        self.retirement.seen(checkpoint.query_id, checkpoint.label)
        self.durability.acked(checkpoint.query_id, checkpoint.label, checkpoint.batch_id)
        if self.snapshots is not None:  # Spark committed it: its snapshot, in the background
            self.snapshots.committed(checkpoint)

    async def _blob_batch(self, query_id: str) -> int | None:
        doc = await self.store.read(query_id)
        return doc.batch_id if doc is not None else None

    async def _lookup_blob(self, query_id: str | None, name: str | None) -> bytes | None:
        """A checkpoint from its blob (``get`` when Redis has none), encoded as in Redis."""
        doc = await self.store.find(query_id, name)
        return ckpt.encode(doc.checkpoint()) if doc is not None else None

    async def _wait_for(self, what: str, probe: Callable[[], Awaitable[object]]) -> bool:
        """Retry ``probe`` until it succeeds (True) or a stop is requested first (False)."""
        backoff = Backoff(0.1, RETRY_MAX_S)
        while True:
            try:
                await probe()
                return True
            except SidecarError as exc:
                if not exc.retriable:
                    raise
                # Refused credentials are a configuration error: said at ERROR, and tried at
                # the cap (a password rotated in Redis before its Secret heals by itself).
                refused = isinstance(exc, BufferRefused)
                delay = backoff.failed(give_up_ramp=refused)
                level = logging.ERROR if refused else logging.WARNING
                log.log(level, "waiting for %s (retry in %.1fs): %s", what, delay, exc)
            with anyio.move_on_after(delay):
                await self._stop.wait()
                return False

    async def _shutdown(self) -> None:
        budget = self._budget = StopBudget(self.config.shutdown_grace_s)
        log.info(
            "stopping: no new connections, answering requests already read, then a final "
            "flush (grace %.1fs: %s)",
            budget.grace_s,
            budget.plan(),
        )
        with budget.phase("drain") as drain:
            await self.server.drain()
        if drain.cancelled_caught:
            log.warning(
                "stop: drain cut at its deadline (%.1fs): closing %d connection(s) without all "
                "their replies (e.g. a client not reading them) and %d queued update(s); "
                "nothing unanswered was acknowledged, so clients resend it",
                budget.until("drain"),
                self.server.active_connections,
                self.coalescer.queued,
            )
        with budget.finalizers():
            with budget.phase("final flush") as flush:
                if self.snapshots is not None:
                    self.snapshots.stop()  # a snapshot under way is cut: pruned later
                for sink in self.sinks:
                    # Before the final flush tells it: the final commit alone opens what it
                    # needs (a flush of the loop meanwhile is committed by it too).
                    await sink.stop_loop()
                await self.flush.final_flush()
            if flush.cancelled_caught:
                await self._log_unflushed(budget.until("final flush"))
            if self.sinks:
                with budget.phase("final commit") as commit:
                    async with anyio.create_task_group() as finals:
                        for sink in self.sinks:
                            finals.start_soon(sink.final_commit)
                outcome = "cut" if commit.cancelled_caught else "failed"
                for sink in self.sinks:
                    if behind := sink.behind():
                        log.warning(
                            "stop: %s %s: group(s) %s not %s at their query's last durable "
                            "batch (they stay behind until the query's next flush after a "
                            "restart)",
                            sink.FINAL,
                            outcome,
                            ", ".join(behind),
                            sink.NOT_DONE,
                        )
            with budget.phase("release") as release:
                await self.flush.release_all()
            if release.cancelled_caught:
                log.warning(
                    "stop: releasing leases cut at %.1fs; lease(s) of %s left to expire by "
                    "themselves (a successor waits up to %ds to write those blobs)",
                    budget.until("release"),
                    ", ".join(self.flush.health().held),
                    self.config.lease_duration_s,
                )

    async def _log_unflushed(self, deadline_s: float) -> None:
        try:
            with anyio.fail_after(1):
                snapshot = await self.buffer.snapshot()
        except (SidecarError, TimeoutError):
            log.warning(
                "stop: final flush cut at its deadline (%.1fs); what is left stays in Redis "
                "and is flushed at the next start",
                deadline_s,
            )
            return
        left = ", ".join(
            f"{q.query_id} ({q.pending} updates, batch {q.batch_id})"
            for q in snapshot.queries
            if q.pending > 0
        )
        log.warning(
            "stop: final flush cut at its deadline (%.1fs); left unflushed (kept in Redis, "
            "flushed at the next start): %s",
            deadline_s,
            left or "nothing",
        )

    async def _socket_ready(self) -> str | None:
        return None if self.server.bound else "socket not bound"

    async def _started_ready(self) -> str | None:
        return self.handler.starting

    async def _redis_ready(self) -> str | None:
        try:
            with anyio.fail_after(1):
                await self.buffer.ping()
        except (SidecarError, TimeoutError) as exc:
            return f"Redis: {exc}"
        return None

    async def _leases_ready(self) -> str | None:
        # A store that does not answer is not a reason (sidecar.daemon.store_watch): Redis
        # keeps buffering, and checkpoint_sidecar_store_up says it.
        health = self.flush.health()
        if health.contested:
            holders = health.holders
            owners = ", ".join(
                f"{label} (last written by {holders[label]})" if label in holders else label
                for label in health.contested
            )
            return (
                "lease held by another daemon (updates are buffered in Redis, nothing is "
                f"written), or ours was broken, for: {owners}"
            )
        return None

    async def _blobs_ready(self) -> str | None:
        refused = self.flush.health().refused
        if not refused:
            return None
        which = ", ".join(f"{label} ({reset})" for label, reset in sorted(refused.items()))
        return (
            "a blob holds a reset this daemon's Redis never recorded (another daemon with its "
            "own Redis?); nothing is written over it until 'checkpoint-sidecar reset' here: "
            + which
        )


def _redis_buffer(config: Config) -> RedisBuffer:
    """The Redis buffer of ``config``'s namespace and topology."""
    return RedisBuffer(
        config.redis_url,
        config.namespace,
        timeout_s=config.redis_timeout_s,
        topology=Topology.of(config),
        min_replicas=config.redis_min_replicas,
    )


def event_loop_name() -> str:
    """``uvloop`` or ``asyncio``: the loop running the daemon (``SIDECAR_EVENT_LOOP``)."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.split(".")[0] == "uvloop" else "asyncio"
