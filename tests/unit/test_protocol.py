"""Unit tests of the sans-IO wire protocol (``sidecar.wire.protocol``) and the checkpoint record.

Pure logic: bytes in, events out. No socket, no Redis, no event loop.
Decoder tests run three ways, as h11's ``test_io.py`` does: the whole buffer at once, one
byte at a time, and with a trailing incomplete frame that must be held until it completes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.errors import CorruptRecord
from sidecar.model import checkpoint
from sidecar.model.checkpoint import Checkpoint, SourceOffsets
from sidecar.model.document import CheckpointDocument, Writer, decode_document, encode_document
from sidecar.wire import endpoint
from sidecar.wire.protocol import (
    AUTH_ID,
    CLOSING_CODES,
    MAX_FRAME_BYTES,
    RETRIABLE_CODES,
    Authenticated,
    BadRequest,
    ClientConnection,
    ErrorCode,
    Event,
    Get,
    LineFramer,
    Ping,
    Progress,
    ProtocolViolation,
    ServerConnection,
    encode_error,
    encode_ok,
    encode_request,
    parse_request,
)
from tests.sparkshapes import idle_progress_spark34, kafka_progress, rate_progress

QID = "8a3f7c2e-5b1d-4e6f-9a0b-1c2d3e4f5a6b"
OTHER_QID = "1f2e3d4c-5b6a-4798-8a9b-0c1d2e3f4a5b"


def expected_checkpoint(progress: dict[str, Any]) -> Checkpoint:
    """The checkpoint a progress dict should become, built by hand (the test's oracle)."""
    return Checkpoint(
        query_id=progress["id"],
        run_id=progress["runId"],
        name=progress.get("name"),
        batch_id=progress["batchId"],
        timestamp=progress["timestamp"],
        sources=[
            SourceOffsets(
                description=s["description"],
                start_offset=msgspec.Raw(as_json(s.get("startOffset"))),
                end_offset=msgspec.Raw(as_json(s.get("endOffset"))),
                latest_offset=msgspec.Raw(as_json(s.get("latestOffset"))),
                num_input_rows=s.get("numInputRows"),
            )
            for s in progress["sources"]
        ],
    )


def as_json(value: Any) -> bytes:
    """Compare JSON values by their encoding, so 1 vs 1.0 vs True count as different."""
    return msgspec.json.encode(value)


# --- feeding strategies ------------------------------------------------------------------

Feed = Callable[[ServerConnection, bytes], list[Event]]


def feed_whole(conn: ServerConnection, data: bytes) -> list[Event]:
    return conn.receive_data(data)


def feed_bytewise(conn: ServerConnection, data: bytes) -> list[Event]:
    events: list[Event] = []
    for i in range(len(data)):
        events += conn.receive_data(data[i : i + 1])
    return events


def feed_in_chunks_of_7(conn: ServerConnection, data: bytes) -> list[Event]:
    events: list[Event] = []
    for i in range(0, len(data), 7):
        events += conn.receive_data(data[i : i + 7])
    return events


@pytest.fixture(
    params=[feed_whole, feed_bytewise, feed_in_chunks_of_7], ids=["whole", "bytewise", "chunks7"]
)
def feed(request: pytest.FixtureRequest) -> Feed:
    return request.param  # type: ignore[no-any-return]


RATE = rate_progress(QID, 41)
KAFKA = kafka_progress(OTHER_QID, 7, partitions=4)

STREAMS = [
    pytest.param(encode_request("ping", 1), [Ping(1)], id="one-ping"),
    pytest.param(
        encode_request("ping", 1)
        + encode_request("get", "g-2", query_id=QID)
        + encode_request("progress", 3, progress=RATE)
        + encode_request("progress", 4, progress=KAFKA),
        [
            Ping(1),
            Get("g-2", QID),
            Progress(3, expected_checkpoint(RATE)),
            Progress(4, expected_checkpoint(KAFKA)),
        ],
        id="several-frames",
    ),
    pytest.param(
        encode_request("ping", 1).replace(b"\n", b"\r\n")
        + encode_request("progress", 2, progress=RATE).replace(b"\n", b"\r\n"),
        [Ping(1), Progress(2, expected_checkpoint(RATE))],
        id="crlf",
    ),
    pytest.param(
        b"\n\r\n\n" + encode_request("ping", 1) + b"\n\n" + encode_request("ping", 2) + b"\r\n",
        [Ping(1), Ping(2)],
        id="empty-lines-ignored",
    ),
]


# --- framing -------------------------------------------------------------------------------


@pytest.mark.parametrize(("stream", "expected"), STREAMS)
def test_decoder_yields_the_same_events_however_the_bytes_arrive(
    feed: Feed, stream: bytes, expected: list[Event]
) -> None:
    conn = ServerConnection()
    assert feed(conn, stream) == expected
    assert conn.closed is False


@pytest.mark.parametrize(("stream", "expected"), STREAMS)
def test_trailing_partial_frame_is_held_until_its_newline(
    feed: Feed, stream: bytes, expected: list[Event]
) -> None:
    trailing = encode_request("get", 99, query_id=QID)
    head, tail = trailing[:-10], trailing[-10:]
    conn = ServerConnection()

    assert feed(conn, stream + head) == expected  # the partial frame is not emitted
    assert feed(conn, tail) == [Get(99, QID)]  # and completes with the rest


@pytest.mark.parametrize("feed_framer", ["whole", "bytewise"])
def test_line_framer_buffers_exactly_the_unfinished_frame(feed_framer: str) -> None:
    data = b"first\r\nsecond\n\nthi"
    framer = LineFramer()
    if feed_framer == "whole":
        frames = framer.feed(data)
    else:
        frames = [f for i in range(len(data)) for f in framer.feed(data[i : i + 1])]
    assert frames == [b"first", b"second"]
    assert framer.buffered == len(b"thi")
    assert framer.feed(b"rd\n") == [b"third"]
    assert framer.buffered == 0


def test_a_large_frame_split_across_many_feeds_arrives_once_whole() -> None:
    progress = kafka_progress(QID, 12, partitions=200)
    line = encode_request("progress", 5, progress=progress)
    pieces = [line[i : i + 97] for i in range(0, len(line), 97)]
    assert len(pieces) > 50
    conn = ServerConnection()

    events = [conn.receive_data(piece) for piece in pieces]

    assert events[:-1] == [[]] * (len(pieces) - 1)
    assert events[-1] == [Progress(5, expected_checkpoint(progress))]


def test_default_frame_limit_fits_a_kafka_source_with_thousands_of_partitions() -> None:
    progress = kafka_progress(QID, 1_000_000, partitions=5000)
    line = encode_request("progress", 1, progress=progress)
    assert 100_000 < len(line) < MAX_FRAME_BYTES
    assert ServerConnection().receive_data(line) == [Progress(1, expected_checkpoint(progress))]


# --- error codes ---------------------------------------------------------------------------


def progress_line(rid: Any = 4, **changes: Any) -> bytes:
    """A rate progress request with fields of ``progress`` replaced (``...`` deletes one)."""
    progress = copy.deepcopy(RATE)
    for key, value in changes.items():
        if value is ...:
            del progress[key]
        else:
            progress[key] = value
    return encode_request("progress", rid, progress=progress).rstrip(b"\n")


JSON, REQ, OP = ErrorCode.BAD_JSON, ErrorCode.BAD_REQUEST, ErrorCode.UNKNOWN_OP
ID_TYPE = '"id" must be a string, an integer or null'
KNOWN_OPS = "this daemon knows ping, get, progress"

# fmt: off  (one row per case reads better than one argument per line)
BAD_LINES = [
    # case, line, code, echoed id, op, a fragment the message must contain
    ("not-json", b"this is not json", JSON, None, None, "not valid JSON"),
    ("truncated-json", b'{"op": "ping", "id": 1', JSON, None, None, "not valid JSON"),
    ("invalid-utf8-bytes", b"\xff\xfe\xfd", JSON, None, None, "not valid JSON"),
    ("json-array", b'[{"op": "ping"}]', REQ, None, None, "must be a JSON object, got list"),
    ("json-string", b'"ping"', REQ, None, None, "must be a JSON object, got str"),
    ("missing-op", b'{"id": 7}', REQ, 7, None, 'missing "op"; one of ping, get, progress'),
    ("id-true", b'{"op": "ping", "id": true}', REQ, None, None, ID_TYPE),
    ("id-float", b'{"op": "ping", "id": 1.5}', REQ, None, None, ID_TYPE),
    ("id-object", b'{"op": "ping", "id": {"n": 1}}', REQ, None, None, ID_TYPE),
    ("progress-no-batchId", progress_line(4, batchId=...), REQ, 4, "progress", "`batchId`"),
    (
        "progress-negative-batchId",
        progress_line(4, batchId=-1),
        REQ,
        4,
        "progress",
        ">= 0 - at `$.progress.batchId`",
    ),
    (
        "progress-string-batchId",
        progress_line("p-4", batchId="41"),
        REQ,
        "p-4",
        "progress",
        "`$.progress.batchId`",
    ),
    (
        "progress-sources-not-a-list",
        progress_line(4, sources={"rate": 1}),
        REQ,
        4,
        "progress",
        "`$.progress.sources`",
    ),
    ("progress-empty-query-id", progress_line(4, id=""), REQ, 4, "progress", "`$.progress.id`"),
    (
        "progress-without-payload",
        encode_request("progress", 4).rstrip(b"\n"),
        REQ,
        4,
        "progress",
        "missing required field `progress`",
    ),
    (
        "get-without-query-id",
        encode_request("get", 5).rstrip(b"\n"),
        REQ,
        5,
        "get",
        'exactly one of "query_id" or "name"',
    ),
    (
        "unknown-op",
        encode_request("frobnicate", 6).rstrip(b"\n"),
        OP,
        6,
        None,
        f"unknown op 'frobnicate'; {KNOWN_OPS}",
    ),
    (
        "unknown-op-string-id",
        encode_request("PING", "six").rstrip(b"\n"),
        OP,
        "six",
        None,
        KNOWN_OPS,
    ),
]
# fmt: on


@pytest.mark.parametrize(
    ("line", "code", "rid", "op", "fragment"),
    [case[1:] for case in BAD_LINES],
    ids=[case[0] for case in BAD_LINES],
)
def test_bad_line_gets_its_error_and_the_connection_survives(
    line: bytes, code: ErrorCode, rid: Any, op: str | None, fragment: str
) -> None:
    conn = ServerConnection()

    events = conn.receive_data(line + b"\n" + encode_request("ping", 99))

    assert len(events) == 2
    bad, follow = events
    assert isinstance(bad, BadRequest)
    assert (bad.code, bad.id, bad.op, bad.fatal) == (code, rid, op, False)
    assert fragment in bad.message
    assert follow == Ping(99)
    assert conn.closed is False


def test_good_request_in_a_later_read_after_a_bad_one_is_parsed() -> None:
    conn = ServerConnection()

    [bad] = conn.receive_data(progress_line(1, batchId=-5) + b"\n")
    [good] = conn.receive_data(encode_request("progress", 2, progress=RATE))

    assert isinstance(bad, BadRequest)
    assert bad.code is ErrorCode.BAD_REQUEST
    assert good == Progress(2, expected_checkpoint(RATE))


# --- frame limit ---------------------------------------------------------------------------

LIMIT = 64


def assert_frame_too_large(events: list[Event]) -> None:
    assert len(events) == 1
    [event] = events
    assert isinstance(event, BadRequest)
    assert (event.code, event.id, event.fatal) == (ErrorCode.FRAME_TOO_LARGE, None, True)
    assert f"exceeds {LIMIT} bytes" in event.message
    assert "SIDECAR_MAX_FRAME_BYTES" in event.message


def test_line_of_exactly_the_limit_is_accepted() -> None:
    conn = ServerConnection(max_frame_bytes=LIMIT)
    [event] = conn.receive_data(b"x" * LIMIT + b"\n")
    assert isinstance(event, BadRequest)
    assert event.code is ErrorCode.BAD_JSON  # parsed as a frame, not refused for its size
    assert conn.closed is False


def test_oversized_line_arriving_with_its_newline_is_fatal() -> None:
    conn = ServerConnection(max_frame_bytes=LIMIT)
    assert_frame_too_large(conn.receive_data(b"x" * (LIMIT + 1) + b"\n"))
    assert conn.closed is True


def test_line_growing_past_the_limit_without_newline_is_fatal_before_it_ends() -> None:
    conn = ServerConnection(max_frame_bytes=LIMIT)
    assert conn.receive_data(b"x" * 40) == []
    assert conn.receive_data(b"x" * (LIMIT - 40)) == []  # exactly at the limit: still waiting
    assert_frame_too_large(conn.receive_data(b"x"))
    assert conn.closed is True


def test_line_growing_byte_by_byte_past_the_limit_is_fatal() -> None:
    conn = ServerConnection(max_frame_bytes=LIMIT)
    assert feed_bytewise(conn, b"{" * LIMIT) == []
    assert_frame_too_large(conn.receive_data(b"{"))


@pytest.mark.parametrize(
    "oversized",
    [b"x" * (LIMIT + 1) + b"\n", b"x" * (LIMIT + 1)],
    ids=["with-newline", "without-newline"],
)
def test_after_frame_too_large_the_connection_ignores_further_data(oversized: bytes) -> None:
    conn = ServerConnection(max_frame_bytes=LIMIT)
    assert_frame_too_large(conn.receive_data(oversized))

    assert conn.receive_data(b"\n" + encode_request("ping", 1)) == []
    assert conn.receive_data(encode_request("ping", 2)) == []
    assert conn.closed is True


# --- offsets as JSON values ------------------------------------------------------------------


@pytest.mark.parametrize(
    "progress",
    [
        rate_progress(QID, 0),
        rate_progress(QID, 123, name=None),
        kafka_progress(QID, 0),  # first batch: startOffset is null
        kafka_progress(QID, 9, topic="orders", partitions=6),
    ],
    ids=["rate-first", "rate-unnamed", "kafka-first", "kafka-later"],
)
def test_source_offsets_round_trip_as_json_values(progress: dict[str, Any]) -> None:
    [event] = ServerConnection().receive_data(encode_request("progress", 1, progress=progress))

    assert isinstance(event, Progress)
    got = event.checkpoint.sources
    assert len(got) == len(progress["sources"]) == 1
    sent = progress["sources"][0]
    assert got[0].description == sent["description"]
    assert as_json(got[0].start_offset) == as_json(sent["startOffset"])
    assert as_json(got[0].end_offset) == as_json(sent["endOffset"])
    assert as_json(got[0].latest_offset) == as_json(sent["latestOffset"])
    assert got[0].num_input_rows == sent["numInputRows"]


def test_kafka_offsets_stay_nested_objects() -> None:
    progress = kafka_progress(QID, 2, topic="events", partitions=2)
    [event] = ServerConnection().receive_data(encode_request("progress", 1, progress=progress))

    assert isinstance(event, Progress)
    source = event.checkpoint.sources[0]
    assert checkpoint.offset_value(source.end_offset) == {"events": {"0": 300, "1": 301}}
    assert checkpoint.offset_value(source.start_offset) == {"events": {"0": 200, "1": 201}}


def test_progress_already_serialized_as_raw_json_parses_like_a_dict() -> None:
    raw = msgspec.Raw(msgspec.json.encode(KAFKA))
    [event] = ServerConnection().receive_data(encode_request("progress", 8, progress=raw))
    assert event == Progress(8, expected_checkpoint(KAFKA))


@pytest.mark.parametrize("batch_id", [2**62, 2**63 - 1])
def test_huge_batch_ids_survive(batch_id: int) -> None:
    progress = rate_progress(QID, 0) | {"batchId": batch_id}
    [event] = ServerConnection().receive_data(encode_request("progress", 1, progress=progress))

    assert isinstance(event, Progress)
    assert event.checkpoint.batch_id == batch_id
    assert checkpoint.decode(checkpoint.encode(event.checkpoint)).batch_id == batch_id


# --- the position rule: a checkpoint without any end offset is never stored ------------------


def test_spark34_idle_progress_parses_but_has_no_position() -> None:
    progress = idle_progress_spark34(QID, 4)
    [event] = ServerConnection().receive_data(encode_request("progress", 1, progress=progress))

    assert event == Progress(1, expected_checkpoint(progress))  # valid: answered, not an error
    assert not checkpoint.has_position(event.checkpoint)


@pytest.mark.parametrize(
    ("end_offsets", "expected"),
    [
        ([None], False),  # Spark 3.4's idle trigger
        ([], False),  # no source at all: nothing to resume either
        ([None, None], False),
        ([0], True),  # falsy, still a position (a rate source at its start)
        ([{}], True),
        ([{"events": {"0": 5}}], True),
        ([None, {"events": {"0": 5}}], True),  # one source has not produced offsets yet
    ],
)
def test_has_position_when_any_source_reports_an_end_offset(
    end_offsets: list[Any], expected: bool
) -> None:
    progress = rate_progress(QID, 3)
    source = progress["sources"][0]
    progress["sources"] = [source | {"endOffset": end} for end in end_offsets]
    [event] = ServerConnection().receive_data(encode_request("progress", 1, progress=progress))

    assert isinstance(event, Progress)
    assert checkpoint.has_position(event.checkpoint) is expected


# --- property tests ----------------------------------------------------------------------------

LONG = st.integers(min_value=-(2**63), max_value=2**63 - 1)  # Spark offsets are Java longs
json_values = st.recursive(
    st.none()
    | st.booleans()
    | LONG
    | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
# Query and run ids: Spark's are UUIDs; the protocol accepts a safe alphabet (they name blobs).
ids_text = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_:.-]{0,255}\Z", fullmatch=True)

source_dicts = st.fixed_dictionaries(
    {
        "description": st.text(max_size=40),
        "startOffset": json_values,
        "endOffset": json_values,
        "latestOffset": json_values,
        "numInputRows": st.none() | st.integers(min_value=0, max_value=2**63 - 1),
    }
)
progress_dicts = st.fixed_dictionaries(
    {
        "id": ids_text,
        "runId": ids_text,
        "name": st.none() | st.text(max_size=40),
        "batchId": st.integers(min_value=0, max_value=2**63 - 1),
        "timestamp": st.text(max_size=30),
        "sources": st.lists(source_dicts, max_size=3),
    }
)
request_ids = st.none() | st.text(max_size=10) | LONG


@settings(max_examples=200, deadline=None)
@given(progress=progress_dicts, rid=request_ids)
def test_any_valid_progress_round_trips_to_its_checkpoint(
    progress: dict[str, Any], rid: str | int | None
) -> None:
    events = ServerConnection().receive_data(encode_request("progress", rid, progress=progress))

    assert len(events) == 1
    [event] = events
    assert isinstance(event, Progress)
    assert event.id == rid
    assert event.checkpoint == expected_checkpoint(progress)
    # Equal and of the same JSON types (== alone would take True for 1 and 1.0 for 1).
    assert checkpoint.encode(event.checkpoint) == checkpoint.encode(expected_checkpoint(progress))


frames = st.one_of(
    st.builds(lambda rid: encode_request("ping", rid), request_ids),
    st.builds(lambda rid, q: encode_request("get", rid, query_id=q), request_ids, ids_text),
    st.builds(
        lambda rid, p: encode_request("progress", rid, progress=p), request_ids, progress_dicts
    ),
    st.sampled_from(
        [
            b"not json\n",
            b"[]\n",
            b'{"op": "nope", "id": 3}\n',
            b"\n",
            b"\r\n",
            encode_request("ping", 1).replace(b"\n", b"\r\n"),
        ]
    ),
)


@settings(max_examples=200, deadline=None)
@given(stream=st.lists(frames, min_size=1, max_size=8).map(b"".join), data=st.data())
def test_any_split_of_a_stream_yields_the_events_of_the_whole(
    stream: bytes, data: st.DataObject
) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=20).map(sorted), label="cuts")
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    assert b"".join(chunks) == stream

    whole = ServerConnection().receive_data(stream)
    split_conn = ServerConnection()
    split = [event for chunk in chunks for event in split_conn.receive_data(chunk)]

    assert split == whole
    # One event per non-empty line (JSON escapes newlines, so every b"\n" ends a line).
    assert len(whole) == sum(1 for line in stream.split(b"\n")[:-1] if line.rstrip(b"\r"))


