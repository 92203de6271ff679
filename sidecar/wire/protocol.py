"""The socket protocol between the Spark listener and the daemon. Sans-IO.

This module turns bytes into typed events and events into bytes. It never touches a socket,
never awaits and imports no event loop: the daemon's async server (``sidecar.ingest.server``)
and its own clients (``sidecar.ops.client``, the benches) drive it. It is the reference; the
Spark side speaks a subset of it with the standard library only (``spark_bridge.wire``, and
the JVM listener's ``Wire.java``), checked against this module by tests.

Framing: newline-delimited JSON. One request object per line (``\\n``-terminated, a trailing
``\\r`` is tolerated, empty lines are ignored), one reply line per request, in request order.
Requests may carry ``"id"`` (string, integer or null), echoed in the reply.

Requests::

    {"op": "progress", "id": 1, "progress": {...Spark StreamingQueryProgress JSON...},
     "tracking": "sync" | "async" | "real_time"}  (optional: how the query tracks progress)
    {"op": "get", "id": 2, "query_id": "…"}      (or "name": "…")
    {"op": "ping", "id": 3}
    {"op": "reset", "id": 4, "name": "…", "to_batch": 36, "reason": "…"}   (admin: see below)
    {"op": "retire", "id": 5, "query_id": "…", "archive": true}
    {"op": "auth", "id": "auth", "token": "…"}  (TCP: the first request; see below)

Replies::

    {"id": 1, "ok": true, "applied": true}        # stored (false: stale, or no end offsets)
    {"id": 2, "ok": true, "checkpoint": {...} | null}
    {"id": 3, "ok": true}
    {"id": 4, "ok": true, "result": {...what was done...}}
    {"id": …, "ok": false, "error": {"code": "bad_json", "message": "…"}}

A bad line gets an error reply and the connection stays usable. A frame longer than the
limit is fatal: the error is sent and the connection is closed, never resynchronised
(there is no way to know where the oversized frame really ends).

``reset`` and ``retire`` are admin ops (docs/operator-ops.md): a :class:`ServerConnection`
answers them ``forbidden`` unless built with ``admin_refusal=None`` (the server decides per
listener).

Authentication (the TCP listener, which every local process can reach): a
:class:`ServerConnection` built with ``auth_token`` accepts nothing until an ``auth`` request
carries that token. Anything else first — another op, a wrong token, a bad line — is answered
``unauthenticated`` and the connection is closed, as after ``frame_too_large``. The token is
published beside the socket, readable by whoever may connect to it
(:mod:`sidecar.wire.endpoint`). On a connection without a token (the Unix socket) ``auth`` is
answered ``ok`` and changes nothing.
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from sidecar.model.checkpoint import (
    BatchId,
    Checkpoint,
    Id,
    SparkProgress,
    Tracking,
    from_progress,
    offsets_error,
    source_offsets,
)
from sidecar.model.document import SnapshotRef
from sidecar.model.restored import RestoreStats
from sidecar.wire.framing import MAX_FRAME_BYTES as MAX_FRAME_BYTES
from sidecar.wire.framing import MAX_JSON_DEPTH as MAX_JSON_DEPTH
from sidecar.wire.framing import FrameTooLarge as FrameTooLarge
from sidecar.wire.framing import LineFramer as LineFramer
from sidecar.wire.framing import nesting_exceeds as nesting_exceeds

RequestId = str | int | None


#: The message of every ``internal`` error reply (a bug: the daemon logs what happened).
INTERNAL_MESSAGE = "internal error; see the daemon log"


class ErrorCode(enum.StrEnum):
    """Stable, machine-readable error codes (part of the protocol contract)."""

    BAD_JSON = "bad_json"  # the line is not JSON (or not UTF-8)
    BAD_REQUEST = "bad_request"  # JSON, but not a valid request of its op
    UNKNOWN_OP = "unknown_op"  # "op" is missing from the known set
    FRAME_TOO_LARGE = "frame_too_large"  # line over the limit; the connection is closed
    UNAVAILABLE = "unavailable"  # Redis unreachable; nothing stored; retry
    NOT_DURABLE = "not_durable"  # ack_mode=blob: stored in Redis, not yet in the blob in time
    NOT_OWNER = "not_owner"  # ack_mode=blob: stored in Redis; another daemon holds the lease
    SHUTTING_DOWN = "shutting_down"  # the daemon is stopping; retry against the next one
    FORBIDDEN = "forbidden"  # an admin op this listener does not allow (the message says why)
    CONFLICT = "conflict"  # an admin op refused for now: query running, lease held elsewhere
    NOT_FOUND = "not_found"  # an admin op's query, or its batch, is not known
    UNAUTHENTICATED = "unauthenticated"  # TCP: no valid auth first; the connection is closed
    INTERNAL = "internal"  # a bug; the message says what failed


#: Error codes after which resending the same update can succeed (the daemon was down, busy,
#: or not yet durable); every other error is final for that update. Clients classify replies
#: with this set: the Python sender imports it, the JVM listener's copy is checked against it.
RETRIABLE_CODES: frozenset[str] = frozenset(
    {
        ErrorCode.UNAVAILABLE,
        ErrorCode.NOT_DURABLE,
        ErrorCode.NOT_OWNER,
        ErrorCode.SHUTTING_DOWN,
        ErrorCode.INTERNAL,
    }
)
#: Error codes after which the daemon closes the connection: a client reconnects.
CLOSING_CODES: frozenset[str] = frozenset({ErrorCode.FRAME_TOO_LARGE, ErrorCode.UNAUTHENTICATED})

#: The id a client gives its ``auth`` request (any id would do; this one reads well in logs).
AUTH_ID = "auth"
#: Longest token accepted in an ``auth`` request (the daemon's are 43 characters).
MAX_TOKEN_CHARS = 256


# --- events ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ping:
    id: RequestId


@dataclass(frozen=True, slots=True)
class Authenticated:
    """An ``auth`` request the connection accepted: answer it ``ok``."""

    id: RequestId


@dataclass(frozen=True, slots=True)
class Get:
    """Look a query up by ``query_id``, or by ``name`` (the newest query with that name)."""

    id: RequestId
    query_id: str | None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class Progress:
    id: RequestId
    checkpoint: Checkpoint


@dataclass(frozen=True, slots=True)
class BadRequest:
    """A line that could not be turned into a request; answer it with an error reply."""

    id: RequestId
    code: ErrorCode
    message: str
    #: True when the connection must be closed after the reply (framing is lost).
    fatal: bool = False
    #: The request's op when it was a known one (so a bad "progress" counts as rejected).
    op: str | None = None


# --- request schema (validated in one pass by msgspec) -------------------------------------


class _PingMsg(msgspec.Struct, tag_field="op", tag="ping"):
    id: RequestId = None


class _AuthMsg(msgspec.Struct, tag_field="op", tag="auth"):
    token: Annotated[str, msgspec.Meta(max_length=MAX_TOKEN_CHARS)]
    id: RequestId = None


class _GetMsg(msgspec.Struct, tag_field="op", tag="get"):
    query_id: Id | None = None
    name: str | None = None
    id: RequestId = None


class _ProgressMsg(msgspec.Struct, tag_field="op", tag="progress"):
    progress: SparkProgress
    id: RequestId = None
    #: How the query tracks progress, when the listener could tell (``Tracking``).
    tracking: Tracking | None = None


class SourceSpec(msgspec.Struct, frozen=True):
    """A source's position in a ``reset``: its end offset (where to resume from); a blank
    description is taken from the query's current source at that index."""

    end_offset: Any
    description: str = ""
    start_offset: Any = None
    latest_offset: Any = None
    num_input_rows: int | None = None


