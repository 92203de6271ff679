"""The shipped pod templates through Spark's own submission code, in the JVM of this PySpark.

A native sidecar is an init container with ``restartPolicy: Always``; if Spark's Kubernetes
client dropped that field while reading the template, the daemon would run as a plain init
container that never exits, and the pod would hang in ``Init:0/1``. PySpark 3.5 bundles
fabric8 6.7.2, whose ``Container`` model has no ``restartPolicy`` (it can only keep it among
unknown properties); PySpark 4 bundles fabric8 7.x, whose model has it. So the round trip is run
under both (``pytest.mark.spark``), through the code ``spark-submit --deploy-mode cluster`` runs:

* ``KubernetesClientApplication.start``, Spark's entry point for a Kubernetes cluster-mode
  submission, with ``spark.kubernetes.driver.podTemplateFile`` set to the template: it builds
  the driver's conf, loads the template (``KubernetesUtils.loadPodFromTemplate``: fabric8's
  ``pods().load``, then the driver container picked by ``podTemplateContainerName``), runs the
  driver feature steps (``KubernetesDriverBuilder``), adds its conf volume and creates the pod
  with the client ``SparkKubernetesClientFactory`` makes, serialized by that client.
* The API server is a fake (``FakeApiServer``) on a free port: it records what Spark sends and
  answers as the API server would (a create gets its object back with a uid, a server-side
  apply its object), so the assertions read the bytes a real API server would receive.

Checked, for each template: every init container arrives exactly as written (the sidecar's
``restartPolicy: Always``, probes, env, ports, resources, volume mounts, security context), and
so does the pre-1.29 template's sidecar under ``containers``; the pod's volumes, security
context and other settings of the template, its labels and annotations are kept; the driver
container keeps its volume mounts; no NetworkPolicy Spark creates (PySpark 4 creates one for
the executors) selects the driver pod, where Prometheus scrapes the sidecar. The
SparkApplication's ``driver.template`` goes through the same path, written to a file as the Spark
Operator writes it (metadata and spec, no ``kind``) before it runs spark-submit.

Not covered: what the API server and the kubelet then do (a cluster before 1.29 refuses or
ignores the field: kubernetes-validate checks that in test_deploy_kubernetes.py), and whether
a Spark Operator version keeps the field while decoding the SparkApplication (its Go API
types, before spark-submit runs).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from tests.services import REPO_ROOT

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

DEPLOY = REPO_ROOT / "deploy" / "kubernetes"
DRIVER = "spark-kubernetes-driver"
SIDECAR = "checkpoint-sidecar"
NAMESPACE = "spark-jobs"
#: What a submission needs besides the template; the template header's listener confs are not
#: needed: Spark passes them to the driver in its conf map, not in the pod.
SUBMIT_CONFS = {
    "spark.app.name": "orders-stream",
    "spark.submit.deployMode": "cluster",
    "spark.kubernetes.namespace": NAMESPACE,
    "spark.kubernetes.container.image": "registry.example.com/spark:test",
    "spark.kubernetes.driver.podTemplateContainerName": DRIVER,
    # Return once the pod and its resources are created: nothing here would ever run it.
    "spark.kubernetes.submission.waitAppCompletion": "false",
}


@dataclass(frozen=True)
class ApiRequest:
    method: str
    path: str
    body: dict[str, Any]


class FakeApiServer:
    """A Kubernetes API server for one submission: records each request and echoes its object.

    A create (POST) is answered 201 with the object and a uid (Spark sets the pod's uid as the
    owner of the resources it creates next), a server-side apply (PATCH) 200 with the object,
    anything else (a GET: no watch is started without waitAppCompletion) 404.
    """

    def __init__(self) -> None:
        self.requests: list[ApiRequest] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def created(self, kind: str) -> list[dict[str, Any]]:
        return [r.body for r in self.requests if r.body.get("kind") == kind]

    def __enter__(self) -> FakeApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self._record()
                body.setdefault("metadata", {})["uid"] = "00000000-0000-0000-0000-000000000001"
                self._reply(201, body)

            def do_PATCH(self) -> None:
                self._reply(200, self._record())

            def do_GET(self) -> None:
                api.requests.append(ApiRequest("GET", self.path, {}))
                self._reply(404, {"kind": "Status", "apiVersion": "v1", "code": 404})

            def _record(self) -> dict[str, Any]:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                # A create is JSON; a server-side apply is sent as application/apply-patch+yaml.
                ctype = self.headers.get("Content-Type", "")
                body = json.loads(raw) if "json" in ctype else yaml.safe_load(raw)
                assert isinstance(body, dict)
                api.requests.append(ApiRequest(self.command, self.path, body))
                return body

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the assertions say what was sent

        return Handler


@pytest.fixture
def api_server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


def submit(spark: SparkSession, template: Path, api: FakeApiServer) -> dict[str, Any]:
    """Submit a cluster-mode application with the driver pod template, as spark-submit does;
    returns the driver pod as the API server received it."""
    jvm = spark._jvm
    assert jvm is not None
    conf = jvm.org.apache.spark.SparkConf(False)
    for key, value in {
        **SUBMIT_CONFS,
        "spark.master": f"k8s://{api.url}",
        "spark.kubernetes.driver.podTemplateFile": str(template),
    }.items():
        conf.set(key, value)
    # What SparkSubmit passes to a JVM application without a primary resource.
    args = spark.sparkContext._gateway.new_array(jvm.java.lang.String, 2)  # type: ignore[union-attr]
    args[0], args[1] = "--main-class", "org.example.OrdersStream"
    jvm.org.apache.spark.deploy.k8s.submit.KubernetesClientApplication().start(args, conf)
    pods = api.created("Pod")
    assert len(pods) == 1, [(r.method, r.path) for r in api.requests]
    return pods[0]


def operator_template_file(tmp_path: Path) -> Path:
    """The SparkApplication's driver.template as the Spark Operator hands it to spark-submit: a
    file with the template's metadata and spec (no apiVersion, no kind)."""
    app = yaml.safe_load((DEPLOY / "sparkapplication.yaml").read_text())
    path = tmp_path / "driver-pod-template.yaml"
    path.write_text(yaml.safe_dump(app["spec"]["driver"]["template"]))
    return path


