"""Ownership against real daemon processes, redis-server and Azurite
(``sidecar.daemon.ownership``: a lease id of each process's own, handed over only to the same
container restarted in its pod; every write names the blob's version):

- a daemon killed -9 and restarted in its pod resumes its own leases at once;
- twins — one identity, two Redis servers, one storage namespace, their drivers 50 batches
  apart — never both write: under a minute of load the blob never moves backwards and ends at
  the owner's highest acknowledged batch, and the other says it does not own the query;
- two daemons on one Redis server, databases 0 and 1: the second writes nothing while the
  first holds the lease, and takes over once it stops.

The late write of a killed daemon and an old pod's Event Hubs commit: test_fencing.py.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

from tests.faults.load import scrape_process
from tests.helpers import (
    metric_value,
    post_progress,
    read_blob,
    wait_blob,
    wait_for,
)
from tests.services import DaemonProcess, RedisServer
from tests.sparkshapes import rate_progress

QID = "1a570000-0000-4000-8000-000000000001"
NAME = "pod"


def post(proc: DaemonProcess, batch: int) -> bool:
    """One update; whether it was acknowledged (stored)."""
    reply = post_progress(proc.socket_path, rate_progress(QID, batch, name=NAME))
    return reply.ok


def elsewhere(proc: DaemonProcess) -> float:
    """``checkpoint_sidecar_lease_held_elsewhere`` of the query (any writer), 0 when absent."""
    _, text = scrape_process(proc)
    total = 0.0
    for line in text.splitlines():
        if (
            line.startswith("checkpoint_sidecar_lease_held_elsewhere{")
            and f'query="{NAME}"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_daemon_killed_and_restarted_in_its_pod_resumes_its_own_leases_at_once(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    # 60 s leases: with a lease id of its own the restarted daemon could not write the blob
    # for a minute (the killed one's lease would have to expire first). The same container
    # restarted shares its pod's emptyDir (here: the socket's directory) with its predecessor.
    env = daemon_env | {"SIDECAR_LEASE_DURATION_S": "60", "SIDECAR_COUNT_THRESHOLD": "1"}
    first = DaemonProcess(env, tmp_path / "first.log")
    procs.append(first)
    first.start()
    assert post(first, 1)
    wait_blob(env, QID, 1)
    first.kill()  # SIGKILL: no final flush, no lease released, its lease file left locked-free

    second = DaemonProcess(first.settings, tmp_path / "second.log")
    procs.append(second)
    second.start()
    started = time.monotonic()
    assert post(second, 2)
    doc = wait_blob(env, QID, 2, timeout_s=30)  # well inside the killed daemon's 60 s lease
    assert doc.batch_id == 2 and time.monotonic() - started < 30
    assert "taken over from the dead daemon of" in second.log()


def test_twins_with_separate_redis_never_both_write_and_the_blob_never_moves_back(
    daemon_env: dict[str, str],
    procs: list[DaemonProcess],
    tmp_path: Path,
    short_tmp: Path,
    own_redis: RedisServer,
) -> None:
    # One identity (the Spark Operator names every driver pod <app>-driver), one storage
    # namespace and container, two Redis servers: a recovery cluster, a copied config.
    env = daemon_env | {"SIDECAR_INSTANCE_ID": "app-driver", "SIDECAR_COUNT_THRESHOLD": "1"}
    twin_env = env | {
        "SIDECAR_SOCKET_PATH": str(short_tmp / "twin" / "s.sock"),
        "SIDECAR_REDIS_URL": own_redis.url,
    }
    (short_tmp / "twin").mkdir()
    first = DaemonProcess(env, tmp_path / "first.log")
    procs.append(first)
    first.start()
    assert post(first, 0)
    wait_blob(env, QID, 0)  # the first owns the query's lease now
    twin = DaemonProcess(twin_env, tmp_path / "twin.log")
    procs.append(twin)
    twin.start()

    stop = threading.Event()
    acked: dict[str, int] = {"first": 0, "twin": 0}
    seen: list[int] = []

    def drive(proc: DaemonProcess, who: str, offset: int) -> None:
        batch = 1
        while not stop.is_set():
            if post(proc, batch + offset):
                acked[who] = batch + offset
            batch += 1
            time.sleep(0.02)

    def watch() -> None:
        while not stop.is_set():
            doc = read_blob(env, QID)
            if doc is not None:
                seen.append(doc.batch_id)
            time.sleep(0.05)

    threads = [
        threading.Thread(target=drive, args=(first, "first", 0)),
        threading.Thread(target=drive, args=(twin, "twin", 50)),  # its driver 50 batches ahead
        threading.Thread(target=watch),
    ]
    for thread in threads:
        thread.start()
    try:
        time.sleep(60)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)

    # The twin says it does not own the query, and whose lease holds it.
    assert elsewhere(twin) == 1
    status, body = twin.readyz() or (0, "")
    assert status == 503 and "lease held by another daemon" in body and NAME in body
    assert metric_value(scrape_process(twin)[1], "checkpoint_sidecar_lease_held", query=NAME) == 0
    assert twin.stop() == 0  # it writes nothing on its way out either
    assert first.stop() == 0  # the owner's final flush
    moves_back = [(a, b) for a, b in itertools.pairwise(seen) if b < a]
    assert moves_back == []
    assert len(set(seen)) > 100  # the blob really moved under the load
    assert max(seen) < 50 + min(acked.values())  # no batch of the twin's ever reached it
    doc = read_blob(env, QID)
    assert doc is not None and doc.batch_id == acked["first"]


def test_two_daemons_on_one_redis_server_databases_0_and_1_one_writes_until_it_stops(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path, short_tmp: Path
) -> None:
    env = daemon_env | {"SIDECAR_COUNT_THRESHOLD": "1"}
    (short_tmp / "db1").mkdir()
    second_env = env | {
        "SIDECAR_SOCKET_PATH": str(short_tmp / "db1" / "s.sock"),
        "SIDECAR_REDIS_URL": env["SIDECAR_REDIS_URL"].rsplit("/", 1)[0] + "/1",
    }
    first = DaemonProcess(env, tmp_path / "first.log")
    procs.append(first)
    first.start()
    assert post(first, 1)
    wait_blob(env, QID, 1)
    second = DaemonProcess(second_env, tmp_path / "second.log")
    procs.append(second)
    second.start()
    assert post(second, 5)  # buffered in database 1; the lease is the first's
    wait_for(lambda: elsewhere(second) == 1, 30, "the second to report the lease held elsewhere")
    doc = read_blob(env, QID)
    assert doc is not None and doc.batch_id == 1  # the second wrote nothing

    assert first.stop() == 0  # its leases released
    doc = wait_blob(env, QID, 5, timeout_s=30)  # the second's retry takes the lease
    assert doc.batch_id == 5
    wait_for(lambda: elsewhere(second) == 0, 10, "the holder's series to go")
