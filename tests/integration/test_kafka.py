"""Consumer-group commits and lag against a real Kafka-protocol broker (Tansu), Redis, Azurite."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import OffsetAndMetadata
from azure.storage.blob.aio import BlobLeaseClient, BlobServiceClient

from sidecar.config import Config
from sidecar.errors import ConfigError
from sidecar.kafka.committer import TICK_S as COMMIT_TICK_S
from sidecar.model.checkpoint import NULL, Checkpoint, SourceOffsets
from sidecar.model.document import CheckpointDocument, Writer, encode_document
from sidecar.model.offsets import group_name, kafka_offsets
from sidecar.ops import admin_tool
from sidecar.ops.client import SidecarClient
from sidecar.wire.protocol import Reset
from tests.helpers import (
    ConfigFactory,
    blob_reader,
    checkpoint_from,
    eventually,
    metric_value,
    running_daemon,
    sample,
    scrape,
    wait_blob_batch,
)
from tests.kafkatools import (
    GROUP,
    PARTS,
    QID,
    TOPIC,
    TPS,
    committed,
    create_topic_with_records,
    end_offsets_of,
    group_reader,
    progress,
    wait_committed,
)
from tests.services import Azurite, KafkaBroker
from tests.sparkshapes import kafka_progress, rate_progress

COMMITS = "checkpoint_sidecar_kafka_commits_total"
FLUSHES = "checkpoint_sidecar_flushes_total"
PENDING = "checkpoint_sidecar_pending_updates"
QUERY_LAG = "checkpoint_sidecar_kafka_query_lag_records"


@pytest.fixture
def sent_commits(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """OffsetCommit requests as sent to the broker. Tansu 0.6 accepts commit metadata but
    returns it empty on fetch (checked byte for byte), so metadata is checked on the wire."""
    import aiokafka.conn

    sent: list[dict[str, Any]] = []
    original = aiokafka.conn.AIOKafkaConnection.send

    def spy(
        self: aiokafka.conn.AIOKafkaConnection, request: Any, expect_response: bool = True
    ) -> Any:
        if type(request).__name__.startswith("OffsetCommitRequest"):
            sent.append(vars(request))
        return original(self, request, expect_response)

    monkeypatch.setattr(aiokafka.conn.AIOKafkaConnection, "send", spy)
    return sent


@pytest.fixture
def kafka_connections(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(host, port) of every connection any Kafka client in this process opens to a broker."""
    import aiokafka.conn

    made: list[tuple[str, int]] = []
    original = aiokafka.conn.AIOKafkaConnection.__init__

    def spy(self: aiokafka.conn.AIOKafkaConnection, host: str, port: int, **kw: Any) -> None:
        made.append((host, port))
        original(self, host, port, **kw)

    monkeypatch.setattr(aiokafka.conn.AIOKafkaConnection, "__init__", spy)
    return made


async def test_group_commits_follow_the_blob_with_metadata(
    make_config: ConfigFactory,
    broker: KafkaBroker,
    sent_commits: list[dict[str, Any]],
) -> None:
    await create_topic_with_records(broker.bootstrap)
    config = make_config(
        kafka_bootstrap_servers=broker.bootstrap, count_threshold=2, time_threshold_s=3600
    )
    async with running_daemon(config) as daemon, group_reader(broker.bootstrap) as reader:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(3))).applied  # below the count threshold
            # A flush pass has seen batch 3 pending and left it in Redis ...
            await eventually(lambda: sample(daemon, PENDING, query="orders-to-delta") == 1)
            # ... so it must reach no group. A commit that must not happen has no event to
            # wait for: give the committer one tick (it wakes at once when told of a
            # durable checkpoint) to commit it wrongly.
            await anyio.sleep(COMMIT_TICK_S)
            assert sent_commits == [] and await daemon.store.read(QID) is None
            assert (await c.progress(progress(4))).applied  # two pending: flushed
        await wait_committed(reader, end_offsets_of(4))
        doc = await daemon.store.read(QID)
        assert doc is not None and doc.batch_id == 4
        batches = {
            json.loads(meta)["batch_id"]
            for request in sent_commits
            for _, parts in request["_topics"]
            for _, _, meta in parts
        }
        assert batches == {4}  # batch 3 was never alone in the blob, so never committed
        request = sent_commits[-1]
        assert request["_consumer_group"] == GROUP
        assert request["_consumer_group_generation_id"] == -1  # committed without joining
        ((topic, partitions),) = request["_topics"]
        assert topic == TOPIC
        assert sorted((p, o) for p, o, _ in partitions) == list(enumerate(end_offsets_of(4)))
        meta = json.loads(partitions[0][2])
        assert meta == {
            "committer": "checkpoint-sidecar",
            "query_id": QID,
            "run_id": progress(4)["runId"],
            "batch_id": 4,
        }
        _, text = await anyio.to_thread.run_sync(scrape, daemon)
    assert metric_value(text, "checkpoint_sidecar_kafka_commits_total", result="ok") >= 1
    assert metric_value(text, "checkpoint_sidecar_kafka_up") == 1


