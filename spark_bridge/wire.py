"""The daemon's socket protocol as the Spark side's Python speaks it. Sans-IO, standard library
only (Python 3.8+), no socket here.

The reference is ``sidecar/wire/protocol.py`` (docs/protocol.md): newline-delimited JSON, one
request per line, replies in request order with the request's ``id``. This module holds what
a client needs of it — a request line, the replies decoded from bytes with a cap on a line,
and which error codes are retried or close the connection — without the daemon's
dependencies, so ``spark_bridge`` installs on the Pythons Spark images ship. The JVM
listener's ``Wire.java`` is the same subset in Java. Both copies are checked against the
reference by tests (tests/unit/test_bridge_wire.py, tests/integration/test_listener_conformance.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Union

#: A request's id as the protocol allows it.
RequestId = Union[str, int, None]

#: Error codes after which resending the same update can succeed
#: (``sidecar.wire.protocol.RETRIABLE_CODES``).
RETRIABLE_CODES = frozenset(
    {"unavailable", "not_durable", "not_owner", "shutting_down", "internal"}
)
#: Error codes after which the daemon closes the connection (``CLOSING_CODES``).
CLOSING_CODES = frozenset({"frame_too_large", "unauthenticated"})
#: The code of a reply to a request the daemon failed on (a bug; ``ErrorCode.INTERNAL``).
INTERNAL = "internal"
#: Nothing stored or read: Redis down, or the daemon still starting (``ErrorCode.UNAVAILABLE``).
UNAVAILABLE = "unavailable"

#: Cap on one reply line: the daemon's own cap on a request line (1 MiB) four times, as its
#: client keeps it (a ``get`` answers with a checkpoint, never more than a progress holds).
MAX_REPLY_BYTES = 4 * 1024 * 1024


class ProtocolViolation(Exception):
    """The peer sent something that is not a valid reply: drop the connection."""


@dataclass(frozen=True)
class ErrorBody:
    code: str
    message: str


@dataclass(frozen=True)
class Reply:
    """A reply as a client sees it; fields absent from the reply stay None."""

    ok: bool
    id: RequestId = None
    applied: bool | None = None
    checkpoint: dict[str, Any] | None = None
    error: ErrorBody | None = None


def encode_request(op: str, rid: RequestId = None, **fields: Any) -> bytes:
    """A request line, e.g. ``encode_request("get", 1, query_id="…")``."""
    return json.dumps({"op": op, "id": rid, **fields}, separators=(",", ":")).encode() + b"\n"


def encode_progress(rid: int, progress_json: bytes, tracking: str | None = None) -> bytes:
    """A ``progress`` request line around Spark's own progress JSON, embedded as it is (never
    decoded and encoded again). A raw line break could only come from a non-JSON payload and
    would split the frame, so it becomes a space (JSON white space outside strings)."""
    body = progress_json.replace(b"\n", b" ").replace(b"\r", b" ")
    extra = b',"tracking":' + json.dumps(tracking).encode() if tracking is not None else b""
    return b'{"op":"progress","id":%d%s,"progress":%s}\n' % (rid, extra, body)


def decode_reply(line: bytes) -> Reply:
    """One reply line (without its newline).

    Raises:
        ProtocolViolation: not a reply of the protocol.
    """
    try:
        body = json.loads(line)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ProtocolViolation(f"malformed reply: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolViolation("a reply must be a JSON object")
    ok, rid = body.get("ok"), body.get("id")
    if not isinstance(ok, bool):
        raise ProtocolViolation('a reply needs a boolean "ok"')
    if isinstance(rid, bool) or not isinstance(rid, (str, int, type(None))):
        raise ProtocolViolation('a reply\'s "id" must be a string, an integer or null')
    applied, checkpoint, error = body.get("applied"), body.get("checkpoint"), body.get("error")
    if not isinstance(applied, (bool, type(None))) or not isinstance(
        checkpoint, (dict, type(None))
    ):
        raise ProtocolViolation('a reply\'s "applied" or "checkpoint" has the wrong type')
    found: ErrorBody | None = None
    if error is not None:
        if not (
            isinstance(error, dict)
            and isinstance(error.get("code"), str)
            and isinstance(error.get("message"), str)
        ):
            raise ProtocolViolation('an error reply needs "error": {"code", "message"}')
        found = ErrorBody(error["code"], error["message"])
    return Reply(ok, rid, applied, checkpoint, found)


class ClientConnection:
    """The client's side of one connection: reply bytes in, :class:`Reply` objects out."""

    def __init__(self, max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        self._max = max_reply_bytes
        self._buf = bytearray()

    def receive_data(self, data: bytes) -> list[Reply]:
        """Feed received bytes; return the replies they complete.

        Raises:
            ProtocolViolation: a malformed reply, or one longer than the cap.
        """
        self._buf += data
        replies: list[Reply] = []
        while True:
            end = self._buf.find(b"\n")
            if end < 0:
                break
            line = bytes(self._buf[:end]).rstrip(b"\r")
            del self._buf[: end + 1]
            if len(line) > self._max:
                raise ProtocolViolation(f"reply exceeds the frame limit ({len(line)} bytes)")
            if line:
                replies.append(decode_reply(line))
        if len(self._buf) > self._max:
            raise ProtocolViolation(f"reply exceeds the frame limit ({len(self._buf)} bytes)")
        return replies
