"""Event Hubs sources, pure parts and the checkpointer against an in-memory store: recognising
the connector's sources, the ``eventhubs.startingPositions`` JSON, the SDKs' checkpoint layout,
the never-backwards plan, the retry policy, and the lag collector run with the Event Hubs
names. The checkpoints read back by the SDK from Azurite: tests/integration/test_eventhubs.py.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from sidecar.config import Config
from sidecar.errors import StoreError, StoreUnavailable, VersionConflict
from sidecar.eventhubs import checkpointer as checkpointer_module
from sidecar.eventhubs import plan as eh
from sidecar.eventhubs.checkpointer import EventHubsCheckpointer
from sidecar.kafka.lag import EVENTHUBS, KAFKA, LagTracker
from sidecar.model import checkpoint as ckpt
from sidecar.model import positions
from sidecar.model.offsets import (
    ResumeError,
    eventhubs_offsets,
    eventhubs_starting_positions,
    is_eventhubs_offsets,
    is_eventhubs_source,
    kafka_offsets,
    kafka_starting_offsets,
    starting_offsets,
)
from sidecar.telemetry.metrics import Metrics
from tests.helpers import checkpoint_from, eventually
from tests.sparkshapes import EVENTHUBS_SOURCE, eventhubs_progress, kafka_progress

QID = "9d0e7c55-1b2a-4c3d-8e4f-5a6b7c8d9e0f"
NAMESPACE = "MyNs.servicebus.windows.net"
STORED_AS = "myns.servicebus.windows.net"  # the SDKs lowercase the whole blob name


# --- recognising the connector's sources --------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"telemetry": {"0": 42, "1": 0}}, True),
        ({"a": {"0": -1}}, True),  # the connector's "nothing yet"
        ({"a": {"0": -2}}, False),  # Kafka's "earliest" marker is no sequence number
        ({"a": {}}, False),
        ({}, False),
        (42, False),
        ({"a": {"x": 1}}, False),
        ({"a": {"0": True}}, False),
        ({"a": {"0": 2**63}}, False),
    ],
)
def test_is_eventhubs_offsets(value: Any, expected: bool) -> None:
    assert is_eventhubs_offsets(value) is expected


def test_sources_are_told_from_kafka_by_description_not_shape() -> None:
    offsets = {"events": {"0": 42}}  # one shape for both
    assert is_eventhubs_source(EVENTHUBS_SOURCE, offsets)
    assert is_eventhubs_source("org.apache.spark.sql.eventhubs.EventHubsSource", offsets)
    assert not is_eventhubs_source("KafkaV2[Subscribe[events]]", offsets)
    assert not is_eventhubs_source(EVENTHUBS_SOURCE, 42)


def test_eventhubs_offsets_read_only_eventhubs_sources_and_kafka_only_kafka_ones() -> None:
    eh_progress = eventhubs_progress(QID, 2, partitions=2, per_partition=10)
    kafka = kafka_progress(QID, 2, partitions=2, per_partition=10)
    eh_progress["sources"] += kafka["sources"]
    checkpoint = checkpoint_from(eh_progress)
    # the daemon stores the description without the JVM object hash
    assert checkpoint.sources[0].description == "org.apache.spark.sql.eventhubs.EventHubsSource"
    assert eventhubs_offsets(checkpoint) == {("telemetry", 0): 30, ("telemetry", 1): 31}
    assert eventhubs_offsets(checkpoint, "latest_offset") == {
        ("telemetry", 0): 35,
        ("telemetry", 1): 36,
    }
    assert set(kafka_offsets(checkpoint)) == {("events", 0), ("events", 1)}


# --- eventhubs.startingPositions ------------------------------------------------------------


def saved(*sources: dict[str, Any]) -> dict[str, Any]:
    return {"query_id": QID, "name": "telemetry-to-delta", "batch_id": 3, "sources": list(sources)}


def eh_source(end: Any) -> dict[str, Any]:
    return {"description": "org.apache.spark.sql.eventhubs.EventHubsSource", "end_offset": end}


def test_starting_positions_are_the_connectors_json_at_the_saved_end_inclusive() -> None:
    got = eventhubs_starting_positions(saved(eh_source({"eh": {"1": 7, "0": 42, "10": 3}})))
    assert got == (
        '{"{\\"ehName\\":\\"eh\\",\\"partitionId\\":0}":'
        '{"offset":null,"seqNo":42,"enqueuedTime":null,"isInclusive":true},'
        '"{\\"ehName\\":\\"eh\\",\\"partitionId\\":1}":'
        '{"offset":null,"seqNo":7,"enqueuedTime":null,"isInclusive":true},'
        '"{\\"ehName\\":\\"eh\\",\\"partitionId\\":10}":'
        '{"offset":null,"seqNo":3,"enqueuedTime":null,"isInclusive":true}}'
    )
    # each key is the connector's NameAndPartition JSON (json4s: ehName, then partitionId)
    keys = [json.loads(k) for k in json.loads(got)]
    assert keys == [{"ehName": "eh", "partitionId": p} for p in (0, 1, 10)]


@pytest.mark.parametrize(
    ("missing", "position"),
    [
        ("earliest", {"offset": "-1", "seqNo": -1, "enqueuedTime": None, "isInclusive": True}),
        ("latest", {"offset": "@latest", "seqNo": -1, "enqueuedTime": None, "isInclusive": False}),
    ],
)
def test_absent_partitions_start_at_missing(missing: Any, position: dict[str, Any]) -> None:
    got = json.loads(
        eventhubs_starting_positions(
            saved(eh_source({"eh": {"0": 5}})), partitions={"eh": 2}, missing=missing
        )
    )
    assert got['{"ehName":"eh","partitionId":1}'] == position
    assert got['{"ehName":"eh","partitionId":0}']["seqNo"] == 5


def test_absent_partitions_with_missing_error_are_named() -> None:
    with pytest.raises(ResumeError, match="no sequence numbers for eh-1, eh-2;"):
        eventhubs_starting_positions(
            saved(eh_source({"eh": {"0": 5}})), partitions={"eh": 3}, missing="error"
        )


def test_a_partition_with_nothing_read_starts_at_the_start_of_the_stream() -> None:
    got = json.loads(eventhubs_starting_positions(saved(eh_source({"eh": {"0": -1}}))))
    assert got['{"ehName":"eh","partitionId":0}']["offset"] == "-1"


def test_starting_offsets_picks_the_json_the_chosen_source_needs() -> None:
    kafka = {"description": "KafkaV2[Subscribe[events]]", "end_offset": {"events": {"0": 9}}}
    both = saved(eh_source({"eh": {"0": 5}}), kafka)
    assert starting_offsets(both, source=1) == '{"events":{"0":9}}'
    assert json.loads(starting_offsets(both, source=0)) == {
        '{"ehName":"eh","partitionId":0}': {
            "offset": None,
            "seqNo": 5,
            "enqueuedTime": None,
            "isInclusive": True,
        }
    }
    with pytest.raises(ResumeError, match="2 Kafka-shaped sources"):
        starting_offsets(both)
    # alone, the Event Hubs source needs no index
    assert starting_offsets(saved(eh_source({"eh": {"0": 5}}))).startswith('{"{')


def test_kafka_starting_offsets_refuses_an_eventhubs_source() -> None:
    with pytest.raises(ResumeError, match=r"is an Event Hubs source.*startingPositions"):
        kafka_starting_offsets(saved(eh_source({"eh": {"0": 5}})))


def test_eventhubs_starting_positions_refuses_a_kafka_source() -> None:
    kafka = {"description": "KafkaV2[Subscribe[events]]", "end_offset": {"events": {"0": 9}}}
    with pytest.raises(ResumeError, match=r"0 Event Hubs-shaped sources \(none\)"):
        eventhubs_starting_positions(saved(kafka))


# --- the checkpoints' layout and the plan ----------------------------------------------------


def test_blob_names_are_the_sdks_lowercased() -> None:
    name = eh.blob_name(NAMESPACE, "Telemetry", "spark-Orders", 3)
    assert name == f"{STORED_AS}/telemetry/spark-orders/checkpoint/3"
    assert name.startswith(eh.prefix(NAMESPACE, "Telemetry", "spark-Orders"))


def test_a_checkpoint_is_the_last_event_processed_with_an_empty_offset() -> None:
    assert eh.metadata(41) == {"sequencenumber": "41", "offset": ""}
    # Spark's end offset is the next to read; nothing processed yet: no checkpoint
    assert eh.processed({("eh", 0): 42, ("eh", 1): 0, ("eh", 2): -1, ("eh", 3): 1}) == {
        ("eh", 0): 41,
        ("eh", 3): 0,
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [("41", 41), (" 7 ", 7), ("-1", -1), ("", None), (None, None), ("4x", None), ("1e3", None)],
)
def test_parse_stored(text: str | None, expected: int | None) -> None:
    assert eh.parse_stored(text) == expected


def test_the_plan_never_moves_a_partition_backwards_and_skips_equal_ones() -> None:
    wanted = {("eh", 0): 10, ("eh", 1): 5, ("eh", 2): 7, ("eh", 3): 1}
    stored = {("eh", 0): 9, ("eh", 1): 8, ("eh", 2): 7}
    got = eh.plan(wanted, stored)
    assert got.write == {("eh", 0): 10, ("eh", 3): 1}  # higher, and unknown
    assert [str(m) for m in got.lowered] == ["eh-1: 8 -> 5"]
    assert got.rewound == got.held == [] and got.kept == []


def test_a_rewind_lowers_on_purpose_and_names_what_it_cannot() -> None:
    wanted = {("eh", 0): 10, ("eh", 1): 5, ("eh", 2): 7}
    stored = {("eh", 0): 9, ("eh", 1): 8, ("eh", 2): 7, ("eh", 3): 41, ("eh", 4): 3}
    got = eh.plan(wanted, stored, rewind=True, held={("eh", 1)}, unset={("eh", 3), ("eh", 5)})
    # lower ones written too; an equal one is there already; a rewind ignores held
    assert got.write == {("eh", 0): 10, ("eh", 1): 5}
    assert [str(m) for m in got.rewound] == ["eh-1: 8 -> 5"] and got.lowered == []
    # partition 3 processed nothing at the target: no checkpoint can say so; 5 has none stored
    assert got.kept == ["eh-3: 41"]
    # partition 4 is not in the checkpoint at all: a rewind leaves it (and does not name it)


def test_a_partition_another_writer_lowered_is_not_raised_by_the_same_positions() -> None:
    wanted = {("eh", 0): 10, ("eh", 1): 10}
    stored = {("eh", 0): 4, ("eh", 1): 4}  # both lowered by another daemon's reset
    got = eh.plan(wanted, stored, held={("eh", 1)}, unset={("eh", 3)})
    assert got.write == {("eh", 0): 10}
    assert [str(m) for m in got.held] == ["eh-1: 4 -> 10"]
    assert got.kept == []  # only a rewind names them


def test_moved_since_tells_another_writers_moves_from_ours() -> None:
    known = {("t", 0): 10, ("t", 1): 10, ("t", 2): 10}
    now = {("t", 0): 7, ("t", 1): 12, ("t", 2): 10, ("t", 3): 1}
    assert positions.moved_since(known, now) == {("t", 0)}
    assert positions.moved_since(known, now, raised_too=True) == {("t", 0), ("t", 1)}


def test_decide_rewrites_equal_positions_only_when_asked() -> None:
    wanted, stored = {("t", 0): 5, ("t", 1): 6}, {("t", 0): 5, ("t", 1): 9}
    assert positions.decide(wanted, stored).write == {}
    kafka = positions.decide(wanted, stored, rewrite_equal=True)
    assert kafka.write == {("t", 0): 5} and [str(m) for m in kafka.regressed] == ["t-1: 9 -> 6"]
    rewound = positions.decide(wanted, stored, rewind=True, rewrite_equal=True)
    assert rewound.write == wanted and [str(m) for m in rewound.rewound] == ["t-1: 9 -> 6"]
    many = [positions.Move(("t", p), 9, 1) for p in range(7)]
    assert positions.described(many, 2) == "t-0: 9 -> 1, t-1: 9 -> 1 (and 5 more)"


# --- the checkpointer, against an in-memory store ----------------------------------------


class MemoryBlobs:
    """The store's two Event Hubs calls over a dict; ``fail`` raises that error once per call
    until cleared; while ``gate`` is set, each write waits for it to be opened (a write in
    flight), after reading the version it is to match."""

    def __init__(self) -> None:
        self.blobs: dict[tuple[str, str], dict[str, str]] = {}
        self.versions: dict[tuple[str, str], str] = {}
        self.fail: Exception | None = None
        self.writes = 0
        self.changes = 0
        self.gate: anyio.Event | None = None
        self.waiting = 0

    async def eventhubs_checkpoints(
        self, container: str, prefix: str
    ) -> dict[str, tuple[str | None, str]]:
        if self.fail is not None:
            raise self.fail
        return {
            name.rsplit("/", 1)[-1]: (meta.get("sequencenumber"), self.versions[(c, name)])
            for (c, name), meta in self.blobs.items()
            if c == container and name.startswith(prefix)
        }

    async def write_eventhubs_checkpoint(
        self, container: str, name: str, metadata: dict[str, str], version: str | None
    ) -> str:
        if self.fail is not None:
            raise self.fail
        if self.gate is not None:
            self.waiting += 1
            await self.gate.wait()
        if self.versions.get((container, name)) != version:
            raise VersionConflict(f"memory: {name} changed since it was listed")
        self.writes += 1
        return self.put(container, name, metadata)

    def put(self, container: str, name: str, metadata: dict[str, str]) -> str:
        """Set a blob's metadata as any writer would (a new version)."""
        self.blobs[(container, name)] = dict(metadata)
        self.changes += 1
        version = self.versions[(container, name)] = f'"0x{self.changes:X}"'
        return version

    def numbers(self) -> dict[str, int]:
        return {name: int(meta["sequencenumber"]) for (_, name), meta in self.blobs.items()}


