"""What one sidecar costs its pod: start-up, memory, CPU idle and at a realistic load, image.

Starts redis-server and Azurite (``tests.services``), then:

- ``--starts`` daemon processes one after another (own namespace each): the time from exec to
  the first ``GET /readyz`` 200 (polled every 5 ms), the RSS then, and the RSS once the blob
  store is open (the Azure SDK is imported after readiness: the ``blob store open`` line);
- one daemon idle for ``--idle-s``: CPU in millicores (``/proc/<pid>/stat``), wakes a second
  (its threads' voluntary context switches: what idle CPU is made of) and RSS; then the same
  with checkpoint snapshots and Kafka commits on (a Tansu broker), each a loop of its own;
- the same daemon at the realistic load for ``--load-s``: 10 queries, one micro-batch per second
  each, 8 Kafka-shaped partitions: CPU millicores and RSS;
- the container image's size (``podman image inspect``), when it was built (``make image``).

Targets (issue #22): ready ≤ 150 ms, RSS at ready ≤ 65 MiB, idle ≤ 2 millicores, image ≤ 160 MB.
``--code DIR`` runs another checkout's ``sidecar`` (A/B: the same services, the same run);
``--label`` stores the report under that key of ``bench/results/footprint.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from statistics import median
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from bench.common import BenchError, Report, bench_main, cpu_seconds, environment, rss_kib, services
from sidecar import __version__
from sidecar.ops.client import SidecarClient
from tests.services import REPO_ROOT, DaemonProcess, KafkaBroker, free_port
from tests.sparkshapes import kafka_progress

TARGETS = {"ready_ms": 150, "rss_at_ready_mib": 65, "idle_millicores": 2, "image_mb": 160}
QUERIES, PARTITIONS = 10, 8


def settings(redis_url: str, azurite: str, tmp: Path) -> dict[str, str]:
    return {
        "SIDECAR_REDIS_URL": redis_url,
        "AZURE_STORAGE_CONNECTION_STRING": azurite,
        "SIDECAR_NAMESPACE": f"fp{uuid.uuid4().hex[:10]}",
        "SIDECAR_SOCKET_PATH": str(tmp / f"{uuid.uuid4().hex[:8]}.sock"),
        "SIDECAR_METRICS_PORT": str(free_port()),
        "SIDECAR_LOG_LEVEL": "INFO",
    }


def start_once(env: dict[str, str], log: Path, code: Path | None) -> dict[str, float]:
    """One start: exec → /readyz 200 (ms), RSS then and once the store is open (MiB)."""
    proc = DaemonProcess(env, log)
    proc.code = code
    began = time.perf_counter()
    proc.start(wait=False)
    try:
        while (answer := proc.readyz()) is None or answer[0] != 200:
            if not proc.running:
                raise BenchError(f"the daemon exited:\n{proc.log()[-2000:]}")
            if time.perf_counter() - began > 30:
                raise BenchError(f"not ready in 30 s: {answer}")
            time.sleep(0.005)
        ready_ms = (time.perf_counter() - began) * 1000
        rss_ready = rss_kib(proc.pid) / 1024
        deadline = time.monotonic() + 30
        while "blob store open" not in proc.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # let the first flush pass and the doctor settle
        return {
            "ready_ms": round(ready_ms, 1),
            "rss_at_ready_mib": round(rss_ready, 1),
            "rss_store_open_mib": round(rss_kib(proc.pid) / 1024, 1),
        }
    finally:
        proc.stop()


async def realistic_load(socket_path: str, seconds: float) -> int:
    """10 queries, one micro-batch per second each (8 partitions), on one connection; the
    number of updates acknowledged."""
    ids = [f"f00d0000-0000-4000-8000-{i:012d}" for i in range(QUERIES)]
    acked = 0
    async with await SidecarClient.connect(socket_path) as client:
        start = anyio.current_time()
        batch = 0
        while anyio.current_time() - start < seconds:
            for i, qid in enumerate(ids):
                progress = kafka_progress(qid, batch, name=f"fp-{i}", partitions=PARTITIONS)
                reply = await client.progress(progress)
                if not (reply.ok and reply.applied):
                    raise BenchError(f"update refused: {reply}")
                acked += 1
            batch += 1
            await anyio.sleep(start + batch - anyio.current_time())
    return acked


def wakes(pid: int) -> int:
    """Voluntary context switches of all of a process's threads so far: each is a sleep ended,
    a wake of the event loop (a timer, a reply) or of a pool thread."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread gone between the listing and the read
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


def idle(proc: DaemonProcess, seconds: float) -> dict[str, float]:
    """Millicores and wakes a second of a daemon left alone for ``seconds``."""
    deadline = time.monotonic() + 30
    while "blob store open" not in proc.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(3)  # the doctor's checks and the first renewals: not idle yet
    cpu0, wakes0, t0 = cpu_seconds(proc.pid), wakes(proc.pid), time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    return {
        "millicores": round((cpu_seconds(proc.pid) - cpu0) / elapsed * 1000, 2),
        "wakes_per_s": round((wakes(proc.pid) - wakes0) / elapsed, 1),
    }


