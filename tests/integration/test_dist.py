"""``make dist``: the sdists and the wheels, each carrying the listener jar, installed as a
user would install them.

scripts/build_dist.sh (what ``make dist`` runs) builds them into a temp dir; ``twine check``
passes; the daemon's wheel, in a fresh venv holding nothing else but msgspec, imports
``spark_bridge`` and runs ``checkpoint-sidecar --version`` and ``listener-jar``; the Spark
side's own distribution (``checkpoint-sidecar-bridge``) installs alone and serves a driver
against a real daemon without any of the daemon's dependencies; the sdist builds a wheel with
no JDK on PATH. A source tree without the jar (a git checkout, ``pip install git+…``) builds it
with javac and the installed pyspark, and without javac fails saying what to install: never a
jar-less package.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.services import REPO_ROOT, DaemonProcess
from tests.sparkshapes import kafka_progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JAR = "spark_bridge/jars/checkpoint-sidecar-listener.jar"
LISTENER_CLASS = "io/checkpointsidecar/SidecarStreamingListener.class"
VERSION = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
#: The words of setup.py's refusal that tell the user what to do.
REFUSAL = (
    f"the Spark listener jar {JAR} is not in this source tree",
    "no JDK: 'javac' / 'jar' not found on PATH",
    "apt-get install openjdk-17-jdk-headless",
    "bash scripts/build_jar.sh",
)


def run(
    *args: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command (no shell), its output captured; never raises on a non-zero exit."""
    return subprocess.run(
        [str(a) for a in args],
        env=env,
        cwd=cwd or "/",
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without anything that would point a Python at the repository."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return {**env, **extra}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel, built by ``make dist``'s script into a temp dir."""
    out = tmp_path_factory.mktemp("dist")
    result = run(
        "bash", "scripts/build_dist.sh",
        cwd=REPO_ROOT, env={**os.environ, "DIST_DIR": str(out), "PYTHON": sys.executable},
    )  # fmt: skip
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(dist: Path) -> Path:
    return dist / f"checkpoint_sidecar-{VERSION}-py3-none-any.whl"


@pytest.fixture(scope="module")
def sdist(dist: Path) -> Path:
    return dist / f"checkpoint_sidecar-{VERSION}.tar.gz"


@pytest.fixture(scope="module")
def driver_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A fresh venv with the wheel (no dependencies resolved) and msgspec: nothing else."""
    venv = tmp_path_factory.mktemp("driver") / "venv"
    assert run(sys.executable, "-m", "venv", venv).returncode == 0
    pip = run(
        venv / "bin/python", "-m", "pip", "install", "-q", "--disable-pip-version-check",
        "--no-deps", wheel, "msgspec", env=clean_env(),
    )  # fmt: skip
    assert pip.returncode == 0, pip.stderr
    return venv


@pytest.fixture
def no_jdk_path(tmp_path: Path) -> str:
    """A PATH without javac (nor anything else): the build must not need a tool from it."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    return str(empty)


@pytest.fixture
def source_tree(tmp_path: Path) -> Path:
    """The tree a git checkout gives: sources, packaging files and build script, no jar."""
    tree = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "jars", "*.egg-info")
    for name in ("pyproject.toml", "setup.py", "README.md", "scripts/build_jar.sh"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, tree / name)
    for package in ("sidecar", "spark_bridge"):
        shutil.copytree(REPO_ROOT / package, tree / package, ignore=ignore)
    assert not (tree / JAR).exists()
    return tree


def pip_wheel(tree: Path | str, out: Path, path: str) -> subprocess.CompletedProcess[str]:
    """``pip wheel`` as ``pip install`` builds (isolated build env) with PATH as given."""
    return run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
        "--wheel-dir", out, tree, env=clean_env(PATH=path),
    )  # fmt: skip


def test_the_sdist_and_the_wheel_carry_the_jar_and_pass_twine_check(
    wheel: Path, sdist: Path
) -> None:
    built_jar = (REPO_ROOT / JAR).read_bytes()
    with zipfile.ZipFile(wheel) as whl:
        assert whl.read(JAR) == built_jar
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        member = tar.extractfile(f"checkpoint_sidecar-{VERSION}/{JAR}")
        assert member is not None and member.read() == built_jar
    with zipfile.ZipFile(REPO_ROOT / JAR) as jar:
        assert LISTENER_CLASS in jar.namelist()
    # The sdist is the clean tree: packaging files and the packages, nothing local.
    top = {n.split("/")[1] for n in names if n.count("/") >= 1}
    assert {"setup.py", "pyproject.toml", "README.md", "sidecar", "spark_bridge"} <= top
    assert not [n for n in names if "__pycache__" in n or "/tests/" in n or "/.venv" in n]

    check = run(sys.executable, "-m", "twine", "check", "--strict", wheel, sdist)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count("PASSED") == 2


