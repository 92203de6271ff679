"""The documentation says what the code does, and its site builds with every link working.

* docs/configuration.md's table lists every setting (variable and flag), and README's
  essential settings are rows of it; no doc or manifest mentions a ``SIDECAR_*`` variable the
  daemon would refuse.
* docs/metrics.md's table lists every metric the daemon exports, and nothing else: names,
  types, label names, and the label values the daemon exports from the start.
* The site (mkdocs.yml, ``make docs``) builds in strict mode, and a broken link, a missing
  anchor or a link out of the site fails that build.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

from sidecar import __version__
from sidecar.config.settings import _K8S_SERVICE_ENV, Config, Setting
from sidecar.kafka.lag import EVENTHUBS, KAFKA
from sidecar.telemetry.metrics import Metrics
from tests.services import REPO_ROOT

README = REPO_ROOT / "README.md"
CONFIGURATION = REPO_ROOT / "docs" / "configuration.md"
METRICS = REPO_ROOT / "docs" / "metrics.md"
DOCS = [
    README,
    REPO_ROOT / "deploy" / "README.md",
    REPO_ROOT / "Dockerfile",
    *sorted((REPO_ROOT / "docs").glob("*.md")),
    *sorted((REPO_ROOT / "deploy" / "kubernetes").rglob("*.yaml")),
    REPO_ROOT / "deploy" / "compose" / "compose.yaml",
    REPO_ROOT / "CHANGELOG.md",
]
#: What `mkdocs build` needs of the repository (a copy of it fails on purpose below).
SITE_SOURCES = [
    "mkdocs.yml",
    "docs",
    "scripts/mkdocs_hooks.py",
    "README.md",
    "deploy/README.md",
    "CHANGELOG.md",
    "LICENSE",
]
SITE_BUILD_TIMEOUT_S = 60


def table(path: Path, header: str) -> list[list[str]]:
    """The cells of each row of the Markdown table of ``path`` whose header row starts with
    ``header``. A pipe escaped with a backslash (inside a code span) is no cell border."""
    lines = path.read_text().splitlines()
    start = next(
        (i for i, line in enumerate(lines) if line.startswith(header)),
        None,
    )
    assert start is not None, f"{path.relative_to(REPO_ROOT)} has no table '{header} …'"
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def settings_rows(path: Path) -> dict[str, list[str]]:
    """A settings table: variable -> its cells (variable, flag, default, meaning)."""
    rows = {}
    for cells in table(path, "| variable | flag | default | meaning |"):
        if match := re.fullmatch(r"`([A-Z0-9_]+)`", cells[0]):
            rows[match.group(1)] = cells
    return rows


# --- settings ------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", Config.settings(), ids=lambda s: s.name)
def test_the_configuration_table_lists_every_setting(setting: Setting) -> None:
    env = setting.metadata["env"]
    flag = "--" + setting.name.replace("_", "-")
    rows = settings_rows(CONFIGURATION)
    assert env in rows, f"docs/configuration.md's table has no row for {env}"
    assert rows[env][1] == f"`{flag}`", f"the row of {env} should name its flag {flag}"


def test_the_configuration_table_lists_only_settings() -> None:
    known = {s.metadata["env"] for s in Config.settings()}
    assert set(settings_rows(CONFIGURATION)) <= known


def test_the_readme_essential_settings_are_rows_of_the_configuration_table() -> None:
    essential = settings_rows(README)
    reference = settings_rows(CONFIGURATION)
    assert 5 <= len(essential) <= 8, "README's essential settings: a handful, not all"
    for env, cells in essential.items():
        assert env in reference, f"README's essential settings name {env}, not a setting"
        assert cells[1:3] == reference[env][1:3], (
            f"README's row of {env} should give the flag and default of docs/configuration.md"
        )


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


# --- one install story, commands that run ------------------------------------------------

#: Every page a command is copied from: the docs, the READMEs, the manifests, the packaging
#: and the release workflow (its release notes).
COMMAND_PAGES = [
    *DOCS,
    REPO_ROOT / "spark_bridge" / "README.md",
    REPO_ROOT / "pyproject.toml",
    REPO_ROOT / "spark_bridge" / "pyproject.toml",
    REPO_ROOT / ".github" / "workflows" / "release.yml",
]
_VERSION_SPEC = r"(?:(?:==|>=|<=|~=|!=|<|>)[\w.*$+-]+)?"
#: What a `pip install` may name of this project: the Spark side (on a driver, Python 3.8+),
#: by name or as its archive, or the daemon with its `daemon` extra (Python 3.11+, never a
#: driver's). A bare `checkpoint-sidecar` is the daemon's distribution without the daemon: on
#: a driver it fails on the Spark 3.5 images' Python 3.8 and has no use elsewhere.
INSTALLABLE = [
    rf"checkpoint-sidecar-bridge{_VERSION_SPEC}",
    r"checkpoint_sidecar_bridge-[\w.*$+-]+\.(?:whl|tar\.gz)",
    rf"checkpoint-sidecar\[(?:\w+,)*daemon(?:,\w+)*\]{_VERSION_SPEC}",
    r"checkpoint_sidecar-[\w.*$+-]+\.(?:whl|tar\.gz)\[(?:\w+,)*daemon(?:,\w+)*\]",
]


def commands(text: str) -> list[str]:
    """``text`` cut into what a reader copies as one command: each line of a fenced code block
    (with its ``\\`` continuations), and each other paragraph joined into one line, leading
    comment marks (``#``) and indentation removed, so that a command a paragraph breaks
    across lines (in a code span, a list item or a YAML comment) reads as one."""
    units: list[str] = []
    paragraph: list[str] = []
    fenced = False
    for line in text.replace("\\\n", " ").splitlines():
        if line.strip().startswith(("```", "~~~")):
            fenced = not fenced
            units.append(" ".join(paragraph))
            paragraph = []
        elif fenced:
            units.append(line)
        elif line.strip():
            paragraph.append(re.sub(r"^\s*(?:#+\s*)?", "", line))
        else:
            units.append(" ".join(paragraph))
            paragraph = []
    units.append(" ".join(paragraph))
    return [unit for unit in units if unit.strip()]


def wrong_installs(text: str) -> list[str]:
    """Each package a `pip install` in ``text`` names of this project that is not one of
    :data:`INSTALLABLE` (a path names its file). Its arguments end at the end of the command:
    a code span's backtick, a shell comment, ``;``, ``|``, ``&`` or ``)``."""
    wrong = []
    for unit in commands(text):
        for args in re.findall(r"\bpip3?\s+install\b([^`#;|&)]*)", unit):
            for token in args.split():
                name = token.strip("'\"\\").rsplit("/", 1)[-1]
                if re.match(r"checkpoint[-_]sidecar", name) and not any(
                    re.fullmatch(ok, name) for ok in INSTALLABLE
                ):
                    wrong.append(name)
    return wrong


def wrong_commands(text: str) -> list[str]:
    """Commands that fail where they are run: ``python`` for ``python3`` (Debian, Ubuntu and
    the Spark images have only ``python3``; a path such as ``.venv/bin/python`` is fine), and a
    driver's ``--jars`` from the daemon's CLI (``checkpoint-sidecar listener-jar``: a driver
    has the bridge, whose command is ``python3 -m spark_bridge listener-jar``)."""
    wrong = []
    for unit in commands(text):
        wrong += re.findall(r"(?<![\w/.$-])python\s+(?:-[mc]\s*\S+|[\w./-]+\.py\b)", unit)
        wrong += re.findall(r"--jars[\s=]+[\"']?\$\(checkpoint-sidecar\s+listener-jar\)", unit)
    return wrong


def test_the_driver_side_is_installed_as_the_bridge_everywhere() -> None:
    # One install story (issue #41): a Spark driver installs checkpoint-sidecar-bridge; the
    # daemon, outside its image, checkpoint-sidecar[daemon,...].
    wrong = {
        f"{path.relative_to(REPO_ROOT)}: pip install {name}"
        for path in COMMAND_PAGES
        for name in wrong_installs(path.read_text())
    }
    assert not wrong, f"a driver installs checkpoint-sidecar-bridge: {sorted(wrong)}"
    for page in (README, REPO_ROOT / "docs" / "getting-started.md"):
        assert "pip install checkpoint-sidecar-bridge" in page.read_text(), page
    # Until it is published: the wheel `make dist` builds, and where the image keeps it.
    bridge = (REPO_ROOT / "docs" / "spark-bridge.md").read_text()
    assert "pip install dist/checkpoint_sidecar_bridge-" in bridge
    assert "/opt/checkpoint-sidecar/bridge/checkpoint_sidecar_bridge-" in bridge
    assert "/opt/checkpoint-sidecar/bridge/" in (REPO_ROOT / "Dockerfile").read_text()


def test_commands_shown_run_as_written() -> None:
    # The Dockerfile's commands run inside the image, whose venv has `python`.
    wrong = {
        f"{path.relative_to(REPO_ROOT)}: {command}"
        for path in COMMAND_PAGES
        if path.name != "Dockerfile"
        for command in wrong_commands(path.read_text())
    }
    assert not wrong, f"python3, and the bridge's listener-jar: {sorted(wrong)}"


def test_the_install_and_command_rules_find_the_wrong_lines() -> None:
    """The two tests above can fail: each wrong line is found, each right one is not."""
    wrong = {
        "pip install checkpoint-sidecar   # on the driver": "checkpoint-sidecar",
        "(Outside these templates, `pip install\n    checkpoint-sidecar` on the driver)": (
            "checkpoint-sidecar"
        ),
        "# requirements of a driver: `pip install\n# 'checkpoint-sidecar[bridge]'`": (
            "checkpoint-sidecar[bridge]"
        ),
        "```sh\npython3 -m pip install dist/checkpoint_sidecar-0.1.0-py3-none-any.whl\n```": (
            "checkpoint_sidecar-0.1.0-py3-none-any.whl"
        ),
        "uv pip install -q checkpoint-sidecar==0.1.0 && run": "checkpoint-sidecar==0.1.0",
    }
    for text, name in wrong.items():
        assert wrong_installs(text) == [name], text
    right = [
        "pip install checkpoint-sidecar-bridge   # on the machine that runs spark-submit",
        "`python3 -m pip install dist/checkpoint_sidecar_bridge-0.1.0-py3-none-any.whl`",
        "pip install /opt/checkpoint-sidecar/bridge/checkpoint_sidecar_bridge-0.1-py3-none-any.whl",
        "\\`python3 -m pip install 'checkpoint-sidecar[daemon,uvloop]==$version'\\`.",
        "Outside a container: `pip install 'checkpoint-sidecar[daemon,uvloop]'`, then run",
        '--find-links /tmp/wheels "checkpoint-sidecar[daemon,uvloop]" || exit 1',
        "pip install -e '.[daemon,test]'",
    ]
    for text in right:
        assert wrong_installs(text) == [], text
    assert len(wrong_commands('spark-submit --jars "$(python -m spark_bridge listener-jar)"')) == 1
    assert len(wrong_commands("JARS=\"$(python -c 'import pyspark')\"")) == 1
    assert len(wrong_commands("`python scripts/demo.py`")) == 1
    assert len(wrong_commands('`--jars "$(checkpoint-sidecar\n    listener-jar)"`')) == 1
    for text in (
        'spark-submit --jars "$(python3 -m spark_bridge listener-jar)"',
        ".venv/bin/python -m pytest tests/unit",
        'cp "$(checkpoint-sidecar listener-jar)" /opt/checkpoint-sidecar/lib/',
        'attach(spark, listener="python")',
        "A Python listener remains as a fallback",
    ):
        assert wrong_commands(text) == [], text


# --- metrics -------------------------------------------------------------------------------

#: name as exported -> (type, label names, {label: the values exported from the start}).
MetricsShape = dict[str, tuple[str, set[str], dict[str, set[str]]]]


def exported_metrics() -> MetricsShape:
    """Every metric the daemon exports, from the code."""
    metrics = Metrics()
    metrics.set_redis_aof(True)  # registered once Redis has said whether AOF is on
    # What the daemon adds at start (sidecar/daemon/app.py, Daemon.run).
    metrics.build_info.info({"version": __version__, "event_loop": "asyncio"})
    wrappers = {w._name: w for w in vars(metrics).values() if isinstance(w, MetricWrapperBase)}
    shape: MetricsShape = {}
    for family in metrics.registry.collect():
        values: dict[str, set[str]] = {}
        for sample in family.samples:
            for label, value in sample.labels.items():
                values.setdefault(label, set()).add(value)
        values.pop("le", None)  # a histogram's buckets
        labels = set(wrappers[family.name]._labelnames)
        if family.type == "info":  # an info metric's labels are its values
            labels |= set(values)
            values = {}
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        shape[family.name + suffix] = (family.type, labels, values)
    for lag in (KAFKA, EVENTHUBS):  # collected at scrape time (sidecar.kafka.lag)
        shape[lag.lag] = ("gauge", {"query", lag.stream_label, "partition"}, {})
        shape[lag.query_lag] = ("gauge", {"query"}, {})
        shape[lag.seconds] = ("gauge", {"query"}, {})
        shape[lag.dropped] = ("gauge", set(), {})
    return shape


def documented_metrics() -> MetricsShape:
    """docs/metrics.md's table: a row names one metric or more (``…_`` abbreviates
    ``checkpoint_sidecar_``), each with its labels, a label's values as ``l="a\\|b"``."""
    shape: MetricsShape = {}
    for cells in table(METRICS, "| metric | type | meaning |"):
        for span in re.findall(r"`([^`]+)`", cells[0]):
            span = re.sub(r"^…_", "checkpoint_sidecar_", span)
            match = re.fullmatch(r"([a-z_]+)(?:\{(.*)\})?", span)
            assert match, f"docs/metrics.md: cannot read the metric {span!r}"
            labels, values = set(), {}
            for label in filter(None, (match.group(2) or "").split(",")):
                name, _, listed = label.partition("=")
                labels.add(name)
                if listed:
                    values[name] = set(listed.strip('"').split("\\|"))
            assert match.group(1) not in shape, f"docs/metrics.md: {match.group(1)} twice"
            shape[match.group(1)] = (cells[1], labels, values)
    return shape


def test_the_metrics_table_lists_every_metric_and_only_those() -> None:
    code, docs = exported_metrics(), documented_metrics()
    assert sorted(code.keys() - docs.keys()) == [], "exported, missing in docs/metrics.md"
    assert sorted(docs.keys() - code.keys()) == [], "in docs/metrics.md, not exported"


@pytest.mark.parametrize("name", sorted(exported_metrics()))
def test_the_metrics_table_gives_type_labels_and_values(name: str) -> None:
    kind, labels, values = exported_metrics()[name]
    documented = documented_metrics().get(name)
    assert documented is not None, f"docs/metrics.md has no row for {name}"
    doc_kind, doc_labels, doc_values = documented
    assert doc_kind == kind, f"docs/metrics.md: {name} is a {kind}"
    assert doc_labels == labels, f"docs/metrics.md: {name}'s labels are {sorted(labels)}"
    for label, listed in doc_values.items():
        assert listed == values.get(label), (
            f"docs/metrics.md: {name}'s {label} values are {sorted(values.get(label, ()))}"
        )


# --- the site --------------------------------------------------------------------------------


def build_site(root: Path, site_dir: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build` of the repository at ``root``, strict as mkdocs.yml says (and as
    `make docs` runs it)."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=root,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=SITE_BUILD_TIMEOUT_S,
        check=False,
    )


def test_the_site_builds_with_every_link_and_anchor_found(tmp_path: Path) -> None:
    built = build_site(REPO_ROOT, tmp_path / "site")
    assert built.returncode == 0, f"make docs fails:\n{built.stderr}"
    pages = {p.relative_to(tmp_path / "site").as_posix() for p in tmp_path.glob("site/**/*.html")}
    assert {"index.html", "deploy/index.html", "configuration/index.html"} <= pages
    # The first deploy's pages (issue #30): in the site, linked from the home page.
    assert {"troubleshooting/index.html", "changelog/index.html", "license/index.html"} <= pages
    home = (tmp_path / "site" / "index.html").read_text()
    for page in ("troubleshooting/", "changelog/", "license/"):
        assert f'href="{page}"' in home, f"the home page does not link {page}"
    assert "Apache License" in (tmp_path / "site" / "license" / "index.html").read_text()


def test_a_broken_link_or_anchor_fails_the_site_build(tmp_path: Path) -> None:
    # A copy of what the build reads, with one mistake of each kind a page can make.
    root = tmp_path / "repo"
    for source in SITE_SOURCES:
        (root / source).parent.mkdir(parents=True, exist_ok=True)
        if (REPO_ROOT / source).is_dir():
            shutil.copytree(REPO_ROOT / source, root / source)
        else:
            shutil.copy(REPO_ROOT / source, root / source)
    mistakes = {
        root / "docs" / "metrics.md": "[gone](no-such-page.md)",
        root / "docs" / "operations.md": "[anchor](configuration.md#no-such-anchor)",
        root / "docs" / "kafka.md": "[out of the site](../sidecar/kafka/committer.py)",
        root / "README.md": "[from the README](docs/no-such-page.md)",
        root / "deploy" / "README.md": "[from the deploy guide](../README.md#no-such-anchor)",
    }
    for path, link in mistakes.items():
        path.write_text(path.read_text() + f"\n{link}\n")
    built = build_site(root, tmp_path / "site")
    assert built.returncode != 0, "a build with broken links passed"
    for page, link in (  # as the site names them: README.md is index.md, deploy/README.md deploy.md
        ("metrics.md", "no-such-page.md"),
        ("operations.md", "configuration.md#no-such-anchor"),
        ("kafka.md", "../sidecar/kafka/committer.py"),
        ("index.md", "no-such-page.md"),
        ("deploy.md", "index.md#no-such-anchor"),
    ):
        needle = f"Doc file '{page}' contains a link '{link}'"
        assert needle in built.stderr, f"the build did not report {needle}:\n{built.stderr}"


def test_the_snapshot_failure_reasons_are_the_uploads_but_not_owner() -> None:
    """The reasons pre-set on the failures counter are every reason a failed snapshot gets
    (not_owner is a result of its own: another daemon snapshots the query)."""
    from sidecar.snapshot.upload import FAILURE_REASONS
    from sidecar.telemetry.metrics import SNAPSHOT_FAILURE_REASONS

    assert set(SNAPSHOT_FAILURE_REASONS) == set(FAILURE_REASONS) - {"not_owner"}
