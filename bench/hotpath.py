"""Hot-path benchmark: the daemon's CPU time per acknowledged update, pipelined.

Starts a private redis-server and Azurite, then one daemon per ``--code`` directory (default:
this checkout), each a separate process on its own Unix socket and Redis namespace (all from
``tests.services``). Each round, for 1 and 8 connections, every connection sends Spark-shaped
Kafka progress (its own 10 queries x 32 partitions, round robin, batch ids increasing; about
1.5-1.9 KB per request) with 64 requests in flight; the daemon's CPU time (user + system,
Linux ``/proc/<pid>/stat``) over the round is divided by the updates it acknowledged
(``ok=true, applied=true``). Rounds alternate between the daemons, so they share the
machine's background load; the median round is reported.

    .venv/bin/python bench/hotpath.py                           # this checkout
    .venv/bin/python bench/hotpath.py --code /tmp/base --code .  # A/B, alternating rounds

Results go to ``bench/results/hotpath.json`` (``--out``). Exit code 1 when an update is not
acknowledged or a daemon fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio

from sidecar.wire.protocol import encode_request

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from bench.common import (
    RESULTS_DIR,
    BenchError,
    Report,
    bench_main,
    cpu_seconds,
    drive,
    environment,
    services,
)
from tests.services import REPO_ROOT, DaemonProcess
from tests.sparkshapes import kafka_progress

QUERIES_PER_CONNECTION = 10
PARTITIONS = 32
WINDOW = 64  # requests in flight per connection
UPDATES_PER_ROUND = 16_000  # per scenario, split across its connections
WARMUP_UPDATES = 4_000
CONNECTIONS = (1, 8)


class Workload:
    """Pre-encoded request lines; each connection's queries advance one batch per request."""

    def __init__(self, conns: int) -> None:
        self.queries = [
            [str(uuid.uuid4()) for _ in range(QUERIES_PER_CONNECTION)] for _ in range(conns)
        ]
        self.next_batch = 0

    def lines(self, total: int) -> list[list[bytes]]:
        per = total // len(self.queries)
        rounds = -(-per // QUERIES_PER_CONNECTION)
        first, self.next_batch = self.next_batch, self.next_batch + rounds
        return [
            [
                encode_request("progress", i, progress=kafka_progress(q, b, partitions=PARTITIONS))
                for i, (b, q) in enumerate((b, q) for b in range(first, first + rounds) for q in qs)
            ][:per]
            for qs in self.queries
        ]


async def one_round(
    socket_path: str, pid: int, batches: list[list[bytes]], *, warmup: bool = False
) -> dict[str, Any]:
    streams = [await anyio.connect_unix(socket_path) for _ in batches]
    counts: Counter[str] = Counter()
    try:
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        async with anyio.create_task_group() as tg:
            for stream, lines in zip(streams, batches, strict=True):
                tg.start_soon(drive, stream, lines, counts, WINDOW)
        elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    finally:
        for stream in streams:
            await stream.aclose()
    # Warm-up: the first pipelined updates of a new query wait for its floor (one listing of
    # the blobs) and are then applied in any order, so a few answer applied=false (stale):
    # the newest is stored, as always. Measured rounds must be acked in full.
    if set(counts) - ({"acked", "stale"} if warmup else {"acked"}):
        raise BenchError(f"not every update was acknowledged: {dict(counts)}")
    return {"acked": counts["acked"], "seconds": elapsed, "cpu_s": cpu}


async def measure(daemons: dict[str, DaemonProcess], rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for conns in CONNECTIONS:
        work = {name: Workload(conns) for name in daemons}
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in daemons}
        for r in range(rounds + 1):  # round 0 warms up (first updates of new queries)
            for name, daemon in daemons.items():
                total = WARMUP_UPDATES if r == 0 else UPDATES_PER_ROUND
                lines = work[name].lines(total)
                result = await one_round(daemon.socket_path, daemon.pid, lines, warmup=r == 0)
                if r:
                    samples[name].append(result)
        for name, rows in samples.items():
            us = [row["cpu_s"] / row["acked"] * 1e6 for row in rows]
            rate = [row["acked"] / row["seconds"] for row in rows]
            out.setdefault(name, []).append({
                "connections": conns, "window_per_connection": WINDOW,
                "updates_per_round": rows[0]["acked"], "rounds": len(rows),
                "cpu_us_per_update_median": round(statistics.median(us), 2),
                "cpu_us_per_update_rounds": [round(u, 2) for u in us],
                "acked_per_s_median": round(statistics.median(rate)),
            })  # fmt: skip
    return out


def run(codes: list[Path], rounds: int) -> Report:
    with ExitStack() as cleanup:
        tmp, redis_server, azurite = services(cleanup, "cps-hot-")
        daemons: dict[str, DaemonProcess] = {}
        for i, code in enumerate(c.resolve() for c in codes):
            name = f"{i}:{code}"
            daemon = DaemonProcess({
                "SIDECAR_SOCKET_PATH": str(tmp / f"{i}.sock"),
                "SIDECAR_REDIS_URL": redis_server.url, "SIDECAR_NAMESPACE": f"hot{i}",
                "SIDECAR_METRICS_HOST": "127.0.0.1", "SIDECAR_LOG_LEVEL": "WARNING",
                "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
            }, tmp / f"daemon{i}.log")  # fmt: skip
            daemon.env["PYTHONPATH"] = str(code)
            daemon.code = code  # its working directory, first on the path of `python -m`
            cleanup.callback(daemon.stop, timeout_s=20)
            daemon.start()
            daemons[name] = daemon
        results = anyio.run(measure, daemons, rounds)
    sample = encode_request("progress", 1, progress=kafka_progress("q" * 36, 500, partitions=32))
    return {
        **environment(), "request_bytes": len(sample),
        "workload": f"{QUERIES_PER_CONNECTION} queries x {PARTITIONS} partitions per connection, "
                    f"{WINDOW} in flight, ack_mode=redis; CPU = daemon process only",
        "daemons": results,
    }  # fmt: skip


def show(report: Report) -> None:
    print(f"hotpath: {report['cpu_count']} cores, load avg before {report['loadavg_1min_before']}")
    for name, rows in report["daemons"].items():
        for row in rows:
            print(
                f"  {name}  {row['connections']} conn: {row['cpu_us_per_update_median']:6.1f} "
                f"us CPU/update (rounds {row['cpu_us_per_update_rounds']}), "
                f"{row['acked_per_s_median']}/s"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", action="append", type=Path, help="a checkout's root")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "hotpath.json")
    args = parser.parse_args()
    codes = [c.resolve() for c in args.code or [REPO_ROOT]]
    return bench_main("hotpath", lambda: run(codes, args.rounds), show, out=args.out)


if __name__ == "__main__":
    raise SystemExit(main())