async def test_a_commit_that_would_go_backwards_is_skipped_and_counted(
    make_config: ConfigFactory, broker: KafkaBroker
) -> None:
    await create_topic_with_records(broker.bootstrap)
    config = make_config(
        kafka_bootstrap_servers=broker.bootstrap, count_threshold=1, kafka_recommit_interval_s=1
    )
    reset = "4b1d0c2e-0000-4000-8000-0000000000ff"  # same name, new id: a query reset
    async with running_daemon(config) as daemon, group_reader(broker.bootstrap) as reader:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(3))).applied
            await wait_committed(reader, end_offsets_of(3))
            assert (await c.progress(progress(0, query_id=reset))).applied
        doc = await wait_blob_batch(daemon.store, reset, 0, timeout_s=10)
        assert doc.batch_id == 0
        # A second refused pass (the idle re-commit) begins only after the first one, and
        # whatever it sent, has finished.
        await eventually(lambda: sample(daemon, COMMITS, result="regressed") >= 2)
        assert await committed(reader) == end_offsets_of(3)  # not lowered to batch 0's
        _, text = await anyio.to_thread.run_sync(scrape, daemon)
    assert metric_value(text, "checkpoint_sidecar_kafka_partitions_skipped_total") >= PARTS


async def test_broker_outage_commits_resume_and_catch_up(
    make_config: ConfigFactory, broker: KafkaBroker
) -> None:
    await create_topic_with_records(broker.bootstrap)
    config = make_config(
        kafka_bootstrap_servers=broker.bootstrap, count_threshold=1, kafka_timeout_s=2
    )
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(1))).applied
            async with group_reader(broker.bootstrap) as reader:
                await wait_committed(reader, end_offsets_of(1))
            await anyio.to_thread.run_sync(broker.stop)
            assert daemon.committer is not None
            passes = daemon.committer.passes
            assert (await c.progress(progress(2))).applied
            await wait_blob_batch(
                daemon.store, QID, 2, timeout_s=10
            )  # flushing is unaffected by the broker
            # Each commit gives up after kafka_timeout_s (2 s). A fresh clone's CI run on a
            # starved machine once counted none in 10 s: the bound is wide, and a miss says
            # whether the commit loop was still passing (slow) or stuck in one pass (a hang).
            try:
                await eventually(lambda: sample(daemon, COMMITS, result="error") >= 1, 30)
            except TimeoutError:
                raise AssertionError(
                    f"no failed commit counted 30 s after the broker stopped; the commit loop "
                    f"made {daemon.committer.passes - passes} pass(es) since"
                ) from None
            await anyio.to_thread.run_sync(broker.start)  # memory-only: a new, empty broker
            await create_topic_with_records(broker.bootstrap)
            async with group_reader(broker.bootstrap) as reader:
                await wait_committed(reader, end_offsets_of(2), timeout_s=45)


async def test_lag_equals_end_offset_minus_committed(
    make_config: ConfigFactory, broker: KafkaBroker
) -> None:
    await create_topic_with_records(broker.bootstrap, per_partition=50)
    config = make_config(kafka_bootstrap_servers=broker.bootstrap, count_threshold=1)
    async with running_daemon(config) as daemon, group_reader(broker.bootstrap) as reader:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(3))).applied
        await wait_committed(reader, end_offsets_of(3))
        expected = [50 - o for o in end_offsets_of(3)]  # 10, 9, 8

        def lag_of(p: int) -> float:
            labels = {"query": "orders-to-delta", "topic": TOPIC, "partition": str(p)}
            return sample(daemon, "checkpoint_sidecar_kafka_lag_records", **labels)

        await eventually(lambda: [lag_of(p) for p in range(PARTS)] == expected)
        _, text = await anyio.to_thread.run_sync(scrape, daemon)
    assert metric_value(
        text, "checkpoint_sidecar_kafka_query_lag_records", query="orders-to-delta"
    ) == sum(expected)


