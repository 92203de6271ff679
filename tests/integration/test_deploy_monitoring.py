"""The monitoring kustomize base, deploy/kubernetes/monitoring/, as ``kubectl apply -k`` reads it.

* Its generated files (the PrometheusRule from deploy/prometheus/alerts.yml, the dashboard's
  ConfigMap from deploy/grafana/checkpoint-sidecar.json) are what generate.py makes of the
  sources as they are now.
* ``kubectl kustomize`` (the kustomize built into kubectl: Debian's kubernetes-client, which
  ``make setup`` installs, or any kubectl on the PATH; ``KUBECTL_BIN`` names another) builds it
  into exactly the three objects, in the kustomization's namespace: the PodMonitor as written,
  the PrometheusRule whose groups are alerts.yml's (every alert with its runbook_url), the
  ConfigMap labelled ``grafana_dashboard: "1"`` holding the dashboard byte for byte.
* Strictly, as the API server's strict field validation (kubectl's default since 1.27) would:
  the ConfigMap with ``kubernetes-validate`` (unknown fields are errors); the PodMonitor and
  the PrometheusRule against the field names of the Prometheus Operator's CRDs
  (monitoring.coreos.com/v1), an explicit allow-list below (no schema package ships them),
  with the types and patterns of the fields this base sets.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from functools import cache
from types import ModuleType
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.services import REPO_ROOT

BASE = REPO_ROOT / "deploy" / "kubernetes" / "monitoring"
GENERATE = BASE / "generate.py"
ALERTS = REPO_ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "checkpoint-sidecar.json"
KUSTOMIZE_TIMEOUT_S = 60
#: What the base builds into: (kind, name) of each object.
EXPECTED = {
    ("PodMonitor", "checkpoint-sidecar"),
    ("PrometheusRule", "checkpoint-sidecar"),
    ("ConfigMap", "checkpoint-sidecar-dashboard"),
}
KUBERNETES_VERSIONS = ["1.25.0", "1.29.0", "1.33.0", "1.37.0"]

# --- The Prometheus Operator's CRD fields ------------------------------------------------------
# A field schema: a dict of the field names an object allows (each with its value's schema), a
# one-item list for an array of that schema, or a check of a leaf value that returns what is
# wrong with it ("" when nothing). Names from the CRDs of prometheus-operator v0.87
# (example/prometheus-operator-crd/monitoring.coreos.com_{podmonitors,prometheusrules}.yaml);
# fields this base does not set are listed by name with ANY, so their contents go unchecked.
Schema = dict[str, Any] | list[Any] | Callable[[Any], str]


def ANY(value: Any) -> str:
    return ""


def STRING(value: Any) -> str:
    return "" if isinstance(value, str) else f"{value!r} is not a string"


def BOOLEAN(value: Any) -> str:
    return "" if isinstance(value, bool) else f"{value!r} is not a boolean"


def STRING_MAP(value: Any) -> str:
    ok = isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )
    return "" if ok else f"{value!r} is not a map of strings"


def DURATION(value: Any) -> str:
    """The CRDs' duration pattern (Prometheus' model.Duration)."""
    pattern = r"0|(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?"
    ok = isinstance(value, str) and value != "" and re.fullmatch(pattern, value)
    return "" if ok else f"{value!r} is not a duration"


def one_of(*allowed: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        return "" if value in allowed else f"{value!r} is none of {allowed}"

    return check


METADATA: Schema = {
    "name": STRING,
    "namespace": STRING,
    "labels": STRING_MAP,
    "annotations": STRING_MAP,
}
LABEL_SELECTOR: Schema = {
    "matchLabels": STRING_MAP,
    "matchExpressions": [
        {
            "key": STRING,
            "operator": one_of("In", "NotIn", "Exists", "DoesNotExist"),
            "values": [STRING],
        }
    ],
}
RELABEL_CONFIG: Schema = {
    "sourceLabels": [STRING],
    "separator": STRING,
    "targetLabel": STRING,
    "regex": STRING,
    "modulus": ANY,
    "replacement": STRING,
    "action": one_of(
        *(a for action in ("replace", "keep", "drop", "hashmod", "labelmap", "labeldrop",
                           "labelkeep", "lowercase", "uppercase", "keepequal", "dropequal")
          for a in (action, action.capitalize()))
    ),
}  # fmt: skip
POD_METRICS_ENDPOINT: Schema = {
    "port": STRING,
    "portNumber": ANY,
    "targetPort": ANY,
    "path": STRING,
    "scheme": one_of("http", "https", "HTTP", "HTTPS"),
    "params": ANY,
    "interval": DURATION,
    "scrapeTimeout": DURATION,
    "honorLabels": BOOLEAN,
    "honorTimestamps": BOOLEAN,
    "trackTimestampsStaleness": BOOLEAN,
    "relabelings": [RELABEL_CONFIG],
    "metricRelabelings": [RELABEL_CONFIG],
    "filterRunning": BOOLEAN,
    "enableHttp2": BOOLEAN,
    "followRedirects": BOOLEAN,
    **dict.fromkeys(
        ["authorization", "basicAuth", "bearerTokenSecret", "oauth2", "tlsConfig", "proxyUrl",
         "noProxy", "proxyFromEnvironment", "proxyConnectHeader"],
        ANY,
    ),
}  # fmt: skip
POD_MONITOR: Schema = {
    "apiVersion": one_of("monitoring.coreos.com/v1"),
    "kind": one_of("PodMonitor"),
    "metadata": METADATA,
    "spec": {
        "selector": LABEL_SELECTOR,
        "podMetricsEndpoints": [POD_METRICS_ENDPOINT],
        "namespaceSelector": {"any": BOOLEAN, "matchNames": [STRING]},
        "jobLabel": STRING,
        "podTargetLabels": [STRING],
        **dict.fromkeys(
            ["attachMetadata", "bodySizeLimit", "convertClassicHistogramsToNHCB",
             "fallbackScrapeProtocol", "keepDroppedTargets", "labelLimit", "labelNameLengthLimit",
             "labelValueLengthLimit", "nativeHistogramBucketLimit",
             "nativeHistogramMinBucketFactor", "sampleLimit", "scrapeClass",
             "scrapeClassicHistograms", "scrapeProtocols", "selectorMechanism", "targetLimit"],
            ANY,
        ),
    },
}  # fmt: skip
RULE: Schema = {
    "record": STRING,
    "alert": STRING,
    "expr": STRING,
    "for": DURATION,
    "keep_firing_for": DURATION,
    "labels": STRING_MAP,
    "annotations": STRING_MAP,
}
PROMETHEUS_RULE: Schema = {
    "apiVersion": one_of("monitoring.coreos.com/v1"),
    "kind": one_of("PrometheusRule"),
    "metadata": METADATA,
    "spec": {
        "groups": [
            {
                "name": STRING,
                "interval": DURATION,
                "query_offset": DURATION,
                "limit": ANY,
                "partial_response_strategy": ANY,
                "labels": STRING_MAP,
                "rules": [RULE],
            }
        ]
    },
}
#: Required fields, beyond what the allow-list says: (kind, where, fields).
REQUIRED = {
    "PodMonitor": ["spec.selector"],
    "PrometheusRule": ["spec"],
}


def field_errors(value: Any, schema: Schema, path: str = "") -> Iterator[str]:
    """What in ``value`` the schema does not allow: unknown fields, wrong types."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            yield f"{path or '.'}: {value!r} is not an object"
            return
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if key not in schema:
                yield f'{where}: unknown field "{key}"'
            else:
                yield from field_errors(item, schema[key], where)
    elif isinstance(schema, list):
        if not isinstance(value, list):
            yield f"{path}: {value!r} is not a list"
            return
        for index, item in enumerate(value):
            yield from field_errors(item, schema[0], f"{path}[{index}]")
    elif problem := schema(value):
        yield f"{path}: {problem}"


