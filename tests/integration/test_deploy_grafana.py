"""The Grafana dashboard (deploy/grafana) and the Prometheus rules (deploy/prometheus) against a
real Prometheus (Debian's binary) scraping a real daemon under a small load.

Every panel's expression, every variable's query and every rule's expression must parse and
evaluate; each selector in them must match series the daemon exports (no typo'd metric or
label name); each panel must return data whose labels are those its legend names, except the
ones listed in EXPECTED_EMPTY with the reason; and under this healthy load no alert is pending
or firing, and every rule evaluates without error.
"""

from __future__ import annotations

import importlib.util
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest
import yaml
from azure.storage.blob import BlobServiceClient, RetentionPolicy

from sidecar.ops.client import SidecarClient
from tests.helpers import wait_blob, wait_for
from tests.prometheus_server import PrometheusServer
from tests.services import REPO_ROOT, Azurite, DaemonProcess
from tests.snapshotdirs import HdfsCheckpoint
from tests.sparkshapes import kafka_progress

REPO = REPO_ROOT
DASHBOARD_SCRIPT = REPO / "deploy" / "grafana" / "dashboard.py"
DASHBOARD = REPO / "deploy" / "grafana" / "checkpoint-sidecar.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"

#: The streaming queries of the load (by name), and the target labels Prometheus gives the
#: daemon, as a PodMonitor would.
QUERIES = ("orders", "payments")
BATCHES = 5
POD = "orders-driver-0"
#: Panels (title, refId) expected to return nothing under this load, and why.
EXPECTED_EMPTY = {
    ("Redis, blob store and Kafka up", "C"): "Kafka is not configured: no daemon has "
    "committed, so the panel leaves out kafka_up (0 without Kafka, which would read as down)",
}
#: Grafana's built-in interval, as it would be with a 1 s scrape interval and a short range.
RATE_INTERVAL = "1m"
#: A series selector (metric name with optional matchers) in PromQL text; recorded series
#: (checkpoint_sidecar:…) included. Functions and keywords are not followed by a brace or
#: are not metric names of ours.
SELECTOR = re.compile(r"\b(checkpoint_sidecar[_:][\w:]+|up)\b(\{[^}]*\})?")


