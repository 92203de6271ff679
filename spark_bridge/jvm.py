"""The JVM listener: load it into Spark's driver JVM through Py4J and register it.

The listener itself is Java (``io.checkpointsidecar.SidecarStreamingListener``, sources in
``spark_bridge/jvm/src``, the jar in ``spark_bridge/jars``): on Spark's listener thread it
stores the progress in a per-query slot and returns; a JVM thread delivers it. PySpark does not
convert a single event for it, so it costs Spark nothing (``bench/listener.py``).

Three ways in, all the same listener:

- by configuration, before the session starts (``configure(builder)`` or ``spark-submit
  --jars … --conf spark.sql.streaming.streamingQueryListeners=…``): Spark creates it;
- ``attach(spark)`` on a session started without it: the jar is loaded through a child class
  loader over Py4J and the listener is added to ``spark.streams``;
- ``attach(spark)`` on a session that already has it by configuration: that one is used.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spark_bridge.handle import BridgeError, BridgeHandle, SenderStats

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

LISTENER_CLASS = "io.checkpointsidecar.SidecarStreamingListener"
JAR_NAME = "checkpoint-sidecar-listener.jar"
LISTENERS_CONF = "spark.sql.streaming.streamingQueryListeners"
SETTINGS_PREFIX = "spark.checkpointSidecar."

#: The listener class per driver JVM (keyed by Py4J gateway), loaded once: a second class
#: loader would give a second copy of its statics, and with them a second connection.
_classes: dict[int, Any] = {}


def listener_jar() -> str:
    """Path of the bundled listener jar (for ``spark.jars`` / ``spark-submit --jars``).

    Raises:
        BridgeError: the jar was not built (a source checkout: run ``make setup``).
    """
    path = Path(__file__).resolve().parent / "jars" / JAR_NAME
    if not path.is_file():
        raise BridgeError(
            f"the listener jar is missing ({path}): in a source checkout build it with "
            "`make setup` (or `bash scripts/build_jar.sh`); installed wheels include it"
        )
    return str(path)


def _merge_list(current: str | None, item: str) -> str:
    items = [x.strip() for x in (current or "").split(",") if x.strip()]
    return ",".join(items if item in items else [*items, item])


def configure(builder: Any, socket_path: str | None = None, **settings: str) -> Any:
    """Add the listener to a ``SparkSession.Builder`` (classic or Spark Connect server) by conf.

    Appends the bundled jar to ``spark.jars`` and the class to
    ``spark.sql.streaming.streamingQueryListeners`` (keeping values already set on the
    builder), and sets ``spark.checkpointSidecar.socketPath`` when ``socket_path`` is given.
    ``settings`` are further ``spark.checkpointSidecar.*`` keys, e.g. ``tcpPort="9401"``.
    Returns the builder.
    """
    options: dict[str, str] = getattr(builder, "_options", {})
    builder = builder.config("spark.jars", _merge_list(options.get("spark.jars"), listener_jar()))
    builder = builder.config(
        LISTENERS_CONF, _merge_list(options.get(LISTENERS_CONF), LISTENER_CLASS)
    )
    if socket_path is not None:
        settings = {"socketPath": socket_path, **settings}
    for key, value in settings.items():
        builder = builder.config(SETTINGS_PREFIX + key, str(value))
    return builder


class JvmHandle(BridgeHandle):
    """A :class:`SidecarStreamingListener` in the driver JVM, driven through Py4J."""

    kind = "jvm"

    def __init__(self, spark: SparkSession, listener: Any, *, by_conf: bool) -> None:
        self.spark = spark
        self.listener = listener
        #: Registered by Spark from configuration: close() leaves it registered.
        self.by_conf = by_conf

    def stats(self) -> SenderStats:
        values = json.loads(self.listener.statsJson())
        return SenderStats.from_mapping(values)

    def listener_errors(self) -> int:
        """Events the listener failed to handle (logged by the JVM, never raised into Spark)."""
        return int(json.loads(self.listener.statsJson())["listener_errors"])

    def flush(self, timeout_s: float = 5.0) -> bool:
        return bool(self.listener.flush(_ms(timeout_s)))

    def close(self, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        active = ",".join(str(q.id) for q in self.spark.streams.active)
        terminated = bool(self.listener.awaitTerminated(active, _ms(timeout_s)))
        left = max(0.0, deadline - time.monotonic())
        if self.by_conf:
            return terminated and self.flush(left)
        self.spark._jsparkSession.streams().removeListener(self.listener)
        return terminated and bool(self.listener.close(_ms(left)))


def _ms(seconds: float) -> int:
    return max(0, int(seconds * 1000))


def attach_jvm(spark: SparkSession, settings: dict[str, str]) -> JvmHandle:
    """Register the JVM listener on a classic session (or reuse the one set by conf).

    ``settings``: ``spark.checkpointSidecar.*`` keys without the prefix; the session's own
    ``spark.checkpointSidecar.*`` conf fills the rest, then the driver's environment.
    """
    from py4j.protocol import Py4JError, Py4JJavaError

    jsession = spark._jsparkSession
    manager = jsession.streams()
    for existing in manager.listListeners():
        if existing.getClass().getName() == LISTENER_CLASS:
            if settings:
                log.warning(
                    "the checkpoint-sidecar listener is already registered by Spark conf; "
                    "using it with its own settings, not %s",
                    settings,
                )
            return JvmHandle(spark, existing, by_conf=True)

    conf = spark.sparkContext.getConf()
    merged = {
        key[len(SETTINGS_PREFIX) :]: value
        for key, value in conf.getAll()
        if key.startswith(SETTINGS_PREFIX)
    }
    # The driver JVM read its environment when it started; this process's may have changed.
    for key, env in (("socketPath", "SIDECAR_SOCKET_PATH"), ("tcpPort", "SIDECAR_TCP_PORT")):
        if os.environ.get(env):
            merged.setdefault(key, os.environ[env])
    merged.update(settings)
    try:
        cls = _listener_class(spark)
        jvm = spark._jvm
        gateway = spark.sparkContext._gateway
        assert jvm is not None and gateway is not None
        jmap = jvm.java.util.HashMap()
        for key, value in merged.items():
            jmap.put(key, value)
        arg_types = gateway.new_array(jvm.java.lang.Class, 1)
        arg_types[0] = jvm.java.lang.Class.forName("java.util.Map")
        args = gateway.new_array(jvm.java.lang.Object, 1)
        args[0] = jmap
        listener = cls.getConstructor(arg_types).newInstance(args)
    except Py4JJavaError as exc:
        raise BridgeError(f"cannot create the JVM listener: {_java_message(exc)}") from None
    except Py4JError as exc:
        raise BridgeError(f"cannot create the JVM listener: {exc}") from None
    manager.addListener(listener)
    return JvmHandle(spark, listener, by_conf=False)


def _listener_class(spark: SparkSession) -> Any:
    """The listener class: from Spark's class path if the jar is there, else a child loader."""
    from py4j.protocol import Py4JJavaError

    gateway = spark.sparkContext._gateway
    jvm = spark._jvm
    assert gateway is not None and jvm is not None
    key = id(gateway)
    if key in _classes:
        return _classes[key]
    context = jvm.java.lang.Thread.currentThread().getContextClassLoader()
    try:
        cls = jvm.java.lang.Class.forName(LISTENER_CLASS, True, context)
    except Py4JJavaError:
        urls = gateway.new_array(jvm.java.net.URL, 1)
        urls[0] = jvm.java.io.File(listener_jar()).toURI().toURL()
        loader = jvm.java.net.URLClassLoader(urls, context)
        cls = jvm.java.lang.Class.forName(LISTENER_CLASS, True, loader)
    _classes[key] = cls
    return cls


def _java_message(exc: Any) -> str:
    """The innermost Java exception's message (reflection wraps constructor errors)."""
    throwable = exc.java_exception
    while throwable.getCause() is not None:
        throwable = throwable.getCause()
    return str(throwable.toString())
