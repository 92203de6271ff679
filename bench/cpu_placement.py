"""Where a server's background CPU runs, and what its acks pay for it on a saturated machine.

Why it exists (issue #29): with snapshots on, the daemon's acks that overlap a snapshot have a
p99 of 32-39 ms against ~8 ms without, on 2 cores that Spark keeps busy, while the daemon
spends only ~10-30 ms of CPU per snapshot. This measures the mechanism apart from the product:
the same background CPU placed four ways, beside an open-loop client of the same server.

- The server: an asyncio echo server on a Unix socket (a process of its own), answering one
  line per request: an ack with no work behind it.
- The client: another process, open loop, ``--rate`` requests per second (default 100, the
  snapshot benchmark's) on an absolute schedule; latency from the scheduled send.
- The load: ``--hogs`` busy processes (default: one per core), as Spark's tasks are.
- Every second the server spends ``--burn-ms`` (default 30) of CPU time (counted as CPU, not
  as wall time, which a descheduled burn would stretch), placed:

  - ``none``: nothing (the reference);
  - ``loop``: on the event loop's thread, in 2 ms callbacks (the Azure SDK's request
    handling, a pack's assembly: Python on the loop);
  - ``thread-gil``: in a worker thread running Python (it holds the GIL);
  - ``thread-nogil``: in a worker thread hashing (hashlib releases the GIL, as the upload's
    SHA-256 and CRC-32C of large files do);
  - ``child``: in a child process at nice +5 (the snapshot cut's worker).

Rounds alternate the placements (``--rounds``, ``--seconds`` each). Reported per placement:
p50, p99 and p99.9 of the pooled latencies and each round's p99, and p99 ÷ the reference's.
Results: ``bench/results/cpu_placement.json``. No target: it says which placement keeps the
ack tail where the reference has it.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import hashlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from bench.common import BenchError, Report, bench_main, cpu_seconds, environment
from bench.tools import latency_summary_ms, schedule

PLACEMENTS = ("none", "loop", "thread-gil", "thread-nogil", "child")
SLICE_MS = 2.0
_BUFFER = bytes(256 * 1024)


def spin(ms: float) -> None:
    """Python running for ``ms`` milliseconds of this thread's CPU (holds the GIL)."""
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        pass


def hash_for(ms: float) -> None:
    """SHA-256 over 256 KiB buffers for ``ms`` milliseconds of this thread's CPU (hashlib
    releases the GIL while it hashes)."""
    end = time.thread_time() + ms / 1000
    digest = hashlib.sha256()
    while time.thread_time() < end:
        digest.update(_BUFFER)


def spin_niced(ms: float) -> None:
    if os.nice(0) < 5:
        os.nice(5)
    spin(ms)


async def burn(placement: str, ms: float) -> None:
    """Every second, ``ms`` of CPU placed as ``placement`` says."""
    loop = asyncio.get_running_loop()
    threads = concurrent.futures.ThreadPoolExecutor(1)
    fork = multiprocessing.get_context("fork")
    child = concurrent.futures.ProcessPoolExecutor(1, mp_context=fork)
    await loop.run_in_executor(child, spin_niced, 0.0)  # started before the first round
    while True:
        await asyncio.sleep(1.0)
        if placement == "loop":
            done = 0.0
            while done < ms:
                spin(SLICE_MS)
                done += SLICE_MS
                await asyncio.sleep(0)
        elif placement == "thread-gil":
            await loop.run_in_executor(threads, spin, ms)
        elif placement == "thread-nogil":
            await loop.run_in_executor(threads, hash_for, ms)
        elif placement == "child":
            await loop.run_in_executor(child, spin_niced, ms)


async def serve(path: str, placement: str, ms: float) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            writer.write(line)
            await writer.drain()

    server = await asyncio.start_unix_server(answer, path)
    async with server, asyncio.TaskGroup() as tg:  # a failed burn ends the server
        tg.create_task(burn(placement, ms))
        tg.create_task(server.serve_forever())


def server_role(path: str, placement: str, ms: float) -> None:
    os.setpgrp()  # its child process with it: killed as a group
    asyncio.run(serve(path, placement, ms))