class Reset(msgspec.Struct, frozen=True, tag_field="op", tag="reset"):
    """Admin: make a checkpoint the query's position, recorded as a reset (docs/operator-ops.md).
    Exactly one of ``to_batch`` (a checkpoint the blob retains) or ``sources`` (explicit
    offsets, stored as batch ``batch_id``: by default the batch the blob holds). ``by``: who
    asks, as the client says (user@host, pid), for the log. ``force``: even if the query was
    heard from within the quiet time. ``from_spark``: the offsets are Spark's own last
    committed batch (``import-spark-checkpoint``): the position is Spark's committed one and
    ``stateful`` true says its directory has state (None: not known; never "stateless").
    ``state_rewound``: the caller moved the query's state store with it (or starts it fresh),
    so a stateful query may move back (``sidecar.model.stateful``); nothing else lets it.
    ``snapshot``: the document's new marker, the snapshot whose state goes with the new
    position (a restore's; None: offsets alone, no snapshot named). ``restored``: what the
    restore asking for this reset wrote (files, bytes, seconds), kept in Redis once the
    reset is done and exported by the daemon (None: not a restore)."""

    reason: str
    query_id: Id | None = None
    name: str | None = None
    to_batch: BatchId | None = None
    sources: tuple[SourceSpec, ...] | None = None
    batch_id: BatchId | None = None
    run_id: Id | None = None
    timestamp: str | None = None
    force: bool = False
    by: str | None = None
    from_spark: bool = False
    stateful: bool | None = None
    state_rewound: bool = False
    snapshot: SnapshotRef | None = None
    restored: RestoreStats | None = None
    id: RequestId = None


