"""The Redis buffer: latest checkpoint per query, applied atomically and never backwards.

Invariant: a query's stored ``batch_id`` only grows. The comparison and the write happen in
one Lua script, so concurrent connections (or two daemons) cannot interleave into a
regression. Batch ids are compared as canonical decimal strings, exact beyond 2**53.

The daemon acknowledges an update only after the script that stored it has returned;
concurrent updates are batched by ``sidecar.ingest.coalescer`` into one script call (one Redis round
trip) per batch.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis.exceptions as rex

from sidecar.buffer import lua, refusals
from sidecar.buffer.keys import Keys
from sidecar.buffer.rows import PendingEntry as PendingEntry
from sidecar.buffer.rows import PendingQuery as PendingQuery
from sidecar.buffer.rows import Snapshot as Snapshot
from sidecar.buffer.rows import applied_query, pending_query
from sidecar.buffer.rows import counter as _counter
from sidecar.buffer.rows import text as _text
from sidecar.buffer.topology import Topology
from sidecar.errors import (
    BufferError_,
    BufferRefused,
    BufferUnavailable,
    CorruptRecord,
    NotReplicated,
)
from sidecar.model import checkpoint as ckpt
from sidecar.model.checkpoint import Checkpoint

log = logging.getLogger(__name__)

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
# A script meeting a key of its slot already moved to another node: a slot migration is under
# way (the slot's keys move a few at a time), so the call succeeds once it has ended.
_MIGRATING = "Script attempted to access a non local key"


def _refusal(exc: Exception) -> str:
    """What a transient refusal means (``refusals``), with Redis' own words."""
    return refusals.explain(
        str(exc),
        loading=isinstance(exc, rex.BusyLoadingError),
        oom=isinstance(exc, rex.OutOfMemoryError),
    )


