"""Spark Connect: the JVM listener registered on a real Connect server by conf alone.

The server (``spark-submit --class …SparkConnectServer``) runs as its own process with the
listener jar and ``spark.sql.streaming.streamingQueryListeners``; the clients are separate
Python processes (``python -m tests.integration.test_spark_connect``, see ``main``) that use
nothing but PySpark's Connect API and the server's ``sc://`` address: no jar, conf or listener
on the client side. (A client in this process could meet the classic SparkSession of
tests/integration/test_spark.py.)

The client and the test talk through small JSON files in the client's directory:
``started.json`` (session and query ids), ``reached.json`` (every query ran the requested
batches), then the test creates ``stop`` and the client answers ``result.json`` with each
query's last progress after ``stop()``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyspark
import pytest
from pyspark.sql import SparkSession

import spark_bridge
from sidecar.model import checkpoint as ckpt
from sidecar.wire.protocol import encode_request
from tests.faults.test_hostile_clients import Client
from tests.helpers import metric_value, wait_blob, wait_for
from tests.services import REPO_ROOT, TEST_JVM_OPTIONS, Azurite, DaemonProcess, RedisServer

pytestmark = pytest.mark.spark4

#: The line SparkConnectServer logs once its gRPC port accepts connections.
SERVER_STARTED = re.compile(r"Spark Connect server started at: (\S+):(\d+)")
#: Logged once per Sender, i.e. once per daemon endpoint in a driver JVM (Sender.start).
SENDER_STARTED = "checkpoint-sidecar listener sends to"
ROWS_PER_BATCH = 10


class ConnectServer:
    """A Spark Connect server with the listener registered by conf, as its own process group.

    The gRPC port is 0 (the server picks a free one; read back from its log), so there is
    no window in which another process can take a port chosen here.
    """

    def __init__(self, work_dir: Path, socket_path: str) -> None:
        self.dir = work_dir
        self.log_path = work_dir / "connect-server.log"
        self.socket_path = socket_path
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        spark_submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
        # Spark's scratch space (block manager, fetched jars) in our dir, removed afterwards.
        local = self.dir / "spark-local"
        conf = {
            "spark.sql.streaming.streamingQueryListeners": spark_bridge.LISTENER_CLASS,
            "spark.checkpointSidecar.socketPath": self.socket_path,
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": "0",
            "spark.ui.enabled": "false",
            "spark.local.dir": str(local),
            "spark.driver.extraJavaOptions": " ".join(
                [f"-Djava.io.tmpdir={local}", *TEST_JVM_OPTIONS]
            ),
            "spark.sql.warehouse.dir": str(self.dir / "warehouse"),
        }
        # The spark-connect jar ships in the pyspark wheel's jars/: no --packages needed.
        return [
            str(spark_submit),
            "--class",
            "org.apache.spark.sql.connect.service.SparkConnectServer",
            "--name",
            "checkpoint-sidecar-connect-tests",
            "--master",
            "local[2]",
            "--jars",
            spark_bridge.listener_jar(),
            *[arg for key, value in conf.items() for arg in ("--conf", f"{key}={value}")],
        ]

    def start(self, timeout_s: float = 90) -> None:
        (self.dir / "spark-local").mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SIDECAR_", "SPARK_"))}
        env["SPARK_LOCAL_IP"] = "127.0.0.1"  # driver, block manager: loopback only
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=self.dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped as a whole
            )
        self.port = wait_for(self._accepting, timeout_s, "the Spark Connect server")

    def _accepting(self) -> int | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"Connect server exited {self.proc.returncode}:\n{self.log()}")
        started = SERVER_STARTED.search(self.log())
        if started is None:
            return None
        port = int(started.group(2))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return port
        except OSError:
            return None

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM the process group (Spark's shutdown hooks run), SIGKILL it if it hangs."""
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc.wait()
        self.proc = None


