"""Commit Spark's durable Kafka offsets to consumer groups, so Kafka tools see Spark jobs.

Spark never commits its Kafka offsets to a consumer group, so lag exporters, Burrow and
``kafka-consumer-groups`` are blind to Spark jobs. This daemon already holds every Kafka
source's offsets; after each successful blob write it commits them.

Invariants:
- only offsets that are **durable in the blob** are committed (the flusher calls
  :meth:`KafkaCommitter.durable` after a write, never before; a reset by the daemon after its
  own);
- a partition's committed offset **never goes backwards but on purpose**: a commit that would
  lower it (e.g. after a query reset under the same name) is skipped for that partition and
  counted; only a deliberate rewind (``durable(checkpoint, rewind=why)``: a reset by the
  daemon — ``reset``, ``import-spark-checkpoint``, ``restore``) lowers it, logged at WARNING
  with why and counted (``rewound``);
- groups stay alive: the current offsets are re-committed every
  ``kafka_recommit_interval_s`` when idle, so offset retention does not expire them and lag
  tools do not report the consumer as stopped. A re-commit reads the group's offsets first
  and leaves a partition another writer moved since (a new owner of the query, another
  daemon's rewind, an operator's tool): a daemon that lost the query never moves its group.

Ordering of a rewind (Kafka has no conditional commit, so it is made by order):
- a group's commits run one at a time (a pass waits for them all; the final commit runs
  after the loop stopped), and ``durable`` only replaces what the next one commits. A commit
  of older offsets in flight when the rewind arrives is answered before the rewind's is sent;
  the rewind's commit re-reads the broker and lowers whatever that one raised;
- the rewind stays pending until a commit made with it has succeeded: a commit that began
  before it never clears it, and a newer durable checkpoint of the same query given before
  that commit keeps it (that checkpoint's offsets are committed, lowering where they are
  lower); a checkpoint of another query under the same name drops it;
- within the daemon no older checkpoint of the query follows the rewind: its flushes and the
  reset hold the same per-query lock, and a Redis row read before the reset is never flushed
  after it (``sidecar.flush.blob_state``); so a checkpoint given after the rewind is newer;
- a commit that timed out before the rewind may still reach the broker after the rewind's (a
  request left on a closed connection): the group is then raised again, and the next
  re-commit, which reads the group first, takes it for another writer's move and leaves it
  until the query's next durable batch. That window is a broker holding a request longer
  than ``kafka_timeout_s`` plus the backoff. Likewise a former owner's first commit of a
  group (it never read the group before) retried across the reset: it cannot tell the
  reset's offsets from older ones. Run the reset again if ``kafka-consumer-groups`` shows it.

The loop, the rewind's bookkeeping, the backoff and the log lines are the ones the Event Hubs
checkpointer runs too (``sidecar.sinks``); this module is their Kafka edge: reading and
committing a group's offsets through aiokafka.

Commits are made without joining the group (manual assignment, generation -1), so nothing
rebalances and no Spark executor is disturbed. Commit metadata carries query id, run id and
batch id. A broker outage never blocks flushing: commits are retried with backoff.

Kafka is optional and must never stop the core: aiokafka's errors arrive translated by
``sidecar.kafka.client`` (the client edge): :class:`KafkaUnavailable` is retried from 0.5 s
doubling to 30 s; :class:`KafkaRefused` (authentication, ACLs, an invalid group, an unusable
TLS setup) waits the 30 s cap, logged as an error. Anything else raised by a group's commit
or by the end-offset poll (a bug here or in the client) is contained too: logged once with
its traceback, counted as an error, retried with the backoff.
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from aiokafka.structs import OffsetAndMetadata, TopicPartition

from sidecar.config import Config
from sidecar.errors import KafkaRefused, SidecarError
from sidecar.kafka import client
from sidecar.model import positions
from sidecar.model.checkpoint import Checkpoint
from sidecar.model.offsets import Offsets, commit_metadata, group_name, kafka_offsets
from sidecar.sinks.loop import Attempt, SinkGroup, SinkLoop
from sidecar.sinks.report import Reporter, Words
from sidecar.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

TICK_S = 1.0
RETRY_CAP_S = 30.0
#: How its log lines name it and a group's commit.
WORDS = Words("kafka", "commit", "committing", "committed")
#: Backoff key of the end-offset poll (group names are the other keys).
_END_OFFSETS = object()
#: Why a held partition is left, in its line.
_HELD = "moved by another writer since (another owner, a reset elsewhere, an operator's tool?)"


@dataclass
class _Group(SinkGroup[tuple[str, int]]):
    """One query's consumer group and what we know of its commits (``fetched``: partitions
    whose committed offset was read from the broker since (re)connecting)."""

    committed: Offsets = field(default_factory=dict)  # as far as we know (broker's view)
    last_commit: float = 0.0
    consumer: Any = None


class KafkaCommitter(SinkLoop[_Group]):
    """Owns one aiokafka consumer per group (created lazily); the loop is ``sinks.loop``'s."""

    FINAL = "final Kafka commit"
    NOT_DONE = "committed"

    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        *,
        on_committable: Callable[[str, Offsets], None] | None = None,
        on_end_offsets: Callable[[Offsets], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        """``on_committable(label, offsets)``: a query's durable Kafka offsets, as they become
        known; ``on_end_offsets(ends)``: the brokers' end offsets of committed partitions
        (both feed the lag gauges; wired in ``sidecar.daemon.app``); ``clock``, ``jitter``: of
        the idle re-commits and the retries (a simulation's: virtual time, no randomness)."""
        reporter = Reporter(
            log, WORDS, metrics.kafka_commits, metrics.kafka_partitions_skipped, metrics.kafka_up
        )
        super().__init__(
            reporter, _Group, tick_s=TICK_S, retry_cap_s=RETRY_CAP_S, clock=clock, jitter=jitter
        )
        self._config = config
        self._metrics = metrics
        self._on_committable = on_committable
        self._on_end_offsets = on_end_offsets
        self._clock = clock
        self._extra = config.kafka_query_set
        self._where = config.kafka_bootstrap_servers or ""
        #: Built once (files are read in a worker thread); None until then, or without TLS.
        self._ssl_context: ssl.SSLContext | None = None

    def durable(self, checkpoint: Checkpoint, *, rewind: str | None = None) -> None:
        """A checkpoint is now in the blob: commit its Kafka offsets (non-blocking).
        ``rewind``: why the query was moved back on purpose (a reset by the daemon, whose
        document is now in the blob): its offsets are committed even where lower."""
        offsets = kafka_offsets(checkpoint, self._extra)
        if not offsets:
            return
        name = group_name(self._config.kafka_group_template, checkpoint, self._config.namespace)
        self._take(name, checkpoint, offsets, rewind)
        if self._on_committable is not None:
            self._on_committable(checkpoint.label, offsets)

    async def _prepare(self) -> None:
        if self._tls:
            try:
                await self._build_ssl_context()
            except KafkaRefused as exc:
                self._metrics.kafka_up.set(0)
                log.error("%s; commits wait until it can be built (retried at each attempt)", exc)

    def _due(self, group: _Group) -> bool:
        """Dirty, or idle for the re-commit interval (it keeps the group alive)."""
        idle_s = self._clock() - group.last_commit
        return group.dirty or idle_s >= self._config.kafka_recommit_interval_s

    async def _after_pass(self) -> None:
        await self._poll_end_offsets()

    async def _release(self, group: _Group) -> None:
        """Close the group's consumer (it reconnects at its next commit)."""
        consumer, group.consumer = group.consumer, None
        if consumer is not None:
            await client.stop_quietly(consumer)

    async def _write(self, group: _Group, attempt: Attempt) -> None:
        # The idle re-commit of what was committed: read the group first, so that nothing
        # another writer committed since is overwritten.
        recommit = not group.dirty
        if recommit:
            group.fetched.clear()
        async with self._call(f"commit of group {group.name}"):
            consumer = await self._consumer(group)
            tps = {key: TopicPartition(*key) for key in attempt.wanted}
            if consumer.assignment() != set(tps.values()):
                # Manual assignment: commit as a "simple" consumer, never join the group
                # (it never polls, so nothing is fetched).
                consumer.assign(list(tps.values()))
            for key, tp in tps.items():
                if key in group.fetched:
                    continue
                # e.g. a partition seen first now, a re-commit, after a failure, a rewind
                self._learn(group, key, await consumer.committed(tp), recommit=recommit)
                group.fetched.add(key)
            moves = positions.decide(
                attempt.wanted,
                group.committed,
                rewind=attempt.rewind is not None,
                held=group.held,
                rewrite_equal=True,  # re-committed: keeps the group alive
            )
            attempt.rewound = moves.rewound
            self._report.backwards(group.name, attempt.checkpoint, moves.regressed)
            level = logging.DEBUG if recommit else logging.INFO
            self._report.held(group.name, attempt.checkpoint, moves.held, why=_HELD, level=level)
            if moves.write:
                metadata = commit_metadata(attempt.checkpoint)
                await consumer.commit(
                    {tps[k]: OffsetAndMetadata(o, metadata) for k, o in moves.write.items()}
                )
        for key, offset in moves.write.items():
            group.committed[key] = offset
            group.held.discard(key)  # ours now
        attempt.done.update(moves.write)
        group.last_commit = self._clock()

    @staticmethod
    def _learn(group: _Group, key: tuple[str, int], offset: int | None, *, recommit: bool) -> None:
        """Take the broker's committed offset of a partition as what the group holds now. One
        another writer lowered since we knew it (or, read for a re-commit, moved either way)
        is held: the current offsets do not move it again."""
        known = group.committed.get(key)
        if offset is None:  # nothing committed (never, expired, deleted): committed again
            group.committed.pop(key, None)
            return
        if positions.moved_since(
            {key: known} if known is not None else {}, {key: offset}, raised_too=recommit
        ):
            group.held.add(key)
        group.committed[key] = offset

    def _call(self, what: str) -> AbstractAsyncContextManager[None]:
        return client.call(what, self._config.kafka_timeout_s, self._where)

    async def _consumer(self, group: _Group) -> Any:
        if group.consumer is None:
            if self._tls and self._ssl_context is None:
                await self._build_ssl_context()  # it failed at start: the files may be fixed
            group.consumer = await client.open_consumer(
                group.name, client.options(self._config, self._ssl_context)
            )
        return group.consumer

    def client_options(self) -> dict[str, Any] | None:
        """The client options of the commits (their TLS context, built once at start), for
        other read-only clients (``sidecar.ops.doctor``); None when that context failed."""
        if self._tls and self._ssl_context is None:
            return None
        return client.options(self._config, self._ssl_context)

    @property
    def _tls(self) -> bool:
        return self._config.kafka_security_protocol.endswith("SSL")

    async def _build_ssl_context(self) -> None:
        self._ssl_context = await client.ssl_context(self._config)

    async def _poll_end_offsets(self) -> None:
        """Read the brokers' end offsets of every committed partition, for lag metrics."""
        groups = [g for g in self._groups.values() if g.consumer is not None]
        if not groups or not self._backoff.ready(_END_OFFSETS):
            return
        consumer = groups[0].consumer
        keys = {key for g in groups for key in g.wanted}
        try:
            async with self._call("end offsets"):
                ends = await consumer.end_offsets([TopicPartition(*k) for k in keys])
        except SidecarError as exc:
            # Commits report the brokers' state (kafka_up); lag waits, backed off: a poll that
            # waits out kafka_timeout_s at every pass would hold each pass, and a new batch's
            # commit behind it, that long while the brokers are down.
            delay = self._backoff.failed(_END_OFFSETS)
            log.debug("kafka end offsets unavailable (next poll in %.1fs): %s", delay, exc)
            return
        except Exception as exc:  # a bug here or in the client: contained, never fatal
            self._failed(_END_OFFSETS, "kafka end offsets", exc)
            return
        self._backoff.succeeded(_END_OFFSETS)
        if self._on_end_offsets is not None:
            self._on_end_offsets({(tp.topic, tp.partition): off for tp, off in ends.items()})


async def rewind_once(config: Config, checkpoint: Checkpoint, why: str) -> dict[str, bool]:
    """A deliberate rewind committed now, without a daemon (the CLI's reset under a lease of
    its own, where no committer runs): ``checkpoint``'s groups set to its offsets, lowered on
    purpose where lower and logged as the daemon does. Each group's name → whether it was
    committed (a failure is logged, never raised)."""
    return await KafkaCommitter(config, Metrics()).rewind_once(checkpoint, why)
