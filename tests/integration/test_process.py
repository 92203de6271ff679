"""The daemon as a real process: signals, exit codes, the socket file, start-up errors."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.config import Config
from tests.services import REPO_ROOT, DaemonProcess, ServiceError


@pytest.fixture
def spawn(procs: list[DaemonProcess]) -> list[DaemonProcess]:
    return procs


def start(
    spawn: list[DaemonProcess], env: dict[str, str], tmp: Path, *, wait: bool = True
) -> DaemonProcess:
    proc = DaemonProcess(env, tmp / f"daemon{len(spawn)}.log")
    spawn.append(proc)
    proc.start(wait=wait)
    return proc


def ping(path: str) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(b'{"op":"ping","id":1}\n')
        return s.recv(1024)


def test_sigterm_stops_cleanly_with_exit_0(
    daemon_env: dict[str, str], spawn: list[DaemonProcess], short_tmp: Path
) -> None:
    proc = start(spawn, daemon_env, short_tmp)
    path = daemon_env["SIDECAR_SOCKET_PATH"]
    with socket.socket(socket.AF_UNIX) as idle:
        idle.connect(path)
        assert ping(path) == b'{"id":1,"ok":true}\n'
        proc.signal(signal.SIGTERM)
        assert proc.wait() == 0
        assert idle.recv(10) == b""  # the idle connection was closed, not left hanging
    assert not os.path.exists(path), "the socket file is removed on a clean stop"
    assert "received SIGTERM: stopping gracefully" in proc.log()
    assert "stopped" in proc.log()


def test_sigint_also_stops_with_exit_0(
    daemon_env: dict[str, str], spawn: list[DaemonProcess], short_tmp: Path
) -> None:
    proc = start(spawn, daemon_env, short_tmp)
    proc.signal(signal.SIGINT)
    assert proc.wait() == 0


def test_socket_file_is_private_by_default(
    daemon_env: dict[str, str], spawn: list[DaemonProcess], short_tmp: Path
) -> None:
    start(spawn, daemon_env, short_tmp)
    mode = os.stat(daemon_env["SIDECAR_SOCKET_PATH"]).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600


def test_socket_mode_is_configurable(
    daemon_env: dict[str, str], spawn: list[DaemonProcess], short_tmp: Path
) -> None:
    start(spawn, {**daemon_env, "SIDECAR_SOCKET_MODE": "660"}, short_tmp)
    assert stat.S_IMODE(os.stat(daemon_env["SIDECAR_SOCKET_PATH"]).st_mode) == 0o660


def test_stale_socket_file_is_replaced(
    daemon_env: dict[str, str], spawn: list[DaemonProcess], short_tmp: Path
) -> None:
    path = daemon_env["SIDECAR_SOCKET_PATH"]
    crashed = socket.socket(socket.AF_UNIX)
    crashed.bind(path)  # a socket file nobody listens on, as a kill -9 leaves behind
    crashed.close()
    assert os.path.exists(path)
    proc = start(spawn, daemon_env, short_tmp)
    assert ping(path) == b'{"id":1,"ok":true}\n'
    assert "replacing stale socket file" in proc.log()


def test_live_socket_is_not_stolen(
    daemon_env: dict[str, str], spawn: list[DaemonProcess], short_tmp: Path
) -> None:
    first = start(spawn, daemon_env, short_tmp)
    second = start(spawn, daemon_env, short_tmp, wait=False)
    assert second.wait() == 1
    # Refused at its first step: the live daemon holds the lease file beside the socket.
    assert f"another live daemon (pid {first.pid} " in second.log()
    assert "give each its own SIDECAR_SOCKET_PATH" in second.log()
    # With a state directory of its own, the socket itself is refused (not stolen).
    third = start(
        spawn, daemon_env | {"SIDECAR_STATE_DIR": str(short_tmp / "other")}, short_tmp, wait=False
    )
    assert third.wait() == 1
    assert "another process is serving" in third.log()
    assert first.running
    assert ping(daemon_env["SIDECAR_SOCKET_PATH"]) == b'{"id":1,"ok":true}\n'


def test_non_socket_file_is_never_deleted(
    daemon_env: dict[str, str], spawn: list[DaemonProcess], short_tmp: Path
) -> None:
    path = Path(daemon_env["SIDECAR_SOCKET_PATH"])
    path.write_text("precious")
    # Waiting for readiness stops at the exit, quoting the daemon's log (no 60 s timeout).
    with pytest.raises(ServiceError, match=r"exited with code 1 before it was ready") as failed:
        start(spawn, daemon_env, short_tmp)
    assert "is not a socket" in str(failed.value)
    assert path.read_text() == "precious"


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        env={**base, **(env or {}), "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_invalid_configuration_exits_2_naming_the_setting() -> None:
    result = run_cli("run", env={"SIDECAR_METRICS_PORT": "nine", "SIDECAR_REDIS_ULR": "x"})
    assert result.returncode == 2
    assert "SIDECAR_METRICS_PORT='nine'" in result.stderr
    assert "did you mean SIDECAR_REDIS_URL" in result.stderr


def test_help_lists_every_environment_variable() -> None:
    result = run_cli("run", "--help")
    assert result.returncode == 0
    names = [f.metadata["env"] for f in Config.settings()]
    assert {"SIDECAR_SOCKET_PATH", "AZURE_STORAGE_CONNECTION_STRING"} <= set(names)
    assert [name for name in names if name not in result.stdout] == []


def test_config_command_redacts_the_redis_password() -> None:
    result = run_cli("config", env={"SIDECAR_REDIS_URL": "redis://:hunter2@db:6379/0"})
    assert result.returncode == 0
    assert "hunter2" not in result.stdout + result.stderr
    assert "SIDECAR_REDIS_URL=redis://:***@db:6379/0" in result.stdout


@pytest.mark.parametrize(
    "command", [["run"], ["list"], ["show", "q"], ["history", "q"], ["starting-offsets", "q"]]
)
def test_commands_that_use_the_blobs_exit_2_without_a_blob_store(
    command: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A configuration without one is valid (`config` shows it); using the blobs needs one.
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    result = run_cli(*command, env={"SIDECAR_NAMESPACE": "ns"})
    assert result.returncode == 2, result.stderr
    assert "no blob store configured: set AZURE_STORAGE_CONNECTION_STRING" in result.stderr
