"""The socket protocol between the Spark listener and the daemon. Sans-IO.

This module turns bytes into typed events and events into bytes. It never touches a socket,
never awaits and imports no event loop, so the daemon's async server (``sidecar.server``)
and the synchronous Spark-side client (``spark_bridge``) drive the very same code.

Framing: newline-delimited JSON. One request object per line (``\\n``-terminated, a trailing
``\\r`` is tolerated, empty lines are ignored), one reply line per request, in request order.
Requests may carry ``"id"`` (string, integer or null), echoed in the reply.

Requests::

    {"op": "progress", "id": 1, "progress": {...Spark StreamingQueryProgress JSON...}}
    {"op": "get", "id": 2, "query_id": "…"}      (or "name": "…")
    {"op": "ping", "id": 3}

Replies::

    {"id": 1, "ok": true, "applied": true}        # stored (false: stale, or no end offsets)
    {"id": 2, "ok": true, "checkpoint": {...} | null}
    {"id": 3, "ok": true}
    {"id": …, "ok": false, "error": {"code": "bad_json", "message": "…"}}

A bad line gets an error reply and the connection stays usable. A frame longer than the
limit is fatal: the error is sent and the connection is closed, never resynchronised
(there is no way to know where the oversized frame really ends).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from sidecar.checkpoint import Checkpoint, Id, SparkProgress, from_progress

#: Default cap on one request line, newline excluded. A Spark progress event for a Kafka
#: source with a few thousand partitions is ~100-300 KiB; 1 MiB leaves room and still bounds
#: what one connection can make the daemon hold in memory before it sees a newline.
MAX_FRAME_BYTES = 1024 * 1024

#: Deepest JSON nesting accepted in a request. Spark's progress JSON nests about six levels
#: (request → progress → sources → source → offsets → topic → partition). Without a cap, a
#: small hostile frame nested ~1,000 levels deep makes the decoder (and any later encode)
#: hit Python's recursion limit: a RecursionError, not a bad request. 64 leaves room for any
#: source's offsets and keeps every decode and encode far from that limit.
MAX_JSON_DEPTH = 64

RequestId = str | int | None


class ErrorCode(enum.StrEnum):
    """Stable, machine-readable error codes (part of the protocol contract)."""

    BAD_JSON = "bad_json"  # the line is not JSON (or not UTF-8)
    BAD_REQUEST = "bad_request"  # JSON, but not a valid request of its op
    UNKNOWN_OP = "unknown_op"  # "op" is missing from the known set
    FRAME_TOO_LARGE = "frame_too_large"  # line over the limit; the connection is closed
    UNAVAILABLE = "unavailable"  # Redis unreachable; nothing stored; retry
    NOT_DURABLE = "not_durable"  # ack_mode=blob: stored in Redis, not yet in the blob in time
    SHUTTING_DOWN = "shutting_down"  # the daemon is stopping; retry against the next one
    INTERNAL = "internal"  # a bug; the message says what failed


#: Error codes after which resending the same update can succeed (the daemon was down, busy,
#: or not yet durable); every other error is final for that update. Clients classify replies
#: with this set: the Python sender imports it, the JVM listener's copy is checked against it.
RETRIABLE_CODES: frozenset[str] = frozenset(
    {ErrorCode.UNAVAILABLE, ErrorCode.NOT_DURABLE, ErrorCode.SHUTTING_DOWN, ErrorCode.INTERNAL}
)
#: Error codes after which the daemon closes the connection: a client reconnects.
CLOSING_CODES: frozenset[str] = frozenset({ErrorCode.FRAME_TOO_LARGE})


# --- events ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ping:
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


Request = Ping | Get | Progress
Event = Request | BadRequest


# --- request schema (validated in one pass by msgspec) -------------------------------------


class _PingMsg(msgspec.Struct, tag_field="op", tag="ping"):
    id: RequestId = None


class _GetMsg(msgspec.Struct, tag_field="op", tag="get"):
    query_id: Id | None = None
    name: str | None = None
    id: RequestId = None


class _ProgressMsg(msgspec.Struct, tag_field="op", tag="progress"):
    progress: SparkProgress
    id: RequestId = None


_OPS = ("ping", "get", "progress")
_request_decoder = msgspec.json.Decoder(_PingMsg | _GetMsg | _ProgressMsg)
_any_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


# A JSON string literal (escapes included); brackets inside strings are not nesting.
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nesting_exceeds(frame: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text ``frame`` nests arrays/objects deeper than ``limit``."""
    if frame.count(b"[") + frame.count(b"{") <= limit:
        return False  # fewer openers than the limit: cannot be deeper (the common case)
    depth = 0
    for b in _JSON_STRING.sub(b'""', frame).translate(None, _NOT_BRACKETS):
        depth += 1 if b in b"[{" else -1
        if depth > limit:
            return True
    return False


