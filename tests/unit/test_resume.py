"""Unit tests of sidecar.model.offsets: Kafka ``startingOffsets`` JSON from a saved checkpoint.
Pure."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar.model.offsets import ResumeError, is_kafka_offsets, kafka_starting_offsets

KAFKA = "KafkaV2[Subscribe[events]]"
RATE = "RateStreamV2[rowsPerSecond=10, rampUpTimeSeconds=0, numPartitions=default"


def source(end_offset: Any, description: str = KAFKA) -> dict[str, Any]:
    return {"description": description, "start_offset": None, "end_offset": end_offset}


def checkpoint(*sources: dict[str, Any], name: str = "orders-to-delta") -> dict[str, Any]:
    return {
        "query_id": "0e1c3f52-9d2b-4f7e-a3c4-5d6e7f809a1b",
        "name": name,
        "batch_id": 7,
        "sources": list(sources),
    }


THREE = {"events": {"0": 30, "1": 31, "2": 32}}


def test_single_kafka_source_gives_its_end_offset_compactly() -> None:
    got = kafka_starting_offsets(checkpoint(source(THREE)))
    assert got == '{"events":{"0":30,"1":31,"2":32}}'
    assert json.loads(got) == THREE


def test_partitions_sorted_numerically_and_topics_by_name() -> None:
    end = {"zeta": {"10": 5, "2": 6, "1": 7}, "alpha": {"11": 1, "0": 2, "9": 3}}
    got = kafka_starting_offsets(checkpoint(source(end)))
    assert got == '{"alpha":{"0":2,"9":3,"11":1},"zeta":{"1":7,"2":6,"10":5}}'


def test_input_checkpoint_is_not_mutated() -> None:
    ck = checkpoint(source({"events": {"1": 4}}))
    kafka_starting_offsets(ck, partitions={"events": 3, "new": 1})
    assert ck["sources"][0]["end_offset"] == {"events": {"1": 4}}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (THREE, True),
        ({"a": {"0": 1}, "b": {"3": 0}}, True),
        (120, False),  # the rate source's offset: a plain number
        ('{"events":{"0":1}}', False),  # a stringified offset is not the raw object
        ({}, False),
        (None, False),
        ({"events": {"x": 1}}, False),  # partition is not a number
        ({"events": {"0": "1"}}, False),  # offset is not an integer
        ({"events": {"0": 1.5}}, False),
        ({"events": [1, 2]}, False),
    ],
)
def test_is_kafka_offsets(value: Any, expected: bool) -> None:
    assert is_kafka_offsets(value) is expected


def test_rate_source_alone_is_no_kafka_source() -> None:
    with pytest.raises(ResumeError, match=r"0 Kafka-shaped sources \(none\)"):
        kafka_starting_offsets(checkpoint(source(120, RATE)))


def test_rate_source_beside_kafka_is_ignored() -> None:
    got = kafka_starting_offsets(checkpoint(source(120, RATE), source(THREE)))
    assert json.loads(got) == THREE


def test_several_kafka_sources_need_source_and_the_error_names_them() -> None:
    ck = checkpoint(
        source({"orders": {"0": 1}}, "KafkaV2[Subscribe[orders]]"),
        source(99, RATE),
        source({"payments": {"0": 2}}, "KafkaV2[Subscribe[payments]]"),
    )
    with pytest.raises(ResumeError) as caught:
        kafka_starting_offsets(ck)
    message = str(caught.value)
    assert "2 Kafka-shaped sources" in message
    assert "0: KafkaV2[Subscribe[orders]]" in message
    assert "2: KafkaV2[Subscribe[payments]]" in message
    assert "source=" in message
    assert "Rate" not in message


def test_source_picks_the_right_kafka_source() -> None:
    ck = checkpoint(
        source({"orders": {"0": 1}}, "KafkaV2[Subscribe[orders]]"),
        source(99, RATE),
        source({"payments": {"0": 2}}, "KafkaV2[Subscribe[payments]]"),
    )
    assert kafka_starting_offsets(ck, source=0) == '{"orders":{"0":1}}'
    assert kafka_starting_offsets(ck, source=2) == '{"payments":{"0":2}}'


@pytest.mark.parametrize("index", [1, 3, -1])
def test_source_at_a_non_kafka_or_absent_index_is_refused(index: int) -> None:
    ck = checkpoint(source(THREE), source(99, RATE), name="mixed")
    with pytest.raises(
        ResumeError, match=rf"source {index} of query 'mixed'.*Kafka sources: \[0\]"
    ):
        kafka_starting_offsets(ck, source=index)


def test_checkpoint_without_sources_is_refused() -> None:
    with pytest.raises(ResumeError, match="0 Kafka-shaped sources"):
        kafka_starting_offsets({"name": "empty", "sources": []})


@pytest.mark.parametrize(("missing", "fill"), [("earliest", -2), ("latest", -1)])
def test_added_partitions_start_at_missing(missing: Any, fill: int) -> None:
    got = kafka_starting_offsets(
        checkpoint(source(THREE)), partitions={"events": 5}, missing=missing
    )
    assert got == f'{{"events":{{"0":30,"1":31,"2":32,"3":{fill},"4":{fill}}}}}'


def test_default_missing_is_earliest() -> None:
    got = kafka_starting_offsets(checkpoint(source(THREE)), partitions={"events": 4})
    assert json.loads(got) == {"events": {"0": 30, "1": 31, "2": 32, "3": -2}}


def test_added_partitions_with_missing_error_are_listed() -> None:
    with pytest.raises(ResumeError) as caught:
        kafka_starting_offsets(checkpoint(source(THREE)), partitions={"events": 5}, missing="error")
    message = str(caught.value)
    assert "events-3, events-4" in message
    assert "events-2" not in message
    assert "missing='earliest' or 'latest'" in message


def test_missing_error_passes_when_nothing_is_absent() -> None:
    got = kafka_starting_offsets(
        checkpoint(source(THREE)), partitions={"events": 3}, missing="error"
    )
    assert json.loads(got) == THREE


def test_newly_subscribed_topic_gets_all_its_partitions() -> None:
    got = kafka_starting_offsets(
        checkpoint(source(THREE)), partitions={"events": 3, "audit": 2}, missing="latest"
    )
    assert got == '{"audit":{"0":-1,"1":-1},"events":{"0":30,"1":31,"2":32}}'


def test_newly_subscribed_topic_with_missing_error_is_named() -> None:
    with pytest.raises(ResumeError, match=r"no offsets for audit-0, audit-1;"):
        kafka_starting_offsets(
            checkpoint(source(THREE)), partitions={"events": 3, "audit": 2}, missing="error"
        )


def test_saved_partition_keeps_its_offset_when_partitions_is_given() -> None:
    # Saved offsets win over the fill, whatever the fill, including partitions beyond count.
    end = {"events": {"0": 30, "1": 0, "4": 77}}
    got = kafka_starting_offsets(
        checkpoint(source(end)), partitions={"events": 3}, missing="latest"
    )
    assert json.loads(got) == {"events": {"0": 30, "1": 0, "2": -1, "4": 77}}


def test_offsets_beyond_2_pow_53_survive_exactly() -> None:
    big = 2**53 + 1
    huge = 2**63 - 1  # Kafka's largest offset (a Java long)
    got = kafka_starting_offsets(checkpoint(source({"events": {"0": big, "1": huge}})))
    assert got == f'{{"events":{{"0":{big},"1":{huge}}}}}'
    assert json.loads(got)["events"] == {"0": 9007199254740993, "1": 9223372036854775807}