# --- replies -----------------------------------------------------------------------------------


def test_encode_ok_is_one_compact_line() -> None:
    assert encode_ok(1) == b'{"id":1,"ok":true}\n'
    assert encode_ok("a", applied=False) == b'{"id":"a","ok":true,"applied":false}\n'


def test_encode_error_is_one_line_even_when_the_message_has_newlines() -> None:
    line = encode_error(3, ErrorCode.BAD_JSON, "first line\nsecond line")
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert msgspec.json.decode(line) == {
        "id": 3,
        "ok": False,
        "error": {"code": "bad_json", "message": "first line\nsecond line"},
    }


@pytest.mark.parametrize("code", list(ErrorCode))
def test_client_reads_back_every_error_code(code: ErrorCode) -> None:
    [reply] = ClientConnection().receive_data(encode_error("r1", code, "what to do next"))
    assert reply.ok is False
    assert reply.id == "r1"
    assert reply.error is not None
    assert (reply.error.code, reply.error.message) == (code.value, "what to do next")


def test_client_reads_replies_with_an_embedded_raw_checkpoint() -> None:
    cp = expected_checkpoint(KAFKA)
    stream = (
        encode_ok(1, applied=True)
        + encode_ok(2, checkpoint=msgspec.Raw(checkpoint.encode(cp)))
        + encode_ok(3, checkpoint=None)
        + encode_ok(None)
    )
    client = ClientConnection()

    replies = [r for i in range(len(stream)) for r in client.receive_data(stream[i : i + 1])]

    assert [(r.id, r.ok, r.applied) for r in replies] == [
        (1, True, True),
        (2, True, None),
        (3, True, None),
        (None, True, None),
    ]
    assert replies[1].checkpoint == msgspec.json.decode(checkpoint.encode(cp))
    assert replies[1].checkpoint is not None
    assert replies[1].checkpoint["sources"][0]["end_offset"] == KAFKA["sources"][0]["endOffset"]
    assert replies[2].checkpoint is None


