"""The Redis buffer: latest checkpoint per query, applied atomically and never backwards.

Invariant: a query's stored ``batch_id`` only grows. The comparison and the write happen in
one Lua script, so concurrent connections (or two daemons) cannot interleave into a
regression. Batch ids are compared as canonical decimal strings, exact beyond 2**53.

The daemon acknowledges an update only after the script that stored it has returned;
concurrent updates are batched by ``sidecar.coalescer`` into one script call (one Redis round
trip) per batch.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import redis.asyncio as aioredis
import redis.exceptions as rex
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from sidecar import checkpoint as ckpt
from sidecar.checkpoint import Checkpoint
from sidecar.config import redact_url
from sidecar.errors import BufferError_, BufferUnavailable, CorruptRecord
from sidecar.keys import Keys

log = logging.getLogger(__name__)

# Shared by the scripts: newer(a, b) compares canonical decimal batch ids exactly (length,
# then bytes: no float rounding above 2**53); batch(s) is true for a canonical decimal batch
# id (a Java long: no sign, no leading zero, at most 2**63-1), false for anything else that a
# damaged record may hold; `now` is Redis' clock in milliseconds.
_PRELUDE_LUA = """
local function newer(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
local function batch(s)
  if not s or not (s == '0' or string.find(s, '^[1-9]%d*$')) then return false end
  return #s < 19 or (#s == 19 and s <= '9223372036854775807')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS[1] pending zset, KEYS[2] queries set, KEYS[3] names hash, KEYS[3+i] hash of update i.
# ARGV[4i-3..4i]: query id, batch id (canonical decimal), checkpoint JSON, name ("" if none).
# Returns one integer per update: 1 applied, 0 stale.
# A damaged record (docs/architecture.md, "Corrupted records"): any update replaces one whose
# batch_id is unreadable, the next newer batch one whose checkpoint is (a readable batch_id
# stays monotonic); counters that are not integers restart from 0, so HINCRBY cannot fail
# the call and with it the other queries' updates.
_APPLY_LUA = (
    _PRELUDE_LUA
    + """
local function counter(s)
  return s and #s <= 18 and string.find(s, '^%-?%d+$') ~= nil
end
local out = {}
for i = 1, #KEYS - 3 do
  local key = KEYS[i + 3]
  local qid, id = ARGV[4 * i - 3], ARGV[4 * i - 2]
  local cur = redis.call('HMGET', key, 'batch_id', 'pending', 'version')
  if batch(cur[1]) and not newer(id, cur[1]) then
    out[i] = 0
  else
    if cur[2] and not counter(cur[2]) then redis.call('HSET', key, 'pending', 0) end
    if cur[3] and not counter(cur[3]) then redis.call('HSET', key, 'version', 0) end
    local pending = redis.call('HINCRBY', key, 'pending', 1)
    redis.call('HINCRBY', key, 'version', 1)
    redis.call('HSET', key, 'batch_id', id, 'checkpoint', ARGV[4 * i - 1], 'updated_ms', now)
    if pending == 1 then
      redis.call('HSET', key, 'first_pending_ms', now)
      redis.call('ZADD', KEYS[1], now, qid)
    end
    redis.call('SADD', KEYS[2], qid)
    if ARGV[4 * i] ~= '' then redis.call('HSET', KEYS[3], ARGV[4 * i], qid) end
    out[i] = 1
  end
end
return out
"""
)

# Everything the flusher needs, read atomically with Redis' clock.
# KEYS[1] pending zset. ARGV[1] query hash prefix; ARGV[2..] extra query ids to report even
# when nothing is pending (those with acks waiting on the blob). The query hashes are not in
# KEYS because they are found inside; they share KEYS[1]'s hash tag, so one Cluster slot.
# Returns {now_ms, {qid, pending, first_pending_ms, version, batch_id, checkpoint,
# flushed_batch_id}, ...}; absent fields are nil.
_SNAPSHOT_LUA = """
local t = redis.call('TIME')
local out = {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local seen = {}
for _, qid in ipairs(ids) do seen[qid] = true end
for i = 2, #ARGV do
  if not seen[ARGV[i]] then table.insert(ids, ARGV[i]); seen[ARGV[i]] = true end
end
for _, qid in ipairs(ids) do
  local h = redis.call('HMGET', ARGV[1] .. qid, 'pending', 'first_pending_ms', 'version',
                       'batch_id', 'checkpoint', 'flushed_batch_id')
  table.insert(out, {qid, h[1], h[2], h[3], h[4], h[5], h[6]})
end
return out
"""

# After a successful flush: record the durable batch and clear the pending state, but only
# what the flushed snapshot covered, so an update applied meanwhile is not lost.
# KEYS[1] query hash, KEYS[2] pending zset.
# ARGV: query id, version at snapshot, pending at snapshot, snapshot time (ms), durable batch.
# Returns the updates still pending.
_MARK_FLUSHED_LUA = (
    _PRELUDE_LUA
    + """
local flushed = redis.call('HGET', KEYS[1], 'flushed_batch_id')
if batch(flushed) and newer(flushed, ARGV[5]) then
  -- a stale mark (a newer flush was already recorded): it must not clear newer updates
  return tonumber(redis.call('HGET', KEYS[1], 'pending') or '0')
end
redis.call('HSET', KEYS[1], 'flushed_batch_id', ARGV[5])
redis.call('HSET', KEYS[1], 'flushed_ms', now)
local left = 0
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[2] then
  left = redis.call('HINCRBY', KEYS[1], 'pending', -tonumber(ARGV[3]))
end
if left <= 0 then
  redis.call('HSET', KEYS[1], 'pending', 0)
  redis.call('HDEL', KEYS[1], 'first_pending_ms')
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
-- Updates arrived after the snapshot; none is older than the snapshot itself.
redis.call('HSET', KEYS[1], 'first_pending_ms', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
return left
"""
)

# Redis error replies that mean "not now" rather than "never". redis-py turns some prefixes
# into their own exception classes (stripping the prefix), so check both.
_TRANSIENT_ERRORS = (
    rex.ReadOnlyError,
    rex.OutOfMemoryError,
    rex.TryAgainError,
    rex.MasterDownError,
    rex.ClusterDownError,
)
_TRANSIENT_PREFIXES = ("BUSY", "MISCONF", "CLUSTERDOWN", "NOREPLICAS", "LOADING")


class RedisBuffer:
    """All Redis operations of the daemon, each one round trip, errors translated.

    Raises (every method):
        BufferUnavailable: Redis is unreachable or refusing writes; nothing changed. Retry.
        BufferError_: Redis rejected the command for a reason retrying will not fix.
    """

    def __init__(self, url: str, namespace: str, *, timeout_s: float = 2.0) -> None:
        self.keys = Keys(namespace)
        self._url = redact_url(url)
        self._redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # No client-side retries: the caller sees the failure and the client retries the
            # request; a blind retry here could only repeat an update the script already took.
            retry=Retry(NoBackoff(), 0),
            health_check_interval=30,
        )
        self._apply = self._redis.register_script(_APPLY_LUA)
        self._snapshot = self._redis.register_script(_SNAPSHOT_LUA)
        self._mark_flushed = self._redis.register_script(_MARK_FLUSHED_LUA)
        #: Outcome of the last Redis call (None before the first); transitions are logged once.
        self.available: bool | None = None

    @property
    def url(self) -> str:
        """The Redis URL with any password redacted."""
        return self._url

    def _mark(self, available: bool, detail: str = "") -> None:
        if available != self.available:
            if available:
                log.info("Redis at %s is reachable", self._url)
            else:
                log.warning("Redis at %s is unavailable: %s", self._url, detail)
        self.available = available

    @contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        try:
            yield
        except (rex.ConnectionError, rex.TimeoutError, OSError) as exc:
            self._mark(False, str(exc))
            raise BufferUnavailable(
                f"Redis at {self._url} is unreachable during {what} ({exc}); nothing was "
                "stored, retry — the daemon reconnects by itself when Redis is back"
            ) from exc
        except rex.ResponseError as exc:
            if isinstance(exc, _TRANSIENT_ERRORS) or str(exc).startswith(_TRANSIENT_PREFIXES):
                self._mark(False, str(exc))
                raise BufferUnavailable(
                    f"Redis at {self._url} refused {what}: {exc}; retry later"
                ) from exc
            raise BufferError_(f"Redis at {self._url} rejected {what}: {exc}") from exc
        self._mark(True)

    async def ping(self) -> None:
        with self._translate("PING"):
            await self._redis.ping()

    async def apply(self, checkpoints: Sequence[Checkpoint]) -> list[bool]:
        """Store each checkpoint unless its query already holds that batch or a newer one.

        Updates are applied in order, so a later update of the same query in the same call
        sees the earlier one. Returns, per update, True when applied and False when stale.
        """
        if not checkpoints:
            return []
        keys = [self.keys.pending, self.keys.queries, self.keys.names]
        args: list[str | bytes] = []
        for c in checkpoints:
            keys.append(self.keys.query(c.query_id))
            args += (c.query_id, str(c.batch_id), ckpt.encode(c), c.name or "")
        with self._translate("apply"):
            result = await self._apply(keys=keys, args=args)
        return [bool(r) for r in result]

    async def get(self, query_id: str) -> bytes | None:
        """The stored checkpoint JSON of ``query_id``, or None when the query is unknown.

        Raises:
            CorruptRecord: the stored record cannot be read (it is left as it is).
        """
        key = self.keys.query(query_id)
        with self._translate("get"):
            value = await self._redis.hget(key, "checkpoint")
        if value is None:
            return None
        data = value.encode() if isinstance(value, str) else value
        ckpt.decode(data, key, query_id)  # checked: a reply must carry a readable record
        return data

    async def query_id_for(self, name: str) -> str | None:
        """Id of the query that most recently reported under ``name``, if any."""
        with self._translate("name lookup"):
            value = await self._redis.hget(self.keys.names, name)
        return _text(value) if value is not None else None

    async def snapshot(self, extra: Iterable[str] = ()) -> Snapshot:
        """Every query with pending updates (plus ``extra`` ones), read atomically; those whose
        record cannot be read are in ``corrupt`` (left as they are), not in ``queries``."""
        with self._translate("snapshot"):
            raw = await self._snapshot(
                keys=[self.keys.pending], args=[self.keys.query_prefix, *extra]
            )
        now_ms = int(raw[0])
        snapshot = Snapshot(now_ms, [], {})
        for row in raw[1:]:
            query_id = _text(row[0])
            try:
                query = self._pending_query(query_id, row[1:], now_ms)
            except CorruptRecord as exc:
                snapshot.corrupt[query_id] = exc
                continue
            if query is not None:
                snapshot.queries.append(query)
        return snapshot

    def _pending_query(
        self, query_id: str, fields: list[bytes | None], now_ms: int
    ) -> PendingQuery | None:
        """One row of the snapshot script, checked; None for an id Redis knows nothing of.

        Raises:
            CorruptRecord: the record's checkpoint, batch id or counters cannot be read, or
                they disagree with each other.
        """
        pending, first_ms, version, batch, doc, flushed = fields
        key = self.keys.query(query_id)
        if doc is None:
            if pending is None and version is None and batch is None:
                return None  # an extra id Redis knows nothing about (or a deleted record)
            raise CorruptRecord("redis", key, "has no checkpoint field")
        checkpoint = ckpt.decode(bytes(doc), key, query_id)
        batch_id = ckpt.decode_batch_id(batch, key)
        if checkpoint.batch_id != batch_id:
            raise CorruptRecord(
                "redis",
                key,
                f"has batch_id {batch_id} but a checkpoint of batch {checkpoint.batch_id}",
            )
        count = _counter(pending) if pending is not None else 0
        if count is None or version is None or _counter(version) is None:
            raise CorruptRecord(
                "redis",
                key,
                f"has counters that are not integers (pending {pending!r}, version {version!r})",
            )
        return PendingQuery(
            query_id=query_id,
            pending=count,
            # Bookkeeping only: unreadable reads as unknown (the flusher flushes a pending query
            # of unknown age at once, reading the blob's batch first; the flush rewrites both).
            first_pending_ms=_counter(first_ms) if first_ms is not None else None,
            version=_text(version),
            batch_id=batch_id,
            checkpoint=checkpoint,
            flushed_batch_id=_counter(flushed) if flushed is not None else None,
            snapshot_ms=now_ms,
        )

    async def mark_flushed(self, query: PendingQuery, durable_batch_id: int) -> int:
        """Record that ``durable_batch_id`` is in the blob; clear what the snapshot covered.

        Returns the number of updates still pending (applied after the snapshot).
        """
        keys = [self.keys.query(query.query_id), self.keys.pending]
        args: list[str | int] = [
            query.query_id,
            query.version,
            query.pending,
            query.snapshot_ms,
            str(durable_batch_id),
        ]
        with self._translate("mark flushed"):
            left = await self._mark_flushed(keys=keys, args=args)
        return int(left)

    # --- what an acknowledgement is worth (sidecar.durability) ------------------------------

    async def aof_enabled(self) -> bool | None:
        """Redis' ``appendonly`` setting; None when CONFIG is refused (managed services)."""
        try:
            with self._translate("CONFIG GET appendonly"):
                reply = await self._redis.config_get("appendonly")
        except BufferError_:
            return None  # CONFIG disabled or renamed: unknown, not an outage
        value = reply.get("appendonly") or reply.get(b"appendonly")  # type: ignore[call-overload]
        return None if value is None else _text(value) == "yes"

    async def marker(self) -> str | None:
        """The namespace's marker (see :meth:`set_marker`), None when Redis has none."""
        with self._translate("marker read"):
            value = await self._redis.get(self.keys.marker)
        return _text(value) if value is not None else None

    async def set_marker(self, token: str) -> None:
        """Mark the namespace's data: if the marker vanishes, Redis lost the namespace."""
        with self._translate("marker write"):
            await self._redis.set(self.keys.marker, token)

    async def stored_batch(self, query_id: str) -> int | None:
        """The batch id Redis holds for ``query_id`` (None: unknown to Redis)."""
        with self._translate("batch read"):
            value = await self._redis.hget(self.keys.query(query_id), "batch_id")
        return int(_text(value)) if value is not None else None

    async def aclose(self) -> None:
        await self._redis.aclose()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


_COUNTER = re.compile(rb"-?[0-9]{1,18}")


def _counter(value: bytes) -> int | None:
    """A stored integer (a counter, a time in ms); None when it is not one."""
    return int(value) if _COUNTER.fullmatch(value) else None


@dataclass(frozen=True, slots=True)
class PendingQuery:
    """One query's flush state as read by :meth:`RedisBuffer.snapshot`."""

    query_id: str
    pending: int
    first_pending_ms: int | None
    version: str
    batch_id: int
    checkpoint: Checkpoint
    flushed_batch_id: int | None
    snapshot_ms: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    now_ms: int
    queries: list[PendingQuery]
    #: Queries whose record cannot be read, by query id (left as they are in Redis).
    corrupt: dict[str, CorruptRecord]
