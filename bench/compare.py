"""Benchmarks that compare: the daemon against what a user would write instead, in one run.

``python -m bench.compare [--quick]`` (quick: about 3 minutes; full: about 12 on 2 cores)
measures the targets of bench/peers.py on one workload (10 queries x 32 Kafka partitions,
Spark-shaped progress of ~2 KB per update):

1. Throughput, in alternating rounds: every round runs each subject once for a fixed
   window, the order rotated per round, so paired rounds saw the same machine load.
   Subjects: the daemon in ``ack_mode=redis`` and ``ack_mode=blob`` with 1 and 8
   connections x 1 and 64 requests in flight each; the direct leased-blob writer and
   Event Hubs' BlobCheckpointStore with 1 and 10 writers (one per query). Acked updates/s
   (median over rounds), CPU per update (daemon + its redis-server from /proc; for the
   in-process peers this process), and ratios to the direct writer from paired rounds: a
   subject with one update in flight in all against the direct writer's one writer, the
   others against its 10 writers.
2. Latency open-loop at 100, 1,000 and 5,000 updates/s: sends on an absolute schedule, never
   waiting for answers; latency from the scheduled time (so a stall shows, with every
   request queued behind it); p50 / p99 / p99.9, sends late, and whether the rate was
   sustained (else the rate achieved; higher rates are then skipped).
3. Blob transactions per 10,000 updates at 100 updates/s (10 per query per s), counted per
   operation in Azurite's request log: the daemon at its defaults, the direct writer,
   BlobCheckpointStore.

Phases 1-2 use an Azurite without its debug log (it costs Azurite CPU per request); phase 3
a fresh Azurite, redis-server and daemon with it. Everything shares this machine's cores
(the load average before and after each phase is recorded). Results:
``bench/results/compare.json``; exit code 1 when a service or the daemon fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import anyio
import redis

from bench.common import (
    Pids,
    Report,
    bench_main,
    cpu_times,
    environment,
    redis_version,
    rounded,
    tool_version,
)
from bench.peers import GRACE_S, PARTITIONS, QUERIES, Daemon, InProcess, peers
from bench.tools import AzuriteLogCounter, paired_ratios, per_10k, rotated
from tests.services import Azurite, DaemonProcess, RedisServer


@dataclass(frozen=True)
class Mode:
    rounds: int
    seconds: float  # throughput window per subject and round
    warmup_s: float
    latency_s: float  # open-loop window per rate
    transactions_s: float


MODES = {
    "quick": Mode(rounds=2, seconds=2.0, warmup_s=1.0, latency_s=2.0, transactions_s=15.0),
    "full": Mode(rounds=5, seconds=5.0, warmup_s=2.0, latency_s=10.0, transactions_s=60.0),
}
RATES = (100, 1_000, 5_000)
TRANSACTIONS_RATE = 100
TARGETS = {
    "redis": "daemon, ack_mode=redis",
    "blob": "daemon, ack_mode=blob",
    "direct": "direct leased-blob writer",
    "eventhubs": "Event Hubs BlobCheckpointStore",
}
EXTRA_PACKAGES = ("azure-eventhub", "azure-eventhub-checkpointstoreblob-aio", "aiohttp")


@dataclass(frozen=True)
class Subject:
    target: str
    workers: int  # the daemon's connections; a peer's writer tasks
    window: int  # requests in flight per connection (peers: 1)

    @property
    def key(self) -> str:
        return f"{self.target} {self.workers}x{self.window}"

    @property
    def label(self) -> str:
        unit = "conn" if self.target in ("redis", "blob") else "writer"
        plural = "s" if self.workers > 1 else ""
        return f"{TARGETS[self.target]}, {self.workers} {unit}{plural} x {self.window} in flight"

    @property
    def reference(self) -> str:
        """The direct writer's subject this one is compared with."""
        return "direct 1x1" if self.workers * self.window == 1 else f"direct {QUERIES}x1"


SUBJECTS = [Subject(t, c, w) for t in ("redis", "blob") for c in (1, 8) for w in (1, 64)] + [
    Subject(t, n, 1) for t in ("direct", "eventhubs") for n in (1, QUERIES)
]


