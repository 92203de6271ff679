"""``spark_bridge``'s Python floor (3.8: Spark 3.5's default image) and its independence from
the daemon, held in the suite: vermin finds nothing newer than the floor in its modules (and
does find a newer feature when there is one), ruff lints it for that version, its distribution
says that floor and the daemon's version, and no module of it imports the daemon's package
or msgspec at import time (only the blob-reading paths do, inside functions)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.services import REPO_ROOT

BRIDGE = REPO_ROOT / "spark_bridge"
FLOOR = (3, 8)
PROJECT = tomllib.loads((BRIDGE / "pyproject.toml").read_text())
VERMIN = [str(Path(sys.executable).parent / "vermin"), "--no-tips", "--violations", "-t=3.8-"]


def modules() -> list[Path]:
    return sorted(BRIDGE.glob("*.py"))


def test_vermin_finds_nothing_newer_than_the_floor() -> None:
    result = subprocess.run(
        [*VERMIN, *map(str, modules())], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_vermin_would_find_a_feature_newer_than_the_floor(tmp_path: Path) -> None:
    newer = tmp_path / "newer.py"
    newer.write_text("def pairs(a, b):\n    return list(zip(a, b, strict=True))\n")
    result = subprocess.run([*VERMIN, str(newer)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "strict" in result.stdout


def test_the_distribution_and_the_linter_state_the_floor() -> None:
    assert PROJECT["project"]["requires-python"] == ">={}.{}".format(*FLOOR)
    assert PROJECT["tool"]["ruff"]["target-version"] == "py{}{}".format(*FLOOR)
    assert PROJECT["project"]["dependencies"] == []
    daemon = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert PROJECT["project"]["version"] == daemon["version"]


def test_no_module_imports_the_daemon_or_msgspec_when_imported() -> None:
    """Module-level imports only (TYPE_CHECKING blocks are never run)."""
    found = []
    for path in modules():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    break
                names = []
                if isinstance(sub, ast.Import):
                    names = [alias.name for alias in sub.names]
                elif isinstance(sub, ast.ImportFrom) and sub.module:
                    names = [sub.module]
                found += [
                    f"{path.name}: {n}" for n in names if n.split(".")[0] in ("sidecar", "msgspec")
                ]
    assert found == []