def config(**env: str) -> Config:
    return Config.from_env(
        {
            "SIDECAR_EVENTHUBS_NAMESPACE": NAMESPACE,
            "SIDECAR_CONTAINER": "checkpoints",
            "SIDECAR_NAMESPACE": "app",
            **env,
        }
    )


def durable(query_id: str, batch: int, **kwargs: Any) -> ckpt.Checkpoint:
    return checkpoint_from(eventhubs_progress(query_id, batch, **kwargs))


def value(metrics: Metrics, name: str, **labels: str) -> float:
    got = metrics.registry.get_sample_value(name, labels)
    return -1.0 if got is None else got


async def test_checkpointer_writes_durable_positions_and_never_lowers_them() -> None:
    blobs, metrics = MemoryBlobs(), Metrics()
    writer = EventHubsCheckpointer(config(), metrics, blobs)
    group = f"{STORED_AS}/telemetry/spark-telemetry-to-delta/checkpoint"
    # A checkpoint left by an earlier run (or another writer): partition 1 is ahead.
    blobs.put("checkpoints", f"{group}/1", {"sequencenumber": "500", "offset": ""})
    writer.durable(durable(QID, 2, partitions=3, per_partition=10))  # ends 30, 31, 32
    await writer.final_commit()
    assert blobs.numbers() == {f"{group}/0": 29, f"{group}/1": 500, f"{group}/2": 31}
    assert all(meta["offset"] == "" for meta in blobs.blobs.values())
    assert value(metrics, "checkpoint_sidecar_eventhubs_checkpoints_total", result="ok") == 1
    assert value(metrics, "checkpoint_sidecar_eventhubs_checkpoints_total", result="regressed") == 1
    assert value(metrics, "checkpoint_sidecar_eventhubs_partitions_skipped_total") == 1
    assert value(metrics, "checkpoint_sidecar_eventhubs_up") == 1
    assert writer.behind() == []

    # The same batch told again: nothing newer, no pass; a newer batch writes what moved.
    writes = blobs.writes
    writer.durable(durable(QID, 2, partitions=3, per_partition=10))
    await writer.final_commit()
    assert blobs.writes == writes
    writer.durable(durable(QID, 3, partitions=3, per_partition=10))  # ends 40, 41, 42
    await writer.final_commit()
    assert blobs.numbers() == {f"{group}/0": 39, f"{group}/1": 500, f"{group}/2": 41}

    # A query reset under the same name (a new id, lower numbers) shares the group: refused.
    reset = "0a0b0c0d-0000-4000-8000-000000000001"
    writer.durable(durable(reset, 0, partitions=3, per_partition=10))  # ends 10, 11, 12
    await writer.final_commit()
    assert blobs.numbers() == {f"{group}/0": 39, f"{group}/1": 500, f"{group}/2": 41}
    # partition 1 (behind the stored 500) is counted at each of the 2 passes, then 3 more
    assert value(metrics, "checkpoint_sidecar_eventhubs_partitions_skipped_total") == 5


