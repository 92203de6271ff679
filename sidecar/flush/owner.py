"""The flush owner's door: the one thing the rest of the daemon holds of ``sidecar.flush``.

Behind it, each query's record (``core``, through its shell ``blob_state``), the leases
(``lease_manager``) and the flush loop (``flusher``); in front of it, fourteen verbs, by who
calls them::

    ingest ─── apply ───────────────▶ ┐  one Redis call, the floors filled, rows kept
           ─── read_floor ──────────▶ │  the floor read (unknown, or rewound elsewhere?)
           ─── ack ─────────────────▶ │  a blob-mode ack: durable, timed out, or not_owner
    admin ops ─ admin ──────────────▶ │  a reset's or an archive's write, under the lease
    retirement ─ busy / release / forget ▶ FlushOwner ──▶ BlobStates ──▶ FlushCore
    snapshots ─ owns / snapshot_marker / snapshot_taken ▶ │             └▶ LeaseManager
    app ─────── run / final_flush / release_all / health ▶ ┘  Flusher (the loop)

Nothing outside ``sidecar.flush`` touches a query's record or the lease table: what they
need of them is asked here, and every write of a blob — the flusher's, a reset's, an
archive's — goes through the same conditional write under the held lease.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import anyio
from anyio.abc import TaskStatus

from sidecar.backoff import Backoff
from sidecar.buffer.redis_buffer import Outcome, RedisBuffer
from sidecar.config import Config
from sidecar.errors import AdminRefused, StoreUnavailable, VersionConflict
from sidecar.flush import blob_state
from sidecar.flush.blob import Seen
from sidecar.flush.blob_state import BlobStates
from sidecar.flush.flusher import AUDIT_EVERY_S, Flusher
from sidecar.flush.lease import Held, Ownership
from sidecar.model.checkpoint import Checkpoint
from sidecar.model.document import SnapshotRef, Stored, Writer
from sidecar.telemetry.metrics import Metrics

T = TypeVar("T")

#: An admin op's write, given the blob's version it replaces, this daemon's lease id and a
#: check that the lease is still held: what the op returns, and what the blob holds after.
Send = Callable[[str, str, Callable[[], bool]], Awaitable[tuple[T, Stored]]]


class FlushStore(blob_state.BlobStore, Protocol):
    """What the flush owner needs of the blob store (``sidecar.store.blobs``)."""

    def blob_name(self, query_id: str) -> str: ...


@dataclass(frozen=True, slots=True)
class Health:
    """What ``/readyz`` and the stop's log lines say of the leases and blobs."""

    #: Labels of the queries whose lease another daemon holds, or ours was broken.
    contested: list[str]
    #: By label, who last wrote the blob of each query another daemon holds.
    holders: dict[str, str]
    #: By label, the reset each blob holds that this daemon's Redis never recorded.
    refused: dict[str, str]
    #: Labels of the queries whose lease this daemon holds.
    held: list[str]


