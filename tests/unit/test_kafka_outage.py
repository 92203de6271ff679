"""The Kafka committer's loop while the brokers are down, in virtual time, against a fake
consumer at the client's edge (``sidecar.kafka.client.open_consumer``). The same path against
a real broker stopped under the daemon: tests/integration/test_kafka.py
(``test_broker_outage_commits_resume_and_catch_up``)."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import msgspec
import pytest
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from sidecar.config import Config
from sidecar.kafka import client as kafka_client
from sidecar.kafka.committer import KafkaCommitter
from sidecar.model import checkpoint as ckpt
from sidecar.telemetry.metrics import Metrics
from tests.unit.fakes import FakeKafkaConsumer, checkpoint
from tests.unit.simloop import VirtualTimeLoop

CONFIG = Config(namespace="unit", kafka_bootstrap_servers="unit:9092", kafka_timeout_s=2)


class Brokers:
    """One partition's committed offset; while ``down``, every call waits until they are up
    again or its caller gives up (aiokafka retries an unreachable broker until the request
    times out)."""

    def __init__(self) -> None:
        self.down = False
        self.committed: int | None = None
        self.polls = 0

    async def _reach(self) -> None:
        while self.down:  # noqa: ASYNC110 - the test's scenario sets it
            await asyncio.sleep(0.1)

    async def open_consumer(self, group: str, options: dict[str, Any]) -> Consumer:
        await self._reach()
        return Consumer(self)


class Consumer(FakeKafkaConsumer):
    def __init__(self, brokers: Brokers) -> None:
        super().__init__()
        self.brokers = brokers

    async def committed(self, tp: TopicPartition) -> int | None:
        await self.brokers._reach()
        return self.brokers.committed

    async def commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        await self.brokers._reach()
        (self.brokers.committed,) = (oam.offset for oam in offsets.values())

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        self.brokers.polls += 1
        await self.brokers._reach()
        return {tp: 100 for tp in tps}


def of_kafka(batch: int) -> ckpt.Checkpoint:
    """Batch ``batch`` of a query reading one Kafka partition, at offset ``batch``."""
    offsets = ckpt.raw_offset({"events": {"0": batch}})
    source = ckpt.SourceOffsets("KafkaV2[Subscribe[events]]", offsets, offsets, offsets, 1)
    return msgspec.structs.replace(checkpoint("q1", batch, name="orders"), sources=[source])


def test_the_lag_poll_backs_off_while_the_brokers_are_down(monkeypatch: pytest.MonkeyPatch) -> None:
    # The poll of end offsets (for lag) waits out kafka_timeout_s against a broker that is
    # down. Polled at every pass (a tick a second), it held each pass that long, and a new
    # batch's commit behind it; backed off like a commit, it polls a few times a minute.
    brokers = Brokers()
    monkeypatch.setattr(kafka_client, "open_consumer", brokers.open_consumer)
    runner = asyncio.Runner(loop_factory=VirtualTimeLoop)
    loop = runner.get_loop()
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        committer = KafkaCommitter(CONFIG, Metrics(), clock=loop.time, jitter=lambda: 0.5)
        async with anyio.create_task_group() as tg:
            await tg.start(committer.run)
            committer.durable(of_kafka(1))
            await anyio.sleep(1.5)
            seen["up"] = (brokers.committed, brokers.polls)
            brokers.down = True
            await anyio.sleep(60)
            seen["polls while down"] = brokers.polls - seen["up"][1]
            brokers.down = False
            committer.durable(of_kafka(2))
            began = loop.time()
            while brokers.committed != 2:  # noqa: ASYNC110 - set by the committer's task
                await anyio.sleep(0.1)
            seen["commit after"] = loop.time() - began
            tg.cancel_scope.cancel()

    try:
        runner.run(scenario())
    finally:
        runner.close()
    assert seen["up"][0] == 1  # committed
    # Every pass polling: 20 polls in 60 s (a 1 s tick, then 2 s waited out each time).
    assert seen["polls while down"] <= 7
    assert seen["commit after"] <= 1.1  # commits resume at the next pass
