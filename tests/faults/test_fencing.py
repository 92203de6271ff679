"""Every write names the version it read (``If-Match``): what a stale writer can still do is
nothing. Against real daemon processes, Azurite and the fault proxy:

- a daemon killed -9 while its write of batch 11 is held in the network; its successor in the
  same pod (the same lease id, taken over) writes batch 20; then the held request arrives, with
  the lease id that still holds the blob: the store refuses it (412), the blob keeps 20;
- an old pod's Event Hubs final commit, retried after the new pod's checkpoint: refused by its
  version, listed again, never lowering a sequence number.

Which writer holds the lease at all: test_ownership.py.
"""

from __future__ import annotations

from pathlib import Path

from sidecar.eventhubs.checkpointer import EventHubsCheckpointer
from sidecar.eventhubs.plan import blob_name, consumer_group
from sidecar.model.checkpoint import Checkpoint
from sidecar.store.blobs import BlobStore
from sidecar.store.eventhubs import EventHubsBlobs
from sidecar.telemetry.metrics import Metrics
from tests.faults.store_proxy import Fault, StoreFaultProxy
from tests.helpers import (
    ConfigFactory,
    checkpoint_from,
    post_progress,
    read_blob,
    wait_blob,
    wait_for,
)
from tests.services import Azurite, DaemonProcess
from tests.sparkshapes import eventhubs_progress, rate_progress

QID = "fe0c0000-0000-4000-8000-000000000001"
EH_QID = "fe0c0000-0000-4000-8000-000000000002"
EH_NAMESPACE = "fence.servicebus.windows.net"


def test_a_killed_daemons_late_write_is_refused_after_its_successor_wrote(
    daemon_env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path, azurite: Azurite
) -> None:
    # The daemons' logs in short_tmp: a failure's report ends with them (tests/conftest.py).
    with StoreFaultProxy(azurite.port) as proxy:
        env = daemon_env | {
            "AZURE_STORAGE_CONNECTION_STRING": proxy.connection_string(),
            "SIDECAR_COUNT_THRESHOLD": "1",
            "SIDECAR_LEASE_DURATION_S": "60",
        }
        first = DaemonProcess(env, short_tmp / "first.log")
        procs.append(first)
        first.start()
        assert post_progress(first.socket_path, rate_progress(QID, 10)).ok
        wait_blob(daemon_env, QID, 10)

        proxy.faults = [Fault("hold", kinds=frozenset({"upload"}))]
        assert post_progress(first.socket_path, rate_progress(QID, 11)).ok
        wait_for(lambda: proxy.held, 30, "the write of batch 11 to be held in the network")
        first.kill()  # with its request still in flight
        proxy.faults = []

        # The same container restarted: it takes the lease id over, and writes at once.
        second = DaemonProcess(first.settings, short_tmp / "second.log")
        procs.append(second)
        second.start()
        assert post_progress(second.socket_path, rate_progress(QID, 20)).ok
        assert wait_blob(daemon_env, QID, 20).batch_id == 20

        held = [_request_line_and_condition(raw) for raw in proxy.held]
        # If-Match: the version it read is gone
        assert proxy.deliver_held() == [412], (held, proxy.struck, proxy.requests)
    doc = read_blob(daemon_env, QID)
    assert doc is not None and doc.batch_id == 20


def _request_line_and_condition(raw: bytes) -> str:
    """A held request's first line and its If-Match (for a failure's message)."""
    lines = raw.split(b"\r\n\r\n", 1)[0].decode(errors="replace").split("\r\n")
    return " ".join([lines[0], *(h for h in lines if h.lower().startswith("if-match"))])


async def test_an_old_pods_eventhubs_final_commit_never_lowers_a_sequence_number(
    make_config: ConfigFactory,
) -> None:
    config = make_config(eventhubs_namespace=EH_NAMESPACE)
    store = BlobStore(config)
    await store.ensure_container()
    blobs = EventHubsBlobs(store.account)
    old_metrics = Metrics()
    old = EventHubsCheckpointer(config, old_metrics, blobs)
    new = EventHubsCheckpointer(config, Metrics(), blobs)

    def at(batch: int) -> Checkpoint:
        return checkpoint_from(eventhubs_progress(EH_QID, batch, partitions=1, per_partition=10))

    async def stored() -> int:
        checkpoint = checkpoint_from(eventhubs_progress(EH_QID, 0, partitions=1))
        group = consumer_group(
            config.eventhubs_consumer_group_template, checkpoint, config.namespace
        )
        name = blob_name(EH_NAMESPACE, "telemetry", group, 0)
        listed = await blobs.eventhubs_checkpoints(config.container, name)
        ((number, _),) = listed.values()
        assert number is not None
        return int(number)

    try:
        old.durable(at(1))  # the old pod checkpoints batch 1 (its sequence number 19)
        await old.final_commit()
        assert await stored() == 19
        new.durable(at(3))  # the new pod, meanwhile, batch 3 (39)
        await new.final_commit()
        assert await stored() == 39
        old.durable(at(2))  # the old pod's last commit, retried late (29): refused
        await old.final_commit()
        assert await stored() == 39
        assert old_metrics.write_conflicts.labels("eventhubs")._value.get() == 1
        await old.final_commit()  # listed again: lower than what is there, skipped
        assert await stored() == 39 and old.behind() == []
        assert old_metrics.eventhubs_partitions_skipped._value.get() == 1
    finally:
        await store.aclose()
