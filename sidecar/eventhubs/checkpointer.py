"""Write Spark's durable Event Hubs positions as Event Hubs checkpoints, after each blob write.

Spark's Event Hubs connector keeps its position in Spark's checkpoint directory only, so KEDA's
Event Hubs scaler, lag dashboards and the SDKs' processors see a Spark job as a consumer that
never checkpointed. The daemon holds every Event Hubs source's sequence numbers; after each
successful blob write it writes them as checkpoints of a consumer group, in the layout the
SDKs' ``BlobCheckpointStore`` uses (``sidecar.eventhubs.plan``).

Invariants (those of the Kafka committer, ``sidecar.kafka.committer``):
- only positions that are **durable in the blob** are written (the flusher calls
  :meth:`EventHubsCheckpointer.durable` after a write, never before; a reset by the daemon
  after its own);
- a partition's checkpoint **never goes backwards but on purpose**: the store's checkpoints
  of a group are read before its first write (and again after any failure), and a write that
  would lower a partition's sequence number is skipped for that partition and counted; only a
  deliberate rewind (``durable(checkpoint, rewind=why)``: a reset by the daemon) lowers it,
  logged at WARNING and counted (``rewound``). Every write names the blob's version it read
  (``If-Match``): a version conflict lists the hub again, never overwrites blind;
- a rewind is never undone by what preceded it: a group's writes run one at a time, so a
  write of older positions in flight when the rewind arrives ends before the rewind's is
  planned (it lists again first, and lowers what that write raised); the rewind stays pending
  until a write made with it has landed, whatever newer checkpoint of the query came since;
  and a partition another writer lowered since this one last listed it (a rewind by another
  daemon) is not raised again by the positions that were current then
  (``sidecar.model.positions``);
- the store never blocks flushing: writes are retried with backoff, 0.5 s doubling to 30 s,
  an error that is not ``retriable`` (a missing container, a refused credential) waiting the
  30 s cap at once; anything unexpected is contained, logged once with its traceback.

Unlike Kafka's groups, checkpoint blobs do not expire, so nothing is re-written while idle: a
pass writes only the partitions whose sequence number moved.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import anyio
from anyio.abc import TaskStatus

from sidecar.backoff import Retries
from sidecar.config import Config
from sidecar.errors import VersionConflict
from sidecar.eventhubs import plan as eh
from sidecar.model import positions
from sidecar.model.checkpoint import Checkpoint
from sidecar.model.offsets import eventhubs_offsets
from sidecar.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

TICK_S = 1.0
RETRY_CAP_S = 30.0
#: Checkpoint blobs written at once (one Set Blob Metadata each), over all groups.
WRITES_IN_FLIGHT = 16


class CheckpointBlobs(Protocol):
    """What the checkpointer needs of the store (``sidecar.store.eventhubs.EventHubsBlobs``)."""

    async def eventhubs_checkpoints(
        self, container: str, prefix: str
    ) -> dict[str, tuple[str | None, str]]:
        """Partition id → (stored ``sequencenumber``, version) of the checkpoints under
        ``prefix``."""
        ...

    async def write_eventhubs_checkpoint(
        self, container: str, name: str, metadata: dict[str, str], version: str | None
    ) -> str:
        """Set a checkpoint blob's metadata if it is still at ``version`` (None: create it,
        if absent); its new version. Raises ``VersionConflict`` when another wrote it."""
        ...


@dataclass
class _Group:
    """One query's consumer group and what we know of its checkpoints."""

    name: str
    checkpoint: Checkpoint
    #: (event hub, partition) → the last sequence number processed, durable in the blob.
    wanted: eh.Positions
    dirty: bool = True
    #: What the store holds, as far as we know (listed, then what we wrote).
    stored: dict[tuple[str, int], int] = field(default_factory=dict)
    #: The version of each partition's blob as listed or written (absent: no blob), which
    #: the next write of it names: a blob another writer changed meanwhile is never
    #: overwritten blind (listed again instead, and never lowered).
    versions: dict[tuple[str, int], str] = field(default_factory=dict)
    #: Event hubs whose stored checkpoints were read since the last failure.
    fetched: set[str] = field(default_factory=set)
    #: The checkpoint's partitions with nothing processed (a rewind names their checkpoints).
    unset: set[tuple[str, int]] = field(default_factory=set)
    #: A deliberate rewind not yet written (it lowers what the store holds).
    rewind: positions.Rewind | None = None
    #: Partitions another writer lowered since we knew them: not raised again by ``wanted``.
    held: set[tuple[str, int]] = field(default_factory=set)


