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

Event Hubs sources: the same collector, built with :data:`EVENTHUBS` (its own metric names,
an ``eventhub`` label for the ``topic`` one, the Event Hubs sources' sequence numbers), gives
their lag from Spark's view alone (there is no Event Hubs client to read the partitions' last
sequence numbers): only where the progress carries them as ``latestOffset``. The upstream
connector's source is a v1 ``Source`` without admission control, for which Spark reports the
batch's end as its latest offset (``MicroBatchExecution``: ``getOffset`` is both): a query's
Event Hubs lag is therefore exported only once a progress has shown a latest offset past the
end (``LagFamily.proven_only``), never as a 0 that only means "not reported".

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.model.checkpoint import Checkpoint
from sidecar.model.offsets import Offsets, eventhubs_offsets, kafka_offsets

log = logging.getLogger(__name__)

RATE_WINDOW_S = 60.0


@dataclass(frozen=True)
class LagFamily:
    """The metrics of one kind of source, and how its offsets are read from a checkpoint."""

    lag: str
    query_lag: str
    seconds: str
    dropped: str
    lag_doc: str
    query_lag_doc: str
    seconds_doc: str
    dropped_doc: str
    #: The label of the stream a partition belongs to (a topic, an event hub).
    stream_label: str
    #: (checkpoint, extra queries, "end_offset" | "latest_offset") -> its offsets.
    offsets: Callable[[Checkpoint, frozenset[str], str], Offsets]
    #: Export Spark's view of a query's lag only once one of its progresses has shown a
    #: latest offset past the end: a source that reports its end as its latest (Spark's v1
    #: ``Source`` without admission control, such as the Event Hubs connector's) would read
    #: 0 however far behind it is; absent says "unknown" instead.
    proven_only: bool = False


_SECONDS_DOC = (
    "Estimated time to consume the lag at the query's rate over the last minute "
    "(+Inf when the query is not consuming)"
)
KAFKA = LagFamily(
    lag="checkpoint_sidecar_kafka_lag_records",
    query_lag="checkpoint_sidecar_kafka_query_lag_records",
    seconds="checkpoint_sidecar_kafka_lag_seconds",
    dropped="checkpoint_sidecar_kafka_lag_series_dropped",
    lag_doc=(
        "Records between the end of the log and the query's position (durable offset with a "
        "broker configured, else Spark's latestOffset - endOffset); per topic (no partition "
        "label) for queries beyond SIDECAR_KAFKA_LAG_PARTITION_SERIES_MAX"
    ),
    query_lag_doc="Sum of the query's Kafka lag over all its partitions",
    seconds_doc=_SECONDS_DOC,
    dropped_doc=(
        "Per-partition lag series not exported at the last collection, because "
        "SIDECAR_KAFKA_LAG_PARTITION_SERIES_MAX was reached: those queries' lag is exported "
        "per topic"
    ),
    stream_label="topic",
    offsets=kafka_offsets,
)
EVENTHUBS = LagFamily(
    lag="checkpoint_sidecar_eventhubs_lag_records",
    query_lag="checkpoint_sidecar_eventhubs_query_lag_records",
    seconds="checkpoint_sidecar_eventhubs_lag_seconds",
    dropped="checkpoint_sidecar_eventhubs_lag_series_dropped",
    lag_doc=(
        "Events between the last sequence number Spark saw available and the query's "
        "position (Spark's latestOffset - endOffset, when its progress carries latestOffset); "
        "per event hub (no partition label) for queries beyond "
        "SIDECAR_KAFKA_LAG_PARTITION_SERIES_MAX"
    ),
    query_lag_doc="Sum of the query's Event Hubs lag over all its partitions",
    seconds_doc=_SECONDS_DOC,
    dropped_doc=(
        "Per-partition Event Hubs lag series not exported at the last collection, because "
        "SIDECAR_KAFKA_LAG_PARTITION_SERIES_MAX was reached"
    ),
    stream_label="eventhub",
    offsets=lambda checkpoint, _extra, which: eventhubs_offsets(checkpoint, which),
    proven_only=True,
)
# The Kafka family's names, as before.
LAG, QUERY_LAG, LAG_SECONDS, DROPPED = KAFKA.lag, KAFKA.query_lag, KAFKA.seconds, KAFKA.dropped


