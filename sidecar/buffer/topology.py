"""Which Redis the buffer talks to: one server, a Redis Cluster, or Sentinel's primary.

::

    standalone ─▶ Redis(SIDECAR_REDIS_URL)
    cluster    ─▶ RedisCluster(any node of SIDECAR_REDIS_URL): follows MOVED/ASK, slot
                  migrations and failovers (the node map is refreshed on each redirection)
    sentinel   ─▶ Sentinel(SIDECAR_REDIS_SENTINELS).master_for(SIDECAR_REDIS_SENTINEL_MASTER):
                  asks the sentinels for the primary at every new connection, so it follows
                  failovers; the URL gives only password, user, db and TLS

Every key of a namespace shares the hash tag ``{<namespace>}`` (``sidecar.buffer.keys``), so in a
cluster every call and script of one namespace goes to one slot's node, and namespaces spread
over the nodes. Standalone and sentinel clients never retry a call by themselves (the client
of the socket protocol retries on ``unavailable``); the cluster client re-sends a call that
was redirected, or refused while a slot moves, which is safe: nothing was executed, and a
repeated apply is refused as stale.

Standalone and sentinel clients run with Redis' maintenance notifications off
(:data:`NO_MAINT_NOTIFICATIONS`): in redis-py 8.1, "auto" (on by default under RESP3) skips the
pool's check of an idle connection at checkout, so after Redis restarts, every connection pooled
before it fails one call with "Connection closed by server" (redis/redis-py#4252, fixed by
#4260, not yet released). Off, a connection the server closed is replaced at checkout.

Also here: what an error means for the operator when the topology setting is wrong (a
cluster node given as standalone, a replica given as the primary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import redis.exceptions as rex
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.maint_notifications import MaintNotificationsConfig

from sidecar.config import Config, redact_url

Mode = Literal["standalone", "cluster", "sentinel"]
Client = aioredis.Redis | RedisCluster

#: See the module docstring: with these off, the pool replaces a connection the server closed.
NO_MAINT_NOTIFICATIONS = MaintNotificationsConfig(enabled=False)


@dataclass(frozen=True)
class Topology:
    mode: Mode
    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str | None = None
    sentinel_password: str | None = None

    @classmethod
    def of(cls, config: Config) -> Topology:
        sentinels = tuple(
            (host, int(port))
            for host, _, port in (
                s.rpartition(":") for s in (config.redis_sentinels or "").split(",")
            )
            if host
        )
        return cls(
            config.redis_mode,
            config.redis_url,
            sentinels,
            config.redis_sentinel_master,
            config.redis_sentinel_password,
        )

    def __str__(self) -> str:
        """Where the buffer is, for logs (no password)."""
        if self.mode == "sentinel":
            where = ",".join(f"{h}:{p}" for h, p in self.sentinels)
            return f"primary {self.master!r} of sentinels {where}"
        return f"{redact_url(self.url)}{' (cluster)' if self.mode == 'cluster' else ''}"

    def connect(self, timeout_s: float) -> Client:
        """A client for this topology (connections are opened lazily, at the first call)."""
        t = timeout_s
        if self.mode == "cluster":
            return RedisCluster.from_url(self.url, socket_timeout=t, socket_connect_timeout=t)
        no_retry = Retry(NoBackoff(), 0)
        if self.mode == "standalone":
            return aioredis.Redis.from_url(
                self.url,
                socket_timeout=t,
                socket_connect_timeout=t,
                retry=no_retry,
                health_check_interval=30,
                maint_notifications_config=NO_MAINT_NOTIFICATIONS,
            )
        url = urlsplit(self.url)
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            list(self.sentinels),
            sentinel_kwargs={
                "password": self.sentinel_password,
                "socket_timeout": t,
                "socket_connect_timeout": t,
            },
            socket_timeout=t,
            socket_connect_timeout=t,
        )
        assert self.master is not None  # Config checks it
        primary: aioredis.Redis = sentinel.master_for(
            self.master,
            redis_class=aioredis.Redis,
            username=url.username or None,
            password=url.password or None,
            db=int(url.path.strip("/") or 0),
            ssl=url.scheme.lower() == "rediss",
            retry=no_retry,
            health_check_interval=30,
            maint_notifications_config=NO_MAINT_NOTIFICATIONS,
            socket_timeout=t,
            socket_connect_timeout=t,
        )
        return primary

    async def node_of(self, client: Client, key: str) -> dict[str, Any]:
        """Keyword arguments that send a keyless command (WAIT, INFO) to ``key``'s node: in
        a cluster, ``target_nodes`` (the slot map is read first if this is the client's
        first call); elsewhere nothing (there is one primary)."""
        if isinstance(client, RedisCluster):
            await client.initialize()  # a no-op once initialized
            return {"target_nodes": client.get_node_from_key(key)}
        return {}

    def hint(self, exc: BaseException) -> str | None:
        """What to do about ``exc`` when it says the topology setting is wrong, else None."""
        if isinstance(exc, rex.AskError) and self.mode != "cluster":  # MOVED or ASK
            return (
                f"it is a Redis Cluster node whose slot for this namespace is elsewhere ({exc}): "
                "set SIDECAR_REDIS_MODE=cluster"
            )
        if isinstance(exc, rex.ReadOnlyError):
            fix = (
                "the sentinels' primary changed; the next call asks them again"
                if self.mode == "sentinel"
                else "point SIDECAR_REDIS_URL at the primary, or set SIDECAR_REDIS_MODE=sentinel "
                "to follow failovers"
            )
            return f"it is a read-only replica: {fix}"
        if isinstance(exc, rex.ResponseError) and "cluster support disabled" in str(exc):
            return "it is not a Redis Cluster node: set SIDECAR_REDIS_MODE=standalone"
        return None
