"""The StreamingQueryListener that hands each finished micro-batch's progress to the sender.

Spark calls ``onQueryProgress`` from its asynchronous listener bus; ``onQueryStarted`` runs
synchronously inside ``query.start()``. The listener therefore does almost nothing on
Spark's thread: it takes Spark's own progress JSON (``event.progress.json``, one Py4J call
to the JVM, ~0.2 ms; the attribute accessors would stringify offsets, a null becoming
"None") and the query id, offers both to the sender, and returns. Nothing else: no socket
to the daemon, no parsing, and it never raises into Spark. Costs: ``bench/listener.py``.
"""

from __future__ import annotations

import logging
from typing import Any

from pyspark.sql.streaming.listener import StreamingQueryListener

from spark_bridge.sender import Sender

log = logging.getLogger(__name__)

#: How long ``onQueryTerminated`` may wait for the query's last offsets to be delivered.
DRAIN_ON_TERMINATE_S = 2.0


class CheckpointListener(StreamingQueryListener):
    """Posts every query progress to the checkpoint-sidecar daemon (through a Sender)."""

    def __init__(self, sender: Sender) -> None:
        self._sender = sender
        self.errors = 0

    def onQueryStarted(self, event: Any) -> None:
        pass  # runs inside query.start(): keep it free

    def onQueryProgress(self, event: Any) -> None:
        try:
            progress = event.progress
            self._sender.offer(str(progress.id), progress.json.encode())
        except Exception:  # never into Spark; count and log the first few
            self.errors += 1
            if self.errors <= 3:
                log.exception("checkpoint-sidecar listener could not queue a progress event")

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        try:
            if not self._sender.flush(DRAIN_ON_TERMINATE_S):
                log.warning(
                    "query %s terminated with offsets still undelivered to checkpoint-sidecar (%s)",
                    event.id,
                    self._sender.stats(),
                )
        except Exception:
            log.exception("checkpoint-sidecar listener failed on query termination")