class Retire(msgspec.Struct, frozen=True, tag_field="op", tag="retire"):
    """Admin: stop tracking a query: its Redis keys removed, its blob kept or archived."""

    query_id: Id | None = None
    name: str | None = None
    archive: bool = False
    force: bool = False
    reason: str | None = None
    by: str | None = None
    id: RequestId = None


AdminRequest = Reset | Retire
Request = Ping | Get | Progress | Reset | Retire | Authenticated
Event = Request | BadRequest

_OPS = ("ping", "get", "progress", "reset", "retire", "auth")
ADMIN_OPS = frozenset({"reset", "retire"})
_request_decoder = msgspec.json.Decoder(
    _PingMsg | _GetMsg | _ProgressMsg | Reset | Retire | _AuthMsg
)
_any_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def parse_request(line: bytes, admin_refusal: str | None = None) -> Event:
    """Turn one frame (without its newline) into a request or a :class:`BadRequest`.

    ``admin_refusal``: when given, an admin op (``reset``, ``retire``) is answered
    ``forbidden`` with this message instead. An ``auth`` request becomes
    :class:`Authenticated` here: checking its token is the connection's job
    (:class:`ServerConnection`).
    """
    if nesting_exceeds(line):
        return BadRequest(
            None,
            ErrorCode.BAD_REQUEST,
            f"JSON nested deeper than {MAX_JSON_DEPTH} levels: not a valid request "
            "(Spark's progress nests about 6)",
        )
    try:
        msg = _request_decoder.decode(line)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        return _diagnose(line, exc)
    if isinstance(msg, _ProgressMsg):
        # Offsets are kept as their JSON text: check what decoding them would have checked.
        bad = offsets_error(source_offsets(msg.progress.sources))
        if bad is not None:
            return _diagnose(line, bad)
        return Progress(msg.id, from_progress(msg.progress, msg.tracking))
    if isinstance(msg, _GetMsg):
        if (msg.query_id is None) == (msg.name is None):
            return BadRequest(
                msg.id,
                ErrorCode.BAD_REQUEST,
                'a get request needs exactly one of "query_id" or "name"',
                op="get",
            )
        return Get(msg.id, msg.query_id, msg.name)
    if isinstance(msg, Reset | Retire):
        return _admin(msg, admin_refusal)
    if isinstance(msg, _AuthMsg):
        return Authenticated(msg.id)
    return Ping(msg.id)