@pytest.mark.parametrize(
    "line",
    [
        b"not json\n",
        b"[]\n",
        b'{"id": 1}\n',
        b'{"ok": "yes"}\n',
        b'{"ok": false, "error": {"code": "x"}}\n',
    ],
    ids=["not-json", "array", "missing-ok", "ok-not-bool", "error-without-message"],
)
def test_client_refuses_a_malformed_reply(line: bytes) -> None:
    with pytest.raises(ProtocolViolation, match="malformed reply"):
        ClientConnection().receive_data(line)


def test_client_refuses_an_oversized_reply() -> None:
    client = ClientConnection(max_frame_bytes=16)
    assert client.receive_data(b'{"id":1,') == []
    with pytest.raises(ProtocolViolation, match="exceeds the frame limit"):
        client.receive_data(b'"ok":true,"pad":1}')


def test_request_lines_end_in_exactly_one_newline() -> None:
    line = encode_request("progress", 1, progress=KAFKA)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1


# --- the checkpoint record -------------------------------------------------------------------


@pytest.mark.parametrize(
    "progress", [RATE, KAFKA, rate_progress(QID, 0, name=None)], ids=["rate", "kafka", "unnamed"]
)
def test_checkpoint_encode_decode_round_trip(progress: dict[str, Any]) -> None:
    cp = expected_checkpoint(progress)
    assert checkpoint.decode(checkpoint.encode(cp)) == cp


