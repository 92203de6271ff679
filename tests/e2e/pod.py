"""deploy/kubernetes/'s driver pod template, rendered for ``podman kube play``.

What a cluster would fill in, filled in here, and what podman 4.3 needs that a kubelet does
not; nothing else of the template changes (no second copy of it is kept anywhere):

* As Spark fills in a driver pod: the pod's name, ``restartPolicy: Never``, the driver
  container's image and args (``spark-submit`` with the confs the template's header names),
  and the ``checkpoint-sidecar/namespace`` label (the submit-time label override).
* As the operator edits the template: the sidecar image (the ``CHANGE ME`` lines).
* The Secrets' and the volumes' names get a per-run suffix: podman's secrets are global to
  its storage, and so is the named volume it makes of an ``emptyDir`` (two pods of one
  template would share it), and test runs may overlap. The Secrets' values go into podman
  secrets (:func:`secret_json`), never into the rendered file.
* ``hostNetwork: true``: the test's redis-server and Azurite listen on the host's loopback.
  With it, podman refuses ``ports`` (it would publish each as a host port; a kubelet treats
  them as documentation), so they go, the admin port is a free one (the host's ports are
  shared with everything else on the machine), and the probes name its number.
* ``supplementalGroups: [<fsGroup>]``: podman ignores ``fsGroup``; a kubelet adds it to every
  container's groups, which is how the driver (uid 185) may connect to the 0660 socket.
  Its other half, the ``emptyDir`` of group ``fsGroup`` with the setgid bit, is the volume
  the test creates before playing the pod (:func:`empty_dirs`): left to podman, a new volume
  is given to whichever container mounts it first -- the driver (uid 185) as often as not,
  and then the daemon cannot create its socket.

``python -m tests.e2e.pod TEMPLATE`` prints a rendering with placeholder values.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.services import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy" / "kubernetes"
NATIVE = DEPLOY / "spark-driver-with-sidecar.yaml"
PLAIN = DEPLOY / "spark-driver-with-sidecar-pre-1.29.yaml"
DRIVER = "spark-kubernetes-driver"
SIDECAR = "checkpoint-sidecar"
NAMESPACE_LABEL = "checkpoint-sidecar/namespace"
#: Where the driver image keeps the application (tests/e2e/driver/Containerfile).
APP = "/opt/app/stream.py"


def load(template: Path) -> dict[str, Any]:
    doc = yaml.safe_load(template.read_text())
    assert isinstance(doc, dict) and doc.get("kind") == "Pod", f"{template}: not a Pod"
    return doc


def listener_confs(template: Path = NATIVE) -> dict[str, str]:
    """The Spark confs that switch the listener on, as the native template's header tells
    the operator to pass them (``--conf k=v`` lines; the pre-1.29 one refers to it), without
    Kubernetes' own."""
    confs = {}
    for key, value in re.findall(r"^#\s+--conf (\S+?)=(\S+)", template.read_text(), re.M):
        if not key.startswith("spark.kubernetes."):
            confs[key] = value
    assert confs, f"{template}'s header names no --conf"
    return confs


def containers(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = [*spec.get("initContainers", []), *spec["containers"]]
    return found


def empty_dirs(doc: Mapping[str, Any]) -> list[str]:
    """The names of the pod's ``emptyDir`` volumes."""
    return [v["name"] for v in doc["spec"]["volumes"] if "emptyDir" in v]


def secret_names(doc: Mapping[str, Any]) -> set[str]:
    """The Secrets the template's containers read (``secretKeyRef``)."""
    return {
        env["valueFrom"]["secretKeyRef"]["name"]
        for c in containers(doc["spec"])
        for env in c.get("env", [])
        if "secretKeyRef" in env.get("valueFrom", {})
    }


def literal_env(all_containers: list[dict[str, Any]], name: str) -> dict[str, str]:
    """The literal ``env`` values of the container ``name``."""
    [container] = [c for c in all_containers if c["name"] == name]
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def secret_json(data: Mapping[str, str]) -> str:
    """A Secret's data as podman keeps it for ``secretKeyRef`` (``podman secret create NAME
    FILE``): JSON of key -> base64 value (podman 4.3 reads only that form)."""
    return json.dumps({k: base64.b64encode(v.encode()).decode() for k, v in data.items()})


def render(
    template: Path,
    *,
    pod_name: str,
    namespace: str,
    sidecar_image: str,
    driver_image: str,
    driver_env: Mapping[str, str],
    admin_port: int,
    suffix: str,
    spark_confs: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The pod ``template`` with the substitutions of this module's docstring.

    ``spark_confs``: more ``--conf`` for the driver, after the template's listener confs.
    """
    doc = copy.deepcopy(load(template))
    doc["metadata"]["name"] = pod_name
    doc["metadata"]["labels"][NAMESPACE_LABEL] = namespace
    spec = doc["spec"]
    spec["restartPolicy"] = "Never"
    spec["hostNetwork"] = True
    fs_group = spec["securityContext"]["fsGroup"]
    spec["securityContext"]["supplementalGroups"] = [fs_group]
    for volume in spec["volumes"]:
        volume["name"] += suffix
    for container in containers(spec):
        for mount in container.get("volumeMounts", []):
            mount["name"] += suffix
        if container["name"] == DRIVER:
            confs = {**listener_confs(), **(spark_confs or {})}
            container["image"] = driver_image
            container["args"] = [
                "spark-submit",
                *(arg for k, v in confs.items() for arg in ("--conf", f"{k}={v}")),
                APP,
            ]
            container["env"] = [{"name": k, "value": v} for k, v in driver_env.items()]
            continue
        assert "example.com" in container["image"], container["image"]
        container["image"] = sidecar_image
        container.pop("ports", None)
        for env in container.get("env", []):
            if env["name"] == "SIDECAR_METRICS_PORT":
                env["value"] = str(admin_port)
            if ref := env.get("valueFrom", {}).get("secretKeyRef"):
                ref["name"] += suffix
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if probe in container:
                container[probe]["httpGet"]["port"] = admin_port
    return doc


def main(argv: list[str]) -> int:
    template = Path(argv[0]) if argv else PLAIN
    doc = render(
        template,
        pod_name="cps-e2e",
        namespace="e2e",
        sidecar_image="localhost/checkpoint-sidecar:0.1.0",
        driver_image="localhost/checkpoint-sidecar-e2e-driver:<hash>",
        driver_env={"QUERY_NAME": "e2e-rate"},
        admin_port=9400,
        suffix="",
    )
    yaml.safe_dump(doc, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
