"""The flush core proven by simulation (FoundationDB's and TigerBeetle's simulators, in small).

A Hypothesis state machine drives the real daemon parts between the socket and the blob —
the request handler and its write coalescer, the flusher and its loop, each query's blob
state (``sidecar.flush.blob_state`` around the pure ``sidecar.flush.core``), the lease
manager and its renewals, the admin ops and retirement — with fakes only at the two SDK
edges: fakeredis running the real Lua scripts behind the real ``RedisBuffer``, and an
in-memory blob store with Azure's lease rules (``tests.unit.fakes``). Everything runs on a
virtual-time event loop (``tests.unit.simloop``), so minutes of leases and backoffs pass in
milliseconds and every run of the same steps interleaves the same way.

Steps, in any order: updates (new batches and resends, acknowledged once in Redis or once in
the blob), gets, time passing, the store slow, down, or timing out a write that did land, the
store losing its last writes (one blob restored to an older version, or every blob as after a
crash), a lease broken or taken by another owner (who may flush, or reset, too), a twin on its
own Redis resetting a query, Redis down or emptied, resets and retirements, and the daemon
restarted (cleanly, or killed). Checked after every step (the invariants written at the top of
``sidecar.flush.core``):

- no blob, Redis record or ``get`` answer moves backwards, except by a reset, a retirement,
  Redis losing its data or the store losing writes;
- a blob-mode ack is answered only when its batch is (or was, since it began) in the blob, or
  was in it before the store lost it (what the daemon knew then it can learn is gone only by
  reading the blob again);
- a reset is never undone: after it, only batches applied after it are written;
- a write is made only by the lease holder, as its lease manager sees it;
- a Kafka group's committed offset or an Event Hubs checkpoint moves back only as a reset's
  rewind landing (after the daemon's reset told its durable hooks: to the reset's target, or
  a batch the blob took since), once; after that it holds only such batches: nothing from
  before the reset raises it again;

and once the faults stop (at the end of each run), every acknowledged batch reaches the blob
(also after the store lost it, idle or not; unless a twin's reset holds the blob, which the
daemon then reports and never writes over),
every ack whose batch is in the blob is answered, and the groups of each reset hold its target
or a batch since (unless the daemon told of it was restarted: a kill before its commit loses
the rewind, docs/kafka.md; nor an Event Hubs checkpoint for a reset to batch 0, which no
checkpoint can say).

``make test`` runs a few hundred examples; ``make simulate`` many more
(``SIMULATION_EXAMPLES``). Each defect found stays below as an ``@example``-style test.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import anyio
import fakeredis
import msgspec
import pytest
from aiokafka.structs import OffsetAndMetadata, TopicPartition
from fakeredis.commands_mixins import server_mixin
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sidecar import backoff as grid
from sidecar.backoff import Backoff
from sidecar.buffer.lua import NO_BLOB
from sidecar.buffer.redis_buffer import RedisBuffer
from sidecar.config import Config
from sidecar.daemon.admin_ops import DaemonAdmin
from sidecar.daemon.retirement import Retirement
from sidecar.errors import NotOwner, SidecarError, StoreUnavailable, VersionConflict
from sidecar.eventhubs.checkpointer import EventHubsCheckpointer
from sidecar.flush.blob_state import RETRY_BASE_S, RETRY_CAP_S
from sidecar.flush.lease import LeaseState
from sidecar.flush.owner import FlushOwner
from sidecar.ingest.coalescer import WriteCoalescer
from sidecar.ingest.handler import RequestHandler
from sidecar.kafka import client as kafka_client
from sidecar.kafka.committer import KafkaCommitter
from sidecar.model import checkpoint as ckpt
from sidecar.model.document import (
    CheckpointDocument,
    Stored,
    Writer,
    decode_document,
    encode_document,
    reset_document,
)
from sidecar.model.offsets import EVENTHUBS_SOURCE_PREFIXES
from sidecar.store.blobs import BlobStore
from sidecar.telemetry.metrics import Metrics
from sidecar.wire.protocol import ClientConnection, Get, Progress, Reset, Retire, SourceSpec
from tests.unit.fakes import WRITER, FakeBlobStore, FakeKafkaConsumer, Lease, checkpoint
from tests.unit.simloop import VirtualTimeLoop

QUERIES = ("q1", "q2")
NS = "sim"
LEASE_S = 15
CONFIG = Config(
    namespace=NS,
    count_threshold=3,
    time_threshold_s=5,  # Redis' clock is the virtual one (VirtualWallClock)
    flush_interval_s=0.5,
    flush_concurrency=4,
    history_size=4,
    lease_duration_s=LEASE_S,
    admin_ops=True,
)
#: The durable hooks' settings (Kafka commits, Event Hubs checkpoints).
HOOKS = Config(
    namespace=NS,
    kafka_bootstrap_servers="sim:9092",
    eventhubs_namespace="sim.servicebus.windows.net",
)
#: The Event Hubs checkpoints' blob name prefix, up to the consumer group.
HUB_GROUP = "sim.servicebus.windows.net/hub/"
EXAMPLES = int(os.environ.get("SIMULATION_EXAMPLES", "150"))
#: The period of the store's audit against Redis (``Flusher``'s ``audit_every_s``): below
#: the time the end of a run lets pass, so a blob that went back while nobody held its lease
#: is found before the final checks.
AUDIT_S = 20.0
T = TypeVar("T")
#: Redis' wall clock at the virtual loop's time 0.
EPOCH_S = 1_800_000_000.0


#: The loop passes a read of Redis by a new asyncio client takes here (connect, ``HGET``,
#: close: 17, ``_loop_passes`` counts its own first and last).
ROUND_TRIP_PASSES = 15


async def _loop_passes(n: int) -> None:
    """Yield to the loop ``n`` times: what is ready runs, the clock does not move."""
    for _ in range(n):
        await asyncio.sleep(0)


#: Where the periodic loops may tick (``sidecar.backoff.next_tick``'s phase, which a daemon
#: draws at random): each example draws one, so the same steps always interleave the same way
#: and the search still tries the loops' ticks at different places (a run that drew one phase
#: for all its examples met a case 1 time in 12).
GRID_PHASES = tuple(i / 20 for i in range(20))


def CHECK_CPU() -> float:
    """The flush loop's CPU time as the simulation's daemons read it: constant."""
    return 0.0


class VirtualWallClock:
    """What fakeredis reads as ``time`` for ``TIME``: the virtual loop's clock, as wall time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def time(self) -> float:
        return EPOCH_S + self._loop.time()


class SimStore(FakeBlobStore):
    """The fake blob store, watched: every value each blob takes, and the safety rules."""

    def __init__(self, sim: FlushSimulation) -> None:
        super().__init__(clock=lambda: sim.now)
        self.sim = sim
        #: Each query's blob batches, in the order the blob took them.
        self.history: dict[str, list[int]] = {q: [] for q in QUERIES}
        #: Queries a reset may lower right now.
        self.lowering: set[str] = set()
        #: The next write lands, then its call fails as if it timed out.
        self.time_out_next_write = False
        #: How long each call takes (virtual seconds): flushes and admin ops overlap.
        self.latency_s = 0.0
        #: The next write is held in the network: its call times out at once, the request
        #: lands later (or is refused) when :meth:`deliver_held` sends it on.
        self.hold_next_write = False
        self.held: list[tuple[str, bytes, str, str]] = []
        #: Each blob's states (body, version), oldest first: what losing writes goes back to.
        self.states: dict[str, list[tuple[bytes, str]]] = {}
        #: The highest batch each blob lost to the store going back, and the lowest batch it
        #: held after such a loss (NO_BLOB: none): groups may come down to it.
        self.lost: dict[str, int] = {}
        self.kept_after_loss: dict[str, int] = {}

    def _set(self, query_id: str, body: bytes) -> str:
        version = super()._set(query_id, body)
        self.states.setdefault(query_id, []).append((body, version))
        return version

    def lose_writes(self, query_id: str, back: int) -> None:
        """The blob goes back ``back`` writes (a store that lost them: a crash, a failover,
        a restore of an older version), to the body and version it had then; its lease stays.
        A reset's own write lost with them leaves its target in Redis as flushed: the daemon
        may write it back (``FlushSimulation.reset_target``)."""
        states = self.states.get(query_id, [])
        if back <= 0 or len(states) < 2:
            return
        target = self.sim.reset_target.get(query_id)
        allowed = self.sim.since_reset[query_id]
        if target is not None and allowed is not None:
            allowed.add(target)
        before = self.batch(query_id)
        del states[max(1, len(states) - back) :]
        self.bodies[query_id], self.versions[query_id] = states[-1]
        after = self.batch(query_id)
        doc = self.document(query_id)
        if query_id in self.sim.unrecorded and (doc is None or doc.reset_reason != "twin"):
            # The twin's reset lost with the rest: only our Redis' word is left, as if it had
            # never been made (the store itself undid it).
            self.sim.unrecorded.discard(query_id)
            self.sim.since_reset[query_id] = None
            watch = self.sim.rewinds.get(query_id)
            if watch is not None and watch.daemon is not self.sim.daemon:  # the twin's rewind
                del self.sim.rewinds[query_id]
        if before is not None and (after is None or after < before):
            self.lost[query_id] = max(self.lost.get(query_id, before), before)
            kept = NO_BLOB if after is None else after
            self.kept_after_loss[query_id] = min(self.kept_after_loss.get(query_id, kept), kept)
            self.lowering.add(query_id)
            self._took(query_id, NO_BLOB if after is None else after, "lost")
        elif after is not None and after != before:
            # Back to a higher batch (a reset's write lost): the blob holds it again. What
            # an ack is checked against (a read finds it there).
            self.history[query_id].append(after)
            self.lowering.discard(query_id)

    async def _slow(self) -> None:
        if self.latency_s:
            await asyncio.sleep(self.latency_s)

    def _took(self, query_id: str, batch: int, writer: str) -> None:
        seen = self.history[query_id]
        if seen and batch < seen[-1] and query_id not in self.lowering:
            self.sim.violations.append(f"blob {query_id} moved back {seen[-1]} -> {batch}")
        seen.append(batch)
        self.sim.wrote(query_id, batch, writer)

    async def write(
        self, query_id: str, body: bytes, *, lease_id: str, query_name: str | None, version: str
    ) -> str:
        for daemon in self.sim.live_daemons():
            held = daemon.leases.state(query_id) is LeaseState.HELD
            if lease_id == daemon.lease_id and not held:
                self.sim.violations.append(f"write of {query_id} without a HELD lease")
        await self._slow()
        if self.hold_next_write:
            self.hold_next_write = False
            self.held.append((query_id, body, lease_id, version))
            raise StoreUnavailable("sim: write timed out (held in the network)")
        written = await super().write(
            query_id, body, lease_id=lease_id, query_name=query_name, version=version
        )
        self._took(query_id, self.writes[-1][1], lease_id)
        if self.time_out_next_write:
            self.time_out_next_write = False
            raise StoreUnavailable("sim: write timed out (it landed)")
        return written

    async def read_stored(self, query_id: str) -> Stored:
        await self._slow()
        return await super().read_stored(query_id)

    async def acquire_lease(self, query_id: str, lease_id: str, duration_s: int) -> str | None:
        await self._slow()
        return await super().acquire_lease(query_id, lease_id, duration_s)

    async def deliver_held(self) -> None:
        """The held requests reach the store now, with their lease id and version: each
        lands only if both still hold (If-Match)."""
        held, self.held = self.held, []
        for query_id, body, lease_id, version in held:
            doc = decode_document(body, query_id, query_id)
            # A reset's own document, landing late: the reset itself (it lowers, on purpose).
            reset = doc is not None and doc.reset_at == doc.written_at
            if reset:
                self.lowering.add(query_id)
            try:
                await FakeBlobStore.write(
                    self, query_id, body, lease_id=lease_id, query_name=None, version=version
                )
                self._took(query_id, self.writes[-1][1], "late reset" if reset else "late")
            except SidecarError:
                continue  # refused: lease or version
            finally:
                if reset:
                    self.lowering.discard(query_id)

    def put(self, query_id: str, batch: int) -> None:
        """Another owner's flush of Redis' batch (the query's name kept: its groups)."""
        doc = CheckpointDocument.of(checkpoint(query_id, batch, name=f"name-{query_id}"), WRITER)
        self._set(query_id, encode_document(doc))
        self._took(query_id, batch, "thief")

    def put_document(self, query_id: str, doc: CheckpointDocument) -> None:
        """Write ``doc`` as another owner would (no lease checked)."""
        self._set(query_id, encode_document(doc))
        self._took(query_id, doc.batch_id, "thief")

    def document(self, query_id: str) -> CheckpointDocument | None:
        return decode_document(self.bodies.get(query_id, b""), query_id, query_id)

    def blob_name(self, query_id: str) -> str:
        return f"{NS}/{query_id}.json"