def _admin(msg: Reset | Retire, refusal: str | None) -> Reset | Retire | BadRequest:
    op = "reset" if isinstance(msg, Reset) else "retire"
    problem = refusal
    if problem is None and msg.query_id is None and msg.name is None:
        problem = f'{op} needs "query_id" or "name"'
    elif isinstance(msg, Reset) and (
        (msg.to_batch is None) == (msg.sources is None) or not msg.reason.strip()
    ):
        problem = 'reset needs a non-empty "reason" and exactly one of "to_batch" or "sources"'
    if problem is None:
        return msg
    code = ErrorCode.FORBIDDEN if refusal is not None else ErrorCode.BAD_REQUEST
    return BadRequest(msg.id, code, problem, op=op)


def _diagnose(line: bytes, exc: Exception) -> BadRequest:
    """Slow path for bad input: find the id to echo and the most useful error code."""
    try:
        obj = _any_decoder.decode(line)
    except UnicodeDecodeError as err:
        return BadRequest(None, ErrorCode.BAD_JSON, f"not valid UTF-8: {err}")
    except msgspec.DecodeError as err:
        # msgspec 0.23 reports bad UTF-8 in a string as a DecodeError (0.22: UnicodeDecodeError)
        what = "UTF-8" if "UTF-8" in str(err) else "JSON"
        return BadRequest(None, ErrorCode.BAD_JSON, f"not valid {what}: {err}")
    if not isinstance(obj, dict):
        return BadRequest(
            None,
            ErrorCode.BAD_REQUEST,
            f"a request must be a JSON object, got {type(obj).__name__}",
        )
    rid = obj.get("id")
    if isinstance(rid, bool) or not isinstance(rid, str | int | None):
        return BadRequest(None, ErrorCode.BAD_REQUEST, '"id" must be a string, an integer or null')
    op = obj.get("op")
    if op is None:
        return BadRequest(rid, ErrorCode.BAD_REQUEST, f'missing "op"; one of {", ".join(_OPS)}')
    if op not in _OPS:
        return BadRequest(
            rid, ErrorCode.UNKNOWN_OP, f"unknown op {op!r}; this daemon knows {', '.join(_OPS)}"
        )
    return BadRequest(rid, ErrorCode.BAD_REQUEST, f"invalid {op} request: {exc}", op=op)


