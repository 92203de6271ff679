"""Snapshots end to end (issue #29): a real PySpark driver's stateful queries snapshotted by a
real daemon process, side by side with a full copy per batch made with the storage SDK.

The workload: PySpark 4 in this process (``local[2]``, UI off), ``--queries`` queries (default
4), each a count by key of the ``rate-micro-batch`` source (``--rows`` rows per batch, key =
``value % --keys``: each batch updates ``--rows`` of the ``--keys`` keys, all of them every
``keys / rows`` batches) into the ``noop`` sink, 20 shuffle partitions, the RocksDB state store
with changelog checkpointing, a fixed ``--trigger-s`` processing-time trigger (default 10 s),
Spark's other settings at their defaults. Their checkpoints are under one root, the daemon's
``SIDECAR_SNAPSHOT_ROOT``; the JVM listener (``spark_bridge.attach(..., listener="jvm")``) posts
their progress to the daemon (a process: ``tests.services.DaemonProcess``, JSON logs at INFO,
``SIDECAR_SNAPSHOT_RETAIN=1000`` so that every index is still there to be read at the end),
with its own redis-server and Azurite (request log off).

Phases, one after the other on the same running queries (wall-clock windows):

1. ``warm-up``: the daemon without snapshots, until each query ran 2 batches and
   ``--warmup-s`` more.
2. ``off-1``: no snapshots (``SIDECAR_SNAPSHOT_ROOT`` unset).
3. ``first``: the daemon restarted with snapshots; until each query's first snapshot (its
   whole cut) is stored. Not measured.
4. ``on``: snapshots, nothing else: the sidecar's backup lag, bytes, requests, the daemon's
   ack latency and Spark's batch durations with snapshots on.
5. ``side-by-side``: the same, and a **full copy per batch** in another process (what a
   scheduled copy job does): it polls each query's ``commits/`` every 100 ms and after each
   new commit uploads every file of the checkpoint directory (one Put Blob each, 8 at a time
   per query, azure-storage-blob aio) over the previous copy; a commit that comes while a
   copy runs is taken by the next copy. Its lag (commit → copy done), requests and bytes per
   copy, and the files new or changed since its previous walk: the requests a file-by-file
   incremental copy would send. It competes for the 2 cores: the sidecar's lag here is not
   its lag alone (phase 4's is).
6. ``restart``: once every committed batch is in a snapshot, the daemon is stopped (SIGTERM)
   and started again (same Redis, same store, same pod identity); snapshots go on.
7. ``off-2``: no snapshots again (so "off" is measured before and after "on").

In phases 2, 4, 5 and 7 a separate client process sends progress updates of 10 other
queries (Kafka-shaped, 32 partitions: ``bench/peers.py``) at ``--rate`` per second (default
100) on an absolute schedule, after a 3 s warm-up: the daemon's ack latency, measured from
the scheduled send (open loop).

Measured:

- **Backup lag** of each (query, batch N): from ``commits/N``'s mtime to the first snapshot
  of N or a later batch stored (the daemon's "snapshot written" log line, after the index is
  written); coalesced batches (held first by a later batch's snapshot) counted.
- **Per snapshot**, from every index read back at the end, in order: the cut's files and
  bytes; the files new or changed since the previous cut and their bytes; the bytes of the
  packs it wrote (what it uploaded); contents uploaded that an earlier snapshot had stored
  (none expected, across the restart too); from its log line: storage requests, index bytes,
  duration. Pack blobs no index names (a snapshot cut by the stop) are counted.
- The daemon's snapshot metrics per process (``checkpoint_sidecar_snapshot_*``).
- **Spark's batch duration** (``durationMs.triggerExecution`` of every progress) per phase.
- **CPU** (cores used) of the daemon, Redis, Azurite, Spark's JVM, the client, the copier.
- **Restore**: the newest snapshot of one query restored (``sidecar.snapshot.restore``)
  against a plain parallel SDK download of the same packs, alternating, ``--restore-rounds``
  each; and bench/snapshot_store.py's restore of a ``--restore-mib`` (default 1024) synthetic
  HDFS checkpoint against the same download, run here after Spark stopped.

Targets (issue #29), each in the report with what was measured: backup lag p99 ≤ one trigger
interval (phase ``on``); bytes uploaded ÷ bytes of new files ≤ 1.05 per snapshot after a
query's first; no content uploaded twice across the restart; ack latency p99 with snapshots
÷ without ≤ 1.2; Spark batch duration with ÷ without ≤ 1.02 (a goal; reported); restore ≥
0.9 times the SDK download. Results: ``bench/results/snapshots.json``
(``snapshots-store-nice-N.json`` with ``--store-nice N``: Azurite's threads niced, as a remote
store's CPU is off the pod's cores; an experiment beside the reference). ``--placement pod``
(``snapshots-pod.json``): the sidecar's side (the daemon with its worker, Redis, the ack client)
pinned to the first CPU, Spark's driver and JVM, Azurite and the copier to the others, as a
pod's sidecar container has a CPU request of its own and the store is remote; the default,
``shared``, leaves every process where the kernel puts it. Exit code 1 when the bytes
ratio or the no-duplicate check fails, or a snapshot failed for an unexpected reason (a bug):
deterministic outcomes; the timed targets are reported, met or MISSED, since on 2 shared cores
their misses are often the machine's.

``--quick`` (~3 min): 2 queries x 20,000 keys, 5,000 rows per batch, 5 s trigger, short
phases, 128 MiB restore, one round.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from statistics import median
from typing import Any

import anyio
import anyio.to_thread

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from bench.common import BenchError, Cpus, Report, bench_main, cpu_seconds, environment, pin
from bench.fleetmodel import CheckpointGrowth, snapshot_fleet
from bench.snapshot_store import CONTAINER, alternated, paired_ratio, restores, sdk_download
from bench.snapshotstats import (
    IndexFacts,
    Lag,
    Stored,
    backup_lags,
    changes,
    files_per_batch,
    lag_summary,
    new_since,
    overlapping,
    ratio,
    spread,
)
from bench.tools import latency_summary_ms, paired_ratios
from tests.services import REPO_ROOT, Azurite, DaemonProcess, RedisServer, free_port

NAMESPACE, COPY_CONTAINER = "bench-snapshots", "full-copies"
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
#: The copier looks for new commits this often.
POLL_S = 0.1
#: The client's warm-up before its measured window (the other queries' leases, the connection).
CLIENT_WARMUP_S = 3.0
#: After a restart without snapshots, before a window: the listener reconnected.
SETTLE_OFF_S = 3.0
TARGETS = {
    "backup_lag_p99_s": "≤ trigger interval",
    "uploaded_per_new_byte": 1.05,
    "ack_p99_on_over_off": 1.2,
    "spark_batch_median_on_over_off": 1.02,
    "restore_over_sdk_download": 0.9,
}
MiB = 1024 * 1024


@dataclass(frozen=True)
class Plan:
    """What one run does (``--quick`` and the flags change it)."""

    queries: int = 4
    keys: int = 100_000
    rows: int = 20_000
    partitions: int = 20
    trigger_s: float = 10.0
    warmup_s: float = 20.0
    #: Rounds of a window with snapshots off and one with them on (order alternating): 5,
    #: since a 40 s window's ack p99 moves 2-fold between windows of one kind.
    rounds: int = 5
    window_s: float = 40.0
    side_s: float = 120.0
    restart_s: float = 40.0
    rate: float = 100.0
    copy_concurrency: int = 8
    restore_mib: int = 1024
    restore_rounds: int = 5
    #: Niceness given to Azurite's threads: Azure Storage is remote in production, its CPU
    #: not on the pod's cores; Azurite's is here. 0: left as it is.
    store_nice: int = 0
    #: Where the processes run. ``shared``: anywhere, as the kernel places them. ``pod``: the
    #: sidecar's side (the daemon with its worker, Redis, the ack client) on the first CPU,
    #: Spark's driver, its JVM, Azurite and the copier on the others: the CPU of a pod's
    #: sidecar container (its own request) and a remote store's, apart from Spark's.
    placement: str = "shared"


QUICK = Plan(queries=2, keys=20_000, rows=5_000, trigger_s=5.0, warmup_s=5.0, rounds=2,
             window_s=20.0, side_s=30.0, restart_s=20.0, restore_mib=128,
             restore_rounds=1)  # fmt: skip


@dataclass
class Phase:
    name: str
    start: float  # wall clock (commit mtimes, log timestamps and progress times are too)
    end: float = 0.0
    daemon: str = ""
    cores: dict[str, float] = field(default_factory=dict)
    #: CPU-seconds per process over the phase (``cores`` rounded is too coarse for a
    #: snapshot's tens of milliseconds); the daemon's with its cut worker process.
    cpu_s: dict[str, float] = field(default_factory=dict)
    client: dict[str, Any] | None = None
    copier: dict[str, Any] | None = None

    def holds(self, t: float) -> bool:
        return self.start <= t < self.end


# --- the client process: open-loop progress updates of other queries ------------------------


def client_role(cfg: dict[str, Any]) -> dict[str, Any]:
    from bench.peers import Daemon  # the compare bench's open loop, on one connection

    async def main() -> dict[str, Any]:
        daemon = Daemon(cfg["socket"])
        await daemon.open_loop(cfg["rate"], CLIENT_WARMUP_S)
        cpu0 = time.process_time()
        wall = time.time() - time.perf_counter()  # perf_counter → wall clock
        rec = await daemon.open_loop(cfg["rate"], cfg["seconds"])
        done = [(s, d) for s, d in zip(rec.scheduled, rec.done, strict=True) if d is not None]
        return {
            "summary": rec.summary(),
            "latencies_ms": [round((d - s) * 1000, 3) for s, d in done],
            "scheduled_at": [round(s + wall, 4) for s, _ in done],
            "cpu_s": round(time.process_time() - cpu0, 2),
        }

    return anyio.run(main)


# --- the copier process: a full copy per batch with the storage SDK -------------------------


def newest_commit(location: Path) -> int:
    try:
        names = os.listdir(location / "commits")
    except FileNotFoundError:
        return -1
    return max((int(n) for n in names if n.isdigit()), default=-1)


def walk(location: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``location``: relative path → (size, mtime ns)."""
    out: dict[str, tuple[int, int]] = {}
    for dirpath, _, files in os.walk(location):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:  # renamed or deleted by Spark meanwhile
                continue
            out[os.path.relpath(path, location)] = (st.st_size, st.st_mtime_ns)
    return out