@dataclass
class RewindWatch:
    """A reset whose daemon told its durable hooks (a deliberate rewind of its query's
    groups): what the groups may hold from then on."""

    #: The reset's batch.
    target: int
    #: Batches a group may hold now: the target, then those the blob took since the reset
    #: (only durable batches are committed; a newer one may carry the rewind down, too).
    allowed: set[int]
    #: The daemon told: the groups must follow unless it is restarted first (a kill before
    #: its commit loses the rewind, docs/kafka.md).
    daemon: SimDaemon
    #: The positions (Kafka partitions, Event Hubs checkpoints) the rewind has reached.
    landed: set[str] = field(default_factory=set)


def position_landed(
    sim: FlushSimulation, key: str, query: str, before: int | None, at: int
) -> None:
    """A group's position (as a batch: Kafka's offset, an Event Hubs sequence number + 1)
    moves from ``before`` to ``at``. It goes down only as a reset's rewind landing (once, to a
    batch of that reset's), and once the rewind landed it holds only that reset's batches:
    nothing from before the reset raises it again. Or it goes down to a batch the blob
    still held after the store lost writes: the batch it was committed for is gone with them,
    and a daemon whose Redis never had it (the twin's) writes and commits what it has."""
    watch = sim.rewinds.get(query)
    ours = watch is not None and at in watch.allowed
    landed = watch.landed if watch is not None else set()
    store_lost = at >= sim.store.kept_after_loss.get(query, at + 1)
    if before is not None and at < before and not (ours and key not in landed) and not store_lost:
        sim.violations.append(f"{key} lowered {before} -> {at}")
    elif watch is not None and key in landed and not ours:
        sim.violations.append(
            f"{key} raised to {at} over a reset to {watch.target} "
            f"(its batches: {sorted(watch.allowed)})"
        )
    if ours:
        landed.add(key)


def query_of(group: str) -> str:
    """The query of a group name (``spark-name-q1``)."""
    return group.rsplit("-", 1)[-1]


class SimEventHubs:
    """The store's Event Hubs calls over a dict, with versions, watched: a sequence number
    goes down only by a reset through the daemon (``position_landed``). A write takes the
    store's latency, checked against the version when it lands."""

    def __init__(self, sim: FlushSimulation) -> None:
        self.sim = sim
        self.blobs: dict[str, tuple[int, str]] = {}  # name -> (sequence number, version)
        self._versions = itertools.count(1)

    async def eventhubs_checkpoints(
        self, container: str, prefix: str
    ) -> dict[str, tuple[str | None, str]]:
        return {
            name.rsplit("/", 1)[-1]: (str(number), version)
            for name, (number, version) in self.blobs.items()
            if name.startswith(prefix)
        }

    async def write_eventhubs_checkpoint(
        self, container: str, name: str, metadata: dict[str, str], version: str | None
    ) -> str:
        await self.sim.store._slow()
        known = self.blobs.get(name)
        if (known[1] if known else None) != version:
            raise VersionConflict(f"sim: {name} changed since it was listed")
        number = int(metadata["sequencenumber"])
        query = query_of(name.split("/")[2])
        before = known[0] + 1 if known is not None else None
        position_landed(self.sim, f"eventhubs {name}", query, before, number + 1)
        new = f"v{next(self._versions)}"
        self.blobs[name] = (number, new)
        return new


class SimKafka:
    """Consumer groups' committed offsets, watched (one goes down only by a reset through the
    daemon, ``position_landed``), and the consumer the committer opens on them
    (``sidecar.kafka.client.open_consumer``); its calls take the store's latency."""

    def __init__(self, sim: FlushSimulation) -> None:
        self.sim = sim
        self.committed: dict[tuple[str, str, int], int] = {}

    async def open_consumer(self, group: str, options: dict[str, Any]) -> SimConsumer:
        return SimConsumer(self, group)


class SimConsumer(FakeKafkaConsumer):
    def __init__(self, kafka: SimKafka, group: str) -> None:
        super().__init__()
        self.kafka, self.group = kafka, group

    async def committed(self, tp: TopicPartition) -> int | None:
        await self.kafka.sim.store._slow()
        return self.kafka.committed.get((self.group, tp.topic, tp.partition))

    async def commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        await self.kafka.sim.store._slow()  # in flight meanwhile; lands at once, all of it
        for tp, oam in offsets.items():
            key = (self.group, tp.topic, tp.partition)
            before = self.kafka.committed.get(key)
            where = f"kafka {key}"
            position_landed(self.kafka.sim, where, query_of(self.group), before, oam.offset)
            self.kafka.committed[key] = oam.offset

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: 1_000_000 for tp in tps}


def sources_of(c: ckpt.Checkpoint) -> ckpt.Checkpoint:
    """The simulation's checkpoint as a Kafka and an Event Hubs source would report it (the
    same end offset, the batch's): what the durable hooks commit."""
    end = ckpt.offset_value(c.sources[0].end_offset)
    kafka = ckpt.raw_offset({"events": {"0": end}})
    hub = ckpt.raw_offset({"hub": {"0": end}})
    return msgspec.structs.replace(
        c,
        sources=[
            ckpt.SourceOffsets("KafkaV2[Subscribe[events]]", kafka, kafka, kafka, 1),
            ckpt.SourceOffsets(EVENTHUBS_SOURCE_PREFIXES[0] + "@1", hub, hub, hub, 1),
        ],
    )


def reset_to(query: str, batch: int, reason: str) -> Reset:
    """``checkpoint-sidecar reset --offsets`` of ``query`` to ``batch`` (forced)."""
    return Reset(
        reason=reason,
        query_id=query,
        sources=(SourceSpec(end_offset=batch, description="rate"),),
        batch_id=batch,
        force=True,
    )


def answered(a: BlobAck) -> bool:
    """The ack's wait ended with an answer (durable or timed out), not not_owner."""
    return a.task.done() and not a.task.cancelled() and a.task.exception() is None


def not_owner(a: BlobAck) -> bool:
    return a.task.done() and not a.task.cancelled() and isinstance(a.task.exception(), NotOwner)


@dataclass
class BlobAck:
    query: str
    batch: int
    #: Index into the blob's history when it began (what the blob held then).
    began: int
    task: asyncio.Task[bool]
    #: Owed an answer once faults stop and its batch is in the blob.
    owed: bool = True


