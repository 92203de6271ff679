"""The laptop quickstart (deploy/compose/compose.yaml) as ``make quickstart-test`` runs it:
podman-compose starts Redis, Azurite, the sidecar and a PySpark driver from local images (the
sidecar image of ``make image``'s script, the Spark driver image of tests/e2e/driver/, one
Debian image with redis-server and Azurite), and the driver's streaming query has a
checkpoint in the blob, read back through the sidecar (``checkpoint-sidecar show``/``list``).

Root only (rootful podman, like the other container tests); ``-m "not container"`` leaves it
out. The images are the ones tests/e2e/test_pod.py and tests/integration/test_container.py
build: cached by then.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.services import REPO_ROOT

pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]


def test_the_compose_quickstart_checkpoints_a_query_to_the_blob() -> None:
    result = subprocess.run(
        ["bash", "scripts/quickstart.sh"],
        cwd=REPO_ROOT,
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
    print(found.group(0))
