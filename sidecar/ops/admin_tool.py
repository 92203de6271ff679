"""Reset and retire from the command line: through the running daemon, or without one.

:func:`reset` and :func:`retire` first ask the daemon on ``SIDECAR_SOCKET_PATH`` (the
lease owner performs the op, ``sidecar.daemon.admin_ops.DaemonAdmin``). When no daemon
answers there (the socket file does not exist, or nobody listens on it), they do it
themselves, in the same steps (``sidecar.ops.admin_steps``), under a lease of their own on
the query's blob: acquired for the op (refused, changing nothing, while another owner holds
it), released at the end. A reset then also does what the daemon's hooks would: the query's
Kafka consumer groups and Event Hubs checkpoints are set to the new position, lowered on
purpose where lower, before the lease is released (a daemon that takes the blob after it may
commit newer positions, which this must not land after); the summary says what was and was
not set. Any other failure to connect (e.g. permission denied: a daemon
runs, but not for this user) is an error, never a reason to go around a running daemon.

:func:`apply_reset` is the entry point for tools that hold a whole checkpoint (``import-spark-
checkpoint``): it writes it as a reset, by either path.
"""

from __future__ import annotations

import errno
import getpass
import os
import socket
import time
import uuid

import anyio
import msgspec

from sidecar.buffer.redis_buffer import RedisBuffer
from sidecar.buffer.topology import Topology
from sidecar.config import Config
from sidecar.errors import (
    AdminForbidden,
    AdminRefused,
    InvalidRequest,
    LeaseConflict,
    NotFound,
    SidecarError,
)
from sidecar.model.checkpoint import Checkpoint, SourceOffsets, offset_value
from sidecar.model.document import SnapshotRef, Writer
from sidecar.model.offsets import eventhubs_offsets, kafka_offsets
from sidecar.model.restored import RestoreStats
from sidecar.model.stateful import State, state_of
from sidecar.ops.admin_steps import (
    AdminResult,
    archive_stamp,
    log_done,
    reset_under_lease,
    resolve,
    retire_in_redis,
    rewind_reason,
    target_of,
)
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore
from sidecar.wire.protocol import AdminRequest, Reset, Retire, SourceSpec

#: Error codes of a daemon's reply, as the exceptions they are on this side.
_ERRORS: dict[str, type[SidecarError]] = {
    "forbidden": AdminForbidden,
    "conflict": AdminRefused,
    "not_found": NotFound,
    "bad_request": InvalidRequest,
}
#: Connecting failed this way: no daemon listens on the socket.
_NO_DAEMON = (errno.ENOENT, errno.ECONNREFUSED)
#: A reset's positions for other tools are set this long before the tool's lease ends, or
#: not at all: a daemon that takes the blob after it may commit newer ones (seconds).
LEASE_MARGIN_S = 5.0


async def apply_reset(
    config: Config,
    checkpoint: Checkpoint,
    *,
    reason: str,
    force: bool = False,
    from_spark: bool = False,
    state_rewound: bool = False,
    snapshot: SnapshotRef | None = None,
    restored: RestoreStats | None = None,
) -> AdminResult:
    """Make ``checkpoint`` (its query id, name, batch id, run id, timestamp and sources) the
    query's position, as a reset: through the daemon when one runs on the configured socket,
    else under the blob's lease. ``force``: even if the query was heard from within
    ``SIDECAR_ADMIN_QUIET_S``; ``from_spark``: the offsets are Spark's own committed batch
    (``Reset.from_spark``); ``state_rewound``: a stateful query's state store moved with it
    (``sidecar.model.stateful``); ``snapshot``: the snapshot restored with it, which the
    document names from then on (its marker; None: none); ``restored``: that restore's
    figures, kept in Redis for the daemon to export. What was done (``.summary()`` says it
    in one line).

    Raises:
        AdminForbidden: the daemon runs without ``SIDECAR_ADMIN_OPS=true``.
        AdminRefused: the query may be running, another owner holds the blob's lease, or a
            stateful query would move back without ``state_rewound``.
        InvalidRequest: another number of sources than the query's blob has.
        SidecarError: Redis or the blob store failed (``retriable`` says whether to retry).
    """
    request = Reset(
        reason=reason,
        query_id=checkpoint.query_id,
        name=checkpoint.name,
        sources=tuple(_spec(s) for s in checkpoint.sources),
        batch_id=checkpoint.batch_id,
        run_id=checkpoint.run_id,
        timestamp=checkpoint.timestamp,
        force=force,
        by=who(),
        from_spark=from_spark,
        # Spark's directory with state says so; without it, nothing is known (never stateless)
        stateful=(True if state_of(checkpoint) is State.STATEFUL else None) if from_spark else None,
        state_rewound=state_rewound,
        snapshot=snapshot,
        restored=restored,
    )
    return await reset(config, request)