async def test_lag_from_sparks_latest_offset_without_a_broker(make_config: ConfigFactory) -> None:
    config = make_config()
    async with running_daemon(config) as daemon:
        assert daemon.committer is None  # the feature is off without bootstrap servers
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(QID, 4, lag=7))).applied
        await eventually(lambda: sample(daemon, QUERY_LAG, query="orders-to-delta") == 21)
        _, text = await anyio.to_thread.run_sync(scrape, daemon)
    for p in range(3):
        assert (
            metric_value(
                text,
                "checkpoint_sidecar_kafka_lag_records",
                query="orders-to-delta",
                topic="events",
                partition=str(p),
            )
            == 7
        )


async def test_lag_per_topic_when_partition_labels_are_off(make_config: ConfigFactory) -> None:
    config = make_config(kafka_lag_per_partition="false")
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(QID, 4, lag=7))).applied
        await eventually(lambda: sample(daemon, QUERY_LAG, query="orders-to-delta") == 21)
        _, text = await anyio.to_thread.run_sync(scrape, daemon)
    assert (
        metric_value(
            text, "checkpoint_sidecar_kafka_lag_records", query="orders-to-delta", topic="events"
        )
        == 21
    )
    assert 'partition="' not in text


async def test_no_kafka_connection_is_made_when_the_feature_is_off(
    make_config: ConfigFactory, kafka_connections: list[tuple[str, int]]
) -> None:
    # Seen on the wire, not in the daemon's wiring: e.g. a committer built with aiokafka's
    # default bootstrap server (localhost:9092) would connect, and be caught here.
    config = make_config(count_threshold=1)  # no SIDECAR_KAFKA_BOOTSTRAP_SERVERS
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(3))).applied
        await wait_blob_batch(
            daemon.store, QID, 3, timeout_s=10
        )  # durable: a committer would commit it now
    # The daemon has stopped, so its final commit (had it one) is over too.
    assert kafka_connections == []


async def test_idle_groups_are_recommitted(make_config: ConfigFactory, broker: KafkaBroker) -> None:
    await create_topic_with_records(broker.bootstrap)
    config = make_config(
        kafka_bootstrap_servers=broker.bootstrap, count_threshold=1, kafka_recommit_interval_s=1
    )
    async with running_daemon(config) as daemon, group_reader(broker.bootstrap) as reader:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(3))).applied
        await wait_committed(reader, end_offsets_of(3))
        first = sample(daemon, COMMITS, result="ok")
        await eventually(lambda: sample(daemon, COMMITS, result="ok") >= first + 2)  # no update
        assert await committed(reader) == end_offsets_of(3)


# --- deliberate rewinds (resets) lower the group on purpose; nothing else does ---------------

NAME = "orders-to-delta"
RENAMED = "4b1d0c2e-0000-4000-8000-0000000000aa"  # same name, new id


async def flushed_one_by_one(daemon: Any, c: SidecarClient, batches: range) -> None:
    """Each batch flushed in its own write, so the blob retains each (history)."""
    for batch in batches:
        assert (await c.progress(progress(batch))).applied
        await wait_blob_batch(daemon.store, QID, batch)


async def test_a_reset_through_the_daemon_lowers_the_group_on_purpose_and_nothing_else_does(
    make_config: ConfigFactory, broker: KafkaBroker, caplog: pytest.LogCaptureFixture
) -> None:
    await create_topic_with_records(broker.bootstrap)
    config = make_config(
        kafka_bootstrap_servers=broker.bootstrap,
        count_threshold=1,
        admin_ops="true",
        history_size=5,
    )
    async with running_daemon(config) as daemon, group_reader(broker.bootstrap) as reader:
        async with await SidecarClient.connect(config.socket_path) as c:
            await flushed_one_by_one(daemon, c, range(5))
            await wait_committed(reader, end_offsets_of(4))
            reply = await c.request(
                "reset", name=NAME, to_batch=2, reason="bad deploy", force=True, by="t"
            )
            assert reply.ok and reply.result is not None, reply.error
            assert (
                "Kafka group commits and Event Hubs checkpoints follow it"
                in (reply.result["positions"])
            )
            await wait_committed(reader, end_offsets_of(2))  # lowered, on purpose
            assert sample(daemon, COMMITS, result="rewound") == 1
            assert sample(daemon, COMMITS, result="regressed") == 0
            said = [r.getMessage() for r in caplog.records if r.name == "sidecar.kafka.committer"]
            said = [line for line in said if "on purpose" in line]
            assert said == [
                "kafka group=spark-orders-to-delta query=orders-to-delta batch=2: 3 partition(s) "
                "lowered on purpose, a deliberate rewind (reset from batch 4 to batch 2 by t; "
                "reason: bad deploy): events-0: 50 -> 30, events-1: 51 -> 31, events-2: 52 -> 32"
            ]

            # Nothing else lowers it: an older batch of a query under the same name (a new id)
            # is flushed, and refused by the group, as before.
            assert (await c.progress(progress(0, query_id=RENAMED))).applied
            await wait_blob_batch(daemon.store, RENAMED, 0)
            await eventually(lambda: sample(daemon, COMMITS, result="regressed") >= 1)
            assert await committed(reader) == end_offsets_of(2)
            # The query's next batch after the reset moves it forward again.
            assert (await c.progress(progress(3))).applied
            await wait_committed(reader, end_offsets_of(3))
    assert sample(daemon, COMMITS, result="rewound") == 1