class ConnectClient:
    """One client process (``main`` below) running a streaming query in each of its sessions."""

    def __init__(self, server_url: str, work_dir: Path, sessions: int, batches: int) -> None:
        self.dir = work_dir
        work_dir.mkdir(parents=True)
        self.log_path = work_dir / "client.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SIDECAR_", "SPARK_"))}
        env["PYTHONPATH"] = str(REPO_ROOT)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.integration.test_spark_connect",
                    server_url,
                    str(work_dir),
                    f"--sessions={sessions}",
                    f"--batches={batches}",
                ],
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def message(self, name: str, timeout_s: float = 60) -> Any:
        """Wait for the client's ``<name>.json``; fail early (with its log) if it died."""

        def ready() -> Any:
            path = self.dir / f"{name}.json"
            if path.exists():
                return json.loads(path.read_text())
            if self.proc.poll() is not None:
                log = self.log_path.read_text(errors="replace")
                raise AssertionError(f"client exited {self.proc.returncode}:\n{log}")
            return None

        return wait_for(ready, timeout_s, f"the client's {name}.json")

    def stop_queries(self) -> list[dict[str, Any]]:
        """Tell the client to stop its queries; their last progress (Spark's own JSON)."""
        (self.dir / "stop").touch()
        result: list[dict[str, Any]] = self.message("result")
        assert self.proc.wait(30) == 0, self.log_path.read_text(errors="replace")
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# --- fixtures: one daemon and one Connect server for this module --------------------------