REWOUND_BY = "reset from batch 3 to batch 1 by t; reason: bad deploy"
CHECKPOINTS = "checkpoint_sidecar_eventhubs_checkpoints_total"


async def test_a_rewind_lowers_the_checkpoints_on_purpose_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    blobs, metrics = MemoryBlobs(), Metrics()
    writer = EventHubsCheckpointer(config(), metrics, blobs)
    group = f"{STORED_AS}/telemetry/spark-telemetry-to-delta/checkpoint"
    writer.durable(durable(QID, 3, partitions=2, per_partition=10))  # ends 40, 41
    await writer.final_commit()
    assert blobs.numbers() == {f"{group}/0": 39, f"{group}/1": 40}

    writer.durable(durable(QID, 1, partitions=2, per_partition=10), rewind=REWOUND_BY)
    await writer.final_commit()
    assert blobs.numbers() == {f"{group}/0": 19, f"{group}/1": 20}  # lowered
    assert value(metrics, CHECKPOINTS, result="rewound") == 1
    assert value(metrics, CHECKPOINTS, result="regressed") == 0
    (line,) = [r.getMessage() for r in caplog.records if "on purpose" in r.getMessage()]
    assert line == (
        "eventhubs group=spark-telemetry-to-delta query=telemetry-to-delta batch=1: "
        "2 partition(s) lowered on purpose, a deliberate rewind (reset from batch 3 to batch 1 "
        "by t; reason: bad deploy): telemetry-0: 39 -> 19, telemetry-1: 40 -> 20"
    )
    assert writer.behind() == []

    # Afterwards, never backwards again but on purpose: an older batch is refused.
    writer.durable(durable(QID, 0, partitions=2, per_partition=10))
    await writer.final_commit()
    assert blobs.numbers() == {f"{group}/0": 19, f"{group}/1": 20}
    assert value(metrics, CHECKPOINTS, result="regressed") == 1
    assert value(metrics, CHECKPOINTS, result="rewound") == 1


