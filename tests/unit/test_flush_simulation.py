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
the blob), gets, time passing, the store slow, down, or timing out a write that did land, a
lease broken or taken by another owner (who may flush, or reset, too), Redis down or emptied,
resets and retirements, and the daemon restarted (cleanly, or killed). Checked after every
step (the invariants written at the top of ``sidecar.flush.core``):

- no blob, Redis record or ``get`` answer moves backwards, except by a reset, a retirement
  or Redis losing its data;
- a blob-mode ack is answered only when its batch is (or was, since it began) in the blob;
- a reset is never undone: after it, only batches applied after it are written;
- a write is made only by the lease holder, as its lease manager sees it;

and once the faults stop (at the end of each run), every acknowledged batch reaches the blob
and every ack whose batch is in the blob is answered.

``make test`` runs a few hundred examples; ``make simulate`` many more
(``SIMULATION_EXAMPLES``). Each defect found stays below as an ``@example``-style test.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import fakeredis
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sidecar.backoff import Backoff
from sidecar.buffer.redis_buffer import RedisBuffer
from sidecar.config import Config
from sidecar.daemon.admin_ops import DaemonAdmin
from sidecar.daemon.retirement import Retirement
from sidecar.errors import SidecarError, StoreUnavailable
from sidecar.flush.blob_state import RETRY_BASE_S, RETRY_CAP_S, BlobStates
from sidecar.flush.flusher import Flusher
from sidecar.flush.lease import LeaseManager, LeaseState
from sidecar.ingest.coalescer import WriteCoalescer
from sidecar.ingest.handler import RequestHandler
from sidecar.model import checkpoint as ckpt
from sidecar.model.document import (
    CheckpointDocument,
    Writer,
    decode_document,
    encode_document,
    reset_document,
)
from sidecar.store.blobs import BlobStore
from sidecar.telemetry.metrics import Metrics
from sidecar.wire.protocol import ClientConnection, Get, Progress, Reset, Retire, SourceSpec
from tests.unit.fakes import WRITER, FakeBlobStore, Lease, checkpoint
from tests.unit.simloop import VirtualTimeLoop

