"""Test helpers: run the daemon in-process, read its metrics, wait for conditions.

The daemon as a real process: ``tests.services.DaemonProcess``.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import anyio
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from sidecar.buffer.redis_buffer import Outcome, RedisBuffer
from sidecar.config import Config
from sidecar.daemon.app import Daemon
from sidecar.flush.blob_state import BlobStates
from sidecar.flush.lease_manager import LeaseManager
from sidecar.model import checkpoint as ckpt
from sidecar.model.document import CheckpointDocument
from sidecar.store.blobs import BlobStore
from sidecar.telemetry.metrics import Metrics
from sidecar.wire.protocol import ClientConnection, Reply, encode_request
from tests.services import REPO_ROOT
from tests.sparkshapes import kafka_progress

#: The ``make_config`` fixture (tests/conftest.py): a daemon Config for this test; keyword
#: arguments override SIDECAR_* settings.
ConfigFactory = Callable[..., Config]


@asynccontextmanager
async def running_daemon(config: Config, **options: Any) -> AsyncIterator[Daemon]:
    """Run a daemon in this event loop; stop it gracefully on exit. ``options``: the
    Daemon's keyword arguments (``lease_clock``, ``registry``)."""
    daemon = Daemon(config, **options)
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.run)
        try:
            yield daemon
        finally:
            daemon.request_stop()


