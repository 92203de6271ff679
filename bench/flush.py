"""Flush benchmark: blob writes per 10,000 updates, and the latency from update to blob.

Starts redis-server and Azurite and per scenario a fresh daemon process (own namespace, flush
tick 0.05 s, log level WARNING; ready once ``/readyz`` answers 200), all from
``tests.services``, fed one query with strictly increasing batch ids. A query is due when it
has C (count_threshold) pending updates or its oldest is T (time_threshold_s) old; one write
covers everything pending.

1. Writes, counted in Azurite's own request log (``Azurite.blob_writes``: the blob's PUTs
   carrying a lease id), not by the daemon. count, paced: N=10,000 updates in groups of C,
   each pipelined, the next sent once a blob read shows the group's last batch; exactly
   floor(N/C) writes are then allowed while running, plus 1 at the graceful stop (SIGTERM,
   counted apart) if N % C != 0. count, free: all N pipelined; one write may cover more
   than C, so floor(N/C) is only a bound. time: T=1 s, 1,000 updates/s for 10 s, until
   nothing is pending; writes are >= T apart, so at most floor(span/T) + 1, about 10.
2. Latency to durability, C=1, one update at a time (after 5 warm-up ones): ack_mode=redis,
   send until a blob read (BlobStore.read, every 2 ms) shows it; ack_mode=blob, send until
   the ack (then one read checks the blob). "locked": sent as soon as the previous one is
   durable, i.e. just after a flush tick (about a whole tick: a worst case); "random":
   after a random 0-3 tick pause.

Client, daemon, Redis and Azurite share the machine's cores. Results: ``bench/results/
flush.json``; exit code 1 on a count other than the thresholds allow (``anomaly``) or a
blob-mode ack before the blob write.
"""

from __future__ import annotations

import platform
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from statistics import median, quantiles
from typing import Any, NamedTuple

import anyio
import redis.asyncio as aioredis

from sidecar.buffer.keys import Keys
from sidecar.config import Config
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from bench.common import BenchError, bench_main, environment, redis_version, tool_version
from tests.services import Azurite, DaemonProcess, RedisServer

CONTAINER, QUERY = "bench-flush", "5f2c9a41-7a0e-4c7b-9d51-0f6a8e2b3c10"
N, TICK_S = 10_000, 0.05  # updates per writes scenario; SIDECAR_FLUSH_INTERVAL_S
NEVER_COUNT, NEVER_S = 10_000_000, 86_400.0  # thresholds out of reach
RATE_HZ, THRESHOLD_S = 1_000, 1.0  # the time scenario
SAMPLES, WARMUP, POLL_S = 200, 5, 0.002  # the latency scenarios
Result = dict[str, Any]


class Services(NamedTuple):
    azurite: Azurite
    redis_url: str
    tmp: Path


def progress(batch_id: int) -> tuple[str, dict[str, Any]]:
    """A ``progress`` request shaped like Spark's rate-source StreamingQueryProgress JSON."""
    start, end, b = batch_id * 10, batch_id * 10 + 10, batch_id
    return "progress", {"progress": {
        "id": QUERY, "runId": "6b7d1d0a-3a39-4a58-9a44-0d4a6f0c0a11", "name": "rate-demo",
        "timestamp": f"2026-11-21T{b // 3600 % 24:02d}:{b // 60 % 60:02d}:{b % 60:02d}.000Z",
        "batchId": b, "batchDuration": 112, "numInputRows": 10, "stateOperators": [],
        "durationMs": {"addBatch": 71, "triggerExecution": 112, "walCommit": 15},
        "sources": [{"description": "RateStreamV2[rowsPerSecond=10, rampUpTimeSeconds=0]",
                     "startOffset": start, "endOffset": end, "latestOffset": end,
                     "numInputRows": 10, "inputRowsPerSecond": 10.0}],
        "sink": {"description": "ConsoleTable$@5c8a1", "numOutputRows": 10},
    }}  # fmt: skip