class SimDaemon:
    """One daemon's parts between the socket and the blob, wired as ``sidecar.daemon.app``."""

    def __init__(
        self,
        sim: FlushSimulation,
        number: int,
        *,
        lease_id: str,
        blob_mode: bool,
        redis: fakeredis.FakeServer,
    ) -> None:
        """``lease_id``: its own, or (the same container restarted in its pod) its
        predecessor's; ``blob_mode``: ack_mode=blob's wiring (the rows each apply returns go
        to the blob state), else redis ack mode's (every row flushed is read from Redis)."""
        self.lease_id = lease_id
        clock = sim.loop.time
        self.metrics = Metrics()
        self.buffer = RedisBuffer("redis://sim", NS, client=fakeredis.FakeAsyncRedis(server=redis))
        # No randomness: the same steps must always interleave the same way.
        backoff = Backoff(RETRY_BASE_S, RETRY_CAP_S, clock=clock, jitter=lambda: 0.5)
        writer = Writer(host="sim", pid=number, instance_id=self.lease_id)
        # The durable hooks, as ``sidecar.daemon.app`` wires them: Kafka commits and Event
        # Hubs checkpoints of what is in the blob (fakes only at their client edges).
        # Their re-commits and retries count in virtual time too, without randomness.
        self.committer = KafkaCommitter(HOOKS, self.metrics, clock=clock, jitter=lambda: 0.5)
        self.eventhubs = EventHubsCheckpointer(
            HOOKS, self.metrics, sim.eventhubs, clock=clock, jitter=lambda: 0.5
        )

        def durable(c: ckpt.Checkpoint, rewind: str | None = None) -> None:
            if rewind is not None:  # a reset of ours: its groups may go down to it, once
                sim.rewinds[c.query_id] = RewindWatch(c.batch_id, {c.batch_id}, self)
            self.committer.durable(sources_of(c), rewind=rewind)
            self.eventhubs.durable(sources_of(c), rewind=rewind)

        # The store's audit within the time the end of a run lets pass once faults stop.
        self.flush = FlushOwner(
            msgspec.structs.replace(CONFIG, ack_mode="blob" if blob_mode else "redis"),
            self.buffer,
            cast(BlobStore, sim.store),
            self.metrics,
            writer,
            on_durable=durable,
            clock=clock,
            jitter=lambda: 0.5,
            backoff=backoff,
            audit_every_s=AUDIT_S,
            cpu_clock=CHECK_CPU,  # checks cost no CPU time: never spaced out by the load
        )
        self.leases = self.flush.leases
        self.retirement = Retirement(3600, release=self.flush.release, clock=clock)
        self.retirement.busy.append(self.flush.busy)
        self.retirement.forget.append(self.flush.forget)
        self.blob_mode = blob_mode
        self.coalescer = WriteCoalescer(self.flush)

        async def lookup_blob(query_id: str | None, name: str | None) -> bytes | None:
            doc = await sim.store.read(query_id) if query_id else None
            return ckpt.encode(doc.checkpoint()) if doc is not None else None

        async def blob_ack(query_id: str, batch: int, timeout_s: float) -> bool:
            return True  # the ack's wait is the simulation's own (``update``: ``BlobAck``)

        # ack_mode=blob's handler (its path before an ack: the floor read again), with the
        # wait for the blob left to the simulation, which watches when each ack is answered.
        self.handler = RequestHandler(
            self.coalescer,
            self.buffer,
            self.metrics,
            lookup_blob=lookup_blob,
            floors=self.flush,
            wait_durable=blob_ack if blob_mode else None,
        )
        # The fake serves every call the daemon's side of the admin ops makes.
        store = cast(BlobStore, sim.store)
        self.admin = DaemonAdmin(
            CONFIG,
            self.buffer,
            store,
            self.flush,
            self.retirement,
            self.metrics,
            writer,
            on_rewind=durable,
        )
        loop = sim.loop
        opened = anyio.Event()  # the store is open from the start
        opened.set()
        self.tasks = [
            loop.create_task(self.coalescer.run()),
            loop.create_task(self.flush.run(self.lease_id, opened)),
            loop.create_task(self.committer.run()),
            loop.create_task(self.eventhubs.run()),
        ]


