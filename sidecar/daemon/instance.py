"""The instance identity: one live daemon per (namespace, identity), and its lease id.

A daemon's blob leases carry a lease id derived from its namespace and its **instance
identity** (``SIDECAR_INSTANCE_ID``, else ``HOSTNAME`` — the pod's name under Kubernetes —
else the host name). A container restarted inside its pod has the same identity, so it
re-acquires its own leases at once (Azure accepts an acquire with the lease id that already
holds the blob) instead of waiting for them to expire.

Two *live* daemons with one identity would share a lease id, and Azure could not tell their
writes apart. So each daemon first takes an **instance lock** in Redis: a hash naming its
random token, with a TTL of the write timeout plus :data:`LIVE_S`, refreshed every
:data:`REFRESH_S`. The daemon starts a blob write only while its lock is valid by its own
monotonic clock — taken or refreshed less than ``LIVE_S - MARGIN_S`` ago — so a write
started last is over (done or timed out) before Redis could let anyone else in; and
``/readyz`` says when it is not. Each time the lock is regained after lapsing, its *epoch*
changes, and the lease manager re-acquires every lease under a new term (what was known of a
blob while not live may be stale).

A newcomer that finds the lock held by another token takes it over at once only when that
holder is provably dead: it recorded this network namespace (the kernel's boot id and the
namespace's inode) and this admin port, and the newcomer has just bound that very port (a
live holder in this network namespace would still hold it). That is the container restarted
in its pod. Otherwise (another pod given the same ``SIDECAR_INSTANCE_ID``, a pod recreated
while the old one still runs elsewhere, an admin port of 0) it waits for the lock to expire,
unready, logging who holds it. The argument for each crash point is in
``docs/architecture.md`` ("Instance identity").
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from sidecar.buffer.redis_buffer import RedisBuffer
from sidecar.errors import SidecarError
from sidecar.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

#: The lock lives this long in Redis beyond the write timeout, seconds (its TTL: how long a
#: successor with no proof that its predecessor is dead waits, at most).
LIVE_S = 10.0
#: How often the holder refreshes it.
REFRESH_S = 2.0
#: The holder starts no write later than this before ``LIVE_S`` has passed since its last
#: refresh (clock rates differ a little).
MARGIN_S = 2.0
#: Lease ids are UUIDs derived from this and "<namespace>/<identity>".
_LEASE_IDS = uuid.UUID("5f0c6d1e-8a3b-4c2e-9d7a-1b2c3d4e5f60")


def identity(configured: str | None) -> str:
    """The instance identity: the setting, else ``HOSTNAME``, else the host name."""
    return configured or os.environ.get("HOSTNAME") or socket.gethostname()


def network_namespace() -> str:
    """This process's network namespace, as "<boot id>:<namespace inode>" ("" if unknown):
    the containers of one pod share it; no other pod, and no other machine, has it."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


#: Read once, at import: the process never changes namespace (and no file is read on a loop).
NETWORK_NAMESPACE = network_namespace()


def lease_id(namespace: str, identity: str) -> str:
    """The blob lease id of ``identity`` in ``namespace``: stable across restarts."""
    return str(uuid.uuid5(_LEASE_IDS, f"{namespace}/{identity}"))


