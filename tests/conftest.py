"""Fixtures: real services on free ports in temp dirs, started here and stopped afterwards.

Nothing relies on a service left running by hand; binaries come from ``make setup``.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.config import Config
from sidecar.devservices import Azurite, RedisServer
from tests.helpers import DaemonProcess


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
        env = {
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
    """Environment for running the daemon as a real process (tests.helpers.DaemonProcess)."""
    return {
        "SIDECAR_SOCKET_PATH": str(short_tmp / "s.sock"),
        "SIDECAR_REDIS_URL": redis_server.url,
        "SIDECAR_NAMESPACE": namespace,
        "SIDECAR_METRICS_PORT": "0",
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