def _spec(source: SourceOffsets) -> SourceSpec:
    """A checkpoint's source as a reset request carries it: offsets as values (the request
    goes to the daemon as JSON; ``adminops`` encodes them back to the same text)."""
    return SourceSpec(
        description=source.description,
        start_offset=offset_value(source.start_offset),
        end_offset=offset_value(source.end_offset),
        latest_offset=offset_value(source.latest_offset),
        num_input_rows=source.num_input_rows,
    )


async def reset(config: Config, request: Reset) -> AdminResult:
    """``checkpoint-sidecar reset``: see the module docstring."""
    return await _via_daemon(config, request) or await _offline(config, request)


async def retire(config: Config, request: Retire) -> AdminResult:
    """``checkpoint-sidecar retire``: see the module docstring."""
    return await _via_daemon(config, request) or await _offline(config, request)


def who() -> str:
    """Who asks, for the daemon's log: user@host and pid (``uid N`` for a user without a
    name: an arbitrary uid with no /etc/passwd entry, as OpenShift runs containers)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (KeyError up to 3.12, OSError after)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


async def _via_daemon(config: Config, request: AdminRequest) -> AdminResult | None:
    """The daemon's answer; None when no daemon listens on the socket."""
    try:
        client = await SidecarClient.connect(config.socket_path)
    except OSError as exc:
        if exc.errno in _NO_DAEMON:
            return None
        raise SidecarError(f"cannot reach the daemon at {config.socket_path}: {exc}") from exc
    op = "reset" if isinstance(request, Reset) else "retire"
    fields = {k: v for k, v in msgspec.structs.asdict(request).items() if k != "id"}
    async with client:
        with anyio.fail_after(max(60.0, 4 * config.write_timeout_s)):
            reply = await client.request(op, **fields)
    if reply.error is not None:
        raise _ERRORS.get(reply.error.code, SidecarError)(reply.error.message)
    return msgspec.convert(reply.result, AdminResult)


async def _offline(config: Config, request: AdminRequest) -> AdminResult:
    buffer = RedisBuffer(
        config.redis_url,
        config.namespace,
        timeout_s=config.redis_timeout_s,
        topology=Topology.of(config),
    )
    store = BlobStore(config)
    try:
        query_id, name = await resolve(buffer, store, request.query_id, request.name)
        if isinstance(request, Reset):
            result = await _reset(config, buffer, store, request, query_id, name)
        else:
            result = await _retire(config, buffer, store, request, query_id, name)
    finally:
        with anyio.CancelScope(shield=True):
            await buffer.aclose()
            await store.aclose()
    log_done(result, request)
    return result


async def _lease(store: BlobStore, config: Config, query_id: str) -> str:
    """A lease of our own on the query's blob (created if absent); its id.

    Raises:
        AdminRefused: another owner holds it.
    """
    lease_id = str(uuid.uuid4())
    await store.create_if_absent(query_id)
    try:
        await store.acquire_lease(query_id, lease_id, config.lease_duration_s)
    except LeaseConflict:
        state = await store.lease_state(query_id)
        raise AdminRefused(
            f"another owner holds the lease on {store.blob_name(query_id)} (lease state "
            f"{state}): a daemon flushes this query. Run the command where that daemon's socket "
            "is (SIDECAR_SOCKET_PATH, with SIDECAR_ADMIN_OPS=true), or stop it first; nothing "
            "was changed"
        ) from None
    return lease_id


def _version(version: str | None, store: BlobStore, query_id: str) -> str:
    """The version of a blob the tool's lease holds (the lease made it exist)."""
    if version is None:
        raise AdminRefused(
            f"{store.blob_name(query_id)} was deleted while the tool held its lease; nothing "
            "was changed: run the command again"
        )
    return version


async def _release(store: BlobStore, query_id: str, lease_id: str) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(10):
        await store.release_lease(query_id, lease_id)