def test_checkpoint_decode_refuses_an_incomplete_record() -> None:
    with pytest.raises(CorruptRecord, match="query_id"):
        checkpoint.decode(b'{"run_id": "r", "batch_id": 1}')


def test_label_is_the_name_when_the_query_is_named() -> None:
    assert expected_checkpoint(rate_progress(QID, 1, name="rate-demo")).label == "rate-demo"


def test_label_is_the_query_id_when_the_query_is_unnamed() -> None:
    assert expected_checkpoint(rate_progress(QID, 1, name=None)).label == QID


# --- regressions ------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [b'{"op": "ping", "id": "\xff"}', b'{"op": "get", "id": 1, "query_id": "q\xc3"}', b'"\xff"'],
)
def test_invalid_utf8_inside_a_json_string_is_bad_json(line: bytes) -> None:
    conn = ServerConnection()
    events = conn.receive_data(line + b"\n" + encode_request("ping", 2))
    assert isinstance(events[0], BadRequest)
    assert events[0].code is ErrorCode.BAD_JSON
    assert events[1] == Ping(2)


def test_request_before_an_oversized_frame_in_the_same_read_is_not_dropped() -> None:
    conn = ServerConnection(max_frame_bytes=64)
    events = conn.receive_data(encode_request("ping", 1) + b"x" * 65 + b"\n")
    assert events[0] == Ping(1)  # as when the same bytes arrive in two reads
    assert isinstance(events[-1], BadRequest) and events[-1].fatal


