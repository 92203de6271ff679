"""Crash recovery and the read-side CLI, with the daemon as a real process."""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import pytest

from sidecar.wire.protocol import ClientConnection, Reply, encode_request
from tests.helpers import cli, read_blob, wait_blob
from tests.services import DaemonProcess
from tests.sparkshapes import kafka_progress

QID = "9d3e1f20-55aa-4b8e-8f1c-2a3b4c5d6e7f"


@pytest.fixture
def env(daemon_env: dict[str, str]) -> dict[str, str]:
    return {**daemon_env, "SIDECAR_COUNT_THRESHOLD": "2", "SIDECAR_TIME_THRESHOLD_S": "3600"}


def send(path: str, *batches: int) -> list[bool | None]:
    """Send progress events over a plain blocking socket; return their `applied` flags."""
    conn = ClientConnection()
    replies: list[Reply] = []
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(
            b"".join(
                encode_request("progress", b, progress=kafka_progress(QID, b)) for b in batches
            )
        )
        while len(replies) < len(batches):
            replies += conn.receive_data(s.recv(65536))
    assert all(r.ok for r in replies), replies
    return [r.applied for r in replies]


def test_kill_9_with_pending_updates_then_restart_reaches_last_acked_batch(
    env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path
) -> None:
    first = DaemonProcess(env, short_tmp / "first.log")
    procs.append(first)
    first.start()
    assert send(env["SIDECAR_SOCKET_PATH"], 0, 1) == [True, True]
    assert wait_blob(env, QID, 1).writer.pid == first.pid
    assert send(env["SIDECAR_SOCKET_PATH"], 2) == [True]  # below the threshold: pending
    first.signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    doc = read_blob(env, QID)
    assert doc is not None and doc.batch_id == 1  # batch 2 was acknowledged, never flushed

    # The same container restarted in its pod (the same socket directory): it takes the dead
    # daemon's lease id over, so it writes at once, without waiting its leases out.
    second = DaemonProcess(env, short_tmp / "second.log")
    procs.append(second)
    second.start()
    doc = wait_blob(env, QID, 2)
    assert doc.batch_id == 2
    assert doc.writer.pid == second.pid
    assert "taken over from the dead daemon of" in second.log()
    assert "another owner holds the lease" not in second.log()
    second.signal(signal.SIGTERM)
    assert second.wait() == 0


def test_list_and_show_read_the_blobs(
    env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path
) -> None:
    daemon = DaemonProcess(env, short_tmp / "d.log")
    procs.append(daemon)
    daemon.start()
    # Two at a time: a flush of 0-2 (the count threshold is 2) would leave 3 alone below it,
    # pending until the hour's time threshold (a race a busy machine lost once).
    send(env["SIDECAR_SOCKET_PATH"], 0, 1)
    wait_blob(env, QID, 1)
    send(env["SIDECAR_SOCKET_PATH"], 2, 3)
    wait_blob(env, QID, 3)
    daemon.signal(signal.SIGTERM)
    assert daemon.wait() == 0  # the daemon need not run for the read side

    listed = cli(env, "list")
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split()[:3] == ["QUERY", "QUERY", "ID"]
    assert row.split()[:3] == ["orders-to-delta", QID, "3"]
    assert '{"events":{"0":400,"1":401,"2":402}}' in row

    rows = json.loads(cli(env, "list", "--json").stdout)
    assert [(r["checkpoint"]["query_id"], r["checkpoint"]["batch_id"]) for r in rows] == [(QID, 3)]
    assert rows[0]["lease_state"] == "available"

    shown = cli(env, "show", "orders-to-delta")
    assert shown.returncode == 0, shown.stderr
    assert f"query id    {QID}" in shown.stdout
    assert 'end    {"events":{"0":400,"1":401,"2":402}}' in shown.stdout

    doc = json.loads(cli(env, "show", QID, "--json").stdout)
    assert doc["batch_id"] == 3 and doc["schema_version"] == 2

    resume = cli(env, "starting-offsets", "orders-to-delta")
    assert resume.returncode == 0, resume.stderr
    assert resume.stdout.strip() == '{"events":{"0":400,"1":401,"2":402}}'
    widened = cli(env, "starting-offsets", QID, "--partitions", "events=5", "--missing", "latest")
    assert json.loads(widened.stdout) == {
        "events": {"0": 400, "1": 401, "2": 402, "3": -1, "4": -1}
    }
    refused = cli(env, "starting-offsets", QID, "--partitions", "events=4", "--missing", "error")
    assert refused.returncode == 1 and "events-3" in refused.stderr

    missing = cli(env, "show", "no-such-query")
    assert missing.returncode == 1
    assert "no checkpoint for query 'no-such-query'" in missing.stderr


def test_list_without_blob_store_settings_exits_2(env: dict[str, str]) -> None:
    del env["AZURE_STORAGE_CONNECTION_STRING"]
    result = cli(env, "list")
    assert result.returncode == 2
    assert "AZURE_STORAGE_CONNECTION_STRING" in result.stderr