class InstanceLock:
    """This daemon's claim on its instance identity (see the module docstring)."""

    def __init__(
        self,
        buffer: RedisBuffer,
        identity: str,
        metrics: Metrics,
        *,
        admin_port: Callable[[], int | None],
        write_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``admin_port``: the port this daemon's admin endpoint bound (None: not bound);
        ``write_timeout_s``: the longest a blob write started while valid may take."""
        self._buffer = buffer
        self.identity = identity
        self._metrics = metrics
        self._admin_port = admin_port
        self._clock = clock
        self.ttl_s = write_timeout_s + LIVE_S
        self.token = uuid.uuid4().hex
        self._host = socket.gethostname()
        self._netns = NETWORK_NAMESPACE
        self._valid_until = 0.0
        #: +1 each time the lock is (re)gained after lapsing: leases re-acquire under it.
        self.epoch = 0
        #: Claims and the release one at a time: a refresh in flight cannot bring a released
        #: lock back.
        self._calls = anyio.Lock()
        self._released = False
        #: The live holder while it is not ours (its description), for logs and ``/readyz``.
        self.other: dict[str, object] | None = None
        #: A holder is proven dead only by this process's first claim, right after it bound
        #: its admin port: never later, so two daemons that each believe the other dead (one
        #: host name in two network namespaces) cannot take the lock from each other in turn.
        self._first = True

    def held(self) -> bool:
        """Whether this daemon may write: its lock was taken or refreshed recently enough."""
        return self._clock() < self._valid_until

    def live(self) -> int | None:
        """The lock's epoch while :meth:`held`, else None (the lease manager's gate)."""
        return self.epoch if self.held() else None

    def _holder(self) -> str:
        return json.dumps(
            {
                "token": self.token,
                "host": self._host,
                "netns": self._netns,
                "port": self._admin_port(),
                "pid": os.getpid(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        )

    def _dead(self, other: dict[str, object]) -> bool:
        """Whether ``other`` is provably not running: it was in this network namespace, on
        the admin port this daemon has just bound (a live holder would hold it still)."""
        port = self._admin_port()
        return (
            self._first
            and bool(port)
            and bool(self._netns)
            and other.get("netns") == self._netns
            and other.get("port") == port
        )

    async def claim(self) -> bool:
        """Take or refresh the lock (one attempt, or two when a dead holder is replaced).

        Raises:
            SidecarError: Redis cannot be reached (the lock stays valid until it lapses).
        """
        async with self._calls:
            if self._released:
                return False
            claimed = await self._claim()  # Redis unreachable: the next is still the first
        self._first = False
        return claimed

    async def _claim(self) -> bool:
        dead = ""
        for _ in range(2):
            started = self._clock()
            answer = await self._buffer.claim_instance(
                self.identity, self.token, self._holder(), int(self.ttl_s * 1000), dead
            )
            if answer is None:
                if not self.held():
                    self.epoch += 1
                    log.info(
                        "instance %s: this daemon is its live instance%s",
                        self.identity,
                        " (took over from a previous run in this network namespace, on this port)"
                        if dead
                        else "",
                    )
                self._valid_until = started + LIVE_S - MARGIN_S
                self.other = None
                self._metrics.instance_lock_held.set(1)
                return True
            try:
                other = json.loads(answer) if answer else {}
            except ValueError:
                other = {}
            if not isinstance(other, dict):
                other = {}
            if not dead and self._dead(other) and isinstance(other.get("token"), str):
                dead = str(other["token"])
                continue
            break
        if self.other != other or self.held():
            log.error(
                "instance %s is held by another live daemon (host %s, admin port %s, pid %s, "
                "since %s): this daemon writes no blob until that lock expires. Two daemons "
                "with one SIDECAR_INSTANCE_ID share a lease id; give each its own.",
                self.identity,
                other.get("host", "?"),
                other.get("port", "?"),
                other.get("pid", "?"),
                other.get("since", "?"),
            )
        self.other = other
        self._valid_until = 0.0
        self._metrics.instance_lock_held.set(0)
        return False

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Refresh (or keep trying to take) the lock until cancelled."""
        task_status.started()
        while True:
            await anyio.sleep(REFRESH_S)
            try:
                await self.claim()
            except SidecarError as exc:
                log.warning("instance %s: lock not refreshed: %s", self.identity, exc)
                if not self.held():
                    self._metrics.instance_lock_held.set(0)

    async def release(self) -> None:
        """Delete the lock if still ours (a clean stop: a successor need not wait). No claim
        runs after it."""
        async with self._calls:
            self._released = True
            self._valid_until = 0.0
            try:
                await self._buffer.release_instance(self.identity, self.token)
            except SidecarError as exc:
                log.warning("instance %s: lock not released (expires in %gs): %s",
                            self.identity, self.ttl_s, exc)  # fmt: skip

    def readiness(self) -> str | None:
        """None when held, else why not (for ``/readyz``)."""
        if self.held():
            return None
        if self.other is not None:
            return (
                f"instance {self.identity} held by another live daemon on host "
                f"{self.other.get('host', '?')} (SIDECAR_INSTANCE_ID must differ)"
            )
        if self._first:
            return f"instance lock of {self.identity} not claimed yet (starting)"
        return f"instance lock of {self.identity} not held (Redis unreachable?)"
