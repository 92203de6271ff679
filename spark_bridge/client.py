"""The driver's client of the daemon: attach the listener to a running session, read a
query's saved checkpoint (``get`` over the socket; the blobs, through the daemon's command
line, when no daemon answers) and turn it into a source's starting offsets. Re-exported by
``spark_bridge``; the standard library only (Python 3.8+).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from spark_bridge.handle import BridgeError, BridgeHandle
from spark_bridge.jvm import LISTENER_CLASS
from spark_bridge.resume import Missing, ResumeError
from spark_bridge.resume import starting_offsets as any_starting_offsets
from spark_bridge.wire import INTERNAL, UNAVAILABLE, ClientConnection, encode_request

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

DEFAULT_SOCKET_PATH = "/tmp/checkpoint-sidecar.sock"


#: The Spark conf key the listener and the pod templates name the daemon's socket by.
SOCKET_CONF = "spark.checkpointSidecar.socketPath"


def _socket_path(socket_path: str | None) -> str:
    return _socket_and_origin(socket_path)[0]


def _socket_and_origin(socket_path: str | None) -> tuple[str, str]:
    """The daemon's socket, looked for as the listener does: the argument, the active Spark
    session's :data:`SOCKET_CONF` (what the templates set on the driver), the environment's
    ``SIDECAR_SOCKET_PATH``, the default; and where it was found (for a message)."""
    if socket_path:
        return socket_path, "the socket_path argument"
    conf = _spark_conf(SOCKET_CONF)
    if conf:
        return conf, SOCKET_CONF
    env = os.environ.get("SIDECAR_SOCKET_PATH")
    if env:
        return env, "SIDECAR_SOCKET_PATH"
    return DEFAULT_SOCKET_PATH, f"the default (neither {SOCKET_CONF} nor SIDECAR_SOCKET_PATH set)"


def _spark_conf(key: str) -> str | None:
    """``key`` in the active Spark session's conf, when this process runs one (PySpark is
    never imported for it)."""
    sql = sys.modules.get("pyspark.sql")
    if sql is None:
        return None
    try:
        session = sql.SparkSession.getActiveSession()
        value = session.conf.get(key, None) if session is not None else None
    except Exception:  # a session stopping, Spark Connect without the key: not configured
        return None
    return str(value) if value else None


def _is_connect(spark: Any) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")


def attach(
    spark: SparkSession,
    socket_path: str | None = None,
    *,
    listener: Literal["auto", "jvm", "python"] = "auto",
) -> BridgeHandle:
    """Register the checkpoint listener on ``spark``; return a handle with ``close()``.

    ``listener="auto"`` (the default) registers the JVM listener
    (``io.checkpointsidecar.SidecarStreamingListener``), loading the bundled jar into the
    running driver if the session was not started with it, or reuses the one registered by
    configuration. ``"python"`` registers the Python fallback listener instead.

    The daemon need not be running: progress is kept (latest per query) and delivered once
    it is reachable. The listener never slows or fails the query. The socket is
    ``socket_path``, else ``spark.checkpointSidecar.socketPath``, else ``SIDECAR_SOCKET_PATH``.

    Raises:
        BridgeError: the JVM listener cannot be loaded, or ``spark`` is a Spark Connect
            session (listeners registered from a Connect client run in the client, not in
            the driver beside the sidecar: register the JVM listener on the Connect server by
            configuration; ``listener="python"`` runs the Python one in this client anyway).
    """
    if _is_connect(spark):
        if listener != "python":
            raise BridgeError(
                "this is a Spark Connect session: a listener added here runs in this client "
                "process, not in the driver beside the sidecar, and only while this client "
                "lives. Start the Connect server with the JVM listener instead: --jars "
                f'"$(checkpoint-sidecar listener-jar)" --conf '
                f"spark.sql.streaming.streamingQueryListeners={LISTENER_CLASS} "
                "(see docs/spark-bridge.md); or pass listener='python' to run the Python "
                "listener in this client knowingly"
            )
        log.warning(
            "Spark Connect: the checkpoint-sidecar Python listener runs in this client process "
            "and posts to %s from here, only while this client session lives",
            _socket_path(socket_path),
        )
    if listener == "python":
        from spark_bridge.listener import attach_python

        return attach_python(spark, _socket_path(socket_path))
    if listener not in ("auto", "jvm"):
        raise ValueError(f"listener must be 'auto', 'jvm' or 'python', not {listener!r}")
    from spark_bridge.jvm import attach_jvm

    return attach_jvm(spark, {"socketPath": socket_path} if socket_path else {})


def load_checkpoint(
    query: str, socket_path: str | None = None, *, timeout_s: float = 5.0
) -> dict[str, Any]:
    """The saved checkpoint of ``query`` (id or name).

    Asks the daemon first (``get`` by id, then by name: the newest query with that name), on
    ``socket_path``, else the active Spark session's ``spark.checkpointSidecar.socketPath``
    (what the pod templates set), else ``SIDECAR_SOCKET_PATH``, else the default;
    when the daemon is not running or knows neither, reads the blobs directly
    (configuration from the same environment variables as the daemon:
    AZURE_STORAGE_CONNECTION_STRING or SIDECAR_ACCOUNT_URL, SIDECAR_CONTAINER,
    SIDECAR_NAMESPACE).

    Raises:
        ResumeError: no checkpoint found for ``query``, or the one stored cannot be read
            (a damaged Redis record or blob: the message names it and what to do). An
            unreadable checkpoint is never replaced by an older one in silence.
    """
    path, origin = _socket_and_origin(socket_path)
    for field in ("query_id", "name"):
        found = _get_from_daemon(path, timeout_s, **{field: query})
        if found is not None:
            return found
    why = f"the checkpoint-sidecar at {path} (from {origin}) did not answer for {query!r}"
    read: dict[str, Any] = json.loads(_read_blobs(["show", "--checkpoint", "--", query], why))
    return read


#: What reading the blobs directly needs, said when it is missing.
DAEMON_PACKAGE = (
    "pip install 'checkpoint-sidecar[daemon]' (Python 3.11+), the daemon's package, which "
    "reads the blob store with the daemon's settings (AZURE_STORAGE_CONNECTION_STRING or "
    "SIDECAR_ACCOUNT_URL, SIDECAR_CONTAINER, SIDECAR_NAMESPACE)"
)
#: How long the daemon's command line may take to read the blobs.
BLOB_READ_TIMEOUT_S = 120.0


def _read_blobs(args: list[str], why: str) -> str:
    """What the daemon's command line (``python -m sidecar ARGS``) prints, reading the blobs
    directly with the daemon's environment variables, in a child process: the daemon's
    package is never imported here.

    Raises:
        ResumeError: the command failed (its message: no checkpoint, an unreadable blob, a
            batch not retained ...), or the daemon's package is not installed (``why``: what
            asked for the blobs).
    """
    command = [sys.executable, "-m", "sidecar", *args]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=BLOB_READ_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise ResumeError(
            f"{why}, and reading the blobs directly (checkpoint-sidecar {' '.join(args)}) took "
            f"over {BLOB_READ_TIMEOUT_S:.0f} s: check the blob store's address and the network"
        ) from None
    if done.returncode == 0:
        return done.stdout
    said = done.stderr.strip()
    if "No module named sidecar" in said or "No module named 'sidecar'" in said:
        raise ResumeError(
            f"{why}, and reading the blobs directly needs the daemon's package (not "
            f"installed for {sys.executable}): {DAEMON_PACKAGE}"
        )
    last = said.splitlines()[-1] if said else f"exit code {done.returncode}"
    prefix = "checkpoint-sidecar: "  # (str.removeprefix is Python 3.9+; this is 3.8 too)
    raise ResumeError(last[len(prefix) :] if last.startswith(prefix) else last)


def _get_from_daemon(path: str, timeout_s: float, **lookup: str) -> dict[str, Any] | None:
    """The daemon's answer to ``get``; None when it is not running or knows nothing. While
    it answers ``unavailable`` (starting, Redis down: Redis may hold a newer position than
    the blob), asked again until ``timeout_s``.

    Raises:
        ResumeError: the daemon found the query's record but could not read it (``internal``;
            other errors leave the answer to the blobs).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        answer, retry = _ask_daemon(path, deadline, lookup)
        if not retry or time.monotonic() + 0.2 >= deadline:
            return answer
        time.sleep(0.2)


