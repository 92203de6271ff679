"""What bench/compare.py measures, each on the same workload and driven the same way.

The workload: :data:`QUERIES` Spark queries reading :data:`PARTITIONS` Kafka partitions each;
one update is one micro-batch's progress of one query (bench/ingest.py's shape, ~2 KB),
batch ids increasing per query, queries taken in turn. The targets:

* :class:`Daemon`: the sidecar daemon over its Unix socket (a separate process; its Redis
  is another). ``connections`` sockets, ``window`` requests pipelined on each; a query
  belongs to one connection, as a Spark driver's queries share its one connection.
* :class:`DirectWriter`: what a user writes instead of the sidecar: each update written
  straight to its query's blob (Put Blob, azure-storage-blob aio) under a lease this
  process holds and renews a third of its duration after the last renewal, like the daemon.
* :class:`EventHubsStore`: Azure Event Hubs' ``BlobCheckpointStore``
  (azure-eventhub-checkpointstoreblob-aio), the way an Event Hubs consumer checkpoints:
  ``update_checkpoint`` once per partition per micro-batch (the partitions concurrently),
  and partition ownership listed and claimed (renewed) per query every
  :data:`OWNERSHIP_EVERY_S`, azure-eventhub's default load-balancing interval.

In-process targets use ``workers`` tasks, each owning the queries ``q % workers`` and
writing one update at a time: one query's updates are never written concurrently (a later
write could land first). An update counts once it is acknowledged (daemon: ``ok`` and
``applied``; peers: every call returned).
"""

from __future__ import annotations

import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
from anyio.abc import ByteStream
from azure.eventhub.extensions.checkpointstoreblobaio import BlobCheckpointStore
from azure.storage.blob.aio import BlobClient, BlobLeaseClient, BlobServiceClient

from bench.common import BenchError
from bench.ingest import progress_line
from bench.tools import TEMPLATE_BATCH, LineTemplate, OpenLoop, due_count, schedule
from sidecar.wire.protocol import ClientConnection

QUERIES, PARTITIONS = 10, 32
LEASE_S = 30  # the daemon's default lease_duration_s
RENEW_EVERY_S = LEASE_S / 3  # sidecar.flush.lease renews a third of the duration after the last
OWNERSHIP_EVERY_S = 30.0  # azure-eventhub's default load_balancing_interval
#: How long after its window an open-loop run still waits for answers.
GRACE_S = 2.0
#: How long after its window a throughput run waits for the replies still due (a blob-mode
#: ack can take a flush tick or more; what comes later is not counted).
DRAIN_S = 0.5
EH_NAMESPACE, EH_GROUP = "bench.servicebus.windows.net", "$default"


class Queries:
    """The queries' ids, their next batch ids, and their request lines."""

    def __init__(self) -> None:
        self.ids = [str(uuid.uuid4()) for _ in range(QUERIES)]
        self._templates = [LineTemplate(progress_line(q, TEMPLATE_BATCH, PARTITIONS))
                           for q in self.ids]  # fmt: skip
        self._next = [1] * QUERIES

    def take(self, q: int) -> int:
        """The next batch id of query ``q`` (each is taken once)."""
        self._next[q] += 1
        return self._next[q] - 1

    def line(self, q: int, batch: int) -> bytes:
        return self._templates[q].line(batch)


def owned(worker: int, workers: int) -> list[int]:
    return [q for q in range(QUERIES) if q % workers == worker]


def open_loop_record(rate: float, seconds: float) -> OpenLoop:
    scheduled = schedule(time.perf_counter() + 0.05, rate, seconds)
    return OpenLoop(rate, seconds, scheduled, done=[None] * len(scheduled))


async def pace(rec: OpenLoop, send: Callable[[int, int], Awaitable[None]]) -> None:
    """Call ``send(first, last)`` for the requests due, on ``rec``'s absolute schedule."""
    n = 0
    while n < len(rec.scheduled):
        now = time.perf_counter()
        if (due := due_count(rec.scheduled, now, n)) == n:
            await anyio.sleep(rec.scheduled[n] - now)
            continue
        rec.sent.extend([now] * (due - n))
        await send(n, due)
        n = due


