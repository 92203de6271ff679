"""The container image, built by ``make image``'s script and run the way the pod runs it.

The daemon's container gets the pod's security settings (read-only root file system without
any writable tmpfs, no capabilities, no new privileges, uid/gid 10001, a memory limit) and the
host's network, and talks to this test's redis-server and Azurite on loopback. The socket
directory is a host directory shared like the pod's ``emptyDir`` with ``fsGroup: 10001``
(group 10001, setgid); the "Spark driver" is a second container from the same image running
as another uid (185, as in the Apache Spark images) with group 10001 added, which posts
progress over the socket; a third, outside the group, is refused.

The image is built the way a clean checkout builds it: from a copy of the work tree's files
that git tracks or would (no listener jar, no venv, nothing ignored), so the Dockerfile's own
listener stage compiles the jar; the jar copied out of the image is then loaded by a real
PySpark driver (PySpark 4, and 3.5 in `make test`'s second run), whose query's last batch
reaches the blob through a daemon.

The image as built is checked too: its OCI labels (version, the git commit), the CycloneDX
SBOM that ``make image`` writes beside it (every distribution in the image at the version
installed there, and exactly the hashed lock's pins), no pip, setuptools or build tools in the
final stage, bytecode compiled, and its size budget.

podman, always (scripts/podman.sh: the project's containers.conf and storage): the build
machines have no Docker daemon. Root only, like ``make setup``'s apt installs (rootful
podman, a directory of group 10001, containers as other uids). ``-m "not container"`` leaves
these tests out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import tomllib
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers import http_get, lease_state, read_blob, wait_blob, wait_for
from tests.services import REPO_ROOT, Azurite, DaemonProcess, RedisServer, free_port
from tests.sparkshapes import kafka_progress

# Building from cold (installing podman, making the Debian base) takes a few minutes.
pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]

IMAGE = "localhost/checkpoint-sidecar:test"
PODMAN = ["bash", str(REPO_ROOT / "scripts" / "podman.sh")]
#: The pod's fsGroup: the daemon's own gid, added to the driver container's groups.
SHARED_GID = 10001
DRIVER_UID = 185
OUTSIDER_UID = 186
#: What OpenShift's restricted SCCs run every container of a pod as: a uid from the project's
#: range (this one is of the kind it assigns), group 0, no /etc/passwd entry.
ARBITRARY_UID = 1000650000
MEMORY_LIMIT = "256m"
VERSION = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
#: The image's size budget (issue #22): the local runtime base (~96 MB) plus the venv (~51 MB).
MAX_IMAGE_BYTES = 160_000_000
#: Where the image's SIDECAR_SOCKET_PATH points.
SOCKET_DIR = "/var/run/checkpoint-sidecar"
#: The pod's securityContext, for every container of the test.
LOCKED_DOWN = [
    "--read-only",
    "--read-only-tmpfs=false",  # readOnlyRootFilesystem gives no writable /tmp or /run
    "--cap-drop=ALL",
    "--security-opt=no-new-privileges",
    f"--memory={MEMORY_LIMIT}",
]

#: The driver's side, stdlib only, run by the image's Python: send each stdin line over
#: the socket, print each reply; exit 3 with the errno's name when connecting fails.
CLIENT = """
import errno, socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print(errno.errorcode[exc.errno])
    sys.exit(3)
replies = s.makefile("rb")
for frame in sys.stdin.buffer.read().splitlines(keepends=True):
    s.sendall(frame)
    sys.stdout.write(replies.readline().decode())
