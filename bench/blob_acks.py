"""Blob-mode acknowledgements against a direct leased writer, on this machine.

Starts redis-server and Azurite (``tests.services``), then alternates rounds of:

- ``direct``: one query's blob written straight from this process under a lease held by it
  (``BlobStore.write``, the daemon's own edge), one write per update, one at a time: the
  speed of one blob write, the peer an ack in ``ack_mode=blob`` is measured against;
- ``sdk``: the same writes made as a user's own writer makes them, with the SDK's
  ``BlobClient.upload_blob`` (the lease, ``If-Match``, the metadata and content type the
  daemon's documents carry): the alternative a user would pick;
- ``daemon-1``: the daemon as a process (``SIDECAR_ACK_MODE=blob``, every other setting at
  its default: flush interval 1 s, thresholds 100 updates / 10 s), one connection, one
  request in flight;
- ``daemon-64``: the same, 64 requests in flight on the one connection (a new request is sent
  as each reply arrives);
- ``daemon-4x1``: four connections, one request in flight on each, each its own query (a
  driver running four streaming queries), against ``direct-4``: four direct writers at once,
  each its own query's blob under its own lease.

Each update is a Spark-shaped Kafka progress (32 partitions, ~1.7 KB) with a strictly
increasing batch id; only replies with ``ok=true`` count. Ack latency = send to parsed reply.
Each daemon scenario also says where an ack's time goes (means, from the daemon's
``ack_seconds`` and ``flush_seconds`` histograms): the client's round trip, the daemon's
request-read-to-reply-ready, the blob writes' share of it, and the daemon's CPU per ack.
Prints one JSON object (medians over the rounds, with the machine, the versions and the load
average); ``--out`` also writes it to a file. Exit code 1 when an update is not acknowledged or
a service fails. The daemon's event loop is its default unless ``--event-loop`` is given
(``SIDECAR_EVENT_LOOP``).

    .venv/bin/python bench/blob_acks.py --seconds 5 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from statistics import median, quantiles
from typing import Any

import anyio
import msgspec
from azure.core import MatchConditions
from azure.storage.blob import ContentSettings
from prometheus_client.parser import text_string_to_metric_families

from sidecar.config import Config
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore
from sidecar.wire.protocol import encode_request

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from bench.common import (
    BenchError,
    bench_main,
    cpu_seconds,
    git_commit,
    package_versions,
    services,
)
from tests.services import Azurite, DaemonProcess, RedisServer
from tests.sparkshapes import kafka_progress

CONTAINER = "bench-acks"
PARTITIONS = 32
WINDOW = 64
#: Connections of the ``daemon-4x1`` scenario, and writers of its peer ``direct-4``.
CONNECTIONS = 4
Result = dict[str, Any]


def request(query_id: str, batch_id: int, rid: int) -> bytes:
    progress = kafka_progress(query_id, batch_id, partitions=PARTITIONS)
    return encode_request("progress", rid, progress=progress)


def summary(name: str, latencies: list[float], seconds: float) -> Result:
    pct = quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
    return {
        "scenario": name,
        "acked": len(latencies),
        "per_s": round(len(latencies) / seconds, 1),
        "p50_ms": round(pct[49] * 1000, 2),
        "p99_ms": round(pct[98] * 1000, 2),
    }


async def direct(
    azurite: Azurite, seconds: float, writers: int = 1, *, sdk: bool = False
) -> Result:
    """``writers`` queries' blobs written at once from one store client, each under its own
    lease, one write at a time each; ``sdk``: each write the SDK's ``upload_blob``."""
    namespace = f"direct-{uuid.uuid4().hex[:8]}"
    store = BlobStore(
        Config(
            namespace=namespace,
            container=CONTAINER,
            azure_connection_string=azurite.connection_string,
        )
    )
    latencies: list[float] = []

    async def write(query: str, start: float) -> None:
        lease = str(uuid.uuid4())
        version = await store.create_if_absent(query)
        assert version is not None  # a new query: the blob was made here
        await store.acquire_lease(query, lease, 60)
        blob = await store.account.blob(store.blob_name(query))
        settings = ContentSettings(content_type="application/json")
        batch = 0
        while (now := time.perf_counter()) - start < seconds:
            body = msgspec.json.encode(kafka_progress(query, batch, partitions=PARTITIONS))
            if sdk:
                answer = await blob.upload_blob(
                    body,
                    overwrite=True,
                    lease=lease,  # type: ignore[arg-type]  # the SDK accepts the id string
                    metadata={"query_id": query, "query_name": "bench"},
                    content_settings=settings,
                    etag=version,
                    match_condition=MatchConditions.IfNotModified,
                )
                version = answer["etag"]
            else:
                version = await store.write(
                    query, body, lease_id=lease, query_name="bench", version=version
                )
            latencies.append(time.perf_counter() - now)
            batch += 1
        await store.release_lease(query, lease)

    try:
        await store.ensure_container()
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(writers):
                tg.start_soon(write, str(uuid.uuid4()), start)
        elapsed = time.perf_counter() - start
    finally:
        await store.aclose()
    name = ("sdk" if sdk else "direct") + ("" if writers == 1 else f"-{writers}")
    return summary(name, latencies, elapsed)


