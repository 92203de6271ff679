"""Test helpers: run the daemon in-process or as a real process, read its metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from prometheus_client.parser import text_string_to_metric_families

from sidecar.app import Daemon
from sidecar.blobstore import BlobStore
from sidecar.checkpoint import CheckpointDocument
from sidecar.config import Config
from sidecar.devservices import REPO_ROOT


@asynccontextmanager
async def running_daemon(config: Config) -> AsyncIterator[Daemon]:
    """Run a daemon in this event loop; stop it gracefully on exit."""
    daemon = Daemon(config)
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.run)
        try:
            yield daemon
        finally:
            daemon.request_stop()


async def eventually(predicate: Callable[[], bool], timeout_s: float = 10) -> None:
    """Wait until ``predicate()`` is true; fail the test after ``timeout_s``."""
    with anyio.fail_after(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polls state owned by another component
            await anyio.sleep(0.01)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` with exactly ``labels`` in Prometheus text ``text``."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    raise AssertionError(f"no sample {name}{labels} in metrics")


def scrape(daemon: Daemon, path: str = "/metrics") -> tuple[int, str]:
    """GET an admin endpoint (blocking; call from a thread in async tests)."""
    url = f"http://127.0.0.1:{daemon.admin.port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


class DaemonProcess:
    """``python -m sidecar run`` as a real child process, for signal and exit-code tests."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
        self.env.update(env)
        self.env["PYTHONPATH"] = str(REPO_ROOT)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait_socket: bool = True) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sidecar", "run"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if wait_socket:
            self.wait_ready()

    def wait_ready(self, timeout_s: float = 30) -> None:
        path = self.env["SIDECAR_SOCKET_PATH"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            if "ready: namespace=" in self.log() and os.path.exists(path):
                return
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready after {timeout_s}s:\n{self.log()}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 30) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_for(predicate: Callable[[], Any], timeout_s: float = 60, what: str = "condition") -> Any:
    """Poll ``predicate`` (blocking; for sync tests) until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def read_blob(env: dict[str, str], query_id: str) -> CheckpointDocument | None:
    """A query's checkpoint document, read with the same settings as the daemon (sync)."""

    async def read() -> CheckpointDocument | None:
        store = BlobStore(Config.from_env(env))
        try:
            return await store.read(query_id)
        finally:
            await store.aclose()

    return anyio.run(read)


def wait_blob(
    env: dict[str, str], query_id: str, batch: int, timeout_s: float = 40
) -> CheckpointDocument:
    """Wait until the query's blob holds ``batch`` or newer (sync)."""

    def reached() -> CheckpointDocument | None:
        doc = read_blob(env, query_id)
        return doc if doc is not None and doc.batch_id >= batch else None

    return wait_for(reached, timeout_s, f"the blob to hold batch {batch}")  # type: ignore[no-any-return]