async def test_an_idle_recommit_never_moves_what_another_writer_committed(
    make_config: ConfigFactory, broker: KafkaBroker
) -> None:
    await create_topic_with_records(broker.bootstrap)
    config = make_config(
        kafka_bootstrap_servers=broker.bootstrap, count_threshold=1, kafka_recommit_interval_s=1
    )
    async with running_daemon(config) as daemon, group_reader(broker.bootstrap) as reader:
        committer = daemon.committer
        assert committer is not None
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(3))).applied
            await wait_committed(reader, end_offsets_of(3))
            # Another writer moves the group back: the query's new owner after a reset to
            # batch 1, or an operator's `kafka-consumer-groups --reset-offsets`.
            back = dict(zip(TPS, end_offsets_of(1), strict=True))
            await reader.commit({tp: OffsetAndMetadata(o, "") for tp, o in back.items()})
            # Idle re-commits fall due every second: let two passes' worth go by.
            passes = committer.passes
            await eventually(lambda: committer.passes >= passes + 3)
            assert await committed(reader) == end_offsets_of(1)  # left as that writer set it
            assert sample(daemon, COMMITS, result="regressed") == 0
            # This query's next durable batch moves it again.
            assert (await c.progress(progress(4))).applied
            await wait_committed(reader, end_offsets_of(4))


async def test_a_blob_newer_than_the_row_leaves_the_group_to_the_blobs_writer(
    make_config: ConfigFactory, broker: KafkaBroker, azurite: Azurite
) -> None:
    """Another owner (our lease broken) wrote batch 4 and committed the group at 4, then let
    go. Our driver, behind, posts batch 3: the blob holds newer, so nothing is written, and our
    older offsets are not committed either: the group stays at 4 (our committer last committed
    1 itself, so it could not tell). Our next newer batch moves it on."""
    await create_topic_with_records(broker.bootstrap)
    config = make_config(kafka_bootstrap_servers=broker.bootstrap, count_threshold=1)
    other = "0b5e0000-0000-4000-8000-00000000cccc"
    async with (
        running_daemon(config) as daemon,
        blob_reader(config) as store,
        group_reader(broker.bootstrap) as reader,
        await SidecarClient.connect(config.socket_path) as c,
    ):
        assert (await c.progress(progress(1))).applied
        await wait_committed(reader, end_offsets_of(1))
        service = BlobServiceClient.from_connection_string(azurite.connection_string)
        async with service:
            blob = service.get_blob_client(config.container, store.blob_name(QID))
            await BlobLeaseClient(blob).break_lease(lease_break_period=0)
        await store.acquire_lease(QID, other, 15)
        ours = await store.read_stored(QID)
        assert ours.document is not None and ours.version is not None
        theirs = CheckpointDocument.of(checkpoint_from(progress(4)), Writer("other-pod", 1, other))
        await store.write(
            QID, encode_document(theirs), lease_id=other, query_name=None, version=ours.version
        )
        await reader.commit(
            {tp: OffsetAndMetadata(o, "") for tp, o in zip(TPS, end_offsets_of(4), strict=True)}
        )
        await store.release_lease(QID, other)

        assert (await c.progress(progress(3))).applied
        await eventually(lambda: sample(daemon, FLUSHES, result="skipped") >= 1)
        passes = daemon.committer.passes if daemon.committer else 0
        await eventually(lambda: daemon.committer is not None and daemon.committer.passes > passes)
        assert await committed(reader) == end_offsets_of(4)
        assert (await store.read(QID)).batch_id == 4  # type: ignore[union-attr]

        assert (await c.progress(progress(5))).applied
        await wait_committed(reader, end_offsets_of(5))


