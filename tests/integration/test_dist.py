"""``make dist``: the sdist and the wheel, each carrying the listener jar, installed as a user
would install them.

scripts/build_dist.sh (what ``make dist`` runs) builds them into a temp dir; ``twine check``
passes; the wheel, in a fresh venv holding nothing else but msgspec (what a Spark driver
installs), imports ``spark_bridge`` and runs ``checkpoint-sidecar --version`` and
``listener-jar``; the sdist builds a wheel with no JDK on PATH. A source tree without the jar
(a git checkout, ``pip install git+…``) builds it with javac and the installed pyspark, and
without javac fails saying what to install: never a jar-less package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.services import REPO_ROOT

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
