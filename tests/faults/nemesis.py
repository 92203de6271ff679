"""A seeded nemesis soak: two daemons on one namespace under load, a random fault every few
seconds, and the sweep's checker throughout (``tests/faults/load.py``).

Real parts only: two daemon processes (instance ids ``soak-a`` and ``soak-b``) sharing one
redis-server (AOF) and one Azurite, the store reached through the HTTP fault proxy
(``tests/faults/store_proxy.py``). The load sends to both sockets; the watcher reads every
query's Redis record, each daemon's ``get`` and the blob, and records any backward move.

The fault schedule is drawn from the seed alone (:func:`schedule`), so the same seed replays
the same faults in the same order with the same durations (how the system interleaves with
them still varies). One fault at a time, each healed before a pause and the next:

- ``kill -9 daemon`` / ``SIGTERM daemon``: either daemon, restarted at once with the same
  settings (a SIGTERM must exit 0);
- ``kill -9 redis``: down for the fault's duration, restarted on its AOF;
- ``store stalled`` (every response held past the write timeout), ``store slow`` (0.3 s per
  response), ``store 503`` (half the calls ServerBusy), ``store down`` (connections reset);
- ``lease broken``: another client breaks one query's blob lease;
- ``kill -9 store``: Azurite killed with SIGKILL and restarted on its data after the fault's
  duration: it comes back without its last writes (up to 5 s: it saves its metadata that
  often), so the blobs go back below what Redis records as flushed. The watcher judges each
  blob from what it holds on return (``Load.store_went_back``).

At the end, with every fault healed: each acknowledged batch is in its blob and in Redis
("lost 0"), nothing moved backwards (but by what the store lost), and both daemons exit 0 on
SIGTERM.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from signal import SIGKILL
from typing import Any

import anyio
from azure.storage.blob.aio import BlobLeaseClient, BlobServiceClient

from tests.faults.load import Load, run_load
from tests.faults.store_proxy import Fault, StoreFaultProxy
from tests.services import Azurite, DaemonProcess, RedisServer

log = logging.getLogger("tests.soak")

KINDS = (
    "kill -9 daemon",
    "SIGTERM daemon",
    "kill -9 redis",
    "store stalled",
    "store slow",
    "store 503",
    "store down",
    "lease broken",
    "kill -9 store",
)
#: Azurite keeps its metadata (which blobs exist, their versions) in memory and saves it every
#: 5 s (its LokiJS store's autosave): a SIGKILL loses what changed since the last save, and one
#: sooner than this after its start the container itself (a store that lost everything).
AZURITE_SAVE_S = 5.5
QUERIES = 6
NAMESPACE = "soak"
SETTINGS = {
    "SIDECAR_NAMESPACE": NAMESPACE,
    "SIDECAR_CONTAINER": "soak",
    "SIDECAR_METRICS_HOST": "127.0.0.1",
    "SIDECAR_LEASE_DURATION_S": "15",
    "SIDECAR_WRITE_TIMEOUT_S": "1",
    "SIDECAR_COUNT_THRESHOLD": "25",
    "SIDECAR_TIME_THRESHOLD_S": "0.2",
    "SIDECAR_FLUSH_INTERVAL_S": "0.05",
    "SIDECAR_SHUTDOWN_GRACE_S": "10",
}


@dataclass(frozen=True)
class Step:
    """One fault: when (seconds from the start), what, on which daemon or query, how long."""

    at_s: float
    kind: str
    target: int
    duration_s: float


def schedule(seed: int, duration_s: float) -> list[Step]:
    """The faults of a soak of ``duration_s`` with ``seed``: a function of both alone."""
    rng = random.Random(seed)
    steps, at = [], rng.uniform(2.0, 4.0)
    while at < duration_s:
        kind = rng.choice(KINDS)
        target = rng.randrange(QUERIES if kind == "lease broken" else 2)
        length = round(rng.uniform(1.0, 4.0), 2)
        steps.append(Step(round(at, 2), kind, target, length))
        at += length + rng.uniform(1.0, 3.0)
    return steps


@dataclass
class Soak:
    seed: int
    duration_s: float
    tmp: Path
    #: Faults injected so far, by kind.
    injected: Counter[str] = field(default_factory=Counter)
    #: Exit codes of daemons stopped by a SIGTERM fault (each must be 0).
    sigterm_exits: list[int] = field(default_factory=list)
    restarts: int = 0
    #: When Azurite last (re)started, monotonic.
    store_started: float = 0.0

    async def run(self) -> dict[str, Any]:
        """Run the soak; its report. Raises AssertionError when an invariant broke."""
        steps = schedule(self.seed, self.duration_s)
        log.info("soak: seed %d, %.0f s, %d faults", self.seed, self.duration_s, len(steps))
        print(f"soak: seed {self.seed} (SOAK_SEED={self.seed} replays this schedule)", flush=True)
        with RedisServer() as redis_server, Azurite() as azurite:
            self.store_started = time.monotonic()
            with StoreFaultProxy(azurite.port, seed=self.seed) as proxy:
                return await self._run(steps, redis_server, azurite, proxy)

    async def _run(
        self, steps: list[Step], redis_server: RedisServer, azurite: Azurite, proxy: StoreFaultProxy
    ) -> dict[str, Any]:
        direct = {
            **SETTINGS,
            "SIDECAR_REDIS_URL": redis_server.url,
            "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
        }
        daemons = [
            DaemonProcess(
                direct
                | {
                    "SIDECAR_INSTANCE_ID": f"soak-{name}",
                    "SIDECAR_SOCKET_PATH": str(self.tmp / f"{name}.sock"),
                    "AZURE_STORAGE_CONNECTION_STRING": proxy.connection_string(),
                },
                self.tmp / f"daemon-{name}.log",
            )
            for name in "ab"
        ]
        for d in daemons:
            await anyio.to_thread.run_sync(functools.partial(d.start, wait=False))
        for d in daemons:
            await _listening(d)
        started = time.monotonic()
        async with AsyncExitStack() as stack:
            service = BlobServiceClient.from_connection_string(azurite.connection_string)
            await stack.enter_async_context(service)
            load = await stack.enter_async_context(
                run_load(direct, [d.socket_path for d in daemons], connections=4, rate_per_s=600)
            )
            try:
                await load.wait_acks(500, timeout_s=60)
                for step in steps:
                    await anyio.sleep(max(0.0, started + step.at_s - time.monotonic()))
                    log.info("soak: t=%.1fs %s (%d, %.1fs)", step.at_s, step.kind, step.target,
                             step.duration_s)  # fmt: skip
                    await self._inject(step, daemons, redis_server, azurite, proxy, service, load)
                    self.injected[step.kind] += 1
                await anyio.sleep(max(0.0, started + self.duration_s - time.monotonic()))
                # Heal: everything up, then let the senders stop and every ack reach its blob.
                proxy.faults = []
                await anyio.to_thread.run_sync(redis_server.start)
                for i, d in enumerate(daemons):
                    if not d.running:
                        daemons[i] = await self._restart(d)
                await load.stop_sending()
                settle_s = await load.wait_durable(timeout_s=120)
            finally:
                for d in daemons:
                    log.info("soak: daemon log tail %s:\n%s", d.log_path, d.log()[-3000:])
        load.check()
        exits = [await anyio.to_thread.run_sync(d.stop) for d in daemons]
        assert exits == [0, 0], f"the daemons' exits on SIGTERM at the end: {exits}"
        assert all(code == 0 for code in self.sigterm_exits), self.sigterm_exits
        return self._report(load, settle_s, exits)

    async def _inject(
        self,
        step: Step,
        daemons: list[DaemonProcess],
        redis_server: RedisServer,
        azurite: Azurite,
        proxy: StoreFaultProxy,
        service: BlobServiceClient,
        load: Load,
    ) -> None:
        kind = step.kind
        if kind in ("kill -9 daemon", "SIGTERM daemon"):
            d = daemons[step.target]
            if kind == "kill -9 daemon":
                d.signal(SIGKILL)
                await anyio.to_thread.run_sync(d.wait)
            else:
                self.sigterm_exits.append(await anyio.to_thread.run_sync(d.stop))
            daemons[step.target] = await self._restart(d)
            return
        if kind == "kill -9 redis":
            await anyio.to_thread.run_sync(redis_server.stop, SIGKILL)
            await anyio.sleep(step.duration_s)
            await anyio.to_thread.run_sync(redis_server.start)
            return
        if kind == "kill -9 store":
            await anyio.sleep(max(0.0, self.store_started + AZURITE_SAVE_S - time.monotonic()))
            await anyio.to_thread.run_sync(azurite.stop, SIGKILL)
            await anyio.sleep(step.duration_s)
            await anyio.to_thread.run_sync(azurite.start)
            self.store_started = time.monotonic()
            load.store_went_back()
            return
        if kind == "lease broken":
            q = load.queries[step.target]
            blob = service.get_blob_client(
                SETTINGS["SIDECAR_CONTAINER"], f"{NAMESPACE}/{q.query_id}.json"
            )
            try:
                await BlobLeaseClient(blob).break_lease(lease_break_period=0)
            except Exception as exc:  # no lease right now (between owners): nothing to break
                log.info("soak: lease of %s not broken: %s", q.name, exc)
            return
        faults = {
            "store stalled": [Fault("delay_headers", delay_s=step.duration_s + 1.0)],
            "store slow": [Fault("delay_headers", delay_s=0.3)],
            "store 503": [Fault("status", share=0.5, status=503)],
            "store down": [Fault("drop")],
        }[kind]
        proxy.faults = faults
        await anyio.sleep(step.duration_s)
        proxy.faults = []

    async def _restart(self, old: DaemonProcess) -> DaemonProcess:
        new = DaemonProcess(old.settings, old.log_path)
        await anyio.to_thread.run_sync(lambda: new.start(wait=False))
        await _listening(new)
        self.restarts += 1
        return new

    def _report(self, load: Load, settle_s: float, exits: list[int]) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "duration_s": self.duration_s,
            "faults_injected": dict(sorted(self.injected.items())),
            "faults_total": sum(self.injected.values()),
            "daemon_restarts": self.restarts,
            "updates_acked": load.acks,
            "stale_acks": load.stale_acks,
            "acks_by_daemon": {Path(p).stem: n for p, n in load.acks_by_socket.items()},
            "retriable_error_replies": dict(load.errors),
            "reconnects": load.reconnects,
            "lost": 0,  # wait_durable returned: every acknowledged batch is in blob and Redis
            "backward_moves": len(load.regressions),
            "store_losses_rewritten": self._losses_logged(),
            "longest_blob_lag_behind_an_ack_s": round(load.blob_lag_max_s, 2),
            "all_durable_after_healing_s": round(settle_s, 2),
            "sigterm_exit_codes": self.sigterm_exits + exits,
        }

    def _losses_logged(self) -> int:
        """Blobs the daemons found below Redis after the store lost writes (their log lines,
        which outlive the daemons' restarts)."""
        logs = [self.tmp / f"daemon-{name}.log" for name in "ab"]
        return sum(
            p.read_text(errors="replace").count("the blob store lost writes:")
            for p in logs
            if p.exists()
        )


async def _listening(d: DaemonProcess, timeout_s: float = 60) -> None:
    """Wait until the daemon's socket takes connections (not readiness: with two daemons on
    one namespace, each is unready while the other holds some of its leases)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stream = await anyio.connect_unix(d.socket_path)
        except OSError:
            if not d.running:
                raise AssertionError(f"daemon exited: {d.log()[-2000:]}") from None
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon not listening after {timeout_s}s") from None
            await anyio.sleep(0.05)
            continue
        await stream.aclose()
        return


def run_soak(seed: int, duration_s: float, tmp: Path) -> dict[str, Any]:
    return anyio.run(Soak(seed, duration_s, tmp).run)
