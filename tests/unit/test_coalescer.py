"""The write coalescer and the flush owner's side of its calls, on fakeredis running the real
scripts behind the real ``RedisBuffer`` (the daemon-level path: ``tests/integration/
test_blob_acks.py``)."""

from __future__ import annotations

import anyio
import fakeredis
import pytest

from sidecar.buffer.lua import NO_BLOB
from sidecar.buffer.redis_buffer import Outcome, RedisBuffer
from sidecar.config import Config
from sidecar.errors import BufferUnavailable
from sidecar.flush.owner import FlushOwner
from sidecar.ingest.coalescer import WriteCoalescer
from sidecar.model.checkpoint import Checkpoint
from sidecar.telemetry.metrics import Metrics
from tests.unit.fakes import WRITER, FakeBlobStore, checkpoint


class Recorder:
    """An applier that records each call (query and floor of each update) and applies it."""

    def __init__(self, buffer: RedisBuffer) -> None:
        self.buffer = buffer
        self.calls: list[list[tuple[str, int | None]]] = []

    async def apply(self, checkpoints: list[Checkpoint], floors: list[int | None]) -> list[Outcome]:
        self.calls.append([(c.query_id, f) for c, f in zip(checkpoints, floors, strict=True)])
        return await self.buffer.apply(checkpoints, [NO_BLOB if f is None else f for f in floors])


def fake_buffer() -> tuple[fakeredis.FakeServer, RedisBuffer]:
    server = fakeredis.FakeServer()
    return server, RedisBuffer("redis://fake", "ns", client=fakeredis.FakeAsyncRedis(server=server))


async def test_concurrent_updates_go_in_one_call_and_a_failed_call_fails_each() -> None:
    server, buffer = fake_buffer()
    applier = Recorder(buffer)
    coalescer = WriteCoalescer(applier)
    async with anyio.create_task_group() as tg:
        await tg.start(coalescer.run)
        first = [await coalescer.submit(checkpoint(q, 1)) for q in ("a", "b")]
        stale = await coalescer.submit(checkpoint("a", 1), 7)
        assert [await f for f in first] == [Outcome.APPLIED] * 2
        assert await stale == Outcome.STALE
        # one call for the three, each with its floor (None: the applier's to fill)
        assert applier.calls == [[("a", None), ("b", None), ("a", 7)]]
        server.connected = False
        failed = [await coalescer.submit(checkpoint(q, 2)) for q in ("a", "b")]
        for slot in failed:
            with pytest.raises(BufferUnavailable):
                await slot
        tg.cancel_scope.cancel()


def owner_of(buffer: RedisBuffer, ack_mode: str) -> FlushOwner:
    config = Config(namespace="ns", ack_mode="blob" if ack_mode == "blob" else "redis")
    return FlushOwner(config, buffer, FakeBlobStore(), Metrics(), WRITER)


def kept_row(owner: FlushOwner, query_id: str) -> int | None:
    """The batch of the row kept for the query's next flush (blob ack mode), if any."""
    q = owner._blobs._core.get(query_id)
    return None if q is None or q.row is None else q.row[0].batch_id


async def test_the_flush_owner_fills_the_floors_it_knows_and_keeps_the_rows_in_blob_mode() -> None:
    server, buffer = fake_buffer()
    owner = owner_of(buffer, "blob")
    # Unknown floor, and Redis does not know the query: its blob must be read first.
    assert await owner.apply([checkpoint("a", 1)], [None]) == [Outcome.NEEDS_FLOOR]
    got = await owner.apply([checkpoint("a", 1), checkpoint("b", 4)], [NO_BLOB, NO_BLOB])
    assert got == [Outcome.APPLIED, Outcome.APPLIED]
    assert (kept_row(owner, "a"), kept_row(owner, "b")) == (1, 4)
    # A call that raises may have run: the rows kept of its queries are void, no other.
    server.connected = False
    with pytest.raises(BufferUnavailable):
        await owner.apply([checkpoint("a", 2)], [NO_BLOB])
    assert (kept_row(owner, "a"), kept_row(owner, "b")) == (None, 4)


async def test_in_redis_ack_mode_the_flush_owner_keeps_no_row() -> None:
    _, buffer = fake_buffer()
    owner = owner_of(buffer, "redis")
    assert await owner.apply([checkpoint("a", 1)], [NO_BLOB]) == [Outcome.APPLIED]
    assert kept_row(owner, "a") is None
