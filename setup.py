"""Build hook: every sdist and wheel carries the Spark listener jar, or the build fails.

``spark_bridge/jars/checkpoint-sidecar-listener.jar`` is built from ``spark_bridge/jvm/src``
by ``scripts/build_jar.sh`` (a JDK's javac against the Spark jars of an installed pyspark)
and never committed. ``make dist`` builds it first, and the sdist carries it, so installing
an sdist or a wheel needs no JDK. A plain source tree (a git checkout, ``pip install
git+…``) has no jar: the build makes it here when javac and a Python with pyspark are at
hand, and otherwise stops with what to install or run. It never makes a jar-less package.
Editable installs (``make setup``) are left alone: they read the jar from the tree.

Everything else about the package is declared in pyproject.toml.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist
from setuptools.errors import SetupError

ROOT = Path(__file__).resolve().parent
JAR = Path("spark_bridge/jars/checkpoint-sidecar-listener.jar")
JAVA_SOURCES = Path("spark_bridge/jvm/src")
BUILD_SCRIPT = Path("scripts/build_jar.sh")
#: Importing pyspark (only to find its jars) takes about a second; a hung one fails the build.
PROBE_TIMEOUT_S = 120
PYSPARK_JARS = "import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), 'jars'))"


def _stale(jar: Path) -> bool:
    """Whether a Java source is newer than the jar (scripts/build_jar.sh's own test)."""
    built = jar.stat().st_mtime
    return any(src.stat().st_mtime > built for src in (ROOT / JAVA_SOURCES).rglob("*.java"))


def _unisolated_env() -> dict[str, str]:
    """This environment without pip's build isolation (PYTHONPATH holds its sitecustomize)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}


def _python_with_pyspark() -> tuple[str | None, list[str]]:
    """A Python interpreter that imports pyspark (and has its jars), and the ones tried.

    A build frontend hides the caller's packages (pip's build isolation puts a
    ``sitecustomize`` on PYTHONPATH; ``python -m build`` and uv use a fresh venv), so each
    candidate runs without the isolation's variables: $PYTHON, the interpreter running this
    build (pip's isolation keeps it), the tree's own .venv, then ``python3`` on PATH.
    """
    candidates = [
        os.environ.get("PYTHON"),
        sys.executable,
        str(ROOT / ".venv/bin/python"),
        shutil.which("python3"),
    ]
    tried: list[str] = []
    for candidate in dict.fromkeys(c for c in candidates if c):
        if not os.access(candidate, os.X_OK):
            continue
        tried.append(candidate)
        try:
            probe = subprocess.run(
                [candidate, "-c", PYSPARK_JARS],
                env=_unisolated_env(),
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0 and Path(probe.stdout.strip()).is_dir():
            return candidate, tried
    return None, tried


def ensure_listener_jar() -> None:
    """Make sure the jar is in the source tree, building it when it is missing or stale.

    Raises SetupError (the build stops with its message) when it is missing and cannot be
    built. A stale jar that cannot be rebuilt is kept, with a warning.
    """
    jar = ROOT / JAR
    if jar.is_file() and not _stale(jar):
        return
    missing: list[str] = []
    if not (ROOT / BUILD_SCRIPT).is_file():
        missing.append(f"{BUILD_SCRIPT} is not in this source tree")
    if shutil.which("javac") is None or shutil.which("jar") is None:
        missing.append("no JDK: 'javac' / 'jar' not found on PATH")
    python, tried = _python_with_pyspark()
    if python is None:
        missing.append(f"no Python with pyspark (tried: {', '.join(tried) or 'none'})")
    if not missing:
        print(f"building {JAR} with {BUILD_SCRIPT} (pyspark of {python})", flush=True)
        result = subprocess.run(
            ["bash", str(BUILD_SCRIPT)],
            cwd=ROOT,
            env={**_unisolated_env(), "PYTHON": str(python)},
            check=False,
        )
        if result.returncode != 0 or not jar.is_file():
            raise SetupError(f"{BUILD_SCRIPT} failed (exit {result.returncode}); see above")
        return
    if jar.is_file():
        print(
            f"WARNING: {JAR} is older than its Java sources and cannot be rebuilt here "
            f"({'; '.join(missing)}): packaging it as it is",
            file=sys.stderr,
            flush=True,
        )
        return
    raise SetupError(
        f"checkpoint-sidecar: the Spark listener jar {JAR} is not in this source tree, "
        f"and it cannot be built here: {'; '.join(missing)}.\n"
        "It is built from spark_bridge/jvm/src with a JDK's javac against the Spark jars of "
        "an installed pyspark. Either:\n"
        "  - install a built package instead (PyPI, or the sdist or wheel that `make dist` "
        "makes): those carry the jar and need no JDK; or\n"
        "  - install a JDK with javac (Debian/Ubuntu: apt-get install openjdk-17-jdk-headless) "
        "and pyspark (pip install 'pyspark>=3.4') where this build runs, and install again; or\n"
        f"  - build the jar in the source tree first: PYTHON=/path/to/python-with-pyspark "
        f"bash {BUILD_SCRIPT} (`make jar`), and install again."
    )


class BuildPy(build_py):
    """build_py that puts the listener jar into every (non-editable) wheel."""

    def run(self) -> None:
        if not self.editable_mode:
            ensure_listener_jar()
            # The package data list is computed lazily; drop one made before the jar existed.
            self.__dict__.pop("data_files", None)
        super().run()


class Sdist(sdist):
    """sdist that carries the listener jar, so installing it needs no JDK."""

    def run(self) -> None:
        ensure_listener_jar()
        super().run()


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