async def test_a_rewind_to_nothing_processed_keeps_that_checkpoint_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    blobs, metrics = MemoryBlobs(), Metrics()
    writer = EventHubsCheckpointer(config(), metrics, blobs)
    group = f"{STORED_AS}/telemetry/spark-telemetry-to-delta/checkpoint"
    writer.durable(durable(QID, 3, partitions=1, per_partition=10))
    await writer.final_commit()
    at_zero = durable(QID, 0, partitions=1, per_partition=0)  # end 0: nothing processed
    writer.durable(at_zero, rewind=REWOUND_BY)
    await writer.final_commit()
    assert blobs.numbers() == {f"{group}/0": 39}
    assert value(metrics, CHECKPOINTS, result="rewound") == 0  # nothing was lowered
    (line,) = [r.getMessage() for r in caplog.records if "on purpose" in r.getMessage()]
    assert "0 partition(s) lowered on purpose" in line
    assert "1 partition(s) not lowered, nothing processed at the target" in line
    assert line.endswith("telemetry-0: 39")


async def test_a_rewind_is_not_undone_by_a_write_in_flight_before_it() -> None:
    blobs, metrics = MemoryBlobs(), Metrics()
    writer = EventHubsCheckpointer(config(), metrics, blobs)
    group = f"{STORED_AS}/telemetry/spark-telemetry-to-delta/checkpoint"
    writer.durable(durable(QID, 1, partitions=1, per_partition=10))
    await writer.final_commit()
    blobs.gate = anyio.Event()
    async with anyio.create_task_group() as tg:
        await tg.start(writer.run)
        writer.durable(durable(QID, 5, partitions=1, per_partition=10))
        await eventually(lambda: blobs.waiting == 1)  # batch 5's write is in flight
        # The reset lands meanwhile (to batch 3), and the query's next batch after it (4).
        writer.durable(durable(QID, 3, partitions=1, per_partition=10), rewind=REWOUND_BY)
        writer.durable(durable(QID, 4, partitions=1, per_partition=10))
        gate, blobs.gate = blobs.gate, None
        gate.set()  # batch 5 lands (its version still matches) ...
        # ... and the rewind, carried by batch 4's positions, lowers it again.
        await eventually(lambda: blobs.numbers() == {f"{group}/0": 49} and not writer.behind())
        assert value(metrics, CHECKPOINTS, result="rewound") == 1
        await writer.stop_loop()
        tg.cancel_scope.cancel()
    assert blobs.numbers() == {f"{group}/0": 49}


