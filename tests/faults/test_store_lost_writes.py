"""The blob store loses its last writes under load, and every checkpoint converges again.

Azurite killed with SIGKILL in the middle of writes and restarted on its data comes back
without its last seconds of writes (it saves its metadata every 5 s; the kill comes 2 s after
a save): the blobs hold batches below what Redis records as flushed, as after an Azure account
failover or a restore of older blob versions. Two daemon processes on one namespace and one
Redis flush six queries under load (``tests/faults/load.py``, both sockets).

Checked: within 30 s of the store's return every query's blob holds the newest batch
acknowledged by then; nothing moves backwards in Redis, in a ``get`` reply or in a blob,
except by what the store itself lost (the blobs are judged from what they hold when it
returns); the daemons count each blob the store lost
(``checkpoint_sidecar_store_lost_writes_total``) and say so for each in words an operator
reads, whoever read it first (a blob read by ingest is compared with Redis too); and no
daemon blames "another writer".
"""

from __future__ import annotations

import functools
import random
import time
from pathlib import Path
from signal import SIGKILL

import anyio
import pytest

from tests.faults.load import metric, run_load
from tests.faults.nemesis import AZURITE_SAVE_S, SETTINGS, _listening
from tests.services import Azurite, DaemonProcess, RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: How long after the store's return every blob must hold what was acknowledged by then.
CONVERGE_S = 30.0
#: How long after one of its saves the store is killed: the writes it loses.
LOSE_S = 2.0


async def saved(azurite: Azurite, timeout_s: float = 2 * AZURITE_SAVE_S) -> None:
    """Wait until Azurite saves its metadata again (its database file is rewritten)."""
    db = azurite.dir / "data" / "__azurite_db_blob__.json"
    first = db.stat().st_mtime_ns
    deadline = time.monotonic() + timeout_s
    while db.stat().st_mtime_ns == first:
        assert time.monotonic() < deadline, f"Azurite did not save {db} in {timeout_s}s"
        await anyio.sleep(0.02)


async def test_checkpoints_converge_after_the_store_loses_its_last_writes(
    short_tmp: Path,
) -> None:
    with RedisServer() as redis_server, Azurite(debug_log=False) as azurite:
        env = {
            **SETTINGS,
            "SIDECAR_REDIS_URL": redis_server.url,
            "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
        }
        daemons = [
            DaemonProcess(
                env
                | {
                    "SIDECAR_INSTANCE_ID": f"lost-{name}",
                    "SIDECAR_SOCKET_PATH": str(short_tmp / f"{name}.sock"),
                },
                short_tmp / f"daemon-{name}.log",
            )
            for name in "ab"
        ]
        try:
            for d in daemons:
                await anyio.to_thread.run_sync(functools.partial(d.start, wait=False))
            for d in daemons:
                await _listening(d)
            sockets = [d.socket_path for d in daemons]
            async with run_load(env, sockets, connections=4, rate_per_s=600) as load:
                await load.wait_acks(600, timeout_s=60)
                await load.wait_every_blob()
                # Azurite saves its metadata every AZURITE_SAVE_S: past that, the container and
                # the blobs are on disk and only the last writes can be lost, as in a store
                # that ran for long. Then the kill comes LOSE_S after a save, mid-write
                # (flushes run every few tens of ms here): those seconds of writes are lost.
                await anyio.sleep(AZURITE_SAVE_S)
                await saved(azurite)
                await anyio.sleep(LOSE_S + random.uniform(0.0, 0.5))
                before = await load.blob_batches()
                await anyio.to_thread.run_sync(azurite.stop, SIGKILL)
                await anyio.sleep(2.0)  # down: the daemons buffer in Redis and retry
                await anyio.to_thread.run_sync(azurite.start)
                returned = time.monotonic()
                load.store_went_back()
                after = await load.blob_batches()
                owed = load.acked()
                deadline = returned + CONVERGE_S
                while True:
                    now = await load.blob_batches()
                    behind = {q: (b, owed[q]) for q, b in now.items() if b is None or b < owed[q]}
                    if not behind:
                        break
                    assert time.monotonic() < deadline, (
                        f"{CONVERGE_S:.0f}s after the store returned, blobs behind what was "
                        f"acknowledged (blob, acked): {behind}; before the kill {before}, "
                        f"on return {after}; {load.summary()}"
                    )
                    await anyio.sleep(0.2)
                converged_s = time.monotonic() - returned
                await load.stop_sending()
                await load.wait_durable(timeout_s=60)
            load.check()
            lost = {
                q: (before[q], after[q]) for q in before if (after[q] or -1) < (before[q] or -1)
            }
            counted = [
                await metric(d, "checkpoint_sidecar_store_lost_writes_total") for d in daemons
            ]
            logs = "".join(d.log() for d in daemons)
            print(
                f"store lost writes: {len(lost)} of {len(before)} blobs went back {lost}; "
                f"converged {converged_s:.1f}s after its return; counted {counted}"
            )
            # The fault did what it is for: the store went back on some blobs, and the
            # daemons said so in those words, never blaming another writer.
            assert lost, f"the store lost nothing this time (before {before}, after {after})"
            # Each blob that went back is found before it is written over, whoever read it
            # first (the flush, or ingest's floor: a blob read by ingest is compared too).
            assert sum(c or 0 for c in counted) >= len(lost), (counted, lost)
            found = {
                line.split("query=")[1].split(":")[0]
                for line in logs.splitlines()
                if "the blob store lost writes: the blob held batch" in line
            }
            assert len(found) >= len(lost), (found, lost)
            assert "changed by another writer" not in logs
            exits = [await anyio.to_thread.run_sync(d.stop) for d in daemons]
            assert exits == [0, 0]
        finally:
            for d in daemons:
                d.close()