class Run:
    """One daemon process with its own namespace, and the means to observe its blob."""

    def __init__(self, svc: Services, name: str) -> None:
        self.svc, self.name, self.namespace = svc, name, f"{name}-{uuid.uuid4().hex[:8]}"
        conn = svc.azurite.connection_string
        self.store = BlobStore(Config(namespace=self.namespace, container=CONTAINER,
                                      azure_connection_string=conn))  # fmt: skip
        self.redis = aioredis.Redis.from_url(svc.redis_url)
        self.daemon: DaemonProcess | None = None
        self.client: SidecarClient | None = None

    async def start(self, settings: dict[str, str]) -> None:
        sock, svc = str(self.svc.tmp / f"{self.name}.sock"), self.svc
        self.daemon = DaemonProcess({
            "SIDECAR_SOCKET_PATH": sock, "SIDECAR_REDIS_URL": svc.redis_url,
            "SIDECAR_NAMESPACE": self.namespace, "SIDECAR_CONTAINER": CONTAINER,
            "SIDECAR_METRICS_HOST": "127.0.0.1", "SIDECAR_LOG_LEVEL": "WARNING",
            "SIDECAR_FLUSH_INTERVAL_S": str(TICK_S),
            "AZURE_STORAGE_CONNECTION_STRING": svc.azurite.connection_string, **settings,
        }, svc.tmp / f"{self.name}.log")  # fmt: skip
        await anyio.to_thread.run_sync(self.daemon.start)  # returns once /readyz says 200
        self.client = await SidecarClient.connect(sock)

    def log_tail(self) -> str:
        return self.daemon.log()[-3000:] if self.daemon is not None else ""

    async def send(self, batches: Iterable[int]) -> None:
        """Pipeline one update per batch id; fail unless every one is acknowledged."""
        assert self.client is not None
        replies = await self.client.send_many([progress(b) for b in batches])
        if bad := [r for r in replies if not (r.ok and r.applied)]:
            raise BenchError(f"{self.name}: {len(bad)} update(s) not acknowledged: {bad[0]}")

    async def blob_batch(self) -> int:
        doc = await self.store.read(QUERY)
        return doc.batch_id if doc is not None else -1

    async def wait_blob(self, batch: int, sent: float) -> tuple[float, float]:
        """Poll until the blob holds ``batch``. Returns perf_counter times: the start of the
        last read that did not show it (else ``sent``), and the end of the one that did."""
        not_before = sent
        with anyio.fail_after(30):
            while True:
                started = time.perf_counter()
                if await self.blob_batch() >= batch:
                    return not_before, time.perf_counter()
                not_before = started
                await anyio.sleep(POLL_S)

    async def wait_quiet(self, below: int) -> int:
        """Wait until fewer than ``below`` updates are pending: Redis is cleared only after
        the write, so none is then due or in flight. Ten more ticks must write nothing."""
        key = Keys(self.namespace).query(QUERY)
        with anyio.fail_after(30):
            while (left := int(await self.redis.hget(key, "pending") or 0)) >= below:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        await anyio.sleep(10 * TICK_S)
        return left

    async def writes(self) -> int:
        """Leased writes of the blob in Azurite's log, once the count stops changing."""
        last, blob = -1, f"{self.namespace}/{QUERY}.json"
        count_now = self.svc.azurite.blob_writes
        with anyio.fail_after(30):
            while (count := await anyio.to_thread.run_sync(count_now, CONTAINER, blob)) != last:
                last = count
                await anyio.sleep(0.3)
        return count

    async def stop(self) -> None:
        """SIGTERM: a graceful stop with its final flush; killed after 20 s."""
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        if self.daemon is None or not self.daemon.running:
            return
        code = await anyio.to_thread.run_sync(self.daemon.stop, signal.SIGTERM, 20)
        if code != 0:
            raise BenchError(f"{self.name}: exit {code}:\n{self.log_tail()}")


@asynccontextmanager
async def running(svc: Services, name: str, **settings: object) -> AsyncIterator[Run]:
    """A daemon with ``settings`` (Config field names); always stopped and closed on exit."""
    run = Run(svc, name)
    try:
        await run.start({f"SIDECAR_{k.upper()}": str(v) for k, v in settings.items()})
        yield run
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await run.stop()
            finally:
                await run.store.aclose()
                await run.redis.aclose()


