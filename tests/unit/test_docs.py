"""The documentation names the settings that exist: the README's configuration table lists
every one (variable and flag), and no doc or manifest mentions a ``SIDECAR_*`` variable the
daemon would refuse."""

from __future__ import annotations

import re

import pytest

from sidecar.config.settings import _K8S_SERVICE_ENV, Config, Setting
from tests.services import REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = [
    README,
    REPO_ROOT / "deploy" / "README.md",
    REPO_ROOT / "Dockerfile",
    *sorted((REPO_ROOT / "docs").glob("*.md")),
    *sorted((REPO_ROOT / "deploy" / "kubernetes").glob("*.yaml")),
]


def config_rows() -> dict[str, str]:
    """The README's configuration table: variable -> its row."""
    section = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if match := re.match(r"\| `([A-Z0-9_]+)` \|", line):
            rows[match.group(1)] = line
    return rows


@pytest.mark.parametrize("setting", Config.settings(), ids=lambda s: s.name)
def test_the_readme_configuration_table_lists_every_setting(setting: Setting) -> None:
    env = setting.metadata["env"]
    flag = "--" + setting.name.replace("_", "-")
    rows = config_rows()
    assert env in rows, f"README.md's configuration table has no row for {env}"
    assert f"`{flag}`" in rows[env], f"the row of {env} should name its flag {flag}"


def test_docs_and_manifests_name_only_real_settings() -> None:
    known = {s.metadata["env"] for s in Config.settings()}
    unknown = {
        f"{path.relative_to(REPO_ROOT)}: {name}"
        for path in DOCS
        for name in re.findall(r"\bSIDECAR_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())
        if name not in known
        and not _K8S_SERVICE_ENV.match(name)
        and name != "SIDECAR_FOO_SERVICE_HOST"  # the example of what Kubernetes injects
    }
    assert not unknown, f"not settings of the daemon: {sorted(unknown)}"
