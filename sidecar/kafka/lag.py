"""Kafka lag of each query, from Spark's own progress or from the brokers' end offsets,
computed when ``/metrics`` is collected (a custom Prometheus collector).

Without a broker: lag = Spark's ``latestOffset`` - ``endOffset`` of the newest applied
progress (what Spark saw available vs. what it has processed). With
``SIDECAR_KAFKA_BOOTSTRAP_SERVERS``: lag = the brokers' end offset - the offset durable in
the blob (and committed to the group), which is what a lag exporter would report for the
group. Lag in seconds = records of lag / the query's consumption rate over the last minute
(its position, the sum of its end offsets, sampled at each collection).

The ingest path only keeps a reference to the newest checkpoint per query (O(1)); nothing
is computed until a collection asks. At 1,000 queries x 100 partitions, refreshing gauges
meant ~100k gauge updates per second on the event loop; a collection computes each query
once, in the admin endpoint's worker thread (``sidecar.daemon.http``).

Per-partition series are capped (``SIDECAR_KAFKA_LAG_PARTITION_SERIES_MAX``): queries are taken
in the order they were first seen, each exported per partition while its partitions fit in
what is left of the cap, per topic (no ``partition`` label) otherwise, and
``checkpoint_sidecar_kafka_lag_series_dropped`` says how many per-partition series were
folded into per-topic ones at the last collection.

Threads: the loop writes (``observe``, ``durable``, ``end_offsets``, ``forget``); a
collection, in another thread, reads. The values are immutable (a checkpoint, an offsets
dict the caller no longer touches) and replaced, never changed; the collection copies the
maps it iterates (``dict.copy`` runs under the GIL without calling Python code: keys are
str) and only looks up the end offsets (``dict.get``, never iterated). The rate history is
the collections' own, under a lock.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.model.checkpoint import Checkpoint
from sidecar.model.offsets import Offsets, kafka_offsets

log = logging.getLogger(__name__)

RATE_WINDOW_S = 60.0

LAG = "checkpoint_sidecar_kafka_lag_records"
QUERY_LAG = "checkpoint_sidecar_kafka_query_lag_records"
LAG_SECONDS = "checkpoint_sidecar_kafka_lag_seconds"
DROPPED = "checkpoint_sidecar_kafka_lag_series_dropped"
_LAG_DOC = (
    "Records between the end of the log and the query's position (durable offset with a "
    "broker configured, else Spark's latestOffset - endOffset); per topic (no partition "
    "label) for queries beyond SIDECAR_KAFKA_LAG_PARTITION_SERIES_MAX"
)
_QUERY_LAG_DOC = "Sum of the query's Kafka lag over all its partitions"
_SECONDS_DOC = (
    "Estimated time to consume the lag at the query's rate over the last minute "
    "(+Inf when the query is not consuming)"
)
_DROPPED_DOC = (
    "Per-partition lag series not exported at the last collection, because "
    "SIDECAR_KAFKA_LAG_PARTITION_SERIES_MAX was reached: those queries' lag is exported per topic"
)


class LagTracker(Collector):
    """Registered on the daemon's registry; ``collect`` computes every query's lag."""

    def __init__(
        self,
        extra_queries: frozenset[str] = frozenset(),
        *,
        per_partition: bool = True,
        partition_series_max: int = 10_000,
    ) -> None:
        self._extra = extra_queries
        self._partition_budget = partition_series_max if per_partition else 0
        self._observed: dict[str, Checkpoint] = {}  # by label: newest applied progress
        self._durable: dict[str, Offsets] = {}  # by label: offsets durable in the blob
        self._ends: Offsets = {}  # brokers' end offsets (looked up only, never iterated)
        self._users: dict[tuple[str, int], int] = {}  # durable queries reading a partition
        #: By label: the first progress seen, until a collection starts the rate history.
        self._first: dict[str, tuple[float, Checkpoint]] = {}
        self._history: dict[str, deque[tuple[float, int]]] = {}  # the collections' own
        self._history_lock = threading.Lock()
        self._failed: set[str] = set()
        #: Per query: its newest progress and that progress's end and latest Kafka offsets,
        #: decoded from the raw JSON once, not at every scrape (scrape threads only).
        self._decoded: dict[str, tuple[Checkpoint, Offsets, Offsets]] = {}

    # --- the loop's side: references only ---------------------------------------------------

    def observe(self, checkpoint: Checkpoint) -> None:
        """The newest applied progress of a query (called on the ingest path: O(1))."""
        label = checkpoint.label
        if label not in self._observed:
            self._first[label] = (time.monotonic(), checkpoint)
        self._observed[label] = checkpoint

    def durable(self, label: str, offsets: Offsets) -> None:
        old = self._durable.get(label)
        if old is None or old.keys() != offsets.keys():
            self._release(old or {})
            for key in offsets:
                self._users[key] = self._users.get(key, 0) + 1
        self._durable[label] = offsets

    def end_offsets(self, ends: Offsets) -> None:
        self._ends.update(ends)

    def forget(self, label: str) -> None:
        """Drop a retired query's state (``sidecar.daemon.retirement``), and the end offsets of
        partitions no query left here reads: O(that query's partitions)."""
        self._observed.pop(label, None)
        self._first.pop(label, None)
        self._release(self._durable.pop(label, {}))
        self._failed.discard(label)  # its rate history goes at the next collection

    def _release(self, offsets: Offsets) -> None:
        for key in offsets:
            left = self._users.get(key, 0) - 1
            if left > 0:
                self._users[key] = left
            else:
                self._users.pop(key, None)
                self._ends.pop(key, None)

    # --- a collection's side (any thread) ---------------------------------------------------

    def describe(self) -> list[Metric]:
        return [
            GaugeMetricFamily(LAG, _LAG_DOC),
            GaugeMetricFamily(QUERY_LAG, _QUERY_LAG_DOC),
            GaugeMetricFamily(LAG_SECONDS, _SECONDS_DOC),
            GaugeMetricFamily(DROPPED, _DROPPED_DOC),
        ]

    def lag(self, label: str) -> Offsets | None:
        """Lag per (topic, partition) of the query ``label``, None when unknown."""
        return self._lag(label, self._observed.get(label), self._durable.get(label))

    def _lag(
        self, label: str, checkpoint: Checkpoint | None, durable: Offsets | None
    ) -> Offsets | None:
        if durable:
            ends = self._ends
            lag = {}
            for key, offset in durable.items():
                if (end := ends.get(key)) is None:
                    break
                lag[key] = max(0, end - offset)
            else:
                return lag
        if checkpoint is None:
            return None
        ends, latest = self._offsets(label, checkpoint)
        if not ends or not latest:
            return None
        return {key: max(0, latest[key] - ends[key]) for key in ends if key in latest}

    def _offsets(self, label: str, checkpoint: Checkpoint) -> tuple[Offsets, Offsets]:
        """The checkpoint's end and latest Kafka offsets, decoded once per checkpoint."""
        cached = self._decoded.get(label)
        if cached is None or cached[0] is not checkpoint:
            ends = kafka_offsets(checkpoint, self._extra, "end_offset")
            latest = kafka_offsets(checkpoint, self._extra, "latest_offset")
            cached = self._decoded[label] = (checkpoint, ends, latest)
        return cached[1], cached[2]

    def collect(self, now: float | None = None) -> Iterator[Metric]:
        now = time.monotonic() if now is None else now
        observed, durable = self._observed.copy(), self._durable.copy()
        lag_family = Metric(LAG, _LAG_DOC, "gauge")
        query_lag = GaugeMetricFamily(QUERY_LAG, _QUERY_LAG_DOC, labels=["query"])
        seconds = GaugeMetricFamily(LAG_SECONDS, _SECONDS_DOC, labels=["query"])
        budget, dropped = self._partition_budget, 0
        with self._history_lock:
            for label in self._history.keys() - observed.keys() - durable.keys():
                del self._history[label]  # retired
            for label in self._decoded.keys() - observed.keys():
                del self._decoded[label]
            for label in {**observed, **durable}:  # first seen first: they keep the cap
                try:
                    lag = self._lag(label, observed.get(label), durable.get(label))
                    if lag is None:
                        continue
                    if len(lag) <= budget:
                        budget -= len(lag)
                        for (topic, partition), records in lag.items():
                            labels = {"query": label, "topic": topic, "partition": str(partition)}
                            lag_family.add_sample(LAG, labels, records)
                    else:
                        dropped += len(lag) if self._partition_budget else 0
                        per_topic: dict[str, int] = {}
                        for (topic, _), records in lag.items():
                            per_topic[topic] = per_topic.get(topic, 0) + records
                        for topic, records in per_topic.items():
                            lag_family.add_sample(LAG, {"query": label, "topic": topic}, records)
                    total = sum(lag.values())
                    query_lag.add_metric([label], total)
                    seconds.add_metric([label], self._seconds(label, observed, total, now))
                except Exception:  # one odd query must not take the scrape down
                    if label not in self._failed:
                        self._failed.add(label)
                        log.exception("lag of query %s cannot be computed; skipping it", label)
        yield lag_family
        yield query_lag
        yield seconds
        yield GaugeMetricFamily(DROPPED, _DROPPED_DOC, value=dropped)

    def _seconds(
        self, label: str, observed: dict[str, Checkpoint], total: int, now: float
    ) -> float:
        """Lag in seconds at the query's consumption rate (position over the last minute)."""
        checkpoint = observed.get(label)
        history = self._history.get(label)
        if history is None:
            history = self._history[label] = deque()
            if (first := self._first.pop(label, None)) is not None and first[0] < now:
                history.append((first[0], self._position(first[1])))
        position = sum(self._offsets(label, checkpoint)[0].values()) if checkpoint else 0
        history.append((now, position))
        while len(history) > 2 and now - history[0][0] > RATE_WINDOW_S:
            history.popleft()
        (t0, p0), (t1, p1) = history[0], history[-1]
        rate = (p1 - p0) / (t1 - t0) if t1 > t0 else 0.0
        return 0.0 if total == 0 else (total / rate if rate > 0 else math.inf)

    def _position(self, checkpoint: Checkpoint) -> int:
        return sum(kafka_offsets(checkpoint, self._extra).values())