class FlushSimulation(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.runner = asyncio.Runner(loop_factory=VirtualTimeLoop)
        self.loop = self.runner.get_loop()
        self.redis = fakeredis.FakeServer()
        #: Reads Redis for the checks without a client on the loop (one per read cost a quarter
        #: of the simulation's time); ``_loop_passes`` lets the loop run as that round trip did.
        self.observer = fakeredis.FakeRedis(server=self.redis)
        grid.GRID_PHASE_S = 0.0  # the daemon starts on it; settle moves it (GRID_PHASES)
        # Redis' clock (TIME, in the scripts) is the virtual one: time thresholds count in it.
        setattr(server_mixin, "time", VirtualWallClock(self.loop))  # noqa: B010
        self.violations: list[str] = []
        self.store = SimStore(self)
        self.eventhubs = SimEventHubs(self)
        self.kafka = SimKafka(self)
        self._open_consumer = kafka_client.open_consumer
        kafka_client.open_consumer = self.kafka.open_consumer  # type: ignore[assignment]
        self.daemons = 0
        self.daemon = self._start(lease_id="daemon-1", blob_mode=True)
        #: A second daemon with its own Redis and the same identity (a copied config, a second
        #: cluster): its own lease id, the same namespace and store.
        self.twin: SimDaemon | None = None
        self.twin_redis = fakeredis.FakeServer()
        self.next_batch = dict.fromkeys(QUERIES, 0)
        self.ids = 0
        #: Batches acknowledged as applied since the query's last reset, retirement or Redis
        #: loss: each must reach the blob once faults stop.
        self.acked: dict[str, set[int]] = {q: set() for q in QUERIES}
        #: Batches applied since the query's last reset (None: never reset): the only ones
        #: a write may carry after it.
        self.since_reset: dict[str, set[int] | None] = dict.fromkeys(QUERIES)
        #: The last batch Redis held and ``get`` answered, per query (for "never backwards").
        self.redis_batch: dict[str, int | None] = dict.fromkeys(QUERIES)
        self.got: dict[str, int | None] = dict.fromkeys(QUERIES)
        #: Blob-mode acks waiting for the blob.
        self.acks: list[BlobAck] = []
        #: The last reset of each query the daemon told its durable hooks of.
        self.rewinds: dict[str, RewindWatch] = {}
        #: Queries whose blob holds a reset of the twin's that our Redis never recorded.
        self.unrecorded: set[str] = set()
        #: The batch of each query's last reset recorded in our Redis (ours, or another
        #: owner's through it): its checkpoint is Redis' flushed one.
        self.reset_target: dict[str, int] = {}
        #: Queries whose last reset through ours set Redis but not the blob (the lease was
        #: lost meanwhile; the op failed, to be run again): until Redis moves on, get may
        #: answer the blob's batch, or Redis' target where the blob cannot be compared.
        self.half_reset: dict[str, int] = {}

    # --- plumbing --------------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.loop.time()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coro)

    def _start(
        self, *, lease_id: str, blob_mode: bool, redis: fakeredis.FakeServer | None = None
    ) -> SimDaemon:
        self.daemons += 1
        number = self.daemons

        async def start() -> SimDaemon:  # anyio's primitives are made on a running loop
            return SimDaemon(
                self, number, lease_id=lease_id, blob_mode=blob_mode, redis=redis or self.redis
            )

        return self.run(start())

    def live_daemons(self) -> list[SimDaemon]:
        return [self.daemon] if self.twin is None else [self.daemon, self.twin]

    def wrote(self, query_id: str, batch: int, writer: str) -> None:
        if query_id in self.rewinds:
            self.rewinds[query_id].allowed.add(batch)  # durable after the reset: committed
        allowed = self.since_reset[query_id]
        lowering = query_id in self.store.lowering
        # The twin's driver knows nothing of our resets: its batches are its own (and the
        # store's version check, not this rule, keeps it from writing below the blob).
        ours = writer not in ("thief", "late", "late reset", "lost")
        ours = ours and not writer.startswith("twin")
        if writer == "late" and allowed is not None and batch not in allowed and not lowering:
            self.violations.append(f"{query_id}: a late write of batch {batch} undid a reset")
        if ours and allowed is not None and batch not in allowed and not lowering:
            self.violations.append(f"{query_id}: batch {batch} written after a reset undid it")

    def _rid(self) -> int:
        self.ids += 1
        return self.ids

    async def _request(self, event: Progress | Get, daemon: SimDaemon | None = None) -> Any:
        data = await (await (daemon or self.daemon).handler.begin(event))
        return ClientConnection().receive_data(data)[0]

    def _forget_model(self, query_id: str) -> None:
        """A reset, retirement or Redis loss: what was acked before is not owed any more."""
        self.unrecorded.discard(query_id)
        self.reset_target.pop(query_id, None)
        self.half_reset.pop(query_id, None)
        self.acked[query_id].clear()
        self.got[query_id] = None
        self.redis_batch[query_id] = None

    def _lost_by_store(self, query_id: str) -> None:
        """The store went back on the query's blob. A ``get`` answer that neither Redis nor
        the blob holds any more is not owed: Redis had lost it, or the query was retired
        (its keys removed: the blob was its only copy), and the store has now lost it too.
        Only the daemon's memory would hold it, and memory is not durable (a restart loses
        it): a get below it replays a batch, it loses none. What Redis still holds stays
        owed: the daemon writes it back (its convergence is checked, not excused)."""
        got = self.got[query_id]
        if got is None:
            return
        connected, self.redis.connected = self.redis.connected, True  # down is not lost
        try:
            copies = (self._redis_batch(query_id), self.store.batch(query_id))
        finally:
            self.redis.connected = connected
        held = max((b for b in copies if b is not None), default=None)
        if held is None or held < got:
            self.got[query_id] = held

    def _redis_batch(self, query_id: str) -> int | None:
        """The batch Redis holds for the query (None: none, or Redis is down), after the loop
        ran what was ready for as many passes as a client's round trip takes: the kept cases'
        steps were found with the checks' reads letting the daemons run that far."""
        self.run(_loop_passes(ROUND_TRIP_PASSES))
        try:
            value = self.observer.hget(f"cps:{{{NS}}}:q:{query_id}", "batch_id")
        except Exception:
            return None
        return int(cast(bytes, value)) if value is not None else None

    # --- steps -------------------------------------------------------------------------------

    @initialize(phase=st.sampled_from(GRID_PHASES))
    def settle(self, phase: float = 0.0) -> None:
        grid.GRID_PHASE_S = phase  # every tick from the flusher's first check on
        self.run(asyncio.sleep(0.1))  # the loops start (the flusher's first check)

    @rule(query=st.sampled_from(QUERIES), back=st.integers(0, 3), blob_ack=st.booleans())
    def update(self, query: str, back: int, blob_ack: bool) -> None:
        """A micro-batch's progress (``back`` > 0: a resend of an older batch); with
        ``blob_ack``, answered in blob mode: once Redis answered, the reply waits for the blob
        (as the handler does; the wait goes on in the background)."""
        if back == 0:
            self.next_batch[query] += 1
        batch = max(0, self.next_batch[query] - back)
        c = checkpoint(query, batch, name=f"name-{query}")
        try:
            reply = self.run(self._request(Progress(self._rid(), c)))
        except SidecarError:
            return
        if reply.ok and reply.applied:
            if batch > self.half_reset.get(query, batch):
                del self.half_reset[query]  # Redis moved on: its target is no answer now
            self.acked[query].add(batch)
            allowed = self.since_reset[query]
            if allowed is not None:
                allowed.add(batch)
        if reply.ok and blob_ack and self.daemon.blob_mode:
            began = len(self.store.history[query]) - 1
            task = self.loop.create_task(self.daemon.flush.ack(query, batch, None))
            self.acks.append(BlobAck(query, batch, began, task))
            self.run(asyncio.sleep(0))

    @rule(query=st.sampled_from(QUERIES))
    def get(self, query: str) -> None:
        reply = self.run(self._request(Get(self._rid(), query)))
        if not reply.ok or reply.checkpoint is None:
            return
        batch = int(reply.checkpoint["batch_id"])
        before = self.got[query]
        if before is not None and batch < before and batch != self.half_reset.get(query):
            self.violations.append(f"get {query} moved back {before} -> {batch}")
        self.got[query] = batch

    @rule(seconds=st.sampled_from([0.1, 0.6, 2.0, 6.0, 20.0]))
    def time_passes(self, seconds: float) -> None:
        self.run(asyncio.sleep(seconds))

    @rule(down=st.booleans())
    def store_down(self, down: bool) -> None:
        self.store.down = down

    @rule()
    def a_write_times_out_after_landing(self) -> None:
        self.store.time_out_next_write = True

    @rule(latency_s=st.sampled_from([0.0, 0.3, 1.5]))
    def store_latency(self, latency_s: float) -> None:
        self.store.latency_s = latency_s

    @rule(query=st.sampled_from(QUERIES), back=st.integers(1, 3))
    def store_loses_writes(self, query: str, back: int) -> None:
        """The store goes back on one blob: its last ``back`` writes are lost (an operator's
        restore of an older version, a point-in-time restore), the lease kept."""
        self.store.lose_writes(query, back)
        self._lost_by_store(query)

    @rule(back=st.integers(1, 2))
    def store_crashes_and_loses_its_last_writes(self, back: int) -> None:
        """The store is killed and comes back having lost its last writes on every blob (the
        emulator's SIGKILL, an account failover): down for a while, then older."""
        self.store.down = True
        self.run(asyncio.sleep(2.0))
        for query in QUERIES:
            self.store.lose_writes(query, back)
            self._lost_by_store(query)
        self.store.down = False

    @rule(down=st.booleans())
    def redis_down(self, down: bool) -> None:
        self.redis.connected = not down

    @rule(query=st.sampled_from(QUERIES))
    def lease_broken(self, query: str) -> None:
        self.store.break_lease(query)

    @rule(query=st.sampled_from(QUERIES), flush=st.booleans())
    def another_owner(self, query: str, flush: bool) -> None:
        """Another daemon takes the lease when it is free, and may flush Redis' batch."""
        active = self.store._active(query)
        if active is None and query in self.store.bodies:
            self.store.leases[query] = Lease("thief", self.now + LEASE_S, LEASE_S)
            active = self.store.leases[query]
        if active is not None and active.lease_id == "thief" and flush:
            batch = self._redis_batch(query)
            held = self.store.batch(query)
            if batch is not None and (held is None or batch > held):
                self.store.put(query, batch)

    @rule(query=st.sampled_from(QUERIES), back=st.integers(0, 3))
    def another_owner_resets(self, query: str, back: int) -> None:
        """The other daemon, holding the lease, resets the query: Redis, then the blob."""
        lease = self.store._active(query)
        held = self.store.batch(query)
        if lease is None or lease.lease_id != "thief" or held is None or self.store.down:
            return
        target = max(0, held - back)
        previous = self.store.document(query)
        reset = reset_document(
            previous,
            checkpoint(query, target, name=f"name-{query}"),  # its name: its groups
            WRITER,
            reason="r",
            history_size=4,
        )
        connected, self.redis.connected = self.redis.connected, True
        self.run(self._redis_reset(query, target, reset.reset_at))
        self.redis.connected = connected
        self.store.lowering.add(query)
        self.store.put_document(query, reset)
        self.store.lowering.discard(query)
        self._forget_model(query)
        self.since_reset[query] = set()
        self.reset_target[query] = target
        self.redis_batch[query] = target

    async def _flushall(self) -> None:
        client = fakeredis.FakeAsyncRedis(server=self.redis)
        await client.flushall()
        await client.aclose()

    async def _redis_reset(self, query: str, batch: int, reset_at: str | None) -> None:
        buffer = RedisBuffer("redis://sim", NS, client=fakeredis.FakeAsyncRedis(server=self.redis))
        try:
            await buffer.reset(checkpoint(query, batch, name=f"name-{query}"), None, reset_at)
        finally:
            await buffer.aclose()

    @rule(
        query=st.sampled_from(QUERIES),
        flush=st.booleans(),
        reset_back=st.none() | st.integers(0, 3),
    )
    def failover_and_back(self, query: str, flush: bool, reset_back: int | None) -> None:
        """Our lease is broken, another daemon takes the blob over (and may flush Redis'
        batch, or reset the query), then lets go: ours comes back under a new term."""
        if self.store.down or query not in self.store.bodies:
            return
        self.store.break_lease(query)
        self.another_owner(query, flush)
        if reset_back is not None:
            self.another_owner_resets(query, reset_back)
        self.another_owner_lets_go(query)

    @rule(query=st.sampled_from(QUERIES))
    def another_owner_lets_go(self, query: str) -> None:
        lease = self.store.leases.get(query)
        if lease is not None and lease.lease_id == "thief":
            del self.store.leases[query]

    @rule(query=st.sampled_from(QUERIES), back=st.integers(0, 3))
    def reset(self, query: str, back: int) -> None:
        """``checkpoint-sidecar reset --offsets`` through the daemon, to an earlier batch."""
        held = self.store.batch(query)
        if held is None:
            return
        target = max(0, held - back)
        self.store.lowering.add(query)
        try:
            self.run(self.daemon.admin(reset_to(query, target, "sim")))
        except SidecarError:
            pass
        finally:
            self.store.lowering.discard(query)
        if self._redis_batch(query) == target:  # Redis was set: the reset counts
            self._forget_model(query)
            self.since_reset[query] = set()
            self.reset_target[query] = target
            self.redis_batch[query] = target
            self.next_batch[query] = target  # the query, restarted from it, runs them again
            if self.store.batch(query) != target:
                self.half_reset[query] = target

    @rule(query=st.sampled_from(QUERIES))
    def retire(self, query: str) -> None:
        try:
            self.run(self.daemon.admin(Retire(query_id=query, force=True)))
        except SidecarError:
            return
        self._forget_model(query)
        for a in self.acks:
            if a.query == query:
                a.owed = False  # retired while waiting: it times out (the query is gone)
        self.next_batch[query] = max(self.next_batch[query], self.store.batch(query) or 0)

    @rule()
    def redis_loses_its_data(self) -> None:
        """``FLUSHALL``, or a restart without persistence (also while it was unreachable)."""
        connected, self.redis.connected = self.redis.connected, True
        self.run(self._flushall())
        self.redis.connected = connected
        for a in self.acks:
            # Nothing may be left to write: it times out, and the client's resend is answered
            # from the floor (the blob read again).
            a.owed = False
        for query in QUERIES:
            self._forget_model(query)

    @rule(killed=st.booleans(), same_pod=st.booleans(), blob_mode=st.booleans())
    def restart(self, killed: bool, same_pod: bool = False, blob_mode: bool = False) -> None:
        """The daemon stops (cleanly: loops stopped, a final flush, leases released; or
        killed) and a new one starts on the same Redis and store: in the same pod (it takes
        its predecessor's lease id over, ``sidecar.daemon.ownership``) or another (its own),
        in blob ack mode or not."""
        old = self.daemon
        if not killed:
            self.run(self._stop(old))
        for task in old.tasks + [a.task for a in self.acks]:
            task.cancel()
        self.run(asyncio.sleep(0))
        self.acks = []
        lease_id = old.lease_id if same_pod else f"daemon-{self.daemons + 1}"
        self.daemon = self._start(lease_id=lease_id, blob_mode=blob_mode)
        self.run(asyncio.sleep(0.1))

    @rule()
    def a_write_is_held_in_the_network(self) -> None:
        """The next blob write is held: its call times out, the request is still on its way."""
        self.store.hold_next_write = True

    @rule()
    def late_writes_land(self) -> None:
        """What was held in the network reaches the store (after a restart, a takeover, a
        reset...): refused unless its lease and version still hold."""
        self.run(self.store.deliver_held())

    @rule()
    def twin_starts(self) -> None:
        if self.twin is None:
            number = self.daemons + 1
            self.twin = self._start(
                lease_id=f"twin-{number}", blob_mode=False, redis=self.twin_redis
            )

    @rule(query=st.sampled_from(QUERIES), ahead=st.sampled_from([-3, 0, 3]))
    def twin_update(self, query: str, ahead: int) -> None:
        """The twin's driver: the same query, some batches behind or ahead of ours."""
        if self.twin is None:
            return
        batch = max(0, self.next_batch[query] + ahead)
        c = checkpoint(query, batch, name=f"name-{query}")
        try:
            self.run(self._request(Progress(self._rid(), c), self.twin))
        except SidecarError:
            return

    @rule(query=st.sampled_from(QUERIES), back=st.integers(1, 3))
    def twin_resets(self, query: str, back: int) -> None:
        """An operator resets the query through the twin (its own Redis records it; ours
        never does) to an earlier batch, our lease broken first so that the twin may take it.
        Not to the batch the blob holds: a reset this Redis never recorded is told only below
        Redis' flushed batch (a known limit: ``docs/flush-owner.md``)."""
        held = self.store.batch(query)
        if self.twin is None or held is None or held < back or self.store.down:
            return
        target = held - back
        self.store.break_lease(query)
        self.store.lowering.add(query)
        try:
            self.run(self.twin.admin(reset_to(query, target, "twin")))
        except SidecarError:
            pass
        finally:
            self.store.lowering.discard(query)
        doc = self.store.document(query)
        if doc is not None and doc.reset_reason == "twin" and doc.reset_at == doc.written_at:
            self._forget_model(query)
            self.since_reset[query] = set()
            self.redis_batch[query] = None  # ours stays above it: no reset of its own
            self.unrecorded.add(query)

    @rule(killed=st.booleans())
    def twin_stops(self, killed: bool) -> None:
        if self.twin is not None:
            self._end_twin(killed)

    def _end_twin(self, killed: bool) -> None:
        twin, self.twin = self.twin, None
        assert twin is not None
        if not killed:
            self.run(self._stop(twin))
        for task in twin.tasks:
            task.cancel()
        self.run(asyncio.sleep(0))

    async def _stop(self, daemon: SimDaemon) -> None:
        await daemon.committer.stop_loop()
        await daemon.eventhubs.stop_loop()
        try:
            with_deadline = asyncio.timeout(8)
            async with with_deadline:
                await daemon.flush.final_flush()
        except TimeoutError:
            pass
        await daemon.committer.final_commit()
        await daemon.eventhubs.final_commit()
        await daemon.flush.release_all()

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def nothing_moved_backwards_and_every_answer_was_true(self) -> None:
        for daemon in self.live_daemons():  # a loop that crashed would flush nothing more
            for task in daemon.tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    self.violations.append(f"a daemon task crashed: {task.exception()!r}")
        for a in self.acks:
            if answered(a) and a.task.result():
                seen = self.store.history[a.query][max(a.began, 0) :]
                known_then = a.batch <= self.store.lost.get(a.query, NO_BLOB)
                if (not seen or max(seen) < a.batch) and not known_then:
                    self.violations.append(f"ack {a.query}@{a.batch} answered, blob had {seen}")
        self.acks = [a for a in self.acks if not a.task.done()]
        for query in QUERIES:
            batch = self._redis_batch(query) if self.redis.connected else None
            if batch is None:
                continue
            before = self.redis_batch[query]
            if before is not None and batch < before:
                self.violations.append(f"Redis {query} moved back {before} -> {batch}")
            self.redis_batch[query] = batch
        assert self.violations == [], self.violations

    def _rewinds_reached_the_groups(self) -> None:
        """Each reset's groups hold its target or a batch since, unless the daemon told of
        it was restarted (the rewind may be lost; docs/kafka.md) or nothing was processed at
        the target (no Event Hubs checkpoint can say so)."""
        for query, watch in self.rewinds.items():
            if watch.daemon is not self.daemon:
                continue
            held = [("kafka", self.kafka.committed.get((f"spark-name-{query}", "events", 0)))]
            if watch.target > 0:
                hub = self.eventhubs.blobs.get(f"{HUB_GROUP}spark-name-{query}/checkpoint/0")
                held.append(("eventhubs", hub[0] + 1 if hub is not None else None))
            for where, at in held:
                assert at in watch.allowed, (
                    f"{query}: the {where} group holds {at} once faults stopped, after a "
                    f"reset to {watch.target} (its batches: {sorted(watch.allowed)})"
                )

    def teardown(self) -> None:
        try:
            self._once_faults_stop()
        finally:
            for daemon in self.live_daemons():
                for task in daemon.tasks:
                    task.cancel()
            for a in self.acks:
                a.task.cancel()
            self.runner.close()
            setattr(server_mixin, "time", time)  # noqa: B010
            kafka_client.open_consumer = self._open_consumer

    def _once_faults_stop(self) -> None:
        """Heal everything, let time pass; every acknowledged batch reaches the blob and every
        ack whose batch is there is answered."""
        self.store.down = self.store.time_out_next_write = self.store.hold_next_write = False
        self.redis.connected = True
        if self.twin is not None:  # its driver gone: it lets go, ours takes the blob back
            self._end_twin(killed=False)
        for query, lease in list(self.store.leases.items()):
            if lease.lease_id == "thief":
                del self.store.leases[query]
        acks = [a for a in self.acks if a.owed]
        # Leases of killed daemons expire, and ours come back (retried within a third of
        # the duration).
        self.run(asyncio.sleep(2 * LEASE_S))
        # The flush thresholds count in Redis' clock (the wall clock here): a stop's final
        # flush writes whatever is still pending below them.
        self.run(self._stop(self.daemon))
        refused = self.daemon.flush.health().refused
        for query in QUERIES:
            held = self.store.batch(query)
            owed = max(self.acked[query], default=None)
            if query in self.unrecorded and owed is not None and (held is None or held < owed):
                # Written over, the twin's reset would be undone: reported instead.
                assert f"name-{query}" in refused, f"{query}: a twin's reset not reported"
                continue
            assert owed is None or (held is not None and held >= owed), (
                f"{query}: acknowledged batch {owed} never reached the blob (it holds {held})"
            )
        self._rewinds_reached_the_groups()
        for a in acks:
            held = self.store.batch(a.query)
            # An ack answered not_owner (another daemon held the lease meanwhile) was answered
            # truthfully: its client resends.
            if held is not None and held >= a.batch and not not_owner(a):
                assert answered(a) and a.task.result(), f"ack {a.query}@{a.batch} never answered"
        assert self.violations == [], self.violations


FlushSimulation.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
TestFlushSimulation = FlushSimulation.TestCase


#: One step of a scripted run: a rule of the state machine called with its arguments.
Step = Callable[["FlushSimulation"], object]


def replay(steps: list[Step], *, grid_phase_s: float = 0.0) -> None:
    """Run ``steps`` (rule calls, as Hypothesis prints them, typed) with the invariants after
    each and the end-of-run checks, as the state machine would; the loops' ticks at
    ``grid_phase_s`` (where the run that found them had its grid)."""
    sim = FlushSimulation()
    try:
        sim.settle(phase=grid_phase_s)
        sim.nothing_moved_backwards_and_every_answer_was_true()
        for step in steps:
            step(sim)
            sim.nothing_moved_backwards_and_every_answer_was_true()
    except BaseException:
        for task in sim.daemon.tasks:
            task.cancel()
        sim.runner.close()
        raise
    sim.teardown()


#: Every defect the simulation found, as the steps that showed it (shrunk by hand).
FOUND: dict[str, list[Step]] = {
    # A row read while a reset was under way (after its start, before its Redis write) was
    # flushed after it: batch 1 came back over the reset. (The op now stamps its end too.)
    "a row read during a reset": [
        lambda s: s.update(query="q1", back=0, blob_ack=False),
        lambda s: s.restart(killed=False),
        lambda s: s.update(query="q1", back=0, blob_ack=False),
        lambda s: s.store_latency(latency_s=0.3),
        lambda s: s.redis_down(down=True),
        lambda s: s.restart(killed=False),
        lambda s: s.redis_down(down=False),
        lambda s: s.reset(query="q1", back=0),
    ],
    # A reset whose blob write timed out after landing left the durable batch above the
    # blob: an ack of a batch the reset dropped was answered.
    "a reset whose write timed out": [
        lambda s: s.update(query="q1", back=0, blob_ack=False),
        lambda s: s.update(query="q1", back=0, blob_ack=False),
        lambda s: s.restart(killed=False, blob_mode=True),
        lambda s: s.a_write_times_out_after_landing(),
        lambda s: s.reset(query="q1", back=2),
        lambda s: s.update(query="q1", back=1, blob_ack=True),
    ],
    # A row read before the lease was ours predated another owner's reset (and release).
    "a row read before another owner's reset": [
        lambda s: s.update(query="q1", back=0, blob_ack=False),
        lambda s: s.restart(killed=False, blob_mode=True),
        lambda s: s.store_latency(latency_s=1.5),
        lambda s: s.update(query="q1", back=0, blob_ack=True),
        lambda s: s.failover_and_back(query="q1", flush=False, reset_back=1),
    ],
    # Redis lost its data during a flush and an update re-created the record: its version
    # counter restarted, equal to the flushed row's, and the flush marked the newer batch
    # flushed (an acknowledged update lost). Marking now keeps a batch newer than the blob's
    # pending.
    "a mark after Redis lost the record": [
        lambda s: s.store_latency(latency_s=1.5),
        lambda s: s.update(query="q1", back=0, blob_ack=True),
        lambda s: s.redis_loses_its_data(),
        lambda s: s.update(query="q1", back=0, blob_ack=False),
    ],
    # After Redis lost its data, a blob-mode ack of a batch the blob held waited for a write
    # that would never come. (A floor read from the blob now counts for acks.)
    "an ack after Redis lost its data": [
        lambda s: s.update(query="q1", back=0, blob_ack=False),
        lambda s: s.restart(killed=False, blob_mode=True),
        lambda s: s.redis_loses_its_data(),
        lambda s: s.update(query="q1", back=1, blob_ack=True),
    ],
    # A reset read the blob slowly; meanwhile the lease's renewal was refused (another owner
    # had broken it and let go), and the reset wrote with a lease its manager knew was lost.
    # (Azure refuses that write while nobody holds the lease; had the lease been taken again
    # under a new term meanwhile, a write planned from the old term's read would land.) Every
    # write now checks, right before it, that the term it planned under is still held.
    "a write after the lease was lost during a slow read": [
        lambda s: s.store_latency(latency_s=1.5),
        lambda s: s.update(query="q1", back=0, blob_ack=False),
        lambda s: s.restart(killed=False),
        lambda s: s.a_write_times_out_after_landing(),
        lambda s: s.reset(query="q1", back=0),
        lambda s: s.failover_and_back(query="q1", flush=False, reset_back=None),
        lambda s: s.reset(query="q1", back=0),
    ],
    # A write timed out after landing batch 1; Redis then lost its data, and batch 0 was
    # stored under the floor known before that write (no blob; and the namespace's listing,
    # made before the lease created the blob, said "no blob" too): `get` went from 1 back to
    # 0. A write whose outcome is unknown now forgets the floor, and acquiring a lease adds
    # its blob to the listing, so the blob is read before such an update is stored.
    "an older batch after a write of unknown outcome and a Redis loss": [
        lambda s: s.a_write_times_out_after_landing(),
        lambda s: s.update(query="q1", back=0, blob_ack=True),
        lambda s: s.redis_loses_its_data(),
        lambda s: s.get(query="q1"),
        lambda s: s.update(query="q1", back=1, blob_ack=True),
        lambda s: s.get(query="q1"),
    ],
    # Another owner reset the blob from batch 1 to 0 and let go; batch 1 came again, the
    # floor (1) alone refused it, and the floor read again said 0, but the durable batch
    # stayed 1: its blob-mode ack was answered at once, the blob holding 0. A floor read
    # again exactly now sets the durable batch too, down as well as up.
    "an ack after another owner rewound the blob": [
        lambda s: s.update(query="q2", back=0, blob_ack=True),
        lambda s: s.update(query="q2", back=0, blob_ack=False),
        lambda s: s.failover_and_back(query="q2", flush=False, reset_back=1),
        lambda s: s.update(query="q2", back=1, blob_ack=True),
    ],
    # A write of batch 1 timed out after landing while its blob-mode ack waited; a `get` read
    # the floor (1) from the blob, which made batch 1 durable without answering that ack,
    # and nothing later could (Redis' flushed batch equal to the durable one is no news): it
    # waited forever. A floor read now answers the acks it makes durable.
    "an ack made durable by a floor read": [
        lambda s: s.a_write_times_out_after_landing(),
        lambda s: s.update(query="q2", back=0, blob_ack=True),
        lambda s: s.get(query="q2"),
        lambda s: s.failover_and_back(query="q2", flush=False, reset_back=0),
    ],
    # Another owner reset the blob from 1 to 0 (Redis first, then the blob) and let go; batch
    # 2 was applied over it (the floor known, 1, let it through), then a resend of batch 1:
    # stale in Redis, and its blob-mode ack answered from the blob this daemon last saw (1),
    # the blob holding 0. Redis' flushed batch, which each apply's row now carries, tells of
    # the reset (after this daemon's own flush was recorded in Redis: no false alarm).
    # Found at 1,500 examples (this code and the one before).
    "an ack of a resent batch after another owner's reset": [
        lambda s: s.update(query="q2", back=0, blob_ack=True),
        lambda s: s.failover_and_back(query="q2", flush=True, reset_back=3),
        lambda s: s.update(query="q2", back=0, blob_ack=False),
        lambda s: s.update(query="q2", back=1, blob_ack=True),
    ],
    # Batch 2 written (its blob-mode ack answered); Redis lost its data; batch 0 was refused
    # by the floor (2) alone and the floor read again (still 2); another owner reset the
    # query to batch 0 (Redis, then the blob) and let go. Batch 1 came within the 5 s the
    # floor is not read again: the floor alone refused it, and its ack was answered from the
    # blob as last read (2), the blob holding 0. In ack_mode=blob the floor is now read again
    # at each such refusal. Found at 1,500 examples (seed 2), on main's code too.
    "an ack answered from a floor read before another owner's reset": [
        lambda s: s.update(query="q1", back=0, blob_ack=False),
        lambda s: s.update(query="q1", back=0, blob_ack=True),
        lambda s: s.redis_loses_its_data(),
        lambda s: s.update(query="q1", back=2, blob_ack=False),
        lambda s: s.failover_and_back(query="q1", flush=False, reset_back=3),
        lambda s: s.update(query="q1", back=1, blob_ack=True),
    ],
    # The namespace was listed before batch 1's lease created the blob; the query was retired
    # (its record, lease term included, forgotten; the blob stays) and `get` read batch 1
    # from the blob. Batch 0 then came: the listing, not a minute old, said "no blob", and it
    # was stored below the blob (`get`: 1, then 0). A retired query known to have a blob is
    # now added to the listing. Found at 1,500 examples (no seed), on main's code too.
    "an older batch after a retirement": [
        lambda s: s.update(query="q1", back=0, blob_ack=True),
        lambda s: s.retire(query="q1"),
        lambda s: s.get(query="q1"),
        lambda s: s.update(query="q1", back=1, blob_ack=False),
        lambda s: s.get(query="q1"),
    ],
    # Ours committed the group at batch 1 and retired the query; the twin (another Redis)
    # took the lease, wrote batch 4 and committed the group there; ours, its stale floor
    # saying 1, took batches 1 and 2. Once the killed twin's lease ran out ours flushed: the
    # blob held 4, so it skipped the write, yet it committed batch 2's offsets (its committer
    # knew only its own 1): the group went 4 -> 3. Only a blob holding the very batch is
    # committed now. Found once the simulation watched the groups.
    "an older row's offsets over a newer blob's": [
        lambda s: s.update(query="q2", back=0, blob_ack=False),
        lambda s: s.time_passes(seconds=6.0),
        lambda s: s.twin_starts(),
        lambda s: s.retire(query="q2"),
        lambda s: s.twin_update(query="q2", ahead=3),
        lambda s: s.time_passes(seconds=0.6),
        lambda s: s.update(query="q2", back=0, blob_ack=False),
        lambda s: s.update(query="q2", back=0, blob_ack=False),
        lambda s: s.time_passes(seconds=6.0),
        lambda s: s.twin_stops(killed=True),
        lambda s: s.time_passes(seconds=6.0),
    ],
    # The store lost its last write (batch 6; back to 3) while the daemon held the lease.
    # Batch 7's write named the lost version and was refused; the blob read again held 3,
    # Redis' flushed batch (6) said "another writer" again, the blob was read again... at
    # each try, then a backoff, for good: nothing reached the blob again. A blob read under
    # the lease held now is what it holds: the newest batch is written over it.
    "a store that lost its last writes": [
        *[lambda s: s.update(query="q1", back=0, blob_ack=False)] * 3,
        lambda s: s.time_passes(seconds=0.6),
        *[lambda s: s.update(query="q1", back=0, blob_ack=False)] * 3,
        lambda s: s.time_passes(seconds=0.6),
        lambda s: s.store_loses_writes(query="q1", back=1),
        lambda s: s.update(query="q1", back=0, blob_ack=True),
        lambda s: s.time_passes(seconds=20.0),
    ],
    # The same loss on an idle query: nothing pending, no write to be refused; the blob
    # stayed at 3 with batch 6 acknowledged. A renewal reporting another version than the
    # one written makes the daemon read the blob and compare it with Redis.
    "an idle query's blob after the store lost its last write": [
        *[lambda s: s.update(query="q1", back=0, blob_ack=False)] * 3,
        lambda s: s.time_passes(seconds=0.6),
        *[lambda s: s.update(query="q1", back=0, blob_ack=False)] * 3,
        lambda s: s.time_passes(seconds=0.6),
        lambda s: s.store_crashes_and_loses_its_last_writes(back=1),
    ],
    # The store lost the only write of an idle query (its blob back to empty), then the
    # daemon was replaced: the new one had nothing pending and no lease of it, so nothing
    # ever read the blob (found at 1,000 examples, with the renewal check alone). The store's
    # listing is held against Redis' record of each last flush at start and every
    # AUDIT_EVERY_S: a blob at another version is read and compared.
    "a blob that went back before the daemon was replaced": [
        lambda s: s.update(query="q1", back=0, blob_ack=False),
        lambda s: s.time_passes(seconds=20.0),
        lambda s: s.store_loses_writes(query="q1", back=1),
        lambda s: s.restart(killed=False, same_pod=False, blob_mode=False),
    ],
    # The same loss after the new daemon's start, no daemon holding the blob's lease: found
    # by the next audit, not by the one at start (found at 1,500 examples with a 10-minute
    # audit, longer than a run's end lets pass; the audit now runs every minute).
    "a blob that went back while no daemon held its lease": [
        lambda s: s.update(query="q2", back=0, blob_ack=False),
        lambda s: s.time_passes(seconds=20.0),
        lambda s: s.restart(killed=False, same_pod=False, blob_mode=False),
        lambda s: s.store_loses_writes(query="q2", back=1),
    ],
    # A reset's own write held in the network (its call timed out: Redis reset, the blob
    # not), then the store lost the query's only write: Redis' flushed batch is the reset's,
    # and the daemon writes that checkpoint back (found at 1,500 examples: the simulation
    # allowed no write of the reset's batch after it; the daemon also re-planned the flush
    # at every check while a lease acquired anew left the blob unverified and a write had
    # seen it since: a plan now reads such a blob first).
    "a reset's write lost with the store's": [
        lambda s: s.update(query="q1", back=0, blob_ack=False),
        lambda s: s.time_passes(seconds=6.0),
        lambda s: s.a_write_is_held_in_the_network(),
        lambda s: s.retire(query="q1"),
        lambda s: s.reset(query="q1", back=0),
        lambda s: s.store_loses_writes(query="q1", back=1),
        lambda s: s.restart(killed=False, same_pod=False, blob_mode=False),
    ],
    # The twin reset the query (its groups rewound with it) and stopped; the store lost that
    # reset; the twin, back, flushed and committed a batch above the rewind. Found at 5,000
    # examples, a defect of the simulation's model: a reset the store itself undid still
    # held the groups to it.
    "a twin's rewind the store lost": [
        lambda s: s.twin_starts(),
        lambda s: s.update(query="q2", back=0, blob_ack=True),
        lambda s: s.twin_resets(query="q2", back=1),
        lambda s: s.twin_stops(killed=False),
        lambda s: s.store_crashes_and_loses_its_last_writes(back=1),
        lambda s: s.twin_starts(),
        lambda s: s.twin_update(query="q2", ahead=0),
    ],
    # The store lost the batch ours had flushed and committed the group for; the twin, whose
    # Redis never had it, wrote and committed batch 0. Found at 5,000 examples, a defect of
    # the simulation's model: a group may come down to what the store kept.
    "a group committed for a batch the store lost": [
        lambda s: s.twin_starts(),
        lambda s: s.store_down(down=True),
        lambda s: s.update(query="q2", back=0, blob_ack=False),
        lambda s: s.store_crashes_and_loses_its_last_writes(back=1),
        lambda s: s.twin_update(query="q2", ahead=0),
        lambda s: s.update(query="q2", back=3, blob_ack=True),
        lambda s: s.lease_broken(query="q2"),
        lambda s: s.time_passes(seconds=20.0),
        lambda s: s.store_crashes_and_loses_its_last_writes(back=2),
    ],
    # The store lost the twin's reset with the rest of its last writes (the blob back to
    # empty): ours wrote back what its Redis holds. Found at 5,000 examples, a defect of the
    # simulation's model (it still forbade writes for a reset the store itself undid).
    "a twin's reset lost with the store's last writes": [
        *[lambda s: s.update(query="q2", back=0, blob_ack=True)] * 2,
        lambda s: s.twin_starts(),
        lambda s: s.time_passes(seconds=6.0),
        lambda s: s.twin_resets(query="q2", back=1),
        lambda s: s.store_crashes_and_loses_its_last_writes(back=2),
    ],
    # Blob ack mode: ours flushed batch 3; a twin on its own Redis broke our lease and reset
    # the query to 1; a resend of batch 2 was answered durable from ours's memory ("ack q1@2
    # answered, blob had [1]"; issue #40). An ack is now answered only by a read or a write
    # of the blob, never by a batch remembered or said by Redis.
    # The first version of that fix: a resend's ack after a restart waited for a read that
    # nothing made (make simulate, 5,000 examples).
    "a resend's ack after a restart": [
        lambda s: s.update(query="q1", back=0, blob_ack=False),
        lambda s: s.restart(killed=False, same_pod=False, blob_mode=True),
        lambda s: s.update(query="q1", back=1, blob_ack=True),
    ],
    # Our reset to batch 0 was lost by the store (back to batch 1, as written before it); an
    # ack of batch 1 answered by a read of it was taken for a false one. Found at 5,000
    # examples, a defect of the simulation's model: the blob's going back up was not in its
    # history.
    "an ack after the store lost a reset's write": [
        lambda s: s.update(query="q2", back=0, blob_ack=False),
        lambda s: s.time_passes(seconds=6.0),
        lambda s: s.failover_and_back(flush=False, query="q2", reset_back=1),
        lambda s: s.redis_loses_its_data(),
        lambda s: s.reset(back=0, query="q2"),
        lambda s: s.store_loses_writes(back=1, query="q2"),
        lambda s: s.update(query="q2", back=0, blob_ack=True),
    ],
    "an ack answered from memory after a twin's reset": [
        lambda s: s.twin_starts(),
        *[lambda s: s.update(query="q1", back=0, blob_ack=False)] * 3,
        lambda s: s.time_passes(seconds=0.6),
        lambda s: s.twin_resets(query="q1", back=2),
        lambda s: s.update(query="q1", back=1, blob_ack=True),
        lambda s: s.time_passes(seconds=6.0),
    ],
    # A twin on its own Redis reset q2 to batch 0 and lowered its group there; ours, which had
    # committed batch 1 and not yet seen the reset (its lease was broken, its renewal not due),
    # flushed the query again from memory ("blob already holds batch 1") and told its sinks
    # batch 1 again, each time as if new: the group was raised back to 1 over the twin's
    # reset. A sink now takes a checkpoint told again as nothing newer (``sidecar.sinks.loop``):
    # what another writer moved stays as it set it. Found by make simulate at 5,000 examples
    # (29 steps, cut to these 4).
    "a twin's reset to 0 raised back to 1 in the group by ours": [
        lambda s: s.update(back=0, blob_ack=True, query="q2"),
        lambda s: s.update(back=2, blob_ack=True, query="q2"),
        lambda s: s.twin_starts(),
        lambda s: s.twin_resets(back=1, query="q2"),
    ],
    # The store went back (to the empty blob the lease had created) after a restart; the new
    # daemon had only read the blob for a get (its floor: never compared with Redis), and its
    # audit took "seen here at that version" for "judged": batch 1, acknowledged, never came
    # back. A blob is now exempt only when seen holding the last flush's batch or newer.
    # Found by the suite's short run (seed 102, 5 steps).
    "a blob the store lost, read for a get but never compared, after a restart": [
        lambda s: s.update(back=0, blob_ack=False, query="q2"),
        lambda s: s.restart(blob_mode=False, killed=False, same_pod=False),
        lambda s: s.update(back=0, blob_ack=False, query="q1"),
        lambda s: s.store_crashes_and_loses_its_last_writes(back=1),
        lambda s: s.get(query="q2"),
    ],
    # The store crashed and lost q2's blob whole (no blob left); another owner took the blob
    # and let go without writing; ours never wrote batch 1, acknowledged, back: the blob
    # still holds nothing at the end. Found by make simulate at 5,000 examples. Settled with
    # the case above: the audit took the empty blob, seen here but never compared with Redis,
    # for judged.
    "an acknowledged batch not written back after the store lost the blob whole": [
        lambda s: s.update(query="q2", back=0, blob_ack=True),
        lambda s: s.update(query="q1", back=0, blob_ack=True),
        lambda s: s.retire(query="q1"),
        lambda s: s.another_owner(flush=False, query="q1"),
        lambda s: s.store_latency(latency_s=1.5),
        lambda s: s.reset(back=0, query="q1"),
        lambda s: s.store_crashes_and_loses_its_last_writes(back=2),
        lambda s: s.failover_and_back(flush=False, query="q2", reset_back=0),
        lambda s: s.time_passes(seconds=0.6),
        lambda s: s.get(query="q2"),
    ],
    # Two cases kept OPEN until the model was settled (FlushSimulation._lost_by_store): a
    # get answer that no durable copy holds any more is not owed. A retired query (its Redis
    # keys removed) whose blob the store lost: get answered batch 1, then 0 (an older resend
    # stored over what the store kept) — the blob was the batch's only copy.
    "get of a retired query after the store lost its blob": [
        lambda s: s.update(query="q1", back=0, blob_ack=True),
        lambda s: s.retire(query="q1"),
        lambda s: s.get(query="q1"),
        lambda s: s.store_crashes_and_loses_its_last_writes(back=2),
        lambda s: s.update(query="q1", back=3, blob_ack=False),
        lambda s: s.get(query="q1"),
    ],
    # The same with Redis' data lost instead of the query retired: get answered batch 1 from
    # the blob (Redis had lost it), the store then lost that write too, and an older resend
    # was stored: get answers 0. Nothing durable held batch 1 any more (only the daemon's
    # memory, which a restart loses): a replay of one batch, no loss. Found by make simulate
    # at 5,000 examples (35 steps, cut to 7).
    "get after Redis and then the store lost the batch it answered": [
        lambda s: s.update(back=0, blob_ack=True, query="q1"),
        lambda s: s.redis_loses_its_data(),
        lambda s: s.time_passes(seconds=0.1),
        lambda s: s.get(query="q1"),
        lambda s: s.store_crashes_and_loses_its_last_writes(back=1),
        lambda s: s.update(back=2, blob_ack=False, query="q1"),
        lambda s: s.get(query="q1"),
    ],
    # A blob-mode ack of a resend (batch 0) made after the query was retired here (its Redis
    # record removed), while earlier writes are still held in the network and land later,
    # then the store lost its last write: the ack was never answered (a liveness gap). Its
    # query has no Redis row, so no flush check listed it and no flush read its blob; now the
    # flush reads the blob of a query acks wait on that Redis holds nothing of
    # (Flusher._confirm). Found by make simulate at 5,000 examples (22 steps as shrunk).
    "a resend's ack after a retirement, late writes and a store that lost one": [
        lambda s: s.twin_starts(),
        *[lambda s: s.a_write_times_out_after_landing()] * 3,
        lambda s: s.update(back=0, blob_ack=True, query="q1"),
        *[lambda s: s.a_write_is_held_in_the_network()] * 5,
        lambda s: s.failover_and_back(flush=False, query="q1", reset_back=0),
        *[lambda s: s.a_write_is_held_in_the_network()] * 5,
        lambda s: s.get(query="q1"),
        lambda s: s.store_latency(latency_s=0.3),
        lambda s: s.a_write_is_held_in_the_network(),
        lambda s: s.retire(query="q1"),
        lambda s: s.update(back=3, blob_ack=True, query="q1"),
        lambda s: s.store_crashes_and_loses_its_last_writes(back=1),
    ],
}


def sample(sim: FlushSimulation, name: str) -> float | None:
    """A metric's value in the daemon's registry."""
    return sim.daemon.metrics.registry.get_sample_value(name)


#: Ours flushes batch 3; a twin on its own Redis resets the query to batch 1.
TWIN_RESETS: list[Step] = [
    lambda s: s.twin_starts(),
    *[lambda s: s.update(query="q1", back=0, blob_ack=False)] * 3,
    lambda s: s.time_passes(seconds=0.6),
    lambda s: s.twin_resets(query="q1", back=2),
]


def test_a_twins_reset_that_our_redis_never_recorded_is_never_written_over() -> None:
    # Ours flushed batch 3; an operator reset the query to 1 through a twin on its own Redis
    # (ours fenced out first); ours applied batch 4 meanwhile. Once the twin is gone, ours
    # takes the lease back and reads the twin's reset below its Redis' flushed batch, with a
    # reset record its Redis never saw: it writes nothing over it, and says so.
    sim: list[FlushSimulation] = []
    replay([sim.append, *TWIN_RESETS, lambda s: s.update(query="q1", back=0, blob_ack=False)])
    s = sim[0]
    doc = s.store.document("q1")
    assert doc is not None and (doc.batch_id, doc.reset_reason) == (1, "twin")
    refused = s.daemon.flush.health().refused
    assert list(refused) == ["name-q1"] and "reset to batch 1" in refused["name-q1"]
    assert sample(s, "checkpoint_sidecar_blob_resets_unrecorded") == 1
    assert sample(s, "checkpoint_sidecar_store_lost_writes_total") == 0


#: Ours flushed batch 1 and applied batch 2; another daemon holds the lease (after its own
#: reset at batch 1); an operator resets the query through ours to batch 0: Redis takes it,
#: the blob write is refused (the lease is not ours), and the op fails, to be run again.
RESET_NOT_IN_THE_BLOB: list[Step] = [
    lambda s: s.a_write_times_out_after_landing(),  # ours retries: the other gets the lease
    lambda s: s.update(query="q1", back=0, blob_ack=True),
    lambda s: s.failover_and_back(query="q1", flush=True, reset_back=0),
    lambda s: s.another_owner(query="q1", flush=False),
    lambda s: s.update(query="q1", back=0, blob_ack=True),
    lambda s: s.reset(query="q1", back=1),
]


def test_a_reset_redis_took_and_the_blob_did_not_is_answered_as_documented() -> None:
    # docs/operator-ops.md: the blob keeps the replaced batch, Redis the target. get answers
    # the blob's batch (the newer durable one) while the blob can be read; with the store
    # down and the floor forgotten (a check since: the reset may have lowered the blob), the
    # only word left is Redis': the target, which the operator asked for. A lower answer
    # replays batches and loses none; the simulation allows that one answer (half_reset).
    sim: list[FlushSimulation] = []
    answers: list[int | None] = []
    replay(
        [
            sim.append,
            *RESET_NOT_IN_THE_BLOB,
            lambda s: s.get(query="q1"),
            lambda s: answers.append(s.got["q1"]),
            lambda s: s.store_down(down=True),
            lambda s: s.time_passes(seconds=0.6),
            lambda s: s.get(query="q1"),
            lambda s: answers.append(s.got["q1"]),
        ]
    )
    s = sim[0]
    assert (s.store.batch("q1"), s.half_reset) == (1, {"q1": 0})
    assert answers == [1, 0]


def test_a_reset_here_after_a_twins_reset_resumes_the_flushes() -> None:
    # As above, then the operator resets the query through ours (now recorded in its
    # Redis): batches after it reach the blob again.
    sim: list[FlushSimulation] = []
    replay(
        [
            sim.append,
            *TWIN_RESETS,
            lambda s: s.twin_stops(killed=False),
            lambda s: s.time_passes(seconds=20.0),
            lambda s: s.reset(query="q1", back=0),
            *[lambda s: s.update(query="q1", back=0, blob_ack=False)] * 3,
            lambda s: s.time_passes(seconds=6.0),
        ]
    )
    s = sim[0]
    assert s.store.batch("q1") == 4 and s.daemon.flush.health().refused == {}


def test_a_store_that_lost_writes_is_counted_once_and_rewritten() -> None:
    sim: list[FlushSimulation] = []
    replay([*FOUND["a store that lost its last writes"], sim.append])
    s = sim[0]
    assert s.store.history["q1"] == [3, 6, 3, 7]
    assert sample(s, "checkpoint_sidecar_store_lost_writes_total") == 1
    assert sample(s, "checkpoint_sidecar_blob_resets_unrecorded") == 0


def test_a_get_answer_redis_still_holds_stays_owed_after_the_store_lost_it() -> None:
    # The model excuses a get going back only when no durable copy holds the batch: here
    # Redis holds batch 2 (down, not lost) when the store loses it, so get must still answer
    # 2 (the daemon writes it back); with Redis' data lost, nothing holds it and it is not.
    sim: list[FlushSimulation] = []
    replay(
        [
            *[lambda s: s.update(query="q1", back=0, blob_ack=True)] * 2,
            lambda s: s.time_passes(seconds=0.6),
            lambda s: s.get(query="q1"),
            lambda s: s.redis_down(down=True),
            lambda s: s.store_crashes_and_loses_its_last_writes(back=1),
            sim.append,
        ]
    )
    s = sim[0]
    assert s.got["q1"] == 2  # still owed: Redis holds 2
    lost: list[FlushSimulation] = []
    replay(
        [
            *[lambda s: s.update(query="q1", back=0, blob_ack=True)] * 2,
            lambda s: s.time_passes(seconds=0.6),
            lambda s: s.redis_loses_its_data(),
            lambda s: s.get(query="q1"),
            lambda s: s.store_crashes_and_loses_its_last_writes(back=1),
            lost.append,
        ]
    )
    s = lost[0]
    assert s.store.batch("q1") == 1 and s.got["q1"] == 1  # no copy holds 2 any more


#: Found at a grid phase of its own: the steps, and where the loops ticked.
FOUND_AT_PHASE: dict[str, tuple[float, list[Step]]] = {
    # The reset above, among 21 steps at grid phase 0.15: get answered the blob's 1, then,
    # the store down after a check had forgotten the floor, Redis' 0 (flagged as moved back
    # before the model knew a reset half done: half_reset). Found by make simulate at 5,000
    # examples; it showed only at some phases (each run drew its grid's phase at random, so
    # the same steps failed 1 run in 12: each example now draws its own, GRID_PHASES).
    "get after a reset Redis took and the blob did not, the store down": (
        0.15,
        [
            lambda s: s.another_owner_resets(back=0, query="q1"),
            lambda s: s.a_write_times_out_after_landing(),
            lambda s: s.update(back=0, blob_ack=True, query="q1"),
            lambda s: s.failover_and_back(flush=True, query="q1", reset_back=0),
            lambda s: s.another_owner(flush=False, query="q1"),
            lambda s: s.update(back=0, blob_ack=True, query="q1"),
            lambda s: s.reset(back=1, query="q1"),
            lambda s: s.a_write_times_out_after_landing(),
            lambda s: s.another_owner(flush=False, query="q1"),
            lambda s: s.get(query="q1"),
            lambda s: s.store_down(down=True),
            lambda s: s.time_passes(seconds=0.1),
            lambda s: s.get(query="q1"),
        ],
    ),
}


@pytest.mark.parametrize("case", list(FOUND_AT_PHASE.values()), ids=list(FOUND_AT_PHASE))
def test_what_the_simulation_found_at_a_phase_stays_found(case: tuple[float, list[Step]]) -> None:
    phase, steps = case
    replay(steps, grid_phase_s=phase)


@pytest.mark.parametrize("steps", list(FOUND.values()), ids=list(FOUND))
def test_what_the_simulation_found_stays_found(steps: list[Step]) -> None:
    replay(steps)


#: What the simulation found and is not settled yet (each fails the same way on the code
#: before the session that found it: not a regression). Kept so that they stay in sight:
#: strict, so a change that settles one says so, and the case moves to FOUND.
OPEN: dict[str, list[Step]] = {
    # A twin on its own Redis reset q1 again and again while ours retired the query between
    # its updates: ours wrote batch 3 over one of the twin's resets. The "twins both write"
    # class (its known limit: a reset this Redis never recorded is told only below Redis'
    # flushed batch; a retired query has no flushed batch here). Found by make simulate at
    # 5,000 examples (cut to 10 steps); fails the same on the code before the session.
    "a twin's reset written over by ours after the query was retired here": [
        lambda s: s.twin_resets(back=1, query="q1"),
        lambda s: s.twin_starts(),
        lambda s: s.twin_resets(back=1, query="q1"),
        lambda s: s.update(back=0, blob_ack=False, query="q2"),
        lambda s: s.update(back=0, blob_ack=False, query="q1"),
        lambda s: s.update(back=0, blob_ack=True, query="q1"),
        lambda s: s.twin_resets(back=1, query="q1"),
        lambda s: s.retire(query="q1"),
        lambda s: s.update(back=0, blob_ack=False, query="q1"),
        lambda s: s.twin_resets(back=1, query="q1"),
    ],
    # Ours wrote batch 1 and the write timed out after landing (so its Redis records no flush);
    # a twin on its own Redis reset the query to 0 under its lease; once the twin is gone, ours
    # writes batch 1 again over the reset. The twins class's known limit: with no flushed
    # batch in this Redis, a reset it never recorded is not below anything, so it is not judged.
    # Found by make simulate at 5,000 examples (20 steps, cut to 4); fails the same on 86a102d.
    "a twin's reset written over by ours whose own write timed out after landing": [
        lambda s: s.a_write_times_out_after_landing(),
        lambda s: s.update(back=0, blob_ack=True, query="q1"),
        lambda s: s.twin_starts(),
        lambda s: s.twin_resets(back=1, query="q1"),
    ],
    # A reset to batch 1 through ours (the Kafka group rewound to 1), then the store lost the
    # reset's write: the blob holds the batch 2 of before the reset again. The query, rerun
    # from 1, sends batch 2; the flush finds the blob "already holding batch 2" (the old
    # one: batches are compared across the reset), writes nothing and tells the groups the
    # blob's batch 2, raising the rewound group; the blob never gets the reset back. A store
    # that lost a reset's own write: the lost-writes check compares batches (blob below
    # Redis' flushed one), and a reset turns that around. Found by make simulate at 5,000
    # examples (3 distinct failures of 10-20 steps, cut to 5); fails the same on 86a102d.
    "a reset's write lost by the store, then the same batch id again": [
        lambda s: s.update(back=0, blob_ack=True, query="q1"),
        lambda s: s.update(back=0, blob_ack=True, query="q1"),
        lambda s: s.reset(back=1, query="q1"),
        lambda s: s.store_loses_writes(back=1, query="q1"),
        lambda s: s.update(back=0, blob_ack=False, query="q1"),
    ],
}


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="open: see OPEN's comments")
@pytest.mark.parametrize("steps", list(OPEN.values()), ids=list(OPEN))
def test_what_the_simulation_found_and_is_open_still_fails(steps: list[Step]) -> None:
    replay(steps)