class ServerConnection:
    """The daemon's side of one connection: bytes in, events out.

    States: AUTHENTICATING (only with ``auth_token``: the first request must be ``auth`` with
    that token) → OPEN (requests) → CLOSED (after a fatal error; further data is ignored).
    """

    def __init__(
        self,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        admin_refusal: str | None = "admin ops are not allowed on this connection",
        *,
        auth_token: str | None = None,
        auth_hint: str = "",
    ) -> None:
        """``admin_refusal``: why admin ops are refused on this connection; None: allowed.
        ``auth_token``: the token this connection must be given first (None: none needed);
        ``auth_hint``: where a client finds it, added to the refusal."""
        self._framer = LineFramer(max_frame_bytes)
        self._max = max_frame_bytes
        self._admin_refusal = admin_refusal
        self._token = auth_token.encode() if auth_token is not None else None
        self._hint = auth_hint
        self.closed = False

    @property
    def authenticated(self) -> bool:
        """True once requests are accepted (at once when no token is needed)."""
        return self._token is None

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed received bytes; return the events they complete, in order.

        After a fatal :class:`BadRequest` the connection is closed and further data ignored.
        """
        if self.closed:
            return []
        try:
            frames = self._framer.feed(data)
        except FrameTooLarge as exc:
            # Requests completed before the oversized frame are answered, as they would be
            # had they arrived in an earlier read; nothing after it can be trusted.
            events = self._events(exc.frames)
            if self.closed:
                return events
            self.closed = True
            return [
                *events,
                BadRequest(
                    None,
                    ErrorCode.FRAME_TOO_LARGE,
                    f"request line exceeds {self._max} bytes without a newline; closing the "
                    "connection (raise SIDECAR_MAX_FRAME_BYTES if such requests are legitimate)",
                    fatal=True,
                ),
            ]
        return self._events(frames)

    def refuse_unauthenticated(self, why: str) -> BadRequest:
        """Close a connection that did not authenticate (e.g. in time); the reply to send."""
        self.closed = True
        return self._unauthenticated(None, why)

    def _events(self, frames: list[bytes]) -> list[Event]:
        events: list[Event] = []
        for frame in frames:
            event = parse_request(frame, self._admin_refusal)
            if self._token is not None:
                event = self._authenticate(event, frame)
                if self.closed:
                    events.append(event)
                    return events  # nothing after a refused first request is read
            events.append(event)
        return events

    def _authenticate(self, event: Event, frame: bytes) -> Event:
        """The first request of a connection that needs a token."""
        assert self._token is not None
        if not isinstance(event, Authenticated):
            self.closed = True
            what = "a bad line" if isinstance(event, BadRequest) else "another request"
            return self._unauthenticated(event.id, f"{what} came before auth")
        token = _token_of(frame)
        if token is None or not hmac.compare_digest(token, self._token):
            self.closed = True
            return self._unauthenticated(event.id, "the token is not this daemon's")
        self._token = None  # OPEN
        return event

    def _unauthenticated(self, rid: RequestId, why: str) -> BadRequest:
        return BadRequest(
            rid,
            ErrorCode.UNAUTHENTICATED,
            f"this listener needs authentication first ({why}): send "
            '{"op":"auth","token":"<token>"} as the first request; closing the connection'
            + (f". {self._hint}" if self._hint else ""),
            fatal=True,
            op="auth",
        )


_auth_decoder = msgspec.json.Decoder(_AuthMsg)


def _token_of(frame: bytes) -> bytes | None:
    """The token of an ``auth`` frame (already parsed once as one), as bytes."""
    try:
        return _auth_decoder.decode(frame).token.encode()
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None


# --- replies ---------------------------------------------------------------------------------


def encode_ok(rid: RequestId, **fields: Any) -> bytes:
    """A success reply line. ``fields`` may hold :class:`msgspec.Raw` JSON to embed as is."""
    return _encoder.encode({"id": rid, "ok": True, **fields}) + b"\n"


def encode_error(rid: RequestId, code: ErrorCode, message: str) -> bytes:
    """An error reply line."""
    return (
        _encoder.encode({"id": rid, "ok": False, "error": {"code": code, "message": message}})
        + b"\n"
    )


# --- the client's side ----------------------------------------------------------------------


class ErrorBody(msgspec.Struct, frozen=True):
    code: str
    message: str


class Reply(msgspec.Struct, frozen=True):
    """A reply as a client sees it; fields absent from the reply stay None."""

    ok: bool
    id: RequestId = None
    applied: bool | None = None
    checkpoint: dict[str, Any] | None = None
    #: What an admin op did (``reset``, ``retire``).
    result: dict[str, Any] | None = None
    error: ErrorBody | None = None


class ProtocolViolation(Exception):
    """The peer sent something that is not a valid reply."""


def encode_request(op: str, rid: RequestId = None, **fields: Any) -> bytes:
    """A request line, e.g. ``encode_request("progress", 7, progress=json_obj)``.

    A progress payload that is already JSON text may be passed as :class:`msgspec.Raw`.
    """
    return _encoder.encode({"op": op, "id": rid, **fields}) + b"\n"


class ClientConnection:
    """The client's side of one connection: reply bytes in, :class:`Reply` objects out."""

    _decoder = msgspec.json.Decoder(Reply)

    def __init__(self, max_frame_bytes: int = 4 * MAX_FRAME_BYTES) -> None:
        self._framer = LineFramer(max_frame_bytes)

    def receive_data(self, data: bytes) -> list[Reply]:
        """Feed received bytes; return the replies they complete.

        Raises:
            ProtocolViolation: the daemon sent an oversized or malformed reply.
        """
        try:
            frames = self._framer.feed(data)
        except FrameTooLarge as exc:
            raise ProtocolViolation(f"reply exceeds the frame limit ({exc.size} bytes)") from None
        try:
            return [self._decoder.decode(frame) for frame in frames]
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise ProtocolViolation(f"malformed reply: {exc}") from None
