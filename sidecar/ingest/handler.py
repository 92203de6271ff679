"""What each request does: the daemon's request policy, between the socket shell and Redis.

::

    progress ─▶ has a position? ─no──▶ applied:false (never stored)
                   │ yes
                   ▼
               WriteCoalescer ─▶ Redis (one round trip per batch of updates), never older
                   │ applied / stale       than the blob (the floor: the first update of a
                   │                       query Redis does not know reads the blob first;
                   │                       one the floor alone refuses reads it again, rarely)
                   ├─▶ observe (lag gauges)
                   └─▶ ack_mode=blob: wait until the blob holds it (≤ blob_ack_timeout_s)
    get      ─▶ Redis ─▶ the blob instead when it is newer or Redis has nothing
    ping     ─▶ ok
    auth     ─▶ ok (the connection checked the token: sidecar.wire.protocol)
    reset, retire (admin) ─▶ the admin callable (sidecar.daemon.admin_ops): the lease owner
    bad line ─▶ counted, logged, error reply

The server (``sidecar.ingest.server``) calls :meth:`RequestHandler.begin` for every event of
one read before awaiting any reply, so the updates of a read share a Redis round trip; each
returns an :class:`Answer`, awaited in the request's turn and written in request order. In
blob ack mode an update's answer is marked ``at_once``: the server starts it in a task of the
connection's group right away, so the acks of a read, and of later reads, join the same blob
write instead of waiting for one write each in turn. What lies beyond Redis — lag, the
blobs' floors and durability, the blob lookup — reaches this module as callables and
protocols wired in ``sidecar.daemon.app``, so the flow of imports stays one way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from sidecar.buffer.redis_buffer import Outcome, RedisBuffer
from sidecar.errors import NotOwner, NotReplicated, SidecarError
from sidecar.ingest.coalescer import PendingWrite, WriteCoalescer
from sidecar.model import checkpoint as ckpt
from sidecar.telemetry.metrics import Metrics
from sidecar.wire.protocol import (
    ADMIN_OPS,
    INTERNAL_MESSAGE,
    AdminRequest,
    Authenticated,
    BadRequest,
    ErrorCode,
    Event,
    Get,
    Ping,
    Progress,
    RequestId,
    Reset,
    Retire,
    encode_error,
    encode_ok,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Answer:
    """A request's reply in the making, the one type :meth:`RequestHandler.begin` returns:
    awaiting it gives the reply's bytes. The server awaits it in the request's turn, or, when
    ``at_once``, starts it right away in a task of the connection's task group (a blob-mode
    ack waits for the blob from when it was read, not from its turn)."""

    request_id: RequestId
    make: Coroutine[Any, Any, bytes]
    at_once: bool = False

    def __await__(self) -> Generator[Any, None, bytes]:
        return self.make.__await__()


async def _now(reply: bytes) -> bytes:
    return reply


#: True once the query's blob holds this batch or a newer one, False after the timeout (s);
#: raises ``NotOwner`` when another daemon holds the query's lease.
WaitDurable = Callable[[str, int, float], Awaitable[bool]]
#: A checkpoint read from the blob store, by query id or by name (encoded), or None.
LookupBlob = Callable[[str | None, str | None], Awaitable[bytes | None]]
#: Carry out an admin op (``sidecar.daemon.admin_ops``); what was done, for the reply's ``result``.
AdminOp = Callable[[AdminRequest], Awaitable[dict[str, object]]]


class Floors(Protocol):
    """Each query's floor, the batch its blob holds (the flush owner, ``sidecar.flush.owner``:
    no update older is stored; ``NO_BLOB``: the query has no blob)."""

    async def read_floor(
        self, query_id: str, *, again: bool = False, always: bool = False
    ) -> int | None:
        """The floor, read from the blob unless known; ``again``: the floor alone refused an
        update, read it again, or None when it was read too recently and not ``always``
        (raises the store's errors)."""


class RequestHandler:
    """Turns protocol events into reply bytes. One per daemon, shared by all connections."""

    def __init__(
        self,
        coalescer: WriteCoalescer,
        buffer: RedisBuffer,
        metrics: Metrics,
        *,
        observe: Callable[[ckpt.Checkpoint, bool], None] | None = None,
        wait_durable: WaitDurable | None = None,
        blob_ack_timeout_s: float = 30.0,
        lookup_blob: LookupBlob | None = None,
        floors: Floors | None = None,
        admin: AdminOp | None = None,
    ) -> None:
        """``wait_durable`` given: ``ack_mode=blob`` (acknowledge once in the blob).
        ``floors`` given: no update older than the query's blob is stored, and ``get``
        answers with the blob when it is newer than Redis (``sidecar.flush.owner``). ``admin``:
        performs ``reset`` / ``retire``; ``observe(checkpoint, applied)``: told of every
        progress once handled (stored, or not: stale, no position, failed), before its ack
        waits for the blob."""
        self._coalescer = coalescer
        self._buffer = buffer
        self._metrics = metrics
        self._observe = observe
        self._wait_durable = wait_durable
        self._blob_ack_timeout_s = blob_ack_timeout_s
        self._lookup_blob = lookup_blob
        self._floors = floors
        self._admin = admin
        # Label children bound once: .labels() costs more than the increment on this path.
        self._applied = metrics.updates.labels("applied")
        self._stale = metrics.updates.labels("stale")
        self._no_offsets = metrics.updates.labels("no_offsets")
        self._rejected = metrics.updates.labels("rejected")
        #: Whether a Spark listener has sent a progress update since the daemon started, and
        #: when the last one arrived (Unix seconds; read at scrape time, not set per update).
        self.listener_seen = False
        self.last_update = 0.0
        #: While the daemon starts (the socket bound, Redis not reached yet, or what needs
        #: it not started): why; every request but ``ping`` is answered ``unavailable`` with
        #: it, so a client keeps its updates and retries. None once started.
        self.starting: str | None = None
        metrics.last_update.set_function(lambda: self.last_update)

    async def begin(self, event: Event) -> Answer:
        """Start handling ``event`` (a progress is submitted to Redis now); its answer."""
        started = time.perf_counter()
        if self.starting is not None and not isinstance(event, Ping | Authenticated):
            return Answer(event.id, _now(self._error(event.id, ErrorCode.UNAVAILABLE,
                                                     self.starting)))  # fmt: skip
        if isinstance(event, Progress):
            self.last_update = time.time()
            if not self.listener_seen:
                self._first_progress(event)
        match event:
            case Progress(id=rid, checkpoint=c) if not ckpt.has_position(c):
                return Answer(rid, _now(self._no_position(rid, c, started)))
            case Progress(id=rid, checkpoint=c):
                slot = await self._coalescer.submit(c)  # its floor: the flush owner's
                # Blob mode: the wait for the blob starts now, beside the other requests.
                at_once = self._wait_durable is not None
                return Answer(rid, self._progress(rid, c, slot, started), at_once)
            case Get(id=rid, query_id=query_id, name=name):
                # In its turn: after every earlier request of the connection (read your writes).
                return Answer(rid, self._get(rid, query_id, name))
            case Ping(id=rid) | Authenticated(id=rid):
                return Answer(rid, _now(encode_ok(rid)))
            case Reset() | Retire():
                return Answer(event.id, self._admin_op(event))
            case BadRequest():
                return Answer(event.id, _now(self._bad(event)))
        raise AssertionError(f"unhandled event {event!r}")

    def _first_progress(self, event: Progress) -> None:
        """The first progress update since start: a listener reaches this daemon (a first
        deploy's question; ``checkpoint_sidecar_listener_seen``)."""
        self.listener_seen = True
        self._metrics.listener_seen.set(1)
        log.info(
            "first progress update since start: a Spark listener reaches this daemon "
            "(query=%s batch=%d)",
            event.checkpoint.label,
            event.checkpoint.batch_id,
        )

    def _no_position(self, rid: RequestId, c: ckpt.Checkpoint, started: float) -> bytes:
        # Nothing to resume from (sidecar.model.checkpoint's position rule): not stored, and
        # acknowledged at once, even in blob ack mode (no blob will ever hold it), so the
        # client neither resends it nor counts it as failed.
        self._no_offsets.inc()
        if self._observe is not None:
            self._observe(c, False)
        log.debug("update query=%s batch=%d has no end offsets; not stored", c.label, c.batch_id)
        self._metrics.ack_seconds.observe(time.perf_counter() - started)
        return encode_ok(rid, applied=False)

    async def _progress(
        self, rid: RequestId, c: ckpt.Checkpoint, slot: PendingWrite, started: float
    ) -> bytes:
        applied = False
        try:
            outcome = await slot
            if outcome is Outcome.NEEDS_FLOOR and self._floors is not None:
                # Redis does not know the query: read its blob's batch first (once per query).
                floor = await self._floors.read_floor(c.query_id)
                outcome = await (await self._coalescer.submit(c, floor))
            if outcome is Outcome.BELOW_FLOOR and self._floors is not None:
                # Redis would take it, the floor alone refused it: the blob may have been
                # rewound elsewhere (a reset through another daemon). Read it again, rarely;
                # always when an ack waits for the blob (it would be answered from the blob
                # as last read, which may be higher than the blob now).
                again = await self._floors.read_floor(
                    c.query_id, again=True, always=self._wait_durable is not None
                )
                if again is not None:
                    outcome = await (await self._coalescer.submit(c, again))
            applied = outcome is Outcome.APPLIED
        except NotReplicated as exc:  # stored on the primary only: not rejected, not acked
            self._metrics.not_durable.labels("replicas").inc()
            return self._error(rid, ErrorCode.NOT_DURABLE, str(exc))
        except SidecarError as exc:
            self._rejected.inc()
            return self._error(rid, ErrorCode(exc.code), str(exc))
        except Exception:
            log.exception("storing update query=%s batch=%d failed", c.label, c.batch_id)
            self._rejected.inc()
            return self._error(rid, ErrorCode.INTERNAL, INTERNAL_MESSAGE)
        finally:
            if self._observe is not None:  # whatever the outcome: an idle query reports too
                self._observe(c, applied)
        (self._applied if applied else self._stale).inc()
        if not applied:
            log.debug("stale update query=%s batch=%d not applied", c.label, c.batch_id)
        if self._wait_durable is not None:  # ack_mode=blob: wait until the blob has it
            # The deadline counts from when the request was read, not from when its turn in
            # the connection's reply order came: the acks of one read wait concurrently.
            left = self._blob_ack_timeout_s - (time.perf_counter() - started)
            try:
                durable = await self._wait_durable(c.query_id, c.batch_id, max(0.0, left))
            except NotOwner as exc:  # another daemon holds the lease: prompt, retriable
                self._metrics.not_durable.labels("not_owner").inc()
                return self._error(rid, ErrorCode.NOT_OWNER, str(exc))
            if durable:
                self._metrics.ack_seconds.observe(time.perf_counter() - started)
                return encode_ok(rid, applied=applied)
            self._metrics.not_durable.labels("blob").inc()
            return self._error(
                rid,
                ErrorCode.NOT_DURABLE,
                f"batch {c.batch_id} of query {c.label} is stored in Redis but not yet in the "
                f"blob after {self._blob_ack_timeout_s}s (lease not held or store unavailable; "
                "see /readyz); resending is safe",
            )
        self._metrics.ack_seconds.observe(time.perf_counter() - started)
        return encode_ok(rid, applied=applied)

    async def _get(self, rid: RequestId, query_id: str | None, name: str | None) -> bytes:
        try:
            if query_id is None and name is not None:
                query_id = await self._buffer.query_id_for(name)
            raw = await self._buffer.get(query_id) if query_id is not None else None
            if self._lookup_blob is not None:
                if raw is None:
                    raw = await self._lookup_blob(query_id, None if query_id else name)
                elif query_id is not None and await self._blob_is_newer(query_id, raw):
                    raw = await self._lookup_blob(query_id, None) or raw
        except SidecarError as exc:
            return self._error(rid, ErrorCode(exc.code), str(exc))
        return encode_ok(rid, checkpoint=msgspec.Raw(raw) if raw else None)

    async def _blob_is_newer(self, query_id: str, raw: bytes) -> bool:
        """Whether the query's blob holds a newer batch than Redis (Redis lost data and was
        given older updates before the floor was known, or restored from an older file)."""
        if self._floors is None:
            return False
        try:
            floor = await self._floors.read_floor(query_id)
        except SidecarError:
            return False  # the store cannot say now: Redis' answer is the best there is
        return floor is not None and floor > ckpt.decode(raw, query_id=query_id).batch_id

    async def _admin_op(self, event: AdminRequest) -> bytes:
        if self._admin is None:
            return self._error(event.id, ErrorCode.FORBIDDEN, "this daemon has no admin ops")
        try:
            return encode_ok(event.id, result=await self._admin(event))
        except SidecarError as exc:  # counted and logged by the admin op itself
            return self._error(event.id, ErrorCode(exc.code), str(exc))

    def _error(self, rid: RequestId, code: ErrorCode, message: str) -> bytes:
        """An error reply, counted by code (``checkpoint_sidecar_bad_requests_total``)."""
        self._metrics.bad_requests.labels(code.value).inc()
        return encode_error(rid, code, message)

    def _bad(self, event: BadRequest) -> bytes:
        if event.op == "progress":
            self._rejected.inc()
        elif event.op in ADMIN_OPS:
            self._metrics.admin_ops.labels(event.op, "refused").inc()
        log.log(
            logging.WARNING if event.fatal or event.op in ADMIN_OPS else logging.INFO,
            "bad request (%s): %s",
            event.code.value,
            event.message,
        )
        return self._error(event.id, event.code, event.message)
