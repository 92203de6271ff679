"""The Prometheus rules of deploy/prometheus: valid, unit-tested by promtool (every alert firing
and not firing), documented (summary, description, a runbook section in deploy/README.md, and a
``runbook_url`` that links that section: one base for all, the anchor GitHub gives the heading).

The rules' expressions against a real Prometheus scraping a real daemon:
tests/integration/test_deploy_grafana.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.prometheus_server import prometheus_binary
from tests.services import REPO_ROOT

REPO = REPO_ROOT
RULES_DIR = REPO / "deploy" / "prometheus"
ALERTS = RULES_DIR / "alerts.yml"
ALERTS_TEST = RULES_DIR / "alerts_test.yml"
DEPLOY_README = REPO / "deploy" / "README.md"
#: An alert's runbook_url: where deploy/README.md is served (the base, one for all alerts), then
#: the anchor of the alert's runbook section.
RUNBOOK_URL = re.compile(r"(?P<base>https://[^#\s]+)#(?P<anchor>[\w-]+)")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [prometheus_binary("promtool"), *args],
        cwd=RULES_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def rules() -> list[dict[str, Any]]:
    """Every rule of alerts.yml (recording and alerting), in file order."""
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alert_rules() -> list[dict[str, Any]]:
    return [rule for rule in rules() if "alert" in rule]


def test_rules_are_valid() -> None:
    result = promtool("check", "rules", ALERTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", ALERTS_TEST.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    """The unit tests see a changed threshold: a stale checkpoint alert at 400 s instead of
    300 s no longer fires when they expect it."""
    changed = ALERTS.read_text().replace(
        "checkpoint_sidecar_checkpoint_age_seconds > 300",
        "checkpoint_sidecar_checkpoint_age_seconds > 400",
    )
    assert changed != ALERTS.read_text()
    (tmp_path / ALERTS.name).write_text(changed)
    shutil.copy(ALERTS_TEST, tmp_path / ALERTS_TEST.name)
    result = subprocess.run(
        [prometheus_binary("promtool"), "test", "rules", ALERTS_TEST.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "alertname: CheckpointSidecarCheckpointStale" in result.stdout + result.stderr


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    cases: dict[str, list[list[Any]]] = {}
    for group in yaml.safe_load(ALERTS_TEST.read_text())["tests"]:
        for check in group.get("alert_rule_test", []):
            cases.setdefault(check["alertname"], []).append(check["exp_alerts"])
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names)), "alert names must be unique"
    for name in names:
        expected = cases.get(name, [])
        assert any(expected), f"{name}: no case where it fires"
        assert any(not alerts for alerts in expected), f"{name}: no case where it does not fire"
    assert set(cases) <= set(names), f"tests of unknown alerts: {set(cases) - set(names)}"


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_every_alert_is_documented(rule: dict[str, Any]) -> None:
    """A summary, a description that says what to do, a severity, and a runbook section."""
    name = rule["alert"]
    annotations = rule["annotations"]
    assert set(annotations) >= {"summary", "description"}, name
    assert len(annotations["description"]) > 100, f"{name}: say what happened and what to do"
    assert rule["labels"]["severity"] in {"critical", "warning"}
    sections = re.findall(r"^#### (\w+)$", DEPLOY_README.read_text(), re.MULTILINE)
    assert name in sections, f"deploy/README.md needs a runbook section '#### {name}'"


def github_anchor(heading: str) -> str:
    """The anchor GitHub (and the docs site's toc) gives a Markdown heading's text: a link
    reduced to its text, lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def heading_anchors(markdown: str) -> dict[str, str]:
    """Each heading's anchor -> the heading's text, outside code blocks; a repeated anchor
    gets GitHub's suffix (-1, -2, ...)."""
    anchors: dict[str, str] = {}
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6} (.+)$", line)):
            anchor = base = github_anchor(match.group(1))
            count = 0
            while anchor in anchors:
                count += 1
                anchor = f"{base}-{count}"
            anchors[anchor] = match.group(1).strip()
    return anchors


def test_heading_anchors_are_githubs() -> None:
    """The anchors computed here are those deploy/README.md's own links use (the docs build
    checks those against the site's), and a code block's comment is no heading."""
    anchors = heading_anchors(DEPLOY_README.read_text())
    linked = set(re.findall(r"\]\(#([^)]+)\)", DEPLOY_README.read_text()))
    assert linked and linked <= set(anchors), linked - set(anchors)
    assert github_anchor("Beside your own listeners and class path") == (
        "beside-your-own-listeners-and-class-path"
    )
    assert github_anchor("`alerts.yml`: the [rules](x.md), v2.1!") == "alertsyml-the-rules-v21"
    assert heading_anchors("# A\n```sh\n# not a heading\n```\n## A\n") == {"a": "A", "a-1": "A"}


def test_every_alert_links_its_runbook_section() -> None:
    """runbook_url is the base where deploy/README.md is served (the same for every alert, and
    named in deploy/README.md) and the anchor of the alert's own `#### Name` section."""
    anchors = heading_anchors(DEPLOY_README.read_text())
    bases = set()
    for rule in alert_rules():
        name = rule["alert"]
        url = rule["annotations"].get("runbook_url")
        assert url, f"{name}: no runbook_url annotation"
        match = RUNBOOK_URL.fullmatch(url)
        assert match, f"{name}: runbook_url {url!r} is not https://…#anchor"
        assert anchors.get(match["anchor"]) == name, (
            f"{name}: #{match['anchor']} is not the anchor of its section '#### {name}' in "
            "deploy/README.md"
        )
        bases.add(match["base"])
    assert len(bases) == 1, f"one runbook base for all alerts, not {sorted(bases)}"
    [base] = bases
    assert f"`{base}`" in DEPLOY_README.read_text(), "deploy/README.md names the runbook base"
