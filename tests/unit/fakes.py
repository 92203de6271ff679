"""Fakes at the SDK edges, for unit tests of pure logic and its thin shells (never instead of
the real-service tests of the same paths, which run against Azurite and redis-server).

:class:`FakeBlobStore` keeps Azure's rules that the flush core relies on: a blob is written
only under its active lease, an active lease of another id refuses an acquire, an expired
lease may be taken by anyone, and a broken or taken lease refuses renewals and writes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka.structs import TopicPartition

from sidecar.errors import LeaseConflict, LeaseLost, StoreUnavailable, VersionConflict
from sidecar.model import checkpoint as ckpt
from sidecar.model.document import (
    CheckpointDocument,
    Stored,
    Writer,
    decode_document,
    encode_document,
)

WRITER = Writer(host="unit", pid=1, instance_id="unit")


def checkpoint(query_id: str, batch: int, name: str | None = "q") -> ckpt.Checkpoint:
    """A checkpoint of ``query_id`` at ``batch`` with one source (offset = batch)."""
    raw = ckpt.raw_offset(batch)
    return ckpt.Checkpoint(
        query_id=query_id,
        run_id="run",
        name=name,
        batch_id=batch,
        timestamp="2026-11-25T00:00:00.000Z",
        sources=[ckpt.SourceOffsets("rate", raw, raw, raw, 1)],
    )


def document(query_id: str, batch: int) -> CheckpointDocument:
    """A blob document of ``query_id`` at ``batch``."""
    return CheckpointDocument.of(checkpoint(query_id, batch), WRITER)


@dataclass
class Lease:
    lease_id: str
    expires_at: float
    duration_s: float


class FakeBlobStore:
    """Blobs, their versions (ETags) and their leases in memory; ``clock`` decides when a
    lease expires. Set :attr:`down` to make every call raise ``StoreUnavailable`` (nothing
    happens). Conditional writes follow Azure: a write names the version it replaces."""

    def __init__(self, clock: Callable[[], float] = lambda: 0.0) -> None:
        self._clock = clock
        self.bodies: dict[str, bytes] = {}
        #: Each blob's current version (a new one at every change of its body).
        self.versions: dict[str, str] = {}
        self.leases: dict[str, Lease] = {}
        self.down = False
        #: Reads of a blob so far.
        self.blob_reads = 0
        #: (query id, batch id) of every write that landed, in order.
        self.writes: list[tuple[str, int]] = []
        self._etags = itertools.count(1)

    def _set(self, query_id: str, body: bytes) -> str:
        self.bodies[query_id] = body
        version = self.versions[query_id] = f'"0x{next(self._etags):X}"'
        return version

    def _call(self) -> None:
        if self.down:
            raise StoreUnavailable("fake store: down")

    def _active(self, query_id: str) -> Lease | None:
        lease = self.leases.get(query_id)
        return lease if lease is not None and lease.expires_at > self._clock() else None

    def put(self, query_id: str, batch: int) -> None:
        """Write a document at ``batch`` as another owner would (no lease checked)."""
        self._set(query_id, encode_document(document(query_id, batch)))

    def batch(self, query_id: str) -> int | None:
        doc = decode_document(self.bodies.get(query_id, b""), query_id, query_id)
        return doc.batch_id if doc is not None else None

    async def create_if_absent(self, query_id: str) -> str | None:
        self._call()
        if query_id in self.bodies:
            return None
        return self._set(query_id, b"")

    async def acquire_lease(self, query_id: str, lease_id: str, duration_s: int) -> str | None:
        self._call()
        active = self._active(query_id)
        if active is not None and active.lease_id != lease_id:
            raise LeaseConflict("fake store: another owner holds the lease")
        self.leases[query_id] = Lease(lease_id, self._clock() + duration_s, duration_s)
        return self.versions.get(query_id)

    async def renew_lease(self, query_id: str, lease_id: str) -> str | None:
        self._call()
        lease = self.leases.get(query_id)
        if lease is None or lease.lease_id != lease_id:
            raise LeaseLost("fake store: lease taken or broken")
        lease.expires_at = self._clock() + lease.duration_s
        return self.versions.get(query_id)

    async def release_lease(self, query_id: str, lease_id: str) -> None:
        self._call()
        lease = self.leases.get(query_id)
        if lease is not None and lease.lease_id == lease_id:
            del self.leases[query_id]

    def break_lease(self, query_id: str) -> None:
        self.leases.pop(query_id, None)

    async def write(
        self, query_id: str, body: bytes, *, lease_id: str, query_name: str | None, version: str
    ) -> str:
        self._call()
        active = self._active(query_id)
        if active is None or active.lease_id != lease_id:
            raise LeaseLost("fake store: our lease is no longer valid")
        if self.versions.get(query_id) != version:
            raise VersionConflict("fake store: the blob changed since it was read")
        doc = decode_document(body, query_id, query_id)
        assert doc is not None, "the flusher never writes an empty body"
        self.writes.append((query_id, doc.batch_id))
        return self._set(query_id, body)

    async def read(self, query_id: str) -> CheckpointDocument | None:
        return (await self.read_stored(query_id)).document

    async def read_stored(self, query_id: str) -> Stored:
        self._call()
        self.blob_reads += 1
        body = self.bodies.get(query_id)
        if body is None:
            return Stored(None, None)
        doc = decode_document(body, f"{query_id}.json", query_id) if body else None
        return Stored(self.versions[query_id], doc)

    def blob_name(self, query_id: str) -> str:
        return f"fake/{query_id}.json"

    async def query_ids(self) -> set[str]:
        self._call()
        return {q for q, body in self.bodies.items() if body}

    async def listed_versions(self) -> dict[str, str]:
        self._call()
        return dict(self.versions)


class FakeKafkaConsumer:
    """What the Kafka committer asks of an aiokafka consumer besides its calls to the
    brokers (``sidecar.kafka.client.open_consumer``'s: manual assignment, never joined)."""

    def __init__(self) -> None:
        self._assigned: set[TopicPartition] = set()

    def assignment(self) -> set[TopicPartition]:
        return self._assigned

    def assign(self, tps: list[TopicPartition]) -> None:
        self._assigned = set(tps)

    async def stop(self) -> None:
        return None
