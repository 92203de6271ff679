"""The Spark side's copy of the protocol (``spark_bridge.wire``, standard library only) against
the reference, ``sidecar.wire.protocol``: the same codes, request lines the daemon reads as the
reference's, replies read as the reference's client reads them (or refused alike)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.wire import protocol
from spark_bridge import wire
from tests.sparkshapes import kafka_progress, rate_progress

QID = "8a3f7c2e-5b1d-4e6f-9a0b-1c2d3e4f5a6b"


def test_the_codes_are_the_protocols() -> None:
    assert wire.RETRIABLE_CODES == protocol.RETRIABLE_CODES
    assert wire.CLOSING_CODES == protocol.CLOSING_CODES
    assert wire.INTERNAL == protocol.ErrorCode.INTERNAL
    assert wire.MAX_REPLY_BYTES == 4 * protocol.MAX_FRAME_BYTES


@pytest.mark.parametrize("tracking", [None, "sync", "async", "real_time"])
@pytest.mark.parametrize("progress", [rate_progress(QID, 3), kafka_progress(QID, 7)])
def test_a_progress_line_is_read_by_the_daemon_as_the_references(
    progress: dict[str, Any], tracking: str | None
) -> None:
    compact = json.dumps(progress, separators=(",", ":")).encode()  # as Spark writes it
    ours = wire.encode_progress(5, compact, tracking)
    extra = {"tracking": tracking} if tracking else {}
    reference = protocol.encode_request("progress", 5, progress=progress, **extra)
    assert ours.endswith(b"\n") and ours.count(b"\n") == 1
    assert protocol.ServerConnection().receive_data(
        ours
    ) == protocol.ServerConnection().receive_data(reference)


def test_a_line_break_inside_a_payload_does_not_split_the_frame() -> None:
    pretty = json.dumps(rate_progress(QID, 1), indent=2).encode()
    [event] = protocol.ServerConnection().receive_data(wire.encode_progress(1, pretty))
    assert isinstance(event, protocol.Progress) and event.checkpoint.batch_id == 1


@pytest.mark.parametrize(
    ("op", "fields"),
    [
        ("get", {"query_id": QID}),
        ("get", {"name": "orders"}),
        ("ping", {}),
        ("auth", {"token": "t"}),
    ],
)
def test_other_requests_are_read_as_the_references(op: str, fields: dict[str, Any]) -> None:
    ours = wire.encode_request(op, 9, **fields)
    assert protocol.parse_request(ours.rstrip(b"\n")) == protocol.parse_request(
        protocol.encode_request(op, 9, **fields).rstrip(b"\n")
    )


ids = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=20))


@given(
    rid=ids,
    applied=st.one_of(st.none(), st.booleans()),
    checkpoint=st.one_of(
        st.none(), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3)
    ),
)
def test_success_replies_read_as_the_reference_client_reads_them(
    rid: Any, applied: bool | None, checkpoint: dict[str, int] | None
) -> None:
    fields: dict[str, Any] = {}
    if applied is not None:
        fields["applied"] = applied
    if checkpoint is not None:
        fields["checkpoint"] = checkpoint
    line = protocol.encode_ok(rid, **fields)
    [ours] = wire.ClientConnection().receive_data(line)
    [reference] = protocol.ClientConnection().receive_data(line)
    assert (ours.ok, ours.id, ours.applied, ours.checkpoint) == (
        reference.ok,
        reference.id,
        reference.applied,
        reference.checkpoint,
    )


@pytest.mark.parametrize("code", list(protocol.ErrorCode))
def test_every_error_code_is_read_as_the_reference_client_reads_it(
    code: protocol.ErrorCode,
) -> None:
    line = protocol.encode_error(3, code, "what happened\nand what to do")
    [ours] = wire.ClientConnection().receive_data(line)
    [reference] = protocol.ClientConnection().receive_data(line)
    assert ours.error is not None and reference.error is not None
    assert (ours.ok, ours.id, ours.error.code, ours.error.message) == (
        reference.ok,
        reference.id,
        reference.error.code,
        reference.error.message,
    )


@pytest.mark.parametrize(
    "line",
    [b"not json\n", b"[1,2]\n", b'{"id":1}\n', b'{"ok":"yes"}\n', b'{"ok":false,"error":"x"}\n'],
)
def test_malformed_replies_are_refused_by_both(line: bytes) -> None:
    with pytest.raises(protocol.ProtocolViolation):
        protocol.ClientConnection().receive_data(line)
    with pytest.raises(wire.ProtocolViolation):
        wire.ClientConnection().receive_data(line)


def test_replies_split_anywhere_arrive_whole() -> None:
    stream = protocol.encode_ok(1, applied=True) + protocol.encode_error(
        2, protocol.ErrorCode.UNAVAILABLE, "redis down"
    )
    conn = wire.ClientConnection()
    got = [reply for i in range(len(stream)) for reply in conn.receive_data(stream[i : i + 1])]
    assert [(r.id, r.ok) for r in got] == [(1, True), (2, False)]


def test_an_oversized_reply_is_refused() -> None:
    conn = wire.ClientConnection(max_reply_bytes=100)
    with pytest.raises(wire.ProtocolViolation, match="exceeds the frame limit"):
        conn.receive_data(b"x" * 101)
