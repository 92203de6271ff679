"""Retirement benchmark: a daemon's memory after 10,000 distinct queries, 100 still active.

Starts redis-server and Azurite and, per scenario, a fresh daemon process (own namespace,
flush tick 0.05 s, ``SIDECAR_QUERY_IDLE_S`` = 2 s, count threshold 3), all from
``tests.services``. Queries are named after their ids, so each has its own metric series.

1. churn: 10,000 distinct queries in waves of 100; each sends 3 updates (batches 0-2,
   pipelined, one flush each) and stops, as a query whose checkpoint directory was replaced
   does. The next wave starts once the wave's last query is in its blob and the daemon holds
   at most 100 leases (the previous wave retired): at most 200 queries are live at a time,
   which keeps Azurite (a single Node process logging every request) from falling behind,
   so every blob call is answered within the write timeout. The last wave stays
   active: it sends one more update every 0.5 s (below the idle time) until the daemon has
   held exactly 100 leases (``checkpoint_sidecar_lease_held`` series) for 10 rounds in a row.
2. baseline: a fresh daemon that only ever sees those 100 queries, fed the same way.

Then, for each: the daemon's resident memory (``VmRSS``, ``/proc``), the series with a
``query`` label in ``/metrics``, all series, and the retirements its log reports. Results:
``bench/results/retire.json``; exit code 1 when the churn daemon's series are not those of
the 100 active queries (``anomaly``).
"""

from __future__ import annotations

import platform
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import anyio

from sidecar.config import Config
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from bench.common import (
    BenchError,
    bench_main,
    environment,
    redis_version,
    rss_kib,
    tool_version,
)
from tests.services import Azurite, DaemonProcess, RedisServer

CONTAINER = "bench-retire"
QUERIES, ACTIVE, UPDATES = 10_000, 100, 3  # distinct queries; active at the end; per query
IDLE_S, TICK_S, KEEPALIVE_S, SETTLE_ROUNDS = 2, 0.05, 0.5, 10
Result = dict[str, Any]


def query_id(i: int) -> str:
    return f"00000000-0000-4000-8000-{i:012d}"


def progress(i: int, batch: int) -> tuple[str, dict[str, Any]]:
    """A rate-source ``progress`` request of query ``i``, named after its id."""
    start, end, qid = batch * 10, batch * 10 + 10, query_id(i)
    return "progress", {"progress": {
        "id": qid, "runId": "6b7d1d0a-3a39-4a58-9a44-0d4a6f0c0a11", "name": qid,
        "timestamp": f"2026-11-21T10:{batch // 60 % 60:02d}:{batch % 60:02d}.000Z",
        "batchId": batch, "batchDuration": 112, "numInputRows": 10, "stateOperators": [],
        "durationMs": {"addBatch": 71, "triggerExecution": 112, "walCommit": 15},
        "sources": [{"description": "RateStreamV2[rowsPerSecond=10, rampUpTimeSeconds=0]",
                     "startOffset": start, "endOffset": end, "latestOffset": end,
                     "numInputRows": 10, "inputRowsPerSecond": 10.0}],
        "sink": {"description": "ConsoleTable$@5c8a1", "numOutputRows": 10},
    }}  # fmt: skip


def series(daemon: DaemonProcess) -> tuple[int, int, int]:
    """(series with a query label, lease_held series, all series) in ``/metrics``."""
    with urllib.request.urlopen(daemon.admin_url + "/metrics", timeout=10) as resp:
        lines = [x for x in resp.read().decode().splitlines() if x and not x.startswith("#")]
    labelled = [x for x in lines if 'query="' in x]
    leases = [x for x in labelled if x.startswith("checkpoint_sidecar_lease_held{")]
    return len(labelled), len(leases), len(lines)


