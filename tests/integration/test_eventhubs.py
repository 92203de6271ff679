"""Event Hubs checkpoints against a real daemon, Redis and Azurite, read back by Event Hubs' own
``BlobCheckpointStore`` (azure-eventhub-checkpointstoreblob-aio): the SDK's layout, checked by
the SDK. Pure parts and the retry policy: tests/unit/test_eventhubs.py."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest
from azure.eventhub.extensions.checkpointstoreblobaio import BlobCheckpointStore
from azure.storage.blob.aio import BlobServiceClient

from sidecar.eventhubs import checkpointer as checkpointer_module
from sidecar.ops import admin_tool
from sidecar.ops.client import SidecarClient
from sidecar.wire.protocol import Reset
from tests.helpers import (
    ConfigFactory,
    blob_reader,
    cli,
    eventually,
    metric_value,
    post_progress,
    running_daemon,
    sample,
    wait_blob_batch,
    wait_for,
)
from tests.services import Azurite, DaemonProcess
from tests.sparkshapes import eventhubs_progress

QID = "7c1d2e3f-4a5b-4c6d-8e7f-9a0b1c2d3e4f"
RESET_QID = "7c1d2e3f-4a5b-4c6d-8e7f-000000000002"
#: Mixed case on purpose: the SDKs lowercase the blob names, and so must the daemon.
EH_NAMESPACE = "Spark-Sidecar.servicebus.windows.net"
EVENTHUB = "Telemetry"
NAME = "Telemetry-To-Delta"
GROUP = f"spark-{NAME}"  # the default SIDECAR_EVENTHUBS_CONSUMER_GROUP_TEMPLATE
PARTITIONS = 4
CHECKPOINTS = "checkpoint_sidecar_eventhubs_checkpoints_total"
UP = "checkpoint_sidecar_eventhubs_up"


def progress(query_id: str, batch: int, **kwargs: Any) -> dict[str, Any]:
    return eventhubs_progress(
        query_id, batch, eventhub=EVENTHUB, partitions=PARTITIONS, name=NAME, **kwargs
    )


def processed(batch: int, per_partition: int = 50) -> dict[str, int]:
    """The last sequence number processed per partition once ``batch`` is done: Spark's end
    offset (the next to read) minus one."""
    ends = progress(QID, batch, per_partition=per_partition)["sources"][0]["endOffset"]
    return {p: n - 1 for p, n in ends[EVENTHUB].items()}


async def read_checkpoints(connection_string: str, container: str) -> list[dict[str, Any]]:
    """The group's checkpoints as Event Hubs' SDK lists them (its names as a processor would
    pass them: the SDK lowercases them itself)."""
    store = BlobCheckpointStore.from_connection_string(connection_string, container)
    async with store:
        return list(await store.list_checkpoints(EH_NAMESPACE, EVENTHUB, GROUP))


def sequence_numbers(checkpoints: list[dict[str, Any]]) -> dict[str, int]:
    return {c["partition_id"]: c["sequence_number"] for c in checkpoints}


async def raw_metadata(connection_string: str, container: str, partition: str) -> dict[str, str]:
    """A checkpoint blob's metadata as stored (Get Blob Properties)."""
    name = f"{EH_NAMESPACE}/{EVENTHUB}/{GROUP}/checkpoint/{partition}".lower()
    async with BlobServiceClient.from_connection_string(connection_string) as service:
        props = await service.get_blob_client(container, name).get_blob_properties()
        return dict(props.metadata)


def metrics(proc: DaemonProcess) -> str:
    with urllib.request.urlopen(f"{proc.admin_url}/metrics", timeout=5) as resp:
        text: str = resp.read().decode()
        return text


def test_durable_batches_become_checkpoints_the_sdk_reads_and_never_go_back(
    daemon_env: dict[str, str], short_tmp: Path, azurite: Azurite, procs: list[DaemonProcess]
) -> None:
    env = {**daemon_env, "SIDECAR_EVENTHUBS_NAMESPACE": EH_NAMESPACE}
    env["SIDECAR_COUNT_THRESHOLD"] = "1"  # every update is flushed
    cs, container = azurite.connection_string, env["SIDECAR_CONTAINER"]
    proc = DaemonProcess(env, short_tmp / "daemon.log")
    procs.append(proc)
    proc.start()
    for batch in range(3):
        assert post_progress(proc.socket_path, progress(QID, batch)).applied

    want = processed(2)  # {"0": 149, "1": 150, "2": 151, "3": 152}

    def written() -> list[dict[str, Any]] | None:
        got = anyio.run(read_checkpoints, cs, container)
        return got if sequence_numbers(got) == want else None

    checkpoints = wait_for(written, 30, "the checkpoints of batch 2")
    assert {c["consumer_group"] for c in checkpoints} == {GROUP}
    # Spark knows no byte offset: the key is there, empty (the SDK's list reads an empty value
    # back through List Blobs as the text "None"; docs/eventhubs.md says what readers do)
    assert anyio.run(raw_metadata, cs, container, "0") == {"sequencenumber": "149", "offset": ""}

    text = metrics(proc)
    assert metric_value(text, CHECKPOINTS, result="ok") >= 1
    assert metric_value(text, CHECKPOINTS, result="error") == 0
    assert metric_value(text, UP) == 1
    # lag from the progress' latestOffset (5 past the end on each partition), Spark's view
    assert metric_value(text, "checkpoint_sidecar_eventhubs_query_lag_records", query=NAME) == 20
    lag = {"query": NAME, "eventhub": EVENTHUB, "partition": "3"}
    assert metric_value(text, "checkpoint_sidecar_eventhubs_lag_records", **lag) == 5
    assert f'checkpoint_sidecar_kafka_query_lag_records{{query="{NAME}"}}' not in text

    # starting-offsets prints the connector's startingPositions at the saved end, inclusive
    resumed = cli(env, "starting-offsets", NAME)
    assert resumed.returncode == 0, resumed.stderr
    positions = json.loads(resumed.stdout)
    assert positions[json.dumps({"ehName": EVENTHUB, "partitionId": 2}, separators=(",", ":"))] == {
        "offset": None,
        "seqNo": want["2"] + 1,
        "enqueuedTime": None,
        "isInclusive": True,
    }

    # A restarted daemon (it reads the stored checkpoints again) and a query reset under the
    # same name (a new id: the same group, lower sequence numbers): nothing moves back.
    assert proc.stop() == 0
    again = DaemonProcess(env, short_tmp / "daemon2.log")
    procs.append(again)
    again.start()
    assert post_progress(again.socket_path, progress(RESET_QID, 0, per_partition=10)).applied
    wait_for(
        lambda: (
            metric_value(metrics(again), "checkpoint_sidecar_eventhubs_partitions_skipped_total")
            == PARTITIONS
        ),
        30,
        "the reset query's lower sequence numbers to be refused",
    )
    assert metric_value(metrics(again), CHECKPOINTS, result="regressed") == 1
    assert sequence_numbers(anyio.run(read_checkpoints, cs, container)) == want
    assert "not checkpointing 4 partition(s) backwards" in again.log()