async def test_without_a_daemon_a_reset_sets_the_group_itself_under_the_tools_lease(
    make_config: ConfigFactory, broker: KafkaBroker, caplog: pytest.LogCaptureFixture
) -> None:
    await create_topic_with_records(broker.bootstrap)
    config = make_config(
        kafka_bootstrap_servers=broker.bootstrap, count_threshold=1, history_size=5
    )
    async with running_daemon(config) as daemon, group_reader(broker.bootstrap) as reader:
        async with await SidecarClient.connect(config.socket_path) as c:
            await flushed_one_by_one(daemon, c, range(4))
        await wait_committed(reader, end_offsets_of(3))
    # The daemon has stopped: the CLI does it under a lease of its own, Kafka included.
    request = Reset(reason="replay", name=NAME, to_batch=1, force=True, by="t")
    result = await admin_tool.reset(config, request)
    assert result.via == "lease"
    assert result.summary().endswith(
        "; Kafka group spark-orders-to-delta set to it (lowered on purpose where lower)"
    )
    async with group_reader(broker.bootstrap) as reader:
        assert await committed(reader) == end_offsets_of(1)
    assert any(
        "events-0: 40 -> 20" in r.getMessage() and "reason: replay" in r.getMessage()
        for r in caplog.records
    )
    # Without the Kafka settings, it says what it did not set.
    bare = make_config(history_size=5)
    again = await admin_tool.reset(bare, Reset(reason="r", name=NAME, to_batch=0, force=True))
    assert again.summary().endswith(
        "; Kafka groups untouched (SIDECAR_KAFKA_BOOTSTRAP_SERVERS not set here; no daemon sets "
        "them later)"
    )
    async with group_reader(broker.bootstrap) as reader:
        assert await committed(reader) == end_offsets_of(1)


# --- pure logic -----------------------------------------------------------------------------


def checkpoint(description: str, end: object, name: str | None = "q") -> Checkpoint:
    return Checkpoint(
        query_id="id-1",
        run_id="r",
        name=name,
        batch_id=1,
        timestamp="t",
        sources=[SourceOffsets(description, NULL, msgspec.Raw(msgspec.json.encode(end)), NULL)],
    )


def test_kafka_sources_are_recognised_by_description_or_opt_in() -> None:
    offsets = {"a": {"0": 5, "1": 6}}
    assert kafka_offsets(checkpoint("KafkaV2[Subscribe[a]]", offsets)) == {("a", 0): 5, ("a", 1): 6}
    other = checkpoint("org.example.MyStream", offsets)
    assert kafka_offsets(other) == {}
    assert kafka_offsets(other, frozenset({"q"})) == {("a", 0): 5, ("a", 1): 6}
    assert kafka_offsets(other, frozenset({"id-1"})) == {("a", 0): 5, ("a", 1): 6}
    assert kafka_offsets(checkpoint("KafkaV2[Subscribe[a]]", 17)) == {}


def test_group_name_template() -> None:
    c = checkpoint("KafkaV2", {}, name=None)
    assert group_name("spark-{query_name}", c, "ns") == "spark-id-1"
    assert group_name("{namespace}.{query_id}", c, "ns") == "ns.id-1"


def test_sasl_without_credentials_is_refused_with_the_configuration() -> None:
    env = {
        "SIDECAR_KAFKA_BOOTSTRAP_SERVERS": "b:9092",
        "SIDECAR_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "SIDECAR_ACCOUNT_URL": "https://a.blob.core.windows.net",
    }
    with pytest.raises(ConfigError, match="SIDECAR_KAFKA_SASL_USERNAME"):
        Config.from_env(env)


def test_rate_source_has_no_kafka_offsets() -> None:
    c = checkpoint_from(rate_progress("x", 3))
    assert kafka_offsets(c, frozenset({"x", "rate-demo"})) == {}


# --- regressions found in review -------------------------------------------------------------