def daemon_env(tmp: Path, name: str, redis_url: str, azurite: Azurite, **kw: str) -> dict[str, str]:
    return {"SIDECAR_SOCKET_PATH": str(tmp / f"{name}.sock"), "SIDECAR_REDIS_URL": redis_url,
            "SIDECAR_NAMESPACE": f"compare-{name}", "SIDECAR_CONTAINER": f"daemon-{name}",
            "SIDECAR_METRICS_HOST": "127.0.0.1", "SIDECAR_LOG_LEVEL": "WARNING",
            "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string, **kw}  # fmt: skip


class Stack:
    """Services started for a phase: each daemon with its own redis-server; one Azurite."""

    def __init__(self, cleanup: ExitStack, tmp: Path, *, debug_log: bool) -> None:
        self.cleanup, self.tmp = cleanup, tmp
        self.azurite = Azurite(debug_log=debug_log)
        cleanup.callback(self.azurite.close)
        self.azurite.start()
        self.daemons: dict[str, Daemon] = {}
        self.pids: dict[str, Pids] = {}
        self.redis_binary = ""

    def daemon(self, name: str, **settings: str) -> Daemon:
        server = RedisServer()
        self.cleanup.callback(server.close)
        server.start()
        self.redis_binary = server.binary
        with redis.Redis.from_url(server.url) as r:
            redis_pid = int(r.info("server")["process_id"])
        env = daemon_env(self.tmp, name, server.url, self.azurite, **settings)
        proc = DaemonProcess(env, self.tmp / f"{name}.log")
        self.cleanup.callback(proc.stop, timeout_s=20)
        proc.start()
        self.daemons[name] = Daemon(proc.socket_path)
        self.pids[name] = {"daemon": proc.pid, "redis": redis_pid}
        return self.daemons[name]


async def measure(
    target: Any, s: Subject, seconds: float, own: Pids, azurite: int | None
) -> Report:
    pids = {**own, "azurite": azurite, "machine": None}
    before = cpu_times(pids)
    counts: Counter[str] = await target.throughput(s.workers, s.window, seconds)
    after = cpu_times(pids)
    secs, acked = counts.pop("seconds_x1000") / 1000, counts.pop("acked", 0)
    cpu = {k: round(after[k] - before[k], 3) for k in pids}
    own_s = sum(cpu[k] for k in own)
    return {"acked": acked, "seconds": secs, "acked_per_s": round(acked / secs, 1),
            "not_acked": dict(counts), "cpu_s": cpu,
            "cpu_us_per_update": round(own_s / acked * 1e6, 1) if acked else None}  # fmt: skip


async def throughput_phase(stack: Stack, peers_: dict[str, InProcess], mode: Mode) -> Report:
    targets: dict[str, Any] = {**stack.daemons, **peers_}
    client: Pids = {"client": os.getpid()}
    own = {t: stack.pids.get(t, client) for t in targets}
    by_key = {s.key: s for s in SUBJECTS}
    for t in ("redis", "blob"):  # connections, leases of every query, Redis scripts loaded
        await measure(targets[t], Subject(t, 1, 64), mode.warmup_s, own[t], stack.azurite.pid)
    runs: dict[str, list[Report]] = {k: [] for k in by_key}
    for rnd in range(mode.rounds):
        started = time.monotonic()
        for key in rotated(list(by_key), rnd):
            s = by_key[key]
            runs[key].append(await measure(targets[s.target], s, mode.seconds, own[s.target],
                                           stack.azurite.pid))  # fmt: skip
        took = time.monotonic() - started
        print(f"  throughput round {rnd + 1}/{mode.rounds}: {took:.0f} s", flush=True)
    out: Report = {}
    for key, s in by_key.items():
        rs, ref = runs[key], runs[s.reference]
        cpu = [r["cpu_us_per_update"] for r in rs]
        ref_cpu = [r["cpu_us_per_update"] for r in ref]
        out[key] = {
            "label": s.label, "target": s.target, "workers": s.workers, "window": s.window,
            "reference": s.reference,
            "acked_per_s": paired_ratios([r["acked_per_s"] for r in rs],
                                         [r["acked_per_s"] for r in ref]),
            "cpu_us_per_update": paired_ratios(cpu, ref_cpu),
            "cpu_processes": list(own[s.target]),
            "azurite_cores": round(median(r["cpu_s"]["azurite"] / r["seconds"] for r in rs), 2),
            "machine_cores": round(median(r["cpu_s"]["machine"] / r["seconds"] for r in rs), 2),
            "rounds": rs,
        }  # fmt: skip
    return out


async def latency_phase(stack: Stack, peers_: dict[str, InProcess], mode: Mode) -> Report:
    targets: dict[str, Any] = {**stack.daemons, **peers_}
    out: Report = {t: {} for t in targets}
    failed: dict[str, int] = {}
    for i, rate in enumerate(RATES):
        for t in rotated(list(targets), i):
            if t in failed:
                out[t][str(rate)] = {"not_run": f"did not sustain {failed[t]}/s"}
                continue
            print(f"  latency {t} at {rate}/s", flush=True)
            summary = (await targets[t].open_loop(rate, mode.latency_s)).summary()
            out[t][str(rate)] = summary
            if not summary["sustained"]:
                failed[t] = rate
    return out


def read_from(path: Path, offset: int) -> str:
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read()


async def written(log: Path, containers: list[str]) -> Counter[str]:
    counter = AzuriteLogCounter()
    counter.feed(await anyio.to_thread.run_sync(read_from, log, 0))
    return counter.of(containers)


async def transactions_phase(stack: Stack, peers_: dict[str, InProcess], mode: Mode) -> Report:
    containers = {"redis": ["daemon-redis"], **{t: [p.container] for t, p in peers_.items()}}
    targets: dict[str, Any] = {**stack.daemons, **peers_}
    log, out = stack.azurite.debug_log_path, {}
    # The peers set up before (containers, leases, ownership, first blobs): so does the
    # daemon. 100 updates per query reach its count threshold: each query is flushed once.
    await stack.daemons["redis"].open_loop(1_000, 100 * QUERIES / 1_000)
    with anyio.fail_after(60):
        while (await written(log, containers["redis"]))["Put Blob"] < QUERIES:  # noqa: ASYNC110 - polls the log
            await anyio.sleep(0.2)
    for t, target in targets.items():
        print(f"  transactions {t}: {mode.transactions_s:g} s at {TRANSACTIONS_RATE}/s", flush=True)
        offset = log.stat().st_size
        rec = await target.open_loop(TRANSACTIONS_RATE, mode.transactions_s)
        await anyio.sleep(1.0)  # let requests under way finish and be logged
        counter = AzuriteLogCounter()
        counter.feed(await anyio.to_thread.run_sync(read_from, log, offset))
        done = sum(d is not None for d in rec.done)
        counts = counter.of(containers[t])
        out[t] = {"label": TARGETS[t], "updates": done, "seconds": mode.transactions_s,
                  "requests": dict(counts), "per_10k_updates": per_10k(counts, done)}  # fmt: skip
    return out


async def phases(tmp: Path, mode: Mode, report: Report) -> None:
    loads: dict[str, list[float]] = {}
    with ExitStack() as cleanup:
        stack = Stack(cleanup, tmp, debug_log=False)
        stack.daemon("redis", SIDECAR_ACK_MODE="redis")
        stack.daemon("blob", SIDECAR_ACK_MODE="blob")
        azurite_version = tool_version([stack.azurite.binary, "--version"])
        report["versions"] = {"redis_server": redis_version(stack.redis_binary),
                              "azurite": azurite_version}  # fmt: skip
        async with peers(stack.azurite.connection_string, "compare") as (direct, eh):
            both: dict[str, InProcess] = {"direct": direct, "eventhubs": eh}
            loads["throughput_before"] = rounded(os.getloadavg())
            report["throughput"] = await throughput_phase(stack, both, mode)
            loads["latency_before"] = rounded(os.getloadavg())
            report["latency_open_loop"] = await latency_phase(stack, both, mode)
    with ExitStack() as cleanup:
        stack = Stack(cleanup, tmp, debug_log=True)
        stack.daemon("redis")  # defaults: ack_mode=redis, count 100, time 10 s, lease 30 s
        async with peers(stack.azurite.connection_string, "tx") as (direct, eh):
            loads["transactions_before"] = rounded(os.getloadavg())
            report["blob_transactions"] = await transactions_phase(
                stack, {"direct": direct, "eventhubs": eh}, mode
            )
    loads["end"] = rounded(os.getloadavg())
    report["loadavg_by_phase"] = loads


def run(mode_name: str) -> Report:
    mode, started = MODES[mode_name], time.monotonic()
    report: Report = {
        **environment(EXTRA_PACKAGES), "mode": mode_name, "conditions": {
            **mode.__dict__, "rates_per_s": list(RATES), "transactions_rate_per_s":
            TRANSACTIONS_RATE, "queries": QUERIES, "partitions": PARTITIONS,
            "open_loop_grace_s": GRACE_S,
            "cpu_per_update": "daemon subjects: daemon process + its redis-server; peers: "
                              "this process (which also drives the load); Azurite apart",
            "ratios": "median of per-round ratios to the direct writer: one update in flight "
                      "in all vs its 1 writer, else vs its 10 writers (one per query)",
        }}  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="cps-cmp-", dir="/tmp"))  # short: sun_path limit
    try:
        anyio.run(phases, tmp, mode, report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report["conditions"]["total_s"] = round(time.monotonic() - started)
    return report


def fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def show(report: Report) -> None:
    c, la = report["conditions"], report["loadavg"]
    # fmt: off
    print(f"\ncompare bench ({report['mode']}): {report['machine']['cpu_count']} cores, load "
          f"average before {la['before']}, after {la['after']}; {c['rounds']} rounds of "
          f"{c['seconds']:g} s; {c['queries']} queries x {c['partitions']} partitions; "
          f"commit {report['git_commit']}")
    print(f"{'throughput (median of rounds)':<62}{'acked/s':>10}{'x direct':>10}"
          f"{'CPU us/upd':>12}{'x direct':>10}{'Azurite':>9}")
    for r in report["throughput"].values():
        a, u = r["acked_per_s"], r["cpu_us_per_update"]
        print(f"  {r['label']:<60}{fmt(a['median']):>10}{fmt(a['ratio_median'], 3):>10}"
              f"{fmt(u['median']):>12}{fmt(u['ratio_median'], 2):>10}{r['azurite_cores']:>9}")
    print("latency open-loop, from the scheduled send: p50 / p99 / p99.9 ms (sent late)")
    for t, rates in report["latency_open_loop"].items():
        cells = []
        for rate, x in rates.items():
            if "not_run" in x:
                cells.append(f"{rate}/s: -")
                continue
            lat = x["latency_from_schedule"]
            got = (f"{fmt(lat.get('p50_ms'), 2)} / {fmt(lat.get('p99_ms'), 2)} / "
                   f"{fmt(lat.get('p99_9_ms'), 2)} ({x['sent_late']})")
            if not x["sustained"]:
                got = f"cannot sustain: {x['achieved_rate_per_s']:g}/s"
            cells.append(f"{rate}/s: {got}")
        print(f"  {TARGETS[t]:<32}" + "; ".join(cells))
    print(f"blob transactions per 10,000 updates at {c['transactions_rate_per_s']}/s "
          f"({c['transactions_s']:g} s each)")
    for x in report["blob_transactions"].values():
        per = x["per_10k_updates"]
        rest = ", ".join(f"{k} {v:,.0f}" for k, v in per.items() if k != "total")
        print(f"  {x['label']:<32}{fmt(per.get('total')):>10}  ({rest}; {x['updates']} updates)")
    # fmt: on


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="short windows, 2 rounds (~3 min)")
    args = parser.parse_args()
    return bench_main("compare", lambda: run("quick" if args.quick else "full"), show)


if __name__ == "__main__":
    raise SystemExit(main())