async def test_a_missing_container_is_an_error_retried_until_it_exists(
    make_config: ConfigFactory,
    azurite: Azurite,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A missing container is not retriable (an operator creates it): the 30 s cap, made 1 s.
    monkeypatch.setattr(checkpointer_module, "RETRY_CAP_S", 1.0)
    container = f"eh-{namespace}"
    config = make_config(
        eventhubs_namespace=EH_NAMESPACE, eventhubs_container=container, count_threshold=1
    )
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as client:
            assert (await client.progress(progress(QID, 0))).applied
        async with blob_reader(config) as store:
            await wait_blob_batch(store, QID, 0)  # the query's own blob is not held up
        await eventually(lambda: sample(daemon, CHECKPOINTS, result="error") >= 2, 20)
        assert sample(daemon, UP) == 0
        assert daemon.eventhubs is not None and daemon.eventhubs.behind() == [GROUP]

        async with BlobServiceClient.from_connection_string(azurite.connection_string) as svc:
            await svc.create_container(container)
        await eventually(lambda: sample(daemon, UP) == 1, 20)
        got = await read_checkpoints(azurite.connection_string, container)
        assert sequence_numbers(got) == processed(0)
        assert daemon.eventhubs.behind() == []


async def test_a_reset_through_the_daemon_lowers_the_checkpoints_on_purpose(
    make_config: ConfigFactory, azurite: Azurite, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(
        eventhubs_namespace=EH_NAMESPACE, count_threshold=1, admin_ops="true", history_size=5
    )
    cs, container = azurite.connection_string, config.container

    async def checkpointed(want: dict[str, int]) -> None:
        with anyio.fail_after(20):
            while sequence_numbers(await read_checkpoints(cs, container)) != want:  # noqa: ASYNC110 - polls the store
                await anyio.sleep(0.05)

    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            for batch in range(4):  # each flushed alone: the blob retains each
                assert (await c.progress(progress(QID, batch))).applied
                await wait_blob_batch(daemon.store, QID, batch)
            await checkpointed(processed(3))
            reply = await c.request(
                "reset", name=NAME, to_batch=1, reason="bad deploy", force=True, by="t"
            )
            assert reply.ok, reply.error
            # Event Hubs' own store reads them back lowered to batch 1's: a processor taking
            # the group over resumes right after what the reset's position processed.
            await checkpointed(processed(1))
            assert sample(daemon, CHECKPOINTS, result="rewound") == 1
            said = [
                r.getMessage()
                for r in caplog.records
                if r.name == "sidecar.eventhubs.checkpointer" and "on purpose" in r.getMessage()
            ]
            assert said == [
                f"eventhubs group={GROUP} query={NAME} batch=1: 4 partition(s) lowered on "
                "purpose, a deliberate rewind (reset from batch 3 to batch 1 by t; reason: bad "
                f"deploy): {EVENTHUB}-0: 199 -> 99, {EVENTHUB}-1: 200 -> 100, {EVENTHUB}-2: 201 "
                f"-> 101, {EVENTHUB}-3: 202 -> 102"
            ]
            # Nothing else lowers them: an older batch of a query under the same name (a new
            # id) is flushed, and refused, as before.
            assert (await c.progress(progress(RESET_QID, 0))).applied
            await wait_blob_batch(daemon.store, RESET_QID, 0)
            await eventually(lambda: sample(daemon, CHECKPOINTS, result="regressed") >= 1)
            assert sequence_numbers(await read_checkpoints(cs, container)) == processed(1)
            # The query's next batch after the reset moves them forward.
            assert (await c.progress(progress(QID, 2))).applied
            await checkpointed(processed(2))
        assert sample(daemon, CHECKPOINTS, result="rewound") == 1
    # The daemon stopped: the CLI's reset, under a lease of its own, lowers them itself.
    request = Reset(reason="replay", query_id=QID, to_batch=0, force=True, by="t")
    result = await admin_tool.reset(config, request)
    assert result.via == "lease"
    assert result.summary().endswith(
        f"; Event Hubs checkpoints of group {GROUP} set to it (lowered on purpose where lower)"
    )
    assert sequence_numbers(await read_checkpoints(cs, container)) == processed(0)
