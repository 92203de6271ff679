"""Ingest benchmark: acknowledged updates/s and ack latency of the real daemon.

Starts a private redis-server (append-only, as in the tests) and Azurite (the daemon needs a
blob store; its flusher runs with default thresholds, ack_mode=redis) and the daemon as a
separate process on a Unix socket, ready once its ``/readyz`` answers 200 (all from
``tests.services``), then measures from this process, the client:

1. Throughput: 1 and 8 concurrent connections, 40,000 updates per scenario after a warm-up.
   Each connection sends Kafka-shaped Spark progress events with strictly increasing batch
   ids for its own query id, pipelined with 64 requests in flight. Only replies with
   ``ok=true, applied=true`` count; afterwards a ``get`` per query must return the last batch
   id sent, or the run fails. Request bytes are encoded before the clock starts.
2. Latency: one connection, one request at a time, 1,000 updates/s paced by an absolute
   schedule for 5 s; ack latency = time from the send to the parsed reply.

All processes share this machine's cores: the CPU each used (Linux ``/proc``; whole_machine
includes Azurite and anything else running) and the load average before the run are recorded.
Results go to ``bench/results/ingest.json``. Exit code 1 when a correctness check fails; a
missed target is reported, not an error.
"""

from __future__ import annotations

import os
import platform
import sys
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from statistics import quantiles
from typing import Any

import anyio
import redis

from sidecar.ops.client import SidecarClient
from sidecar.wire.protocol import ClientConnection, Reply, encode_request

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from bench.common import (
    BenchError,
    Pids,
    Report,
    bench_main,
    cpu_seconds,
    cpu_times,
    drive,
    environment,
    services,
)
from tests.services import DaemonProcess

UPDATES_PER_SCENARIO = 40_000
WARMUP_UPDATES = 4_000  # per scenario, split across its connections, not timed
WINDOW = 64  # requests in flight per connection
LATENCY_RATE_HZ = 1_000
LATENCY_SAMPLES = 5_000
TARGET_UPDATES_S = 20_000  # with 8 connections
TARGET_P99_MS = 2.0  # at LATENCY_RATE_HZ
__all__ = ["BenchError", "measure", "progress_line", "stop_daemon"]  # used by other benchmarks


def progress_line(query_id: str, batch_id: int, partitions: int = 3) -> bytes:
    """A ``progress`` request shaped like Spark 4's Kafka-source StreamingQueryProgress."""

    def offsets(batch: int) -> dict[str, dict[str, int]]:
        return {"events": {str(p): batch * 100 + p for p in range(partitions)}}

    end, b, rows = offsets(batch_id + 1), batch_id, 100 * partitions
    rates = {"inputRowsPerSecond": 500.0, "processedRowsPerSecond": 2678.5}
    progress = {
        "id": query_id, "runId": "0e1c3f52-9d2b-4f7e-a3c4-5d6e7f809a1b", "name": "orders-to-delta",
        "timestamp": f"2026-11-21T{b // 3600 % 24:02d}:{b // 60 % 60:02d}:{b % 60:02d}.000Z",
        "batchId": batch_id, "batchDuration": 112, "numInputRows": rows, **rates,
        "durationMs": {"addBatch": 71, "commitOffsets": 13, "getBatch": 0, "latestOffset": 0,
                       "queryPlanning": 7, "triggerExecution": 112, "walCommit": 15},
        "stateOperators": [], "sources": [{
            "description": "KafkaV2[Subscribe[events]]", "numInputRows": rows, **rates,
            "startOffset": offsets(batch_id) if batch_id else None, "endOffset": end,
            "latestOffset": {"events": {p: o + 5 for p, o in end["events"].items()}},
            "metrics": {"avgOffsetsBehindLatest": "5.0", "maxOffsetsBehindLatest": "5",
                        "minOffsetsBehindLatest": "5"},
        }],
        "sink": {"description": "DeltaSink[/delta/orders]", "numOutputRows": rows},
        "observedMetrics": {},
    }  # fmt: skip
    return encode_request("progress", batch_id, progress=progress)


