"""Fixtures: real services on free ports in temp dirs, started here and stopped afterwards.

Nothing relies on a service left running by hand; binaries come from ``make setup``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from sidecar.config import Config
from tests.services import TEST_JVM_OPTIONS, Azurite, DaemonProcess, KafkaBroker, RedisServer

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


LOG_TAIL_LINES = 40

# Every PySpark driver the tests start (the session's, and the drivers run as processes,
# which inherit it) launches its JVM with the tests' options, unless the caller chose its own.
if TEST_JVM_OPTIONS:
    os.environ.setdefault(
        "PYSPARK_SUBMIT_ARGS", f"--driver-java-options '{' '.join(TEST_JVM_OPTIONS)}' pyspark-shell"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report ends with the tail of each log in its ``short_tmp`` (the
    daemons', the JVM sender's): a failure in CI says what the processes saw, not only
    what the test asserted."""
    report = yield
    tmp = getattr(item, "funcargs", {}).get("short_tmp")
    if report.failed and call.when == "call" and isinstance(tmp, Path):
        for log in sorted(tmp.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            text = "\n".join(line[:300] for line in lines)
            report.sections.append((f"{log.name} (last {LOG_TAIL_LINES} lines)", text))
    return report


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session; tests isolate themselves by namespace."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, for tests that stop and restart it."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def broker() -> Iterator[KafkaBroker]:
    """A Kafka-protocol broker (Tansu) of this test's own."""
    with KafkaBroker() as server:
        yield server


@pytest.fixture(scope="session")
def azurite() -> Iterator[Azurite]:
    with Azurite() as server:
        yield server


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir: Unix socket paths must stay under ~100 bytes."""
    path = Path(tempfile.mkdtemp(prefix="cps-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_config(
    redis_server: RedisServer, azurite: Azurite, namespace: str, short_tmp: Path
) -> Callable[..., Config]:
    """Build a daemon Config for this test; keyword args override SIDECAR_* settings."""

    def make(**overrides: Any) -> Config:
        # Each config is its own daemon (its own pod): two daemons on one namespace are two
        # instances. The same Config run again is the same instance (a restart in its pod).
        env = {
            "SIDECAR_INSTANCE_ID": f"test-{uuid.uuid4().hex[:12]}",
            "SIDECAR_SOCKET_PATH": str(short_tmp / "sidecar.sock"),
            "SIDECAR_REDIS_URL": redis_server.url,
            "SIDECAR_NAMESPACE": namespace,
            "SIDECAR_METRICS_PORT": "0",
            "SIDECAR_METRICS_HOST": "127.0.0.1",
            "SIDECAR_SHUTDOWN_GRACE_S": "5",
            "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
            "SIDECAR_CONTAINER": "checkpoints",
            "SIDECAR_LEASE_DURATION_S": "15",
            "SIDECAR_FLUSH_INTERVAL_S": "0.05",
        }
        env_names = {f.name: f.metadata["env"] for f in Config.settings()}
        env.update({env_names[k]: str(v) for k, v in overrides.items()})
        return Config.from_env(env)

    return make


@pytest.fixture
def daemon_env(
    redis_server: RedisServer, azurite: Azurite, namespace: str, short_tmp: Path
) -> dict[str, str]:
    """Settings for the daemon as a real process (``tests.services.DaemonProcess``, which
    also picks its admin port)."""
    return {
        "SIDECAR_SOCKET_PATH": str(short_tmp / "s.sock"),
        "SIDECAR_REDIS_URL": redis_server.url,
        "SIDECAR_NAMESPACE": namespace,
        "SIDECAR_METRICS_HOST": "127.0.0.1",
        "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
        "SIDECAR_CONTAINER": "checkpoints",
        "SIDECAR_LEASE_DURATION_S": "15",
        "SIDECAR_FLUSH_INTERVAL_S": "0.05",
    }


@pytest.fixture
def procs() -> Iterator[list[DaemonProcess]]:
    """Daemon processes started by a test; killed at teardown if still running."""
    started: list[DaemonProcess] = []
    yield started
    for proc in started:
        proc.kill()


@pytest.fixture(autouse=True)
def no_blocking_calls(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail an async test whose event loop makes a blocking call (sleep, file or socket I/O).

    The daemon runs on that loop in-process, so this checks the daemon's code too.
    """
    if request.node.get_closest_marker("allow_blocking") or not _is_async(request):
        yield
        return
    from blockbuster import blockbuster_ctx

    with blockbuster_ctx(scanned_modules=["sidecar", "spark_bridge"]) as bb:
        # Constructing an Azure SDK client reads platform files once (user agent); it
        # happens at start-up, not per request.
        # redis-py reads its own version from package metadata on each new connection;
        # anyio stats the path while binding a Unix socket (once, at start-up).
        for name in (
            "os.read",
            "io.BufferedReader.read",
            "io.TextIOWrapper.read",
            "os.stat",
            "os.listdir",
            "os.scandir",
        ):
            if name in bb.functions:
                bb.functions[name].can_block_in(
                    "platform.py", {"platform", "libc_ver", "freedesktop_os_release"}
                )
                bb.functions[name].can_block_in(
                    "anyio/_core/_sockets.py", {"setup_unix_local_socket"}
                )
                bb.functions[name].can_block_in(
                    "importlib/metadata/__init__.py",
                    {
                        "mtime",
                        "search",
                        "read_text",
                        "lookup",
                        "__init__",
                        "children",
                        "zip_children",
                    },
                )
        yield


def _is_async(request: pytest.FixtureRequest) -> bool:
    import inspect

    return inspect.iscoroutinefunction(getattr(request.node, "obj", None))


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One local PySpark session for every Spark test of the run (PySpark 4 or 3.5)."""
    from pyspark.sql import SparkSession  # only runs that use Spark pay for importing it

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2]")
        .appName("checkpoint-sidecar-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        # The state stores' maintenance (snapshots, RocksDB uploads, old files deleted) runs on
        # a timer started with the first stateful query's setting, once per JVM: short, so
        # the snapshot tests see Spark's own snapshots and deletions (tests/integration/
        # test_snapshot_restore.py) whichever stateful test runs first.
        .config("spark.sql.streaming.stateStore.maintenanceInterval", "500ms")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def harness_classpath(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The JVM listener's sender without Spark (``tests.jvmharness``), compiled once."""
    from tests.jvmharness import compile_harness

    return compile_harness(tmp_path_factory.mktemp("harness"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group the tests that must not run beside each other under pytest-xdist (--dist loadgroup).

    The Spark tests share one JVM (the session's ``spark`` fixture, and Spark's state-store
    maintenance timer is per JVM); the container tests share podman's image store and names.
    Everything else is spread over the workers. Without xdist the marks do nothing.
    """
    for item in items:
        if item.get_closest_marker("container") is not None:
            item.add_marker(pytest.mark.xdist_group("container"))
        elif item.get_closest_marker("spark") is not None or "spark" in getattr(
            item, "fixturenames", ()
        ):
            item.add_marker(pytest.mark.xdist_group("spark"))
