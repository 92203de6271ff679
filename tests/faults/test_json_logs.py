"""Structured logs from a real daemon process (``SIDECAR_LOG_FORMAT=json``) through a blob
store fault: every line it writes, on stdout or stderr, is one JSON object; the flush, its
failure and the lease's changes carry their fields; no secret of its settings shows. And text
stays the default. The fields themselves: tests/unit/test_logs.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.faults.store_proxy import Fault, StoreFaultProxy
from tests.faults.test_hostile_clients import post
from tests.helpers import cli, wait_blob, wait_for
from tests.services import AZURITE_KEY, Azurite, DaemonProcess, RedisServer
from tests.unit.test_logs import ISO_UTC, TEXT_LINE

QID = "7a5e0000-0000-4000-8000-000000000001"
#: Redis' password, in SIDECAR_REDIS_URL: never in a log line.
REDIS_PASSWORD = "hunter2-json-logs"


def json_lines(text: str) -> list[dict[str, Any]]:
    """Each line of a log parsed as a JSON object (any line that is not one fails)."""
    parsed = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            obj = json.loads(line)
        except ValueError:
            raise AssertionError(f"line {number} is not JSON: {line!r}") from None
        assert isinstance(obj, dict), line
        assert {"timestamp", "level", "logger", "message"} <= obj.keys(), line
        assert ISO_UTC.match(obj["timestamp"]), line
        parsed.append(obj)
    return parsed


def first(lines: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """The first line with these field values (``message`` by prefix)."""
    prefix = fields.pop("message", "")
    for line in lines:
        if line["message"].startswith(prefix) and all(line.get(k) == v for k, v in fields.items()):
            return line
    raise AssertionError(f"no line with {prefix!r} and {fields} among {len(lines)} lines")


def test_a_daemon_logging_json_through_a_store_fault(
    azurite: Azurite, namespace: str, short_tmp: Path, procs: list[DaemonProcess]
) -> None:
    with (
        RedisServer(extra_args=["--requirepass", REDIS_PASSWORD]) as redis_server,
        StoreFaultProxy(azurite.port, seed=21) as proxy,
    ):
        env = {
            "SIDECAR_LOG_FORMAT": "json",
            "SIDECAR_LOG_LEVEL": "DEBUG",  # the flushed lines are DEBUG
            "SIDECAR_SOCKET_PATH": str(short_tmp / "s.sock"),
            "SIDECAR_REDIS_URL": f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_server.port}/0",
            "SIDECAR_NAMESPACE": namespace,
            "SIDECAR_METRICS_HOST": "127.0.0.1",
            "AZURE_STORAGE_CONNECTION_STRING": proxy.connection_string(),
            "SIDECAR_CONTAINER": "checkpoints",
            "SIDECAR_LEASE_DURATION_S": "15",
            "SIDECAR_FLUSH_INTERVAL_S": "0.05",
            "SIDECAR_COUNT_THRESHOLD": "1",
            "SIDECAR_WRITE_TIMEOUT_S": "1",
        }
        proc = DaemonProcess(env, short_tmp / "daemon.log")
        procs.append(proc)
        proc.start()
        # The listener resends until acknowledged (the container may still be being opened).
        wait_for(lambda: post(proc.socket_path, QID, 1).ok, 20, "batch 1 acknowledged")
        assert wait_blob(env, QID, 1).batch_id == 1

        # The store throttles every upload: the flush of batch 2 fails, is logged, retried.
        proxy.faults = [Fault("status", frozenset({"upload"}), status=503)]
        assert post(proc.socket_path, QID, 2).ok  # Redis buffers it
        wait_for(lambda: "flush query=orders batch=2 failed" in proc.log(), 20, "a failed flush")
        proxy.faults = []
        assert wait_blob(env, QID, 2).batch_id == 2
        assert proc.stop() == 0  # its leases released at the stop

    text = proc.log()
    lines = json_lines(text)  # the process's stdout and stderr, every line

    flushed = first(lines, message="flushed query=", batch=1)
    assert (flushed["level"], flushed["logger"]) == ("DEBUG", "sidecar.flush.flusher")
    assert flushed["query"] == "orders"  # the query's name (its id when unnamed)

    failed = first(lines, message="flush query=orders batch=2 failed")
    assert (failed["level"], failed["logger"]) == ("WARNING", "sidecar.flush.flusher")
    assert (failed["query"], failed["batch"], failed["query_id"]) == ("orders", 2, QID)
    assert failed["error"] == "StoreUnavailable"
    assert (failed["error_code"], failed["retriable"]) == ("unavailable", True)
    assert failed["reason"] == "503 ServerBusy"
    assert isinstance(failed["retry_in_s"], float) and failed["retry_in_s"] >= 1.0  # Retry-After

    held = first(lines, message="lease query=orders", lease_state="HELD")
    assert (held["level"], held["logger"], held["query_id"]) == ("INFO", "sidecar.flush.lease", QID)
    released = first(lines, message="lease query=orders", lease_state="RELEASED")
    assert released["query"] == "orders"

    ready = first(lines, message="ready:")
    assert (ready["namespace"], ready["ack_mode"]) == (namespace, "redis")
    levels = {line["level"] for line in lines}
    assert {"DEBUG", "INFO", "WARNING"} <= levels
    assert {"sidecar.daemon.app", "sidecar.flush.lease", "sidecar.flush.flusher"} <= {
        line["logger"] for line in lines
    }

    # The settings are logged at the start as `checkpoint-sidecar config` shows them.
    starting = first(lines, message="checkpoint-sidecar ")
    assert f":***@127.0.0.1:{redis_server.port}/0" in starting["message"]
    assert "AccountKey=***" in starting["message"]
    assert REDIS_PASSWORD not in text
    assert AZURITE_KEY not in text


def test_text_is_the_default_and_json_covers_a_start_refused(short_tmp: Path) -> None:
    """No blob store: the daemon refuses to start (exit 2) after its first log line."""
    env = {
        "SIDECAR_SOCKET_PATH": str(short_tmp / "s.sock"),
        "SIDECAR_REDIS_URL": f"redis://:{REDIS_PASSWORD}@127.0.0.1:1/0",
    }
    text = cli(env, "run")
    assert text.returncode == 2, text.stderr
    warning = text.stderr.splitlines()[0]
    assert TEXT_LINE.match(warning), text.stderr
    assert " WARNING sidecar: SIDECAR_NAMESPACE is not set; using 'default'." in warning
    assert "checkpoint-sidecar: no blob store configured" in text.stderr

    as_json = cli(env | {"SIDECAR_LOG_FORMAT": "json"}, "run")
    assert as_json.returncode == 2, as_json.stderr
    lines = json_lines(as_json.stderr)
    assert first(lines, message="SIDECAR_NAMESPACE is not set")["level"] == "WARNING"
    refused = first(lines, message="no blob store configured")
    assert (refused["level"], refused["logger"], refused["error"]) == (
        "ERROR",
        "sidecar",
        "ConfigError",
    )
    assert REDIS_PASSWORD not in text.stderr + as_json.stderr
