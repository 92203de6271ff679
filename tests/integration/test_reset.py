"""Reset and retire (issue #13 item 3), against real redis-server and Azurite: through the
daemon (in this event loop) as the lease owner, and with no daemon through the CLI under a
lease of its own; refused where admin ops are off, on TCP, for a running query, and while
another owner holds the lease. What each test asserts is what is stored: the blob's bytes,
the Redis record, the lease state, the metric, the exit code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from azure.storage.blob.aio import BlobLeaseClient, BlobServiceClient

from sidecar.buffer.keys import Keys
from sidecar.config import Config
from sidecar.model import checkpoint as ckpt
from sidecar.model.document import (
    CheckpointDocument,
    HistoryEntry,
    Writer,
    decode_document,
    encode_document,
    reset_document,
)
from sidecar.ops import admin_tool
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore
from sidecar.wire.protocol import BadRequest, Reply, Reset, parse_request
from tests.helpers import (
    ConfigFactory,
    acli,
    blob_reader,
    checkpoint_of,
    eventually,
    running_daemon,
    sample,
    wait_blob_batch,
)
from tests.services import Azurite
from tests.sparkshapes import kafka_progress

QID = "7b1e2c3d-4f5a-4b6c-8d7e-9f0a1b2c3d4e"
OTHER = "7b1e2c3d-4f5a-4b6c-8d7e-9f0a1b2c3d4f"
NAME = "orders-to-delta"
BATCH = "checkpoint_sidecar_checkpoint_batch_id"
ADMIN = "checkpoint_sidecar_admin_ops_total"


def end_of(batch: int, qid: str = QID) -> Any:
    """The Kafka end offset ``kafka_progress`` reports for ``batch``."""
    return kafka_progress(qid, batch)["sources"][0]["endOffset"]


async def send(c: SidecarClient, qid: str, *batches: int, name: str = NAME) -> list[bool | None]:
    replies = [await c.progress(kafka_progress(qid, b, name=name)) for b in batches]
    assert all(r.ok for r in replies), replies
    return [r.applied for r in replies]


async def flushed(daemon: Any, c: SidecarClient, qid: str, batches: range, name: str) -> None:
    """Each batch stored and flushed in its own write (count threshold 1)."""
    for b in batches:
        assert await send(c, qid, b, name=name) == [True]
        await eventually(lambda b=b: sample(daemon, BATCH, query=name) == b)  # type: ignore[misc]


async def record(config: Config, qid: str) -> dict[Any, Any]:
    r = aioredis.Redis.from_url(config.redis_url)
    try:
        return await r.hgetall(Keys(config.namespace).query(qid))
    finally:
        await r.aclose()


async def redis_state(config: Config, qid: str) -> tuple[bool, bool, bool, bool]:
    """Whether Redis has the query's hash, its queries-set entry, a name pointing at it, and a
    pending entry."""
    keys = Keys(config.namespace)
    r = aioredis.Redis.from_url(config.redis_url)
    try:
        names = await r.hgetall(keys.names)
        return (
            bool(await r.exists(keys.query(qid))),
            bool(await r.sismember(keys.queries, qid)),
            qid.encode() in names.values(),
            await r.zscore(keys.pending, qid) is not None,
        )
    finally:
        await r.aclose()


async def admin(config: Config, op: str, *, tcp: bool = False, **fields: Any) -> Reply:
    async with await SidecarClient.connect(config.socket_path, tcp=tcp) as c:
        return await c.request(op, **fields)


# --- through the daemon ---------------------------------------------------------------------


async def test_reset_to_a_retained_batch_then_the_floor_holds(make_config: ConfigFactory) -> None:
    config = make_config(admin_ops="true", count_threshold=1, history_size=5)
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            await flushed(daemon, c, QID, range(10, 17), NAME)
            # The query was just heard from: refused, nothing changed.
            running = await admin(config, "reset", name=NAME, to_batch=13, reason="bad deploy")
            assert running.error is not None and running.error.code == "conflict"
            assert "may still be running" in running.error.message
            assert "SIDECAR_ADMIN_QUIET_S=60" in running.error.message
            assert (await store.read(QID)).batch_id == 16  # type: ignore[union-attr]
            absent = await admin(config, "reset", name=NAME, to_batch=3, reason="x", force=True)
            assert absent.error is not None and absent.error.code == "not_found"
            assert "batches 16, 15, 14, 13, 12, 11" in absent.error.message

            reply = await admin(
                config, "reset", name=NAME, to_batch=13, reason="bad deploy", force=True, by="t"
            )
            assert reply.ok, reply.error
            assert reply.result is not None
            assert (reply.result["batch_id"], reply.result["reset_from"]) == (13, 16)
            assert reply.result["via"] == "daemon" and reply.result["query_id"] == QID
            doc = await store.read(QID)
            assert doc is not None
            assert (doc.batch_id, doc.reset_from, doc.reset_reason) == (13, 16, "bad deploy")
            assert doc.reset_at == doc.written_at
            assert [ckpt.offset_value(s.end_offset) for s in doc.sources] == [end_of(13)]
            assert [h.batch_id for h in doc.history] == [12, 11]  # 15, 14 are not older
            stored = await record(config, QID)
            assert stored[b"batch_id"] == stored[b"flushed_batch_id"] == b"13"
            assert stored[b"pending"] == b"0"
            source = ckpt.decode(stored[b"checkpoint"]).sources[0]
            assert ckpt.offset_value(source.end_offset) == end_of(13)
            assert sample(daemon, ADMIN, op="reset", result="ok") == 1
            assert sample(daemon, ADMIN, op="reset", result="refused") == 2
            assert sample(daemon, BATCH, query=NAME) == 13

            # The floor is the reset batch: not newer is stale, newer is stored and flushed.
            assert await send(c, QID, 12, 13, 14) == [False, False, True]
            after = await wait_blob_batch(store, QID, 14)
            got = (await c.get(QID)).checkpoint
        assert got is not None and got["batch_id"] == 14
        assert (after.batch_id, after.reset_from, after.reset_reason) == (14, 16, "bad deploy")
        assert [h.batch_id for h in after.history] == [13, 12, 11]
        assert [ckpt.offset_value(o) for o in after.history[0].end_offsets] == [end_of(13)]


async def test_a_former_owners_floor_follows_a_rewind_made_through_the_new_owner(
    make_config: ConfigFactory, azurite: Azurite, short_tmp: Path
) -> None:
    # The first daemon flushed the query to batch 9 (its floor), then lost its lease; the
    # second took the blob over for a reset to batch 5. Batches above 5 must be stored again
    # through the first one too: its floor alone refuses them, so it reads the blob again.
    first_config = make_config(count_threshold=1, socket_path=str(short_tmp / "first.sock"))
    second_config = make_config(admin_ops="true", count_threshold=1, history_size=10)
    async with running_daemon(first_config) as first, blob_reader(first_config) as store:
        async with await SidecarClient.connect(first_config.socket_path) as c:
            await flushed(first, c, QID, range(10), NAME)
        assert await first.flush.read_floor(QID) == 9  # known: no read
        service = BlobServiceClient.from_connection_string(azurite.connection_string)
        async with service:
            blob = service.get_blob_client(first_config.container, store.blob_name(QID))
            await BlobLeaseClient(blob).break_lease(lease_break_period=0)
        async with running_daemon(second_config):
            reply = await admin(
                second_config, "reset", name=NAME, to_batch=5, reason="r", force=True
            )
            assert reply.ok, reply.error
            async with await SidecarClient.connect(first_config.socket_path) as c:
                assert await send(c, QID, 6) == [True]  # its floor (9) was read again
                assert await send(c, QID, 6, 5) == [False, False]  # stored once; 5 the floor
            doc = await wait_blob_batch(store, QID, 6)  # flushed by the lease owner
    assert (doc.batch_id, doc.reset_from) == (6, 9)


async def test_reset_to_explicit_offsets_through_the_daemon(make_config: ConfigFactory) -> None:
    config = make_config(admin_ops="true", count_threshold=1, admin_quiet_s="0")
    explicit = {"events": {"0": 4200, "1": 4100, "2": 4000}}
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            await flushed(daemon, c, QID, range(5), NAME)
        two = await admin(
            config,
            "reset",
            query_id=QID,
            sources=[{"end_offset": 1}, {"end_offset": 2}],
            reason="r",
        )
        assert two.error is not None and two.error.code == "bad_request"
        assert "2 source offset(s) given, but query orders-to-delta has 1" in two.error.message
        ok = await admin(
            config, "reset", query_id=QID, sources=[{"end_offset": explicit}], reason="replay"
        )
        assert ok.ok, ok.error
        doc = await store.read(QID)
        assert doc is not None
        # Recorded as the batch the blob held (4), the description kept from it.
        assert (doc.batch_id, doc.reset_from, doc.reset_reason) == (4, 4, "replay")
        assert ckpt.offset_value(doc.sources[0].end_offset) == explicit
        assert doc.sources[0].description == "KafkaV2[Subscribe[events]]"
        assert [h.batch_id for h in doc.history] == [3, 2, 1, 0]
        got = await admin(config, "get", query_id=QID)
        assert got.checkpoint is not None
        assert got.checkpoint["sources"][0]["end_offset"] == explicit


async def test_admin_ops_are_refused_without_the_setting_and_on_tcp(
    make_config: ConfigFactory,
) -> None:
    off = make_config()
    async with running_daemon(off) as daemon:
        reply = await admin(off, "retire", name=NAME)
        assert reply.error is not None and reply.error.code == "forbidden"
        assert "SIDECAR_ADMIN_OPS=true" in reply.error.message
        assert sample(daemon, ADMIN, op="retire", result="refused") == 1
        refused = await acli(off, "reset", NAME, "--to-batch", "1", "--reason", "try")
    assert refused.returncode == 2
    assert "reset: reset and retire are admin ops, off on this daemon" in refused.stderr

    on = make_config(admin_ops="true")
    async with running_daemon(on) as daemon:
        assert daemon.server.tcp_port is not None
        tcp = await admin(on, "retire", name=NAME, tcp=True)
        assert tcp.error is not None and tcp.error.code == "forbidden"
        assert "SIDECAR_ADMIN_OPS_TCP=true" in tcp.error.message
        unix = await admin(on, "retire", name=NAME)  # passes the gate: no such query
        assert unix.error is not None and unix.error.code == "not_found"

    both = make_config(admin_ops="true", admin_ops_tcp="true")
    async with running_daemon(both):
        tcp = await admin(both, "retire", name=NAME, tcp=True)
        assert tcp.error is not None and tcp.error.code == "not_found"


async def test_retire_through_the_daemon_keeps_or_archives_the_blob(
    make_config: ConfigFactory,
) -> None:
    config = make_config(admin_ops="true", count_threshold=1, admin_quiet_s="0")
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            await flushed(daemon, c, QID, range(3), NAME)
            await flushed(daemon, c, OTHER, range(2), "payments")
        assert await redis_state(config, QID) == (True, True, True, False)
        body = await blob_body(store, QID)

        kept = await admin(config, "retire", name=NAME, reason="decommissioned")
        assert kept.ok, kept.error
        assert kept.result is not None and "archived_to" not in kept.result
        assert await redis_state(config, QID) == (False, False, False, False)
        assert await blob_body(store, QID) == body  # kept as it was
        assert QID not in daemon.retirement and daemon.flush.leases.state(QID) is None
        assert await store.lease_state(QID) == "available"  # released
        assert sample(daemon, BATCH, query=NAME) != sample(daemon, BATCH, query=NAME)  # NaN: gone

        other = await blob_body(store, OTHER)
        moved = await admin(config, "retire", query_id=OTHER, archive=True)
        assert moved.ok, moved.error
        archived = moved.result.get("archived_to") if moved.result else None
        assert archived and archived.startswith(f"{config.namespace}/archive/{OTHER}.")
        assert await redis_state(config, OTHER) == (False, False, False, False)
        assert await store.read(OTHER) is None  # gone from its place
        assert await blob_body(store, archived, raw_name=True) == other
        assert OTHER not in await store.query_ids()  # an archived blob is no query
        assert sample(daemon, ADMIN, op="retire", result="ok") == 2


async def blob_body(store: BlobStore, name: str, *, raw_name: bool = False) -> bytes:
    """A blob's bytes as stored (a query's, or any blob by name)."""
    blob = store.account.container_client.get_blob_client(
        name if raw_name else store.blob_name(name)
    )
    stream = await blob.download_blob()
    return await stream.readall()


# --- with no daemon: the CLI under a lease of its own -----------------------------------------


async def test_with_no_daemon_the_cli_resets_and_retires_under_its_own_lease(
    make_config: ConfigFactory,
) -> None:
    config = make_config(count_threshold=1, history_size=5)
    async with (
        running_daemon(config) as daemon,
        await SidecarClient.connect(config.socket_path) as c,
    ):
        await flushed(daemon, c, QID, range(6), NAME)
    # The daemon stopped (its socket is gone), but Redis applied an update just now.
    recent = await acli(config, "reset", NAME, "--to-batch", "3", "--reason", "replay")
    assert recent.returncode == 1
    assert "may still be running: Redis applied an update" in recent.stderr

    done = await acli(config, "reset", NAME, "--to-batch", "3", "--reason", "replay", "--force")
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        f"reset {NAME} ({QID}) from batch 5 to batch 3 under the tool's own lease: "
        f"{config.namespace}/{QID}.json written, Redis set; later batches must exceed 3; "
        # a Kafka source, and no Kafka settings here: said (docs/kafka.md)
        "Kafka groups untouched (SIDECAR_KAFKA_BOOTSTRAP_SERVERS not set here; no daemon sets "
        "them later)\n"
    )
    assert "WARNING sidecar.ops.admin_steps: admin reset (forced) by " in done.stderr
    async with blob_reader(config) as store:
        doc = await store.read(QID)
        assert doc is not None
        assert (doc.batch_id, doc.reset_from, doc.reset_reason) == (3, 5, "replay")
        assert await store.lease_state(QID) == "available"  # taken and released
        stored = await record(config, QID)
        assert stored[b"batch_id"] == stored[b"flushed_batch_id"] == b"3"
        shown = await acli(config, "show", NAME)
        assert f"reset       from batch 5 at {doc.reset_at}: replay\n" in shown.stdout

        offsets = json.dumps([end_of(7)])
        explicit = await acli(
            config, "reset", QID, "--offsets", offsets, "--batch-id", "7", "--force"
        )
        assert explicit.returncode == 0, explicit.stderr
        doc = await store.read(QID)
        assert doc is not None and (doc.batch_id, doc.reset_from) == (7, 3)
        assert ckpt.offset_value(doc.sources[0].end_offset) == end_of(7)
        # Offsets given as values (json.dumps spaces them) are stored as compact JSON, the
        # same bytes in Redis and the blob as a reset wrote before offsets were kept as text.
        compact = b'"start_offset":null,"end_offset":' + msgspec.json.encode(end_of(7))
        assert bytes(memoryview(doc.sources[0].end_offset)) == msgspec.json.encode(end_of(7))
        assert compact + b',"latest_offset":null' in (await record(config, QID))[b"checkpoint"]
        assert doc.reset_reason is not None and doc.reset_reason.startswith(
            "checkpoint-sidecar reset by "
        )

        retired = await acli(config, "retire", NAME, "--archive", "--force")
        assert retired.returncode == 0, retired.stderr
        assert retired.stdout.startswith(f"retired {NAME} ({QID}) under the tool's own lease: ")
        assert f"blob moved to {config.namespace}/archive/{QID}." in retired.stdout
        assert await redis_state(config, QID) == (False, False, False, False)
        assert await store.read(QID) is None


async def test_with_no_daemon_the_cli_is_refused_while_another_owner_holds_the_lease(
    make_config: ConfigFactory,
) -> None:
    config = make_config(count_threshold=1)
    async with (
        running_daemon(config) as daemon,
        await SidecarClient.connect(config.socket_path) as c,
    ):
        await flushed(daemon, c, QID, range(3), NAME)
    other = "0b5e0000-0000-4000-8000-00000000aaaa"
    async with blob_reader(config) as store:
        before = await blob_body(store, QID)
        await store.acquire_lease(QID, other, 15)
        try:
            refused = await acli(config, "reset", NAME, "--to-batch", "1", "--force")
            retire = await acli(config, "retire", QID, "--force")
            assert await store.lease_state(QID) == "leased"
        finally:
            await store.release_lease(QID, other)
        assert await blob_body(store, QID) == before
    assert refused.returncode == retire.returncode == 1
    assert "another owner holds the lease on" in refused.stderr
    assert "(lease state leased)" in refused.stderr and "nothing was changed" in refused.stderr
    assert (await record(config, QID))[b"batch_id"] == b"2"  # Redis untouched too
    assert await redis_state(config, QID) == (True, True, True, False)


async def test_apply_reset_writes_a_whole_checkpoint_by_either_path(
    make_config: ConfigFactory,
) -> None:
    """``admin_tool.apply_reset``, as ``import-spark-checkpoint`` calls it: a query the sidecar
    never saw, with no daemon; then, a daemon running, a newer checkpoint through it."""
    config = make_config(admin_ops="true", count_threshold=1)
    first = checkpoint_of(QID, 41)
    done = await admin_tool.apply_reset(config, first, reason="imported from Spark")
    assert (done.via, done.batch_id, done.reset_from) == ("lease", 41, None)
    async with blob_reader(config) as store:
        doc = await store.read(QID)
        assert doc is not None and doc.checkpoint() == first
        assert (doc.reset_from, doc.reset_reason) == (None, "imported from Spark")
        assert await store.lease_state(QID) == "available"
        assert (await record(config, QID))[b"batch_id"] == b"41"
        async with running_daemon(config):
            later = await admin_tool.apply_reset(config, checkpoint_of(QID, 50), reason="again")
            assert (later.via, later.batch_id, later.reset_from) == ("daemon", 50, 41)
            doc = await store.read(QID)
            assert doc is not None and doc.sources == checkpoint_of(QID, 50).sources
            assert [h.batch_id for h in doc.history] == [41]


# --- pure: documents and requests -------------------------------------------------------------


V2_WITHOUT_RESET: dict[str, Any] = {
    "query_id": QID,
    "run_id": "0e1c3f52-9d2b-4f7e-a3c4-5d6e7f809a1b",
    "name": NAME,
    "batch_id": 4,
    "timestamp": "2026-11-21T10:00:04.000Z",
    "sources": [
        {
            "description": "KafkaV2[Subscribe[events]]",
            "start_offset": None,
            "end_offset": {"events": {"0": 500}},
            "latest_offset": None,
        }
    ],
    "schema_version": 2,
    "checkpoint_id": "c0ffee",
    "writer": {"host": "h", "pid": 1, "instance_id": "i"},
    "written_at": "2026-11-21T10:00:04.512+00:00",
    "history": [
        {
            "batch_id": 3,
            "timestamp": "2026-11-21T10:00:03.000Z",
            "written_at": "2026-11-21T10:00:03.512+00:00",
            "end_offsets": [{"events": {"0": 400}}],
        }
    ],
}


class V2Reader(ckpt.Checkpoint, frozen=True):
    """The document as the previous version (history, no reset fields) declared it."""

    schema_version: int
    checkpoint_id: str
    writer: Writer
    written_at: str
    history: tuple[HistoryEntry, ...] = ()


def test_documents_without_reset_fields_decode_and_older_readers_read_reset_ones() -> None:
    v1 = {k: v for k, v in V2_WITHOUT_RESET.items() if k != "history"} | {"schema_version": 1}
    for old in (V2_WITHOUT_RESET, v1):
        doc = decode_document(json.dumps(old).encode())
        assert doc is not None
        assert (doc.reset_from, doc.reset_at, doc.reset_reason) == (None, None, None)
    previous = decode_document(json.dumps(V2_WITHOUT_RESET).encode())
    assert previous is not None
    target = previous.at_batch(3)
    assert target is not None
    assert ckpt.as_builtins(target)["sources"][0] == {
        "description": "KafkaV2[Subscribe[events]]",
        "start_offset": None,
        "end_offset": {"events": {"0": 400}},
        "latest_offset": None,
        "num_input_rows": None,
    }
    assert previous.at_batch(2) is None and previous.at_batch(4) == previous.checkpoint()
    reset = reset_document(previous, target, Writer("h", 2, "j"), reason="why", history_size=20)
    assert (reset.batch_id, reset.reset_from, reset.reset_reason) == (3, 4, "why")
    assert reset.history == ()  # nothing retained is older than batch 3
    body = encode_document(reset)
    old_view = msgspec.json.decode(body, type=V2Reader)  # the previous version reads it
    assert (old_view.batch_id, old_view.sources) == (3, reset.sources)
    # A later normal write carries the record of the reset.
    carried = CheckpointDocument.of(previous.checkpoint(), reset.writer, reset_of=reset)
    assert (carried.reset_from, carried.reset_at) == (4, reset.reset_at)


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        (b'{"op":"reset","id":1,"name":"q","reason":"r"}', 'exactly one of "to_batch"'),
        (b'{"op":"reset","id":1,"name":"q","to_batch":1,"reason":" "}', 'non-empty "reason"'),
        (b'{"op":"retire","id":1}', 'retire needs "query_id" or "name"'),
        (b'{"op":"reset","id":1,"query_id":"../x","to_batch":1,"reason":"r"}', "query_id"),
    ],
)
def test_bad_admin_requests_are_bad_requests(line: bytes, fragment: str) -> None:
    event = parse_request(line)
    assert isinstance(event, BadRequest)
    assert event.code == "bad_request" and fragment in event.message and event.op


def test_admin_requests_decode_and_are_forbidden_where_refused() -> None:
    line = b'{"op":"reset","id":7,"name":"q","sources":[{"end_offset":{"t":{"0":1}}}],"reason":"r"}'
    event = parse_request(line)
    assert isinstance(event, Reset) and event.sources is not None
    assert (event.id, event.name, event.sources[0].end_offset) == (7, "q", {"t": {"0": 1}})
    refused = parse_request(line, "off here")
    assert isinstance(refused, BadRequest)
    assert (refused.code, refused.message, refused.op) == ("forbidden", "off here", "reset")


# --- the stateful-rewind rule (issue #20) ---------------------------------------------------


def stateful_progress(qid: str, batch: int) -> dict[str, Any]:
    """A progress of a query with an aggregation: Spark lists its state operators."""
    operator = {"operatorName": "stateStoreSave", "numRowsTotal": 3, "numRowsUpdated": 1}
    return {**kafka_progress(qid, batch, name=NAME), "stateOperators": [operator]}


async def test_a_stateful_query_is_not_moved_back_by_hand_without_the_state_flag(
    make_config: ConfigFactory,
) -> None:
    config = make_config(admin_ops="true", count_threshold=1, history_size=5, admin_quiet_s=0)
    async with running_daemon(config) as daemon, blob_reader(config) as store:
        async with await SidecarClient.connect(config.socket_path) as c:
            for b in range(5):
                assert (await c.progress(stateful_progress(QID, b))).applied is True
                await eventually(lambda b=b: sample(daemon, BATCH, query=NAME) == b)  # type: ignore[misc]
        doc = await store.read(QID)
        assert doc is not None and doc.stateful is True
        assert ckpt.decode((await record(config, QID))[b"checkpoint"]).stateful is True

        back = await admin(config, "reset", name=NAME, to_batch=2, reason="replay")
        explicit = await admin(
            config, "reset", name=NAME, sources=[{"end_offset": end_of(1)}], reason="replay"
        )
        for refused in (back, explicit):
            assert refused.error is not None and refused.error.code == "conflict"
            assert f"query {NAME} is stateful" in refused.error.message
            assert "its state store must move to the same batch" in refused.error.message
            assert "--state-rewound" in refused.error.message
        assert "moving it to batch 2 (it is at batch 4)" in back.error.message  # type: ignore[union-attr]
        assert "explicit offsets" in explicit.error.message  # type: ignore[union-attr]
        assert (await store.read(QID)).batch_id == 4  # type: ignore[union-attr]
        assert sample(daemon, ADMIN, op="reset", result="refused") == 2

        # starting-offsets of an earlier batch: the same rule, the same way out.
        refused_cli = await acli(config, "starting-offsets", NAME, "--batch", "2")
        assert refused_cli.returncode == 1 and refused_cli.stdout == ""
        assert "is stateful" in refused_cli.stderr and "--state-rewound" in refused_cli.stderr
        latest = await acli(config, "starting-offsets", NAME)  # not a rewind: allowed
        assert latest.returncode == 0 and json.loads(latest.stdout) == end_of(4)
        rewound_cli = await acli(
            config, "starting-offsets", NAME, "--batch", "2", "--state-rewound"
        )
        assert rewound_cli.returncode == 0, rewound_cli.stderr
        assert json.loads(rewound_cli.stdout) == end_of(2)

        # --force is the quiet time's: it does not move a stateful query back.
        forced = await admin(config, "reset", name=NAME, to_batch=2, reason="r", force=True)
        assert forced.error is not None and "is stateful" in forced.error.message
        rewound = await admin(
            config, "reset", name=NAME, to_batch=2, reason="rewound", state_rewound=True
        )
        assert rewound.ok, rewound.error
        after = await store.read(QID)
        assert after is not None and (after.batch_id, after.stateful) == (2, True)
        assert [ckpt.offset_value(s.end_offset) for s in after.sources] == [end_of(2)]