"""


def podman(*args: str, timeout_s: float = 120, stdin: str | None = None) -> str:
    """Run ``podman ARGS``; its stdout. Fails the test, quoting stderr, on a non-zero exit."""
    result = podman_rc(*args, timeout_s=timeout_s, stdin=stdin)
    assert result.returncode == 0, f"podman {' '.join(args)}: {result.stderr[-3000:]}"
    return result.stdout


def podman_rc(
    *args: str, timeout_s: float = 120, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PODMAN, *args], input=stdin, capture_output=True, text=True, timeout=timeout_s
    )


@dataclass(frozen=True)
class Built:
    image: str
    #: The CycloneDX SBOM the script wrote beside the image.
    sbom: Path


def clean_checkout(dest: Path) -> Path:
    """What a clean checkout of this work tree holds, copied to ``dest``: every file git
    tracks or would track (new files too, uncommitted changes as they are), nothing it
    ignores: no listener jar (spark_bridge/jars/), no venv, no .tools."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file() or source.is_symlink():  # a tracked file deleted here: gone
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name, follow_symlinks=False)
    assert (dest / "Dockerfile").is_file()
    assert not (dest / "spark_bridge" / "jars").exists(), "a clean checkout has no jar"
    return dest


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The image, built through scripts/build_image.sh from a clean checkout of this tree
    (:func:`clean_checkout`: no jar built), with this tree's engine, bases and layer cache
    (cached layers make it quick; tests/e2e's build of the same tag from the work tree finds
    every layer cached: the build context is the same)."""
    sbom = tmp_path_factory.mktemp("sbom") / f"checkpoint-sidecar-{VERSION}.cdx.json"
    context = clean_checkout(tmp_path_factory.mktemp("checkout"))
    result = subprocess.run(
        ["bash", "scripts/build_image.sh"],
        cwd=REPO_ROOT,
        env={
            **os.environ,
            "ENGINE": "podman",
            "IMAGE": IMAGE,
            "SBOM_FILE": str(sbom),
            "CONTEXT": str(context),
        },
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-5000:]}"
    return Built(IMAGE, sbom)


@pytest.fixture(scope="module")
def image(built: Built) -> str:
    return built.image


@pytest.fixture
def socket_dir(short_tmp: Path) -> Path:
    """The pod's emptyDir with fsGroup: group SHARED_GID, setgid (the socket inherits the
    group), no write for others. Searchable by all, so an outsider is refused by the socket
    file's own mode, not by the directory."""
    assert os.geteuid() == 0, (
        "the container test needs root: rootful podman, a directory of group 10001, other uids"
    )
    path = short_tmp / "run"
    path.mkdir()
    os.chown(path, 0, SHARED_GID)
    os.chmod(path, 0o2775)
    return path


@pytest.fixture
def container() -> Iterator[str]:
    """A unique container name; the container is removed at teardown."""
    name = f"cps-test-{uuid.uuid4().hex[:8]}"
    yield name
    podman_rc("rm", "--force", "--time", "0", name)


def post_as(
    image: str,
    socket_dir: Path | str,
    uid: int,
    groups: list[int],
    frames: list[str],
    gid: int | None = None,
) -> tuple[int, str]:
    """Run CLIENT in a container of ``image`` as ``uid`` (primary group ``gid``, by default
    the uid's number) with ``groups`` added, the socket directory (a host directory or a named
    volume) mounted read-only (as the driver's pod template does); (exit code, stdout)."""
    result = podman_rc(
        "run", "--rm", "-i", "--network=none", *LOCKED_DOWN,
        f"--user={uid}:{uid if gid is None else gid}", *(f"--group-add={g}" for g in groups),
        f"--volume={socket_dir}:{SOCKET_DIR}:ro",
        "--entrypoint=python", image, "-c", CLIENT, f"{SOCKET_DIR}/sidecar.sock",
        stdin="".join(f + "\n" for f in frames),
    )  # fmt: skip
    assert result.returncode in (0, 3), result.stderr[-3000:]
    return result.returncode, result.stdout


def progress_frame(query_id: str, batch: int) -> str:
    return json.dumps({"op": "progress", "id": batch, "progress": kafka_progress(query_id, batch)})