def test_a_document_read_under_one_lease_term_is_not_trusted_under_the_next() -> None:
    # Our daemon knew the blob at batch 3, its lease was broken, another owner wrote batch 9
    # and let go. Its next write (batch 4, for a blob-mode ack) meets the broken lease, and
    # the lease comes back under a new term: what it knew of the blob must be read again,
    # else batch 4 would move the blob back from 9.
    replay(
        [
            lambda s: s.update(query="q1", back=0, blob_ack=False),
            lambda s: s.update(query="q1", back=0, blob_ack=False),
            lambda s: s.update(query="q1", back=0, blob_ack=False),
            lambda s: s.time_passes(seconds=0.6),
            lambda s: s.lease_broken(query="q1"),
            lambda s: s.another_owner(query="q1", flush=False),
            lambda s: s.store.put("q1", 9),
            lambda s: s.another_owner_lets_go(query="q1"),
            lambda s: s.update(query="q1", back=0, blob_ack=True),
            lambda s: s.time_passes(seconds=20.0),
        ]
    )


def test_a_late_write_of_a_killed_daemon_is_refused_after_its_successor_wrote() -> None:
    # Batch 4's write (for a blob-mode ack) is held in the network when the daemon is
    # killed; the container restarts in its pod (the same lease id), flushes what was left
    # pending and then batch 7; then the held request arrives, its lease id valid: its
    # version (the blob at batch 3) is gone, so it is refused. Without If-Match it would
    # land: the blob back from 7 to 4.
    sim: list[FlushSimulation] = []
    before: list[int] = []
    replay(
        [
            sim.append,
            *[lambda s: s.update(query="q1", back=0, blob_ack=False)] * 3,
            lambda s: s.time_passes(seconds=0.6),
            lambda s: s.a_write_is_held_in_the_network(),
            lambda s: s.update(query="q1", back=0, blob_ack=True),
            lambda s: s.restart(killed=True, same_pod=True, blob_mode=True),
            *[lambda s: s.update(query="q1", back=0, blob_ack=False)] * 3,
            lambda s: s.time_passes(seconds=0.6),
            lambda s: before.extend(s.store.history["q1"]),
            lambda s: s.late_writes_land(),
        ]
    )
    assert before[-1] == 7 and sim[0].store.history["q1"] == before  # nothing landed late