class Daemon:
    """The daemon process at ``socket_path``; ``queries`` shared by every run against it."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.queries = Queries()

    async def throughput(self, connections: int, window: int, seconds: float) -> Counter[str]:
        """Keep ``window`` requests in flight on each connection for ``seconds``, then wait
        up to :data:`DRAIN_S` for the replies. Counts replies by outcome, plus
        ``seconds_x1000`` (from the first send to the last reply or the end of the wait)."""
        counts: Counter[str] = Counter()
        streams = [await anyio.connect_unix(self.socket_path) for _ in range(connections)]
        try:
            started = time.perf_counter()
            deadline, ends = started + seconds, [started]
            with anyio.move_on_after(seconds + DRAIN_S) as scope:
                async with anyio.create_task_group() as tg:
                    for k, stream in enumerate(streams):
                        mine = owned(k, connections)
                        tg.start_soon(self._drive, stream, mine, window, deadline, counts, ends)
        finally:
            for stream in streams:  # unanswered requests are left to the daemon
                await stream.aclose()
        took = seconds + DRAIN_S if scope.cancelled_caught else max(ends) - started
        counts["seconds_x1000"] = round(took * 1000)
        return counts

    async def _drive(self, stream: ByteStream, mine: list[int], window: int, deadline: float,
                     counts: Counter[str], ends: list[float]) -> None:  # fmt: skip
        conn, turn = ClientConnection(), 0

        def lines(n: int) -> bytes:
            nonlocal turn
            out = []
            for _ in range(n):
                q = mine[turn % len(mine)]
                turn += 1
                out.append(self.queries.line(q, self.queries.take(q)))
            return b"".join(out)

        await stream.send(lines(window))
        sent, received = window, 0
        while received < sent:
            replies = conn.receive_data(await stream.receive())
            for r in replies:
                counts["acked" if r.ok and r.applied else r.error.code if r.error else "stale"] += 1
            received += len(replies)
            if replies and time.perf_counter() < deadline:
                await stream.send(lines(len(replies)))
                sent += len(replies)
        ends.append(time.perf_counter())

    async def open_loop(self, rate: float, seconds: float) -> OpenLoop:
        """One connection (as one Spark driver's), requests sent on schedule, pipelined."""
        rec, conn = open_loop_record(rate, seconds), ClientConnection()
        order = [i % QUERIES for i in range(len(rec.scheduled))]
        async with await anyio.connect_unix(self.socket_path) as stream:

            async def send(first: int, last: int) -> None:
                await stream.send(b"".join(self.queries.line(order[i], self.queries.take(
                    order[i])) for i in range(first, last)))  # fmt: skip

            async def receive() -> None:
                got = 0
                while got < len(rec.scheduled):
                    for r in conn.receive_data(await stream.receive()):
                        if r.ok and r.applied:
                            rec.done[got] = time.perf_counter()
                        got += 1

            # A daemon that stops reading blocks a send: the run still ends on time, and
            # what is still unanswered (or unsent) then counts as not completed.
            with anyio.move_on_after(rec.scheduled[-1] + GRACE_S - time.perf_counter()):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(pace, rec, send)
                    await receive()  # all answered: every request was sent
        return rec


class InProcess:
    """A peer written in this process: ``update(q, batch)`` checkpoints one micro-batch."""

    #: The blob container it writes to.
    container: str

    def __init__(self) -> None:
        self.queries = Queries()

    async def update(self, q: int, batch: int) -> None:
        raise NotImplementedError

    async def throughput(self, workers: int, window: int, seconds: float) -> Counter[str]:
        """``workers`` tasks, each updating its queries in turn, one at a time, until
        ``seconds`` have passed (``window`` is the daemon's; here always 1)."""
        if window != 1:
            raise ValueError("an in-process peer writes one update of a query at a time")
        counts: Counter[str] = Counter()
        started = time.perf_counter()
        deadline, ends = started + seconds, [started]

        async def work(mine: list[int]) -> None:
            turn = 0
            while time.perf_counter() < deadline:
                q = mine[turn % len(mine)]
                turn += 1
                await self.update(q, self.queries.take(q))
                counts["acked"] += 1
            ends.append(time.perf_counter())

        with anyio.fail_after(seconds + 120):
            async with anyio.create_task_group() as tg:
                for k in range(workers):
                    tg.start_soon(work, owned(k, workers))
        counts["seconds_x1000"] = round((max(ends) - started) * 1000)
        return counts

    async def open_loop(self, rate: float, seconds: float) -> OpenLoop:
        """Requests handed over on schedule to one task per query, which writes them in
        order (a query's updates queue up behind its slow write)."""
        rec = open_loop_record(rate, seconds)
        send_to, receive_from = zip(*(anyio.create_memory_object_stream[int](math.inf)
                                      for _ in range(QUERIES)), strict=True)  # fmt: skip

        async def work(q: int) -> None:
            async with receive_from[q]:
                async for i in receive_from[q]:
                    await self.update(q, self.queries.take(q))
                    rec.done[i] = time.perf_counter()

        async def send(first: int, last: int) -> None:
            for i in range(first, last):
                send_to[i % QUERIES].send_nowait(i)

        with anyio.move_on_after(rec.scheduled[-1] + GRACE_S - time.perf_counter()):
            async with anyio.create_task_group() as tg:
                for q in range(QUERIES):
                    tg.start_soon(work, q)
                await pace(rec, send)
                for stream in send_to:
                    stream.close()
        return rec


class DirectWriter(InProcess):
    """Each update written straight to its query's blob under a held lease."""

    def __init__(self, service: BlobServiceClient, container: str) -> None:
        super().__init__()
        self.container = container
        self._blobs: list[BlobClient] = [service.get_blob_client(container, f"{q}.json")
                                         for q in self.queries.ids]  # fmt: skip
        self._leases: list[BlobLeaseClient] = []

    async def start(self) -> None:
        for blob in self._blobs:
            await blob.upload_blob(b"{}", overwrite=True)  # a lease needs an existing blob
            self._leases.append(await blob.acquire_lease(LEASE_S))

    async def renew(self) -> None:
        """Renew every lease each :data:`RENEW_EVERY_S` (run as a task; cancel to stop)."""
        while True:
            await anyio.sleep(RENEW_EVERY_S)
            for lease in self._leases:
                await lease.renew()

    async def update(self, q: int, batch: int) -> None:
        lease = self._leases[q]
        await self._blobs[q].upload_blob(self.queries.line(q, batch), overwrite=True, lease=lease)

    async def release(self) -> None:
        for lease in self._leases:
            await lease.release()


class EventHubsStore(InProcess):
    """Event Hubs' BlobCheckpointStore: a query is an event hub of PARTITIONS partitions."""

    def __init__(self, store: BlobCheckpointStore, container: str) -> None:
        super().__init__()
        self.store, self.container = store, container
        self.owner = str(uuid.uuid4())

    async def claim(self) -> None:
        """One load-balancing pass per query: list the ownership, claim (renew) all."""
        for q in range(QUERIES):
            hub = self.queries.ids[q]
            listed = {o["partition_id"]: o for o in await self.store.list_ownership(
                EH_NAMESPACE, hub, EH_GROUP)}  # fmt: skip
            claims = [{"fully_qualified_namespace": EH_NAMESPACE, "eventhub_name": hub,
                       "consumer_group": EH_GROUP, "partition_id": str(p),
                       "owner_id": self.owner, "etag": listed.get(str(p), {}).get("etag")}
                      for p in range(PARTITIONS)]  # fmt: skip
            got = await self.store.claim_ownership(claims)
            if len(list(got)) != PARTITIONS:
                raise BenchError(f"event hub {hub}: claimed {len(list(got))}/{PARTITIONS}")

    async def renew(self) -> None:
        while True:
            await anyio.sleep(OWNERSHIP_EVERY_S)
            await self.claim()

    async def update(self, q: int, batch: int) -> None:
        hub = self.queries.ids[q]

        async def one(p: int) -> None:
            checkpoint: dict[str, Any] = {
                "fully_qualified_namespace": EH_NAMESPACE, "eventhub_name": hub,
                "consumer_group": EH_GROUP, "partition_id": str(p),
                "offset": str((batch + 1) * 100 + p), "sequence_number": (batch + 1) * 100 + p,
            }  # fmt: skip
            await self.store.update_checkpoint(checkpoint)

        async with anyio.create_task_group() as tg:
            for p in range(PARTITIONS):
                tg.start_soon(one, p)


@asynccontextmanager
async def peers(
    connection_string: str, tag: str
) -> AsyncIterator[tuple[DirectWriter, EventHubsStore]]:
    """Both in-process peers, set up (containers, leases, ownership, one checkpoint per
    partition) and renewing in the background; released and closed on exit."""
    async with AsyncExitStack() as stack:
        service = await stack.enter_async_context(
            BlobServiceClient.from_connection_string(connection_string)
        )
        direct = DirectWriter(service, f"direct-{tag}")
        await service.create_container(direct.container)
        await direct.start()
        eh_container = f"eventhubs-{tag}"
        await service.create_container(eh_container)
        store = await stack.enter_async_context(
            BlobCheckpointStore.from_connection_string(connection_string, eh_container)
        )
        eh = EventHubsStore(store, eh_container)
        await eh.claim()
        for q in range(QUERIES):  # a partition's first checkpoint creates its blob
            await eh.update(q, eh.queries.take(q))
        tg = await stack.enter_async_context(anyio.create_task_group())
        tg.start_soon(direct.renew)
        tg.start_soon(eh.renew)
        try:
            yield direct, eh
        finally:
            tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True), anyio.fail_after(30):
                await direct.release()