def test_image_runs_with_the_pods_security_settings(
    image: str,
    own_redis: RedisServer,
    azurite: Azurite,
    namespace: str,
    socket_dir: Path,
    container: str,
) -> None:
    admin = f"http://127.0.0.1:{free_port()}"
    env = {
        "SIDECAR_REDIS_URL": own_redis.url,
        "SIDECAR_NAMESPACE": namespace,
        "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
        "SIDECAR_CONTAINER": "checkpoints",
        "SIDECAR_METRICS_HOST": "127.0.0.1",
        "SIDECAR_METRICS_PORT": admin.rsplit(":", 1)[1],
        "SIDECAR_SOCKET_MODE": "660",
        "SIDECAR_LEASE_DURATION_S": "15",
        # Flush after 3 updates, never by age: a 4th update waits for the final flush.
        "SIDECAR_COUNT_THRESHOLD": "3",
        "SIDECAR_TIME_THRESHOLD_S": "3600",
        "SIDECAR_FLUSH_INTERVAL_S": "0.1",
    }
    podman(
        "run", "--detach", f"--name={container}", "--network=host", "--http-proxy=false",
        *LOCKED_DOWN, f"--user=10001:{SHARED_GID}",
        f"--volume={socket_dir}:{SOCKET_DIR}",
        *(f"--env={k}={v}" for k, v in env.items()),
        image,
    )  # fmt: skip

    def logs() -> str:
        result = podman_rc("logs", container)
        return result.stdout + result.stderr

    def wait_ready(status: int, what: str, timeout_s: float = 60) -> None:
        def answered() -> bool:
            answer = http_get(f"{admin}/readyz")
            return answer is not None and answer[0] == status

        try:
            wait_for(answered, timeout_s, f"/readyz {status} {what}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the daemon's log ends:\n{logs()[-3000:]}") from None

    wait_ready(200, "after start")
    assert http_get(f"{admin}/healthz") == (200, "ok\n")
    sock = os.stat(socket_dir / "sidecar.sock")
    assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o660
    assert (sock.st_uid, sock.st_gid) == (10001, SHARED_GID)

    # The driver (another uid, in the shared group) posts three batches: one flush.
    query_id = str(uuid.uuid4())
    code, out = post_as(
        image, socket_dir, DRIVER_UID, [SHARED_GID], [progress_frame(query_id, b) for b in range(3)]
    )
    assert code == 0
    assert [json.loads(line) for line in out.splitlines()] == [
        {"id": b, "ok": True, "applied": True} for b in range(3)
    ]
    assert wait_blob(env, query_id, 2).batch_id == 2

    # A uid outside the group may not connect.
    assert post_as(image, socket_dir, OUTSIDER_UID, [], [progress_frame(query_id, 9)]) == (
        3,
        "EACCES\n",
    )

    # Redis stops: not ready; Redis is back: ready again.
    own_redis.stop()
    wait_ready(503, "while Redis is stopped", 30)
    answer = http_get(f"{admin}/readyz")
    assert answer is not None and "is unreachable" in answer[1]
    own_redis.start()
    wait_ready(200, "after Redis restarted")

    # A 4th batch stays pending (below the count threshold) until the stop's final flush.
    code, out = post_as(image, socket_dir, DRIVER_UID, [SHARED_GID], [progress_frame(query_id, 3)])
    assert (code, json.loads(out)) == (0, {"id": 3, "ok": True, "applied": True})
    doc = read_blob(env, query_id)
    assert doc is not None and doc.batch_id == 2

    podman("stop", "--time", "30", container, timeout_s=60)
    assert podman("inspect", "--format", "{{.State.ExitCode}}", container).strip() == "0"
    doc = read_blob(env, query_id)
    assert doc is not None and doc.batch_id == 3, "the final flush wrote the pending batch"
    assert lease_state(env, query_id) == "available", "the lease was released"
    assert "final flush" in logs()
    assert not (socket_dir / "sidecar.sock").exists(), "the socket file is removed on stop"


