"""Each query's blob state (``sidecar.flush.blob_state`` around the pure ``sidecar.flush.core``)
with a fake blob store: the floor cache, blob-mode acks, and a rewind made elsewhere. The
same paths run against Azurite and redis-server in tests/faults/test_blob_floor.py,
tests/integration/test_blob_acks.py and tests/integration/test_reset.py."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from sidecar.buffer.lua import NO_BLOB
from sidecar.errors import CorruptRecord, LeaseConflict, NotOwner, VersionConflict
from sidecar.flush.blob import Seen
from sidecar.flush.blob_state import LISTING_MAX_AGE_S, RECHECK_EVERY_S, BlobStates, Durability
from sidecar.flush.events import AckWanted, Answer, BlobRead, RedisSaid
from sidecar.model.document import Stored, encode_document
from sidecar.telemetry.metrics import Metrics
from tests.helpers import Clock
from tests.unit.fakes import FakeBlobStore, document

QID = "5e1d0000-0000-4000-8000-0000000000f1"
NEW = "5e1d0000-0000-4000-8000-0000000000f2"


def states_of(store: FakeBlobStore, clock: Clock | None = None) -> BlobStates:
    clock = clock or Clock(0.0)
    states = BlobStates(store, "", 15, Metrics(), clock=clock)
    states.leases.use("ours")
    return states


async def written(states: BlobStates, store: FakeBlobStore, query_id: str, batch: int) -> None:
    """A flush's write of ``batch`` under our lease, as the flusher makes it."""
    held = await states.held(query_id, "q")
    assert held is not None
    base = await states.stored(query_id)
    doc = document(query_id, batch)
    assert await states.write(query_id, held, base, doc, encode_document(doc)) is not None


