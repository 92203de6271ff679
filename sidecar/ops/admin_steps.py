"""The steps of the admin ops ``reset`` and ``retire``, shared by the daemon and the CLI. See
docs/operator-ops.md.

Invariant: **an admin op writes or moves a blob only under that blob's lease**: the daemon's
own (:class:`DaemonAdmin`, for requests on its socket), or, with no daemon running, one the
CLI takes for the op and releases (``sidecar.ops.admin_tool``). The steps in between are the same
functions here, so both paths write the same bytes.

Reset, in this order (each step refuses before anything changed, until the Redis write)::

    resolve the query ─▶ quiet? (no progress heard, no update applied within
    SIDECAR_ADMIN_QUIET_S, unless forced) ─▶ its lease ─▶ the document the blob holds
    ─▶ the target (a retained batch, or explicit offsets) ─▶ Redis: the record becomes the
    target, as flushed (atomic with the quiet check; pending updates are dropped)
    ─▶ blob: the reset document (reset_from / reset_at / reset_reason) ─▶ floor = target
    ─▶ the Kafka groups and Event Hubs checkpoints set to it, lowered on purpose (a rewind:
    the daemon's hooks, or the CLI itself before it releases its lease)

Redis is written first: if the blob write then fails, the blob still holds the replaced batch
(the floor is not lowered, and the flusher has nothing pending to write) and the op reports the
failure; run it again. Retire: resolve ─▶ quiet ─▶ lease (when there is a blob) ─▶ Redis keys
removed ─▶ blob kept, or archived (copied to ``<namespace>/archive/``, then deleted under the
lease) ─▶ dropped from every component's memory, lease released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime

import msgspec

from sidecar.buffer.redis_buffer import RedisBuffer
from sidecar.config import Config
from sidecar.errors import AdminRefused, CorruptRecord, InvalidRequest, NotFound, SidecarError
from sidecar.model import checkpoint as ckpt
from sidecar.model import stateful
from sidecar.model.checkpoint import Checkpoint, Position, SourceOffsets
from sidecar.model.document import CheckpointDocument, Writer, encode_document, reset_document
from sidecar.model.restored import encode_stats
from sidecar.model.stateful import rewind_refusal
from sidecar.store.blobs import BlobStore, newest_named
from sidecar.wire.protocol import AdminRequest, Reset, Retire

log = logging.getLogger(__name__)


class AdminResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """What an admin op did (the reply's ``result``; the CLI prints :meth:`summary`)."""

    op: str
    query_id: str
    name: str | None
    #: "daemon" (performed by the running daemon) or "lease" (by the CLI under its own lease).
    via: str
    blob: str
    #: reset: the new position, the batch it replaced (None: no document before), and the
    #: updates Redis held unflushed that it dropped.
    batch_id: int | None = None
    reset_from: int | None = None
    dropped: int = 0
    #: retire: Redis keys and entries removed; where the blob went (None: kept in place).
    removed: int = 0
    archived_to: str | None = None
    #: reset: what became of the positions kept for other tools (Kafka groups, Event Hubs
    #: checkpoints), a phrase for the summary; None: the query has none to move.
    positions: str | None = None

    def summary(self) -> str:
        """One line saying what happened."""
        query = f"{self.name} ({self.query_id})" if self.name else self.query_id
        via = "by the daemon" if self.via == "daemon" else "under the tool's own lease"
        if self.op == "reset":
            dropped = f", {self.dropped} unflushed update(s) dropped" if self.dropped else ""
            positions = f"; {self.positions}" if self.positions else ""
            return (
                f"reset {query} from batch {_batch(self.reset_from)} to batch {self.batch_id} "
                f"{via}: {self.blob} written, Redis set{dropped}; later batches must exceed "
                f"{self.batch_id}{positions}"
            )
        blob = f"blob moved to {self.archived_to}" if self.archived_to else f"blob {self.blob} kept"
        return f"retired {query} {via}: {self.removed} Redis key(s)/entries removed, {blob}"


def _batch(batch_id: int | None) -> str:
    return "none" if batch_id is None else str(batch_id)


def rewind_reason(reset_from: int | None, batch_id: int, request: Reset) -> str:
    """Why a reset moves the Kafka groups and Event Hubs checkpoints back on purpose, for
    their log lines: from and to which batch, who, and the reset's reason."""
    by = request.by or "a client that did not say"
    why = request.reason or "no reason given"
    return f"reset from batch {_batch(reset_from)} to batch {batch_id} by {by}; reason: {why}"


def quiet_ms(config: Config, force: bool) -> int | None:
    """The Redis scripts' quiet time: None when forced."""
    return None if force else int(config.admin_quiet_s * 1000)


def running(label: str, query_id: str, seconds: float, config: Config, what: str) -> AdminRefused:
    return AdminRefused(
        f"query {label} ({query_id}) may still be running: {what} {seconds:.1f}s ago (within "
        f"SIDECAR_ADMIN_QUIET_S={config.admin_quiet_s:g}); stop the query first, or force it "
        "(--force: a running query's next batch replaces a reset, or brings a retired query back)"
    )


async def resolve(
    buffer: RedisBuffer, store: BlobStore, query_id: str | None, name: str | None
) -> tuple[str, str | None]:
    """The query's id and name: ``query_id`` as given; ``name`` is a name Redis knows, else a
    query id Redis or the blobs know, else the newest blob of that name (as ``show``).

    Raises:
        NotFound: neither Redis nor the blobs know it.
    """
    if query_id is None and name is not None:
        query_id = await buffer.query_id_for(name)
        if query_id is None and await _known_id(buffer, name):
            query_id, name = name, None
    if query_id is not None:
        return query_id, name or await _name_of(buffer, store, query_id)
    infos = await store.list()
    found = next((i for i in infos if i.query_id == name), None) or newest_named(infos, str(name))
    if found is None:
        raise NotFound(f"no query {name!r} in Redis or the blobs; `checkpoint-sidecar list`")
    return found.query_id, found.query_name


async def _known_id(buffer: RedisBuffer, query_id: str) -> bool:
    try:
        return await buffer.stored_batch(query_id) is not None
    except CorruptRecord:
        return True


async def _name_of(buffer: RedisBuffer, store: BlobStore, query_id: str) -> str | None:
    try:
        raw = await buffer.get(query_id)
        if raw is not None:
            return ckpt.decode(raw).name
        doc = await store.read(query_id)
    except CorruptRecord:
        return None
    return doc.name if doc is not None else None


def target_of(
    request: Reset, query_id: str, name: str | None, current: CheckpointDocument | None
) -> Checkpoint:
    """The checkpoint a reset makes the query's position.

    Raises:
        NotFound: ``to_batch`` is not retained (or there is no document).
        InvalidRequest: explicit offsets for another number of sources than the query has.
        AdminRefused: the query is stateful (or may be) and the reset moves it back, without
            ``state_rewound`` (``sidecar.model.stateful``).
    """
    label = name or query_id
    if current is not None and not request.state_rewound:
        if request.from_spark:  # Spark's own batch: refused only when older than the blob's
            # A directory with state/ says stateful, whatever the document said before; and
            # offsets with no batch say nothing of where they stand: judged as explicit ones.
            judged: Checkpoint = current
            if request.stateful:
                judged = stateful.with_state(current, stateful.State.STATEFUL)
            refusal = rewind_refusal(
                judged, to_batch=request.batch_id, explicit=request.batch_id is None
            )
        else:
            refusal = rewind_refusal(
                current, to_batch=request.to_batch, explicit=request.to_batch is None
            )
        if refusal is not None:
            what = "import" if request.from_spark else "reset"
            raise AdminRefused(f"{what} refused, nothing changed: {refusal}")
    if request.to_batch is not None:
        found = current.at_batch(request.to_batch) if current is not None else None
        if found is None:
            retained = ", ".join(str(e.batch_id) for e in current.retained()) if current else ""
            raise NotFound(
                f"batch {request.to_batch} is not retained for query {label}: "
                + (f"the blob retains batches {retained}" if retained else "it has no blob")
                + " (`checkpoint-sidecar history`); --offsets sets explicit offsets"
            )
        return stateful.carry(current, found)
    assert request.sources is not None
    known = current.sources if current is not None else []
    if current is not None and len(request.sources) != len(known):
        raise InvalidRequest(
            f"{len(request.sources)} source offset(s) given, but query {label} has "
            f"{len(known)} source(s) ({'; '.join(s.description for s in known)}): give one "
            "end offset per source, in that order"
        )
    sources = [
        SourceOffsets(  # the request's offsets are values: encoded once, here
            s.description or (known[i].description if known else f"source {i}"),
            ckpt.raw_offset(s.start_offset),
            ckpt.raw_offset(s.end_offset),
            ckpt.raw_offset(s.latest_offset),
            s.num_input_rows,
        )
        for i, s in enumerate(request.sources)
    ]
    now = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    target = Checkpoint(
        position=Position.COMMITTED if request.from_spark else None,
        query_id=query_id,
        run_id=request.run_id or (current.run_id if current else "reset"),
        name=(current.name if current else None) or name,
        batch_id=_first(request.batch_id, current.batch_id if current else None, 0),
        timestamp=request.timestamp or (current.timestamp if current else now),
        sources=sources,
    )
    # What the request says of state: Spark's directory with state, or not known (an import
    # never says stateless); anything known before sticks (``sidecar.model.stateful``).
    said = stateful.State.STATEFUL if request.stateful else stateful.State.UNKNOWN
    if not request.from_spark and request.stateful is None:
        said = stateful.state_of(current) if current is not None else stateful.State.STATELESS
    return stateful.with_state(
        target, stateful.carried(stateful.state_of(current) if current else None, said)
    )


def _first(*values: int | None) -> int:
    return next(v for v in values if v is not None)


async def reset_under_lease(
    buffer: RedisBuffer,
    store: BlobStore,
    config: Config,
    request: Reset,
    current: CheckpointDocument | None,
    target: Checkpoint,
    *,
    lease_id: str,
    version: str,
    writer: Writer,
    still_held: Callable[[], bool] = lambda: True,
) -> tuple[CheckpointDocument, int, str]:
    """Redis, then the blob (the lease ``lease_id`` held, which ``still_held`` checks right
    before the write; ``version``: the blob's, as ``current`` was read at, which the write
    names); the document written, how many unflushed updates Redis dropped, and the blob's
    new version.

    Raises:
        AdminRefused: an update was applied within the quiet time (nothing changed), or the
            lease was lost before the blob was written (Redis was reset: run it again).
        VersionConflict: the blob changed since it was read (another writer): Redis was
            reset, the blob not: run it again.
    """
    doc = reset_document(
        current,
        target,
        writer,
        reason=request.reason,
        history_size=config.history_size,
        snapshot=request.snapshot,
    )
    answer = await buffer.reset(target, quiet_ms(config, request.force), doc.reset_at)
    if int(answer[0]) == 1:
        label = target.name or target.query_id
        raise running(
            label, target.query_id, int(answer[1]) / 1000, config, "Redis applied an update"
        )
    body = encode_document(doc)
    if not still_held():
        raise AdminRefused(
            f"the lease on {store.blob_name(target.query_id)} was lost while Redis was reset; "
            "the blob is unchanged: run the command again"
        )
    written = await store.write(
        target.query_id, body, lease_id=lease_id, query_name=target.name, version=version
    )
    if request.restored is not None:
        await _keep_restore(buffer, request, target.query_id)
    return doc, int(answer[2]), written


async def _keep_restore(buffer: RedisBuffer, request: Reset, query_id: str) -> None:
    """A restore's figures, kept for the daemon to export once its reset is done (the blob
    written). Not kept is a metric missing, not a reason to say the reset failed."""
    assert request.restored is not None
    try:
        await buffer.record_restore(query_id, encode_stats(request.restored))
    except SidecarError as exc:
        log.warning(
            "restore query=%s: its figures were not kept in Redis (the daemon will not export "
            "them): %s",
            request.restored.name or query_id,
            exc,
        )


async def retire_in_redis(
    buffer: RedisBuffer, config: Config, request: Retire, query_id: str, label: str
) -> int:
    """Remove the query's Redis keys; how many keys and entries were removed.

    Raises:
        AdminRefused: an update was applied within the quiet time (nothing changed).
    """
    quiet = quiet_ms(config, request.force)
    answer = await buffer.admin_script(
        "retire", query_id, [query_id, -1 if quiet is None else quiet]
    )
    if int(answer[0]) == 1:
        raise running(label, query_id, int(answer[1]) / 1000, config, "Redis applied an update")
    return int(answer[1])


def archive_stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")


def log_done(result: AdminResult, request: AdminRequest) -> None:
    """One WARNING per admin op carried out: who, what, why."""
    what = result.summary()
    why = request.reason or "no reason given"
    forced = " (forced)" if request.force else ""
    by = request.by or "a client that did not say"
    log.warning("admin %s%s by %s: %s; reason: %s", result.op, forced, by, what, why)
