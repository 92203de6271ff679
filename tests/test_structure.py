"""The shape of the code, checked: the import layers of ``sidecar`` follow the data flow, the
SDKs stay at their edges, and the Spark side installs without the daemon's dependencies.

See docs/architecture.md for the picture these rules describe.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Lowest first. A module may import sidecar modules of lower layers only (the same layer
#: neither: modules of one layer are peers that know nothing of each other).
LAYERS: list[set[str]] = [
    # vocabulary, byte framing, JSON kept as text: pure
    {"errors", "keys", "backoff", "confighelp", "framing", "rawjson"},
    {"config", "checkpoint", "lua"},  # settings, records, Redis scripts: pure
    {"document"},  # the blob document (checkpoint, writer, history, reset): pure
    # wire format, offset shapes, doctor's rules, Redis rows read: pure
    {"protocol", "offsets", "diagnosis", "records"},
    {"sparklog"},  # Spark's own checkpoint directory, read: pure
    # metrics; which Redis client (standalone, cluster, sentinel); the Kafka client edge
    {"metrics", "topology", "kafkaclient"},
    # the I/O edges (Redis, Azure), the test client; one client connection on the loop
    {"buffer", "blobstore", "client", "connection"},
    # batches updates for the Redis edge; the blobs' batches; unreadable records set aside;
    # acks waiting for the blobs
    {"coalescer", "floor", "quarantine", "querylocks", "docbuilder", "acks"},
    # the components: each one job, wired together by app
    {"lease", "lag", "kafka", "handler", "server", "admin", "report", "durability"}
    | {"retirement", "shutdown", "doctor", "adoption"},
    {"flusher"},
    {"adminops"},  # reset and retire: as the lease owner (tells the flusher, floor, retirement)
    {"app", "offline"},  # wiring; reset and retire through the daemon or under a lease of its own
    {"commands"},
    {"cli"},
    {"__main__"},
]
PURE = {
    "errors",
    "keys",
    "backoff",
    "confighelp",
    "framing",
    "rawjson",
    "config",
    "checkpoint",
    "document",
    "lua",
    "protocol",
    "offsets",
    "diagnosis",
    "records",
    "sparklog",
}
#: Third-party SDKs and where they may be imported: each edge owns its SDK.
SDK_OWNERS = {
    "redis": {"buffer", "topology"},
    "azure": {"blobstore"},
    "aiokafka": {"kafka", "kafkaclient"},
    "aiohttp": {"admin"},
    "uvloop": {"commands"},  # chosen once, at the start (SIDECAR_EVENT_LOOP)
}
IO_LIBRARIES = {"anyio", "asyncio", "socket", "redis", "azure", "aiokafka", "aiohttp"}


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "sidecar":  # from sidecar import checkpoint as ckpt
                found.update(f"sidecar.{alias.name}" for alias in node.names)
    return found


def sidecar_modules() -> dict[str, set[str]]:
    return {
        path.stem: imports_of(path)
        for path in sorted((REPO / "sidecar").glob("*.py"))
        if path.stem != "__init__"
    }


def test_every_sidecar_module_has_a_layer() -> None:
    placed = set().union(*LAYERS)
    assert set(sidecar_modules()) == placed


def test_sidecar_modules_import_only_lower_layers() -> None:
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    wrong = []
    for name, imported in sidecar_modules().items():
        for module in imported:
            parts = module.split(".")
            inner = parts[1] if parts[0] == "sidecar" and len(parts) > 1 else None
            if inner in layer and layer[inner] >= layer[name]:
                wrong.append(f"{name} (layer {layer[name]}) imports {inner}")
    assert wrong == []


def test_the_server_knows_nothing_beyond_the_protocol() -> None:
    imported = {m.split(".")[1] for m in sidecar_modules()["server"] if m.startswith("sidecar.")}
    assert imported <= {"config", "connection", "errors", "metrics", "protocol"}


def test_pure_modules_do_no_io_and_each_sdk_stays_at_its_edge() -> None:
    wrong = []
    for name, imported in sidecar_modules().items():
        roots = {m.split(".")[0] for m in imported}
        if name in PURE and roots & IO_LIBRARIES:
            wrong.append(f"pure {name} imports {sorted(roots & IO_LIBRARIES)}")
        for sdk, owners in SDK_OWNERS.items():
            if sdk in roots and name not in owners:
                wrong.append(f"{name} imports {sdk} (owned by {sorted(owners)})")
    assert wrong == []


def test_no_product_module_is_a_test_service_or_larger_than_400_lines() -> None:
    for package in ("sidecar", "spark_bridge"):
        for path in (REPO / package).glob("*.py"):
            lines = len(path.read_text().splitlines())
            assert lines <= 400, f"{path.relative_to(REPO)} has {lines} lines"
    assert not (REPO / "sidecar" / "devservices.py").exists()


# --- the Spark side without the daemon's dependencies -----------------------------------------


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
