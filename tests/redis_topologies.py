"""Redis as production runs it, on loopback: a Redis Cluster and a Sentinel-managed primary.

Real ``redis-server`` processes (cluster mode, replicas, ``--sentinel``) on free ports in
temp dirs, started in seconds; used by tests/integration/test_redis_topologies.py and the
benchmarks.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from signal import SIGKILL
from typing import Any

import redis

from tests.services import RedisServer, Service, ServiceError, _Process, free_port

#: Fast failure detection: a dead primary is replaced within a few seconds.
NODE_TIMEOUT_MS = 1000


def _until(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.1)
    raise ServiceError(f"timed out after {timeout_s}s waiting for {what}")


def _client(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, decode_responses=True)


def _command(port: int, *args: str) -> Any:
    """A raw command (ROLE, SENTINEL ...) on one server."""
    return _client(port).execute_command(*args)  # type: ignore[no-untyped-call]


class RedisClusterNodes(Service):
    """A Redis Cluster of ``masters`` primaries (3 at least), each with ``replicas`` replicas."""

    def __init__(self, masters: int = 3, replicas: int = 0) -> None:
        self.masters, self.replicas = masters, replicas
        args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(NODE_TIMEOUT_MS),
            # A replica may be promoted however long its primary was gone (tests kill them).
            "--cluster-replica-validity-factor",
            "0",
        ]
        self.nodes = [RedisServer(extra_args=args) for _ in range(masters * (1 + replicas))]
        for node in self.nodes:  # else port + 10000, which may be taken or above 65535
            node.extra_args += ["--cluster-port", str(free_port())]

    @property
    def url(self) -> str:
        """Any node is a seed: the first one."""
        return self.nodes[0].url

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise ServiceError("redis-cli not found: run `make setup` (installs redis-tools)")
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        _until(self._settled, "the cluster to be ok on every node")

    def _settled(self) -> bool:
        for node in self.nodes:
            if not node.running:
                continue
            info = _client(node.port).cluster("info")
            if info["cluster_state"] != "ok":
                return False
        if self.replicas:  # every replica in sync with its primary
            for primary in self.primaries():
                role = _command(primary.port, "ROLE")
                if len([r for r in role[2] if int(r[2]) > 0]) < self.replicas:
                    return False
        return True

    def primaries(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.running and self._role(n) == "master"]

    def _role(self, node: RedisServer) -> str:
        return str(_command(node.port, "ROLE")[0])

    def owner(self, key: str) -> RedisServer:
        """The primary serving ``key``'s slot (the others answer MOVED)."""
        for node in self.primaries():
            try:
                _client(node.port).exists(key)
            except redis.exceptions.ResponseError:  # MOVED
                continue
            return node
        raise ServiceError(f"no primary serves {key}")

    def move_slot(self, key: str, source: RedisServer, target: RedisServer) -> None:
        """Migrate ``key``'s slot from ``source`` to ``target`` while it is in use, as
        ``redis-cli --cluster reshard`` does: IMPORTING/MIGRATING, MIGRATE the keys a few at
        a time, then SETSLOT NODE on every primary."""
        slot = self.begin_move(key, source, target)
        while self.migrate_keys(slot, source, target, 2):
            time.sleep(0.05)  # the daemon meets the half-moved slot (ASK, TRYAGAIN) meanwhile
        self.end_move(slot, target)

    def begin_move(self, key: str, source: RedisServer, target: RedisServer) -> str:
        """Mark ``key``'s slot IMPORTING on ``target`` and MIGRATING on ``source``; its slot."""
        slot = str(_command(source.port, "CLUSTER", "KEYSLOT", key))
        source_id = str(_command(source.port, "CLUSTER", "MYID"))
        target_id = str(_command(target.port, "CLUSTER", "MYID"))
        _command(target.port, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        _command(source.port, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        return slot

    def migrate_keys(self, slot: str, source: RedisServer, target: RedisServer, count: int) -> int:
        """MIGRATE up to ``count`` of the slot's keys still on ``source``; how many moved."""
        keys = _command(source.port, "CLUSTER", "GETKEYSINSLOT", slot, str(count))
        self.migrate(source, target, *keys)
        return len(keys)

    def migrate(self, source: RedisServer, target: RedisServer, *keys: str) -> None:
        """MIGRATE ``keys`` (of a slot marked by ``begin_move``) from ``source`` to ``target``."""
        if keys:
            port = str(target.port)
            _command(source.port, "MIGRATE", "127.0.0.1", port, "", "0", "5000", "KEYS", *keys)

    def end_move(self, slot: str, target: RedisServer) -> None:
        """Give the slot to ``target`` on every primary (after its last key moved)."""
        target_id = str(_command(target.port, "CLUSTER", "MYID"))
        for node in self.primaries():
            _command(node.port, "CLUSTER", "SETSLOT", slot, "NODE", target_id)

    def kill_and_await_failover(self, primary: RedisServer) -> RedisServer:
        """kill -9 ``primary``; return its replica once promoted and the cluster is ok."""
        replicas_before = {n.port for n in self.nodes if n.running} - {
            p.port for p in self.primaries()
        }
        primary.stop(SIGKILL)
        _until(
            lambda: (
                any(self._role(n) == "master" for n in self.nodes if n.port in replicas_before)
                and self._settled_without(primary)
            ),
            "a replica to be promoted",
        )
        promoted = [
            n for n in self.nodes if n.port in replicas_before and self._role(n) == "master"
        ]
        return promoted[0]

    def rejoin(self, node: RedisServer) -> None:
        """Restart a killed node (its nodes.conf makes it a replica of its successor) and
        wait until every primary has its replicas in sync again."""
        node.start()
        _until(self._settled, "the restarted node to rejoin as a replica")

    def _settled_without(self, dead: RedisServer) -> bool:
        return all(
            _client(n.port).cluster("info")["cluster_state"] == "ok"
            for n in self.nodes
            if n.running and n is not dead
        )

    def close(self) -> None:
        for node in self.nodes:
            node.close()


class Sentinel(_Process):
    """One ``redis-server --sentinel`` watching ``master_name`` at ``primary_port``."""

    name = "sentinel"

    def __init__(self, master_name: str, primary_port: int) -> None:
        super().__init__()
        self.master_name = master_name
        self.conf = self.dir / "sentinel.conf"
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.dir}\n"
            f"sentinel monitor {master_name} 127.0.0.1 {primary_port} 1\n"
            f"sentinel down-after-milliseconds {master_name} {NODE_TIMEOUT_MS}\n"
            f"sentinel failover-timeout {master_name} 10000\n"
        )
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServiceError("redis-server not found: run `make setup`")
        self.binary = binary

    def _command(self) -> list[str]:
        return [self.binary, str(self.conf), "--sentinel"]

    def primary_port(self) -> int:
        host_port = _command(self.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name)
        return int(host_port[1])