def crd_errors(doc: dict[str, Any]) -> list[str]:
    """Everything the PodMonitor or PrometheusRule CRD would refuse of ``doc``, as far as the
    allow-list knows, and what the operator needs of a rule (one of record and alert)."""
    schema = {"PodMonitor": POD_MONITOR, "PrometheusRule": PROMETHEUS_RULE}[doc["kind"]]
    errors = list(field_errors(doc, schema))
    for required in REQUIRED[doc["kind"]]:
        node: Any = doc
        for part in required.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            errors.append(f"{required}: required")
    if doc["kind"] == "PrometheusRule":
        for group in doc.get("spec", {}).get("groups", []):
            for index, rule in enumerate(group.get("rules", [])):
                where = f"group {group.get('name')} rule {index}"
                if ("alert" in rule) == ("record" in rule):
                    errors.append(f"{where}: exactly one of alert and record")
                if "expr" not in rule:
                    errors.append(f"{where}: expr is required")
                if "record" in rule and ({"for", "annotations"} & set(rule)):
                    errors.append(f"{where}: a recording rule has no for or annotations")
    return errors


# --- The base ------------------------------------------------------------------------------------


def generate_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("checkpoint_sidecar_monitoring", GENERATE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kubectl_binary() -> str:
    """kubectl: ``KUBECTL_BIN``, else the PATH's or /usr/bin's (Debian's kubernetes-client,
    which `make setup` installs)."""
    found = (
        os.environ.get("KUBECTL_BIN")
        or shutil.which("kubectl")
        or ("/usr/bin/kubectl" if os.access("/usr/bin/kubectl", os.X_OK) else None)
    )
    if not found:
        pytest.fail(
            "kubectl not found: run `make setup` (installs Debian's kubernetes-client) or set "
            "KUBECTL_BIN"
        )
    return found


@cache
def built() -> tuple[dict[str, Any], ...]:
    """The objects `kubectl kustomize deploy/kubernetes/monitoring` prints."""
    result = subprocess.run(
        [kubectl_binary(), "kustomize", str(BASE)],
        capture_output=True,
        text=True,
        timeout=KUSTOMIZE_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc is not None)


def built_object(kind: str) -> dict[str, Any]:
    [doc] = [doc for doc in built() if doc["kind"] == kind]
    return doc


def load(path: Any) -> Any:
    return yaml.safe_load(path.read_text())


def test_generated_files_are_up_to_date() -> None:
    """The committed PrometheusRule and ConfigMap are what generate.py makes of the sources."""
    for path, text in generate_module().outputs().items():
        assert path.read_text() == text, (
            f"{path.relative_to(REPO_ROOT)} is out of date: run "
            ".venv/bin/python deploy/kubernetes/monitoring/generate.py"
        )


def test_the_generator_follows_its_sources() -> None:
    """A changed threshold in alerts.yml changes the PrometheusRule (so the test above fails
    until it is regenerated); a rule file it cannot wrap as it is is refused."""
    module = generate_module()
    source = ALERTS.read_text()
    changed = source.replace("checkpoint_age_seconds > 300", "checkpoint_age_seconds > 400")
    assert changed != source
    assert module.prometheus_rule(changed) != (BASE / "prometheusrule.yaml").read_text()
    with pytest.raises(ValueError, match="only `groups`"):
        module.prometheus_rule(source + "\nrule_files: []\n")
    dashboard = DASHBOARD.read_text()
    assert module.dashboard_configmap(dashboard.replace("Overview", "Over")) != (
        (BASE / "grafana-dashboard.yaml").read_text()
    )


def test_the_kustomization_lists_the_base() -> None:
    kustomization = load(BASE / "kustomization.yaml")
    assert kustomization["resources"] == [
        "podmonitor.yaml",
        "prometheusrule.yaml",
        "grafana-dashboard.yaml",
    ]
    assert all((BASE / name).is_file() for name in kustomization["resources"])


def test_kustomize_builds_exactly_the_three_objects_in_the_namespace() -> None:
    namespace = load(BASE / "kustomization.yaml")["namespace"]
    assert sorted((doc["kind"], doc["metadata"]["name"]) for doc in built()) == sorted(EXPECTED)
    assert {doc["metadata"]["namespace"] for doc in built()} == {namespace}
    # The PodMonitor as written, in the kustomization's namespace.
    pod_monitor = load(BASE / "podmonitor.yaml")
    pod_monitor["metadata"]["namespace"] = namespace
    assert built_object("PodMonitor") == pod_monitor


def test_the_prometheus_rule_holds_the_groups_of_alerts_yml() -> None:
    rule = built_object("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    groups = rule["spec"]["groups"]
    assert groups == load(ALERTS)["groups"]
    alerts = [r for group in groups for r in group["rules"] if "alert" in r]
    assert alerts
    for alert in alerts:
        assert alert["annotations"].get("runbook_url", "").startswith("https://"), alert["alert"]


def test_the_dashboard_configmap_is_what_grafanas_sidecar_loads() -> None:
    configmap = built_object("ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"  # a string, as labels are
    [(key, text)] = configmap["data"].items()
    assert key.endswith(".json")
    assert text == DASHBOARD.read_text()
    assert json.loads(text)["uid"] == "checkpoint-sidecar"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_configmap_is_a_valid_kubernetes_object_in_strict_mode(version: str) -> None:
    kubernetes_validate.validate(built_object("ConfigMap"), version, strict=True)


@pytest.mark.parametrize("kind", ["PodMonitor", "PrometheusRule"])
def test_the_operator_objects_have_only_fields_of_their_crds(kind: str) -> None:
    assert crd_errors(built_object(kind)) == []


def test_the_field_check_refuses_unknown_and_mistyped_fields() -> None:
    pod_monitor = json.loads(json.dumps(built_object("PodMonitor")))
    endpoint = pod_monitor["spec"]["podMetricsEndpoints"][0]
    endpoint["intervall"] = endpoint.pop("interval")
    endpoint["relabelings"][0]["action"] = "rename"
    pod_monitor["spec"]["selector"]["matchExpressions"][0]["operator"] = "exists"
    errors = crd_errors(pod_monitor)
    assert len(errors) == 3, errors
    assert 'spec.podMetricsEndpoints[0].intervall: unknown field "intervall"' in errors
    assert any("relabelings[0].action: 'rename' is none of" in e for e in errors)
    assert any("matchExpressions[0].operator: 'exists'" in e for e in errors)
    rule = json.loads(json.dumps(built_object("PrometheusRule")))
    alert = rule["spec"]["groups"][1]["rules"][0]
    alert["for"] = "2 minutes"
    alert["annotations"]["runbook_url"] = ["not", "a", "string"]
    alert["record"] = "also:a:record"
    rule["spec"]["groups"][0]["evaluation_interval"] = "1m"
    errors = crd_errors(rule)
    assert len(errors) == 5, errors
    for wrong in (
        'spec.groups[0].evaluation_interval: unknown field "evaluation_interval"',
        "spec.groups[1].rules[0].for: '2 minutes' is not a duration",
        "spec.groups[1].rules[0].annotations: {",
        "rule 0: exactly one of alert and record",
        "rule 0: a recording rule has no for or annotations",
    ):
        assert any(wrong in error for error in errors), (wrong, errors)