def judge(result: Result, ok: bool, problem: str) -> Result:
    return {**result, "as_expected": ok, **({} if ok else {"anomaly": problem})}


async def observe(
    svc: Services, name: str, send: Callable[[Run], Awaitable[None]], below: int, **kw: object
) -> Result:
    """Run a daemon, ``send`` N updates, wait until fewer than ``below`` are pending, count
    the writes; stop it (final flush) and count again."""
    async with running(svc, name, **kw) as run:
        started = time.perf_counter()
        await send(run)
        seconds = time.perf_counter() - started
        left = await run.wait_quiet(below)
        during = await run.writes()
        await run.stop()
        total, last = await run.writes(), await run.blob_batch()
    return {
        "scenario": name, **kw, "flush_interval_s": TICK_S, "updates": N,
        "send_seconds": round(seconds, 3), "pending_before_stop": left,
        "writes_during_run": during, "writes_at_stop": total - during,
        "writes_per_10k_updates": round(total * 10_000 / N, 1), "blob_batch_after_stop": last,
    }  # fmt: skip


async def count_scenario(svc: Services, c: int, paced: bool) -> Result:
    async def send(run: Run) -> None:
        for first in range(0, N, c if paced else 100):
            await run.send(group := range(first, min(first + (c if paced else 100), N)))
            if paced and len(group) == c:  # a full group: its write is due; wait for it
                await run.wait_blob(group[-1], time.perf_counter())

    name = f"count{c}-{'paced' if paced else 'free'}"
    r = await observe(svc, name, send, c, count_threshold=c, time_threshold_s=NEVER_S)
    during, at_stop, allowed = r["writes_during_run"], r["writes_at_stop"], N // c
    want_stop = int(N % c != 0 if paced else r["pending_before_stop"] > 0)
    r.update(
        pacing="groups of C, the next once the blob holds the last" if paced else "none",
        expected_during_run=allowed if paced else f"<= {allowed}",
        expected_at_stop=want_stop,
        equals_minimum=(during, at_stop) == (allowed, want_stop) if paced else None,
    )
    ok = (during == allowed if paced else during <= allowed) and at_stop == want_stop
    problem = f"expected {r['expected_during_run']} + {want_stop} writes, got {during} + {at_stop}"
    return judge(r, ok and r["blob_batch_after_stop"] == N - 1, problem)