@pytest.mark.parametrize("query_id", ["a/../../b", "../x", "", "q id", "q/1"])
def test_query_ids_that_could_escape_the_namespace_are_refused(query_id: str) -> None:
    event = parse_request(encode_request("get", 1, query_id=query_id).rstrip(b"\n"))
    assert isinstance(event, BadRequest) and event.code is ErrorCode.BAD_REQUEST
    progress = rate_progress(query_id or "x", 1)
    progress["id"] = query_id
    event = parse_request(encode_request("progress", 2, progress=progress).rstrip(b"\n"))
    assert isinstance(event, BadRequest) and "$.progress.id" in event.message


# --- offsets kept as JSON text: still checked as a decode would check them ----------------------

ACCEPTED_TEXT = [
    b'{"b": {"10": 5, "2": 4}, "a":{"0":1}}',  # order and spaces: kept as sent
    b"1.50",
    b'"e2e-\xc3\xa9v\xc3\xa9nements"',  # UTF-8, and "e2" inside a string: decoded to check
    b"-0",
    b"9" * 4300,
    b"1.5e308",
]


@pytest.mark.parametrize("text", ACCEPTED_TEXT)
def test_offsets_are_kept_as_the_exact_text_sent(text: bytes) -> None:
    body = msgspec.json.encode(rate_progress(QID, 1) | {"sources": []})
    source = b'{"description":"d","startOffset":null,"endOffset": ' + text + b" }"
    line = body.replace(b'"sources":[]', b'"sources":[' + source + b"]")
    [event] = ServerConnection().receive_data(
        encode_request("progress", 1, progress=msgspec.Raw(line))
    )
    assert isinstance(event, Progress)
    assert bytes(memoryview(event.checkpoint.sources[0].end_offset)) == text
    assert b'"end_offset":' + text + b"," in checkpoint.encode(event.checkpoint)
    value = checkpoint.offset_value(event.checkpoint.sources[0].end_offset)
    assert value == msgspec.json.decode(text)