def _ask_daemon(
    path: str, deadline: float, lookup: dict[str, str]
) -> tuple[dict[str, Any] | None, bool]:
    """One ``get``: its answer, and whether to ask again (``unavailable``)."""
    conn = ClientConnection()
    timeout_s = max(0.1, deadline - time.monotonic())
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(encode_request("get", 1, **lookup))
            while time.monotonic() < deadline:
                data = sock.recv(65536)
                if not data:
                    return None, False
                replies = conn.receive_data(data)
                if replies:
                    reply = replies[0]
                    if reply.error is not None and reply.error.code == INTERNAL:
                        asked = ", ".join(f"{k}={v!r}" for k, v in lookup.items())
                        raise ResumeError(
                            f"the checkpoint-sidecar at {path} could not answer get "
                            f"{asked}: {reply.error.message}"
                        )
                    unavailable = reply.error is not None and reply.error.code == UNAVAILABLE
                    return (reply.checkpoint if reply.ok else None), unavailable
    except OSError:
        return None, False
    return None, False


def starting_offsets(
    query: str,
    socket_path: str | None = None,
    *,
    source: int | None = None,
    partitions: dict[str, int] | None = None,
    missing: Missing = "earliest",
    batch: int | None = None,
    before: str | datetime | None = None,
    state_rewound: bool = False,
) -> str:
    """The Kafka ``startingOffsets`` JSON to resume ``query`` (id or name) where it stopped
    (for an Event Hubs source, the connector's ``eventhubs.startingPositions``).

    Uses each partition's saved ``endOffset`` (the next offset to read: no gap, no overlap).
    Partitions absent from the checkpoint (see ``partitions``) start at ``missing``:
    "earliest" (default; nothing skipped), "latest", or "error".
    See :func:`spark_bridge.resume.kafka_starting_offsets`.

    Rewind: ``batch=N`` resumes after batch N, ``before=TIME`` (ISO 8601 text, no zone
    meaning UTC, or a datetime) after the newest batch whose Spark timestamp is earlier, each
    from the checkpoints the query's blob retains (``checkpoint-sidecar history QUERY``;
    ``SIDECAR_HISTORY_SIZE``), read directly from the blob store as :func:`load_checkpoint`'s
    fallback does (so it needs the daemon's package). A stateful query (or one whose state is
    unknown) is not rewound unless ``state_rewound``: its state store must be rewound to the
    same batch too (``sidecar.model.stateful``).

    Raises:
        ResumeError: no checkpoint; the batch or time asked for is not retained (the message
            says what is); a stateful query rewound without ``state_rewound``; or see
            :func:`spark_bridge.resume.kafka_starting_offsets`.
    """
    if batch is None and before is None:
        return any_starting_offsets(
            load_checkpoint(query, socket_path),
            source=source,
            partitions=partitions,
            missing=missing,
        )
    if batch is not None and before is not None:
        raise ResumeError("rewind by batch or before, not both")
    when = ["--batch", str(batch)] if batch is not None else ["--before", _iso(before)]
    args = ["starting-offsets", *when, "--missing", missing]
    args += ["--state-rewound"] if state_rewound else []
    args += ["--source", str(source)] if source is not None else []
    args += [a for t, n in (partitions or {}).items() for a in ("--partitions", f"{t}={n}")]
    args += ["--", query]  # a name may start with "-"
    return _read_blobs(args, "an earlier checkpoint is read from the query's blob").strip()


def _iso(when: str | datetime | None) -> str:
    """``before`` as the command line takes it (a datetime without a zone is UTC there too)."""
    return when.isoformat() if isinstance(when, datetime) else str(when)