async def test_odd_partition_keys_never_crash_the_daemon(make_config: ConfigFactory) -> None:
    config = make_config()
    weird = kafka_progress(QID, 1)
    weird["sources"][0]["endOffset"] = {"events": {"²": 5}}
    weird["sources"][0]["latestOffset"] = {"events": {"²": 9}}
    normal = kafka_progress("4b1d0c2e-0000-4000-8000-000000000001", 1, name="normal", lag=7)
    async with (
        running_daemon(config) as daemon,
        await SidecarClient.connect(config.socket_path) as c,
    ):
        assert (await c.progress(weird)).applied
        assert (await c.progress(normal)).applied
        # The lag export that first shows the normal query went over the odd one too.
        await eventually(lambda: sample(daemon, QUERY_LAG, query="normal") == 21)
        assert (await c.ping()).ok


async def test_a_restarted_query_with_the_same_name_owns_the_group(
    make_config: ConfigFactory, broker: KafkaBroker
) -> None:
    await create_topic_with_records(broker.bootstrap)
    config = make_config(
        kafka_bootstrap_servers=broker.bootstrap, count_threshold=1, kafka_recommit_interval_s=1
    )
    resumed = "4b1d0c2e-0000-4000-8000-00000000beef"  # new checkpoint dir: new id, same name
    async with running_daemon(config) as daemon, group_reader(broker.bootstrap) as reader:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(2))).applied
            await wait_committed(reader, end_offsets_of(2))
            assert (await c.progress(progress(3, query_id=resumed))).applied
            await wait_committed(reader, end_offsets_of(3))
        first = sample(daemon, COMMITS, result="ok")
        # two idle re-commits: the old query must not win again
        await eventually(lambda: sample(daemon, COMMITS, result="ok") >= first + 2)
        assert await committed(reader) == end_offsets_of(3)


async def test_a_partition_seen_later_is_checked_against_the_broker(
    make_config: ConfigFactory, broker: KafkaBroker
) -> None:
    from aiokafka.structs import OffsetAndMetadata

    await create_topic_with_records(broker.bootstrap)
    async with group_reader(broker.bootstrap) as other_tool:
        await other_tool.commit({TPS[2]: OffsetAndMetadata(45, "")})
    config = make_config(kafka_bootstrap_servers=broker.bootstrap, count_threshold=1)
    two = kafka_progress(QID, 1, topic=TOPIC, partitions=2, per_partition=10)
    three = progress(2)  # partition 2 appears, at 32 < 45
    async with running_daemon(config) as daemon, group_reader(broker.bootstrap) as reader:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(two)).applied
            await wait_committed(reader, [20, 21, 45])
            assert (await c.progress(three)).applied
            await wait_committed(reader, [30, 31, 45])
        assert sample(daemon, "checkpoint_sidecar_kafka_partitions_skipped_total") >= 1


# --- faults: an optional feature never stops the core ---------------------------------------

UP = "checkpoint_sidecar_kafka_up"


def test_kafka_errors_are_translated_into_ours() -> None:
    from aiokafka import errors as ke

    from sidecar.errors import KafkaRefused, KafkaUnavailable
    from sidecar.kafka.client import translate

    for refused in (
        ke.GroupAuthorizationFailedError(),
        ke.TopicAuthorizationFailedError(),
        ke.SaslAuthenticationFailed(),
        ke.InvalidGroupIdError(),
    ):
        error = translate(refused, "commit", "b:9092")
        assert isinstance(error, KafkaRefused) and not error.retriable
        assert "ACLs" in str(error) and type(refused).__name__ in str(error)
    # transient, whether aiokafka flags them retriable or not
    for transient in (
        ke.KafkaConnectionError(),
        ke.KafkaTimeoutError(),
        ke.RequestTimedOutError(),
        ke.NotCoordinatorError(),
        ke.CoordinatorNotAvailableError(),
        ke.RebalanceInProgressError(),
    ):
        error = translate(transient, "commit", "b:9092")
        assert isinstance(error, KafkaUnavailable) and error.retriable


def unexpected_logs(caplog: pytest.LogCaptureFixture, what: str) -> list[Any]:
    return [r for r in caplog.records if f"{what} failed unexpectedly" in r.getMessage()]