def parse_request(line: bytes) -> Event:
    """Turn one frame (without its newline) into a request or a :class:`BadRequest`."""
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
        return Progress(msg.id, from_progress(msg.progress))
    if isinstance(msg, _GetMsg):
        if (msg.query_id is None) == (msg.name is None):
            return BadRequest(
                msg.id,
                ErrorCode.BAD_REQUEST,
                'a get request needs exactly one of "query_id" or "name"',
                op="get",
            )
        return Get(msg.id, msg.query_id, msg.name)
    return Ping(msg.id)


def _diagnose(line: bytes, exc: Exception) -> BadRequest:
    """Slow path for bad input: find the id to echo and the most useful error code."""
    try:
        obj = _any_decoder.decode(line)
    except UnicodeDecodeError as err:
        return BadRequest(None, ErrorCode.BAD_JSON, f"not valid UTF-8: {err}")
    except msgspec.DecodeError as err:
        return BadRequest(None, ErrorCode.BAD_JSON, f"not valid JSON: {err}")
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


# --- framing -------------------------------------------------------------------------------


class FrameTooLarge(Exception):
    """A frame exceeded the limit; ``frames`` holds those completed before it in the same feed."""

    def __init__(self, size: int, frames: list[bytes]) -> None:
        super().__init__(size)
        self.size = size
        self.frames = frames


class LineFramer:
    """Split a byte stream into newline-terminated frames, never holding more than the limit.

    Incremental: a frame may arrive one byte at a time or many frames in one chunk; the
    scan resumes where it stopped, so byte-at-a-time input stays linear.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._max = max_frame_bytes
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf already known to hold no newline

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data``; return the complete frames it finished (newline stripped).

        Raises:
            FrameTooLarge: a frame is longer than the limit (the framer is then unusable).
        """
        self._buf += data
        frames: list[bytes] = []
        start = 0
        while True:
            end = self._buf.find(b"\n", max(start, self._scanned))
            if end < 0:
                break
            frame = bytes(self._buf[start:end])
            if frame.endswith(b"\r"):  # CRLF: the \r is part of the line ending, not the frame
                frame = frame[:-1]
            if len(frame) > self._max:
                raise FrameTooLarge(len(frame), frames)
            if frame:
                frames.append(frame)
            start = end + 1
        del self._buf[:start]
        self._scanned = len(self._buf)
        pending = self._scanned - self._buf.endswith(b"\r")  # a \r may be half a CRLF
        if pending > self._max:
            raise FrameTooLarge(self._scanned, frames)
        return frames

    @property
    def buffered(self) -> int:
        """Bytes held for an unfinished frame."""
        return len(self._buf)


class ServerConnection:
    """The daemon's side of one connection: bytes in, events out."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._framer = LineFramer(max_frame_bytes)
        self._max = max_frame_bytes
        self.closed = False

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
            self.closed = True
            return [parse_request(frame) for frame in exc.frames] + [
                BadRequest(
                    None,
                    ErrorCode.FRAME_TOO_LARGE,
                    f"request line exceeds {self._max} bytes without a newline; closing the "
                    "connection (raise SIDECAR_MAX_FRAME_BYTES if such requests are legitimate)",
                    fatal=True,
                )
            ]
        return [parse_request(frame) for frame in frames]


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