QUERIES = ("q1", "q2")
NS = "sim"
LEASE_S = 15
CONFIG = Config(
    namespace=NS,
    count_threshold=3,
    time_threshold_s=3600,  # Redis' clock is the wall clock: only counts, acks and stops flush
    flush_interval_s=0.5,
    flush_concurrency=4,
    history_size=4,
    lease_duration_s=LEASE_S,
    admin_ops=True,
)
EXAMPLES = int(os.environ.get("SIMULATION_EXAMPLES", "150"))
T = TypeVar("T")


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
        self, query_id: str, body: bytes, *, lease_id: str, query_name: str | None
    ) -> None:
        daemon = self.sim.daemon
        if lease_id == daemon.lease_id and daemon.leases.state(query_id) is not LeaseState.HELD:
            self.sim.violations.append(f"write of {query_id} without a HELD lease")
        await self._slow()
        await super().write(query_id, body, lease_id=lease_id, query_name=query_name)
        self._took(query_id, self.writes[-1][1], lease_id)
        if self.time_out_next_write:
            self.time_out_next_write = False
            raise StoreUnavailable("sim: write timed out (it landed)")

    async def read(self, query_id: str) -> CheckpointDocument | None:
        await self._slow()
        return await super().read(query_id)

    async def acquire_lease(self, query_id: str, lease_id: str, duration_s: int) -> None:
        await self._slow()
        await super().acquire_lease(query_id, lease_id, duration_s)

    def put(self, query_id: str, batch: int) -> None:
        super().put(query_id, batch)
        self._took(query_id, batch, "thief")

    def put_document(self, query_id: str, doc: CheckpointDocument) -> None:
        """Write ``doc`` as another owner would (no lease checked)."""
        self.bodies[query_id] = encode_document(doc)
        self._took(query_id, doc.batch_id, "thief")

    def document(self, query_id: str) -> CheckpointDocument | None:
        return decode_document(self.bodies.get(query_id, b""), query_id, query_id)

    def blob_name(self, query_id: str) -> str:
        return f"{NS}/{query_id}.json"


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

    def __init__(self, sim: FlushSimulation, number: int) -> None:
        self.lease_id = f"daemon-{number}"
        clock = sim.loop.time
        self.metrics = Metrics()
        self.buffer = RedisBuffer(
            "redis://sim", NS, client=fakeredis.FakeAsyncRedis(server=sim.redis)
        )
        # No randomness: the same steps must always interleave the same way.
        self.leases = LeaseManager(
            sim.store, self.lease_id, LEASE_S, self.metrics, clock=clock, jitter=lambda: 0.5
        )
        backoff = Backoff(RETRY_BASE_S, RETRY_CAP_S, clock=clock, jitter=lambda: 0.5)
        self.blobs = BlobStates(sim.store, self.leases, clock=clock, backoff=backoff)
        writer = Writer(host="sim", pid=number, instance_id=self.lease_id)
        self.flusher = Flusher(CONFIG, self.buffer, sim.store, self.blobs, self.metrics, writer)
        self.retirement = Retirement(3600, release=self.blobs.release, clock=clock)
        self.retirement.busy.append(self.flusher.busy)
        self.retirement.forget.append(self.blobs.forget)
        # Odd daemons take the rows each apply returns (blob ack mode's wiring), even ones
        # read every row they flush from Redis (redis ack mode's): a restart switches.
        rows = self.flusher if number % 2 else None
        self.coalescer = WriteCoalescer(self.buffer, rows=rows)

        async def lookup_blob(query_id: str | None, name: str | None) -> bytes | None:
            doc = await sim.store.read(query_id) if query_id else None
            return ckpt.encode(doc.checkpoint()) if doc is not None else None

        self.handler = RequestHandler(
            self.coalescer, self.buffer, self.metrics, lookup_blob=lookup_blob, floors=self.blobs
        )
        # The fake serves every call the daemon's side of the admin ops makes.
        store = cast(BlobStore, sim.store)
        self.admin = DaemonAdmin(
            CONFIG, self.buffer, store, self.blobs, self.retirement, self.metrics, writer
        )
        loop = sim.loop
        self.tasks = [
            loop.create_task(self.coalescer.run()),
            loop.create_task(self.leases.run()),
            loop.create_task(self.flusher.run()),
        ]