class RedisBuffer:
    """All Redis operations of the daemon, each one round trip, errors translated.

    Raises (every method):
        BufferUnavailable: Redis is unreachable or refusing writes; nothing changed. Retry.
        BufferError_: Redis rejected the command for a reason retrying will not fix.
    """

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        timeout_s: float = 2.0,
        topology: Topology | None = None,
        min_replicas: int = 0,
        on_replicas: Callable[[int], None] | None = None,
        client: Any = None,
    ) -> None:
        """``client``: a redis-py asyncio client to use instead of connecting (the unit
        tests' fake at this edge). ``topology``: standalone at ``url`` unless given
        (``sidecar.buffer.topology``).
        ``min_replicas``: every apply waits until that many replicas have it (``WAIT``, at
        most half of ``timeout_s``), else raises :class:`NotReplicated`; ``on_replicas`` is
        told each answer."""
        self.keys = Keys(namespace)
        self._min_replicas = min_replicas
        self._wait_ms = max(1, int(timeout_s * 500))
        self.on_replicas = on_replicas
        self._topology = topology or Topology("standalone", url)
        self._url = str(self._topology)
        self._redis = client if client is not None else self._topology.connect(timeout_s)
        self._apply = self._redis.register_script(lua.APPLY)
        self._apply_rows = self._redis.register_script(lua.APPLY_ROWS)
        self._snapshot = self._redis.register_script(lua.SNAPSHOT)
        self._pending = self._redis.register_script(lua.PENDING)
        self._mark_flushed = self._redis.register_script(lua.MARK_FLUSHED)
        self._flushed = self._redis.register_script(lua.FLUSHED)
        self._admin = {op: self._redis.register_script(lua.RESET if op == "reset" else lua.RETIRE)
                       for op in ("reset", "retire")}  # fmt: skip
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
        except rex.BusyLoadingError as exc:  # a ConnectionError to redis-py; an answer to us
            self._mark(False, _refusal(exc))
            raise BufferUnavailable(
                f"Redis at {self._url} refused {what}: {_refusal(exc)}; nothing was stored, "
                "retry — it answers once loaded"
            ) from exc
        except rex.AuthenticationError as exc:  # a ConnectionError to redis-py: not ours
            self._mark(False, f"refused the daemon's credentials ({exc})")
            raise BufferRefused(
                f"Redis at {self._url} refused the daemon's credentials during {what} ({exc}): "
                "a configuration error, not an outage -- set the password (and user) in "
                "SIDECAR_REDIS_URL (e.g. its Secret) to what Redis' requirepass or ACL expects; "
                "nothing was stored, retried meanwhile"
            ) from exc
        except rex.NoPermissionError as exc:
            self._mark(False, f"refused a command to the daemon's user ({exc})")
            raise BufferRefused(
                f"Redis at {self._url} refused {what} to the daemon's user ({exc}): a "
                "configuration error -- grant that user the command named, on the namespace's keys "
                "(docs/troubleshooting.md); nothing was stored, retried meanwhile"
            ) from exc
        except (rex.ConnectionError, rex.TimeoutError, OSError, rex.RedisClusterException) as exc:
            self._mark(False, str(exc))
            raise BufferUnavailable(
                f"Redis at {self._url} is unreachable during {what} ({exc}); nothing was "
                "stored, retry — the daemon reconnects by itself when Redis is back"
            ) from exc
        except rex.ResponseError as exc:
            hint = self._topology.hint(exc)
            transient = isinstance(exc, _TRANSIENT_ERRORS) or str(exc).startswith(
                _TRANSIENT_PREFIXES
            )
            if hint or transient:
                reason = hint or _refusal(exc)
                self._mark(False, reason)
                raise BufferUnavailable(
                    f"Redis at {self._url} refused {what}: {reason}; nothing was stored, "
                    "retry later"
                ) from exc
            if str(exc).startswith(_MIGRATING):
                reason = f"its slot is being migrated between cluster nodes ({exc})"
                self._mark(False, reason)
                raise BufferUnavailable(
                    f"Redis at {self._url} refused {what}: {reason}; nothing was stored, retry "
                    "-- it answers once the migration has moved the slot's keys"
                ) from exc
            raise BufferError_(f"Redis at {self._url} rejected {what}: {exc}") from exc
        except rex.ClusterError as exc:  # redirected (MOVED, ASK, TRYAGAIN) until redis-py gave up
            self._mark(False, str(exc))
            raise BufferUnavailable(
                f"Redis at {self._url} kept redirecting {what} until the client gave up ({exc}): "
                "a slot migration or failover is under way; nothing was stored, retry"
            ) from exc
        self._mark(True)

    async def ping(self) -> None:
        """Check that the namespace can be written (a key of its slot: in a cluster, its
        node; a replica refuses): readiness and ``redis_up`` mean "can store", not "answers"."""
        with self._translate("write probe"):
            await self._redis.set(self.keys.probe, b"1", px=60_000)

    async def apply(
        self, checkpoints: Sequence[Checkpoint], floors: Sequence[int | None] | None = None
    ) -> list[Outcome]:
        """Store each checkpoint unless its query already holds that batch or a newer one.

        ``floors``: per update, the batch its query's blob holds (-1: no blob), or None when
        not known yet; the update must also be newer than it (``sidecar.flush.blob_state``). Without
        ``floors``, Redis' batch alone decides.

        Updates are applied in order, so a later update of the same query in the same call
        sees the earlier one. Returns the outcome of each update.
        """
        if not checkpoints:
            return []
        return [Outcome(int(r)) for r in await self._call_apply(self._apply, checkpoints, floors)]

    async def apply_rows(
        self, checkpoints: Sequence[Checkpoint], floors: Sequence[int | None] | None = None
    ) -> Applied:
        """:meth:`apply`, also returning the row of each update applied, as
        :meth:`snapshot` would read it right after: what the flush of a waiting ack needs."""
        applied = Applied([], [])
        if not checkpoints:
            return applied
        for c, r in zip(checkpoints, await self._call_apply(self._apply_rows, checkpoints, floors),
                        strict=True):  # fmt: skip
            if isinstance(r, int):
                applied.outcomes.append(Outcome(r))
                continue
            applied.outcomes.append(Outcome.APPLIED)
            applied.rows.append(applied_query(c, r))
        return applied

    async def _call_apply(
        self, script: Any, checkpoints: Sequence[Checkpoint], floors: Sequence[int | None] | None
    ) -> list[Any]:
        keys = [self.keys.pending, self.keys.queries, self.keys.names]
        args: list[str | bytes] = []
        prefix = self.keys.query_prefix
        for i, c in enumerate(checkpoints):
            floor = "" if floors is None else _floor_arg(floors[i])
            keys.append(prefix + c.query_id)
            # The checkpoint's one encode; its offsets are copied as the client sent them.
            args += (f"{floor} {c.batch_id} {c.query_id} {c.name or ''}".encode(), ckpt.encode(c))
        with self._translate("apply"):
            if self._min_replicas:
                return list(await self._apply_replicated(script, keys, args))
            return list(await script(keys=keys, args=args))

    async def _apply_replicated(self, script: Any, keys: list[str], args: list[str | bytes]) -> Any:
        """The apply script, a write of the probe key, then ``WAIT``, on one connection of the
        namespace's node: WAIT counts the replicas that have this connection's last write,
        and the probe write makes that cover an update stored earlier elsewhere (a resend
        that is now stale) too, since replicas apply the stream in order."""
        for attempt in (1, 2):
            pipe = self._redis.pipeline(transaction=False)
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            pipe.set(self.keys.probe, b"1", px=60_000)
            node = await self._topology.node_of(self._redis, self.keys.pending)
            pipe.execute_command("WAIT", self._min_replicas, self._wait_ms, **node)
            result, _, replicas = await pipe.execute(raise_on_error=False)
            if isinstance(result, rex.NoScriptError) and attempt == 1:
                await self._redis.script_load(script.script)  # a restarted or new primary
                continue
            break
        for answer in (result, replicas):
            if isinstance(answer, Exception):
                raise answer
        if self.on_replicas is not None:
            self.on_replicas(int(replicas))
        moved = node != await self._topology.node_of(self._redis, self.keys.pending)
        if int(replicas) < self._min_replicas or moved:  # WAIT may have asked another node
            raise NotReplicated(
                f"stored on the Redis primary but confirmed by {replicas} of "
                f"SIDECAR_REDIS_MIN_REPLICAS={self._min_replicas} replica(s) within "
                f"{self._wait_ms} ms; resend (safe)"
            )
        return result

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

    async def snapshot(self, extra: Iterable[str] = (), *, only: bool = False) -> Snapshot:
        """Every query with pending updates (plus ``extra`` ones; with ``only``: just the
        ``extra`` ones), read atomically; those whose record cannot be read are in
        ``corrupt`` (left as they are), not in ``queries``."""
        args = [self.keys.query_prefix, "0" if only else "1", *extra]
        with self._translate("snapshot"):
            raw = await self._snapshot(keys=[self.keys.pending], args=args)
        now_ms = int(raw[0])
        snapshot = Snapshot(now_ms, [], {})
        for row in raw[1:]:
            query_id = _text(row[0])
            try:
                query = pending_query(query_id, self.keys.query(query_id), row[1:], now_ms)
            except CorruptRecord as exc:
                snapshot.corrupt[query_id] = exc
                continue
            if query is not None:
                snapshot.queries.append(query)
        return snapshot

    async def pending(self, extra: Iterable[str] = ()) -> tuple[int, list[PendingEntry]]:
        """Redis' clock (ms) and the flush state of every query with pending updates (plus
        ``extra`` ones Redis knows), without checkpoints: what a flush check decides on."""
        args = [self.keys.query_prefix, "1", *extra]
        with self._translate("pending index"):
            raw = await self._pending(keys=[self.keys.pending], args=args)
        entries = [  # not an extra id Redis knows nothing about (or a deleted record)
            PendingEntry(
                _text(row[0]),
                pending=_counter(row[1]) if row[1] is not None else None,
                first_pending_ms=_counter(row[2]) if row[2] is not None else None,
                flushed_batch_id=_counter(row[3]) if row[3] is not None else None,
                resets=(_counter(row[5]) or 0) if row[5] is not None else 0,
                flushed_reset=_text(row[6]) if row[6] is not None else None,
            )
            for row in raw[1:]
            if any(v is not None for v in row[1:])
        ]
        return int(raw[0]), entries

    async def flushed(self) -> dict[str, tuple[int, str]]:
        """Every query's flushed batch and the blob's version that flush left, where both are
        recorded (what the audit of the store compares its listing with)."""
        keys = [self.keys.pending, self.keys.queries]
        with self._translate("flushed versions"):
            raw = await self._flushed(keys=keys, args=[self.keys.query_prefix])
        out: dict[str, tuple[int, str]] = {}
        for i in range(0, len(raw) - 2, 3):
            batch = _counter(raw[i + 1])
            if batch is not None:
                out[_text(raw[i])] = (batch, _text(raw[i + 2]))
        return out

    async def mark_flushed(
        self,
        query: PendingQuery,
        durable_batch_id: int,
        reset_at: str | None,
        blob_version: str | None = None,
    ) -> int:
        """Record that ``durable_batch_id`` is in the blob, in a document whose reset record
        is ``reset_at`` (None: none), the blob at ``blob_version`` (None: not known); clear what
        the snapshot covered.

        Returns the number of updates still pending (applied after the snapshot).
        """
        keys = [self.keys.query(query.query_id), self.keys.pending]
        args: list[str | int] = [
            query.query_id,
            query.version,
            query.pending,
            query.snapshot_ms,
            str(durable_batch_id),
            reset_at or "",
            blob_version or "",
        ]
        with self._translate("mark flushed"):
            left = await self._mark_flushed(keys=keys, args=args)
        return int(left)

    async def reset(
        self, checkpoint: Checkpoint, quiet_ms: int | None, reset_at: str | None
    ) -> list[Any]:
        """Make ``checkpoint`` the query's record, as flushed (a reset, ``lua.RESET``), in a
        document whose reset record is ``reset_at`` (the one the caller writes next); refused
        while an update was applied within ``quiet_ms`` (None: force). The script's
        answer: ``[1, ms since that update]`` or ``[0, replaced batch, updates dropped]``."""
        c = checkpoint
        args = [
            c.query_id,
            str(c.batch_id),
            ckpt.encode(c),
            c.name or "",
            quiet_ms or -1,
            reset_at or "",
        ]
        return await self.admin_script("reset", c.query_id, args)

    async def admin_script(self, op: str, query_id: str, args: list[Any]) -> list[Any]:
        """Run the ``reset`` or ``retire`` script (``sidecar.buffer.lua``) on the query's keys;
        ``retire``'s ``args``: query id, quiet ms (-1: force)."""
        keys = [self.keys.query(query_id), self.keys.pending, self.keys.queries, self.keys.names,
                self.keys.restores]  # fmt: skip
        with self._translate(op):
            return list(await self._admin[op](keys=keys, args=args))

    # --- what an acknowledgement is worth (sidecar.daemon.durability) -------------------------

    async def aof_enabled(self) -> bool | None:
        """Whether the namespace's node has ``appendonly`` on, from ``INFO`` (which managed
        services answer where ``CONFIG`` is disabled); None when INFO is refused too."""
        try:
            value = (await self.info()).get("aof_enabled")
        except BufferError_:
            return None  # INFO disabled or renamed: unknown, not an outage
        return None if value is None else bool(int(value))

    async def marker(self) -> str | None:
        """The namespace's marker (see :meth:`set_marker`), None when Redis has none."""
        with self._translate("marker read"):
            value = await self._redis.get(self.keys.marker)
        return _text(value) if value is not None else None

    async def claim_marker(self, token: str) -> str:
        """The namespace's marker, set to ``token`` if Redis has none: if it vanishes or
        changes, Redis lost the namespace. Daemons that share a namespace share its marker
        (each writing its own would read as a loss to the others)."""
        with self._translate("marker write"):
            await self._redis.set(self.keys.marker, token, nx=True)
            value = await self._redis.get(self.keys.marker)
        return _text(value) if value is not None else token

    async def stored_batch(self, query_id: str) -> int | None:
        """The batch id Redis holds for ``query_id`` (None: unknown to Redis)."""
        key = self.keys.query(query_id)
        with self._translate("batch read"):
            value = await self._redis.hget(key, "batch_id")
        return ckpt.decode_batch_id(value, key) if value is not None else None

    # --- what ``checkpoint-sidecar doctor`` reads (sidecar.ops.doctor) ----------------------------

    async def info(self) -> dict[str, Any]:
        """``INFO`` of the namespace's node (version, role, persistence, memory): read-only,
        and answered where ``CONFIG`` is disabled (managed services)."""
        with self._translate("INFO"):
            node = await self._topology.node_of(self._redis, self.keys.pending)
            reply = await self._redis.execute_command("INFO", **node)
        return dict(reply)

    async def known_names(self) -> dict[str, str]:
        """Every query name the namespace has seen, with the id that last reported it."""
        with self._translate("name listing"):
            names = await self._redis.hgetall(self.keys.names)
        return {_text(k): _text(v) for k, v in names.items()}

    # --- restores (``checkpoint-sidecar restore``: its figures, for the daemon to export) ---

    async def record_restore(self, query_id: str, record: bytes) -> None:
        """Keep ``record`` (``sidecar.model.restored``) as the query's last restore."""
        with self._translate("restore record"):
            await self._redis.hset(self.keys.restores, query_id, record)

    async def restores(self) -> dict[str, str]:
        """Each query's last restore record (JSON), by query id."""
        with self._translate("restore records"):
            found = await self._redis.hgetall(self.keys.restores)
        return {_text(k): _text(v) for k, v in found.items()}

    async def aclose(self) -> None:
        await self._redis.aclose()


@dataclass(frozen=True, slots=True)
class Applied:
    """What :meth:`RedisBuffer.apply_rows` did: each update's outcome, and the rows of those
    applied (:class:`PendingQuery`, in the order applied)."""

    outcomes: list[Outcome]
    rows: list[PendingQuery]


class Outcome(enum.IntEnum):
    """What :meth:`RedisBuffer.apply` did with one update."""

    #: Newer than Redis' batch (or Redis has none) but not than the floor given: not written.
    #: The floor may be stale (the blob rewound by another owner): re-read it, or it is stale.
    BELOW_FLOOR = -2
    #: Redis holds no batch of the query and its floor was not given: nothing was written.
    NEEDS_FLOOR = -1
    #: Not newer than the query's batch in Redis: not written.
    STALE = 0
    APPLIED = 1


def _floor_arg(floor: int | None) -> str:
    return "?" if floor is None else str(floor)