def cpu_snapshot(pids: Pids) -> tuple[float, dict[str, float]]:
    return time.perf_counter(), cpu_times(pids)


def cores_used(pids: Pids, since: tuple[float, dict[str, float]]) -> dict[str, float]:
    """Average cores each process used since the snapshot ``since``."""
    secs = time.perf_counter() - since[0]
    return {name: round((cpu_seconds(p) - since[1][name]) / secs, 2) for name, p in pids.items()}


async def verify(socket_path: str, expected: dict[str, int]) -> None:
    """Fail unless every query's stored batch id is the last one sent."""
    async with await SidecarClient.connect(socket_path) as client:
        for query_id, batch_id in expected.items():
            reply = await client.get(query_id)
            stored = reply.checkpoint.get("batch_id") if reply.checkpoint else None
            if not reply.ok or stored != batch_id:
                raise BenchError(f"query {query_id}: stored batch {stored}, last sent {batch_id}")


async def throughput(socket_path: str, conns: int, pids: Pids) -> dict[str, Any]:
    """Acked updates/s with ``conns`` pipelined connections."""
    queries = [str(uuid.uuid4()) for _ in range(conns)]
    warm, per = WARMUP_UPDATES // conns, UPDATES_PER_SCENARIO // conns
    warmup = [[progress_line(q, b) for b in range(warm)] for q in queries]
    timed = [[progress_line(q, b) for b in range(warm, warm + per)] for q in queries]
    streams = [await anyio.connect_unix(socket_path) for _ in queries]
    try:
        for batches in (warmup, timed):  # the second pass is the measurement
            counts: Counter[str] = Counter()
            cpu0 = cpu_snapshot(pids)
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for stream, lines in zip(streams, batches, strict=True):
                    tg.start_soon(drive, stream, lines, counts, WINDOW)
            elapsed = time.perf_counter() - t0
            cores = cores_used(pids, cpu0)
    finally:
        for stream in streams:
            await stream.aclose()
    await verify(socket_path, {q: warm + per - 1 for q in queries})
    return {
        "connections": conns, "window_per_connection": WINDOW, "updates": conns * per,
        "acked": counts["acked"], "not_acked": {k: v for k, v in counts.items() if k != "acked"},
        "seconds": round(elapsed, 3), "acked_updates_per_s": round(counts["acked"] / elapsed),
        "cpu_cores_used": cores,
    }  # fmt: skip


async def latency(socket_path: str, pids: Pids) -> dict[str, Any]:
    """Ack latency at LATENCY_RATE_HZ, one request at a time, on an absolute schedule."""
    query, warm = str(uuid.uuid4()), 500
    lines = [progress_line(query, b) for b in range(warm + LATENCY_SAMPLES)]
    samples: list[float] = []
    lags: list[float] = []  # how late each send was against its schedule (client-side pacing)
    async with await anyio.connect_unix(socket_path) as stream:
        await drive(stream, lines[:warm], Counter(), WINDOW)
        conn = ClientConnection()
        cpu0 = cpu_snapshot(pids)
        start = time.perf_counter()
        for i, line in enumerate(lines[warm:]):
            due = start + i / LATENCY_RATE_HZ
            if (delay := due - time.perf_counter()) > 0:
                await anyio.sleep(delay)
            sent = time.perf_counter()
            await stream.send(line)
            replies: list[Reply] = []
            while not replies:
                replies = conn.receive_data(await stream.receive())
            samples.append((time.perf_counter() - sent) * 1000)
            lags.append((sent - due) * 1000)
            if not (replies[0].ok and replies[0].applied):
                raise BenchError(f"update {warm + i} not acknowledged: {replies[0]}")
        elapsed, cores = time.perf_counter() - start, cores_used(pids, cpu0)
    await verify(socket_path, {query: len(lines) - 1})
    pct = quantiles(samples, n=100, method="inclusive")  # pct[k - 1] is the k-th percentile
    return {
        "rate_per_s": LATENCY_RATE_HZ, "samples": len(samples),
        "achieved_rate_per_s": round(len(samples) / elapsed),
        "p50_ms": round(pct[49], 3), "p99_ms": round(pct[98], 3), "max_ms": round(max(samples), 3),
        "send_late_vs_schedule_ms": {
            "p99": round(quantiles(lags, n=100, method="inclusive")[98], 3),
            "max": round(max(lags), 3)},
        "cpu_cores_used": cores,
    }  # fmt: skip


