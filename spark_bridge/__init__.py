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
needs the daemon's package (``checkpoint-sidecar[daemon]``, Python 3.11+): it is run as its
command line (``python -m sidecar show|starting-offsets``) in a child process, never imported,
so the Spark side depends on nothing of the daemon (tests/unit/test_structure.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spark_bridge.client import (
        DEFAULT_SOCKET_PATH,
        SOCKET_CONF,
        attach,
        load_checkpoint,
        starting_offsets,
    )
    from spark_bridge.handle import BridgeError, BridgeHandle, SenderStats
    from spark_bridge.jvm import LISTENER_CLASS, configure, listener_jar
    from spark_bridge.resume import ResumeError

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "LISTENER_CLASS",
    "SOCKET_CONF",
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

#: Where each public name lives: imported on first use, so that importing one module of the
#: package (the daemon imports ``spark_bridge.resume``, pure rules) loads no socket, JVM or
#: sender code.
_HOME = {
    "DEFAULT_SOCKET_PATH": "client",
    "SOCKET_CONF": "client",
    "attach": "client",
    "load_checkpoint": "client",
    "starting_offsets": "client",
    "BridgeError": "handle",
    "BridgeHandle": "handle",
    "SenderStats": "handle",
    "LISTENER_CLASS": "jvm",
    "configure": "jvm",
    "listener_jar": "jvm",
    "ResumeError": "resume",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'spark_bridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"spark_bridge.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
