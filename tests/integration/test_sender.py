"""The Spark-side sender against a real daemon process (no Spark needed)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec

import spark_bridge
from spark_bridge.sender import Sender
from tests.helpers import wait_for
from tests.services import DaemonProcess
from tests.sparkshapes import kafka_progress

QID = "7c0ffee0-1234-4abc-9def-000000000001"


def payload(batch: int, query_id: str = QID) -> bytes:
    return json.dumps(kafka_progress(query_id, batch)).encode()


def test_updates_offered_while_the_daemon_is_down_are_conflated_then_delivered(
    daemon_env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path
) -> None:
    sender = Sender(daemon_env["SIDECAR_SOCKET_PATH"])
    try:
        for batch in range(100):
            sender.offer(QID, payload(batch))
        wait_for(lambda: sender.stats().retried > 0)
        stats = sender.stats()
        assert stats.offered == 100 and stats.sent == 0
        assert stats.pending == 1  # one query: only its latest progress is kept
        assert stats.conflated == 99

        daemon = DaemonProcess(daemon_env, short_tmp / "d.log")
        procs.append(daemon)
        daemon.start()
        assert sender.flush(15)
        assert sender.stats().sent == 1
        saved = spark_bridge.load_checkpoint(QID, daemon_env["SIDECAR_SOCKET_PATH"])
        assert saved["batch_id"] == 99
    finally:
        sender.close(1)


def test_a_refused_update_is_counted_and_the_connection_goes_on(
    daemon_env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path
) -> None:
    daemon = DaemonProcess(daemon_env, short_tmp / "d.log")
    procs.append(daemon)
    daemon.start()
    sender = Sender(daemon_env["SIDECAR_SOCKET_PATH"])
    try:
        bad = msgspec.json.encode({"id": "q-bad", "runId": "r", "batchId": "seven"})
        sender.offer("q-bad", bad)
        sender.offer(QID, payload(3))
        assert sender.flush(10)
        stats = sender.stats()
        assert (stats.failed, stats.sent, stats.reconnects) == (1, 1, 0)
        sender.offer(QID, payload(4))
        assert sender.flush(10)
        assert sender.stats().sent == 2
        saved = spark_bridge.load_checkpoint(QID, daemon_env["SIDECAR_SOCKET_PATH"])
        assert saved["batch_id"] == 4
    finally:
        sender.close(1)
    assert "bad request (bad_request): invalid progress request" in daemon.log()


def test_close_is_bounded_when_the_daemon_never_comes(short_tmp: Path) -> None:
    sender = Sender(str(short_tmp / "nobody.sock"))
    sender.offer(QID, payload(1))
    started = time.monotonic()
    assert sender.close(timeout_s=0.3) is False
    assert time.monotonic() - started < 2.5
    assert sender.stats().pending == 1


def test_offers_do_not_cut_the_reconnect_backoff_short(short_tmp: Path) -> None:
    sender = Sender(str(short_tmp / "nobody.sock"))
    try:
        for batch in range(200):  # one progress every 10 ms for 2 s, daemon down throughout
            sender.offer(QID, payload(batch))
            time.sleep(0.01)
        attempts = sender.stats().retried
    finally:
        sender.close(0.1)
    # Backoff 50 ms doubling: about 6 attempts in 2 s. Waking on every offer made it ~200.
    assert 0 < attempts <= 12


def test_an_oversized_update_is_dropped_and_the_others_still_go(
    daemon_env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path
) -> None:
    daemon = DaemonProcess({**daemon_env, "SIDECAR_MAX_FRAME_BYTES": "4096"}, short_tmp / "d.log")
    procs.append(daemon)
    daemon.start()
    sender = Sender(daemon_env["SIDECAR_SOCKET_PATH"])
    other = "7c0ffee0-1234-4abc-9def-000000000002"
    try:
        huge = json.dumps(kafka_progress(QID, 1, partitions=400)).encode()
        assert len(huge) > 4096
        sender.offer(QID, huge)  # refused by the daemon: frame_too_large, connection closed
        sender.offer(other, payload(5, other))  # queued behind it in the same write
        assert sender.flush(15)
        stats = sender.stats()
        assert (stats.failed, stats.sent, stats.pending) == (1, 1, 0)
        saved = spark_bridge.load_checkpoint(other, daemon_env["SIDECAR_SOCKET_PATH"])
        assert saved["batch_id"] == 5
    finally:
        sender.close(1)