@contextmanager
def daemon(
    redis: RedisServer,
    azurite: Azurite,
    tmp: Path,
    event_loop: str | None,
    extra: dict[str, str],
    code: Path | None = None,
) -> Iterator[DaemonProcess]:
    name = f"acks-{uuid.uuid4().hex[:8]}"
    settings = {
        "SIDECAR_SOCKET_PATH": str(tmp / f"{name}.sock"),
        "SIDECAR_REDIS_URL": redis.url,
        "SIDECAR_NAMESPACE": name,
        "SIDECAR_CONTAINER": CONTAINER,
        "SIDECAR_METRICS_HOST": "127.0.0.1",
        "SIDECAR_LOG_LEVEL": "WARNING",
        "SIDECAR_ACK_MODE": "blob",
        "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
    }
    if event_loop:
        settings["SIDECAR_EVENT_LOOP"] = event_loop
    settings.update(extra)
    proc = DaemonProcess(settings, tmp / f"{name}.log")
    proc.code = code
    proc.start()
    try:
        yield proc
    finally:
        exited = proc.stop(signal.SIGTERM, 30)
        if exited != 0:
            raise BenchError(f"daemon exited with {exited}:\n{proc.log()[-3000:]}")


def histograms(proc: DaemonProcess) -> dict[str, tuple[float, float]]:
    """The daemon's ack and blob write histograms so far, from its /metrics: (count, total
    seconds) of its acks (a progress read to its reply ready) and of its blob writes."""
    with urllib.request.urlopen(f"{proc.admin_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    totals = {f"checkpoint_sidecar_{name}_seconds_{kind}": 0.0
              for name in ("ack", "flush") for kind in ("count", "sum")}  # fmt: skip
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in totals:
                totals[s.name] += s.value  # summed over labels
    return {
        name: (
            totals[f"checkpoint_sidecar_{name}_seconds_count"],
            totals[f"checkpoint_sidecar_{name}_seconds_sum"],
        )
        for name in ("ack", "flush")
    }