async def test_an_unexpected_commit_error_is_contained_logged_once_and_retried(
    make_config: ConfigFactory,
    broker: KafkaBroker,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An injected fault at the client's lowest public layer: aiokafka's own commit raises a
    # type that is no Kafka error (a bug in the client, say) until the test repairs it.
    await create_topic_with_records(broker.bootstrap)
    commit = AIOKafkaConsumer.commit
    broken = False

    async def flaky_commit(self: AIOKafkaConsumer, offsets: Any = None) -> None:
        if broken:
            raise ValueError("injected: a bug in the Kafka client")
        await commit(self, offsets)

    monkeypatch.setattr(AIOKafkaConsumer, "commit", flaky_commit)
    config = make_config(
        kafka_bootstrap_servers=broker.bootstrap, count_threshold=1, time_threshold_s=3600
    )
    async with running_daemon(config) as daemon, group_reader(broker.bootstrap) as reader:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(1))).applied
            await wait_committed(reader, end_offsets_of(1))
            assert sample(daemon, UP) == 1

            broken = True
            assert (await c.progress(progress(2))).applied
            await eventually(lambda: sample(daemon, COMMITS, result="error") >= 2)
            assert sample(daemon, UP) == 0
            assert (await c.progress(progress(3))).applied  # flushing goes on meanwhile
            assert (await wait_blob_batch(daemon.store, QID, 3, timeout_s=10)).batch_id == 3
            assert sample(daemon, UP) == 0
            assert await committed(reader) == end_offsets_of(1)

            broken = False
            await wait_committed(reader, end_offsets_of(3))
            await eventually(lambda: sample(daemon, UP) == 1)
            assert (await c.ping()).ok
        assert not daemon.stopped.is_set()
    logged = unexpected_logs(caplog, f"kafka group={GROUP} query=orders-to-delta commit")
    assert len(logged) >= 2  # every failure logged ...
    tracebacks = [r for r in logged if r.exc_info is not None]
    assert len(tracebacks) == 1  # ... the traceback once
    assert tracebacks[0].exc_info[0] is ValueError


async def test_an_unexpected_end_offsets_error_is_contained_and_lag_comes_back(
    make_config: ConfigFactory,
    broker: KafkaBroker,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await create_topic_with_records(broker.bootstrap, per_partition=50)
    end_offsets = AIOKafkaConsumer.end_offsets
    calls = 0
    broken = True

    async def flaky_end_offsets(self: AIOKafkaConsumer, partitions: Any) -> Any:
        nonlocal calls
        calls += 1
        if broken:
            raise RuntimeError("injected: a bug in the Kafka client")
        return await end_offsets(self, partitions)

    monkeypatch.setattr(AIOKafkaConsumer, "end_offsets", flaky_end_offsets)
    config = make_config(kafka_bootstrap_servers=broker.bootstrap, count_threshold=1)
    async with running_daemon(config) as daemon, group_reader(broker.bootstrap) as reader:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(3))).applied
        await wait_committed(reader, end_offsets_of(3))
        await eventually(lambda: calls >= 2)
        assert sample(daemon, UP) == 1  # commits are not affected
        broken = False
        expected = sum(50 - o for o in end_offsets_of(3))
        await eventually(lambda: sample(daemon, QUERY_LAG, query="orders-to-delta") == expected)
    logged = unexpected_logs(caplog, "kafka end offsets")
    assert len(logged) >= 2 and sum(r.exc_info is not None for r in logged) == 1


async def test_a_refused_commit_waits_the_cap_and_is_logged_as_an_error(
    make_config: ConfigFactory,
    broker: KafkaBroker,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Tansu enforces no ACLs: the refusal is injected where the client raises it.
    from aiokafka.errors import GroupAuthorizationFailedError

    from sidecar.kafka.committer import RETRY_CAP_S

    await create_topic_with_records(broker.bootstrap)
    commit = AIOKafkaConsumer.commit
    refusals = 0

    async def refused_once(self: AIOKafkaConsumer, offsets: Any = None) -> None:
        nonlocal refusals
        if refusals == 0:
            refusals += 1
            raise GroupAuthorizationFailedError()
        await commit(self, offsets)

    monkeypatch.setattr(AIOKafkaConsumer, "commit", refused_once)
    config = make_config(kafka_bootstrap_servers=broker.bootstrap, count_threshold=1)
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(1))).applied
            await eventually(lambda: sample(daemon, COMMITS, result="error") == 1)
            assert sample(daemon, UP) == 0
            assert (await c.progress(progress(2))).applied
            assert (await wait_blob_batch(daemon.store, QID, 2, timeout_s=10)).batch_id == 2
        # a retriable error would have been retried at the next pass of the commit loop
        assert daemon.committer is not None
        passes = daemon.committer.passes
        await eventually(lambda: daemon.committer.passes >= passes + 2)  # type: ignore[union-attr]
        assert sample(daemon, COMMITS, result="ok") == 0 and refusals == 1
    (record,) = [r for r in caplog.records if "commit failed" in r.getMessage()]
    assert record.levelname == "ERROR"
    assert f"retry 1 in {RETRY_CAP_S:.1f}s" in record.getMessage()
    assert "GroupAuthorizationFailedError" in record.getMessage()