def test_the_wheel_serves_a_spark_driver_with_only_msgspec(driver_venv: Path) -> None:
    python = driver_venv / "bin/python"
    installed = run(python, "-m", "pip", "list", "--format=freeze", env=clean_env())
    names = {line.split("==")[0].lower() for line in installed.stdout.splitlines()}
    assert names - {"pip", "setuptools"} == {"checkpoint-sidecar", "msgspec"}

    cli = driver_venv / "bin/checkpoint-sidecar"
    version = run(cli, "--version", env=clean_env())
    assert (version.returncode, version.stdout.strip()) == (0, f"checkpoint-sidecar {VERSION}")
    located = run(cli, "listener-jar", env=clean_env())
    assert located.returncode == 0, located.stderr
    jar = Path(located.stdout.strip())
    site_packages = driver_venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert jar.is_relative_to(site_packages / "site-packages")
    with zipfile.ZipFile(jar) as listener:
        assert LISTENER_CLASS in listener.namelist()

    code = "import spark_bridge; print(spark_bridge.__file__, spark_bridge.listener_jar())"
    probe = run(python, "-c", code, env=clean_env())
    assert probe.returncode == 0, probe.stderr
    module, found = probe.stdout.split()
    assert Path(module).is_relative_to(driver_venv) and Path(found) == jar