class GatedStore(FakeBlobStore):
    """Reads wait for :attr:`release`, and are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.release = anyio.Event()
        self.reads: list[str] = []

    async def read_stored(self, query_id: str) -> Stored:
        self.reads.append(query_id)
        await self.release.wait()
        return await super().read_stored(query_id)


async def test_concurrent_first_updates_share_one_blob_read() -> None:
    store = GatedStore()
    store.put(QID, 7)
    states = states_of(store)
    got: list[int] = []

    async def load() -> None:
        got.append(await states.load(QID))

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(load)
        await anyio.wait_all_tasks_blocked()
        store.release.set()
    assert store.reads == [QID] and got == [7] * 5
    assert states.known(QID) == 7
    store.release.set()
    await written(states, store, QID, 9)  # a write sets it
    assert states.known(QID) == 9
    states.forget(QID)
    assert states.known(QID) is None and QID not in states


async def test_a_blob_read_begun_before_a_reset_does_not_raise_its_floor_back() -> None:
    # The blob still held batch 9 when the read began; a reset to batch 4 lands meanwhile.
    store = GatedStore()
    store.put(QID, 9)
    states = states_of(store)
    got: list[int] = []

    async def load() -> None:
        got.append(await states.load(QID))

    async with anyio.create_task_group() as tg:
        tg.start_soon(load)
        await anyio.wait_all_tasks_blocked()
        async with states.exclusive(QID):
            now = Stored(store.versions[QID], document(QID, 9))  # as a read under it finds
            states._core.step(BlobRead(QID, now, states.stamp()))
            base = Seen(now)
            held = await states.held(QID, "q")
            assert held is not None and states.begin_write(QID, held, base)
            states.reset(QID, Stored('"reset"', document(QID, 4)))
        store.release.set()
    assert got == [4] and states.known(QID) == 4  # batches 5..9 are stored again


async def test_no_blob_and_an_unreadable_blob_are_no_floor() -> None:
    class Unreadable(FakeBlobStore):
        async def read_stored(self, query_id: str) -> Stored:
            raise CorruptRecord("blob", f"{query_id}.json", "is not a checkpoint document")

    assert await states_of(FakeBlobStore()).load(QID) == NO_BLOB
    unreadable = Unreadable()
    unreadable.put(QID, 3)
    assert await states_of(unreadable).load(QID) == NO_BLOB


async def test_queries_without_a_blob_cost_one_listing_not_a_read_each() -> None:
    class Listed(FakeBlobStore):
        def __init__(self) -> None:
            super().__init__()
            self.reads: list[str] = []
            self.listings: list[float] = []

        async def read_stored(self, query_id: str) -> Stored:
            self.reads.append(query_id)
            return await super().read_stored(query_id)

        async def query_ids(self) -> set[str]:
            self.listings.append(clock.now)
            return await super().query_ids()

    clock = Clock(0.0)
    store = Listed()
    store.put(QID, 4)
    states = states_of(store, clock)
    for i in range(1000):  # a client inventing query ids
        assert await states.load(f"invented-{i}") == NO_BLOB
    assert await states.load(QID) == 4
    assert (len(store.listings), store.reads) == (1, [QID])
    assert len(states) == 1  # no record kept for queries without a blob

    store.put(NEW, 4)  # another daemon created NEW's blob since
    clock.now = LISTING_MAX_AGE_S + 1
    assert await states.load(NEW) == 4
    assert store.listings == [0.0, LISTING_MAX_AGE_S + 1] and store.reads == [QID, NEW]
    await written(states, store, "written-here", 2)  # a first blob, made by our lease
    assert states.known("written-here") == 2
    assert await states.load("written-here") == 2 and len(store.listings) == 2


async def test_a_floor_refusal_reads_a_rewound_blob_again_at_most_every_few_seconds() -> None:
    # A standby read the floor (batch 9); the owner then reset the blob to batch 4.
    clock = Clock(0.0)
    store = FakeBlobStore()
    store.put(QID, 9)
    states = states_of(store, clock)
    assert await states.load(QID) == 9
    store.put(QID, 4)
    assert await states.recheck(QID) == 4  # lowered: batches 5..9 are taken again
    assert states.known(QID) == 4
    store.put(QID, 2)
    assert await states.recheck(QID) is None  # read a moment ago: the refusal stands
    clock.now += RECHECK_EVERY_S
    assert await states.recheck(QID) == 2
    # An ack waits on the answer (ack_mode=blob): read again however recently it was read,
    # or the ack would be answered from the blob as last read.
    store.put(QID, 1)
    assert await states.recheck(QID) is None
    assert await states.recheck(QID, always=True) == 1


async def test_an_ack_deferred_while_its_query_is_in_a_pass_wakes_the_loop_once_released() -> None:
    # An ack that arrives while its query is in a flush pass must not be forgotten when the
    # pass ends without making it durable (a row found not due, a write skipped, not owned or
    # failed).
    store = FakeBlobStore()
    states = states_of(store)
    states.begin([QID])
    async with anyio.create_task_group() as tg:
        tg.start_soon(states.wait_durable, QID, 5, None)
        await anyio.wait_all_tasks_blocked()
        assert not states.wake.is_set()  # deferred: its query is in a pass
        states.end(QID)  # the pass ends without batch 5 in the blob
        assert states.wake.is_set() and not states.in_flight(QID)
        states.wake.clear()
        states.end(QID)  # released again with nothing deferred: no second wake
        assert not states.wake.is_set()
        await written(states, store, QID, 5)
    assert states.waiting() == []  # answered and gone


async def test_an_ack_times_out_when_its_batch_never_reaches_the_blob() -> None:
    store = FakeBlobStore()
    states = states_of(store)
    assert await states.wait_durable(QID, 3, 0.01) is False
    assert states.waiting() == []
    await written(states, store, QID, 3)
    # Held already as last known: never answered from memory, but by a read made for it.
    reads = store.blob_reads
    assert await states.wait_durable(QID, 2, 0.01) is True
    assert store.blob_reads == reads + 1
    # Lowered behind this daemon's back (a twin on its own Redis reset it): the read says so.
    store.put(QID, 1)
    assert await states.wait_durable(QID, 2, 0.01) is False


async def test_redis_flushed_batch_answers_no_ack_only_a_read_of_the_blob_does() -> None:
    # The flusher read Redis' flushed batch (9) at stamp ``since``; meanwhile a read found the
    # blob at batch 3 (another owner rewound it). Redis' word is no evidence for an ack, older
    # or newer than the blob's (a twin on its own Redis may have reset the blob lower): the
    # ack of batch 5 keeps waiting until a read or a write shows the blob holds it.
    states = states_of(FakeBlobStore())
    core = states._core
    waiter: asyncio.Future[Durability] = asyncio.get_running_loop().create_future()
    core.step(AckWanted(QID, 5, waiter))
    since = core.stamp
    assert core.step(BlobRead(QID, Stored('"v3"', document(QID, 3)), core.stamp)) == []
    assert core.floor(QID) == 3
    assert core.step(RedisSaid(QID, 9, 0, since)) == []
    assert core.waiting() == [QID]
    assert core.step(RedisSaid(QID, 9, 0, core.stamp)) == []
    assert core.waiting() == [QID]
    read = BlobRead(QID, Stored('"v9"', document(QID, 9)), core.stamp)
    assert core.step(read) == [Answer((waiter,))]
    assert core.waiting() == []


async def test_an_ack_of_a_query_whose_lease_another_daemon_holds_is_answered_not_owner() -> None:
    # Blob ack mode on a daemon that does not own the query: never an ack that waits until
    # its timeout, but a prompt, retriable not_owner naming who last wrote the blob.
    store = FakeBlobStore()
    store.put(QID, 4)
    await store.acquire_lease(QID, "another daemon", 15)
    states = states_of(store)
    async with anyio.create_task_group() as tg:
        waiting = tg.start_soon  # an ack already waiting when the lease turns out held
        outcome: list[object] = []

        async def ack() -> None:
            try:
                outcome.append(await states.wait_durable(QID, 5, None))
            except NotOwner as exc:
                outcome.append(exc)

        waiting(ack)
        await anyio.wait_all_tasks_blocked()
        assert await states.held(QID, "q") is None  # the flusher's try: refused
    assert isinstance(outcome[0], NotOwner) and "unit pid 1" in str(outcome[0])
    assert states.holders() == {"q": "unit pid 1"}
    with pytest.raises(NotOwner):  # a new ack is answered at once
        await states.wait_durable(QID, 6, None)
    # Even a batch the blob held when read: its owner may have reset it lower since (a twin
    # on its own Redis); only the owner vouches for what its blob holds.
    with pytest.raises(NotOwner):
        await states.wait_durable(QID, 4, None)


async def test_a_write_refused_as_another_writers_reads_the_blob_and_never_goes_below() -> None:
    # Our view: batch 3 at version v. Another writer (a predecessor's late PUT under the same
    # lease id) wrote batch 8 meanwhile. Our write of batch 5 names v: refused, counted, the
    # blob read again, and the plan for batch 5 is now to skip it.
    store = FakeBlobStore()
    store.put(QID, 3)
    metrics = Metrics()
    states = BlobStates(store, "", 15, metrics, clock=Clock(0.0))
    states.leases.use("ours")
    held = await states.held(QID, "q")
    assert held is not None
    base = await states.stored(QID)
    store.put(QID, 8)
    doc = document(QID, 5)
    with pytest.raises(VersionConflict):
        await states.write(QID, held, base, doc, encode_document(doc))
    assert metrics.write_conflicts.labels("checkpoint")._value.get() == 1
    assert states.known(QID) == 8 and store.batch(QID) == 8
    # Read under the lease by the conflict's handling, not by a flush: compared with Redis
    # first (the row read again), then skipped.
    plan = states.plan(QID, 5)
    assert plan.step.value == "compare" and plan.base is not None and plan.base.batch == 8
    states.flushed_in_redis(QID, 3, 0, states.stamp(), judge=True)
    plan = states.plan(QID, 5)
    assert plan.step.value == "skip" and plan.base is not None and plan.base.batch == 8


async def test_retiring_a_query_leaves_no_record_of_it() -> None:
    store = FakeBlobStore()
    states = states_of(store)
    await written(states, store, QID, 2)
    states.applied([], states.stamp())
    assert QID in states
    assert await states.release(QID)
    states.forget(QID)
    assert QID not in states and len(states) == 0 and states.leases.held() == []
    assert QID not in store.leases  # released


async def test_a_lease_taken_by_another_daemon_is_refused_and_not_written_under() -> None:
    store = FakeBlobStore()
    await store.create_if_absent(QID)
    await store.acquire_lease(QID, "twin", 15)
    states = states_of(store)
    assert await states.held(QID, "q") is None
    assert states.leases.contested() == ["q"]
    with pytest.raises(LeaseConflict):
        await store.acquire_lease(QID, "ours", 15)


async def test_the_holder_shown_for_a_lease_held_elsewhere_goes_with_the_query() -> None:
    # Shown while another daemon holds the lease (``/readyz``, the metric's series), kept on
    # the query's record: retiring the query removes both, no map left to keep in step.
    store = FakeBlobStore()
    store.put(QID, 4)
    await store.acquire_lease(QID, "twin", 15)
    metrics = Metrics()
    states = BlobStates(store, "", 15, metrics, clock=Clock(0.0))
    states.leases.use("ours")
    assert await states.held(QID, "q") is None
    [(label, holder)] = states.holders().items()
    assert label == "q" and holder != ""
    series = "checkpoint_sidecar_lease_held_elsewhere"
    assert metrics.registry.get_sample_value(series, {"query": "q", "writer": holder}) == 1
    assert await states.release(QID)
    states.forget(QID)
    assert states.holders() == {}
    assert metrics.registry.get_sample_value(series, {"query": "q", "writer": holder}) is None


async def test_the_audit_takes_a_blob_only_read_here_below_the_last_flush_for_unverified() -> None:
    # Redis' last flush left batch 5 at another version; the store now lists the blob at the
    # version this daemon read for a floor (batch 3): read, never compared with Redis, so it
    # proves nothing: unverified. Seen here holding batch 5 or newer, it would be ours.
    store = FakeBlobStore()
    store.put(QID, 3)
    states = states_of(store)
    assert await states.load(QID) == 3
    assert await states.audit({QID: (5, '"flushed-elsewhere"')}) == [QID]
    assert states.unverified() == [QID] and states.known(QID) == 3
    other = FakeBlobStore()
    other.put(QID, 5)
    states = states_of(other)
    assert await states.load(QID) == 5
    assert await states.audit({QID: (5, '"flushed-elsewhere"')}) == []
