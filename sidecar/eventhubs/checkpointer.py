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

The loop, the rewind's bookkeeping, the backoff and the log lines are the Kafka committer's
(``sidecar.sinks``); this module is their Event Hubs edge: listing and writing a group's
checkpoint blobs through the store.

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

from sidecar.config import Config
from sidecar.errors import VersionConflict
from sidecar.eventhubs import plan as eh
from sidecar.model import positions
from sidecar.model.checkpoint import Checkpoint
from sidecar.model.offsets import eventhubs_offsets
from sidecar.sinks.loop import Attempt, SinkGroup, SinkLoop
from sidecar.sinks.report import Reporter, Words
from sidecar.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

TICK_S = 1.0
RETRY_CAP_S = 30.0
#: How its log lines name it and a group's write.
WORDS = Words("eventhubs", "write", "checkpointing", "checkpointed")
#: Checkpoint blobs written at once (one Set Blob Metadata each), over all groups.
WRITES_IN_FLIGHT = 16
#: Why a held partition is left, in its line.
_HELD = "lowered by another writer since they were listed (a reset elsewhere?)"


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
class _Group(SinkGroup[str]):
    """One query's consumer group and what we know of its checkpoints (``wanted``: the last
    sequence number processed per partition; ``fetched``: event hubs whose stored checkpoints
    were read since the last failure)."""

    #: What the store holds, as far as we know (listed, then what we wrote).
    stored: dict[tuple[str, int], int] = field(default_factory=dict)
    #: The version of each partition's blob as listed or written (absent: no blob), which
    #: the next write of it names: a blob another writer changed meanwhile is never
    #: overwritten blind (listed again instead, and never lowered).
    versions: dict[tuple[str, int], str] = field(default_factory=dict)
    #: The checkpoint's partitions with nothing processed (a rewind names their checkpoints).
    unset: set[tuple[str, int]] = field(default_factory=set)


class EventHubsCheckpointer(SinkLoop[_Group]):
    """Owns each group's view of its checkpoints; the loop is ``sinks.loop``'s, the blobs the
    store's (nothing to close: closed with it)."""

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
        reporter = Reporter(
            log,
            WORDS,
            metrics.eventhubs_checkpoints,
            metrics.eventhubs_partitions_skipped,
            metrics.eventhubs_up,
        )
        super().__init__(
            reporter, _Group, tick_s=TICK_S, retry_cap_s=RETRY_CAP_S, clock=clock, jitter=jitter
        )
        self._config = config
        self._namespace = config.eventhubs_namespace
        self._container = config.eventhubs_container or config.container
        self._metrics = metrics
        self._store = store
        self._limiter = anyio.CapacityLimiter(WRITES_IN_FLIGHT)

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
        self._take(name, checkpoint, wanted, rewind).unset = unset

    async def _prepare(self) -> None:
        log.info(
            "Event Hubs checkpoints on: namespace %s, container %s, consumer group %r",
            self._namespace,
            self._container,
            self._config.eventhubs_consumer_group_template,
        )

    async def _write(self, group: _Group, attempt: Attempt) -> None:
        await self._list(group, attempt)
        todo = eh.plan(
            attempt.wanted,
            group.stored,
            rewind=attempt.rewind is not None,
            held=group.held,
            unset=group.unset,
        )
        attempt.rewound = todo.rewound
        if todo.kept:
            attempt.kept = (
                f"; {len(todo.kept)} partition(s) not lowered, nothing processed at the target "
                f"(no checkpoint can say so: delete those blobs to start a processor over): "
                f"{', '.join(todo.kept[:5])}"
            )
        self._report.backwards(group.name, attempt.checkpoint, todo.lowered)
        self._report.held(group.name, attempt.checkpoint, todo.held, why=_HELD)
        await self._write_all(group, todo.write, attempt.done)

    async def _list(self, group: _Group, attempt: Attempt) -> None:
        """Read the stored checkpoints of the event hubs ``attempt`` writes that were not read
        since the last failure (or rewind)."""
        hubs = {key[0] for key in attempt.wanted}
        if attempt.rewind is not None:  # it names the checkpoints it cannot lower
            hubs |= {key[0] for key in group.unset}
        for eventhub in sorted(hubs - group.fetched):
            prefix = eh.prefix(self._namespace, eventhub, group.name)
            listed = await self._store.eventhubs_checkpoints(self._container, prefix)
            self._learn(group, eventhub, listed)
            group.fetched.add(eventhub)

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
        self, group: _Group, write: eh.Positions, done: set[tuple[str, int]]
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
            done.add(key)

        async with anyio.create_task_group() as tg:
            for key, number in write.items():
                tg.start_soon(one, key, number)
        if errors:
            raise errors[0]


async def rewind_once(
    config: Config, store: CheckpointBlobs, checkpoint: Checkpoint, why: str
) -> dict[str, bool]:
    """A deliberate rewind written now, without a daemon (the CLI's reset under a lease of
    its own): ``checkpoint``'s Event Hubs checkpoints set to its positions, lowered on purpose
    where lower and logged as the daemon does. Each consumer group → whether it was written
    (a failure is logged, never raised)."""
    return await EventHubsCheckpointer(config, Metrics(), store).rewind_once(checkpoint, why)