@pytest.fixture
def ca_file(short_tmp: Path) -> Path:
    """A self-signed CA certificate (PEM) made for this test."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "checkpoint-sidecar test CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = short_tmp / "ca.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


async def test_the_tls_context_is_built_once_off_the_event_loop(
    make_config: ConfigFactory, ca_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Loading a CA file is C code that blockbuster does not see, so the loads are recorded
    # here: on which thread, with a running event loop or not.
    import asyncio
    import ssl

    from tests.services import free_port

    loads: list[bool] = []  # True: on the event loop
    load = ssl.SSLContext.load_verify_locations

    def spy(
        self: ssl.SSLContext, cafile: Any = None, capath: Any = None, cadata: Any = None
    ) -> None:
        if cafile == str(ca_file):
            try:
                asyncio.get_running_loop()
                loads.append(True)
            except RuntimeError:
                loads.append(False)
        load(self, cafile, capath, cadata)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", spy)
    config = make_config(
        kafka_bootstrap_servers=f"127.0.0.1:{free_port()}",  # nobody there: it need not connect
        kafka_security_protocol="SSL",
        kafka_ssl_cafile=str(ca_file),
        kafka_timeout_s=1,
        count_threshold=1,
    )
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(1))).applied
            # two attempts, each with a new client: the context is shared, not rebuilt
            await eventually(lambda: sample(daemon, COMMITS, result="error") >= 2)
            assert (await wait_blob_batch(daemon.store, QID, 1, timeout_s=10)).batch_id == 1
            assert (await c.ping()).ok
        assert sample(daemon, UP) == 0
    assert loads == [False]


async def test_unreadable_tls_files_leave_the_daemon_running_and_say_which(
    make_config: ConfigFactory, short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.services import free_port

    missing = short_tmp / "no-such-ca.pem"
    config = make_config(
        kafka_bootstrap_servers=f"127.0.0.1:{free_port()}",
        kafka_security_protocol="SSL",
        kafka_ssl_cafile=str(missing),
        count_threshold=1,
    )
    async with running_daemon(config) as daemon:
        # said at start, before any commit was attempted
        (record,) = [r for r in caplog.records if "TLS context cannot be built" in r.getMessage()]
        assert record.levelname == "ERROR" and str(missing) in record.getMessage()
        assert sample(daemon, UP) == 0
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(1))).applied
        assert (
            await wait_blob_batch(daemon.store, QID, 1, timeout_s=10)
        ).batch_id == 1  # the core goes on
        await eventually(lambda: sample(daemon, COMMITS, result="error") == 1)


async def test_a_batch_made_durable_during_a_commit_is_committed_next(
    make_config: ConfigFactory, broker: KafkaBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flush that ends while the group's commit is in flight replaces what the group must
    commit: that commit's success must not mark the group clean (before the fix, the newer
    offsets waited for the recommit interval, and a stop in between left the group behind)."""
    await create_topic_with_records(broker.bootstrap)
    commit = AIOKafkaConsumer.commit
    held, release = anyio.Event(), anyio.Event()

    async def slow_commit(self: AIOKafkaConsumer, offsets: Any = None) -> None:
        if not release.is_set():
            held.set()
            await release.wait()
        await commit(self, offsets)

    monkeypatch.setattr(AIOKafkaConsumer, "commit", slow_commit)
    config = make_config(
        kafka_bootstrap_servers=broker.bootstrap,
        count_threshold=1,
        time_threshold_s=3600,
        kafka_recommit_interval_s=3600,
    )
    async with running_daemon(config) as daemon, group_reader(broker.bootstrap) as reader:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(progress(1))).applied
            with anyio.fail_after(10):
                await held.wait()  # batch 1's commit is in flight
            assert (await c.progress(progress(2))).applied
            await wait_blob_batch(daemon.store, QID, 2, timeout_s=10)
            assert daemon.committer is not None and daemon.committer.behind() != []
            release.set()
            await wait_committed(reader, end_offsets_of(2))
            await eventually(lambda: daemon.committer.behind() == [])  # type: ignore[union-attr]
