"""The Spark side installs without the daemon's dependencies: a fresh virtualenv holding only
the base install (what a Spark driver gets) imports ``spark_bridge``, finds the listener jar,
and runs ``checkpoint-sidecar listener-jar``; ``run`` says which extra to install."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.services import REPO_ROOT as REPO


def test_the_base_install_is_what_the_bridge_needs() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert [d.split(">")[0] for d in project["dependencies"]] == ["msgspec"]
    daemon = {d.split(">")[0].split("[")[0] for d in project["optional-dependencies"]["daemon"]}
    assert {"anyio", "redis", "azure-storage-blob", "aiokafka", "aiohttp"} <= daemon


@pytest.fixture(scope="module")
def bridge_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv holding only the base dependencies (what a Spark driver installs)."""
    venv = tmp_path_factory.mktemp("bridge-only") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *deps],
        check=True,
    )
    return python


def run_in(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIDECAR_", "PYTHON"))}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [str(python), *args], env=env, cwd="/", capture_output=True, text=True, timeout=60
    )


DAEMON_ONLY = ("anyio", "redis", "azure", "aiokafka", "aiohttp", "prometheus_client")


def test_the_bridge_imports_and_finds_its_jar_without_the_daemons_dependencies(
    bridge_python: Path,
) -> None:
    probe = (
        "import importlib.util, sys\n"
        f"absent = [m for m in {DAEMON_ONLY!r} if importlib.util.find_spec(m) is None]\n"
        "import spark_bridge, spark_bridge.jvm, spark_bridge.sender, spark_bridge.handle\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & set("
        f"{DAEMON_ONLY!r}))\n"
        "print(len(absent), loaded, spark_bridge.listener_jar())\n"
    )
    result = run_in(bridge_python, "-c", probe)
    assert result.returncode == 0, result.stderr
    absent, loaded, jar = result.stdout.split(" ", 2)
    assert int(absent) == len(DAEMON_ONLY)  # the environment really lacks them
    assert loaded == "[]"
    assert Path(jar.strip()).is_file()


def test_the_cli_serves_a_driver_without_the_daemon_extra(bridge_python: Path) -> None:
    jar = run_in(bridge_python, "-m", "sidecar", "listener-jar")
    assert jar.returncode == 0, jar.stderr
    assert jar.stdout.strip().endswith("checkpoint-sidecar-listener.jar")
    run = run_in(bridge_python, "-m", "sidecar", "run")
    assert run.returncode == 2
    assert "pip install 'checkpoint-sidecar[daemon]'" in run.stderr
