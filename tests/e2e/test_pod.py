"""deploy/kubernetes/'s Spark driver pod, run for real with ``podman kube play``.

The pod is the pre-1.29 template (podman runs no native sidecar: it refuses probes on init
containers, and an init container would have to exit before the driver starts), rendered by
:mod:`tests.e2e.pod`. Its containers:

* the template's init container, from the sidecar image (``make image``'s script, the tag
  tests/integration/test_container.py builds too), copies the listener jar into the shared
  volume;
* the Spark driver, from tests/e2e/driver/ (a JRE and PySpark from PyPI, nothing of this
  project), runs ``spark-submit`` with the listener switched on by the template's confs
  alone: a rate-micro-batch query into the noop sink, one batch a second;
* the daemon, with the template's settings, against this test's redis-server and Azurite on
  the host's loopback (the pod uses the host's network).

Then the pod is deleted the way a kubelet deletes it: SIGTERM to every container, SIGKILL
only after ``terminationGracePeriodSeconds``. Not with ``podman pod stop`` or ``kube down``:
see :func:`delete`.

Root only (rootful podman, like tests/integration/test_container.py); ``-m "not
container"`` leaves it out. deploy/README.md ("Tried as a pod") has what differs from a
kubelet and the timings.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from tests.e2e import pod as template
from tests.helpers import http_get, lease_state, metric_value, read_blob, wait_for
from tests.services import REPO_ROOT, Azurite, RedisServer, free_port

# A cold run builds both images (the driver's: a Debian base with a JRE, and PySpark).
pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]

#: The sidecar image's tag, as tests/integration/test_container.py builds it: a second build
#: in the same run finds every layer cached.
SIDECAR_IMAGE = "localhost/checkpoint-sidecar:test"
PODMAN = ["bash", str(REPO_ROOT / "scripts" / "podman.sh")]
QUERY_NAME = "e2e-rate"
#: The driver's uid in its image (as in the Apache Spark images).
DRIVER_UID = 185
#: What Spark logs for every micro-batch: the progress JSON, pretty-printed, closed by "}"
#: at the start of a line.
PROGRESS = re.compile(r"Streaming query made progress: (\{.*?\n\})", re.S)
T = TypeVar("T")


def podman(*args: str, timeout_s: float = 120, check: bool = True) -> str:
    """``podman ARGS`` (scripts/podman.sh); its stdout. With ``check``, a non-zero exit fails
    the test, quoting stderr."""
    result = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout_s)
    if check:
        assert result.returncode == 0, f"podman {' '.join(args)}: {result.stderr[-3000:]}"
    return result.stdout


def logs(container: str) -> str:
    """A container's output, stdout and stderr (the daemon and Spark log to stderr)."""
    result = subprocess.run(
        [*PODMAN, "logs", container], capture_output=True, text=True, timeout=60
    )
    return result.stdout + result.stderr


@dataclass
class Timings:
    """What the module measured, in seconds; printed at its end."""

    sidecar_image_s: float = 0.0
    driver_image_s: float = 0.0
    driver_image_built: bool = False
    play_s: float = 0.0
    start_to_first_blob_s: float = 0.0
    stop_s: float = 0.0

    def line(self) -> str:
        driver = "cold" if self.driver_image_built else "warm"
        return (
            f"e2e pod timings: sidecar image {self.sidecar_image_s:.1f} s, driver image "
            f"({driver}) {self.driver_image_s:.1f} s, kube play {self.play_s:.1f} s, pod "
            f"start -> first blob {self.start_to_first_blob_s:.1f} s, stop "
            f"{self.stop_s:.1f} s"
        )


@pytest.fixture(scope="module")
def timings(pytestconfig: pytest.Config) -> Iterator[Timings]:
    measured = Timings()
    yield measured
    # On the terminal, past the output capture: `make test` shows it.
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write("\n")
            reporter.write_line(measured.line())


@pytest.fixture(scope="module")
def sidecar_image(timings: Timings) -> str:
    """The sidecar image, through ``make image``'s script (cached layers make it quick)."""
    start = time.monotonic()
    result = subprocess.run(
        ["bash", "scripts/build_image.sh"],
        cwd=REPO_ROOT,
        env={**os.environ, "ENGINE": "podman", "IMAGE": SIDECAR_IMAGE},
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-5000:]}"
    timings.sidecar_image_s = time.monotonic() - start
    return SIDECAR_IMAGE


@pytest.fixture(scope="module")
def driver_image(timings: Timings) -> str:
    """The Spark driver image (tests/e2e/driver/), built only when its inputs changed."""
    start = time.monotonic()
    result = subprocess.run(
        ["bash", "tests/e2e/build_driver_image.sh"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-5000:]}"
    timings.driver_image_s = time.monotonic() - start
    timings.driver_image_built = "nothing to build" not in result.stderr
    return result.stdout.strip().splitlines()[-1]


