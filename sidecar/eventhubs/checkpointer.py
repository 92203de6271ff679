"""Write Spark's durable Event Hubs positions as Event Hubs checkpoints, after each blob write.

Spark's Event Hubs connector keeps its position in Spark's checkpoint directory only, so KEDA's
Event Hubs scaler, lag dashboards and the SDKs' processors see a Spark job as a consumer that
never checkpointed. The daemon holds every Event Hubs source's sequence numbers; after each
successful blob write it writes them as checkpoints of a consumer group, in the layout the
SDKs' ``BlobCheckpointStore`` uses (``sidecar.eventhubs.plan``).

Invariants (those of the Kafka committer, ``sidecar.kafka.committer``):
- only positions that are **durable in the blob** are written (the flusher calls
  :meth:`EventHubsCheckpointer.durable` after a write, never before);
- a partition's checkpoint **never goes backwards**: the store's checkpoints of a group are
  read before its first write (and again after any failure), and a write that would lower a
  partition's sequence number is skipped for that partition and counted;
- the store never blocks flushing: writes are retried with backoff, 0.5 s doubling to 30 s,
  an error that is not ``retriable`` (a missing container, a refused credential) waiting the
  30 s cap at once; anything unexpected is contained, logged once with its traceback.

Unlike Kafka's groups, checkpoint blobs do not expire, so nothing is re-written while idle: a
pass writes only the partitions whose sequence number moved.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import anyio
from anyio.abc import TaskStatus

from sidecar.backoff import Retries
from sidecar.config import Config
from sidecar.errors import VersionConflict
from sidecar.eventhubs import plan as eh
from sidecar.model.checkpoint import Checkpoint
from sidecar.model.offsets import eventhubs_offsets
from sidecar.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

TICK_S = 1.0
RETRY_CAP_S = 30.0
#: Checkpoint blobs written at once (one Set Blob Metadata each), over all groups.
WRITES_IN_FLIGHT = 16


class CheckpointBlobs(Protocol):
    """What the checkpointer needs of the store (``sidecar.store.blobs.BlobStore``)."""

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


class EventHubsCheckpointer:
    """Owns the write loop and each group's state; the blobs are the store's."""

    def __init__(self, config: Config, metrics: Metrics, store: CheckpointBlobs) -> None:
        if not config.eventhubs_namespace:
            raise ValueError("EventHubsCheckpointer needs SIDECAR_EVENTHUBS_NAMESPACE")
        self._config = config
        self._namespace = config.eventhubs_namespace
        self._container = config.eventhubs_container or config.container
        self._metrics = metrics
        self._store = store
        self._backoff = Retries(0.5, RETRY_CAP_S)
        # By group name: a query restarted under the same name (new id) shares its group.
        self._groups: dict[str, _Group] = {}
        self._wake = anyio.Event()
        self._limiter = anyio.CapacityLimiter(WRITES_IN_FLIGHT)
        self._retiring: set[str] = set()
        self._loop = anyio.CancelScope()
        #: The loop's passes so far (tests wait on it, not on a fixed time).
        self.passes = 0
        self._loop_done = anyio.Event()

    def durable(self, checkpoint: Checkpoint) -> None:
        """A checkpoint is now in the blob: write its Event Hubs positions (non-blocking)."""
        wanted = eh.processed(eventhubs_offsets(checkpoint))
        if not wanted:
            return
        name = eh.consumer_group(
            self._config.eventhubs_consumer_group_template, checkpoint, self._config.namespace
        )
        group = self._groups.get(name)
        if group is None:
            self._groups[name] = _Group(name, checkpoint, wanted)
        else:
            group.checkpoint, group.wanted, group.dirty = checkpoint, wanted, True
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
        label = group.checkpoint.label
        wanted = group.wanted  # replaced, never changed, by a newer durable checkpoint
        try:
            for eventhub in sorted({key[0] for key in wanted} - group.fetched):
                prefix = eh.prefix(self._namespace, eventhub, group.name)
                listed = await self._store.eventhubs_checkpoints(self._container, prefix)
                self._learn(group, eventhub, listed)
                group.fetched.add(eventhub)
            todo = eh.plan(wanted, group.stored)
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
                    ", ".join(todo.lowered[:5]),
                )
            await self._write_all(group, todo.write)
        except Exception as exc:  # translated by the store, or a bug: never fatal
            group.fetched.clear()  # read the store's view again before the next write
            m.eventhubs_checkpoints.labels("error").inc()
            m.eventhubs_up.set(0)
            self._failed(group.name, f"eventhubs group={group.name} query={label} write", exc)
            return
        if group.wanted is wanted:
            group.dirty = False
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

    def _learn(
        self, group: _Group, eventhub: str, listed: Mapping[str, tuple[str | None, str]]
    ) -> None:
        """Take the store's checkpoints of one event hub as what it holds now, with their
        versions (a partition's number unreadable: written over, as a new consumer would)."""
        for key in [k for k in group.stored if k[0] == eventhub]:
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

    async def _write_all(self, group: _Group, write: eh.Positions) -> None:
        """Write each partition's checkpoint, concurrently (bounded); what succeeded is
        remembered even when another partition failed, whose error is then raised."""
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

        async with anyio.create_task_group() as tg:
            for key, number in write.items():
                tg.start_soon(one, key, number)
        if errors:
            raise errors[0]

    def _failed(self, key: str, what: str, exc: Exception) -> None:
        self._backoff.log_failure(key, what, exc, log)
