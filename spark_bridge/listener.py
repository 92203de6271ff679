"""The Python fallback listener, for where no JVM listener can be loaded.

Prefer the JVM listener (``spark_bridge.jvm``): PySpark converts every listener event on
Spark's listener thread before a Python listener runs (tens of milliseconds per event), which
with many queries makes Spark drop events. This one is kept for environments that cannot load
a jar into the driver, and for Spark Connect clients that explicitly ask for it.

On Spark's thread it takes Spark's own progress JSON (``event.progress.json``: the attribute
accessors stringify offsets, a null becoming "None") and the query id, offers both to the
sender, and returns; it never raises into Spark.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pyspark.sql.streaming.listener import StreamingQueryListener

from spark_bridge.handle import BridgeHandle, SenderStats
from spark_bridge.sender import Sender

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

#: How long ``onQueryTerminated`` may wait for the query's last offsets to be delivered.
DRAIN_ON_TERMINATE_S = 2.0


def tracking_of(spark: SparkSession, query_id: str) -> str | None:
    """How the query tracks progress ("sync", "async", "real_time"), from its execution's class
    and trigger in the JVM (as the JVM listener's ``Tracking`` reads it); None when unknown."""
    try:
        query = spark.streams.get(query_id)
        if query is None:
            return None
        execution = query._jsq.streamingQuery()
        kind = execution.getClass().getSimpleName()
        trigger = execution.trigger().getClass().getSimpleName()
    except Exception:  # another Spark, Spark Connect, the query gone: unknown
        return None
    if trigger.startswith("RealTime"):
        return "real_time"
    if kind.startswith("AsyncProgressTracking"):
        return "async"
    return "sync" if kind == "MicroBatchExecution" else None


class CheckpointListener(StreamingQueryListener):
    """Posts every query progress to the checkpoint-sidecar daemon (through a Sender)."""

    def __init__(
        self, sender: Sender, tracking: Callable[[str], str | None] = lambda _: None
    ) -> None:
        self._sender = sender
        self._tracking = tracking
        self._looked_up: set[str] = set()  # queries whose tracking the sender was told
        self.errors = 0
        self._cond = threading.Condition()
        self._running: set[str] = set()  # started or progressing, not yet terminated

    def onQueryStarted(self, event: Any) -> None:
        # Called inside query.start(), synchronously: record the query (one set insert), so
        # close() waits for its terminated event even when none of its progress arrived yet.
        try:
            with self._cond:
                self._running.add(str(event.id))
            self._look_up(str(event.id))
        except Exception:
            self.errors += 1

    def onQueryProgress(self, event: Any) -> None:
        try:
            progress = event.progress
            query_id = str(progress.id)
            with self._cond:
                self._running.add(query_id)
            if query_id not in self._looked_up:  # attached after the query started
                self._look_up(query_id)
            self._sender.offer(query_id, progress.json.encode())
        except Exception:  # never into Spark; count and log the first few
            self.errors += 1
            if self.errors <= 3:
                log.exception("checkpoint-sidecar listener could not queue a progress event")

    def _look_up(self, query_id: str) -> None:
        """How the query tracks progress, once per run: the sender sends it with each update
        (as the JVM listener does from the query's first event)."""
        self._looked_up.add(query_id)
        self._sender.set_tracking(query_id, self._tracking(query_id))

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        try:
            query_id = str(event.id)
            if not self._sender.flush(DRAIN_ON_TERMINATE_S):
                log.warning(
                    "query %s terminated with offsets still undelivered to checkpoint-sidecar (%s)",
                    query_id,
                    self._sender.stats(),
                )
            with self._cond:
                self._running.discard(query_id)
                self._cond.notify_all()
            # The sender keeps the query's tracking: its last update may still be unsent.
            self._looked_up.discard(query_id)
        except Exception:
            log.exception("checkpoint-sidecar listener failed on query termination")

    def await_terminated(self, active: set[str], timeout_s: float) -> bool:
        """Wait until every query seen here, except ``active``, had its terminated event."""
        with self._cond:
            return self._cond.wait_for(lambda: self._running <= active, timeout_s)


class PythonHandle(BridgeHandle):
    """The Python listener and its sender thread."""

    kind = "python"

    def __init__(self, spark: SparkSession, listener: CheckpointListener, sender: Sender) -> None:
        self.spark = spark
        self.listener = listener
        self.sender = sender

    def stats(self) -> SenderStats:
        return self.sender.stats()

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.sender.flush(timeout_s)

    def close(self, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        active = {str(q.id) for q in self.spark.streams.active}
        terminated = self.listener.await_terminated(active, timeout_s)
        try:
            self.spark.streams.removeListener(self.listener)
        finally:
            delivered = self.sender.close(max(0.0, deadline - time.monotonic()))
        return terminated and delivered


def attach_python(spark: SparkSession, socket_path: str) -> PythonHandle:
    sender = Sender(socket_path)
    listener = CheckpointListener(sender, lambda query_id: tracking_of(spark, query_id))
    spark.streams.addListener(listener)
    return PythonHandle(spark, listener, sender)
