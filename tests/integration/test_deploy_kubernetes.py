"""The Kubernetes manifests in deploy/kubernetes/, checked offline (the monitoring kustomize
base's other objects, and the base as kustomize builds it: test_deploy_monitoring.py).

* Every core object is validated with ``kubernetes-validate`` in strict mode (unknown fields
  are errors) against the Kubernetes versions it is written for: the native-sidecar
  templates for 1.29+, the plain-sidecar template also for 1.25-1.28.
* The SparkApplication is validated against the ``openAPIV3Schema`` of the Spark Operator
  v2.1.0 CRD (vendored in tests/data/: the first release with ``driver.template``, the floor
  the example states), strictly as the API server's field validation is (an unknown field is
  an error); parsed with the operator's own API models (``kubeflow-spark-api``), it must
  survive the round trip unchanged; its ``driver.template`` is validated as a Pod and must
  equal the pod template's spec, so the two examples cannot drift apart.
* The PodMonitor keeps Kubernetes' own target labels (``namespace`` is the pod's Kubernetes
  namespace, as the dashboard and the docs read it): no relabeling writes them.
* What no schema knows: the daemon's settings are ones it accepts (it refuses unknown
  ``SIDECAR_*`` variables at start), the grace period covers the daemon's shutdown grace, the
  socket and listener-jar paths agree between the sidecar and the Spark confs, the security
  context is the one the image is tested with.
* The snapshot template's restore init container runs first, with the daemon's Redis and
  store settings and its own arguments as the CLI parses them, on the volume the daemon
  snapshots (read-only) and the driver writes.
* The plain sidecar's watcher script runs for real: it stops the daemon, gracefully, once a
  process that looks like the driver's JVM has come and gone.

Not validated here: the PodMonitor's other fields (a Prometheus Operator CRD: checked against
its field names by test_deploy_monitoring.py), and whether a given Spark Operator version passes
``restartPolicy: Always`` of an init container through its template (the manifests' comments
say how to check on a cluster).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubeflow_spark_api.models.spark_v1beta2_spark_application import (
    SparkV1beta2SparkApplication,
)

from sidecar.cli.main import build_parser
from sidecar.config import Config
from sidecar.ops.client import SidecarClient
from tests.helpers import wait_blob, wait_for
from tests.services import REPO_ROOT, DaemonProcess
from tests.sparkshapes import kafka_progress

DEPLOY = REPO_ROOT / "deploy" / "kubernetes"
NATIVE = DEPLOY / "spark-driver-with-sidecar.yaml"
PLAIN = DEPLOY / "spark-driver-with-sidecar-pre-1.29.yaml"
APP = DEPLOY / "sparkapplication.yaml"
SNAPSHOTS = DEPLOY / "spark-driver-with-snapshots.yaml"
POD_MONITOR = DEPLOY / "monitoring" / "podmonitor.yaml"
#: The Spark Operator release whose SparkApplication CRD the example is validated against: the
#: first with ``driver.template`` (v2.0 has none), the floor the example states.
OPERATOR_CRD = (
    REPO_ROOT / "tests/data/spark-operator-v2.1.0/sparkoperator.k8s.io_sparkapplications.yaml"
)
#: Target labels the Prometheus Operator sets from Kubernetes; a relabeling must not
#: overwrite them (the dashboard's and the docs' `namespace` is the Kubernetes namespace).
POD_MONITOR_TARGET_LABELS = {"namespace", "pod", "container", "job", "instance", "endpoint"}
NATIVE_VERSIONS = ["1.29.0", "1.31.0", "1.33.0", "1.35.0", "1.37.0"]
ALL_VERSIONS = ["1.25.0", "1.27.0", "1.28.0", *NATIVE_VERSIONS]
SIDECAR = "checkpoint-sidecar"
LISTENER_CONFS = {
    "spark.driver.extraClassPath": "/opt/checkpoint-sidecar/lib/checkpoint-sidecar-listener.jar",
    "spark.sql.streaming.streamingQueryListeners": "io.checkpointsidecar.SidecarStreamingListener",
    "spark.checkpointSidecar.socketPath": "/var/run/checkpoint-sidecar/sidecar.sock",
}


def load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict)
    return doc


def pod_specs() -> dict[str, dict[str, Any]]:
    """The pod spec of each example, by file name (the SparkApplication's driver template)."""
    return {
        NATIVE.name: load(NATIVE)["spec"],
        PLAIN.name: load(PLAIN)["spec"],
        APP.name: load(APP)["spec"]["driver"]["template"]["spec"],
        SNAPSHOTS.name: load(SNAPSHOTS)["spec"],
    }


def daemon_container(spec: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = spec.get("initContainers", []) + spec["containers"]
    found = [c for c in containers if c["name"] == SIDECAR]
    assert len(found) == 1, "exactly one checkpoint-sidecar container"
    return found[0]


def literal_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


@pytest.mark.parametrize(
    ("path", "versions"),
    [
        (NATIVE, NATIVE_VERSIONS),
        (PLAIN, ALL_VERSIONS),
        (SNAPSHOTS, NATIVE_VERSIONS),
        (POD_MONITOR, []),
    ],
    ids=["native", "pre-1.29", "snapshots", "podmonitor"],
)
def test_manifests_are_valid_kubernetes_objects_in_strict_mode(
    path: Path, versions: list[str]
) -> None:
    doc = load(path)
    for version in versions:
        kubernetes_validate.validate(doc, version, strict=True)
    if not versions:  # a CRD: at least its identity
        assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")


def test_the_native_template_needs_kubernetes_1_29_and_says_so() -> None:
    """restartPolicy on an init container is unknown before 1.28 (alpha there)."""
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        kubernetes_validate.validate(load(NATIVE), "1.27.0", strict=True)
    assert daemon_container(load(NATIVE)["spec"])["restartPolicy"] == "Always"


def test_the_spark_application_round_trips_through_the_operators_api_models() -> None:
    doc = load(APP)
    app = SparkV1beta2SparkApplication.from_dict(doc)
    assert app is not None
    assert app.to_dict() == doc  # nothing unknown, misspelt or of the wrong type
    template = doc["spec"]["driver"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", **template}
    for version in NATIVE_VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)
    native = load(NATIVE)
    assert template == {"metadata": native["metadata"], "spec": native["spec"]}
    conf = doc["spec"]["sparkConf"]
    assert {k: conf.get(k) for k in LISTENER_CONFS} == LISTENER_CONFS
    assert conf["spark.kubernetes.driver.podTemplateContainerName"] == "spark-kubernetes-driver"


def strict(schema: Any) -> Any:
    """A CRD's structural schema as the API server applies it to a create with field
    validation ``Strict`` (kubectl's default since 1.27): an object's fields are the ones it
    lists, unless it preserves unknown fields."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def operator_schema() -> dict[str, Any]:
    """The v1beta2 SparkApplication schema of the vendored operator CRD, made strict."""
    crd = load(OPERATOR_CRD)
    assert crd["spec"]["names"]["kind"] == "SparkApplication"
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1beta2"]
    schema: dict[str, Any] = strict(version["schema"]["openAPIV3Schema"])
    return schema


def test_the_spark_application_validates_against_the_operator_2_1_crd() -> None:
    schema = operator_schema()
    validator = jsonschema.Draft7Validator(schema)
    doc = load(APP)
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
    assert errors == []
    # What makes 2.1 the floor: driver.template is in its schema (not in 2.0's).
    assert "template" in schema["properties"]["spec"]["properties"]["driver"]["properties"]
    assert "Spark Operator >= 2.1" in APP.read_text()
    # The validation sees a misspelt field and a wrong type.
    typo = load(APP)
    typo["spec"]["driver"]["tempalte"] = typo["spec"]["driver"].pop("template")
    assert any("tempalte" in e.message for e in validator.iter_errors(typo))
    wrong = load(APP)
    wrong["spec"]["driver"]["cores"] = "1"
    assert not validator.is_valid(wrong)
    # The CRD keeps driver.template as it is (preserve-unknown-fields): the test above
    # validates it as a Pod.


def test_the_pod_monitor_keeps_the_kubernetes_namespace_label() -> None:
    doc = load(POD_MONITOR)
    [endpoint] = doc["spec"]["podMetricsEndpoints"]
    relabelings = endpoint.get("relabelings", [])
    written = {r.get("targetLabel") for r in relabelings if r.get("action", "replace") == "replace"}
    assert not written & POD_MONITOR_TARGET_LABELS, (
        f"overwrites {written & POD_MONITOR_TARGET_LABELS}"
    )
    assert not any(r.get("action") in ("labeldrop", "labelmap") for r in relabelings)
    assert not endpoint.get("honorLabels"), "the daemon's own labels must not win either"
    # The application's namespace (the pod label) is kept, under a name of its own.
    [app] = [r for r in relabelings if r.get("targetLabel") == "sidecar_namespace"]
    assert app["sourceLabels"] == ["__meta_kubernetes_pod_label_checkpoint_sidecar_namespace"]


@pytest.mark.parametrize("name", [NATIVE.name, PLAIN.name, APP.name, SNAPSHOTS.name])
def test_the_daemons_settings_are_ones_it_accepts(name: str) -> None:
    container = daemon_container(pod_specs()[name])
    known = {s.metadata["env"] for s in Config.settings()}
    named = {e["name"] for e in container["env"]}
    ours = {n for n in named if n.startswith("SIDECAR_") or n.startswith("AZURE_STORAGE")}
    assert ours <= known, f"unknown settings: {sorted(ours - known)}"
    env = literal_env(container)
    # Secrets and labels come from the cluster; stand-ins of the right shape here.
    env |= {
        "SIDECAR_REDIS_URL": "rediss://:secret@redis.example.com:6380/0",
        "SIDECAR_NAMESPACE": "orders-stream",
        "AZURE_STORAGE_CONNECTION_STRING": "AccountName=a;AccountKey=k",
    }
    config = Config.from_env({k: v for k, v in env.items() if k in known})  # refused: raises
    spec = pod_specs()[name]
    assert spec["terminationGracePeriodSeconds"] >= config.shutdown_grace_s + 10
    assert config.socket_mode == 0o660 and spec["securityContext"]["fsGroup"] == 10001


@pytest.mark.parametrize("name", [NATIVE.name, PLAIN.name, APP.name, SNAPSHOTS.name])
def test_socket_jar_probes_and_security_context_agree(name: str) -> None:
    spec = pod_specs()[name]
    daemon = daemon_container(spec)
    env = literal_env(daemon)
    driver = next(c for c in spec["containers"] if c["name"] == "spark-kubernetes-driver")
    driver_mounts = {m["mountPath"]: m["name"] for m in driver["volumeMounts"]}
    socket_dir = str(Path(env["SIDECAR_SOCKET_PATH"]).parent)
    assert env["SIDECAR_SOCKET_PATH"] == LISTENER_CONFS["spark.checkpointSidecar.socketPath"]
    assert driver_mounts[socket_dir] == "checkpoint-sidecar-socket"
    jar_dir = str(Path(LISTENER_CONFS["spark.driver.extraClassPath"]).parent)
    assert driver_mounts[jar_dir] == "checkpoint-sidecar-lib"
    copier = next(
        c for c in spec["initContainers"] if c["name"] == "checkpoint-sidecar-listener-jar"
    )
    assert LISTENER_CONFS["spark.driver.extraClassPath"] in " ".join(copier["command"])
    assert copier["image"] == daemon["image"]

    port = next(p for p in daemon["ports"] if p["name"] == "sidecar-admin")["containerPort"]
    assert str(port) == env["SIDECAR_METRICS_PORT"]
    assert daemon["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "sidecar-admin"}
    # No readiness probe: the sidecar's readiness is the pod's, and executors resolve the
    # driver through a Service that publishes Ready pods only; a driver waits only for the
    # socket (/startupz), whatever is down.
    assert "readinessProbe" not in daemon
    if "startupProbe" in daemon:
        assert daemon["startupProbe"]["httpGet"] == {"path": "/startupz", "port": "sidecar-admin"}
    for container in (daemon, copier):
        ctx = container["securityContext"]
        assert ctx["runAsNonRoot"] and (ctx["runAsUser"], ctx["runAsGroup"]) == (10001, 10001)
        assert ctx["readOnlyRootFilesystem"] and not ctx["allowPrivilegeEscalation"]
        assert ctx["capabilities"] == {"drop": ["ALL"]}
        assert container["resources"]["limits"]["memory"]


def test_the_snapshot_template_restores_where_the_daemon_snapshots_and_spark_writes() -> None:
    """The restore init container runs first, with the daemon's Redis and store settings, on
    the volume the daemon snapshots (read-only) and the driver writes its checkpoints to."""
    spec = load(SNAPSHOTS)["spec"]
    daemon = daemon_container(spec)
    [restore] = [c for c in spec["initContainers"] if c["name"] == "checkpoint-sidecar-restore"]
    assert spec["initContainers"][0] is restore  # before the daemon and the driver
    assert "restartPolicy" not in restore  # runs to completion
    assert restore["image"] == daemon["image"]
    args = build_parser().parse_args(restore["args"])
    root = literal_env(daemon)["SIDECAR_SNAPSHOT_ROOT"]
    assert (args.command, args.all_root, args.query) == ("restore", root, None)
    shared = {"SIDECAR_REDIS_URL", "SIDECAR_NAMESPACE", "AZURE_STORAGE_CONNECTION_STRING"}
    by_name = {c["name"]: {e["name"]: e for e in c["env"]} for c in (restore, daemon)}
    for name in shared | {"SIDECAR_CONTAINER"}:
        assert by_name[restore["name"]][name] == by_name[daemon["name"]][name], name

    def mount(container: dict[str, Any]) -> dict[str, Any]:
        found: list[dict[str, Any]] = [
            m for m in container["volumeMounts"] if m["name"] == "checkpoints"
        ]
        assert len(found) == 1
        return found[0]

    driver = next(c for c in spec["containers"] if c["name"] == "spark-kubernetes-driver")
    assert mount(restore)["mountPath"] == mount(daemon)["mountPath"] == root
    assert mount(driver)["mountPath"] == root and not mount(driver).get("readOnly")
    assert mount(daemon)["readOnly"] and not mount(restore).get("readOnly")
    [volume] = [v for v in spec["volumes"] if v["name"] == "checkpoints"]
    assert "persistentVolumeClaim" in volume  # outlives the pod, shared with executors
    # Apart from the checkpoints, it is the plain native template.
    native = load(NATIVE)["spec"]
    assert spec["containers"][0]["name"] == native["containers"][0]["name"]
    assert [c["name"] for c in spec["initContainers"][1:]] == [
        c["name"] for c in native["initContainers"]
    ]


def test_the_plain_sidecar_stops_the_daemon_once_the_driver_has_exited(
    daemon_env: dict[str, str], short_tmp: Path
) -> None:
    """The pre-1.29 watcher script, run as the container would run it."""
    container = daemon_container(load(PLAIN)["spec"])
    assert literal_env(container)["DRIVER_MARK"] == "org.apache.spark.deploy.SparkSubmit"
    # The stand-in driver's own mark: this machine may run real Spark drivers meanwhile
    # (other tests' JVMs, on another pytest worker), which the template's mark would match.
    mark = f"org.apache.spark.deploy.SparkSubmit-stand-in-{uuid.uuid4().hex}"
    probe = DaemonProcess(daemon_env)  # not started: picks the admin port, asks /readyz
    env = {
        **os.environ,
        **probe.settings,
        "DRIVER_MARK": mark,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    query = "5e1d0000-0000-4000-8000-0000000000c1"
    log_path = short_tmp / "sidecar.log"
    with open(log_path, "wb") as log:
        watcher = subprocess.Popen(container["command"], env=env, stdout=log, stderr=log)
    driver = None
    try:
        wait_for(lambda: (probe.readyz() or (0, ""))[0] == 200, 60, "the daemon to be ready")
        # A stand-in for the driver's JVM: its command line carries the mark.
        driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", mark])
        anyio.run(post, env["SIDECAR_SOCKET_PATH"], query, 3)
        # The watcher polls every 2 s: give it a look at the running driver (it must not
        # stop the daemon meanwhile), as a real driver, alive for hours, always does.
        time.sleep(3)
        assert watcher.poll() is None, log_path.read_text()
        driver.send_signal(signal.SIGTERM)
        driver.wait(10)
        code = watcher.wait(60)
    finally:
        for proc in (driver, watcher):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    output = log_path.read_text()
    assert code == 0, output
    assert "stopped" in output
    assert wait_blob(daemon_env, query, 3).batch_id == 3  # the final flush ran


async def post(socket_path: str, query: str, batches: int) -> None:
    async with await SidecarClient.connect(socket_path) as client:
        for batch in range(1, batches + 1):
            assert (await client.progress(kafka_progress(query, batch))).applied