def test_image_runs_as_an_arbitrary_uid_in_group_0(
    image: str,
    redis_server: RedisServer,
    azurite: Azurite,
    namespace: str,
    short_tmp: Path,
    container: str,
) -> None:
    """OpenShift's restricted SCCs: the image's uid replaced by an arbitrary one in group 0,
    without a name (``--passwd=false``: no /etc/passwd entry), with the pod's read-only root
    and no writable tmpfs. The socket directory is one that only group 0 may write (root's,
    0770, as the image's own is): the daemon binds there, the driver -- the same uid, as the
    SCC gives every container of a pod -- posts three batches, they reach the blob, and a stop
    is clean. Without a volume (a plain ``docker run``, writable root) the image's own socket
    directory is writable by that uid through group 0."""
    assert os.geteuid() == 0, "the container test needs root: rootful podman, other uids"
    socket_dir = short_tmp / "run"
    socket_dir.mkdir()
    os.chown(socket_dir, 0, 0)
    os.chmod(socket_dir, 0o770)
    admin = f"http://127.0.0.1:{free_port()}"
    env = {
        "SIDECAR_REDIS_URL": redis_server.url,
        "SIDECAR_NAMESPACE": namespace,
        "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
        "SIDECAR_CONTAINER": "checkpoints",
        "SIDECAR_METRICS_HOST": "127.0.0.1",
        "SIDECAR_METRICS_PORT": admin.rsplit(":", 1)[1],
        "SIDECAR_SOCKET_MODE": "660",
        "SIDECAR_COUNT_THRESHOLD": "3",
        "SIDECAR_TIME_THRESHOLD_S": "3600",
        "SIDECAR_FLUSH_INTERVAL_S": "0.1",
    }
    arbitrary = [f"--user={ARBITRARY_UID}:0", "--passwd=false"]
    podman(
        "run", "--detach", f"--name={container}", "--network=host", "--http-proxy=false",
        *LOCKED_DOWN, *arbitrary, f"--volume={socket_dir}:{SOCKET_DIR}",
        *(f"--env={k}={v}" for k, v in env.items()),
        image,
    )  # fmt: skip

    def ready() -> bool:
        answer = http_get(f"{admin}/readyz")
        return answer is not None and answer[0] == 200

    try:
        wait_for(ready, 60, "/readyz 200 as an arbitrary uid")
    except AssertionError as exc:
        logs = podman_rc("logs", container)
        tail = (logs.stdout + logs.stderr)[-3000:]
        raise AssertionError(f"{exc}; the daemon's log ends:\n{tail}") from None
    # The socket is this uid's, in group 0, 0660.
    sock = os.stat(socket_dir / "sidecar.sock")
    assert (sock.st_uid, sock.st_gid, stat.S_IMODE(sock.st_mode)) == (ARBITRARY_UID, 0, 0o660)
    # The admin commands name their user without an /etc/passwd entry.
    who = podman(
        "exec", container, "python", "-c", "from sidecar.ops.admin_tool import who; print(who())"
    )
    assert who.startswith(f"uid {ARBITRARY_UID}@"), who

    query_id = str(uuid.uuid4())
    frames = [progress_frame(query_id, b) for b in range(3)]
    code, out = post_as(image, socket_dir, ARBITRARY_UID, [], frames, gid=0)
    assert code == 0, out
    assert [json.loads(line) for line in out.splitlines()] == [
        {"id": b, "ok": True, "applied": True} for b in range(3)
    ]
    assert wait_blob(env, query_id, 2).batch_id == 2

    podman("stop", "--time", "30", container, timeout_s=60)
    assert podman("inspect", "--format", "{{.State.ExitCode}}", container).strip() == "0"
    assert not (socket_dir / "sidecar.sock").exists(), "the socket file is removed on stop"

    # No volume, a writable root: the image's own socket directory takes a socket file.
    own = podman_rc(
        "run", "--rm", "--network=none", *arbitrary, "--entrypoint=python", image, "-c",
        "import os, socket; s = socket.socket(socket.AF_UNIX); "
        f"s.bind('{SOCKET_DIR}/probe.sock'); os.unlink('{SOCKET_DIR}/probe.sock')",
    )  # fmt: skip
    assert own.returncode == 0, f"{SOCKET_DIR} is not writable by group 0: {own.stderr[-2000:]}"


def copy_listener_jar(image: str, lib: Path) -> Path:
    """deploy/kubernetes/'s init container, run as written: the JVM listener jar copied out of
    the image into ``lib`` (so the Spark image needs nothing of this project)."""
    template = yaml.safe_load(
        (REPO_ROOT / "deploy/kubernetes/spark-driver-with-sidecar.yaml").read_text()
    )
    copier = next(
        c for c in template["spec"]["initContainers"] if c["name"].endswith("listener-jar")
    )
    lib.mkdir()
    os.chown(lib, 10001, 10001)
    mount = copier["volumeMounts"][0]["mountPath"]
    podman(
        "run", "--rm", "--network=none", *LOCKED_DOWN, "--user=10001:10001",
        f"--volume={lib}:{mount}", f"--entrypoint={copier['command'][0]}",
        image, *copier["command"][1:],
    )  # fmt: skip
    return lib / "checkpoint-sidecar-listener.jar"