class FlushSimulation(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.runner = asyncio.Runner(loop_factory=VirtualTimeLoop)
        self.loop = self.runner.get_loop()
        self.redis = fakeredis.FakeServer()
        self.violations: list[str] = []
        self.store = SimStore(self)
        self.daemons = 0
        self.daemon = self._start()
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

    # --- plumbing --------------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.loop.time()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coro)

    def _start(self) -> SimDaemon:
        self.daemons += 1

        async def start() -> SimDaemon:  # anyio's primitives are made on a running loop
            return SimDaemon(self, self.daemons)

        return self.run(start())

    def wrote(self, query_id: str, batch: int, writer: str) -> None:
        allowed = self.since_reset[query_id]
        lowering = query_id in self.store.lowering
        if writer != "thief" and allowed is not None and batch not in allowed and not lowering:
            self.violations.append(f"{query_id}: batch {batch} written after a reset undid it")

    def _rid(self) -> int:
        self.ids += 1
        return self.ids

    async def _request(self, event: Progress | Get) -> Any:
        data = await (await self.daemon.handler.begin(event))
        return ClientConnection().receive_data(data)[0]

    def _forget_model(self, query_id: str) -> None:
        """A reset, retirement or Redis loss: what was acked before is not owed any more."""
        self.acked[query_id].clear()
        self.got[query_id] = None
        self.redis_batch[query_id] = None

    async def _redis_batch(self, query_id: str) -> int | None:
        client = fakeredis.FakeAsyncRedis(server=self.redis)
        try:
            value = await client.hget(f"cps:{{{NS}}}:q:{query_id}", "batch_id")
        except Exception:
            return None
        finally:
            await client.aclose()
        return int(value) if value is not None else None

    # --- steps -------------------------------------------------------------------------------

    @initialize()
    def settle(self) -> None:
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
            self.acked[query].add(batch)
            allowed = self.since_reset[query]
            if allowed is not None:
                allowed.add(batch)
        if reply.ok and blob_ack:
            began = len(self.store.history[query]) - 1
            task = self.loop.create_task(self.daemon.blobs.wait_durable(query, batch, None))
            self.acks.append(BlobAck(query, batch, began, task))
            self.run(asyncio.sleep(0))

    @rule(query=st.sampled_from(QUERIES))
    def get(self, query: str) -> None:
        reply = self.run(self._request(Get(self._rid(), query)))
        if not reply.ok or reply.checkpoint is None:
            return
        batch = int(reply.checkpoint["batch_id"])
        before = self.got[query]
        if before is not None and batch < before:
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
            batch = self.run(self._redis_batch(query))
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
        connected, self.redis.connected = self.redis.connected, True
        self.run(self._redis_reset(query, target))
        self.redis.connected = connected
        previous = self.store.document(query)
        reset = reset_document(
            previous, checkpoint(query, target), WRITER, reason="r", history_size=4
        )
        self.store.lowering.add(query)
        self.store.put_document(query, reset)
        self.store.lowering.discard(query)
        self._forget_model(query)
        self.since_reset[query] = set()
        self.redis_batch[query] = target

    async def _flushall(self) -> None:
        client = fakeredis.FakeAsyncRedis(server=self.redis)
        await client.flushall()
        await client.aclose()

    async def _redis_reset(self, query: str, batch: int) -> None:
        buffer = RedisBuffer("redis://sim", NS, client=fakeredis.FakeAsyncRedis(server=self.redis))
        try:
            await buffer.reset(checkpoint(query, batch, name=f"name-{query}"), None)
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
        request = Reset(
            reason="sim",
            query_id=query,
            sources=(SourceSpec(end_offset=target, description="rate"),),
            batch_id=target,
            force=True,
        )
        self.store.lowering.add(query)
        try:
            self.run(self.daemon.admin(request))
        except SidecarError:
            pass
        finally:
            self.store.lowering.discard(query)
        if self.run(self._redis_batch(query)) == target:  # Redis was set: the reset counts
            self._forget_model(query)
            self.since_reset[query] = set()
            self.redis_batch[query] = target

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

    @rule(killed=st.booleans())
    def restart(self, killed: bool) -> None:
        """The daemon stops (cleanly: loops stopped, a final flush, leases released; or
        killed) and a new one starts on the same Redis and store."""
        old = self.daemon
        if not killed:
            self.run(self._stop(old))
        for task in old.tasks + [a.task for a in self.acks]:
            task.cancel()
        self.run(asyncio.sleep(0))
        self.acks = []
        self.daemon = self._start()
        self.run(asyncio.sleep(0.1))

    async def _stop(self, daemon: SimDaemon) -> None:
        await daemon.flusher.stop_loop()
        try:
            with_deadline = asyncio.timeout(8)
            async with with_deadline:
                await daemon.flusher.final_flush()
        except TimeoutError:
            pass
        await daemon.leases.release_all()

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def nothing_moved_backwards_and_every_answer_was_true(self) -> None:
        for a in self.acks:
            if a.task.done() and not a.task.cancelled() and a.task.result():
                seen = self.store.history[a.query][max(a.began, 0) :]
                if not seen or max(seen) < a.batch:
                    self.violations.append(f"ack {a.query}@{a.batch} answered, blob had {seen}")
        self.acks = [a for a in self.acks if not a.task.done()]
        for query in QUERIES:
            batch = self.run(self._redis_batch(query)) if self.redis.connected else None
            if batch is None:
                continue
            before = self.redis_batch[query]
            if before is not None and batch < before:
                self.violations.append(f"Redis {query} moved back {before} -> {batch}")
            self.redis_batch[query] = batch
        assert self.violations == [], self.violations

    def teardown(self) -> None:
        try:
            self._once_faults_stop()
        finally:
            for task in self.daemon.tasks + [a.task for a in self.acks]:
                task.cancel()
            self.runner.close()

    def _once_faults_stop(self) -> None:
        """Heal everything, let time pass; every acknowledged batch reaches the blob and every
        ack whose batch is there is answered."""
        self.store.down = self.store.time_out_next_write = False
        self.redis.connected = True
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
        for query in QUERIES:
            held = self.store.batch(query)
            owed = max(self.acked[query], default=None)
            assert owed is None or (held is not None and held >= owed), (
                f"{query}: acknowledged batch {owed} never reached the blob (it holds {held})"
            )
        for a in acks:
            held = self.store.batch(a.query)
            if held is not None and held >= a.batch:
                assert a.task.done() and a.task.result(), f"ack {a.query}@{a.batch} never answered"
        assert self.violations == [], self.violations


FlushSimulation.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
TestFlushSimulation = FlushSimulation.TestCase


def replay(steps: list[str]) -> None:
    """Run ``steps`` (rule calls, as Hypothesis prints them) with the invariants after each
    and the end-of-run checks, as the state machine would."""
    sim = FlushSimulation()
    try:
        for step in ["settle()", *steps]:
            eval(f"sim.{step}", {"sim": sim})
            sim.nothing_moved_backwards_and_every_answer_was_true()
    except BaseException:
        for task in sim.daemon.tasks:
            task.cancel()
        sim.runner.close()
        raise
    sim.teardown()


#: Every defect the simulation found, as the steps that showed it (shrunk by hand).
FOUND = {
    # A row read while a reset was under way (after its start, before its Redis write) was
    # flushed after it: batch 1 came back over the reset. (The op now stamps its end too.)
    "a row read during a reset": [
        "update(query='q1', back=0, blob_ack=False)",
        "restart(killed=False)",
        "update(query='q1', back=0, blob_ack=False)",
        "store_latency(latency_s=0.3)",
        "redis_down(down=True)",
        "restart(killed=False)",
        "redis_down(down=False)",
        "reset(query='q1', back=0)",
    ],
    # A reset whose blob write timed out after landing left the durable batch above the
    # blob: an ack of a batch the reset dropped was answered.
    "a reset whose write timed out": [
        "update(query='q1', back=0, blob_ack=False)",
        "update(query='q1', back=0, blob_ack=False)",
        "restart(killed=False)",
        "a_write_times_out_after_landing()",
        "reset(query='q1', back=2)",
        "update(query='q1', back=1, blob_ack=True)",
    ],
    # A row read before the lease was ours predated another owner's reset (and release).
    "a row read before another owner's reset": [
        "update(query='q1', back=0, blob_ack=False)",
        "restart(killed=False)",
        "store_latency(latency_s=1.5)",
        "update(query='q1', back=0, blob_ack=True)",
        "failover_and_back(query='q1', flush=False, reset_back=1)",
    ],
    # Redis lost its data during a flush and an update re-created the record: its version
    # counter restarted, equal to the flushed row's, and the flush marked the newer batch
    # flushed (an acknowledged update lost). Marking now keeps a batch newer than the blob's
    # pending.
    "a mark after Redis lost the record": [
        "store_latency(latency_s=1.5)",
        "update(query='q1', back=0, blob_ack=True)",
        "redis_loses_its_data()",
        "update(query='q1', back=0, blob_ack=False)",
    ],
    # After Redis lost its data, a blob-mode ack of a batch the blob held waited for a write
    # that would never come. (A floor read from the blob now counts for acks.)
    "an ack after Redis lost its data": [
        "update(query='q1', back=0, blob_ack=False)",
        "restart(killed=False)",
        "redis_loses_its_data()",
        "update(query='q1', back=1, blob_ack=True)",
    ],
    # A reset read the blob slowly; meanwhile the lease's renewal was refused (another owner
    # had broken it and let go), and the reset wrote with a lease its manager knew was lost.
    # (Azure refuses that write while nobody holds the lease; had the lease been taken again
    # under a new term meanwhile, a write planned from the old term's read would land.) Every
    # write now checks, right before it, that the term it planned under is still held.
    "a write after the lease was lost during a slow read": [
        "store_latency(latency_s=1.5)",
        "update(query='q1', back=0, blob_ack=False)",
        "restart(killed=False)",
        "a_write_times_out_after_landing()",
        "reset(query='q1', back=0)",
        "failover_and_back(query='q1', flush=False, reset_back=None)",
        "reset(query='q1', back=0)",
    ],
    # A write timed out after landing batch 1; Redis then lost its data, and batch 0 was
    # stored under the floor known before that write (no blob; and the namespace's listing,
    # made before the lease created the blob, said "no blob" too): `get` went from 1 back to
    # 0. A write whose outcome is unknown now forgets the floor, and acquiring a lease adds
    # its blob to the listing, so the blob is read before such an update is stored.
    "an older batch after a write of unknown outcome and a Redis loss": [
        "a_write_times_out_after_landing()",
        "update(query='q1', back=0, blob_ack=True)",
        "redis_loses_its_data()",
        "get(query='q1')",
        "update(query='q1', back=1, blob_ack=True)",
        "get(query='q1')",
    ],
    # Another owner reset the blob from batch 1 to 0 and let go; batch 1 came again, the
    # floor (1) alone refused it, and the floor read again said 0, but the durable batch
    # stayed 1: its blob-mode ack was answered at once, the blob holding 0. A floor read
    # again exactly now sets the durable batch too, down as well as up.
    "an ack after another owner rewound the blob": [
        "update(query='q2', back=0, blob_ack=True)",
        "update(query='q2', back=0, blob_ack=False)",
        "failover_and_back(query='q2', flush=False, reset_back=1)",
        "update(query='q2', back=1, blob_ack=True)",
    ],
    # A write of batch 1 timed out after landing while its blob-mode ack waited; a `get` read
    # the floor (1) from the blob, which made batch 1 durable without answering that ack,
    # and nothing later could (Redis' flushed batch equal to the durable one is no news): it
    # waited forever. A floor read now answers the acks it makes durable.
    "an ack made durable by a floor read": [
        "a_write_times_out_after_landing()",
        "update(query='q2', back=0, blob_ack=True)",
        "get(query='q2')",
        "failover_and_back(query='q2', flush=False, reset_back=0)",
    ],
}


@pytest.mark.parametrize("steps", list(FOUND.values()), ids=list(FOUND))
def test_what_the_simulation_found_stays_found(steps: list[str]) -> None:
    replay(steps)


def test_a_document_read_under_one_lease_term_is_not_trusted_under_the_next() -> None:
    # Our daemon knew the blob at batch 3, its lease was broken, another owner wrote batch 9
    # and let go. Its next write (batch 4, for a blob-mode ack) meets the broken lease, and
    # the lease comes back under a new term: what it knew of the blob must be read again,
    # else batch 4 would move the blob back from 9.
    replay(
        [
            "update(query='q1', back=0, blob_ack=False)",
            "update(query='q1', back=0, blob_ack=False)",
            "update(query='q1', back=0, blob_ack=False)",
            "time_passes(seconds=0.6)",
            "lease_broken(query='q1')",
            "another_owner(query='q1', flush=False)",
            "store.put('q1', 9)",
            "another_owner_lets_go(query='q1')",
            "update(query='q1', back=0, blob_ack=True)",
            "time_passes(seconds=20.0)",
        ]
    )