@pytest.fixture(scope="module")
def work_dir() -> Iterator[Path]:
    # Short: the daemon's Unix socket path must stay under ~100 bytes.
    path = Path(tempfile.mkdtemp(prefix="cps-connect-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def env(redis_server: RedisServer, azurite: Azurite, work_dir: Path) -> dict[str, str]:
    """The daemon's settings (as conftest's ``daemon_env``, for a module-scoped daemon)."""
    return {
        "SIDECAR_SOCKET_PATH": str(work_dir / "s.sock"),
        "SIDECAR_REDIS_URL": redis_server.url,
        "SIDECAR_NAMESPACE": f"t{uuid.uuid4().hex[:12]}",
        "SIDECAR_METRICS_PORT": "0",
        "SIDECAR_METRICS_HOST": "127.0.0.1",
        "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
        "SIDECAR_CONTAINER": "checkpoints",
        "SIDECAR_LEASE_DURATION_S": "15",
        "SIDECAR_FLUSH_INTERVAL_S": "0.05",
        "SIDECAR_COUNT_THRESHOLD": "1",
    }


@pytest.fixture(scope="module")
def daemon(env: dict[str, str], work_dir: Path) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(env, work_dir / "daemon.log")
    try:
        proc.start()
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def server(daemon: DaemonProcess, env: dict[str, str], work_dir: Path) -> Iterator[ConnectServer]:
    srv = ConnectServer(work_dir / "server", env["SIDECAR_SOCKET_PATH"])
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def clients() -> Iterator[list[ConnectClient]]:
    started: list[ConnectClient] = []
    yield started
    for client in started:
        client.kill()


def daemon_metrics(daemon: DaemonProcess) -> str:
    admin = re.search(r"admin endpoint on (http://\S+)", daemon.log())
    assert admin, daemon.log()
    with urllib.request.urlopen(f"{admin.group(1)}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def daemon_connections(daemon: DaemonProcess) -> float:
    return metric_value(daemon_metrics(daemon), "checkpoint_sidecar_connections")


def assert_checkpointed(env: dict[str, str], last: dict[str, Any], checkpoint_dir: Path) -> None:
    """The query's blob holds Spark's last batch and end offsets (parsed JSON)."""
    doc = wait_blob(env, last["id"], last["batchId"], timeout_s=10)
    batch = last["batchId"]
    assert doc.batch_id == batch
    assert (doc.query_id, doc.run_id, doc.name) == (last["id"], last["runId"], last["name"])
    # The Connect client's progress holds offsets as JSON text; the daemon got JSON values.
    end = json.loads(last["sources"][0]["endOffset"])
    assert ckpt.offset_value(doc.sources[0].end_offset) == end
    # rate-micro-batch: rowsPerBatch rows and 1 s of event time per batch
    assert end == {"offset": ROWS_PER_BATCH * (batch + 1), "timestamp": 1000 * (batch + 1)}
    # ... and what Spark itself logged in the checkpoint's offsets/ log
    offsets_log = (checkpoint_dir / "offsets" / str(batch)).read_text().splitlines()
    assert json.loads(offsets_log[-1]) == end


# --- tests ----------------------------------------------------------------------------------


def test_connect_query_checkpointed_by_the_server_side_listener(
    server: ConnectServer,
    env: dict[str, str],
    work_dir: Path,
    clients: list[ConnectClient],
) -> None:
    client = ConnectClient(server.url, work_dir / "one", sessions=1, batches=4)
    clients.append(client)
    started = client.message("started")
    client.message("reached")
    (last,) = client.stop_queries()
    assert last["id"] == started["queries"][0]
    assert "this is a Spark Connect session" in started["attach_error"]
    assert "--conf spark.sql.streaming.streamingQueryListeners=" in started["attach_error"]
    assert last["batchId"] >= 4
    # The daemon flushes every update (count threshold 1): the last batch is in the blob
    # within seconds of stop() (assert_checkpointed waits at most 10 s).
    assert_checkpointed(env, last, work_dir / "one" / "ck0")


def test_two_client_sessions_one_listener_each_sharing_one_connection(
    server: ConnectServer,
    daemon: DaemonProcess,
    env: dict[str, str],
    work_dir: Path,
    clients: list[ConnectClient],
) -> None:
    client = ConnectClient(server.url, work_dir / "two", sessions=2, batches=3)
    clients.append(client)
    started = client.message("started")
    assert len(set(started["sessions"])) == 2  # two server-side sessions, two listeners
    client.message("reached")
    for query_id in started["queries"]:
        wait_blob(env, query_id, 1, timeout_s=20)  # both running, both delivered
    # The listeners of both sessions (and of any earlier one) share one Sender: one
    # connection to the daemon, one start line in the driver's log.
    assert daemon_connections(daemon) == 1
    assert server.log().count(SENDER_STARTED) == 1, server.log()
    lasts = client.stop_queries()
    assert sorted(last["id"] for last in lasts) == sorted(started["queries"])
    for i, last in enumerate(lasts):
        assert_checkpointed(env, last, work_dir / "two" / f"ck{i}")

    # A listener per session means a progress may reach the daemon more than once (a session
    # listener of another query's session, a retried send): a duplicate is a stale update,
    # answered applied:false, and moves nothing.
    updates = "checkpoint_sidecar_updates_total"
    before = metric_value(daemon_metrics(daemon), updates, result="applied")
    duplicate = Client(env["SIDECAR_SOCKET_PATH"])
    try:
        for rid, last in enumerate(lasts):
            duplicate.send(encode_request("progress", rid, progress=last))
        replies = duplicate.replies(len(lasts))
    finally:
        duplicate.close()
    assert [(r.ok, r.applied) for r in replies] == [(True, False)] * len(lasts)
    text = daemon_metrics(daemon)
    assert metric_value(text, updates, result="applied") == before
    assert metric_value(text, updates, result="stale") >= len(lasts)
    for i, last in enumerate(lasts):
        assert_checkpointed(env, last, work_dir / "two" / f"ck{i}")


# --- the client process ---------------------------------------------------------------------


def _write(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)  # the test never reads a half-written file


def main() -> None:
    """A Spark Connect client: a rate-micro-batch → noop query per session (see module doc)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--batches", type=int, default=3)
    args = parser.parse_args()
    # Never outlive the test by much, even if it died without killing this process.
    deadline = time.monotonic() + 300

    def wait_until(condition: Callable[[], bool]) -> None:
        while not condition():
            if time.monotonic() > deadline:
                raise SystemExit("client: gave up waiting")
            time.sleep(0.05)

    # Typed as the classic session by PySpark's annotations; .remote() makes Connect ones.
    sessions: list[Any] = [
        SparkSession.builder.remote(args.url).create() for _ in range(args.sessions)
    ]
    queries = [
        s.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", str(ROWS_PER_BATCH))
        .load()
        .writeStream.format("noop")
        .queryName(f"connect_{os.getpid()}_{i}")
        .trigger(processingTime="100 milliseconds")
        .option("checkpointLocation", str(args.dir / f"ck{i}"))
        .start()
        for i, s in enumerate(sessions)
    ]
    try:  # a listener added from a Connect client would run here, in the client: refused
        spark_bridge.attach(sessions[0])
        attach_error = None
    except spark_bridge.BridgeError as exc:
        attach_error = str(exc)
    _write(
        args.dir / "started.json",
        {
            "sessions": [s.session_id for s in sessions],
            "queries": [str(q.id) for q in queries],
            "attach_error": attach_error,
        },
    )

    def batch(q: Any) -> int:
        last = q.lastProgress  # one gRPC call
        return -1 if last is None else int(last.batchId)

    wait_until(lambda: all(batch(q) >= args.batches for q in queries))
    _write(args.dir / "reached.json", [batch(q) for q in queries])
    wait_until((args.dir / "stop").exists)
    lasts = []
    for q in queries:
        q.stop()
        last = q.lastProgress
        assert last is not None
        lasts.append(json.loads(last.json))
    _write(args.dir / "result.json", lasts)
    for s in sessions:
        s.stop()


if __name__ == "__main__":
    main()