async def _reset(
    config: Config,
    buffer: RedisBuffer,
    store: BlobStore,
    request: Reset,
    query_id: str,
    name: str | None,
) -> AdminResult:
    await store.ensure_container()
    lease_id = await _lease(store, config, query_id)
    lease_ends = time.monotonic() + config.lease_duration_s
    try:
        stored = await store.read_stored(query_id)
        target = target_of(request, query_id, name, stored.document)
        writer = Writer(socket.gethostname(), os.getpid(), lease_id)
        doc, dropped, _ = await reset_under_lease(
            buffer,
            store,
            config,
            request,
            stored.document,
            target,
            lease_id=lease_id,
            version=_version(stored.version, store, query_id),
            writer=writer,
        )
        why = rewind_reason(doc.reset_from, doc.batch_id, request)
        positions = await _rewind_positions(
            config, store, doc.checkpoint(), why, lease_ends - LEASE_MARGIN_S
        )
    finally:
        await _release(store, query_id, lease_id)
    return AdminResult(
        "reset",
        query_id,
        doc.name,
        "lease",
        store.blob_name(query_id),
        batch_id=doc.batch_id,
        reset_from=doc.reset_from,
        dropped=dropped,
        positions=positions,
    )


async def _rewind_positions(
    config: Config, store: BlobStore, checkpoint: Checkpoint, why: str, until: float
) -> str | None:
    """What the daemon's rewind hooks do, done here (no daemon runs): the reset's Kafka groups
    and Event Hubs checkpoints set to ``checkpoint``, lowered on purpose where lower (logged
    as the daemon logs it), by ``until`` (monotonic) at the latest. The summary's phrase;
    None when the query has no such source. Failures are said, never raised: the reset is
    done."""
    kafka = bool(kafka_offsets(checkpoint, config.kafka_query_set))
    hubs = bool(eventhubs_offsets(checkpoint))
    if not kafka and not hubs:
        return None
    said: list[str] = []
    with anyio.move_on_after(max(0.0, until - time.monotonic())) as scope:
        if kafka and not config.kafka_bootstrap_servers:
            said.append(_not_set("Kafka groups", "SIDECAR_KAFKA_BOOTSTRAP_SERVERS"))
        elif kafka:
            from sidecar.kafka.committer import rewind_once as kafka_rewind

            said.append(_set("Kafka group", await kafka_rewind(config, checkpoint, why)))
        if hubs and not config.eventhubs_namespace:
            said.append(_not_set("Event Hubs checkpoints", "SIDECAR_EVENTHUBS_NAMESPACE"))
        elif hubs:
            from sidecar.eventhubs.checkpointer import rewind_once as hubs_rewind
            from sidecar.store.eventhubs import EventHubsBlobs

            done = await hubs_rewind(config, EventHubsBlobs(store.account), checkpoint, why)
            said.append(_set("Event Hubs checkpoints of group", done))
    if scope.cancelled_caught:
        said.append(
            "the rest NOT set to it (cut 5 s before the tool's lease would end; no daemon "
            "sets it later: run the reset again)"
        )
    return "; ".join(said)


def _set(what: str, done: dict[str, bool]) -> str:
    ok = [name for name, committed in done.items() if committed]
    failed = [name for name, committed in done.items() if not committed]
    parts = [f"{what} {', '.join(ok)} set to it (lowered on purpose where lower)"] if ok else []
    if failed:
        parts.append(
            f"{what} {', '.join(failed)} NOT set to it (see the log; no daemon sets it later: "
            "run the reset again)"
        )
    return "; ".join(parts)


def _not_set(what: str, setting: str) -> str:
    return f"{what} untouched ({setting} not set here; no daemon sets them later)"


async def _retire(
    config: Config,
    buffer: RedisBuffer,
    store: BlobStore,
    request: Retire,
    query_id: str,
    name: str | None,
) -> AdminResult:
    label = name or query_id
    archived = None
    if query_id not in await store.query_ids():  # no blob: nothing to lease
        removed = await retire_in_redis(buffer, config, request, query_id, label)
    else:
        lease_id = await _lease(store, config, query_id)
        try:
            removed = await retire_in_redis(buffer, config, request, query_id, label)
            if request.archive:
                version = (await store.read_stored(query_id)).version
                archived = await store.archive(
                    query_id, lease_id, archive_stamp(), _version(version, store, query_id)
                )
        finally:
            await _release(store, query_id, lease_id)
    return AdminResult(
        "retire",
        query_id,
        name,
        "lease",
        store.blob_name(query_id),
        removed=removed,
        archived_to=archived,
    )