class LagTracker(Collector):
    """Registered on the daemon's registry; ``collect`` computes every query's lag."""

    def __init__(
        self,
        extra_queries: frozenset[str] = frozenset(),
        *,
        per_partition: bool = True,
        partition_series_max: int = 10_000,
        family: LagFamily = KAFKA,
    ) -> None:
        """``family``: the kind of source (:data:`KAFKA`, :data:`EVENTHUBS`) whose lag this
        collector exports."""
        self._family = family
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
        #: Queries whose progress has shown a latest offset past the end (``proven_only``;
        #: scrape threads only).
        self._proven: set[str] = set()

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
        self._proven.discard(label)  # a set's discard is atomic: scrapes may run meanwhile

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
        f = self._family
        return [
            GaugeMetricFamily(f.lag, f.lag_doc),
            GaugeMetricFamily(f.query_lag, f.query_lag_doc),
            GaugeMetricFamily(f.seconds, f.seconds_doc),
            GaugeMetricFamily(f.dropped, f.dropped_doc),
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
        lag = {key: max(0, latest[key] - ends[key]) for key in ends if key in latest}
        if self._family.proven_only:
            if any(lag.values()):
                self._proven.add(label)
            elif label not in self._proven:
                return None  # latest == end so far: the source may not report its latest
        return lag

    def _offsets(self, label: str, checkpoint: Checkpoint) -> tuple[Offsets, Offsets]:
        """The checkpoint's end and latest offsets, decoded once per checkpoint."""
        cached = self._decoded.get(label)
        if cached is None or cached[0] is not checkpoint:
            ends = self._family.offsets(checkpoint, self._extra, "end_offset")
            latest = self._family.offsets(checkpoint, self._extra, "latest_offset")
            cached = self._decoded[label] = (checkpoint, ends, latest)
        return cached[1], cached[2]

    def collect(self, now: float | None = None) -> Iterator[Metric]:
        now = time.monotonic() if now is None else now
        f = self._family
        observed, durable = self._observed.copy(), self._durable.copy()
        lag_family = Metric(f.lag, f.lag_doc, "gauge")
        query_lag = GaugeMetricFamily(f.query_lag, f.query_lag_doc, labels=["query"])
        seconds = GaugeMetricFamily(f.seconds, f.seconds_doc, labels=["query"])
        budget, dropped = self._partition_budget, 0
        with self._history_lock:
            for label in self._history.keys() - observed.keys() - durable.keys():
                del self._history[label]  # retired
            for label in self._decoded.keys() - observed.keys():
                del self._decoded[label]
            self._proven &= observed.keys()
            for label in {**observed, **durable}:  # first seen first: they keep the cap
                try:
                    lag = self._lag(label, observed.get(label), durable.get(label))
                    if lag is None:
                        continue
                    if len(lag) <= budget:
                        budget -= len(lag)
                        for (topic, partition), records in lag.items():
                            labels = {
                                "query": label,
                                f.stream_label: topic,
                                "partition": str(partition),
                            }
                            lag_family.add_sample(f.lag, labels, records)
                    else:
                        dropped += len(lag) if self._partition_budget else 0
                        per_topic: dict[str, int] = {}
                        for (topic, _), records in lag.items():
                            per_topic[topic] = per_topic.get(topic, 0) + records
                        for topic, records in per_topic.items():
                            per = {"query": label, f.stream_label: topic}
                            lag_family.add_sample(f.lag, per, records)
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
        yield GaugeMetricFamily(f.dropped, f.dropped_doc, value=dropped)

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
        return sum(self._family.offsets(checkpoint, self._extra, "end_offset").values())
