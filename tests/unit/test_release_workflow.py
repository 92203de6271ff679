"""The release workflow (``.github/workflows/release.yml``) is checked here, before the day a
tag first runs it: GitHub's workflow schema (check-jsonschema's vendored copy, so no download)
and zizmor's offline audits (unpinned actions, template injection, persisted credentials,
excessive permissions) find nothing in it, and both do find a broken copy. It builds with the
scripts `make dist` and `make image` use, publishes to PyPI by trusted publishing only, and
pins every action to a commit."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.services import REPO_ROOT

WORKFLOW = REPO_ROOT / ".github" / "workflows" / "release.yml"
BIN = Path(sys.executable).parent
LINTERS = {
    "check-jsonschema": [
        str(BIN / "check-jsonschema"),
        "--builtin-schema",
        "vendor.github-workflows",
    ],
    "zizmor": [str(BIN / "zizmor"), "--offline", "--no-progress"],
}
LINT_TIMEOUT_S = 60


def lint(linter: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LINTERS[linter], str(path)],
        capture_output=True,
        text=True,
        timeout=LINT_TIMEOUT_S,
        check=False,
    )


def workflow() -> dict[Any, Any]:
    loaded = yaml.safe_load(WORKFLOW.read_text())
    assert isinstance(loaded, dict)
    return loaded


@pytest.mark.parametrize("linter", sorted(LINTERS))
def test_the_linter_finds_nothing_in_the_release_workflow(linter: str) -> None:
    result = lint(linter, WORKFLOW)
    assert result.returncode == 0, f"{linter}:\n{result.stdout}{result.stderr}"


#: One mistake of each kind, and the linter that must find it.
MISTAKES = {
    "not GitHub's schema": (
        "check-jsonschema",
        "    timeout-minutes: 20\n",
        "    timeout-minutes: twenty\n",
    ),
    "an action by a movable tag": (
        "zizmor",
        "actions/checkout@3d3c42e5aac5ba805825da76410c181273ba90b1  # v7.0.1",
        "actions/checkout@v7",
    ),
    "a commit message spliced into a script": (
        "zizmor",
        "python3 -m venv .venv\n",
        'python3 -m venv .venv\n          echo "${{ github.event.head_commit.message }}"\n',
    ),
    "the checkout keeps its token": (
        "zizmor",
        "        with:\n          persist-credentials: false\n",
        "",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_the_linter_finds_a_broken_workflow(mistake: str, tmp_path: Path) -> None:
    linter, good, bad = MISTAKES[mistake]
    text = WORKFLOW.read_text()
    assert good in text, f"the workflow changed: make the mistake '{mistake}' anew"
    broken = tmp_path / "release.yml"
    broken.write_text(text.replace(good, bad, 1))
    result = lint(linter, broken)
    assert result.returncode != 0, f"{linter} passed a workflow with {mistake}"


def test_a_version_tag_runs_it_and_nothing_else() -> None:
    # PyYAML reads the key `on` as True (YAML 1.1).
    assert workflow()[True] == {"push": {"tags": ["v*"]}}


def test_every_action_is_pinned_to_a_commit_with_its_tag_beside() -> None:
    uses = re.findall(r"^\s*(?:- )?uses: (\S+)(.*)$", WORKFLOW.read_text(), re.M)
    assert uses
    for action, comment in uses:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", action), f"{action}: not a commit"
        assert re.fullmatch(r"\s+# v\d+(\.\d+)*", comment), f"{action}: no '# vX.Y.Z' beside it"


def test_it_builds_with_make_dists_and_make_images_scripts() -> None:
    runs = {
        name: "\n".join(step.get("run", "") for step in job["steps"])
        for name, job in workflow()["jobs"].items()
    }
    assert "bash scripts/build_dist.sh" in runs["dist"]
    assert "requirements/release.txt" in runs["dist"]
    assert "bash scripts/build_image.sh" in runs["image"]
    assert "docker push" in runs["image"]


def test_only_the_pypi_job_may_mint_an_oidc_token_and_none_stores_a_pypi_secret() -> None:
    doc = workflow()
    assert doc["permissions"] == {}, "nothing by default; each job says what it needs"
    minting = [n for n, job in doc["jobs"].items() if job["permissions"].get("id-token")]
    assert minting == ["pypi"]
    pypi = doc["jobs"]["pypi"]
    assert set(pypi["needs"]) == {"dist", "image"}, "published only after both builds pass"
    assert pypi["environment"]["name"] == "pypi"
    (publish,) = (s for s in pypi["steps"] if s["uses"].startswith("pypa/gh-action-pypi-publish@"))
    assert "password" not in publish.get("with", {}), "trusted publishing: no token"
    assert not re.search(r"secrets\.\w*PYPI", WORKFLOW.read_text(), re.I)