def test_the_pod_templates_jar_copier_finds_the_listener_in_the_image(
    image: str, short_tmp: Path
) -> None:
    with zipfile.ZipFile(copy_listener_jar(image, short_tmp / "lib")) as jar:
        assert "io/checkpointsidecar/SidecarStreamingListener.class" in jar.namelist()
        manifest = jar.read("META-INF/MANIFEST.MF").decode()
    assert f"Implementation-Version: {VERSION}" in manifest  # compiled in the build, from here


def test_the_image_keeps_the_driver_side_where_the_docs_say(image: str, short_tmp: Path) -> None:
    """docs/spark-bridge.md's copy, run as written (podman create, cp, rm): the bridge's wheel
    (checkpoint-sidecar-bridge, Python 3.8+, the Spark side alone) and the listener jar in
    /opt/checkpoint-sidecar/bridge/, the jar the same inside the wheel, beside it and in what
    the pod template's init container copies."""
    dest = short_tmp / "bridge"
    container = podman("create", image).strip()
    try:
        podman("cp", f"{container}:/opt/checkpoint-sidecar/bridge/.", str(dest))
    finally:
        podman("rm", container)
    wheel_name = f"checkpoint_sidecar_bridge-{VERSION}-py3-none-any.whl"
    assert sorted(p.name for p in dest.iterdir()) == [
        "checkpoint-sidecar-listener.jar",
        wheel_name,
    ]
    jar = (dest / "checkpoint-sidecar-listener.jar").read_bytes()
    with zipfile.ZipFile(dest / wheel_name) as wheel:
        assert wheel.read("spark_bridge/jars/checkpoint-sidecar-listener.jar") == jar
        assert not [n for n in wheel.namelist() if n.startswith("sidecar/")]
        metadata = wheel.read(f"checkpoint_sidecar_bridge-{VERSION}.dist-info/METADATA").decode()
    assert "Name: checkpoint-sidecar-bridge\n" in metadata
    assert "Requires-Python: >=3.8\n" in metadata
    assert copy_listener_jar(image, short_tmp / "lib").read_bytes() == jar


#: A Spark driver with the listener switched on by the pod template's confs alone (the jar on
#: the driver's class path, the class, the socket): a rate query to batch 3, stopped.
JAR_DRIVER = textwrap.dedent(
    """
    import sys, time
    from pyspark.sql import SparkSession

    jar, socket_path, checkpoint = sys.argv[1:4]
    spark = (
        SparkSession.builder.master("local[1]").appName("image-jar")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.extraClassPath", jar)
        .config("spark.sql.streaming.streamingQueryListeners",
                "io.checkpointsidecar.SidecarStreamingListener")
        .config("spark.checkpointSidecar.socketPath", socket_path)
        .getOrCreate()
    )
    query = (
        spark.readStream.format("rate-micro-batch").option("rowsPerBatch", "5").load()
        .writeStream.format("noop").queryName("image-jar")
        .trigger(processingTime="200 milliseconds")
        .option("checkpointLocation", checkpoint).start()
    )
    deadline = time.monotonic() + 90
    while (query.lastProgress or {}).get("batchId", -1) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    query.stop()
    print(query.id, query.lastProgress["batchId"], spark.version)
    spark.stop()
    """
)