@pytest.mark.parametrize(
    ("text", "code", "message"),
    [
        (b'{"t": {"0": 1,}}', ErrorCode.BAD_JSON, "trailing comma"),
        (b'{"t": {"0": NaN}}', ErrorCode.BAD_JSON, "not valid JSON"),
        (b'{"t": {"0": 01}}', ErrorCode.BAD_JSON, "invalid number"),
        (b'{"t": {"0": 1e400}}', ErrorCode.BAD_JSON, "Number out of range"),
        (b"-1.8E+308", ErrorCode.BAD_JSON, "Number out of range"),
        (b"1" * 5000, ErrorCode.BAD_JSON, "Integer value out of range"),
        (b'{"t\xff": {"0": 1}}', ErrorCode.BAD_JSON, "not valid UTF-8"),
        (b'"\xed\xa0\x80"', ErrorCode.BAD_JSON, "not valid UTF-8"),  # a UTF-8 encoded surrogate
        (b"[" * 70 + b"]" * 70, ErrorCode.BAD_REQUEST, "nested deeper than"),
    ],
    ids=[
        "comma",
        "nan",
        "leading-zero",
        "1e400",
        "-1.8E+308",
        "5000-digits",
        "ff",
        "surrogate",
        "deep",
    ],
)
def test_a_malformed_offset_is_refused_as_a_decode_would_refuse_it(
    text: bytes, code: ErrorCode, message: str
) -> None:
    progress = rate_progress(QID, 1)
    progress["sources"][0]["latestOffset"] = "@"
    line = encode_request("progress", 5, progress=progress).replace(b'"@"', text)
    conn = ServerConnection()
    bad, after = conn.receive_data(line + encode_request("progress", 6, progress=RATE))
    assert isinstance(bad, BadRequest) and bad.code is code
    assert message in bad.message
    assert after == Progress(6, expected_checkpoint(RATE))  # the connection goes on