def copier_role(cfg: dict[str, Any]) -> dict[str, Any]:
    from azure.storage.blob.aio import BlobServiceClient

    requests: Counter[str] = Counter()

    def counted(response: Any) -> None:
        requests[response.http_request.method] += 1

    async def main() -> dict[str, Any]:
        copies: list[dict[str, Any]] = []
        deadline = time.monotonic() + cfg["seconds"]
        async with BlobServiceClient.from_connection_string(
            cfg["connection_string"], raw_response_hook=counted
        ) as service:
            container = service.get_container_client(COPY_CONTAINER)
            if not await container.exists():
                await container.create_container()

            async def upload(prefix: str, location: Path, rel: str, vanished: list[str]) -> None:
                try:
                    data = await anyio.to_thread.run_sync((location / rel).read_bytes)
                except FileNotFoundError:
                    vanished.append(rel)
                    return
                await container.upload_blob(f"{prefix}/{rel}", data, overwrite=True)

            async def copy_query(name: str, location: Path) -> None:
                # The first copy comes after the next commit, as every other: a copy job that
                # runs after each commit (so each copy's lag is from a commit).
                copied = await anyio.to_thread.run_sync(newest_commit, location)
                before: dict[str, tuple[int, int]] = {}
                # A copy still under way at the deadline is cut, and not counted.
                with anyio.move_on_after(deadline - time.monotonic()):
                    while True:
                        newest = await anyio.to_thread.run_sync(newest_commit, location)
                        if newest <= copied:
                            await anyio.sleep(POLL_S)
                            continue
                        started = time.time()
                        files = await anyio.to_thread.run_sync(walk, location)
                        new_files, new_bytes = new_since(before, files)
                        vanished: list[str] = []
                        limiter = anyio.Semaphore(cfg["concurrency"])

                        async def one(
                            rel: str, vanished: list[str] = vanished, limiter: Any = limiter
                        ) -> None:
                            async with limiter:
                                await upload(name, location, rel, vanished)

                        async with anyio.create_task_group() as tg:
                            for rel in files:
                                tg.start_soon(one, rel)
                        copies.append({
                            "query": name, "n": sum(c["query"] == name for c in copies),
                            "batch": newest, "started": started, "ended": time.time(),
                            "files": len(files), "bytes": sum(s for s, _ in files.values()),
                            "new_files": new_files, "new_bytes": new_bytes,
                            "vanished": len(vanished),
                            "puts": len(files) - len(vanished),  # one Put Blob each (< 64 MiB)
                        })  # fmt: skip
                        copied, before = newest, files

            cpu0 = time.process_time()
            async with anyio.create_task_group() as tg:
                for name, location in cfg["locations"].items():
                    tg.start_soon(copy_query, name, Path(location))
        return {"copies": copies, "requests": dict(requests),
                "cpu_s": round(time.process_time() - cpu0, 2)}  # fmt: skip

    return anyio.run(main)


# --- helper processes --------------------------------------------------------------------------


def start_role(role: str, cfg: dict[str, Any], log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, __file__, "--role", role, json.dumps(cfg)],
            stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True,
        )  # fmt: skip