def idle_with_loops(env: dict[str, str], tmp: Path, code: Path | None, seconds: float) -> Report:
    """:func:`idle` with snapshots (an empty root) and Kafka commits (a broker) on."""
    with KafkaBroker() as broker:
        (tmp / "snapshots").mkdir(exist_ok=True)
        env = env | {
            "SIDECAR_SNAPSHOT_ROOT": str(tmp / "snapshots"),
            "SIDECAR_KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
        }
        proc = DaemonProcess(env, tmp / "idle-loops.log")
        proc.code = code
        proc.start()
        try:
            return idle(proc, seconds)
        finally:
            proc.stop()


def steady(
    env: dict[str, str], log: Path, code: Path | None, idle_s: float, load_s: float
) -> Report:
    proc = DaemonProcess(env, log)
    proc.code = code
    proc.start()
    try:
        quiet = idle(proc, idle_s)
        rss_idle = rss_kib(proc.pid) / 1024
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        acked = anyio.run(realistic_load, proc.socket_path, load_s)
        load = (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0) * 1000
        return {
            "idle_millicores": quiet["millicores"],
            "idle_wakes_per_s": quiet["wakes_per_s"],
            "rss_idle_mib": round(rss_idle, 1),
            "load_millicores": round(load, 2),
            "rss_load_mib": round(rss_kib(proc.pid) / 1024, 1),
            "load_acked": acked,
        }
    finally:
        proc.stop()


def image_mb() -> float | None:
    """The image's size as podman reports it (MB, 10^6 bytes; the project's own image storage,
    ``scripts/podman.sh``), None when not built."""
    try:
        out = subprocess.run(
            ["bash", str(REPO_ROOT / "scripts" / "podman.sh"), "image", "inspect",
             f"checkpoint-sidecar:{__version__}", "--format", "{{.Size}}"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    except OSError:
        return None
    return round(int(out.stdout.strip()) / 1e6, 1) if out.returncode == 0 else None


def run(args: argparse.Namespace) -> Report:
    with ExitStack() as cleanup:
        tmp, redis_server, azurite = services(cleanup, "cps-fp-")
        conn = azurite.connection_string
        starts = [
            start_once(settings(redis_server.url, conn, tmp), tmp / f"s{i}.log", args.code)
            for i in range(args.starts)
        ]
        held = steady(
            settings(redis_server.url, conn, tmp), tmp / "steady.log", args.code, args.idle_s,
            args.load_s,
        )  # fmt: skip
        with_loops = idle_with_loops(
            settings(redis_server.url, conn, tmp), tmp, args.code, args.idle_s
        )
    summary = {k: median(s[k] for s in starts) for k in starts[0]}
    return {
        "environment": environment(),
        "code": str(args.code) if args.code else "this checkout",
        "targets": TARGETS,
        "starts": starts,
        "median": summary,
        "steady": held,
        "idle_with_snapshots_and_kafka": with_loops,
        "image_mb": image_mb(),
        "load": {"queries": QUERIES, "batches_per_s_each": 1, "partitions": PARTITIONS},
    }


def show(report: Report) -> None:
    m, s, w = report["median"], report["steady"], report["idle_with_snapshots_and_kafka"]
    rows: list[tuple[str, Any, Any]] = [
        ("exec → /readyz 200, ms (median)", m["ready_ms"], TARGETS["ready_ms"]),
        ("RSS at ready, MiB", m["rss_at_ready_mib"], TARGETS["rss_at_ready_mib"]),
        ("RSS with the store open, MiB", m["rss_store_open_mib"], None),
        ("idle, millicores", s["idle_millicores"], TARGETS["idle_millicores"]),
        ("idle, wakes a second", s["idle_wakes_per_s"], None),
        ("idle + snapshots + Kafka, millicores", w["millicores"], TARGETS["idle_millicores"]),
        ("idle + snapshots + Kafka, wakes a second", w["wakes_per_s"], None),
        ("RSS idle, MiB", s["rss_idle_mib"], None),
        ("realistic load, millicores", s["load_millicores"], None),
        ("RSS at load, MiB", s["rss_load_mib"], None),
        ("image, MB", report["image_mb"], TARGETS["image_mb"]),
    ]
    print(f"footprint ({report['code']}; {len(report['starts'])} starts)")
    for name, value, target in rows:
        print(f"  {name:42} {value!s:>8}" + (f"   target ≤ {target}" if target else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--starts", type=int, default=7)
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--load-s", type=float, default=60.0)
    parser.add_argument("--code", type=Path, default=None, help="another checkout to run")
    parser.add_argument("--label", default="after", help="key of the report in footprint.json")
    args = parser.parse_args()
    return bench_main("footprint", lambda: run(args), show, label=args.label)


if __name__ == "__main__":
    sys.exit(main())