class FlushOwner:
    """One per daemon: the door to each query's record, its lease and the flush loop."""

    def __init__(
        self,
        config: Config,
        buffer: RedisBuffer,
        store: FlushStore,
        metrics: Metrics,
        writer: Writer,
        *,
        on_durable: Callable[[Checkpoint], None] | None = None,
        track: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
        backoff: Backoff | None = None,
        audit_every_s: float = AUDIT_EVERY_S,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        """``on_durable``: told each checkpoint durable in its blob (the position sinks);
        ``track``: told each query a flush pass sees (retirement); ``clock``, ``jitter``,
        ``backoff``: of the leases, retries and rechecks (a simulation's: virtual time, no
        randomness); ``audit_every_s``: how often the store's listing is held against Redis;
        ``cpu_clock``: the flush loop's CPU time, which spaces its checks out (a simulation's
        is constant: the same steps, the same checks)."""
        self._store, self._buffer = store, buffer
        self._keep_rows = config.ack_mode == "blob"
        self._blobs = BlobStates(
            store,
            "",
            config.lease_duration_s,
            metrics,
            clock=clock,
            jitter=jitter,
            backoff=backoff,
        )
        #: The lease manager (its loop, state and counters: tests and diagnostics read them).
        self.leases = self._blobs.leases
        self._flusher = Flusher(
            config,
            buffer,
            self._blobs,
            metrics,
            writer,
            on_durable=on_durable,
            track=track,
            audit_every_s=audit_every_s,
            cpu_clock=cpu_clock,
        )

    # --- the ack path (``sidecar.ingest``) ---------------------------------------------------

    async def read_floor(
        self, query_id: str, *, again: bool = False, always: bool = False
    ) -> int | None:
        """The floor read from the blob unless known; ``again``: the floor alone refused an
        update Redis would take (a rewind elsewhere?): read again, unless read too recently
        (None then) and not ``always`` (an ack waits on the answer).

        Raises:
            SidecarError: the blob store cannot be read now (``StoreUnavailable``: retry).
        """
        if again:
            return await self._blobs.recheck(query_id, always=always)
        return await self._blobs.load(query_id)

    async def apply(self, checkpoints: list[Checkpoint], floors: list[int | None]) -> list[Outcome]:
        """Apply a batch of updates in one Redis round trip, each with its query's floor (None:
        the one known here, maybe still unknown); their outcomes. In blob ack mode the rows the
        call returns are kept for the flush each ack waits on (no Redis read for it); a call
        that raises (it may have run) voids those queries' rows, and a row read before an
        admin op begun since the call began is never flushed.

        Raises:
            SidecarError: the buffer's (``BufferUnavailable``: nothing stored, retry).
        """
        blobs = self._blobs
        floors = [
            blobs.known(c.query_id) if floor is None else floor
            for c, floor in zip(checkpoints, floors, strict=True)
        ]
        if not self._keep_rows:
            return await self._buffer.apply(checkpoints, floors)
        since = blobs.stamp()
        try:
            applied = await self._buffer.apply_rows(checkpoints, floors)
        except BaseException:
            blobs.void([c.query_id for c in checkpoints])
            raise
        blobs.applied(applied.rows, since)  # before the acks wait on the flusher
        return applied.outcomes

    async def ack(self, query_id: str, batch_id: int, timeout_s: float | None) -> bool:
        """True once the query's blob holds ``batch_id`` or newer; False after ``timeout_s``.

        Raises:
            NotOwner: another daemon holds the query's lease: this one cannot make it durable.
        """
        return await self._blobs.wait_durable(query_id, batch_id, timeout_s)

    # --- admin ops (``sidecar.daemon.admin_ops``) ---------------------------------------------

    @asynccontextmanager
    async def admin(
        self, query_id: str, label: str, *, only_a_blob: bool = False
    ) -> AsyncIterator[AdminWrite]:
        """Hold the query for an admin op, under its lease: no flush of it runs inside, and
        none of a Redis row read before the op ends runs after. ``only_a_blob``: the lease
        only if the query has a blob (listed under the hold); ``AdminWrite.held`` says.

        Raises:
            AdminRefused: another owner holds the lease, or the store refused it.
        """
        async with self._blobs.exclusive(query_id):
            wanted = not only_a_blob or query_id in await self._store.query_ids()
            held = await self._held(query_id, label) if wanted else None
            yield AdminWrite(self._blobs, query_id, held)

    async def _held(self, query_id: str, label: str) -> Held:
        held = await self._blobs.held(query_id, label)
        if held is None:
            state = self.leases.state(query_id)
            raise AdminRefused(
                f"this daemon does not hold the lease on {self._store.blob_name(query_id)} now "
                f"({state.name if state else 'unknown'}): another owner holds it or the store "
                "refused (see /readyz and the log); run the command where that owner runs"
            )
        return held

    # --- retirement (``sidecar.daemon.retirement``) -------------------------------------------

    def busy(self, query_id: str) -> bool:
        """Something is unfinished for the query (pending, quarantined, an ack waiting, a
        flush in flight): not to be retired now."""
        return self._flusher.busy(query_id)

    async def release(self, query_id: str) -> bool:
        """Release the query's lease (retiring it); False when a renewal is under way."""
        return await self._blobs.release(query_id)

    def forget(self, query_id: str) -> None:
        """Drop the query's record (retired): read again if it returns."""
        self._blobs.forget(query_id)

    # --- snapshots (``sidecar.daemon.snapshots``) ---------------------------------------------

    async def owns(self, query_id: str, label: str) -> Ownership | None:
        """None unless this daemon holds the query's lease (acquired if due); else a check to
        make right before a write that must be the owner's, with the term held."""
        return await self._blobs.owner_check(query_id, label)

    def snapshot_marker(self, query_id: str) -> tuple[bool, SnapshotRef | None]:
        """The snapshot the query's document names, and whether that is known (seen under
        the lease held now)."""
        return self._blobs.snapshot_marker(query_id)

    def snapshot_taken(self, query_id: str, ref: SnapshotRef) -> None:
        """A snapshot of the query was written: its next document names it."""
        self._blobs.snapshot_taken(query_id, ref)

    # --- the daemon (``sidecar.daemon.app``) ----------------------------------------------------

    async def run(
        self,
        lease_id: str,
        store_open: anyio.Event,
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Keep the leases (under ``lease_id``, this process's), note what a previous run
        left pending, then, once ``store_open`` is set, run the flush loop; until cancelled.
        Started once Redis answers, before updates are accepted."""
        self.leases.use(lease_id)
        async with anyio.create_task_group() as tg:
            await tg.start(self.leases.run)
            await self._flusher.recover()
            task_status.started()
            await store_open.wait()
            await tg.start(self._flusher.run)

    async def final_flush(self) -> None:
        """Stop the flush loop (waiting for its writes), then flush everything owned,
        whatever the thresholds."""
        await self._flusher.stop_loop()
        await self._flusher.final_flush()

    async def release_all(self) -> None:
        """Release every lease held (the stop's last step)."""
        await self.leases.release_all()

    def health(self) -> Health:
        leases, blobs = self.leases, self._blobs
        return Health(leases.contested(), blobs.holders(), blobs.refused(), leases.held())


class AdminWrite:
    """An admin op's hold on one query (from :meth:`FlushOwner.admin`): what its blob holds,
    and the op's write of it, conditional on that version and on the lease."""

    def __init__(self, blobs: BlobStates, query_id: str, lease: Held | None) -> None:
        self._blobs, self._query_id, self._lease = blobs, query_id, lease
        self._base: Seen | None = None
        #: Whether the op holds the query's lease (the blob may be written).
        self.held = lease is not None

    async def base(self) -> Stored:
        """What the query's blob holds, read unless seen; the write replaces this version.

        Raises:
            CorruptRecord: the blob is not a checkpoint document of the query.
            SidecarError: the store cannot be read now.
        """
        self._base = await self._blobs.stored(self._query_id)
        return self._base.stored

    async def write(
        self,
        what: Literal["reset", "archive"],
        send: Send[T],
        *,
        batch_id: int,
        lowered_to: int | None = None,
    ) -> T | None:
        """Run ``send`` over the base read (``reset``: the blob gets a reset's document;
        ``archive``: the blob is moved away); what it returns. None, and nothing sent, when
        the lease was lost or the blob seen to change since the read. ``batch_id``: the op's
        (log lines); ``lowered_to``: what a reset of unknown outcome may have left.

        Raises:
            VersionConflict: another writer changed the blob (read again and counted).
            StoreUnavailable: the outcome is unknown (the blob is read before the next write).
        """
        blobs, query_id, base = self._blobs, self._query_id, self._base
        assert self._lease is not None and base is not None, "held, then base(), then write()"
        if base.stored.version is None or not blobs.begin_write(query_id, self._lease, base):
            return None
        lease = self._lease
        try:
            result, after = await send(
                base.stored.version, blobs.lease_id, lambda: blobs.leases.holds(lease)
            )
        except VersionConflict:
            await blobs.write_refused(query_id, what, batch_id)
            raise
        except (StoreUnavailable, anyio.get_cancelled_exc_class()):
            blobs.unknown(query_id, lowered_to=lowered_to)  # it may have landed
            raise
        except BaseException:
            blobs.not_sent(query_id)  # refused before the blob was written
            raise
        if what == "reset":
            blobs.reset(query_id, after)  # the floor and acks follow it down
        else:
            blobs.archived(query_id)
        return result