@pytest.mark.parametrize("offset", [b'"\xff"', b"1e999"])
def test_a_stored_record_or_document_with_an_unreadable_offset_is_corrupt(offset: bytes) -> None:
    record = checkpoint.encode(expected_checkpoint(KAFKA)).replace(
        b'"end_offset":{', b'"end_offset":' + offset + b',"x":{', 1
    )
    with pytest.raises(CorruptRecord, match="not a checkpoint record"):
        checkpoint.decode(record)
    doc = CheckpointDocument.of(expected_checkpoint(KAFKA), Writer("h", 1, "i"))
    body = encode_document(doc).replace(b'"end_offset":{', b'"end_offset":' + offset + b',"x":{', 1)
    with pytest.raises(CorruptRecord, match="not a checkpoint document"):
        decode_document(body)


# --- authentication (the TCP listener) -----------------------------------------------------

TOKEN = "s3cret-token"


def authed(token: str = TOKEN) -> ServerConnection:
    return ServerConnection(admin_refusal=None, auth_token=token, auth_hint="see the file")


@pytest.mark.parametrize(("stream", "expected"), STREAMS)
def test_after_auth_a_connection_reads_requests_as_any_other(
    feed: Feed, stream: bytes, expected: list[Event]
) -> None:
    conn = authed()
    assert not conn.authenticated
    got = feed(conn, encode_request("auth", AUTH_ID, token=TOKEN) + stream)
    assert got == [Authenticated(AUTH_ID), *expected]
    assert conn.authenticated and not conn.closed