class Run:
    """One daemon process with its own namespace, fed over one connection."""

    def __init__(self, azurite: Azurite, redis_url: str, tmp: Path, name: str) -> None:
        self.name, self.namespace = name, f"retire-{name}-{uuid.uuid4().hex[:8]}"
        self.log_path = tmp / f"{name}.log"
        self.daemon = DaemonProcess({
            "SIDECAR_SOCKET_PATH": str(tmp / f"{name}.sock"), "SIDECAR_REDIS_URL": redis_url,
            "SIDECAR_NAMESPACE": self.namespace, "SIDECAR_CONTAINER": CONTAINER,
            "SIDECAR_METRICS_HOST": "127.0.0.1", "SIDECAR_LOG_LEVEL": "INFO",
            "SIDECAR_FLUSH_INTERVAL_S": str(TICK_S), "SIDECAR_QUERY_IDLE_S": str(IDLE_S),
            "SIDECAR_COUNT_THRESHOLD": str(UPDATES), "SIDECAR_TIME_THRESHOLD_S": "1",
            "SIDECAR_FLUSH_CONCURRENCY": "16", "SIDECAR_LEASE_DURATION_S": "15",
            "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
        }, self.log_path)  # fmt: skip
        conn = azurite.connection_string
        self.store = BlobStore(
            Config(namespace=self.namespace, container=CONTAINER, azure_connection_string=conn)
        )
        self.client: SidecarClient | None = None
        self.updates = 0

    async def send(self, requests: list[tuple[str, dict[str, Any]]]) -> None:
        assert self.client is not None
        replies = await self.client.send_many(requests)
        if bad := [r for r in replies if not (r.ok and r.applied)]:
            raise BenchError(f"{self.name}: {len(bad)} update(s) not acknowledged: {bad[0]}")
        self.updates += len(requests)

    async def wait_blob(self, i: int, batch: int) -> None:
        with anyio.fail_after(60):
            while (doc := await self.store.read(query_id(i))) is None or doc.batch_id < batch:  # noqa: ASYNC110 - polls the blob
                await anyio.sleep(0.05)

    async def feed(self, first: int) -> int:
        """Waves of ``ACTIVE`` new queries from ``first`` on, ``UPDATES`` each; the last wave
        is kept active until the daemon is steady. Returns the keep-alive rounds."""
        for wave in range(first, QUERIES, ACTIVE):
            await self.send([progress(i, b) for i in range(wave, wave + ACTIVE)
                             for b in range(UPDATES)])  # fmt: skip
            await self.wait_blob(wave + ACTIVE - 1, UPDATES - 1)
            with anyio.fail_after(60):
                while (await anyio.to_thread.run_sync(series, self.daemon))[1] > ACTIVE:  # noqa: ASYNC110 - polls /metrics
                    await anyio.sleep(0.1)
        active, batch, rounds, steady = range(QUERIES - ACTIVE, QUERIES), UPDATES, 0, 0
        with anyio.fail_after(300):
            while steady < SETTLE_ROUNDS:
                await anyio.sleep(KEEPALIVE_S)
                await self.send([progress(i, batch) for i in active])
                batch, rounds = batch + 1, rounds + 1
                _, leases, _ = await anyio.to_thread.run_sync(series, self.daemon)
                steady = steady + 1 if leases == ACTIVE else 0
        return rounds

    async def measure(self, first: int) -> Result:
        started = time.perf_counter()
        await anyio.to_thread.run_sync(self.daemon.start)
        self.client = await SidecarClient.connect(self.daemon.socket_path)
        try:
            rounds = await self.feed(first)
            seconds = time.perf_counter() - started
            labelled, leases, total = await anyio.to_thread.run_sync(series, self.daemon)
            rss = rss_kib(self.daemon.pid)
        finally:
            await self.client.aclose()
            await self.store.aclose()
            code = await anyio.to_thread.run_sync(self.daemon.stop, signal.SIGTERM, 30)
        if code != 0:
            raise BenchError(f"{self.name}: exit {code}")
        log = self.log_path.read_text()
        return {
            "scenario": self.name, "queries_seen": QUERIES - first, "active_at_end": ACTIVE,
            "updates": self.updates, "keepalive_rounds": rounds, "seconds": round(seconds, 1),
            "rss_kib": rss, "series_with_query_label": labelled, "lease_held_series": leases,
            "series_total": total, "retired_in_log": log.count("retired query="),
            "warnings_in_log": log.count(" WARNING "),
        }  # fmt: skip


async def measure(azurite: Azurite, redis_url: str, tmp: Path) -> list[Result]:
    baseline = await Run(azurite, redis_url, tmp, "baseline").measure(QUERIES - ACTIVE)
    churn = await Run(azurite, redis_url, tmp, "churn").measure(0)
    return [baseline, churn]


def run() -> Result:
    """Start Redis and Azurite, run both scenarios; always stop them and remove temp dirs."""
    tmp = Path(tempfile.mkdtemp(prefix="cps-retire-", dir="/tmp"))  # short: sun_path limit
    services: list[RedisServer | Azurite] = []
    try:
        services.append(redis_server := RedisServer())
        services.append(azurite := Azurite())
        for service in services:
            service.start()
        baseline, churn = anyio.run(measure, azurite, redis_server.url, tmp)
        redis_v = redis_version(redis_server.binary)
        azurite_v = tool_version([azurite.binary, "--version"])
    finally:
        for service in services:
            service.close()
        shutil.rmtree(tmp, ignore_errors=True)
    ratio = round(churn["rss_kib"] / baseline["rss_kib"], 3)
    same = churn["series_with_query_label"] == baseline["series_with_query_label"]
    return {
        "python": platform.python_version(), "azurite": azurite_v, "redis_server": redis_v,
        **environment(),
        "note": "RSS of the daemon process (VmRSS) once it holds the leases of exactly the "
                "100 active queries; CPython keeps freed memory in its arenas, so RSS is a "
                "high-water mark, not the live heap",
        "query_idle_s": IDLE_S, "rss_ratio_churn_to_baseline": ratio,
        "series_as_baseline": same,
        **({} if same else {"anomaly": "the churn daemon's query series differ from the "
                                       "baseline's: some retired query kept its series"}),
        "scenarios": [baseline, churn],
    }  # fmt: skip


def show(report: Result) -> None:
    for s in report["scenarios"]:
        print(f"  {s['scenario']:>8}: {s['queries_seen']} queries seen, RSS {s['rss_kib']} KiB, "
              f"{s['series_with_query_label']} query series ({s['series_total']} in all), "
              f"{s['retired_in_log']} retired, {s['seconds']} s")  # fmt: skip
    print(f"  RSS ratio churn/baseline: {report['rss_ratio_churn_to_baseline']}; "
          f"{report.get('anomaly', 'series as the baseline')}")  # fmt: skip


def main() -> int:
    return bench_main("retire", run, show, ok=lambda r: bool(r["series_as_baseline"]))


if __name__ == "__main__":
    raise SystemExit(main())
