"""The daemon's side of ``reset`` and ``retire``: requests from its socket, performed as the
lease owner, with every component told (each query's blob state, retirement; a reset's new
position, a deliberate rewind, to the Kafka commits and Event Hubs checkpoints through the
``on_rewind`` hook ``app`` wires, so that they lower what they hold on purpose). The steps
themselves are ``sidecar.ops.admin_steps``, which the CLI runs under a lease of its own when
no daemon is running, so both paths write the same bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from sidecar.buffer.redis_buffer import RedisBuffer
from sidecar.config import Config
from sidecar.daemon.retirement import Retirement
from sidecar.errors import (
    AdminRefused,
    InvalidRequest,
    NotFound,
    SidecarError,
    VersionConflict,
)
from sidecar.flush.owner import FlushOwner
from sidecar.model.checkpoint import Checkpoint
from sidecar.model.document import CheckpointDocument, Stored, Writer
from sidecar.model.restored import RestoreStats, decode_stats
from sidecar.ops.admin_steps import (
    AdminResult,
    archive_stamp,
    log_done,
    reset_under_lease,
    resolve,
    retire_in_redis,
    rewind_reason,
    running,
    target_of,
)
from sidecar.store.blobs import BlobStore
from sidecar.telemetry.metrics import Metrics
from sidecar.wire.protocol import AdminRequest, Reset, Retire

log = logging.getLogger(__name__)


class DaemonAdmin:
    """The daemon's side: admin ops from its socket, performed under its own leases, with
    every component told (each query's blob state, retirement); ``app`` wires it into the
    handler."""

    def __init__(
        self,
        config: Config,
        buffer: RedisBuffer,
        store: BlobStore,
        flush: FlushOwner,
        retirement: Retirement,
        metrics: Metrics,
        writer: Writer,
        *,
        on_rewind: Callable[[Checkpoint, str], None] | None = None,
    ) -> None:
        """``on_rewind(checkpoint, why)``: a reset's document is in the blob: the positions
        kept for other tools (Kafka groups, Event Hubs checkpoints) follow it, lowered on
        purpose where lower (``why``: the reset, for their log lines)."""
        self._config = config
        self._buffer, self._store = buffer, store
        self._flush, self._retirement = flush, retirement
        self._metrics = metrics
        self._writer = writer
        self._on_rewind = on_rewind
        #: When each query's last progress arrived is kept on its entry in the daemon's
        #: record (``sidecar.daemon.queries``), which retirement keeps while it is recent.
        self._queries = retirement.queries

    def heard(self, query_id: str, label: str) -> None:
        """A progress of the query arrived (stored or not: an idle query still reports)."""
        q = self._queries.entry(query_id, label)
        q.heard_at = self._queries.clock()

    def heard_lately(self, query_id: str) -> bool:
        """Whether a progress of the query arrived within the quiet time (retirement keeps
        such a query: a reset or retire must still be refused)."""
        return self._since_heard(query_id) < self._config.admin_quiet_s

    def _since_heard(self, query_id: str) -> float:
        """Seconds since the query's last progress arrived here (inf: none known)."""
        q = self._queries.get(query_id)
        return self._queries.clock() - q.heard_at if q is not None else float("inf")

    async def __call__(self, request: AdminRequest) -> dict[str, Any]:
        op = "reset" if isinstance(request, Reset) else "retire"
        try:
            if isinstance(request, Reset):
                result = await self._reset(request)
            else:
                result = await self._retire(request)
        except SidecarError as exc:
            refused = isinstance(exc, AdminRefused | NotFound | InvalidRequest)
            self._metrics.admin_ops.labels(op, "refused" if refused else "error").inc()
            query = request.query_id or request.name
            by = request.by or "a client that did not say"
            log.warning("admin %s of query %s by %s not done: %s", op, query, by, exc)
            raise
        self._metrics.admin_ops.labels(op, "ok").inc()
        log_done(result, request)
        return msgspec.to_builtins(result)  # type: ignore[no-any-return]

    def _check_heard(self, query_id: str, label: str, force: bool) -> None:
        since = self._since_heard(query_id)
        if not force and since < self._config.admin_quiet_s:
            raise running(label, query_id, since, self._config, "this daemon received a progress")

    async def _reset(self, request: Reset) -> AdminResult:
        query_id, name = await resolve(self._buffer, self._store, request.query_id, request.name)
        label = name or query_id
        self._check_heard(query_id, label, request.force)
        async with self._flush.admin(query_id, label) as op:
            base = await op.base()
            target = target_of(request, query_id, name, base.document)

            async def send(
                version: str, lease_id: str, still_held: Callable[[], bool]
            ) -> tuple[tuple[CheckpointDocument, int], Stored]:
                doc, dropped, new_version = await reset_under_lease(
                    self._buffer,
                    self._store,
                    self._config,
                    request,
                    base.document,
                    target,
                    lease_id=lease_id,
                    version=version,
                    writer=self._writer,
                    still_held=still_held,
                )
                return (doc, dropped), Stored(new_version, doc)

            try:
                # A reset of unknown outcome may have lowered the blob to the target.
                done = await op.write(
                    "reset", send, batch_id=target.batch_id, lowered_to=target.batch_id
                )
            except VersionConflict as exc:
                raise AdminRefused(
                    f"reset refused: {exc}. Redis was set to the target, the blob was not "
                    "touched; check who wrote it (`checkpoint-sidecar show`) and run the "
                    "command again"
                ) from exc
            if done is None:
                raise AdminRefused(
                    f"the lease on {self._store.blob_name(query_id)} was lost, or the blob "
                    "changed, while it was read; nothing was changed: run the command again"
                )
            doc, dropped = done
            # Under the query's lock: no flush of it, nor of a row read before, comes between.
            positions = self._rewound(doc.checkpoint(), request, doc.reset_from)
        self._metrics.checkpoint_batch_id.labels(label).set(doc.batch_id)
        if request.restored is not None:  # kept in Redis too (for the next daemon's start)
            export_restore(self._metrics, label, request.restored)
        return AdminResult(
            "reset",
            query_id,
            doc.name,
            "daemon",
            self._store.blob_name(query_id),
            batch_id=doc.batch_id,
            reset_from=doc.reset_from,
            dropped=dropped,
            positions=positions,
        )

    def _rewound(
        self, checkpoint: Checkpoint, request: Reset, reset_from: int | None
    ) -> str | None:
        """The Kafka groups and Event Hubs checkpoints told (they follow in the background);
        the summary's phrase."""
        if self._on_rewind is None:
            return None
        try:
            self._on_rewind(checkpoint, rewind_reason(reset_from, checkpoint.batch_id, request))
        except Exception:  # the reset is done: its hooks' failures are theirs
            log.exception("after reset of query %s: rewind hook failed", checkpoint.label)
            return "Kafka groups and Event Hubs checkpoints NOT lowered (the daemon's log says why)"
        return (
            "the daemon's Kafka group commits and Event Hubs checkpoints follow it, lowered on "
            "purpose where lower (its log says so)"
        )

    async def _retire(self, request: Retire) -> AdminResult:
        query_id, name = await resolve(self._buffer, self._store, request.query_id, request.name)
        label = name or query_id
        self._check_heard(query_id, label, request.force)
        archived = None
        async with self._flush.admin(query_id, label, only_a_blob=True) as op:
            removed = await retire_in_redis(self._buffer, self._config, request, query_id, label)
            if op.held and request.archive:
                base = await op.base()

                async def send(
                    version: str, lease_id: str, still_held: Callable[[], bool]
                ) -> tuple[str, Stored]:
                    moved = await self._store.archive(query_id, lease_id, archive_stamp(), version)
                    return moved, Stored(None, None)

                try:
                    archived = await op.write("archive", send, batch_id=base.batch_id or 0)
                except VersionConflict as exc:
                    raise AdminRefused(
                        f"archive refused: {exc}. Redis' keys are removed, the blob was not "
                        "touched: run the command again"
                    ) from exc
                if archived is None:
                    raise AdminRefused(
                        f"the lease on {self._store.blob_name(query_id)} was lost before the "
                        "blob was archived (Redis' keys are removed): run the command again"
                    )
            await self._retirement.drop(query_id, label)
        return AdminResult(
            "retire",
            query_id,
            name,
            "daemon",
            self._store.blob_name(query_id),
            removed=removed,
            archived_to=archived,
        )


def export_restore(metrics: Metrics, label: str, stats: RestoreStats) -> None:
    """A restore's figures as ``checkpoint_sidecar_restore_*{query=label}``."""
    metrics.restored(
        label, seconds=stats.seconds, bytes=stats.bytes, files=stats.files, at=stats.at
    )


async def export_restores(buffer: RedisBuffer, metrics: Metrics) -> int:
    """Every restore record Redis keeps (``restore`` ran while no daemon did: an init
    container's), exported; how many. Unreadable records are skipped (logged).

    Raises:
        SidecarError: Redis failed.
    """
    found = await buffer.restores()
    for query_id, record in sorted(found.items()):
        stats = decode_stats(record)
        if stats is None:
            log.warning("restore record of query %s cannot be read: not exported", query_id)
            continue
        export_restore(metrics, stats.name or query_id, stats)
        log.info(
            "last restore: query=%s batch=%d snapshot=%s files=%d bytes=%d seconds=%.3f",
            stats.name or query_id,
            stats.batch_id,
            stats.snapshot,
            stats.files,
            stats.bytes,
            stats.seconds,
        )
    return len(found)
