"""The write coalescer's hand-over of rows (blob ack mode), on fakeredis running the real
scripts behind the real ``RedisBuffer`` (the daemon-level path: ``tests/integration/
test_blob_acks.py``)."""

from __future__ import annotations

import anyio
import fakeredis
import pytest

from sidecar.buffer.redis_buffer import Outcome, PendingQuery, RedisBuffer
from sidecar.errors import BufferUnavailable
from sidecar.ingest.coalescer import WriteCoalescer
from tests.unit.fakes import checkpoint


class Sink:
    def __init__(self) -> None:
        self.stamps = 0
        self.rows: list[tuple[str, int, int]] = []
        self.unknown_ids: list[str] = []

    def stamp(self) -> int:
        self.stamps += 1
        return self.stamps

    def applied(self, rows: list[PendingQuery], since: int) -> None:
        self.rows += [(r.query_id, r.batch_id, since) for r in rows]

    def void(self, query_ids: list[str]) -> None:
        self.unknown_ids += query_ids


async def test_rows_go_to_the_sink_and_a_failed_call_voids_its_queries() -> None:
    server = fakeredis.FakeServer()
    buffer = RedisBuffer("redis://fake", "ns", client=fakeredis.FakeAsyncRedis(server=server))
    sink = Sink()
    coalescer = WriteCoalescer(buffer, rows=sink)
    async with anyio.create_task_group() as tg:
        await tg.start(coalescer.run)
        first = [await coalescer.submit(checkpoint(q, 1), -1) for q in ("a", "b")]
        stale = await coalescer.submit(checkpoint("a", 1), -1)
        assert [await f for f in first] == [Outcome.APPLIED] * 2
        assert await stale == Outcome.STALE
        # one call for the three (one stamp, taken before it); the stale update has no row
        assert sink.rows == [("a", 1, 1), ("b", 1, 1)] and sink.stamps == 1
        server.connected = False
        failed = await coalescer.submit(checkpoint("b", 2), -1)
        with pytest.raises(BufferUnavailable):
            await failed
        assert sink.unknown_ids == ["b"] and len(sink.rows) == 2
        tg.cancel_scope.cancel()
