"""Restart benchmark: kill -9 of the daemon, restarted at once, until its next batch is in the
blob.

Starts redis-server and Azurite (``tests.services``), then per round a daemon process (own
namespace, 60 s leases, count threshold 1, fixed admin port): batch 1 is posted and flushed,
the daemon is killed with SIGKILL and a new one started with the same environment — the
container restarted in its pod. Measured from the kill: the new process ready (``/readyz``
200), its socket answering, and batch 2 (posted as soon as the socket answers) in the blob.

Two scenarios in alternating rounds:

- ``same pod``: the restarted daemon shares the killed one's state directory (the pod's
  emptyDir; here the socket's directory), so it takes its lease id over and re-acquires the
  same leases at once (``sidecar.daemon.ownership``);
- ``new pod``: it has another state directory (a new pod, or this project before the lease
  id was handed over), so it must wait out the killed daemon's lease; with 15 s leases to
  keep the run short (60 s leases would wait ~60 s: ``lease_duration_s`` is in the report).

Results: ``bench/results/restart.json`` (seconds, per round; medians; the ratio); exit code
1 when a batch never reached the blob.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from statistics import median
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from bench.common import BenchError, Report, bench_main, environment, redis_version, services
from sidecar.config import Config
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore
from tests.services import Azurite, DaemonProcess, RedisServer
from tests.sparkshapes import kafka_progress

QID = "4e57a470-0000-4000-8000-000000000001"
TIMEOUT_S = 120.0
SCENARIOS = {"same pod": 60, "new pod": 15}  # -> lease duration, s


async def post(socket_path: str, batch: int, deadline: float) -> float:
    """Post ``batch`` once the socket answers (retrying the connect); when it was acked."""
    while True:
        try:
            async with await SidecarClient.connect(socket_path) as client:
                reply = await client.progress(kafka_progress(QID, batch, name="restart"))
            if not reply.ok:
                raise BenchError(f"batch {batch} refused: {reply.error}")
            return time.monotonic()
        except OSError:
            if time.monotonic() > deadline:
                raise BenchError(f"the socket never answered for batch {batch}") from None
            await anyio.sleep(0.005)


async def in_blob(store: BlobStore, batch: int, deadline: float) -> float:
    while time.monotonic() < deadline:
        doc = await store.read(QID)
        if doc is not None and doc.batch_id >= batch:
            return time.monotonic()
        await anyio.sleep(0.01)
    raise BenchError(f"batch {batch} never reached the blob")


async def ready(proc: DaemonProcess, deadline: float) -> float:
    while time.monotonic() < deadline:
        try:
            await anyio.to_thread.run_sync(proc.wait_ready, 0.5)
            return time.monotonic()
        except Exception:
            if not proc.running:
                raise BenchError(f"the restarted daemon exited: {proc.log()[-2000:]}") from None
    raise BenchError("the restarted daemon was never ready")


async def one_round(
    tmp: Path, redis_server: RedisServer, azurite: Azurite, scenario: str, n: int
) -> dict[str, float]:
    namespace = f"restart-{n}-{uuid.uuid4().hex[:6]}"
    env = {
        "SIDECAR_SOCKET_PATH": str(tmp / f"{n}.sock"),
        "SIDECAR_REDIS_URL": redis_server.url,
        "SIDECAR_NAMESPACE": namespace,
        "SIDECAR_METRICS_HOST": "127.0.0.1",
        "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
        "SIDECAR_CONTAINER": "bench-restart",
        "SIDECAR_LEASE_DURATION_S": str(SCENARIOS[scenario]),
        "SIDECAR_COUNT_THRESHOLD": "1",
        "SIDECAR_FLUSH_INTERVAL_S": "0.05",
        "SIDECAR_INSTANCE_ID": f"driver-{n}",
    }
    first = DaemonProcess(env, tmp / f"{n}-first.log")
    first.start()
    store = BlobStore(Config.from_env(env))
    second = None
    try:
        deadline = time.monotonic() + TIMEOUT_S
        await post(first.socket_path, 1, deadline)
        await in_blob(store, 1, deadline)
        settings = dict(first.settings)  # the admin port it bound, too
        if scenario == "new pod":
            (tmp / f"{n}-new-pod").mkdir()
            settings["SIDECAR_STATE_DIR"] = str(tmp / f"{n}-new-pod")
        killed = time.monotonic()
        first.kill()
        second = DaemonProcess(settings, tmp / f"{n}-second.log")
        second.start(wait=False)
        deadline = time.monotonic() + TIMEOUT_S
        async with anyio.create_task_group() as tg:
            got: dict[str, float] = {}

            async def ready_at() -> None:
                got["ready_s"] = await ready(second, deadline) - killed

            tg.start_soon(ready_at)
            got["acked_s"] = await post(settings["SIDECAR_SOCKET_PATH"], 2, deadline) - killed
            got["in_blob_s"] = await in_blob(store, 2, deadline) - killed
        return {k: round(v, 3) for k, v in got.items()}
    finally:
        await store.aclose()
        first.kill()
        if second is not None:
            second.kill()


def run(rounds: int) -> Report:
    with ExitStack() as cleanup:
        tmp, redis_server, azurite = services(cleanup, "bench-restart-")
        per: dict[str, list[dict[str, float]]] = {s: [] for s in SCENARIOS}
        for n in range(rounds):
            order = list(SCENARIOS) if n % 2 == 0 else list(reversed(SCENARIOS))
            for scenario in order:
                if scenario == "new pod" and n >= max(1, rounds // 2):
                    continue  # each one waits out a lease: half as many rounds
                per[scenario].append(anyio.run(one_round, tmp, redis_server, azurite, scenario, n))
                print(f"  {scenario} round {n + 1}: {per[scenario][-1]}", flush=True)
    summary: dict[str, Any] = {}
    for scenario, results in per.items():
        summary[scenario] = {
            "lease_duration_s": SCENARIOS[scenario],
            "rounds": results,
            **{
                f"median_{key}": round(median(r[key] for r in results), 3)
                for key in ("ready_s", "acked_s", "in_blob_s")
            },
        }
    same, new = summary["same pod"], summary["new pod"]
    return {
        "environment": environment(),
        "redis": redis_version("redis-server"),
        "scenarios": summary,
        "kill_to_blob_ratio_new_over_same": round(
            new["median_in_blob_s"] / same["median_in_blob_s"], 1
        ),
    }


def show(report: Report) -> None:
    print("kill -9 → restarted daemon (seconds from the kill; medians)")
    for scenario, s in report["scenarios"].items():
        print(
            f"  {scenario:14} lease {s['lease_duration_s']:2d}s: ready {s['median_ready_s']:.2f}"
            f"  batch acked {s['median_acked_s']:.2f}  in blob {s['median_in_blob_s']:.2f}"
            f"  ({len(s['rounds'])} rounds)"
        )
    print(f"  new pod / same pod: {report['kill_to_blob_ratio_new_over_same']}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    return bench_main("restart", lambda: run(args.rounds), show)


if __name__ == "__main__":
    sys.exit(main())