async def written_at_batch_3() -> tuple[MemoryBlobs, EventHubsCheckpointer, str]:
    """A checkpointer that wrote batch 3 of two partitions (39, 40); its blobs and group."""
    blobs = MemoryBlobs()
    writer = EventHubsCheckpointer(config(), Metrics(), blobs)
    group = f"{STORED_AS}/telemetry/spark-telemetry-to-delta/checkpoint"
    writer.durable(durable(QID, 3, partitions=2, per_partition=10))
    await writer.final_commit()
    return blobs, writer, group


async def test_positions_another_writer_lowered_are_not_raised_again_by_the_same_batch() -> None:
    blobs, writer, group = await written_at_batch_3()
    # This daemon lost the query; its new owner reset it to batch 1 (lowered both) while a
    # write of this one's batch 5 was failing: retried, it lists again and finds them lower.
    blobs.fail = StoreUnavailable("store down", reason="503 ServerBusy")
    writer.durable(durable(QID, 5, partitions=2, per_partition=10))
    await writer.final_commit()
    for p in (0, 1):
        blobs.put("checkpoints", f"{group}/{p}", {"sequencenumber": "19", "offset": ""})
    blobs.fail = None
    await writer.final_commit()
    assert blobs.numbers() == {f"{group}/0": 19, f"{group}/1": 19}  # not raised back to 59
    assert writer.behind() == []
    # A batch made durable after that (this daemon holds the query again) moves them.
    writer.durable(durable(QID, 6, partitions=2, per_partition=10))
    await writer.final_commit()
    assert blobs.numbers() == {f"{group}/0": 69, f"{group}/1": 70}