class RedisSentinelSet(Service):
    """A primary with one replica, watched by one sentinel (quorum 1): fails over in seconds."""

    master_name = "sidecar-buffer"

    def __init__(self) -> None:
        self.primary = RedisServer()
        self.replica = RedisServer()
        self.sentinel: Sentinel | None = None

    @property
    def sentinels(self) -> str:
        assert self.sentinel is not None
        return f"127.0.0.1:{self.sentinel.port}"

    @property
    def nodes(self) -> Sequence[RedisServer]:
        return [self.primary, self.replica]

    def start(self) -> None:
        self.primary.start()
        self.replica.extra_args = ["--replicaof", "127.0.0.1", str(self.primary.port)]
        self.replica.start()
        _until(lambda: self._in_sync(self.primary), "the replica to sync")
        self.sentinel = Sentinel(self.master_name, self.primary.port)
        self.sentinel.start()
        _until(lambda: self._sentinel_sees_replica(), "the sentinel to find the replica")

    def _in_sync(self, primary: RedisServer) -> bool:
        role = _command(primary.port, "ROLE")
        return role[0] == "master" and any(int(r[2]) > 0 for r in role[2])

    def _sentinel_sees_replica(self) -> bool:
        assert self.sentinel is not None
        replicas = _command(self.sentinel.port, "SENTINEL", "REPLICAS", self.master_name)
        return len(replicas) >= 1

    def kill_primary_and_await_failover(self) -> RedisServer:
        """kill -9 the primary; return the replica once the sentinel has promoted it."""
        assert self.sentinel is not None
        sentinel = self.sentinel
        old, new = self.primary, self.replica
        old.stop(SIGKILL)
        _until(lambda: sentinel.primary_port() == new.port, "the sentinel's failover")
        _until(lambda: _command(new.port, "ROLE")[0] == "master", "promotion")
        self.primary, self.replica = new, old
        return new

    def rejoin_old_primary(self) -> None:
        """Restart the killed primary as the new primary's replica; wait until in sync."""
        self.replica.extra_args = ["--replicaof", "127.0.0.1", str(self.primary.port)]
        self.replica.start()
        _until(lambda: self._in_sync(self.primary), "the old primary to resync as a replica")

    def close(self) -> None:
        if self.sentinel is not None:
            self.sentinel.close()
        self.primary.close()
        self.replica.close()
