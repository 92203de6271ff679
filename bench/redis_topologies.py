"""Ingest on each Redis topology, side by side in one run: what cluster mode and
replica-acknowledged writes cost compared with a standalone Redis.

The same scenarios as ``bench/ingest.py`` (throughput with 1 and 8 pipelined connections,
open-loop latency at 1,000 updates/s; its functions, run against the real daemon process),
on three topologies started here on loopback:

* ``standalone``: one redis-server (append-only), as in bench/ingest.py;
* ``cluster``: a 3-primary Redis Cluster, ``SIDECAR_REDIS_MODE=cluster`` (one namespace lives
  in one slot, so one node serves it: the cost measured is the cluster client's);
* ``min_replicas_1``: a primary with one replica, ``SIDECAR_REDIS_MIN_REPLICAS=1`` (every
  coalesced batch waits for ``WAIT 1``: the cost of acknowledging only replicated updates).

Results, with each topology's ratio to standalone, go to ``bench/results/redis_topologies.json``.
Exit code 1 when a correctness check fails (an update not acknowledged, a wrong stored batch).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from bench.common import Report, bench_main, environment
from bench.ingest import measure, stop_daemon
from tests.redis_topologies import RedisClusterNodes
from tests.services import Azurite, DaemonProcess, RedisServer


def standalone(cleanup: ExitStack) -> dict[str, str]:
    server = RedisServer()
    cleanup.callback(server.close)
    server.start()
    return {"SIDECAR_REDIS_URL": server.url}


def cluster(cleanup: ExitStack) -> dict[str, str]:
    nodes = RedisClusterNodes(masters=3)
    cleanup.callback(nodes.close)
    nodes.start()
    return {"SIDECAR_REDIS_URL": nodes.url, "SIDECAR_REDIS_MODE": "cluster"}


def min_replicas_1(cleanup: ExitStack) -> dict[str, str]:
    primary = RedisServer()
    cleanup.callback(primary.close)
    primary.start()
    replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)])
    cleanup.callback(replica.close)
    replica.start()
    return {"SIDECAR_REDIS_URL": primary.url, "SIDECAR_REDIS_MIN_REPLICAS": "1"}


TOPOLOGIES: dict[str, Callable[[ExitStack], dict[str, str]]] = {
    "standalone": standalone,
    "cluster": cluster,
    "min_replicas_1": min_replicas_1,
}


def run_one(name: str, azurite: Azurite, tmp: Path) -> dict[str, Any]:
    with ExitStack() as cleanup:
        redis_env = TOPOLOGIES[name](cleanup)
        socket_path = str(tmp / f"{name}.sock")
        daemon = DaemonProcess(
            {
                "SIDECAR_SOCKET_PATH": socket_path,
                "SIDECAR_NAMESPACE": f"bench-{name}",
                "SIDECAR_METRICS_HOST": "127.0.0.1",
                "SIDECAR_LOG_LEVEL": "WARNING",
                "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
                **redis_env,
            },
            tmp / f"{name}.log",
        )
        cleanup.callback(stop_daemon, daemon)
        daemon.start()
        pids = {"daemon": daemon.pid, "client": os.getpid(), "whole_machine": None}
        return anyio.run(measure, socket_path, pids)


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    base = results["standalone"]
    out = {}
    for name, r in results.items():
        out[name] = {
            "acked_updates_per_s_8_connections": round(
                r["throughput"][1]["acked_updates_per_s"]
                / base["throughput"][1]["acked_updates_per_s"],
                2,
            ),
            "acked_updates_per_s_1_connection": round(
                r["throughput"][0]["acked_updates_per_s"]
                / base["throughput"][0]["acked_updates_per_s"],
                2,
            ),
            "p99_ms_at_1k_per_s": round(r["latency"]["p99_ms"] / base["latency"]["p99_ms"], 2),
        }
    return out


def run() -> Report:
    results: dict[str, dict[str, Any]] = {}
    with ExitStack() as cleanup:
        tmp = Path(tempfile.mkdtemp(prefix="cps-bench-", dir="/tmp"))
        cleanup.callback(shutil.rmtree, tmp, ignore_errors=True)
        azurite = Azurite()
        cleanup.callback(azurite.close)
        azurite.start()
        for name in TOPOLOGIES:
            results[name] = run_one(name, azurite, tmp)
    return {
        **environment(),
        "note": "client, daemon, every redis-server and Azurite share the machine's cores; "
        "ratios are each topology's value divided by standalone's in this run",
        "ratios_to_standalone": ratios(results),
        **results,
    }


def show(report: Report) -> None:
    cores, load = report["cpu_count"], report["loadavg_1min_before"]
    print(f"redis topologies bench ({cores} cores, load average {load} before)")
    for name in TOPOLOGIES:
        r = report[name]
        rate, p99 = r["throughput"][1]["acked_updates_per_s"], r["latency"]["p99_ms"]
        ratio = report["ratios_to_standalone"][name]
        x_rate, x_p99 = ratio["acked_updates_per_s_8_connections"], ratio["p99_ms_at_1k_per_s"]
        print(f"  {name:>15}: {rate:>6} acked/s with 8 connections (x{x_rate}), p99 {p99} ms")
        print(f"  {'':>15}  at 1,000 updates/s (x{x_p99})")


def main() -> int:
    return bench_main("redis_topologies", run, show)


if __name__ == "__main__":
    raise SystemExit(main())
