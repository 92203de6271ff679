"""Spark side of checkpoint-sidecar.

One line in a PySpark streaming job::

    handle = spark_bridge.attach(spark)        # socket from SIDECAR_SOCKET_PATH

posts every finished micro-batch's offsets to the daemon, and::

    spark.readStream.format("kafka").option(
        "startingOffsets", spark_bridge.starting_offsets("orders-to-delta"))

resumes a query from its last saved position when Spark's own checkpoint is gone.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sidecar.resume import Missing, ResumeError, kafka_starting_offsets
from spark_bridge.sender import Sender, SenderStats

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from spark_bridge.listener import CheckpointListener

__all__ = [
    "BridgeHandle",
    "ResumeError",
    "SenderStats",
    "attach",
    "load_checkpoint",
    "starting_offsets",
]

DEFAULT_SOCKET_PATH = "/tmp/checkpoint-sidecar.sock"


def _socket_path(socket_path: str | None) -> str:
    return socket_path or os.environ.get("SIDECAR_SOCKET_PATH") or DEFAULT_SOCKET_PATH


@dataclass
class BridgeHandle:
    """What :func:`attach` returns: stats while running, ``close()`` at the end."""

    spark: SparkSession
    listener: CheckpointListener
    sender: Sender

    def stats(self) -> SenderStats:
        """Counters: offered, sent, conflated, failed, retried, reconnects, pending."""
        return self.sender.stats()

    def close(self, timeout_s: float = 5.0) -> bool:
        """Unregister the listener and deliver what is pending, within ``timeout_s``.

        Returns True when everything offered was acknowledged by the daemon.
        """
        try:
            self.spark.streams.removeListener(self.listener)
        finally:
            delivered = self.sender.close(timeout_s)
        return delivered


def attach(spark: SparkSession, socket_path: str | None = None) -> BridgeHandle:
    """Register the checkpoint listener on ``spark``; return a handle with ``close()``.

    The daemon need not be running: progress is kept (latest per query) and delivered once
    it is reachable. The listener never slows or fails the query.
    """
    from spark_bridge.listener import CheckpointListener

    sender = Sender(_socket_path(socket_path))
    listener = CheckpointListener(sender)
    spark.streams.addListener(listener)
    return BridgeHandle(spark, listener, sender)


def load_checkpoint(
    query: str, socket_path: str | None = None, *, timeout_s: float = 5.0
) -> dict[str, Any]:
    """The saved checkpoint of ``query`` (id or name).

    Asks the daemon first (``get`` by id, then by name: the newest query with that name);
    when the daemon is not running or knows neither, reads the blobs directly
    (configuration from the same environment variables as the daemon:
    AZURE_STORAGE_CONNECTION_STRING or SIDECAR_ACCOUNT_URL, SIDECAR_CONTAINER,
    SIDECAR_NAMESPACE).

    Raises:
        ResumeError: no checkpoint found for ``query``.
    """
    path = _socket_path(socket_path)
    for field in ("query_id", "name"):
        found = _get_from_daemon(path, timeout_s, **{field: query})
        if found is not None:
            return found
    import anyio
    import msgspec

    from sidecar.config import Config
    from sidecar.errors import SidecarError
    from sidecar.report import find_checkpoint

    try:
        info = anyio.run(find_checkpoint, Config.from_env(os.environ), query)
    except SidecarError as exc:
        raise ResumeError(str(exc)) from exc
    assert info.document is not None
    checkpoint: dict[str, Any] = msgspec.to_builtins(info.document.checkpoint())
    return checkpoint


def _get_from_daemon(path: str, timeout_s: float, **lookup: str) -> dict[str, Any] | None:
    from sidecar.protocol import ClientConnection, encode_request

    conn = ClientConnection()
    deadline = time.monotonic() + timeout_s
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(encode_request("get", 1, **lookup))
            while time.monotonic() < deadline:
                data = sock.recv(65536)
                if not data:
                    return None
                replies = conn.receive_data(data)
                if replies:
                    return replies[0].checkpoint if replies[0].ok else None
    except OSError:
        return None
    return None


def starting_offsets(
    query: str,
    socket_path: str | None = None,
    *,
    source: int | None = None,
    partitions: dict[str, int] | None = None,
    missing: Missing = "earliest",
) -> str:
    """The Kafka ``startingOffsets`` JSON to resume ``query`` (id or name) where it stopped.

    Uses each partition's saved ``endOffset`` (the next offset to read: no gap, no overlap).
    Partitions absent from the checkpoint (see ``partitions``) start at ``missing``:
    "earliest" (default; nothing skipped), "latest", or "error".
    See :func:`sidecar.resume.kafka_starting_offsets`.
    """
    return kafka_starting_offsets(
        load_checkpoint(query, socket_path),
        source=source,
        partitions=partitions,
        missing=missing,
    )