async def drive(path: str, rate: float, seconds: float) -> list[float]:
    """Open loop: request i is due at start + i / rate; its latency counts from then."""
    reader, writer = await asyncio.open_unix_connection(path)
    due: asyncio.Queue[float] = asyncio.Queue()
    latencies: list[float] = []
    times = schedule(time.perf_counter() + 0.5, rate, seconds)

    async def receive() -> None:
        for _ in times:
            await reader.readline()
            latencies.append(time.perf_counter() - await due.get())

    receiver = asyncio.create_task(asyncio.wait_for(receive(), seconds + 30))
    for at in times:
        wait = at - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        due.put_nowait(at)
        writer.write(b"ack\n")
    await receiver
    writer.close()
    return latencies


def one_round(tmp: Path, placement: str, args: argparse.Namespace) -> tuple[list[float], float]:
    """One placement's latencies, and the server's CPU (with its child's) per second."""
    path = str(tmp / f"{placement}.sock")
    fork = multiprocessing.get_context("fork")
    # Not a daemonic process: those may not start the child process ``child`` runs in.
    server = fork.Process(target=server_role, args=(path, placement, args.burn_ms))
    server.start()
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError("the echo server did not start")
            time.sleep(0.01)
        hogs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)
        ]
        time.sleep(0.5)
        if not server.is_alive() or server.pid is None:
            raise BenchError(f"the echo server exited ({server.exitcode}) before the round")
        cpu, began = cpu_seconds(server.pid, tree=True), time.monotonic()
        latencies = asyncio.run(drive(path, args.rate, args.seconds))
        used = (cpu_seconds(server.pid, tree=True) - cpu) / (time.monotonic() - began)
        return latencies, used
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        if server.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
        server.join()


def run(args: argparse.Namespace) -> Report:
    pooled: dict[str, list[float]] = {p: [] for p in PLACEMENTS}
    rounds: dict[str, list[float]] = {p: [] for p in PLACEMENTS}
    cpu: dict[str, list[float]] = {p: [] for p in PLACEMENTS}
    with tempfile.TemporaryDirectory(prefix="cps-cpu-") as tmp:
        for number in range(args.rounds):
            for placement in PLACEMENTS:
                got, used = one_round(Path(tmp), placement, args)
                pooled[placement] += got
                cpu[placement].append(used)
                rounds[placement].append(latency_summary_ms(got)["p99_ms"])
                print(
                    f"round {number + 1}/{args.rounds} {placement}: "
                    f"p99 {rounds[placement][-1]:.2f} ms",
                    file=sys.stderr,
                )
    reference = latency_summary_ms(pooled["none"])["p99_ms"]
    placements: dict[str, Any] = {}
    for placement in PLACEMENTS:
        q = latency_summary_ms(pooled[placement])
        placements[placement] = {
            **q,
            "p99_ms_by_round": rounds[placement],
            "p99_over_none": round(q["p99_ms"] / reference, 3),
            # what the server used: the echo's share and the burn (a check that it ran)
            "server_cpu_ms_per_s": round(1e3 * sum(cpu[placement]) / len(cpu[placement]), 1),
        }
    return {
        "environment": environment(),
        "settings": {
            "rate_per_s": args.rate,
            "seconds_per_round": args.seconds,
            "rounds": args.rounds,
            "hogs": args.hogs,
            "burn_ms_per_s": args.burn_ms,
            "slice_ms": SLICE_MS,
        },
        "placements": placements,
    }


def show(report: Report) -> None:
    s = report["settings"]
    print(
        f"{s['burn_ms_per_s']:.0f} ms of CPU per second beside {s['hogs']} busy processes, "
        f"acks at {s['rate_per_s']:.0f}/s, {s['rounds']} rounds x {s['seconds_per_round']:.0f} s"
    )
    for placement, r in report["placements"].items():
        rounds = ", ".join(f"{p:.1f}" for p in r["p99_ms_by_round"])
        print(
            f"  {placement:13s} p50 {r['p50_ms']:6.2f}  p99 {r['p99_ms']:6.2f}  "
            f"p99.9 {r['p99_9_ms']:6.2f} ms  p99 / none x{r['p99_over_none']:.2f}  "
            f"server CPU {r['server_cpu_ms_per_s']:.0f} ms/s  "
            f"(rounds: {rounds})"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rate", type=float, default=100.0, help="acks per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="per round and placement")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy processes")
    parser.add_argument("--burn-ms", type=float, default=30.0, help="CPU per second, ms")
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    return bench_main("cpu_placement", lambda: run(args), show, save=not args.no_save)


if __name__ == "__main__":
    sys.exit(main())