@pytest.mark.spark
def test_spark_loads_the_images_listener_jar(
    image: str, daemon_env: dict[str, str], procs: list[DaemonProcess], short_tmp: Path
) -> None:
    """The jar the image's build compiled, as the pod's init container copies it out, is the
    driver's listener: a real PySpark driver (this run's: 4, or 3.5) loads it from its class
    path by conf, and its query's last batch reaches the blob through a daemon."""
    jar = copy_listener_jar(image, short_tmp / "lib")
    env = {**daemon_env, "SIDECAR_COUNT_THRESHOLD": "1"}
    daemon = DaemonProcess(env, short_tmp / "daemon.log")
    procs.append(daemon)
    daemon.start()
    driver = short_tmp / "driver.py"
    driver.write_text(JAR_DRIVER)
    driver_env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    driver_env.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    driver_env.pop("PYTHONPATH", None)  # nothing of this checkout: the jar alone
    result = subprocess.run(
        [sys.executable, str(driver), str(jar), env["SIDECAR_SOCKET_PATH"], str(short_tmp / "ck")],
        env=driver_env, cwd=short_tmp, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    query_id, last, spark_version = result.stdout.split()[-3:]
    assert int(last) >= 3
    assert wait_blob(env, query_id, int(last)).batch_id == int(last)
    print(f"Spark {spark_version} loaded the image's listener jar; batch {last} in the blob")


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def in_image(image: str, *command: str) -> subprocess.CompletedProcess[str]:
    """Run COMMAND (its first word the entrypoint) in a locked-down, offline container."""
    return podman_rc(
        "run", "--rm", "--network=none", *LOCKED_DOWN, f"--entrypoint={command[0]}",
        image, *command[1:],
    )  # fmt: skip


def test_the_image_is_labelled_and_its_sbom_lists_what_it_runs(built: Built) -> None:
    labels = json.loads(podman("image", "inspect", "--format", "{{json .Labels}}", built.image))
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    oci = {k.removeprefix("org.opencontainers.image."): v for k, v in labels.items()}
    assert oci["revision"] == head
    assert oci["version"] == VERSION
    assert (oci["title"], oci["licenses"]) == ("checkpoint-sidecar", "Apache-2.0")
    assert oci["description"] and "source" in oci  # empty when git has no public origin

    # What the image's own Python says is installed in it...
    listing = in_image(
        built.image, "python", "-c",
        "import importlib.metadata as m, json; "
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))",
    )  # fmt: skip
    assert listing.returncode == 0, listing.stderr
    installed = {canonical(k): v for k, v in json.loads(listing.stdout).items()}
    assert installed.pop("checkpoint-sidecar") == VERSION

    # ... is what the SBOM beside it lists (the project itself as its root component) ...
    sbom = json.loads(built.sbom.read_text())
    assert sbom["bomFormat"] == "CycloneDX"
    root = sbom["metadata"]["component"]
    assert (root["name"], root["version"]) == ("checkpoint-sidecar", VERSION)
    listed = {canonical(c["name"]): c["version"] for c in sbom["components"]}
    assert listed == installed
    assert {"redis", "azure-storage-blob", "aiohttp", "uvloop", "msgspec"} <= listed.keys()

    # ... and exactly the hashed lock's pins: an unchanged tree rebuilds to the same versions.
    lock = (REPO_ROOT / "requirements" / "image.txt").read_text()
    pins = {canonical(n): v for n, v in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", lock, re.M)}
    assert pins == listed


def test_the_final_image_has_no_installer_or_build_tools_and_fits_its_budget(image: str) -> None:
    pip = in_image(image, "python", "-m", "pip", "--version")
    assert pip.returncode != 0 and "No module named pip" in pip.stderr
    found = in_image(
        image, "python", "-c",
        "import importlib.util as u; "
        "print([m for m in ('pip', 'setuptools', 'wheel') if u.find_spec(m)])",
    )  # fmt: skip
    assert (found.returncode, found.stdout.strip()) == (0, "[]"), found.stderr
    tools = "pip pip3 apt-get gcc cc strip javac"
    which = in_image(image, "sh", "-c", f"for t in {tools}; do command -v $t; done; true")
    assert (which.returncode, which.stdout) == (0, "")

    # Bytecode is there already (the root file system is read-only: none is written at run).
    compiled = in_image(
        image, "python", "-c",
        "import importlib.util as u, os, sidecar.cli.main as m, uvloop, azure.storage.blob as b; "
        "print(all(os.path.exists(u.cache_from_source(x.__file__)) for x in (m, uvloop, b)))",
    )  # fmt: skip
    assert (compiled.returncode, compiled.stdout.strip()) == (0, "True"), compiled.stderr

    size = int(podman("image", "inspect", "--format", "{{.Size}}", image))
    assert size <= MAX_IMAGE_BYTES, f"the image is {size / 1e6:.0f} MB (budget 160 MB)"