def lease_manager(
    store: Any,
    lease_id: str,
    *,
    duration_s: int = 15,
    metrics: Metrics | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> LeaseManager:
    """A lease manager of its own (with the query records it keeps leases on), as a daemon
    with ``lease_id`` has."""
    return BlobStates(store, lease_id, duration_s, metrics or Metrics(), clock=clock).leases


class Clock:
    """A monotonic clock a test moves by hand (``clock.now += 5``): lease deadlines, backoffs
    and listings' ages without waiting for them. Starts at ``now`` (default: the real
    monotonic time)."""

    def __init__(self, now: float | None = None) -> None:
        self.now = time.monotonic() if now is None else now

    def __call__(self) -> float:
        return self.now


async def eventually(predicate: Callable[[], bool], timeout_s: float = 30) -> None:
    """Wait until ``predicate()`` is true; fail the test after ``timeout_s``: a bound, not a
    timing target (what takes 50 ms on a quiet machine has taken seconds in a loaded CI run;
    the benchmarks time things)."""
    with anyio.fail_after(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polls state owned by another component
            await anyio.sleep(0.01)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` with exactly ``labels`` in Prometheus text ``text``."""
    for family in text_string_to_metric_families(text):
        for item in family.samples:
            if item.name == name and item.labels == labels:
                return float(item.value)
    raise AssertionError(f"no sample {name}{labels} in metrics")


def sample(daemon: Daemon, name: str, **labels: str) -> float:
    """The current value of sample ``name`` with exactly ``labels`` in the daemon's registry.

    Read through prometheus-client's public ``CollectorRegistry.get_sample_value``. NaN while
    the series does not exist (yet), so a comparison in :func:`eventually` stays false until
    it appears.
    """
    value = daemon.metrics.registry.get_sample_value(name, labels)
    return math.nan if value is None else value


def scrape(daemon: Daemon, path: str = "/metrics") -> tuple[int, str]:
    """GET an admin endpoint (blocking; call from a thread in async tests)."""
    answer = http_get(f"http://127.0.0.1:{daemon.admin.port}{path}", timeout_s=5)
    if answer is None:
        raise AssertionError(f"nothing answers on the admin endpoint ({path})")
    return answer


def http_get(url: str, timeout_s: float = 2) -> tuple[int, str] | None:
    """GET ``url``: (status, body), an error status included; None while nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError:
        return None


T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T | None], timeout_s: float = 60, what: str = "condition"
) -> T:
    """Poll ``predicate`` (blocking; for sync tests) until it returns something truthy; that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m sidecar ARGS`` of this checkout with only the settings ``env`` (and a PATH);
    180 s at most (a restore of a large snapshot on a loaded machine)."""
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        env={"PATH": "/usr/bin:/bin", **env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=180,
    )


def cli_env(config: Config) -> dict[str, str]:
    """The CLI's settings for the daemon ``config`` describes (its socket, Redis, blobs)."""
    return {
        "SIDECAR_SOCKET_PATH": config.socket_path,
        "SIDECAR_REDIS_URL": config.redis_url,
        "SIDECAR_NAMESPACE": config.namespace,
        "AZURE_STORAGE_CONNECTION_STRING": config.azure_connection_string or "",
        "SIDECAR_CONTAINER": config.container,
        "SIDECAR_LEASE_DURATION_S": "15",
    }


async def acli(config: Config, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI with ``cli_env(config)`` from an async test (the daemon keeps running in this
    loop meanwhile)."""
    return await anyio.to_thread.run_sync(lambda: cli(cli_env(config), *args))


def read_blob(env: dict[str, str], query_id: str) -> CheckpointDocument | None:
    """A query's checkpoint document, read with the same settings as the daemon (sync)."""

    async def read() -> CheckpointDocument | None:
        store = BlobStore(Config.from_env(env))
        try:
            return await store.read(query_id)
        finally:
            await store.aclose()

    return anyio.run(read)


def post_progress(socket_path: str, progress: dict[str, Any], timeout_s: float = 30) -> Reply:
    """One ``progress`` request on a connection of its own (blocking); its reply."""
    conn = ClientConnection()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout_s)
        sock.connect(socket_path)
        sock.sendall(encode_request("progress", 1, progress=progress))
        while True:
            data = sock.recv(1 << 16)
            assert data, "the daemon closed the connection without a reply"
            if replies := conn.receive_data(data):
                return replies[0]


def lease_state(env: dict[str, str], query_id: str) -> str:
    """The lease state the store reports for the query's blob (sync)."""

    async def read() -> str:
        store = BlobStore(Config.from_env(env))
        try:
            return await store.lease_state(query_id)
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

    return wait_for(reached, timeout_s, f"the blob to hold batch {batch}")


def checkpoint_from(progress: dict[str, Any]) -> ckpt.Checkpoint:
    """The checkpoint the daemon stores for the Spark progress ``progress``, read as from the
    wire (offsets kept as their compact JSON text)."""
    wire = msgspec.json.decode(msgspec.json.encode(progress), type=ckpt.SparkProgress)
    return ckpt.from_progress(wire)


def checkpoint_of(query_id: str, batch: int, name: str | None = "orders") -> ckpt.Checkpoint:
    """The checkpoint the daemon stores for ``kafka_progress(query_id, batch)``."""
    return checkpoint_from(kafka_progress(query_id, batch, name=name))


async def seed(
    redis_url: str, namespace: str, query_id: str, batch: int, name: str | None = "orders"
) -> str:
    """Store a valid record of ``query_id`` at ``batch`` straight into Redis, pending and
    without the daemon's floor (as a stopped daemon, or a restored or foreign buffer, leaves
    it); its key."""
    buffer = RedisBuffer(redis_url, namespace)
    try:
        assert await buffer.apply([checkpoint_of(query_id, batch, name)]) == [Outcome.APPLIED]
    finally:
        await buffer.aclose()
    return buffer.keys.query(query_id)


@asynccontextmanager
async def blob_reader(config: Config) -> AsyncIterator[BlobStore]:
    """A blob store client with the daemon's settings, for reading what it wrote."""
    store = BlobStore(config)
    try:
        yield store
    finally:
        await store.aclose()


async def wait_blob_batch(
    store: BlobStore, query_id: str, batch: int, timeout_s: float = 20
) -> CheckpointDocument:
    """Wait until the query's blob holds ``batch`` or newer; its document."""
    with anyio.fail_after(timeout_s):
        while True:
            doc = await store.read(query_id)
            if doc is not None and doc.batch_id >= batch:
                return doc
            await anyio.sleep(0.02)


def as_json(offset: Any) -> Any:
    """An offset from ``StreamingQuery.lastProgress`` as a JSON value.

    PySpark 4 hands back each source's offsets as JSON text, PySpark 3.x as parsed values;
    the listener always posts Spark's own JSON, so the daemon stores parsed values.
    """
    return json.loads(offset) if isinstance(offset, str) else offset


@contextmanager
def spark_conf(spark: Any, conf: Mapping[str, str]) -> Iterator[None]:
    """SQL settings of a SparkSession for the queries started inside; each put back after as
    it was (unset only if it was: an unset falls back to Spark's default, not the session's
    builder value, e.g. 200 shuffle partitions for the next test's queries)."""
    before = {key: spark.conf.get(key, None) for key in conf}
    for key, value in conf.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
