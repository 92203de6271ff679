"""Kafka lag of each query, from Spark's own progress or from the brokers' end offsets.

Without a broker: lag = Spark's ``latestOffset`` - ``endOffset`` of the newest applied
progress (what Spark saw available vs. what it has processed). With
``SIDECAR_KAFKA_BOOTSTRAP_SERVERS``: lag = the brokers' end offset - the offset durable in
the blob (and committed to the group), which is what a lag exporter would report for the
group. Lag in seconds = records of lag / the query's consumption rate over the last minute.

The ingest path only stores the newest checkpoint per query (O(1)); gauges are computed once
a second by :meth:`LagTracker.run`.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque

import anyio
from anyio.abc import TaskStatus

from sidecar.checkpoint import Checkpoint
from sidecar.metrics import Metrics
from sidecar.offsets import Offsets, kafka_offsets

log = logging.getLogger(__name__)

RATE_WINDOW_S = 60.0


class LagTracker:
    def __init__(self, metrics: Metrics, extra_queries: frozenset[str] = frozenset()) -> None:
        self._metrics = metrics
        self._extra = extra_queries
        self._observed: dict[str, Checkpoint] = {}  # by label: newest applied progress
        self._durable: dict[str, Offsets] = {}  # by label: offsets durable in the blob
        self._ends: Offsets = {}  # brokers' end offsets
        self._history: dict[str, deque[tuple[float, int]]] = {}
        self._failed: set[str] = set()

    def observe(self, checkpoint: Checkpoint) -> None:
        """The newest applied progress of a query (called on the ingest path: O(1))."""
        self._observed[checkpoint.label] = checkpoint

    def durable(self, label: str, offsets: Offsets) -> None:
        self._durable[label] = offsets

    def end_offsets(self, ends: Offsets) -> None:
        self._ends.update(ends)

    def forget(self, label: str) -> None:
        """Drop a retired query's state (``sidecar.retirement``), and the end offsets of
        partitions no query left here reads."""
        for state in (self._observed, self._durable, self._history):
            state.pop(label, None)
        self._failed.discard(label)
        used = {key for offsets in self._durable.values() for key in offsets}
        self._ends = {key: end for key, end in self._ends.items() if key in used}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self.export()
            await anyio.sleep(1.0)

    def lag(self, label: str) -> Offsets | None:
        """Lag per (topic, partition) of the query ``label``, None when unknown."""
        durable = self._durable.get(label)
        if durable and all(key in self._ends for key in durable):
            return {key: max(0, self._ends[key] - offset) for key, offset in durable.items()}
        checkpoint = self._observed.get(label)
        if checkpoint is None:
            return None
        ends = kafka_offsets(checkpoint, self._extra, "end_offset")
        latest = kafka_offsets(checkpoint, self._extra, "latest_offset")
        if not ends or not latest:
            return None
        return {key: max(0, latest[key] - ends[key]) for key in ends if key in latest}

    def export(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for label in set(self._observed) | set(self._durable):
            try:
                self._export_one(label, now)
            except Exception:  # one odd query must not take the daemon down
                if label not in self._failed:
                    self._failed.add(label)
                    log.exception("lag of query %s cannot be computed; skipping it", label)

    def _export_one(self, label: str, now: float) -> None:
        m = self._metrics
        lag = self.lag(label)
        if lag is None:
            return
        per_topic: dict[str, int] = {}
        for (topic, partition), records in lag.items():
            per_topic[topic] = per_topic.get(topic, 0) + records
            if m.lag_per_partition:
                m.kafka_lag.labels(label, topic, str(partition)).set(records)
        if not m.lag_per_partition:
            for topic, records in per_topic.items():
                m.kafka_lag.labels(label, topic).set(records)
        total = sum(lag.values())
        m.kafka_query_lag.labels(label).set(total)
        # consumption rate from the position (sum of end offsets) over the last minute
        checkpoint = self._observed.get(label)
        position = sum(kafka_offsets(checkpoint, self._extra).values()) if checkpoint else 0
        history = self._history.setdefault(label, deque())
        history.append((now, position))
        while len(history) > 2 and now - history[0][0] > RATE_WINDOW_S:
            history.popleft()
        (t0, p0), (t1, p1) = history[0], history[-1]
        rate = (p1 - p0) / (t1 - t0) if t1 > t0 else 0.0
        seconds = 0.0 if total == 0 else (total / rate if rate > 0 else math.inf)
        m.kafka_lag_seconds.labels(label).set(seconds)