def result_of(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise BenchError(
            f"a helper process did not finish within {timeout_s:.0f}s; see {log}"
        ) from None
    lines = [x for x in out.decode().splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = log.read_text(errors="replace")[-3000:]
        raise BenchError(f"a helper process exited {proc.returncode}:\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


# --- the daemon's side: metrics and log lines ---------------------------------------------------


def scrape(proc: DaemonProcess) -> dict[str, float]:
    """The daemon's snapshot samples (``name{label="…"}`` → value) from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{proc.admin_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("checkpoint_sidecar_snapshot") and not s.name.endswith(
                ("_bucket", "_created")
            ):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def log_records(path: Path) -> Iterator[dict[str, Any]]:
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def when(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


# --- one run ------------------------------------------------------------------------------------


class Bench:
    """The services, the daemon processes, the Spark driver and the phases of one run."""

    def __init__(
        self, plan: Plan, tmp: Path, redis: RedisServer, azurite: Azurite, cpus: Cpus
    ) -> None:
        self.plan, self.tmp, self.redis, self.azurite = plan, tmp, redis, azurite
        self.cpus = cpus
        self.root = tmp / "volume"
        (self.root / "app").mkdir(parents=True)
        self.names = [f"counts-{i}" for i in range(plan.queries)]
        self.locations = {n: self.root / "app" / n for n in self.names}
        self.off_env = {
            "SIDECAR_SOCKET_PATH": str(tmp / "s.sock"),
            "SIDECAR_REDIS_URL": redis.url,
            "SIDECAR_NAMESPACE": NAMESPACE,
            "SIDECAR_CONTAINER": CONTAINER,
            "SIDECAR_METRICS_HOST": "127.0.0.1",
            "SIDECAR_METRICS_PORT": str(free_port()),
            "SIDECAR_INSTANCE_ID": "bench-driver-pod",  # every restart: the same pod
            "SIDECAR_LOG_LEVEL": "INFO",
            "SIDECAR_LOG_FORMAT": "json",
            "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
        }
        self.on_env = self.off_env | {
            "SIDECAR_SNAPSHOT_ROOT": str(self.root),
            "SIDECAR_SNAPSHOT_RETAIN": "1000",
        }
        self.daemon: DaemonProcess | None = None
        self.daemon_label = ""
        #: label → (log path, metrics at its stop, exit code)
        self.processes: dict[str, dict[str, Any]] = {}
        self.phases: list[Phase] = []
        self.spark: Any = None
        self.queries: list[Any] = []
        self.jvm_pid: int | None = None

    # --- the daemon ---

    def start_daemon(self, label: str, snapshots: bool) -> None:
        log = self.tmp / f"daemon-{label}.log"
        self.daemon = DaemonProcess(self.on_env if snapshots else self.off_env, log)
        self.daemon_label = label
        self.processes[label] = {"log": log, "snapshots": snapshots, "started": time.time()}
        self.daemon.start(timeout_s=90)
        pin(self.daemon.pid, self.cpus.sidecar)  # its worker process too, started now or later

    def stop_daemon(self) -> None:
        assert self.daemon is not None
        info = self.processes[self.daemon_label]
        if info["snapshots"]:
            info["metrics"] = scrape(self.daemon)
        info["stopped"] = time.time()
        code = self.daemon.stop(signal.SIGTERM, 60)
        info["exit_code"] = code
        if code != 0:
            raise BenchError(f"daemon {self.daemon_label} exited with {code}; see {info['log']}")
        self.daemon = None

    def kill_daemon(self) -> None:
        if self.daemon is not None:
            self.daemon.kill()

    def written(self, label: str) -> list[dict[str, Any]]:
        """The "snapshot written" log records of daemon ``label`` so far."""
        return [r for r in log_records(self.processes[label]["log"])
                if str(r.get("message", "")).startswith("snapshot written")]  # fmt: skip

    # --- Spark ---

    def start_spark(self) -> None:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        os.environ["PYSPARK_PYTHON"] = sys.executable
        from pyspark.sql import SparkSession
        from pyspark.sql import functions as F

        import spark_bridge

        p = self.plan
        self.spark = (
            SparkSession.builder.master("local[2]").appName("bench-snapshots")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.memory", "2g")
            .config("spark.sql.shuffle.partitions", str(p.partitions))
            .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB)
            .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled",
                    "true")
            .config("spark.sql.streaming.numRecentProgressUpdates", "10000")
            .getOrCreate()
        )  # fmt: skip
        self.spark.sparkContext.setLogLevel("ERROR")
        self.jvm_pid = int(self.spark._jvm.java.lang.ProcessHandle.current().pid())
        spark_bridge.attach(self.spark, self.off_env["SIDECAR_SOCKET_PATH"], listener="jvm")
        for name in self.names:
            df = (
                self.spark.readStream.format("rate-micro-batch")
                .option("rowsPerBatch", str(p.rows)).load()
                .select((F.col("value") % p.keys).alias("key")).groupBy("key").count()
            )  # fmt: skip
            self.queries.append(
                df.writeStream.format("noop").outputMode("update").queryName(name)
                .trigger(processingTime=f"{p.trigger_s} seconds")
                .option("checkpointLocation", str(self.locations[name])).start()
            )  # fmt: skip

    def batches(self) -> list[int]:
        """Each query's last finished batch (-1: none yet); the JVM's objects (cheap)."""
        out = []
        for q in self.queries:
            if (e := q._jsq.exception()).isDefined():
                raise BenchError(f"query {q.name} failed: {e.get().toString()}")
            last = q._jsq.lastProgress()
            out.append(-1 if last is None else int(last.batchId()))
        return out

    def committed(self) -> dict[str, int]:
        return {n: newest_commit(loc) for n, loc in self.locations.items()}

    # --- phases ---

    def pids(self) -> dict[str, int | None]:
        return {
            "daemon": self.daemon.pid if self.daemon else None,
            "redis": self.redis.pid,
            "azurite": self.azurite.pid,
            "spark_jvm": self.jvm_pid,
            "this_process": os.getpid(),
        }

    @contextmanager
    def phase(self, name: str) -> Iterator[Phase]:
        ph = Phase(name, time.time(), daemon=self.daemon_label)
        pids = {k: v for k, v in self.pids().items() if v is not None}

        def cpu(key: str, pid: int) -> float:  # the daemon with its snapshot cut's worker
            return cpu_seconds(pid, tree=key == "daemon")

        cpu0 = {k: cpu(k, v) for k, v in pids.items()} | {"machine": cpu_seconds(None)}
        own0 = cpu_seconds(pids["daemon"]) if "daemon" in pids else 0.0
        t0 = time.monotonic()
        print(f"  phase {name} (daemon {self.daemon_label}) ...", flush=True)
        yield ph
        secs = time.monotonic() - t0
        ph.end = time.time()
        now = self.pids()
        for key, pid in pids.items():
            if now.get(key) == pid:  # the same process all along
                ph.cpu_s[key] = cpu(key, pid) - cpu0[key]
                ph.cores[key] = round(ph.cpu_s[key] / secs, 2)
                if key == "daemon":  # its own process alone: what the event loop shares
                    ph.cpu_s["daemon_own"] = cpu_seconds(pid) - own0
        ph.cores["machine"] = round((cpu_seconds(None) - cpu0["machine"]) / secs, 2)
        self.phases.append(ph)

    def measured(self, name: str, seconds: float, *, copier: bool = False) -> None:
        """A phase of ``seconds`` with the open-loop client (and the copier)."""
        with self.phase(name) as ph:
            started = time.monotonic()
            client_log = self.tmp / f"client-{name}.log"
            client = start_role("client", {
                "socket": self.off_env["SIDECAR_SOCKET_PATH"], "rate": self.plan.rate,
                "seconds": seconds - CLIENT_WARMUP_S - 2}, client_log)  # fmt: skip
            pin(client.pid, self.cpus.sidecar)  # pinned within its warm-up
            copy = copy_log = None
            if copier:
                copy_log = self.tmp / f"copier-{name}.log"
                copy = start_role(
                    "copier",
                    {
                        "connection_string": self.azurite.connection_string,
                        "locations": {n: str(p) for n, p in self.locations.items()},
                        "seconds": seconds,
                        "concurrency": self.plan.copy_concurrency,
                    },
                    copy_log,
                )
            self.sleep_until(started + seconds)
            ph.client = result_of(client, client_log, 60)
            if copy is not None and copy_log is not None:
                ph.copier = result_of(copy, copy_log, 300)  # a copy under way finishes

    def sleep_until(self, deadline: float) -> None:
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(1.0, left))
            self.batches()  # a failed query fails the run now
            if self.daemon is not None and not self.daemon.running:
                raise BenchError(f"daemon {self.daemon_label} exited; see its log")

    def wait_for(self, what: str, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise BenchError(f"timed out after {timeout_s:.0f}s waiting for {what}")
            self.sleep_until(time.monotonic() + 0.5)

    def caught_up(self) -> bool:
        """Every query's newest commit is in a snapshot of the running daemon."""
        held: dict[str, int] = {}
        for r in self.written(self.daemon_label):
            held[r["query"]] = max(held.get(r["query"], -1), int(r["batch"]))
        ids = {str(q.id): n for q, n in zip(self.queries, self.names, strict=True)}
        newest = self.committed()
        return all(held.get(qid, -1) >= newest[n] for qid, n in ids.items())

    def switch(self, snapshots: bool) -> None:
        """The daemon restarted (SIGTERM, then a new process of the same pod) with snapshots on
        or off, and settled: with snapshots, once each query's newest commit is in a snapshot
        of the new process (its first snapshots read every file of the cut again). A daemon
        with snapshots is stopped once each query's newest commit is in one of its snapshots."""
        if self.daemon is not None:
            if self.processes[self.daemon_label]["snapshots"]:
                # A batch committed at the end of an "on" window is held by this daemon's
                # snapshot, not by the next "on" daemon's minutes later: its lag is not the stop's.
                self.wait_for(
                    "the snapshots to catch up", self.caught_up, 60 + 4 * self.plan.trigger_s
                )
            self.stop_daemon()
        self.start_daemon(f"p{len(self.processes)}-{'on' if snapshots else 'off'}", snapshots)
        with self.phase(f"settle {self.daemon_label}"):
            if snapshots:
                self.wait_for("the first snapshots", self.caught_up, 120 + 4 * self.plan.trigger_s)
            else:
                self.sleep_until(time.monotonic() + SETTLE_OFF_S)

    def run(self) -> None:
        p = self.plan
        self.start_daemon("p0-off", snapshots=False)
        self.start_spark()
        with self.phase("warm-up"):
            self.wait_for("2 batches of each query", lambda: min(self.batches()) >= 2, 300)
            self.sleep_until(time.monotonic() + p.warmup_s)
        self.switch(snapshots=True)  # the first snapshots: each query's whole cut
        for n in range(1, p.rounds + 1):
            for kind in ("off", "on") if n % 2 else ("on", "off"):
                if self.processes[self.daemon_label]["snapshots"] != (kind == "on"):
                    self.switch(snapshots=kind == "on")
                self.measured(f"{kind}-{n}", p.window_s)
        if not self.processes[self.daemon_label]["snapshots"]:
            self.switch(snapshots=True)
        self.measured("side-by-side", p.side_s, copier=True)
        with self.phase("drain"):
            self.wait_for("the snapshots to catch up", self.caught_up, 60 + 4 * p.trigger_s)
        with self.phase("restart"):  # on → on: stopped, started again, snapshots go on
            started = time.monotonic()
            self.stop_daemon()
            self.start_daemon(f"p{len(self.processes)}-on", snapshots=True)
            self.sleep_until(started + p.restart_s)
            self.wait_for("the snapshots to catch up", self.caught_up, 60 + 4 * p.trigger_s)

    def stop_spark(self) -> list[dict[str, Any]]:
        """Stop the queries; every progress of each (batch, start time, duration)."""
        self.spark.sparkContext.setLogLevel("OFF")  # a batch cut by the stop logs errors
        progress = []
        for q, name in zip(self.queries, self.names, strict=True):
            q.stop()
            for pr in q.recentProgress:
                progress.append({
                    "query": name, "batch": pr["batchId"], "start": when(pr["timestamp"]),
                    "trigger_ms": pr["durationMs"].get("triggerExecution"),
                })  # fmt: skip
        return progress

    def commit_times(self) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {}
        for name, loc in self.locations.items():
            out[name] = {}
            for f in (loc / "commits").iterdir():
                if f.name.isdigit():
                    out[name][int(f.name)] = f.stat().st_mtime
        return out


# --- what the store holds at the end -----------------------------------------------------------


async def stored_snapshots(port_cs: str, query_ids: list[str]) -> dict[str, Any]:
    """Every index of each query (decoded, with its blob's size) and every pack's size."""
    from sidecar.config import Config
    from sidecar.snapshot.index import parse_index_name, parse_pack_name, prefix
    from sidecar.snapshot.restore import list_snapshots
    from sidecar.store.blobs import BlobStore
    from sidecar.store.snapshots import SnapshotBlobs

    config = Config.from_env(
        {
            "AZURE_STORAGE_CONNECTION_STRING": port_cs,
            "SIDECAR_CONTAINER": CONTAINER,
            "SIDECAR_NAMESPACE": NAMESPACE,
        }
    )
    store = BlobStore(config)
    blobs = SnapshotBlobs(store.account)
    out: dict[str, Any] = {}
    try:
        for qid in query_ids:
            listed = await blobs.list(prefix(NAMESPACE, qid))
            index_sizes = {}
            packs = {}
            for b in listed:
                if (parsed := parse_index_name(b.name)) is not None:
                    index_sizes[parsed[1]] = b.size
                elif (pack := parse_pack_name(b.name)) is not None:
                    packs[pack] = b.size
            indexes = await list_snapshots(blobs, NAMESPACE, qid)
            out[qid] = {"indexes": indexes, "index_sizes": index_sizes, "packs": packs}
    finally:
        await store.aclose()
    return out


def facts(index: Any) -> IndexFacts:
    return IndexFacts(
        batch=index.batch,
        files={f.path: (f.size, f.sha256, f.pack, f.offset) for f in index.files},
        packs=dict(index.packs),
    )


# --- restore --------------------------------------------------------------------------------------


async def restore_real(cs: str, port: int, index: Any, work: Path, rounds: int) -> dict[str, Any]:
    """The snapshot ``index`` restored, against a plain SDK download of its packs,
    alternating; medians."""
    from sidecar.config import Config
    from sidecar.snapshot.index import pack_name
    from sidecar.snapshot.restore import restore
    from sidecar.store.blobs import BlobStore
    from sidecar.store.snapshots import SnapshotBlobs

    config = Config.from_env(
        {
            "AZURE_STORAGE_CONNECTION_STRING": cs,
            "SIDECAR_CONTAINER": CONTAINER,
            "SIDECAR_NAMESPACE": NAMESPACE,
        }
    )
    store = BlobStore(config)
    blobs = SnapshotBlobs(store.account)
    names = [pack_name(NAMESPACE, index.query_id, p) for p in index.packs]
    try:
        ours, sdk = await alternated(
            rounds,
            lambda: restore(index, blobs, NAMESPACE, work / "restored"),
            lambda: sdk_download(port, names, work / "sdk", 8),
            cleanup=[work / "restored", work / "sdk"],
        )
    finally:
        await store.aclose()
    total, pack_bytes = index.total_bytes, sum(index.packs.values())
    ours_mibs = [total / MiB / s for s in ours]
    sdk_mibs = [pack_bytes / MiB / s for s in sdk]
    return {
        "batch": index.batch, "files": len(index.files), "bytes": total,
        "packs": len(index.packs), "pack_bytes": pack_bytes,
        "restore_s": [round(s, 3) for s in ours], "sdk_download_s": [round(s, 3) for s in sdk],
        "restore_mib_s": round(median(ours_mibs), 1),
        "sdk_download_mib_s": round(median(sdk_mibs), 1),
        "restore_vs_sdk": paired_ratio(ours_mibs, sdk_mibs),
    }  # fmt: skip


# --- the report ---------------------------------------------------------------------------------


def snapshot_rows(
    bench: Bench, qids: dict[str, str], stored: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """One row per snapshot (every query, in the order written), and the bytes of pack blobs
    no index names, per query."""
    logged: dict[str, dict[str, Any]] = {}
    for label, info in bench.processes.items():
        if info["snapshots"]:
            for r in bench.written(label):
                logged[r["snapshot"]] = r | {"process": label}
    rows: list[dict[str, Any]] = []
    orphans: dict[str, int] = {}
    for name, qid in qids.items():
        got = stored[qid]
        indexes = sorted(got["indexes"], key=lambda i: (i.batch, i.created_at))
        named = {p for i in indexes for p in i.packs}
        orphans[name] = sum(s for p, s in got["packs"].items() if p not in named)
        seen_process: set[str] = set()
        for index, ch in zip(indexes, changes([facts(i) for i in indexes]), strict=True):
            rec = logged.get(index.id, {})
            process = rec.get("process")
            rows.append({
                "query": name, "batch": index.batch, "snapshot": index.id, "process": process,
                "written_at": when(rec["timestamp"]) if rec else when(index.created_at),
                "requests": rec.get("requests"), "duration_s": rec.get("duration_s"),
                "index_bytes": got["index_sizes"].get(index.id),
                **{k: v for k, v in asdict(ch).items() if k != "batch"},
                "uploaded_per_new_byte": round(r, 4) if (r := ch.uploaded_per_new_byte) else r,
                "first_of_process": process not in seen_process,
            })  # fmt: skip
            seen_process.add(process or "")
    return rows, orphans


def analyse(
    bench: Bench,
    progress: list[dict[str, Any]],
    commits: dict[str, dict[int, float]],
    stored: dict[str, Any],
    restore: dict[str, Any],
) -> Report:
    plan, phases = bench.plan, {ph.name: ph for ph in bench.phases}
    qids = {n: str(q.id) for n, q in zip(bench.names, bench.queries, strict=True)}
    rows, orphans = snapshot_rows(bench, qids, stored)
    on_windows = [f"on-{n}" for n in range(1, plan.rounds + 1)]
    off_windows = [f"off-{n}" for n in range(1, plan.rounds + 1)]

    # Backup lag: the sidecar's, in every phase; the full copy's, side by side (of the batches
    # committed before its last complete copy started: a later one was cut at the deadline).
    sidecar_lags: list[Lag] = []
    for name in bench.names:
        mine = [Stored(r["batch"], r["written_at"]) for r in rows if r["query"] == name]
        sidecar_lags += backup_lags(commits[name], mine)
    side = phases["side-by-side"]
    copies = side.copier["copies"] if side.copier else []
    copy_lags: list[Lag] = []
    for name in bench.names:
        mine_c = [c for c in copies if c["query"] == name]
        first = min((c["batch"] for c in mine_c), default=None)
        window = {b: t for b, t in commits[name].items()
                  if first is not None and b >= first and t < side.end}  # fmt: skip
        copy_lags += backup_lags(window, [Stored(c["batch"], c["ended"]) for c in mine_c])

    def batches_in(names: list[str]) -> int:
        return sum(any(phases[n].holds(t) for n in names)
                   for q in bench.names for t in commits[q].values())  # fmt: skip

    def spark_ms(names: list[str]) -> list[float]:
        """Batch durations of the batches that ran within one of the phases ``names``."""
        return [p["trigger_ms"] for p in progress if p["trigger_ms"] is not None
                and any(phases[n].start <= p["start"]
                        and p["start"] + p["trigger_ms"] / 1000 <= phases[n].end
                        for n in names)]  # fmt: skip

    def acks(names: list[str]) -> dict[str, Any]:
        lat = [x / 1000 for n in names if (c := phases[n].client) for x in c["latencies_ms"]]
        return latency_summary_ms(lat)

    # What a copy after each batch would send, from the directory at the end (Spark deleted
    # nothing in these runs: fewer than its 100 batches kept): a file-by-file copy one request
    # per file written since the previous commit, a full copy one per file there at the commit.
    by_file: dict[tuple[str, int], int] = {}
    full: dict[tuple[str, int], int] = {}
    full_bytes: dict[tuple[str, int], int] = {}
    for q in bench.names:
        files = sorted((m / 1e9, size) for size, m in walk(bench.locations[q]).values())
        mtimes = [t for t, _ in files]
        upto = list(itertools.accumulate((size for _, size in files), initial=0))
        for batch, count in files_per_batch(commits[q], mtimes).items():
            by_file[q, batch] = count
        for batch, t in commits[q].items():
            full[q, batch] = bisect.bisect_right(mtimes, t)
            full_bytes[q, batch] = upto[full[q, batch]]

    def copies_per_batch(names: list[str]) -> dict[str, Any]:
        keys = [(q, b) for q in bench.names for b, t in commits[q].items()
                if any(phases[n].holds(t) for n in names) and (q, b) in by_file]  # fmt: skip
        return {"file_by_file": spread([by_file[k] for k in keys], 0),
                "full_copy": spread([full[k] for k in keys], 0),
                "full_copy_bytes": spread([full_bytes[k] for k in keys], 0)}  # fmt: skip

    def sidecar(names: list[str]) -> dict[str, Any]:
        snaps = [r for r in rows if any(phases[n].holds(r["written_at"]) for n in names)]
        lags = [lag for lag in sidecar_lags if any(phases[n].holds(lag.committed_at)
                                                   for n in names)]  # fmt: skip
        requests = [r["requests"] for r in snaps if r["requests"] is not None]
        return {
            "backup_lag": lag_summary(lags),
            "snapshots": len(snaps),
            "requests_per_snapshot": spread(requests, 1),
            "requests_per_batch": ratio(sum(requests), batches_in(names), 2),
            "a_copy_per_batch_would_send": copies_per_batch(names),
            "index_bytes": spread([r["index_bytes"] for r in snaps if r["index_bytes"]], 0),
            "uploaded_bytes": spread([r["uploaded_bytes"] for r in snaps], 0),
            "cut_files": spread([r["files"] for r in snaps], 0),
            "new_files_in_cut": spread([r["new_files"] for r in snaps], 0),
            "duration_s": spread([r["duration_s"] for r in snaps if r["duration_s"] is not None]),
        }

    per_phase: dict[str, Any] = {}
    for ph in bench.phases:
        entry: dict[str, Any] = {
            "daemon": ph.daemon, "seconds": round(ph.end - ph.start, 1),
            "batches_committed": batches_in([ph.name]), "cores": ph.cores,
            "spark_batch_ms": spread(spark_ms([ph.name]), 0),
        }  # fmt: skip
        if ph.name == "restart" or bench.processes[ph.daemon]["snapshots"]:
            entry["sidecar"] = sidecar([ph.name])
        if ph.client is not None:
            entry["ack_latency"] = {**acks([ph.name]), "open_loop": ph.client["summary"],
                                    "client_cpu_s": ph.client["cpu_s"]}  # fmt: skip
        if ph.copier is not None:
            cs = ph.copier["copies"]
            later_cs = [c for c in cs if c["n"] > 0]  # a query's first copy: all new
            entry["full_copy"] = {
                "backup_lag": lag_summary(copy_lags, ph.end),
                "copies": len(cs),
                "requests_per_copy": spread([c["puts"] for c in cs], 0),
                "requests_per_batch": ratio(sum(c["puts"] for c in cs), batches_in([ph.name]), 2),
                "bytes_per_copy": spread([c["bytes"] for c in cs], 0),
                "requests_total": ph.copier["requests"], "cpu_s": ph.copier["cpu_s"],
                "file_by_file": {  # the files new or changed since the query's previous copy
                    "requests_per_copy": spread([c["new_files"] for c in later_cs], 0),
                    "requests_per_batch": ratio(
                        sum(c["new_files"] for c in later_cs),
                        sum(c["batch"] - prev["batch"] for c in later_cs
                            for prev in cs if prev["query"] == c["query"]
                            and prev["n"] == c["n"] - 1), 2),
                    "bytes_per_copy": spread([c["new_bytes"] for c in later_cs], 0),
                },
            }  # fmt: skip
        per_phase[ph.name] = entry

    # Bytes: every snapshot after its query's first one (across restarts too).
    later = [r for r in rows if not r["first"]]
    up = sum(r["uploaded_bytes"] for r in later)
    new = sum(r["new_bytes"] for r in later)
    ratios = [r["uploaded_per_new_byte"] for r in later if r["uploaded_per_new_byte"] is not None]
    bytes_report = {
        "snapshots": len(rows), "after_first": len(later),
        "uploaded_bytes": up, "new_file_bytes": new,
        "uploaded_per_new_byte": {"aggregate": ratio(up, new, 4),
                                  "max": max(ratios, default=None),
                                  "median": round(median(ratios), 4) if ratios else None},
        "uploaded_per_new_content_byte": ratio(up, sum(r["new_content_bytes"] for r in later), 4),
        "duplicate_files": sum(r["duplicate_files"] for r in rows),
        "duplicate_bytes": sum(r["duplicate_bytes"] for r in rows),
        "index_bytes": spread([r["index_bytes"] for r in rows if r["index_bytes"]], 0),
        "pack_bytes_no_index_names": orphans,
        "first_snapshot": [{k: r[k] for k in ("query", "batch", "files", "cut_bytes",
                                             "uploaded_bytes", "requests")}
                           for r in rows if r["first"]],
        "metrics_at_stop": {label: info.get("metrics") for label, info in bench.processes.items()
                            if info["snapshots"]},
    }  # fmt: skip

    # Restarts: every process after the first with snapshots started over what an earlier one
    # stored; the last one is the explicit on → on restart.
    on_processes = [label for label, info in bench.processes.items() if info["snapshots"]]

    def restarted(labels: list[str]) -> dict[str, Any]:
        after = [r for r in rows if r["process"] in labels]
        out: dict[str, Any] = {
            "processes": labels,
            "snapshots": len(after),
            "uploaded_bytes": sum(r["uploaded_bytes"] for r in after),
            "new_file_bytes": sum(r["new_bytes"] for r in after),
            "new_content_bytes": sum(r["new_content_bytes"] for r in after),
            "duplicate_files": sum(r["duplicate_files"] for r in after),
            "duplicate_bytes": sum(r["duplicate_bytes"] for r in after),
            "first_after_restart": [{k: r[k] for k in ("query", "process", "batch", "files",
                                                      "new_files", "new_bytes", "uploaded_bytes",
                                                      "requests", "duration_s")}
                                    for r in after if r["first_of_process"]],
        }  # fmt: skip
        out["uploaded_per_new_byte"] = ratio(out["uploaded_bytes"], out["new_file_bytes"], 4)
        return out

    last = on_processes[-1]
    restart = {
        "explicit": restarted([last]),
        "every_restart": restarted(on_processes[1:]),
        "metrics_of_restarted_daemon": {
            k: v
            for k, v in (bench.processes[last].get("metrics") or {}).items()
            if "files_total" in k or "bytes_total" in k
        },
        "exit_codes": {label: info.get("exit_code") for label, info in bench.processes.items()},
    }

    # With snapshots ÷ without: per round (adjacent windows), and pooled.
    rounds = []
    for on_n, off_n in zip(on_windows, off_windows, strict=True):
        a_on, a_off = acks([on_n]), acks([off_n])
        s_on, s_off = spread(spark_ms([on_n]), 0), spread(spark_ms([off_n]), 0)
        rounds.append({"on": on_n, "off": off_n,
                       "ack_p50_ms": [a_on.get("p50_ms"), a_off.get("p50_ms")],
                       "ack_p99_ms": [a_on.get("p99_ms"), a_off.get("p99_ms")],
                       "spark_median_ms": [s_on["p50"], s_off["p50"]],
                       "spark_p90_ms": [s_on["p90"], s_off["p90"]],
                       "machine_cores": [phases[on_n].cores.get("machine"),
                                         phases[off_n].cores.get("machine")]})  # fmt: skip

    def paired(key: str) -> dict[str, float | None]:
        return paired_ratios([r[key][0] for r in rounds], [r[key][1] for r in rounds])

    ack_on, ack_off = acks(on_windows), acks(off_windows)
    spark_on, spark_off = spread(spark_ms(on_windows), 0), spread(spark_ms(off_windows), 0)
    on_off = {
        "rounds": rounds,
        "paired": {k: paired(k) for k in ("ack_p50_ms", "ack_p99_ms", "spark_median_ms",
                                          "spark_p90_ms")},
        "pooled": {
            "ack_latency_ms": {"on": ack_on, "off": ack_off,
                               "p50_ratio": ratio(ack_on.get("p50_ms"), ack_off.get("p50_ms")),
                               "p99_ratio": ratio(ack_on.get("p99_ms"), ack_off.get("p99_ms"))},
            "spark_batch_ms": {"on": spark_on, "off": spark_off,
                               "median_ratio": ratio(spark_on["p50"], spark_off["p50"]),
                               "p90_ratio": ratio(spark_on["p90"], spark_off["p90"])},
        },
        "sidecar_in_on_windows": sidecar(on_windows),
        "cores": {k: [phases[n].cores.get(k) for n in [*on_windows, *off_windows]]
                  for k in ("daemon", "azurite", "spark_jvm", "machine")},
    }  # fmt: skip

    # Why acks are slower with snapshots on: those that overlapped a snapshot under way
    # against the others, in the same windows; and the daemon's CPU per snapshot.
    spans = [(r["written_at"] - r["duration_s"], r["written_at"]) for r in rows
             if r["duration_s"] is not None]  # fmt: skip

    def acks_split(
        names: list[str], spans: list[tuple[float, float]]
    ) -> tuple[list[float], list[float]]:
        """The ack latencies (s) of windows ``names`` that met one of ``spans``, and the rest."""
        inside: list[float] = []
        outside: list[float] = []
        for n in names:
            if (c := phases[n].client) is not None:
                for at, ms in zip(c["scheduled_at"], c["latencies_ms"], strict=True):
                    (inside if overlapping(spans, at, at + ms / 1000) else outside).append(
                        ms / 1000
                    )
        return inside, outside

    during, between = acks_split(on_windows, spans)
    # Snapshots run right after Spark's batches, when the cores are busiest: acks while a Spark
    # batch runs and while none does, with snapshots on and off, tell the two apart.
    busy = [(p["start"], p["start"] + p["trigger_ms"] / 1000) for p in progress
            if p["trigger_ms"] is not None]  # fmt: skip
    by_spark: dict[str, dict[str, list[float]]] = {}
    for kind, names in (("on", on_windows), ("off", off_windows)):
        running, idle = acks_split(names, busy)
        by_spark[kind] = {"spark_running": running, "spark_idle": idle}
    # The same phase of Spark's cycle with snapshots off: acks within W of a commit (W: the
    # on windows' p90 backup lag, by which 9 snapshots in 10 are stored), on and off. What
    # the off side shows there is the commit's own cost (Spark's, the listener's posts).
    window_s = on_off["sidecar_in_on_windows"]["backup_lag"]["p90_s"] or 0.0
    after_commit = [(t, t + window_s) for q in commits.values() for t in q.values()]
    near_on, near_off = (latency_summary_ms(acks_split(names, after_commit)[0])
                         for names in (on_windows, off_windows))  # fmt: skip
    cores_on = [phases[n].cores.get("daemon") for n in on_windows]
    cores_off = [phases[n].cores.get("daemon") for n in off_windows]
    snaps_on = on_off["sidecar_in_on_windows"]["snapshots"]
    secs_on = sum(phases[n].end - phases[n].start for n in on_windows)
    secs_off = sum(phases[n].end - phases[n].start for n in off_windows)

    # The daemon's CPU per second with snapshots on, less that without, per snapshot.
    def per_snapshot_ms(key: str) -> float | None:
        if not (snaps_on and secs_on and secs_off):
            return None
        on = sum(phases[n].cpu_s.get(key, 0.0) for n in on_windows) / secs_on
        off = sum(phases[n].cpu_s.get(key, 0.0) for n in off_windows) / secs_off
        return round((on - off) * secs_on / snaps_on * 1000, 1)

    on_off["why"] = {
        "acks_during_a_snapshot": latency_summary_ms(during),
        "acks_between_snapshots": latency_summary_ms(between),
        "acks_after_a_commit": {"window_s": window_s, "on": near_on, "off": near_off,
                                "p99_ratio": ratio(near_on.get("p99_ms"), near_off.get("p99_ms"))},
        "acks_by_spark": {f"{kind}_{k}": latency_summary_ms(v)
                          for kind, split in by_spark.items() for k, v in split.items()},
        "share_of_time_in_snapshots": round(
            sum(min(b, phases[n].end) - max(a, phases[n].start) for n in on_windows
                for a, b in spans if a < phases[n].end and b > phases[n].start) / secs_on, 3),
        "daemon_cores_on_off": [cores_on, cores_off],
        # With its cut's worker process, and its own process alone (the event loop's share).
        "daemon_cpu_ms_per_snapshot": per_snapshot_ms("daemon"),
        "daemon_own_cpu_ms_per_snapshot": per_snapshot_ms("daemon_own"),
    }  # fmt: skip

    # The fleet model (bench/fleetmodel.py) with this run's growth per batch: one sidecar's
    # queries and 1,000 sidecars against one storage account, each way of copying.
    # Per batch, in the windows with snapshots on: the files a file-by-file copy sends, the
    # directory a full copy sends, and the sidecar's new bytes and index.
    would_send = on_off["sidecar_in_on_windows"]["a_copy_per_batch_would_send"]
    growth = CheckpointGrowth(
        label=f"{plan.keys:,} keys, {plan.rows:,} rows per batch, {plan.partitions} partitions, "
        "RocksDB with changelogs (measured by bench/snapshots.py)",
        new_files=would_send["file_by_file"]["p50"] or 0,
        new_bytes=median([r["new_bytes"] for r in later] or [0]),
        dir_files=int(would_send["full_copy"]["p50"] or 0),
        dir_bytes=would_send["full_copy_bytes"]["p50"] or 0,
        index_bytes=median([r["index_bytes"] for r in later if r["index_bytes"]] or [0]),
    )
    fleet = snapshot_fleet(growth, plan.queries, 1 / plan.trigger_s, drivers=1000)

    lag_on = on_off["sidecar_in_on_windows"]["backup_lag"]
    ack_ratio = on_off["paired"]["ack_p99_ms"]["ratio_median"]
    spark_ratio = on_off["paired"]["spark_median_ms"]["ratio_median"]
    failures = {k: v for m in bytes_report["metrics_at_stop"].values() if m
                for k, v in m.items() if "failures_total" in k and v}  # fmt: skip
    synthetic = restore["synthetic"]
    explicit = restart["explicit"]
    limit = TARGETS["uploaded_per_new_byte"]
    targets = {
        "backup_lag_p99_s": {
            "target": plan.trigger_s, "measured": lag_on["p99_s"], "windows": "on-*",
            "met": lag_on["p99_s"] is not None and lag_on["not_held"] == 0
            and lag_on["p99_s"] <= plan.trigger_s},
        "uploaded_per_new_byte_max": {
            "target": limit, "measured": bytes_report["uploaded_per_new_byte"]["max"],
            "met": (bytes_report["uploaded_per_new_byte"]["max"] or 0) <= limit},
        "no_content_uploaded_twice_across_restart": {
            "target": 0, "measured": bytes_report["duplicate_bytes"],
            "met": explicit["snapshots"] > 0 and bytes_report["duplicate_bytes"] == 0
            and (explicit["uploaded_per_new_byte"] or 0) <= limit},
        "ack_p99_on_over_off": {
            "target": TARGETS["ack_p99_on_over_off"], "measured": ack_ratio,
            "pooled": on_off["pooled"]["ack_latency_ms"]["p99_ratio"],
            "met": ack_ratio is not None and ack_ratio <= TARGETS["ack_p99_on_over_off"]},
        "spark_batch_median_on_over_off": {
            "target": TARGETS["spark_batch_median_on_over_off"], "measured": spark_ratio,
            "pooled": on_off["pooled"]["spark_batch_ms"]["median_ratio"], "goal_only": True,
            "met": spark_ratio is not None
            and spark_ratio <= TARGETS["spark_batch_median_on_over_off"]},
        "restore_over_sdk_download": {
            "target": TARGETS["restore_over_sdk_download"], "measured": synthetic["restore_vs_sdk"],
            "bytes": synthetic["bytes"],
            "met": synthetic["restore_vs_sdk"] >= TARGETS["restore_over_sdk_download"]},
        "no_unexpected_snapshot_failures": {
            "target": 0, "measured": failures, "met": not any("other" in k for k in failures)},
    }  # fmt: skip
    return {
        "environment": environment(["azure-storage-blob", "aiohttp", "pyspark"]),
        "plan": asdict(plan),
        "workload": {
            "spark": "PySpark local[2] in the bench's process, UI off, driver memory 2g",
            "query": f"rate-micro-batch ({plan.rows} rows/batch) → count by value % "
            f"{plan.keys} → noop, update mode",
            "state_store": "RocksDB, changelog checkpointing, Spark's other defaults",
            "trigger_s": plan.trigger_s,
            "shuffle_partitions": plan.partitions,
            "batches": {n: max(c, default=-1) for n, c in commits.items()},
            "checkpoint_at_end": {
                n: {"files": len(w := walk(loc)), "bytes": sum(s for s, _ in w.values())}
                for n, loc in bench.locations.items()
            },
            "open_loop": f"{plan.rate:g} updates/s of 10 other queries on one connection",
            "full_copy": f"every file, one Put Blob each, {plan.copy_concurrency} at a time per "
            "query, after each new commit (polled every 0.1 s)",
        },
        "targets": targets,
        "on_over_off": on_off,
        "phases": per_phase,
        "bytes": bytes_report,
        "fleet": fleet,
        "restart": restart,
        "restore": restore,
        "snapshots": [{k: v for k, v in r.items() if k != "snapshot"} for r in rows],
        "copies": copies,
    }


def run(plan: Plan, keep: bool) -> Report:
    with ExitStack() as cleanup:  # unwinds in reverse: Spark, daemon, Azurite, Redis, temp dir
        tmp = Path(tempfile.mkdtemp(prefix="cps-snap-", dir="/tmp"))
        if keep:
            print(f"  keeping {tmp}", flush=True)
        else:
            cleanup.callback(shutil.rmtree, tmp, ignore_errors=True)
        cpus = Cpus.of(plan.placement)
        pin(os.getpid(), cpus.spark)  # what it starts too: Spark's JVM, Azurite, the copier
        redis = cleanup.enter_context(RedisServer())
        pin(redis.pid, cpus.sidecar)
        azurite = cleanup.enter_context(Azurite(debug_log=False))
        if plan.store_nice and azurite.pid is not None:
            for task in Path(f"/proc/{azurite.pid}/task").iterdir():  # nice is per thread
                os.setpriority(os.PRIO_PROCESS, int(task.name), plan.store_nice)
        bench = Bench(plan, tmp, redis, azurite, cpus)
        cleanup.callback(bench.kill_daemon)
        cleanup.callback(lambda: bench.spark.stop() if bench.spark is not None else None)
        bench.run()
        progress = bench.stop_spark()
        commits = bench.commit_times()
        report_dirs = bench.locations
        bench.stop_daemon()
        bench.spark.stop()
        bench.spark = None
        for pid in (os.getpid(), azurite.pid):  # the restores below: on every CPU again
            pin(pid, cpus.every)
        qids = [str(q.id) for q in bench.queries]
        cs, port = azurite.connection_string, azurite.port
        stored = anyio.run(stored_snapshots, cs, qids)
        newest = max(stored[qids[0]]["indexes"], key=lambda i: (i.batch, i.created_at))
        (tmp / "restore-real").mkdir()
        (tmp / "restore-synthetic").mkdir()
        print("  restore ...", flush=True)
        restore = {
            "real": anyio.run(restore_real, cs, port, newest, tmp / "restore-real",
                              plan.restore_rounds),
            "synthetic": anyio.run(restores, port, tmp / "restore-synthetic", plan.restore_mib,
                                   plan.restore_rounds, 8),
        }  # fmt: skip
        del report_dirs
        return analyse(bench, progress, commits, stored, restore)
    raise AssertionError("unreachable")


def show(report: Report) -> None:
    p, ph = report["plan"], report["phases"]
    print(f"\nsnapshots end to end: {p['queries']} queries x {p['partitions']} partitions x "
          f"{p['keys']:,} keys (RocksDB, changelog), {p['rows']:,} rows/batch, trigger "
          f"{p['trigger_s']:g} s, placement {p.get('placement', 'shared')}; load avg before "
          f"{report['loadavg_1min_before']}")  # fmt: skip
    print(
        f"  {'phase':<17}{'s':>5}{'batches':>8}{'spark p50/p90 ms':>18}{'ack p50/p99 ms':>17}"
        f"{'lag p50/p99/max s':>20}{'req/snap':>9}  cores: daemon azurite spark machine"
    )
    for name, e in ph.items():
        sp, c = e["spark_batch_ms"], e["cores"]
        ack = e.get("ack_latency")
        lag = e.get("sidecar", {}).get("backup_lag")
        req = e.get("sidecar", {}).get("requests_per_snapshot", {}).get("p50")
        spark = f"{sp['p50']}/{sp['p90']}"
        acks = f"{ack['p50_ms']}/{ack['p99_ms']}" if ack else ""
        lags = f"{lag['p50_s']}/{lag['p99_s']}/{lag['max_s']}" if lag else ""
        cores = " ".join(str(c.get(k, "-")) for k in ("daemon", "azurite", "spark_jvm", "machine"))
        print(f"  {name:<17}{e['seconds']:>5.0f}{e['batches_committed']:>8}{spark:>18}"
              f"{acks:>17}{lags:>20}{req if req is not None else '':>9}  {cores}")  # fmt: skip
        if "full_copy" in e:
            fc = e["full_copy"]
            lag, fbf = fc["backup_lag"], fc["file_by_file"]
            lags = f"{lag['p50_s']}/{lag['p99_s']}/{lag['max_s']}"
            print(f"  {'  full copy':<17}{'':>5}{fc['copies']:>8} copies{'':>29}{lags:>20}"
                  f"{fc['requests_per_copy']['p50']:>9}  (cpu {fc['cpu_s']} s)")  # fmt: skip
            print(f"    requests per batch: sidecar {e['sidecar']['requests_per_batch']}, full "
                  f"copy {fc['requests_per_batch']}, file by file {fbf['requests_per_batch']} "
                  f"({fbf['requests_per_copy']['p50']} per copy)")  # fmt: skip
    oo = report["on_over_off"]
    for r in oo["rounds"]:
        print(
            f"  {r['on']} / {r['off']}: ack p99 {r['ack_p99_ms']} ms, spark median "
            f"{r['spark_median_ms']} ms, machine cores {r['machine_cores']}"
        )
    pa, po = oo["paired"], oo["pooled"]
    print(
        f"  on / off, median of rounds (pooled): ack p50 x{pa['ack_p50_ms']['ratio_median']} "
        f"(x{po['ack_latency_ms']['p50_ratio']}), p99 x{pa['ack_p99_ms']['ratio_median']} "
        f"(x{po['ack_latency_ms']['p99_ratio']}); spark median "
        f"x{pa['spark_median_ms']['ratio_median']} (x{po['spark_batch_ms']['median_ratio']}), "
        f"p90 x{pa['spark_p90_ms']['ratio_median']} (x{po['spark_batch_ms']['p90_ratio']})"
    )
    sc, why = oo["sidecar_in_on_windows"], oo["why"]
    would = sc["a_copy_per_batch_would_send"]
    print(f"  on windows: {sc['snapshots']} snapshots, requests per snapshot "
          f"{sc['requests_per_snapshot']['p50']} (per batch {sc['requests_per_batch']}); a copy "
          f"after each batch would send: file by file {would['file_by_file']['p50']}, full "
          f"{would['full_copy']['p50']} (medians)")  # fmt: skip
    print(f"  acks during a snapshot {why['acks_during_a_snapshot']}, between "
          f"{why['acks_between_snapshots']}; {why['share_of_time_in_snapshots']} of the time in "
          f"snapshots; daemon cores on/off {why['daemon_cores_on_off']}, "
          f"~{why['daemon_cpu_ms_per_snapshot']} ms CPU per snapshot, "
          f"~{why['daemon_own_cpu_ms_per_snapshot']} ms of it in its own process")  # fmt: skip
    for key, lat in why["acks_by_spark"].items():
        print(f"    acks {key}: {lat}")
    near = why["acks_after_a_commit"]
    print(f"    acks within {near['window_s']} s of a commit: on {near['on']}, off {near['off']} "
          f"(p99 x{near['p99_ratio']})")  # fmt: skip
    b = report["bytes"]
    print(f"  bytes uploaded / new: {b['uploaded_per_new_byte']} over {b['after_first']} "
          f"snapshots; index bytes {b['index_bytes']}; duplicates {b['duplicate_bytes']} B; "
          f"packs no index names {b['pack_bytes_no_index_names']}")  # fmt: skip
    for kind in ("explicit", "every_restart"):
        r = report["restart"][kind]
        print(f"  restart ({kind}): {r['snapshots']} snapshots, uploaded {r['uploaded_bytes']:,} "
              f"B for {r['new_file_bytes']:,} B new ({r['uploaded_per_new_byte']}), "
              f"duplicates {r['duplicate_bytes']} B")  # fmt: skip
    f = report["fleet"]
    for how, t in f["per_sidecar"].items():
        req, ing = f["requests"][how], f["ingress"][how]
        print(f"  fleet ({how}): {t['requests_per_s']:,} requests/s and "
              f"{t['bytes_per_s'] / 1e6:,.2f} MB/s per sidecar; one account carries "
              f"{req['sidecars_per_unit']:,} sidecars by requests, {ing['sidecars_per_unit']:,} "
              f"by ingress")  # fmt: skip
    for kind, res in report["restore"].items():
        print(f"  restore ({kind}): {res['bytes'] / MiB:.0f} MiB in {res['files']} files: "
              f"{res['restore_mib_s']} vs SDK {res['sdk_download_mib_s']} MiB/s "
              f"(x{res['restore_vs_sdk']})")  # fmt: skip
    for name, t in report["targets"].items():
        print(f"  target {name}: {'met' if t['met'] else 'MISSED'} ({t['measured']} vs "
              f"{t['target']})")  # fmt: skip


def ok(report: Report) -> bool:
    """Only the deterministic outcomes fail the run: bytes, duplicates, a snapshot's bug."""
    t = report["targets"]
    return all(t[k]["met"] for k in ("uploaded_per_new_byte_max",
                                     "no_content_uploaded_twice_across_restart",
                                     "no_unexpected_snapshot_failures"))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="~3 min: smaller, shorter")
    for f in Plan.__dataclass_fields__.values():
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(
            flag,
            type=type(f.default),
            default=None,
            help=f"default {f.default} ({getattr(QUICK, f.name)} with --quick)",
        )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, data)")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--role", help=argparse.SUPPRESS)  # internal: client, copier
    parser.add_argument("cfg", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        role = {"client": client_role, "copier": copier_role}[args.role]
        print("RESULT " + json.dumps(role(json.loads(args.cfg))), flush=True)
        return 0
    plan = QUICK if args.quick else Plan()
    plan = replace(plan, **{k: v for k in Plan.__dataclass_fields__
                            if (v := getattr(args, k)) is not None})  # fmt: skip
    # A run pinned or with the store niced is an experiment beside the reference: its own
    # results file.
    name = (
        "snapshots"
        + (f"-{plan.placement}" if plan.placement != "shared" else "")
        + (f"-store-nice-{plan.store_nice}" if plan.store_nice else "")
    )
    return bench_main(name, lambda: run(plan, args.keep), show, ok, save=not args.no_save)


if __name__ == "__main__":
    sys.exit(main())