def by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in items}


@pytest.mark.parametrize(
    "template",
    [
        "spark-driver-with-sidecar.yaml",
        "spark-driver-with-snapshots.yaml",
        "spark-driver-with-sidecar-pre-1.29.yaml",
        "sparkapplication.yaml",
    ],
)
def test_the_sidecar_survives_sparks_own_template_loader(
    spark: SparkSession, api_server: FakeApiServer, tmp_path: Path, template: str
) -> None:
    if template == "sparkapplication.yaml":
        path = operator_template_file(tmp_path)
    else:
        path = DEPLOY / template
    written = yaml.safe_load(path.read_text())
    pod = submit(spark, path, api_server)
    spec, want = pod["spec"], written["spec"]
    assert pod["metadata"]["labels"]["spark-version"] == spark.version  # this PySpark's code

    # Every init container exactly as written, in order: Spark manages none of them.
    assert spec.get("initContainers", []) == want.get("initContainers", [])
    containers, wanted = by_name(spec["containers"]), by_name(want["containers"])
    sidecar = {**by_name(spec.get("initContainers", [])), **containers}[SIDECAR]
    # Spelled out, though the equalities cover them: what the pod cannot do without.
    assert {"livenessProbe", "securityContext", "volumeMounts"} <= sidecar.keys()
    if template == "spark-driver-with-sidecar-pre-1.29.yaml":
        assert sidecar == wanted[SIDECAR]  # a plain second container, also untouched
    else:
        assert sidecar["restartPolicy"] == "Always"
        assert "startupProbe" in sidecar  # gates the driver's start

    # The driver: Spark fills it in (image, command, env, ports, resources) and keeps the
    # template's volume mounts.
    driver = containers[DRIVER]
    assert driver["image"] == SUBMIT_CONFS["spark.kubernetes.container.image"]
    for mount in wanted[DRIVER]["volumeMounts"]:
        assert mount in driver["volumeMounts"]

    # The pod: the template's volumes and settings kept; Spark adds its own volumes and its
    # restartPolicy: Never (the template sets none at pod level).
    for volume in want["volumes"]:
        assert by_name(spec["volumes"])[volume["name"]] == volume
    for key, value in want.items():
        if key not in {"initContainers", "containers", "volumes"}:
            assert spec[key] == value, key
    for field in ("labels", "annotations"):
        assert written["metadata"][field].items() <= pod["metadata"][field].items()

    # PySpark 4 creates a NetworkPolicy for the executors; a policy selecting the driver pod
    # would cut Prometheus off the sidecar's metrics port.
    labels = pod["metadata"]["labels"]
    for policy in api_server.created("NetworkPolicy"):
        selector = policy["spec"]["podSelector"]["matchLabels"]
        assert not selector.items() <= labels.items(), policy