async def test_a_batch_told_again_does_not_raise_what_another_writer_lowered_since() -> None:
    # Written at batch 3; a twin then reset the query and lowered both partitions. This
    # daemon, not knowing yet, flushes from memory and tells batch 3 again: nothing newer.
    blobs, writer, group = await written_at_batch_3()
    assert blobs.numbers() == {f"{group}/0": 39, f"{group}/1": 40}
    for p in (0, 1):
        blobs.put("checkpoints", f"{group}/{p}", {"sequencenumber": "9", "offset": ""})
    writes = blobs.writes
    writer.durable(durable(QID, 3, partitions=2, per_partition=10))
    await writer.final_commit()
    assert blobs.numbers() == {f"{group}/0": 9, f"{group}/1": 9} and blobs.writes == writes
    assert writer.behind() == []


async def test_checkpointer_failures_are_counted_backed_off_and_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(checkpointer_module, "TICK_S", 0.01)
    blobs, metrics = MemoryBlobs(), Metrics()
    writer = EventHubsCheckpointer(
        config(SIDECAR_EVENTHUBS_CONTAINER="eh-checkpoints"), metrics, blobs
    )
    blobs.fail = StoreUnavailable("store down", reason="503 ServerBusy")
    async with anyio.create_task_group() as tg:
        await tg.start(writer.run)
        writer.durable(durable(QID, 1, partitions=2, per_partition=10))
        errors = "checkpoint_sidecar_eventhubs_checkpoints_total"
        # retried: after about 0.5 s, then 1 s
        await eventually(lambda: value(metrics, errors, result="error") >= 2, 5)
        assert blobs.blobs == {} and value(metrics, "checkpoint_sidecar_eventhubs_up") == 0
        assert writer.behind() == ["spark-telemetry-to-delta"]
        blobs.fail = None
        # Up once the whole commit has succeeded: its first partition's blob is there before
        # (a check between the two failed under a loaded CI run).
        await eventually(lambda: value(metrics, "checkpoint_sidecar_eventhubs_up") == 1, 5)
        assert {c for c, _ in blobs.blobs} == {"eh-checkpoints"} and len(blobs.blobs) == 2
        await writer.stop_loop()
        tg.cancel_scope.cancel()


