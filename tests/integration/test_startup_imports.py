"""What the daemon imports before it is ready (issue #22): only what readiness needs and what
is configured. A fresh interpreter builds the daemon as ``checkpoint-sidecar run`` does, then
lists which heavy packages are loaded; nothing is mocked."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.services import REPO_ROOT, azurite_connection_string

PROBE = """
import json, sys
import anyio
from sidecar.cli import commands  # what `checkpoint-sidecar run` imports
from sidecar.config import Config
from sidecar.daemon.app import Daemon
env = {"SIDECAR_REDIS_URL": "redis://127.0.0.1:1/0",
       "AZURE_STORAGE_CONNECTION_STRING": sys.argv[2], **json.loads(sys.argv[1])}
async def build():
    Daemon(Config.from_env(env))
anyio.run(build)
heavy = ("aiokafka", "azure.storage.blob", "azure.identity", "aiohttp", "sidecar.ops.doctor")
print(json.dumps(sorted(m for m in heavy if m in sys.modules)))
"""


def loaded(env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(env), azurite_connection_string(1)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        check=True,
    )
    return list(json.loads(out.stdout))


def test_nothing_heavy_is_imported_before_readiness_unless_configured() -> None:
    assert loaded({}) == []  # the Azure SDK comes after readiness, in a worker thread
    assert loaded({"SIDECAR_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9092"}) == ["aiokafka"]