class EventHubsCheckpointer:
    """Owns the write loop and each group's state; the blobs are the store's."""

    #: The stop's words for its final write, and for a group it did not bring to the query's
    #: last durable batch (``sidecar.daemon.app``).
    FINAL = "final Event Hubs checkpoints"
    NOT_DONE = "checkpointed"

    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        store: CheckpointBlobs,
        *,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        """``clock``, ``jitter``: of the retries (a simulation's: virtual time, no
        randomness)."""
        if not config.eventhubs_namespace:
            raise ValueError("EventHubsCheckpointer needs SIDECAR_EVENTHUBS_NAMESPACE")
        self._config = config
        self._namespace = config.eventhubs_namespace
        self._container = config.eventhubs_container or config.container
        self._metrics = metrics
        self._store = store
        self._backoff = Retries(0.5, RETRY_CAP_S, clock=clock, jitter=jitter)
        # By group name: a query restarted under the same name (new id) shares its group.
        self._groups: dict[str, _Group] = {}
        self._wake = anyio.Event()
        self._limiter = anyio.CapacityLimiter(WRITES_IN_FLIGHT)
        self._retiring: set[str] = set()
        self._loop = anyio.CancelScope()
        #: The loop's passes so far (tests wait on it, not on a fixed time).
        self.passes = 0
        self._loop_done = anyio.Event()

    def durable(self, checkpoint: Checkpoint, *, rewind: str | None = None) -> None:
        """A checkpoint is now in the blob: write its Event Hubs positions (non-blocking).
        ``rewind``: why the query was moved back on purpose (a reset by the daemon, whose
        document is now in the blob): its positions are written even where lower."""
        ends = eventhubs_offsets(checkpoint)
        wanted, unset = eh.processed(ends), eh.unprocessed(ends)
        if not wanted and not (rewind is not None and unset):
            return
        name = eh.consumer_group(
            self._config.eventhubs_consumer_group_template, checkpoint, self._config.namespace
        )
        group = self._groups.get(name)
        if group is None:
            group = self._groups[name] = _Group(name, checkpoint, wanted)
        else:
            if group.checkpoint.query_id != checkpoint.query_id:
                group.rewind = None  # another query under the same name: not its rewind
            group.checkpoint, group.wanted, group.dirty = checkpoint, wanted, True
        group.unset = unset
        group.held.clear()  # a newer durable checkpoint moves what another writer lowered
        if rewind is not None:
            group.rewind = positions.Rewind(rewind)
            group.fetched.clear()  # lower from what the store holds now, at its versions
        self._retiring.discard(checkpoint.query_id)
        self._wake.set()

    def forget(self, query_id: str) -> None:
        """A retired query: its groups are dropped between passes once written."""
        self._retiring.add(query_id)
        self._wake.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Write what is durable, every tick or when woken, until cancelled. Never raises for
        the store's sake: every failure is logged, counted and retried."""
        log.info(
            "Event Hubs checkpoints on: namespace %s, container %s, consumer group %r",
            self._namespace,
            self._container,
            self._config.eventhubs_consumer_group_template,
        )
        task_status.started()
        try:
            with self._loop:
                while True:
                    with anyio.move_on_after(TICK_S):
                        await self._wake.wait()
                    self._wake = anyio.Event()
                    self._retire()
                    async with anyio.create_task_group() as tg:
                        for group in self._groups.values():
                            if group.dirty and self._backoff.ready(group.name):
                                tg.start_soon(self._write, group)
                    self.passes += 1
        finally:
            self._loop_done.set()

    async def stop_loop(self) -> None:
        """Stop the loop and wait for it (a write in progress is cancelled), so the final
        write never races it."""
        self._loop.cancel()
        await self._loop_done.wait()

    async def final_commit(self) -> None:
        """Write every group's durable positions not yet written (shutdown, after
        :meth:`stop_loop`). A failure is logged; :meth:`behind` names it."""
        async with anyio.create_task_group() as tg:
            for group in self._groups.values():
                if group.dirty:
                    tg.start_soon(self._write, group)

    def behind(self) -> list[str]:
        """The groups whose checkpoints are not their query's last durable batch."""
        return [group.name for group in self._groups.values() if group.dirty]

    async def aclose(self) -> None:
        """Nothing to close: the blobs are the store's, closed with it."""

    def _retire(self) -> None:
        if not self._retiring:
            return
        for name, group in list(self._groups.items()):
            if group.checkpoint.query_id in self._retiring and not group.dirty:
                del self._groups[name]
                self._backoff.forget(name)
        self._retiring = {g.checkpoint.query_id for g in self._groups.values()} & self._retiring

    async def _write(self, group: _Group) -> None:
        m = self._metrics
        checkpoint = group.checkpoint
        label = checkpoint.label
        # Replaced, never changed, by a newer durable checkpoint (or rewind) meanwhile.
        wanted, rewind = group.wanted, group.rewind
        done: list[tuple[str, int]] = []
        todo = eh.Plan({})
        try:
            hubs = {key[0] for key in wanted}
            if rewind is not None:  # it names the checkpoints it cannot lower
                hubs |= {key[0] for key in group.unset}
            for eventhub in sorted(hubs - group.fetched):
                prefix = eh.prefix(self._namespace, eventhub, group.name)
                listed = await self._store.eventhubs_checkpoints(self._container, prefix)
                self._learn(group, eventhub, listed)
                group.fetched.add(eventhub)
            todo = eh.plan(
                wanted,
                group.stored,
                rewind=rewind is not None,
                held=group.held,
                unset=group.unset,
            )
            if todo.held:
                log.info(
                    "eventhubs group=%s query=%s batch=%d: %d partition(s) lowered by another "
                    "writer since they were listed (a reset elsewhere?), left as it set them "
                    "until this query's next durable batch: %s",
                    group.name,
                    label,
                    checkpoint.batch_id,
                    len(todo.held),
                    positions.described(todo.held),
                )
            if todo.lowered:
                m.eventhubs_checkpoints.labels("regressed").inc()
                m.eventhubs_partitions_skipped.inc(len(todo.lowered))
                log.warning(
                    "eventhubs group=%s query=%s batch=%d: not checkpointing %d partition(s) "
                    "backwards (query reset?): %s",
                    group.name,
                    label,
                    group.checkpoint.batch_id,
                    len(todo.lowered),
                    positions.described(todo.lowered),
                )
            await self._write_all(group, todo.write, done)
        except Exception as exc:  # translated by the store, or a bug: never fatal
            group.fetched.clear()  # read the store's view again before the next write
            m.eventhubs_checkpoints.labels("error").inc()
            m.eventhubs_up.set(0)
            self._failed(group.name, f"eventhubs group={group.name} query={label} write", exc)
            self._rewound(group, checkpoint, rewind, todo, done)  # what did land, said
            return
        if group.wanted is wanted:
            group.dirty = False
        if rewind is not None and group.rewind is rewind:
            group.rewind = None  # written; a newer rewind given meanwhile stays
        self._rewound(group, checkpoint, rewind, todo, done)
        self._backoff.succeeded(group.name)
        m.eventhubs_up.set(1)
        if todo.write:
            m.eventhubs_checkpoints.labels("ok").inc()
            log.debug(
                "eventhubs group=%s query=%s batch=%d: checkpointed %d partition(s)",
                group.name,
                label,
                group.checkpoint.batch_id,
                len(todo.write),
            )

    def _rewound(
        self,
        group: _Group,
        checkpoint: Checkpoint,
        rewind: positions.Rewind | None,
        todo: eh.Plan,
        done: list[tuple[str, int]],
    ) -> None:
        """Say what a rewind's write lowered on purpose (one WARNING line, counted), and what
        it could not (partitions with nothing processed keep their checkpoint)."""
        if rewind is None:
            return
        lowered = [move for move in todo.rewound if move.key in set(done)]
        if not lowered and not todo.kept:
            return
        if lowered:
            self._metrics.eventhubs_checkpoints.labels("rewound").inc()
        kept = (
            f"; {len(todo.kept)} partition(s) not lowered, nothing processed at the target (no "
            f"checkpoint can say so: delete those blobs to start a processor over): "
            f"{', '.join(todo.kept[:5])}"
            if todo.kept
            else ""
        )
        log.warning(
            "eventhubs group=%s query=%s batch=%d: %d partition(s) lowered on purpose, a "
            "deliberate rewind (%s): %s%s",
            group.name,
            checkpoint.label,
            checkpoint.batch_id,
            len(lowered),
            rewind.why,
            positions.described(lowered) or "none",
            kept,
        )

    def _learn(
        self, group: _Group, eventhub: str, listed: Mapping[str, tuple[str | None, str]]
    ) -> None:
        """Take the store's checkpoints of one event hub as what it holds now, with their
        versions (a partition's number unreadable: written over, as a new consumer would);
        partitions another writer lowered since we knew them are held."""
        before = {k: n for k, n in group.stored.items() if k[0] == eventhub}
        for key in before:
            del group.stored[key]
        for key in [k for k in group.versions if k[0] == eventhub]:
            del group.versions[key]
        for partition, (text, version) in listed.items():
            if not (partition.isascii() and partition.isdigit()):
                continue
            key = (eventhub, int(partition))
            group.versions[key] = version
            number = eh.parse_stored(text)
            if number is not None:
                group.stored[key] = number
        group.held |= positions.moved_since(before, group.stored)

    async def _write_all(
        self, group: _Group, write: eh.Positions, done: list[tuple[str, int]]
    ) -> None:
        """Write each partition's checkpoint, concurrently (bounded); what succeeded is
        remembered (and added to ``done``) even when another partition failed, whose error is
        then raised."""
        errors: list[Exception] = []

        async def one(key: tuple[str, int], number: int) -> None:
            name = eh.blob_name(self._namespace, key[0], group.name, key[1])
            async with self._limiter:
                try:
                    version = await self._store.write_eventhubs_checkpoint(
                        self._container, name, eh.metadata(number), group.versions.get(key)
                    )
                except VersionConflict as exc:
                    # Another writer (an old pod's late commit, a twin, a reset elsewhere):
                    # list the hub again; the next pass never lowers what it finds.
                    self._metrics.write_conflicts.labels("eventhubs").inc()
                    group.fetched.discard(key[0])
                    errors.append(exc)
                    return
                except Exception as exc:  # collected: the first is raised below
                    errors.append(exc)
                    return
            group.stored[key], group.versions[key] = number, version
            group.held.discard(key)  # ours now
            done.append(key)

        async with anyio.create_task_group() as tg:
            for key, number in write.items():
                tg.start_soon(one, key, number)
        if errors:
            raise errors[0]

    def _failed(self, key: str, what: str, exc: Exception) -> None:
        self._backoff.log_failure(key, what, exc, log)


async def rewind_once(
    config: Config, store: CheckpointBlobs, checkpoint: Checkpoint, why: str
) -> dict[str, bool]:
    """A deliberate rewind written now, without a daemon (the CLI's reset under a lease of
    its own): ``checkpoint``'s Event Hubs checkpoints set to its positions, lowered on purpose
    where lower and logged as the daemon does. Each consumer group → whether it was written
    (a failure is logged, never raised)."""
    checkpointer = EventHubsCheckpointer(config, Metrics(), store)
    checkpointer.durable(checkpoint, rewind=why)
    await checkpointer.final_commit()
    behind = set(checkpointer.behind())
    return {name: name not in behind for name in checkpointer._groups}