async def time_scenario(svc: Services) -> Result:
    per_send, every_s, span = RATE_HZ // 100, 0.01, [0.0]  # span: first to last send

    async def send(run: Run) -> None:
        start = time.perf_counter()
        for i in range(N // per_send):  # on an absolute schedule
            if (delay := start + i * every_s - time.perf_counter()) > 0:
                await anyio.sleep(delay)
            span[0] = time.perf_counter() - start
            await run.send(range(i * per_send, (i + 1) * per_send))

    kw = {"count_threshold": NEVER_COUNT, "time_threshold_s": THRESHOLD_S}
    r = await observe(svc, "time1s", send, 1, **kw)  # below=1: the tail flushes by time too
    total, about = r["writes_during_run"] + r["writes_at_stop"], round(N / RATE_HZ / THRESHOLD_S)
    allowed = int(span[0] // THRESHOLD_S) + 1
    r.update(rate_per_s=RATE_HZ, send_span_s=round(span[0], 3), expected_about=about,
             allowed_at_most=allowed, equals_about=total == about)  # fmt: skip
    ok = total <= allowed and r["writes_at_stop"] == 0 and r["blob_batch_after_stop"] == N - 1
    return judge(r, ok, f"{total} writes ({r['writes_at_stop']} at stop); at most {allowed}")


def stats_ms(samples: list[float]) -> dict[str, float]:
    pct = quantiles(samples, n=100, method="inclusive")  # pct[k - 1]: the k-th percentile
    ms = {"p50_ms": pct[49], "p99_ms": pct[98], "max_ms": max(samples)}
    return {k: round(v * 1000, 2) for k, v in ms.items()}


async def latency_scenario(svc: Services, ack_mode: str, phase: str) -> Result:
    name, pause_max_s = f"latency-{ack_mode}-{phase}", 3 * TICK_S if phase == "random" else 0
    acks, durable, resolution, early = [], [], [], []
    kw = {"count_threshold": 1, "time_threshold_s": NEVER_S, "ack_mode": ack_mode}
    async with running(svc, name, **kw) as run:
        for b in range(WARMUP):  # the first flush also acquires the lease
            await run.send([b])
            await run.wait_blob(b, time.perf_counter())
        for b in range(WARMUP, WARMUP + SAMPLES):
            await anyio.sleep(random.uniform(0, pause_max_s))
            sent = time.perf_counter()
            await run.send([b])
            acks.append(time.perf_counter() - sent)
            if ack_mode == "blob" and (held := await run.blob_batch()) < b:
                early.append((b, held))
            elif ack_mode == "redis":
                not_before, seen = await run.wait_blob(b, sent)
                durable.append(seen - sent)
                resolution.append(seen - not_before)
        writes = await run.writes() - WARMUP
    r: Result = {
        "scenario": name, **kw, "flush_interval_s": TICK_S, "samples": SAMPLES,
        "pause_before_each_send_s": f"uniform 0-{pause_max_s:g}", "ack": stats_ms(acks),
        "writes": writes, "expected_writes": SAMPLES,
    }  # fmt: skip
    if durable:
        r["seen_in_blob"] = stats_ms(durable)
        r["poll_resolution_median_ms"] = round(median(resolution) * 1000, 2)
    else:
        r["acks_before_blob_held_batch"] = len(early)
    problem = f"{writes} writes for {SAMPLES} updates; acked early (batch, blob): {early[:5]}"
    return judge(r, writes == SAMPLES and not early, problem)


async def measure(svc: Services) -> list[Result]:
    out = [await count_scenario(svc, c, paced=True) for c in (100, 300, 1000)]
    out += [await count_scenario(svc, c, paced=False) for c in (100, 1000)]
    out.append(await time_scenario(svc))
    for mode in ("redis", "blob"):
        out += [await latency_scenario(svc, mode, phase) for phase in ("locked", "random")]
    return out


def run() -> Result:
    """Start Redis and Azurite, run every scenario; always stop them and remove temp dirs."""
    tmp = Path(tempfile.mkdtemp(prefix="cps-flush-", dir="/tmp"))  # short: sun_path limit
    services: list[RedisServer | Azurite] = []
    try:
        services.append(redis_server := RedisServer())
        services.append(azurite := Azurite())
        for service in services:
            service.start()
        scenarios = anyio.run(measure, Services(azurite, redis_server.url, tmp))
        redis_v = redis_version(redis_server.binary)
        azurite_v = tool_version([azurite.binary, "--version"])
    finally:
        for service in services:
            service.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "python": platform.python_version(), "azurite": azurite_v, "redis_server": redis_v,
        **environment(),
        "note": "client, daemon, redis-server and Azurite share the machine's cores; writes "
                "are the blob's leased PUTs counted in Azurite's request log",
        "scenarios": scenarios,
    }  # fmt: skip


def show(report: Result) -> None:
    keys = ("cpu_count", "loadavg_1min_before", "python", "azurite", "redis_server")
    print("flush bench: " + "; ".join(f"{k} {report[k]}" for k in keys))
    for s in report["scenarios"]:
        if "writes" in s:  # a latency scenario
            lat = s.get("seen_in_blob", s["ack"])
            got = ", ".join(f"{k} {v}" for k, v in lat.items()) + f"; ack p50 {s['ack']['p50_ms']}"
        else:
            want = s.get("expected_during_run", s.get("expected_about"))
            got = (f"{s['writes_during_run']} writes + {s['writes_at_stop']} at stop (expected "
                   f"{want} + {s.get('expected_at_stop', 0)})")  # fmt: skip
        print(f"  {s['scenario']:>20}: {got}; {s.get('anomaly', 'ok')}")


def main() -> int:
    return bench_main(
        "flush", run, show, ok=lambda r: all(s["as_expected"] for s in r["scenarios"])
    )


if __name__ == "__main__":
    raise SystemExit(main())