@pytest.mark.parametrize(
    ("first", "why"),
    [
        (encode_request("progress", 1, progress=RATE), "another request came before auth"),
        (encode_request("ping", 1), "another request came before auth"),
        (encode_request("retire", 1, name="q"), "another request came before auth"),
        (encode_request("auth", 1, token="guess"), "the token is not this daemon's"),
        (encode_request("auth", 1, token=TOKEN + "x"), "the token is not this daemon's"),
        (encode_request("auth", 1, token=""), "the token is not this daemon's"),
        (encode_request("auth", 1), "a bad line came before auth"),  # no token at all
        (b"not json\n", "a bad line came before auth"),
    ],
)
def test_anything_but_the_token_first_is_refused_and_closes_the_connection(
    feed: Feed, first: bytes, why: str
) -> None:
    conn = authed()
    later = encode_request("auth", 2, token=TOKEN) + encode_request("ping", 3)
    [refusal] = feed(conn, first + later)  # nothing after the refused request is read
    assert isinstance(refusal, BadRequest)
    assert (refusal.code, refusal.fatal) == (ErrorCode.UNAUTHENTICATED, True)
    assert why in refusal.message and "see the file" in refusal.message
    assert conn.closed and not conn.authenticated
    assert conn.receive_data(encode_request("ping", 4)) == []


def test_a_connection_without_a_token_answers_auth_and_needs_none() -> None:
    conn = ServerConnection()
    assert conn.authenticated
    got = conn.receive_data(encode_request("ping", 1) + encode_request("auth", 2, token="x"))
    assert got == [Ping(1), Authenticated(2)]


def test_an_oversized_first_frame_closes_an_unauthenticated_connection_once() -> None:
    conn = ServerConnection(max_frame_bytes=1024, auth_token=TOKEN)
    [refusal] = conn.receive_data(b"x" * 2000)
    assert isinstance(refusal, BadRequest) and refusal.code == ErrorCode.FRAME_TOO_LARGE
    assert refusal.fatal and conn.closed and not conn.authenticated
    # A refused first request followed by an oversized frame in the same read: one refusal.
    conn = ServerConnection(max_frame_bytes=1024, auth_token=TOKEN)
    [refusal] = conn.receive_data(encode_request("ping", 1) + b"x" * 2000)
    assert isinstance(refusal, BadRequest) and refusal.code == ErrorCode.UNAUTHENTICATED


def test_refusing_a_connection_that_never_authenticated_closes_it() -> None:
    conn = authed()
    refusal = conn.refuse_unauthenticated("no auth within 10s")
    assert refusal.code == ErrorCode.UNAUTHENTICATED and refusal.fatal
    assert "no auth within 10s" in refusal.message and conn.closed


def test_unauthenticated_closes_the_connection_for_clients_too() -> None:
    assert ErrorCode.UNAUTHENTICATED in CLOSING_CODES
    assert ErrorCode.UNAUTHENTICATED not in RETRIABLE_CODES


# --- the endpoint file ---------------------------------------------------------------------


@given(
    host=st.sampled_from(["127.0.0.1", "::1", "127.0.0.2"]),
    port=st.integers(1, 65535),
    token=st.text(min_size=1, max_size=80),
    pid=st.integers(0, 2**22),
)
def test_an_endpoint_file_reads_back_what_was_written(
    host: str, port: int, token: str, pid: int
) -> None:
    written = endpoint.Endpoint(host, port, token, pid)
    data = endpoint.encode(written)
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert endpoint.decode(data) == written


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"[]",
        b'{"version":2,"host":"127.0.0.1","port":1,"token":"t"}',
        b'{"version":1,"host":"127.0.0.1","port":0,"token":"t"}',
        b'{"version":1,"host":"127.0.0.1","port":true,"token":"t"}',
        b'{"version":1,"host":"127.0.0.1","port":1,"token":""}',
        b'{"version":1,"port":1,"token":"t"}',
        b"{" + b" " * 5000 + b"}",
    ],
)
def test_anything_else_is_not_an_endpoint_file(data: bytes) -> None:
    with pytest.raises(endpoint.EndpointError):
        endpoint.decode(data)


@pytest.mark.parametrize(
    ("socket_mode", "file_mode"),
    [(0o600, 0o600), (0o660, 0o640), (0o666, 0o644), (0o620, 0o640), (0o640, 0o600), (0, 0o600)],
)
def test_the_endpoint_file_is_readable_by_those_who_may_connect(
    socket_mode: int, file_mode: int
) -> None:
    assert endpoint.mode_for(socket_mode) == file_mode


def test_tokens_are_new_each_time_and_long() -> None:
    tokens = {endpoint.new_token() for _ in range(100)}
    assert len(tokens) == 100
    assert all(len(t) >= 43 for t in tokens)
    assert endpoint.path_for("/run/x/sidecar.sock") == "/run/x/sidecar.sock.tcp"