async def test_an_error_retrying_will_not_fix_waits_the_cap_at_once() -> None:
    writer = EventHubsCheckpointer(config(), Metrics(), MemoryBlobs())
    missing = StoreError("container 'eh' does not exist; create it")
    unavailable = StoreUnavailable("busy", reason="503 ServerBusy", retry_after_s=3.0)
    writer._failed("refused", "write", missing)
    writer._failed("busy", "write", unavailable)
    assert writer._backoff.failures("refused") == 1
    assert not writer._backoff.ready("refused")
    retry_at = writer._backoff._retry_at
    assert retry_at["refused"] - retry_at["busy"] > 20  # 30 s cap vs Retry-After's 3 s


# --- lag: the Kafka collector with the Event Hubs names ------------------------------------


def samples(tracker: LagTracker) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in tracker.collect(now=100.0)
        for s in m.samples
    }


def test_eventhubs_lag_is_latest_minus_end_under_its_own_names() -> None:
    tracker = LagTracker(family=EVENTHUBS)
    kafka = LagTracker(family=KAFKA)
    checkpoint = durable(QID, 1, partitions=2, per_partition=10, lag=5)
    tracker.observe(checkpoint)
    kafka.observe(checkpoint)
    got = samples(tracker)
    query = "telemetry-to-delta"
    lag = "checkpoint_sidecar_eventhubs_lag_records"
    for p in ("0", "1"):
        labels = (("eventhub", "telemetry"), ("partition", p), ("query", query))
        assert got[(lag, labels)] == 5
    assert got[("checkpoint_sidecar_eventhubs_query_lag_records", (("query", query),))] == 10
    assert not any(name.startswith("checkpoint_sidecar_kafka") for name, _ in samples(tracker))
    # the Kafka collector does not take an Event Hubs source for a Kafka one
    assert not any(name.endswith("lag_records") for name, _ in samples(kafka))


def test_no_eventhubs_lag_without_latest_sequence_numbers() -> None:
    tracker = LagTracker(family=EVENTHUBS)
    tracker.observe(durable(QID, 1, lag=None))
    assert not any(name.endswith("lag_records") for name, _ in samples(tracker))


def test_eventhubs_lag_waits_for_a_latest_offset_past_the_end() -> None:
    """Spark reports a v1 source's end as its latest offset (the connector's case): that is
    no evidence of 0 lag, so nothing is exported until a progress shows more."""
    tracker = LagTracker(family=EVENTHUBS)
    query_lag = (
        "checkpoint_sidecar_eventhubs_query_lag_records",
        (("query", "telemetry-to-delta"),),
    )
    tracker.observe(durable(QID, 1, lag=0))
    assert query_lag not in samples(tracker)
    tracker.observe(durable(QID, 2, lag=3, partitions=2))
    assert samples(tracker)[query_lag] == 6
    tracker.observe(durable(QID, 3, lag=0))  # now a real 0: the source reports its latest
    assert samples(tracker)[query_lag] == 0
    tracker.forget("telemetry-to-delta")
    tracker.observe(durable(QID, 4, lag=0))
    assert query_lag not in samples(tracker)  # a retired query proves itself again
