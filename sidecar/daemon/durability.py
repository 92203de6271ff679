"""What an acknowledgement is worth: Redis persistence, and noticing when Redis lost data.

An ack means "stored in Redis". With ``appendonly no`` a Redis restart loses every update
since the last RDB snapshot; ``FLUSHALL`` or a replaced instance loses all of them. The daemon
cannot prevent that, but it must not be silent about it:

- At start and after every reconnect it reads ``CONFIG GET appendonly``: the gauge
  ``checkpoint_sidecar_redis_aof_enabled`` (absent when CONFIG is refused, as on some managed
  services) and a WARNING when it is off. ``SIDECAR_REDIS_REQUIRE_AOF=true`` refuses to start
  (exit 2) when it is known to be off.
- It marks the namespace at start (a key set once, kept by every daemon that shares the
  namespace). When the marker has vanished or changed (checked every second), Redis lost the
  namespace's data while the daemon ran:
  ``checkpoint_sidecar_redis_resets_total`` counts it, and an ERROR names each query whose
  last acknowledged batch (kept on its entry in ``sidecar.daemon.queries``, O(1) per ack) is
  above what Redis and the blob hold now — the size of the loss, so an operator knows what
  to replay.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskStatus

from sidecar.backoff import next_tick
from sidecar.buffer.redis_buffer import RedisBuffer
from sidecar.daemon.queries import Queries
from sidecar.errors import ConfigError, CorruptRecord, SidecarError
from sidecar.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0

#: The batch id a query's blob holds (None: no blob), read from the store.
BlobBatch = Callable[[str], Awaitable[int | None]]


class DurabilityWatch:
    def __init__(
        self,
        buffer: RedisBuffer,
        metrics: Metrics,
        *,
        token: str,
        require_aof: bool,
        blob_batch: BlobBatch,
        queries: Queries,
    ) -> None:
        """``queries``: the daemon's record of live queries, where each one's last
        acknowledged batch is kept (``sidecar.daemon.queries``)."""
        self._buffer = buffer
        self._metrics = metrics
        self._token = token
        #: The namespace's marker as this daemon last saw it (its own token, or the one
        #: another daemon of the namespace set first).
        self._marker = token
        self._claims = 0
        self._require_aof = require_aof
        self._blob_batch = blob_batch
        self._queries = queries
        self._down = False
        #: Completed passes (for tests and debugging).
        self.checks = 0

    def acked(self, query_id: str, label: str, batch_id: int) -> None:
        """An update was acknowledged to a client (called on the ingest path: O(1)). A retired
        query's entry is gone with it: nothing was pending, so Redis or the blob held its last
        acknowledged batch; a later loss is found by its next ack."""
        q = self._queries.entry(query_id, label)
        q.acked = max(q.acked, batch_id)

    async def start(self) -> None:
        """Check persistence and write the marker (Redis must answer).

        Raises:
            ConfigError: ``require_aof`` and Redis reports appendonly off.
        """
        if not await self._check_aof() and self._require_aof:
            raise ConfigError(
                "Redis has appendonly off and SIDECAR_REDIS_REQUIRE_AOF=true: acknowledged "
                "updates would not survive a Redis restart. Turn AOF on (appendonly yes) or "
                "unset SIDECAR_REDIS_REQUIRE_AOF"
            )
        self._marker = await self._buffer.claim_marker(self._token)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await anyio.sleep_until(next_tick(anyio.current_time(), CHECK_INTERVAL_S))
            try:
                await self.check()
            except SidecarError as exc:
                self._down = True  # re-read the persistence setting once Redis is back
                log.debug("durability check skipped: %s", exc)

    async def check(self) -> None:
        """One pass: after an outage re-read AOF; detect a lost marker.

        Raises:
            BufferUnavailable: Redis is down (the next pass tries again).
        """
        marker = await self._buffer.marker()
        if self._down:
            self._down = False
            await self._check_aof()
        if marker != self._marker:
            self._metrics.redis_resets.inc()
            # A new value each time: a daemon of the namespace that still holds the old one
            # must see the loss too.
            self._claims += 1
            self._marker = await self._buffer.claim_marker(f"{self._token}/{self._claims}")
            await self._report_loss()
        self.checks += 1

    async def _check_aof(self) -> bool | None:
        enabled = await self._buffer.aof_enabled()
        self._metrics.set_redis_aof(enabled)
        if enabled is False:
            log.warning(
                "Redis at %s has appendonly off: an ack means 'in Redis memory'; a Redis "
                "restart loses every update acknowledged since its last snapshot. Turn AOF on "
                "(appendonly yes), or set SIDECAR_REDIS_REQUIRE_AOF=true to refuse to start",
                self._buffer.url,
            )
        elif enabled is None:
            log.info("Redis refuses CONFIG GET: whether acks survive a restart is unknown")
        return enabled

    async def _report_loss(self) -> None:
        lost: list[str] = []
        for query_id, q in self._queries:
            acked, label = q.acked, q.label
            if acked < 0:
                continue
            try:
                stored = await self._buffer.stored_batch(query_id)
            except CorruptRecord:
                stored = None  # a damaged record holds no batch (the flusher reports it)
            try:
                durable = await self._blob_batch(query_id)
            except SidecarError:
                durable = None
            held = max(b for b in (stored, durable, -1) if b is not None)
            if acked > held:
                lost.append(f"{label} (acked batch {acked}, now {held if held >= 0 else 'none'})")
        log.error(
            "Redis lost the namespace's data while the daemon ran (restart without AOF, "
            "FLUSHALL or a new instance): %s",
            "; ".join(lost)
            if lost
            else "every acknowledged batch is still held by Redis or the blobs",
        )