async def measure(socket_path: str, pids: Pids) -> dict[str, Any]:
    """Run every scenario against the (ready) daemon."""
    return {
        "throughput": [await throughput(socket_path, n, pids) for n in (1, 8)],
        "latency": await latency(socket_path, pids),
    }


def stop_daemon(daemon: DaemonProcess) -> None:
    """SIGTERM (graceful stop: final flush, lease release); kill after 20 s."""
    if daemon.proc is None:
        return  # never started
    if (code := daemon.stop(timeout_s=20)) != 0:
        print(f"daemon exited with {code}; log:\n{daemon.log()[-3000:]}", file=sys.stderr)


def run() -> Report:
    """Start the services and the daemon, measure; always stop them all, remove temp dirs."""
    with ExitStack() as cleanup:  # unwinds in reverse: daemon, Azurite, Redis, temp dir
        tmp, redis_server, azurite = services(cleanup, "cps-bench-")
        with redis.Redis.from_url(redis_server.url) as r:
            info = r.info("server")
        socket_path = str(tmp / "s.sock")
        daemon = DaemonProcess({
            "SIDECAR_SOCKET_PATH": socket_path, "SIDECAR_REDIS_URL": redis_server.url,
            "SIDECAR_NAMESPACE": "bench", "SIDECAR_METRICS_HOST": "127.0.0.1",
            "SIDECAR_LOG_LEVEL": "WARNING",
            "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
        }, tmp / "daemon.log")  # fmt: skip
        cleanup.callback(stop_daemon, daemon)
        daemon.start()  # in its own session: a Ctrl-C reaches only this script, which stops it
        pids = {"daemon": daemon.pid, "redis": int(info["process_id"]), "client": os.getpid(),
                "whole_machine": None}  # fmt: skip
        results = anyio.run(measure, socket_path, pids)
    rate = results["throughput"][1]
    p99 = results["latency"]["p99_ms"]
    return {
        "python": platform.python_version(), "redis_server": info["redis_version"],
        **environment(),
        "request_bytes": len(progress_line(str(uuid.uuid4()), 1000)),
        "note": "client (this process), daemon, redis-server and Azurite share the machine's "
                "cores; cpu_cores_used says how much each used (whole_machine: every process, "
                "Azurite and other users included)",
        "targets": {
            "acked_updates_per_s_8_connections": {
                "target": TARGET_UPDATES_S, "measured": rate["acked_updates_per_s"],
                "met": rate["acked_updates_per_s"] >= TARGET_UPDATES_S and not rate["not_acked"]},
            "p99_ms_at_1k_per_s": {"target": TARGET_P99_MS, "measured": p99,
                                   "met": p99 <= TARGET_P99_MS},
        },
        **results,
    }  # fmt: skip


def show(r: Report) -> None:
    lat = r["latency"]
    # fmt: off
    print(f"ingest bench: {r['cpu_count']} cores shared by client, daemon, redis, Azurite "
          f"(load avg before: {r['loadavg_1min_before']}); python {r['python']}, "
          f"redis {r['redis_server']}")
    for t in r["throughput"]:
        print(f"  {t['connections']} conn x {WINDOW} in flight: {t['acked_updates_per_s']:>6} "
              f"acked updates/s; not acked: {t['not_acked'] or 0}; cores: {t['cpu_cores_used']}")
    print(f"  latency at {LATENCY_RATE_HZ}/s, one at a time: p50 {lat['p50_ms']} ms, "
          f"p99 {lat['p99_ms']} ms, max {lat['max_ms']} ms; cores: {lat['cpu_cores_used']}")
    for name, t in r["targets"].items():
        print(f"  target {name}: {'met' if t['met'] else 'MISSED'} ({t['measured']} vs "
              f"{t['target']})")
    # fmt: on


def main() -> int:
    return bench_main("ingest", run, show)


if __name__ == "__main__":
    raise SystemExit(main())