@dataclass
class PlayedPod:
    """A pod played from a rendering of a template; the names to ask podman and the store."""

    name: str
    spec: dict[str, Any]
    admin_url: str
    #: The daemon's settings for reading its blobs from here.
    store_env: dict[str, str]
    played_at: float

    def container(self, name: str) -> str:
        """podman's name of the pod's container ``name``."""
        return f"{self.name}-{name}"

    @property
    def driver(self) -> str:
        return self.container(template.DRIVER)

    @property
    def sidecar(self) -> str:
        return self.container(template.SIDECAR)

    def wait_for(self, predicate: Callable[[], T | None], timeout_s: float, what: str) -> T:
        """:func:`tests.helpers.wait_for`, failing with the tails of the pod's logs."""
        try:
            return wait_for(predicate, timeout_s, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log_tails()}") from None

    def log_tails(self) -> str:
        return "\n".join(f"--- {c} ---\n{logs(c)[-4000:]}" for c in (self.driver, self.sidecar))


@pytest.fixture
def played(
    sidecar_image: str,
    driver_image: str,
    redis_server: RedisServer,
    azurite: Azurite,
    namespace: str,
    short_tmp: Path,
    timings: Timings,
) -> Iterator[PlayedPod]:
    """The pre-1.29 template, rendered and played; removed (with its secrets and volumes)
    at teardown."""
    assert os.geteuid() == 0, "the pod test needs root: rootful podman, containers as other uids"
    run = uuid.uuid4().hex[:8]
    suffix = f"-{run}"
    admin_port = free_port()
    doc = template.render(
        template.PLAIN,
        pod_name=f"cps-e2e-{run}",
        namespace=namespace,
        sidecar_image=sidecar_image,
        driver_image=driver_image,
        driver_env={
            "QUERY_NAME": QUERY_NAME,
            # The pod's hostname (its name) resolves to nothing on the host's network; on
            # Kubernetes Spark passes the pod's IP in SPARK_DRIVER_BIND_ADDRESS instead.
            "SPARK_LOCAL_IP": "127.0.0.1",
        },
        admin_port=admin_port,
        suffix=suffix,
        spark_confs={"spark.ui.enabled": "false"},  # no UI port taken on the host
    )
    secrets = {
        "checkpoint-sidecar-redis": {"url": redis_server.url},
        "checkpoint-sidecar-azure": {"connection-string": azurite.connection_string},
    }
    assert template.secret_names(template.load(template.PLAIN)) == set(secrets)
    pod_file = short_tmp / "pod.yaml"
    pod_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    sidecar_env = template.literal_env(template.containers(doc["spec"]), template.SIDECAR)
    pod = PlayedPod(
        name=doc["metadata"]["name"],
        spec=doc["spec"],
        admin_url=f"http://127.0.0.1:{admin_port}",
        store_env={
            "SIDECAR_REDIS_URL": redis_server.url,
            "SIDECAR_NAMESPACE": namespace,
            "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
            "SIDECAR_CONTAINER": sidecar_env["SIDECAR_CONTAINER"],
        },
        played_at=0.0,
    )
    try:
        for name, data in secrets.items():
            path = short_tmp / f"{name}.json"
            path.write_text(template.secret_json(data))
            path.chmod(0o600)
            podman("secret", "create", name + suffix, str(path))
        # The emptyDirs as a kubelet makes them with fsGroup: group fsGroup, setgid (the
        # socket inherits the group), group-writable. podman leaves such a volume as it is
        # (no chown at first use).
        fs_group = doc["spec"]["securityContext"]["fsGroup"]
        for volume in template.empty_dirs(doc):
            podman("volume", "create", "--opt", f"o=uid=0,gid={fs_group}", volume)
            mountpoint = podman("volume", "inspect", "--format", "{{.Mountpoint}}", volume)
            os.chmod(mountpoint.strip(), 0o2775)
        pod.played_at = time.monotonic()
        podman("kube", "play", str(pod_file), timeout_s=300)
        timings.play_s = time.monotonic() - pod.played_at
        yield pod
    finally:
        podman("pod", "rm", "--force", "--time", "0", pod.name, check=False)
        for name in secrets:
            podman("secret", "rm", name + suffix, check=False)
        for volume in template.empty_dirs(doc):
            podman("volume", "rm", "--force", volume, check=False)


def progresses(driver_log: str) -> list[dict[str, Any]]:
    """Every progress the driver's Spark logged, in order."""
    return [json.loads(found) for found in PROGRESS.findall(driver_log)]