def test_the_sdist_builds_its_wheel_without_a_jdk(
    sdist: Path, tmp_path: Path, no_jdk_path: str
) -> None:
    result = pip_wheel(sdist, tmp_path / "out", no_jdk_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    (built,) = (tmp_path / "out").glob("*.whl")
    with zipfile.ZipFile(built) as whl:
        assert JAR in whl.namelist()


def test_a_source_tree_without_the_jar_or_a_jdk_fails_saying_what_to_do(
    source_tree: Path, tmp_path: Path, no_jdk_path: str
) -> None:
    result = pip_wheel(source_tree, tmp_path / "out", no_jdk_path)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    for words in REFUSAL:
        assert words in output, output[-3000:]
    assert not list(tmp_path.glob("out/*.whl"))


def test_a_source_tree_without_the_jar_builds_it_with_javac_and_pyspark(
    source_tree: Path, tmp_path: Path
) -> None:
    """pip's isolated build still finds the pyspark of the Python running pip (.venv's)."""
    result = pip_wheel(source_tree, tmp_path / "out", os.environ["PATH"])
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    (built,) = (tmp_path / "out").glob("*.whl")
    with zipfile.ZipFile(built) as whl, zipfile.ZipFile(whl.open(JAR)) as jar:
        assert LISTENER_CLASS in jar.namelist()


# --- the Spark side's own distribution (spark_bridge/pyproject.toml) ----------------------

BRIDGE_DRIVER = """
import importlib.util, json, sys
import spark_bridge
from spark_bridge.sender import Sender

socket_path, query_id, progress = sys.argv[1], sys.argv[2], sys.argv[3].encode()
sender = Sender(socket_path, timeout_s=10)
sender.offer(query_id, progress)
delivered = sender.close(15)
print(json.dumps({
    "delivered": delivered,
    "offsets": spark_bridge.starting_offsets(query_id, socket_path),
    "jar": spark_bridge.listener_jar(),
    "daemon_importable": [m for m in ("sidecar", "msgspec", "anyio")
                          if importlib.util.find_spec(m) is not None],
    "loaded": sorted({m.split(".")[0] for m in sys.modules} & {"sidecar", "msgspec"}),
}))
"""


@pytest.fixture(scope="module")
def bridge_venv(tmp_path_factory: pytest.TempPathFactory, dist: Path) -> Path:
    """A fresh venv with the bridge's wheel, installed as a driver would (its dependencies
    resolved: there are none; no index, so nothing else could come)."""
    wheel = dist / f"checkpoint_sidecar_bridge-{VERSION}-py3-none-any.whl"
    venv = tmp_path_factory.mktemp("bridge") / "venv"
    assert run(sys.executable, "-m", "venv", venv).returncode == 0
    pip = run(
        venv / "bin/python", "-m", "pip", "install", "-q", "--disable-pip-version-check",
        "--no-index", wheel, env=clean_env(),
    )  # fmt: skip
    assert pip.returncode == 0, pip.stderr
    return venv


def test_the_bridge_archives_carry_the_jar(dist: Path) -> None:
    built_jar = (REPO_ROOT / JAR).read_bytes()
    with zipfile.ZipFile(dist / f"checkpoint_sidecar_bridge-{VERSION}-py3-none-any.whl") as whl:
        assert whl.read(JAR) == built_jar
        assert not [n for n in whl.namelist() if n.startswith("sidecar/")]
    with tarfile.open(dist / f"checkpoint_sidecar_bridge-{VERSION}.tar.gz") as tar:
        member = tar.extractfile(f"checkpoint_sidecar_bridge-{VERSION}/jars/{Path(JAR).name}")
        assert member is not None and member.read() == built_jar
    check = run(sys.executable, "-m", "twine", "check", "--strict", *dist.glob("*bridge*"))
    assert check.returncode == 0 and check.stdout.count("PASSED") == 2, check.stdout


def test_the_bridge_installs_alone_and_serves_a_driver_without_the_daemons_dependencies(
    bridge_venv: Path, daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    python = bridge_venv / "bin/python"
    installed = run(python, "-m", "pip", "list", "--format=freeze", env=clean_env())
    names = {line.split("==")[0].lower() for line in installed.stdout.splitlines()}
    assert names - {"pip", "setuptools"} == {"checkpoint-sidecar-bridge"}

    daemon = DaemonProcess(daemon_env, tmp_path / "d.log")
    procs.append(daemon)
    daemon.start()
    query_id = "5e1d0000-0000-4000-8000-0000000000bb"
    progress = json.dumps(kafka_progress(query_id, 4), separators=(",", ":"))
    sock = daemon_env["SIDECAR_SOCKET_PATH"]
    result = run(python, "-c", BRIDGE_DRIVER, sock, query_id, progress, env=clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["delivered"] is True
    end = kafka_progress(query_id, 4)["sources"][0]["endOffset"]
    assert json.loads(report["offsets"]) == end  # stored by the daemon, read back through it
    assert Path(report["jar"]).is_relative_to(bridge_venv)
    assert report["daemon_importable"] == [] and report["loaded"] == []

    jar = run(python, "-m", "spark_bridge", "listener-jar", env=clean_env())
    assert (jar.returncode, jar.stdout.strip()) == (0, report["jar"])
    # Reading the blobs directly needs the daemon's package: said, not a traceback.
    code = f"import spark_bridge; spark_bridge.starting_offsets({query_id!r}, {sock!r}, batch=1)"
    rewind = run(python, "-c", code, env=clean_env())
    assert rewind.returncode == 1 and "pip install 'checkpoint-sidecar[daemon]'" in rewind.stderr


SPARK_DRIVER = """
import importlib.util, json, sys
from pyspark.sql import SparkSession
import spark_bridge

socket_path, query_id = sys.argv[1], sys.argv[2]
spark = (
    SparkSession.builder.master("local[1]")
    .config("spark.ui.enabled", "false")
    .config(spark_bridge.SOCKET_CONF, socket_path)  # what the shipped templates set
    .getOrCreate()
)
try:
    offsets = spark_bridge.starting_offsets(query_id)
finally:
    spark.stop()
print(json.dumps({
    "offsets": offsets,
    "daemon_importable": [m for m in ("sidecar", "msgspec", "anyio")
                          if importlib.util.find_spec(m) is not None],
}))
"""


@pytest.mark.spark
@pytest.mark.one_spark
def test_a_driver_configured_by_the_templates_spark_conf_alone_resumes_from_the_daemon(
    bridge_venv: Path, daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    """``starting_offsets("q")`` in a real PySpark session whose only pointer to the daemon is
    ``spark.checkpointSidecar.socketPath`` (no argument, no SIDECAR_SOCKET_PATH, not the
    default path), with only the bridge's wheel installed: the daemon's saved offsets.

    Under PySpark 4 only (``one_spark``): what is packaged does not depend on Spark's version,
    and building the dist and the venv was most of its 57 s under 3.5. What does, the session's
    conf read by the bridge, runs under 3.5 in test_spark.py
    (``test_the_bridge_finds_the_daemon_by_the_sessions_spark_conf_alone``)."""
    import py4j
    import pyspark

    # PySpark and py4j, and nothing else of this environment, beside the bridge's venv.
    spark_only = tmp_path / "spark-only"
    spark_only.mkdir()
    for package in (pyspark, py4j):
        assert package.__file__ is not None
        (spark_only / package.__name__).symlink_to(Path(package.__file__).parent)

    daemon = DaemonProcess(daemon_env, tmp_path / "d.log")
    procs.append(daemon)
    daemon.start()
    sock = daemon_env["SIDECAR_SOCKET_PATH"]
    assert sock != "/tmp/checkpoint-sidecar.sock"  # not found by the default path
    query_id = "5e1d0000-0000-4000-8000-0000000000cc"
    progress = json.dumps(kafka_progress(query_id, 6), separators=(",", ":"))
    python = bridge_venv / "bin/python"
    sent = run(python, "-c", BRIDGE_DRIVER, sock, query_id, progress, env=clean_env())
    assert sent.returncode == 0, sent.stderr[-3000:]

    env = clean_env(PYTHONPATH=str(spark_only), SPARK_LOCAL_IP="127.0.0.1")
    env.pop("SIDECAR_SOCKET_PATH", None)
    env["PYSPARK_PYTHON"] = str(python)
    result = run(python, "-c", SPARK_DRIVER, sock, query_id, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    end = kafka_progress(query_id, 6)["sources"][0]["endOffset"]
    assert json.loads(report["offsets"]) == end
    assert report["daemon_importable"] == []
