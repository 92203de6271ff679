"""Each query's blob state (``sidecar.flush.blob_state`` around the pure ``sidecar.flush.core``)
with a fake blob store: the floor cache, blob-mode acks, and a rewind made elsewhere. The
same paths run against Azurite and redis-server in tests/faults/test_blob_floor.py,
tests/integration/test_blob_acks.py and tests/integration/test_reset.py."""

from __future__ import annotations

import asyncio

import anyio

from sidecar.buffer.lua import NO_BLOB
from sidecar.errors import CorruptRecord
from sidecar.flush.blob_state import LISTING_MAX_AGE_S, RECHECK_EVERY_S, BlobStates
from sidecar.flush.lease import Held, LeaseManager
from sidecar.model.document import CheckpointDocument
from sidecar.telemetry.metrics import Metrics
from tests.helpers import Clock
from tests.unit.fakes import FakeBlobStore, document

QID = "5e1d0000-0000-4000-8000-0000000000f1"
NEW = "5e1d0000-0000-4000-8000-0000000000f2"


def states_of(store: FakeBlobStore, clock: Clock | None = None) -> BlobStates:
    clock = clock or Clock(0.0)
    leases = LeaseManager(store, "ours", 15, Metrics(), clock=clock)
    return BlobStates(store, leases, clock=clock)


class GatedStore(FakeBlobStore):
    """Reads wait for :attr:`release`, and are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.release = anyio.Event()
        self.reads: list[str] = []

    async def read(self, query_id: str) -> CheckpointDocument | None:
        self.reads.append(query_id)
        await self.release.wait()
        return await super().read(query_id)


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
    # A read without the lease never lowers it; a write under the lease sets it.
    assert states.core.floor_read(QID, 5, states.core.stamp, exact=False) == (7, [])
    assert states.known(QID) == 7
    states.core.written(QID, 1, document(QID, 9))
    assert states.known(QID) == 9
    states.forget(QID)
    assert states.known(QID) is None


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
            states.reset(QID, Held(QID, term=1), document(QID, 4))
        store.release.set()
    assert got == [4] and states.known(QID) == 4  # batches 5..9 are stored again


async def test_no_blob_and_an_unreadable_blob_are_no_floor() -> None:
    class Unreadable(FakeBlobStore):
        async def read(self, query_id: str) -> CheckpointDocument | None:
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

        async def read(self, query_id: str) -> CheckpointDocument | None:
            self.reads.append(query_id)
            return await super().read(query_id)

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
    assert len(states.core) == 1  # no floor kept for queries without a blob

    store.put(NEW, 4)  # another daemon created NEW's blob since
    clock.now = LISTING_MAX_AGE_S + 1
    assert await states.load(NEW) == 4
    assert store.listings == [0.0, LISTING_MAX_AGE_S + 1] and store.reads == [QID, NEW]
    states.core.written("written-here", 1, document("written-here", 2))  # a first blob
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


async def test_an_ack_deferred_while_its_query_is_in_a_pass_wakes_the_loop_once_released() -> None:
    # An ack that arrives while its query is in a flush pass must not be forgotten when the
    # pass ends without making it durable (a row found not due, a write skipped, not owned or
    # failed).
    states = states_of(FakeBlobStore())
    states.begin([QID])
    async with anyio.create_task_group() as tg:
        tg.start_soon(states.wait_durable, QID, 5, None)
        await anyio.wait_all_tasks_blocked()
        assert not states.wake.is_set()  # deferred: its query is in a pass
        states.end(QID)  # the pass ends without batch 5 in the blob
        assert states.wake.is_set() and not states.core.in_flight(QID)
        states.wake.clear()
        states.end(QID)  # released again with nothing deferred: no second wake
        assert not states.wake.is_set()
        states.written(QID, Held(QID, term=1), document(QID, 5))
    assert states.waiting() == []  # answered and gone


async def test_an_ack_times_out_when_its_batch_never_reaches_the_blob() -> None:
    states = states_of(FakeBlobStore())
    assert await states.wait_durable(QID, 3, 0.01) is False
    assert states.waiting() == []
    states.written(QID, Held(QID, term=1), document(QID, 3))
    assert await states.wait_durable(QID, 2, 0.01) is True  # durable already: no wait


async def test_redis_flushed_batch_read_before_newer_blob_evidence_answers_no_ack() -> None:
    # The flusher read Redis' flushed batch (9) at stamp ``since``; meanwhile a read under the
    # lease found the blob at batch 3 (another owner rewound it). Redis' older word is no
    # evidence now: the ack of batch 5 keeps waiting. Read after the lease's word, it counts.
    states = states_of(FakeBlobStore())
    core = states.core
    waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    core.ack(QID, 5, waiter)
    since = core.stamp
    assert core.read(QID, 1, document(QID, 3)) == []
    assert core.flushed_in_redis(QID, 9, since) == []
    assert core.waiting() == [QID]
    assert core.flushed_in_redis(QID, 9, core.stamp) == [waiter]
    assert core.waiting() == []