def delete(pod: PlayedPod) -> dict[str, int]:
    """Delete the pod as a kubelet does: SIGTERM to each container, SIGKILL to what is left
    after ``terminationGracePeriodSeconds``; the containers' exit codes.

    The driver's SIGTERM first, the sidecar's as soon as the driver has exited. A kubelet
    signals both at once, but the sidecar's shell runs its SIGTERM trap only when its current
    ``sleep 2`` ends, by when the driver's JVM (well under a second to exit) is usually gone:
    this order makes that usual case the tested one (when the watcher was quicker than
    this function, the sidecar has exited by itself, the other way a pod ends).

    Not ``podman pod stop`` / ``kube down`` / ``podman stop``: podman 4.3 marks the containers
    "stopping", and once one of them has exited it stops the pod's infra container, whose
    exit (it is PID 1 of the shared process namespace) SIGKILLs every process in the pod,
    the draining daemon included. A signal sent with ``podman kill`` leaves a container
    "running" until it exits by itself.
    """
    deadline = time.monotonic() + pod.spec["terminationGracePeriodSeconds"]
    codes = {}
    for container in (pod.driver, pod.sidecar):
        # The sidecar may have stopped itself already (its watcher saw the driver go within
        # its `sleep 2`): a kubelet's SIGTERM to an exited container is a no-op, and so is
        # this one then; its exit code is what counts.
        podman("kill", "--signal", "TERM", container, check=container == pod.driver)
        try:
            out = podman("wait", container, timeout_s=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            podman("kill", "--signal", "KILL", pod.driver, pod.sidecar, check=False)
            raise AssertionError(f"{container} outlived the pod's grace period") from None
        codes[container] = int(out)
    return codes


def test_the_driver_pod_checkpoints_and_drains_when_deleted(
    played: PlayedPod, timings: Timings
) -> None:
    pod = played
    confs = template.listener_confs()

    # The daemon is up on the socket in the shared volume, Redis reachable.
    def ready() -> bool:
        answer = http_get(f"{pod.admin_url}/readyz")
        return answer is not None and answer[0] == 200

    pod.wait_for(ready, 120, "the daemon's /readyz")

    # The query runs; its id is what the blob is named after.
    def started() -> str | None:
        found = re.search(r"e2e query started: name=\S+ id=(\S+)", logs(pod.driver))
        return found.group(1) if found else None

    query_id = pod.wait_for(started, 180, "the driver's query to start")

    # The init container put the jar where the driver's conf expects it, and the driver (uid
    # 185, in the socket's group through the pod's security context) loaded the listener
    # from it: the driver image has no other copy.
    jar = confs["spark.driver.extraClassPath"]
    listing = podman(
        "exec", pod.driver, "python3", "-c",
        "import sys, zipfile; print(*zipfile.ZipFile(sys.argv[1]).namelist(), sep='\\n')", jar,
    )  # fmt: skip
    assert "io/checkpointsidecar/SidecarStreamingListener.class" in listing.splitlines()
    uid, groups = podman("exec", pod.driver, "sh", "-c", "id -u; id -G").splitlines()
    fs_group = pod.spec["securityContext"]["fsGroup"]
    assert int(uid) == DRIVER_UID and str(fs_group) in groups.split()
    driver_log = logs(pod.driver)
    socket_path = confs["spark.checkpointSidecar.socketPath"]
    assert f"checkpoint-sidecar listener sends to unix:{socket_path}" in driver_log
    assert f"Registered listener {confs['spark.sql.streaming.streamingQueryListeners']}" in (
        driver_log
    )

    # The listener is connected over the shared socket and its updates are applied.
    def connected() -> bool:
        answer = http_get(f"{pod.admin_url}/metrics")
        if answer is None or answer[0] != 200:
            return False
        applied = metric_value(answer[1], "checkpoint_sidecar_updates_total", result="applied")
        return metric_value(answer[1], "checkpoint_sidecar_connections") == 1 and applied >= 1

    pod.wait_for(connected, 60, "the listener's connection and its first applied update")

    # The first checkpoint reaches the blob (the template's thresholds: within ~10 s).
    first = pod.wait_for(lambda: read_blob(pod.store_env, query_id), 60, "the first checkpoint")
    timings.start_to_first_blob_s = time.monotonic() - pod.played_at
    # Written by this pod's daemon (its host name, the instance identity's default, is the
    # pod's name).
    assert (first.name, first.writer.host) == (QUERY_NAME, pod.name)
    # A few more batches, so that the drain has something to flush.
    pod.wait_for(
        lambda: len(progresses(logs(pod.driver))) >= first.batch_id + 3, 60, "3 more batches"
    )

    # Deleting the pod: the driver stops (its listener says whether everything was
    # acknowledged), the daemon drains, flushes and releases its lease, and exits 0.
    start = time.monotonic()
    codes = delete(pod)
    timings.stop_s = time.monotonic() - start
    driver_log, sidecar_log = logs(pod.driver), logs(pod.sidecar)
    assert codes[pod.sidecar] == 0, (
        f"the daemon exited {codes[pod.sidecar]}:\n{sidecar_log[-3000:]}"
    )
    assert "received SIGTERM again" not in sidecar_log, "the daemon got a second SIGTERM"
    assert "listener at JVM shutdown: everything delivered" in driver_log, driver_log[-3000:]
    last = progresses(driver_log)[-1]
    doc = read_blob(pod.store_env, query_id)
    assert doc is not None, "no checkpoint in the blob"
    assert (doc.query_id, doc.run_id, doc.batch_id) == (
        last["id"], last["runId"], last["batchId"],
    ), "the blob holds the driver's last reported batch"  # fmt: skip
    [source] = doc.sources
    assert json.loads(bytes(source.end_offset)) == last["sources"][0]["endOffset"]
    assert lease_state(pod.store_env, query_id) == "available", "the lease was released"
    assert "HELD -> RELEASED" in sidecar_log
