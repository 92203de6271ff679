"""Spark side of checkpoint-sidecar.

The listener is Java (``io.checkpointsidecar.SidecarStreamingListener``, bundled jar:
:func:`listener_jar`), registered by configuration alone (``spark-submit --jars … --conf
spark.sql.streaming.streamingQueryListeners=…``, or :func:`configure` on a builder), or in a
running PySpark job with one line::

    handle = spark_bridge.attach(spark)        # socket from SIDECAR_SOCKET_PATH

Either way it posts every finished micro-batch's offsets to the daemon, and::

    spark.readStream.format("kafka").option(
        "startingOffsets", spark_bridge.starting_offsets("orders-to-delta"))

resumes a query from its last saved position when Spark's own checkpoint is gone
(``batch=N`` or ``before="2026-11-21T10:00:00Z"``: from an earlier one the blob retains).

Installs on the Pythons Spark images ship (3.8+) without the daemon's dependencies: its own
distribution, ``checkpoint-sidecar-bridge`` (spark_bridge/pyproject.toml), nothing but the
standard library (and PySpark, which the driver has). Only what reads the blob store directly
— :func:`load_checkpoint` when no daemon answers, ``starting_offsets(batch=…/before=…)`` —
needs the daemon's package (``checkpoint-sidecar[daemon]``, Python 3.11+), imported then.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from spark_bridge.handle import BridgeError, BridgeHandle, SenderStats
from spark_bridge.jvm import LISTENER_CLASS, configure, listener_jar
from spark_bridge.resume import Missing, ResumeError
from spark_bridge.resume import starting_offsets as any_starting_offsets
from spark_bridge.wire import INTERNAL, UNAVAILABLE, ClientConnection, encode_request

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from sidecar.model.document import CheckpointDocument

__all__ = [
    "LISTENER_CLASS",
    "BridgeError",
    "BridgeHandle",
    "ResumeError",
    "SenderStats",
    "attach",
    "configure",
    "listener_jar",
    "load_checkpoint",
    "starting_offsets",
]

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
    doc = _read_blob(
        query, f"the checkpoint-sidecar at {path} (from {origin}) did not answer for {query!r}"
    )
    from sidecar.model.checkpoint import as_builtins

    return as_builtins(doc.checkpoint())


#: What reading the blobs directly needs, said when it is missing.
DAEMON_PACKAGE = (
    "pip install 'checkpoint-sidecar[daemon]' (Python 3.11+), the daemon's package, which "
    "reads the blob store with the daemon's settings (AZURE_STORAGE_CONNECTION_STRING or "
    "SIDECAR_ACCOUNT_URL, SIDECAR_CONTAINER, SIDECAR_NAMESPACE)"
)


def _read_blob(query: str, why: str) -> CheckpointDocument:
    """The blob document of ``query`` (id, else the newest of that name), read directly with
    the daemon's environment variables (needs the daemon's package and dependencies).

    Raises:
        ResumeError: none, or unreadable (the message names it and what to do), or the
            daemon's package is not installed (``why``: what asked for the blobs).
    """
    try:
        import anyio
        from sidecar.config import Config
        from sidecar.errors import SidecarError
        from sidecar.ops.inspection import find_checkpoint
    except ImportError as exc:
        raise ResumeError(
            f"{why}, and reading the blobs directly needs the daemon's package ({exc.name} is "
            f"not installed): {DAEMON_PACKAGE}"
        ) from None

    try:
        info = anyio.run(find_checkpoint, Config.from_env(os.environ), query)
    except SidecarError as exc:
        raise ResumeError(str(exc)) from exc
    assert info.document is not None
    return info.document


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
        checkpoint = load_checkpoint(query, socket_path)
    else:
        doc = _read_blob(query, "an earlier checkpoint is read from the query's blob")
        from sidecar.model.offsets import rewind
        from sidecar.model.stateful import rewind_refusal

        checkpoint = rewind(doc, batch=batch, before=before)
        refusal = rewind_refusal(doc, to_batch=checkpoint["batch_id"], explicit=False)
        if refusal is not None and not state_rewound:
            raise ResumeError(f"{refusal} (state_rewound=True)")
    return any_starting_offsets(
        checkpoint,
        source=source,
        partitions=partitions,
        missing=missing,
    )