def dashboard_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("checkpoint_sidecar_dashboard", DASHBOARD_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dashboard_json_is_up_to_date() -> None:
    """The committed JSON is what deploy/grafana/dashboard.py generates."""
    assert DASHBOARD.read_text() == dashboard_module().render(), (
        "deploy/grafana/checkpoint-sidecar.json is out of date: run "
        ".venv/bin/python deploy/grafana/dashboard.py"
    )


def test_dashboard_has_its_variables_and_every_panel_uses_them() -> None:
    board = json.loads(DASHBOARD.read_text())
    names = [variable["name"] for variable in board["templating"]["list"]]
    assert names == ["datasource", "namespace", "query"]
    for panel, item in targets(board):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert 'namespace=~"$namespace"' in item["expr"], panel["title"]


def targets(board: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every query of every panel."""
    for panel in board["panels"]:
        for item in panel.get("targets", []):
            yield panel, item


def substitute(expr: str, namespace: str) -> str:
    """A panel's expression as Grafana sends it: one namespace chosen, every query (All)."""
    return (
        expr.replace("$namespace", re.escape(namespace))
        .replace("$query", f"({'|'.join(QUERIES)})")
        .replace("$__rate_interval", RATE_INTERVAL)
    )


def rule_expressions() -> list[tuple[str, str]]:
    """(name, expression) of every recording and alerting rule."""
    doc = yaml.safe_load(ALERTS.read_text())
    return [
        (rule.get("alert") or rule["record"], rule["expr"])
        for group in doc["groups"]
        for rule in group["rules"]
    ]


async def post_progress(
    socket_path: str, query_ids: dict[str, str], checkpoints: dict[str, HdfsCheckpoint]
) -> None:
    async with await SidecarClient.connect(socket_path) as client:
        for batch in range(BATCHES):
            for name, query_id in query_ids.items():
                assert checkpoints[name].batch() == batch  # Spark commits, then reports
                progress = kafka_progress(query_id, batch, name=name, lag=0)
                reply = await client.progress(progress)
                assert reply.ok, reply


@pytest.fixture
def loaded_daemon(
    daemon_env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path, azurite: Azurite
) -> Iterator[tuple[DaemonProcess, dict[str, str]]]:
    """A daemon process that has acknowledged BATCHES updates of each query, written them to
    the blobs (Azurite) and snapshotted each query's checkpoint directory (Spark-shaped, under
    SIDECAR_SNAPSHOT_ROOT); Kafka not configured. Healthy as the config checks see it too:
    blob soft delete on (Azurite stores the setting), so no check warns."""
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    service.set_service_properties(delete_retention_policy=RetentionPolicy(enabled=True, days=7))
    service.close()
    root = short_tmp / "checkpoints"
    env = {
        **daemon_env,
        "SIDECAR_COUNT_THRESHOLD": "2",
        "SIDECAR_TIME_THRESHOLD_S": "0.5",
        "SIDECAR_SNAPSHOT_ROOT": str(root),
    }
    daemon = DaemonProcess(env, log_path=short_tmp / "daemon.log")
    procs.append(daemon)
    daemon.start()
    query_ids = {name: str(uuid.uuid4()) for name in QUERIES}
    checkpoints = {
        name: HdfsCheckpoint(root / name, partitions=2, delta_bytes=500, query_id=query_id)
        for name, query_id in query_ids.items()
    }
    anyio.run(post_progress, daemon.socket_path, query_ids, checkpoints)
    for query_id in query_ids.values():
        wait_blob(env, query_id, BATCHES - 1)
    yield daemon, query_ids
    assert daemon.stop() == 0, daemon.log()


@pytest.mark.slow
def test_every_expression_against_a_real_prometheus(
    loaded_daemon: tuple[DaemonProcess, dict[str, str]], namespace: str
) -> None:
    daemon, _ = loaded_daemon
    target = daemon.admin_url.removeprefix("http://")
    with PrometheusServer(
        [target], labels={"namespace": namespace, "pod": POD}, rule_files=[ALERTS]
    ) as prom:
        # Scraped since the load's last flush, a few times (rate() needs two samples), and
        # the rules evaluated at least once on it.
        last = BATCHES - 1
        wait_for(
            lambda: (
                len(
                    prom.query(f"checkpoint_sidecar_checkpoint_batch_id == {last}")["data"][
                        "result"
                    ]
                )
                == len(QUERIES)
            ),
            30,
            "Prometheus to scrape the flushed batches",
        )
        wait_for(
            lambda: prom.query('count_over_time(up{job="checkpoint-sidecar"}[1m]) >= 3')["data"][
                "result"
            ],
            30,
            "three scrapes",
        )
        wait_for(
            lambda: prom.query("checkpoint_sidecar:flush_seconds:p99_rate5m")["data"]["result"],
            30,
            "the recording rules to be evaluated",
        )
        wait_for(
            lambda: (
                len(prom.query(f"checkpoint_sidecar_snapshot_batch_id == {last}")["data"]["result"])
                == len(QUERIES)
            ),
            30,
            "each query's snapshot of its last batch",
        )
        # The config checks' results are scraped (their alert has something to judge).
        wait_for(
            lambda: prom.query('checkpoint_sidecar_config_check{check="storage_features"}')["data"][
                "result"
            ],
            30,
            "the config checks' results",
        )
        board = json.loads(DASHBOARD.read_text())
        panel_exprs = [
            (f"panel {panel['title']!r} {item['refId']}", substitute(item["expr"], namespace))
            for panel, item in targets(board)
        ]
        variable_exprs = [
            (f"variable {variable['name']}", substitute(match.group(1), namespace))
            for variable in board["templating"]["list"]
            if (match := re.fullmatch(r"label_values\((.+), \w+\)", str(variable["query"])))
        ]
        assert len(variable_exprs) == 2
        problems: list[str] = []

        # Every selector of every expression matches series: names and labels exist.
        for what, expr in [*panel_exprs, *variable_exprs, *rule_expressions()]:
            for match in SELECTOR.finditer(expr):
                if not prom.series(match.group(0)):
                    problems.append(f"{what}: {match.group(0)} matches no series")

        # Panels: data of the shape the legend names.
        for panel, item in targets(board):
            key = (panel["title"], item["refId"])
            answer = prom.query(substitute(item["expr"], namespace))
            if answer["status"] != "success":
                problems.append(f"{key}: {answer.get('error')}")
                continue
            result = answer["data"]["result"]
            if key in EXPECTED_EMPTY:
                if result:
                    problems.append(f"{key}: expected empty ({EXPECTED_EMPTY[key]}): {result}")
                continue
            if not result:
                problems.append(f"{key}: no data")
            legend_labels = set(re.findall(r"\{\{(\w+)\}\}", item["legendFormat"]))
            for series in result:
                missing = legend_labels - set(series["metric"])
                if missing:
                    problems.append(f"{key}: series {series['metric']} lacks {missing}")
        for what, expr in variable_exprs:
            result = prom.query(expr)["data"]["result"]
            label = "namespace" if what.endswith("namespace") else "query"
            if {series["metric"].get(label) for series in result} != (
                {namespace} if label == "namespace" else set(QUERIES)
            ):
                problems.append(f"{what}: {[series['metric'] for series in result]}")

        # Rules: each expression evaluates; healthy, so no alert expression has a result.
        for name, expr in rule_expressions():
            answer = prom.query(expr)
            if answer["status"] != "success":
                problems.append(f"rule {name}: {answer.get('error')}")
            elif not name.startswith("checkpoint_sidecar:") and answer["data"]["result"]:
                problems.append(f"alert {name} would fire: {answer['data']['result']}")
            elif name.startswith("checkpoint_sidecar:") and not answer["data"]["result"]:
                problems.append(f"recording rule {name}: no data")

        # Prometheus itself loaded and evaluated every rule without error; nothing pending.
        groups = prom.api("rules")["data"]["groups"]
        loaded = {rule["name"]: rule for group in groups for rule in group["rules"]}
        assert set(loaded) == {name for name, _ in rule_expressions()}
        problems += [
            f"rule {name}: {rule['health']} {rule.get('lastError')}"
            for name, rule in loaded.items()
            if rule["health"] != "ok"
        ]
        problems += [f"alert {a['labels']}" for a in prom.api("alerts")["data"]["alerts"]]
        assert not problems, "\n".join(problems)
