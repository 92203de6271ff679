"""Kafka helpers shared by the tests that need a topic and a consumer group on the
Kafka-protocol broker (the ``broker`` fixture of tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition

from tests.sparkshapes import kafka_progress

QID = "4b1d0c2e-0000-4000-8000-00000000cafe"
TOPIC = "events"
PARTS = 3
GROUP = "spark-orders-to-delta"
TPS = [TopicPartition(TOPIC, p) for p in range(PARTS)]


async def create_topic_with_records(bootstrap: str, per_partition: int = 50) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(TOPIC, PARTS, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for p in range(PARTS):
            for _ in range(per_partition):
                await producer.send_and_wait(TOPIC, b"record", partition=p)
    finally:
        await producer.stop()


@asynccontextmanager
async def group_reader(bootstrap: str, group: str = GROUP) -> AsyncIterator[AIOKafkaConsumer]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    consumer.assign(TPS)
    try:
        yield consumer
    finally:
        await consumer.stop()


async def committed(consumer: AIOKafkaConsumer) -> list[int | None]:
    # the admin call listing group offsets fails against Tansu; committed() works
    return [await consumer.committed(tp) for tp in TPS]


def end_offsets_of(batch: int) -> list[int]:
    return [(batch + 1) * 10 + p for p in range(PARTS)]  # kafka_progress(per_partition=10)


def progress(batch: int, query_id: str = QID) -> dict[str, Any]:
    return kafka_progress(query_id, batch, topic=TOPIC, partitions=PARTS, per_partition=10)


async def wait_committed(
    consumer: AIOKafkaConsumer, expected: list[int], timeout_s: float = 30
) -> None:
    with anyio.fail_after(timeout_s):
        while await committed(consumer) != expected:  # noqa: ASYNC110 - polls the broker
            await anyio.sleep(0.1)