async def through_daemon(
    proc: DaemonProcess, window: int, seconds: float, connections: int = 1
) -> Result:
    """``window`` requests in flight on each of ``connections`` connections (each its own
    query) for ``seconds``."""
    before, cpu_before = histograms(proc), cpu_seconds(proc.pid)
    latencies: list[float] = []

    async def connection(start: float) -> None:
        query = str(uuid.uuid4())
        client = await SidecarClient.connect(proc.socket_path)
        sent: dict[int, float] = {}
        next_batch = 0

        async def send_one() -> None:
            nonlocal next_batch
            rid = next_batch + 1
            data = request(query, next_batch, rid)
            sent[rid] = time.perf_counter()
            next_batch += 1
            await client.send_raw(data)

        try:
            for _ in range(window):
                await send_one()
            while sent:
                (reply,) = await client.receive(1)
                if not reply.ok:
                    raise BenchError(f"not acknowledged: {reply}")
                latencies.append(time.perf_counter() - sent.pop(int(str(reply.id))))
                if time.perf_counter() - start < seconds:
                    await send_one()
        finally:
            await client.aclose()

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(connections):
            tg.start_soon(connection, start)
    elapsed = time.perf_counter() - start
    cpu = cpu_seconds(proc.pid) - cpu_before
    after = histograms(proc)
    (acks, ack_s), (writes, write_s) = (
        (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in ("ack", "flush")
    )
    name = f"daemon-{window}" if connections == 1 else f"daemon-{connections}x{window}"
    result = summary(name, latencies, elapsed)
    result["blob_writes"] = writes
    result["blob_write_mean_ms"] = round(write_s / writes * 1000, 2) if writes else None
    # Where an ack's time goes (means): the client's send to its reply parsed; in the daemon,
    # the request read to its reply ready; of that, the blob writes' share.
    result["client_mean_ms"] = round(sum(latencies) / len(latencies) * 1000, 3)
    result["daemon_ack_mean_ms"] = round(ack_s / acks * 1000, 3) if acks else None
    result["write_share_ms"] = round(write_s / acks * 1000, 3) if acks else None
    result["daemon_cpu_ms_per_ack"] = round(cpu / len(latencies) * 1000, 3)
    return result


async def measure(args: argparse.Namespace) -> Result:
    runs: dict[str, list[Result]] = {}
    with ExitStack() as stack:
        tmp, redis, azurite = services(stack, "cps-acks-")
        for _ in range(args.rounds):
            for writers, sdk in ((1, False), (1, True), (CONNECTIONS, False), (CONNECTIONS, True)):
                result = await direct(azurite, args.seconds, writers, sdk=sdk)
                runs.setdefault(result["scenario"], []).append(result)
            extra = dict(item.split("=", 1) for item in args.setting)
            daemons: list[tuple[Path | None, str]] = [(None, "")]
            if args.code:  # the two daemons alternate which runs first, round by round
                daemons.insert(len(runs.get("daemon-1", [])) % 2, (args.code, "-code"))
            for code, suffix in daemons:
                with daemon(redis, azurite, tmp, args.event_loop, extra, code) as proc:
                    for window, connections in ((1, 1), (WINDOW, 1), (1, CONNECTIONS)):
                        result = await through_daemon(proc, window, args.seconds, connections)
                        result["scenario"] += suffix
                        runs.setdefault(result["scenario"], []).append(result)
    out: Result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load_avg": os.getloadavg(),
        "packages": package_versions(),
        "git_commit": git_commit(),
        "event_loop": args.event_loop or "default",
        "seconds": args.seconds,
        "rounds": args.rounds,
        "settings": args.setting,
        "code": str(args.code) if args.code else None,
    }
    for name, results in runs.items():
        keys = [
            "per_s",
            "p50_ms",
            "p99_ms",
            "blob_writes",
            "blob_write_mean_ms",
            "client_mean_ms",
            "daemon_ack_mean_ms",
            "write_share_ms",
            "daemon_cpu_ms_per_ack",
        ]
        out[name] = {
            k: median(r[k] for r in results if r.get(k) is not None)
            for k in keys
            if any(r.get(k) is not None for r in results)
        }
    direct_s, direct_ms = out["direct"]["per_s"], out["direct"]["p50_ms"]
    sdk_s = out["sdk"]["per_s"]
    out["ratios"] = {
        "daemon-1 per_s / sdk": round(out["daemon-1"]["per_s"] / sdk_s, 2),
        f"daemon-{CONNECTIONS}x1 per_s / sdk": round(
            out[f"daemon-{CONNECTIONS}x1"]["per_s"] / sdk_s, 2
        ),
        "direct per_s / sdk": round(direct_s / sdk_s, 2),
        f"direct-{CONNECTIONS} per_s / sdk-{CONNECTIONS}": round(
            out[f"direct-{CONNECTIONS}"]["per_s"] / out[f"sdk-{CONNECTIONS}"]["per_s"], 2
        ),
        "daemon-1 per_s / direct": round(out["daemon-1"]["per_s"] / direct_s, 2),
        "daemon-1 p50 / direct write p50": round(out["daemon-1"]["p50_ms"] / direct_ms, 2),
        f"daemon-{WINDOW} per_s / direct": round(out[f"daemon-{WINDOW}"]["per_s"] / direct_s, 2),
        f"daemon-{CONNECTIONS}x1 per_s / direct": round(
            out[f"daemon-{CONNECTIONS}x1"]["per_s"] / direct_s, 2
        ),
        f"daemon-{CONNECTIONS}x1 per_s / direct-{CONNECTIONS}": round(
            out[f"daemon-{CONNECTIONS}x1"]["per_s"] / out[f"direct-{CONNECTIONS}"]["per_s"], 2
        ),
    }
    if args.code:
        for name in ("daemon-1", f"daemon-{WINDOW}", f"daemon-{CONNECTIONS}x1"):
            out["ratios"][f"{name} per_s / {name}-code"] = round(
                out[name]["per_s"] / out[f"{name}-code"]["per_s"], 2
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per scenario and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--event-loop", choices=["auto", "asyncio", "uvloop"])
    parser.add_argument("--out", type=Path, help="also write the result here (JSON)")
    parser.add_argument(
        "--code", type=Path, help="also run the daemon of this checkout (A/B: `-code` scenarios)"
    )
    parser.add_argument(
        "--setting", action="append", default=[], help="SIDECAR_X=value for the daemon"
    )
    args = parser.parse_args()
    return bench_main(
        "blob_acks",
        lambda: anyio.run(measure, args),
        lambda report: print(json.dumps(report, indent=2)),
        out=args.out,
        save=args.out is not None,
    )


if __name__ == "__main__":
    raise SystemExit(main())