def test_each_flushed_batch_reaches_the_groups() -> None:
    # The flush's durable hook: batches 1-3 flushed, the Kafka group and the Event Hubs
    # checkpoint follow (a flush that stopped calling it went unseen by the random runs,
    # which watch the groups only after a rewind).
    sim: list[FlushSimulation] = []
    replay(
        [
            sim.append,
            *[lambda s: s.update(query="q1", back=0, blob_ack=False)] * 3,
            lambda s: s.time_passes(seconds=2.0),
        ]
    )
    s = sim[0]
    assert s.store.batch("q1") == 3
    assert s.kafka.committed[("spark-name-q1", "events", 0)] == 3
    assert s.eventhubs.blobs[f"{HUB_GROUP}spark-name-q1/checkpoint/0"][0] == 2


def test_a_reset_through_the_daemon_lowers_its_groups_and_nothing_older_raises_them() -> None:
    # Batches 1-3 flushed and committed; the daemon's reset to batch 1 tells its hooks (a
    # rewind): the Kafka group and the Event Hubs checkpoint go down to it.
    sim: list[FlushSimulation] = []
    replay(
        [
            sim.append,
            *[lambda s: s.update(query="q1", back=0, blob_ack=False)] * 3,
            lambda s: s.time_passes(seconds=2.0),
            lambda s: s.reset(query="q1", back=2),
            lambda s: s.time_passes(seconds=2.0),
        ]
    )
    s = sim[0]
    hub = f"{HUB_GROUP}spark-name-q1/checkpoint/0"
    assert s.kafka.committed[("spark-name-q1", "events", 0)] == 1
    assert s.eventhubs.blobs[hub][0] == 0  # the last event processed: batch 1's
    assert s.rewinds["q1"].landed == {f"kafka {('spark-name-q1', 'events', 0)}", f"eventhubs {hub}"}
    # The rule on moves it does not allow: a lowering with no reset of the query, a second
    # lowering after a rewind's first landing, a position from before the reset once the
    # rewind landed.
    position_landed(s, "kafka x", "q2", 3, 1)
    position_landed(s, "kafka y", "q1", 3, 1)  # the rewind landing there: allowed
    position_landed(s, "kafka y", "q1", 3, 1)  # but only once
    position_landed(s, f"eventhubs {hub}", "q1", 1, 3)
    assert s.violations == [
        "kafka x lowered 3 -> 1",
        "kafka y lowered 3 -> 1",
        f"eventhubs {hub} raised to 3 over a reset to 1 (its batches: [1])",
    ]
