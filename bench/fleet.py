"""Fleet benchmark: what N sidecars cost one Redis and one storage account, per sidecar, by
command and by kind of request, and what 1,000 drivers would cost.

Starts ONE redis-server (append-only, as production should run it) and ONE Azurite behind a
counting HTTP proxy (``bench/store_counter.py``), then per case N daemon processes
(``tests.services.DaemonProcess``: one namespace each, as one Spark application per driver;
one shared container; default settings unless the case says otherwise) and drives them as N
Spark drivers would: per sidecar ``--queries`` queries on one connection (the JVM listener's
one socket), each posting one Kafka-shaped micro-batch progress (``--partitions``
partitions, ``tests.sparkshapes.kafka_progress``) every ``--batch-interval-s``, the fleet's
posts spread evenly over the interval; and ``GET /readyz`` of every daemon every
``--readyz-every-s`` (the deploy manifests' readiness probe; 0: never).

Measured per case, per sidecar per second:

* **idle** (``--idle-s``, the default-settings cases): the daemons started, no query yet;
* **loaded**: after a warm-up (``--warmup-s``, and at least the time threshold plus a
  lease renewal interval, so that every query has flushed and renewed once: no first lease
  acquisition or blob read inside the window), a window of ``--window-s``
  (``--alt-window-s`` for the alternatives, whose flushes are rarer).

In each window: Redis ``INFO commandstats`` deltas (every command, those run inside scripts
included) and redis-server's CPU (``/proc``, less its own rate with no daemon,
``--baseline-s``); blob requests by kind and operation, counted by the proxy; the daemons'
CPU. Then an attribution sub-window (``--attribution-s``) with SLOWLOG logging every
command: the commands sent, EVALSHA by script (its sha -> the script of
``sidecar.buffer.lua``), apart from those the scripts run (their client is ``?:0``). It
never overlaps the window above: logging every command costs Redis CPU.

Last, with no daemon left: one sidecar's Redis traffic replayed back to back through the
daemon's own ``RedisBuffer`` (``--replay-sidecar-seconds``), for Redis' CPU per
sidecar-second when commands come densely, as on a busy node; and ``redis-benchmark`` (SET,
1-KB values, 50 clients) for what this machine's redis-server does with simple commands, the
way the published figures are taken.

The extrapolation to ``--drivers`` drivers (``bench/fleetmodel.py``): Redis round trips
against published per-node figures, and Redis' CPU per sidecar against one core; storage
transactions against a storage account's and a blob's published targets. A model of the
rates from the settings is checked against the measurement, and the alternative settings
(``--alt``, at ``--alt-sidecars`` sidecars) are shown as ratios to the defaults at that size.

Results: ``bench/results/fleet.json``; a markdown summary is printed. Exit code 1 when a
daemon exits or a service fails.

    python bench/fleet.py                                        # ~17 min
    python bench/fleet.py --sizes 2 --idle-s 10 --window-s 20 --no-alt --no-save  # smoke
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import anyio
import msgspec
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from bench.common import (
    RESULTS_DIR,
    BenchError,
    Report,
    bench_main,
    cpu_seconds,
    environment,
    outcome,
    redis_version,
    rss_kib,
)
from bench.fleetmodel import (
    REDIS_CORE,
    REDIS_LIMITS,
    REDIS_PURPOSES,
    SINGLE_BLOB,
    STORAGE_ACCOUNT,
    STORE_KINDS,
    Cadence,
    Limit,
    Settings,
    behind_s,
    by_kind,
    extrapolate,
    markdown_table,
    model_rates,
    per_second,
    script_shas,
    sent_key,
)
from bench.store_counter import CountingProxy
from sidecar.buffer import lua
from sidecar.buffer.redis_buffer import RedisBuffer
from sidecar.config import Config
from sidecar.daemon.durability import CHECK_INTERVAL_S
from sidecar.flush.flusher import THRESHOLD_JITTER
from sidecar.model import checkpoint as ckpt
from sidecar.ops.client import SidecarClient
from tests.services import Azurite, DaemonProcess, RedisServer
from tests.sparkshapes import kafka_progress

RESULTS_PATH = RESULTS_DIR / "fleet.json"
CONTAINER = "fleet"
#: After the daemons are ready, before the idle window: their start-up calls (container,
#: listing, marker) are over.
SETTLE_S = 5.0
#: How long N daemons may take to start together on a small shared machine.
START_TIMEOUT_S = 240.0
#: Commands the bench itself sends (sampling, SLOWLOG) or a connection's handshake: not
#: the daemons' steady cost.
HARNESS_COMMANDS = ("info", "hello", "client|setinfo", "client|setname", "select", "config",
                    "config|set", "slowlog", "slowlog|get", "slowlog|reset")  # fmt: skip
#: Entries SLOWLOG keeps during the attribution window (20 sidecars: ~2,500 commands/s,
#: those of the scripts included).
SLOWLOG_MAX_LEN = 200_000
CADENCE = Cadence(
    durability_check_s=CHECK_INTERVAL_S,
    threshold_jitter=THRESHOLD_JITTER,
)
DEFAULT_ALTS = (
    "SIDECAR_TIME_THRESHOLD_S=60",
    "SIDECAR_TIME_THRESHOLD_S=60,SIDECAR_LEASE_DURATION_S=60,SIDECAR_FLUSH_INTERVAL_S=5",
)
SCRIPTS = {
    "apply": lua.APPLY,
    "pending": lua.PENDING,
    "snapshot": lua.SNAPSHOT,
    "mark_flushed": lua.MARK_FLUSHED,
    "reset": lua.RESET,
    "retire": lua.RETIRE,
}


def default_settings() -> Settings:
    """The daemon's own defaults (``sidecar.config.Config``) for the settings the model uses."""
    defaults = {f.name: f.default for f in msgspec.structs.fields(Config)}
    return Settings(**{f.name: defaults[f.name] for f in fields(Settings)})


def settings_of(env: dict[str, str]) -> Settings:
    """The model's settings for a daemon environment (``SIDECAR_TIME_THRESHOLD_S`` ->
    ``time_threshold_s``); the defaults for the rest."""
    base = default_settings()
    out: dict[str, Any] = {}
    for f in fields(Settings):
        raw = env.get(f"SIDECAR_{f.name.upper()}")
        if raw is not None:
            out[f.name] = type(getattr(base, f.name))(raw)
    return replace(base, **out)


def parse_settings(text: str) -> dict[str, str]:
    """``SIDECAR_A=1,SIDECAR_B=2`` -> a dict (empty text: none)."""
    pairs = [p.strip() for p in text.split(",") if p.strip()]
    out = dict(p.split("=", 1) for p in pairs)
    if any(not k.startswith("SIDECAR_") for k in out):
        raise SystemExit(f"settings are SIDECAR_X=value pairs, got {text!r}")
    return out


def query_id(case: int, sidecar: int, query: int) -> str:
    return f"f1ee7{case:03x}-{sidecar:04x}-4000-8000-{query:012x}"


# --- what Redis and the store saw ----------------------------------------------------------


@dataclass
class Sample:
    at: float
    calls: Counter[str]
    usec: Counter[str]
    store: Counter[tuple[str, str]]
    store_failed: Counter[tuple[str, str]]
    redis_cpu_s: float
    daemons_cpu_s: float
    load: Counter[str]


@dataclass
class Bench:
    """The services every case shares."""

    redis_server: RedisServer
    r: redis.Redis
    proxy: CountingProxy
    tmp: Path
    #: redis-server's own CPU with no daemon (cores): cron, AOF; left out of per sidecar.
    redis_baseline_cores: float = 0.0
    #: EVALSHA's sha -> the script's name in ``sidecar.buffer.lua``.
    shas: dict[str, str] = field(default_factory=lambda: script_shas(SCRIPTS))

    def sample(self, daemons: list[DaemonProcess], load: Counter[str]) -> Sample:
        calls, usec = self.commandstats()
        store, failed = self.proxy.counts()
        assert self.redis_server.pid is not None
        return Sample(
            at=time.monotonic(),
            calls=calls,
            usec=usec,
            store=store,
            store_failed=failed,
            redis_cpu_s=cpu_seconds(self.redis_server.pid),
            daemons_cpu_s=sum(cpu_seconds(d.pid) for d in daemons),
            load=Counter(load),
        )

    def redis_cpu_s(self) -> float:
        assert self.redis_server.pid is not None
        return cpu_seconds(self.redis_server.pid)

    async def attributed(self, seconds: float, sidecars: int) -> Report:
        """The commands the daemons send and those their scripts run, per sidecar per
        second over ``seconds`` of SLOWLOG logging every command (threshold 0): EVALSHA by
        script, a script's own commands told by their client (``?:0``, the script's)."""
        old = await anyio.to_thread.run_sync(self._slowlog, {
            "slowlog-max-len": str(SLOWLOG_MAX_LEN), "slowlog-log-slower-than": "0"})  # fmt: skip
        try:
            t0 = time.monotonic()
            await anyio.sleep(seconds)
            entries = await anyio.to_thread.run_sync(self.r.slowlog_get, SLOWLOG_MAX_LEN)
            s = time.monotonic() - t0
        finally:
            await anyio.to_thread.run_sync(self._slowlog, old)
        top: Counter[str] = Counter()
        ran: Counter[str] = Counter()
        for e in entries:
            key = sent_key(e["command"], self.shas)
            if key.split(" ", 1)[0] in HARNESS_COMMANDS:
                continue
            if e["client_address"] in (b"?:0", "?:0"):
                ran[key] += 1
            else:
                top[key] += 1
        if len(entries) >= SLOWLOG_MAX_LEN:
            raise BenchError("SLOWLOG filled up: lower --attribution-s")
        return {
            "seconds": round(s, 2),
            "top_level_per_s": round(top.total() / s / sidecars, 3),
            "in_scripts_per_s": round(ran.total() / s / sidecars, 3),
            "top_level": per_second(dict(top), s, sidecars),
            "in_scripts": per_second(dict(ran), s, sidecars),
        }

    def _slowlog(self, settings: dict[str, str]) -> dict[str, str]:
        """Set SLOWLOG's settings and empty it; the settings it had."""
        old = {str(k): str(v) for k, v in self.r.config_get("slowlog-*").items()}
        for name, value in settings.items():
            self.r.config_set(name, value)
        self.r.slowlog_reset()
        return old

    def commandstats(self) -> tuple[Counter[str], Counter[str]]:
        """(calls, usec) by command, the bench's own left out."""
        calls: Counter[str] = Counter()
        usec: Counter[str] = Counter()
        for key, v in self.r.info("commandstats").items():
            name = key.removeprefix("cmdstat_")
            if name not in HARNESS_COMMANDS:
                calls[name], usec[name] = int(v["calls"]), int(v["usec"])
        return calls, usec


def window(a: Sample, b: Sample, sidecars: int, baseline_cores: float) -> Report:
    """What one sidecar cost per second between two samples."""
    s = b.at - a.at
    calls, usec = b.calls - a.calls, b.usec - a.usec
    ops = b.store - a.store
    per_op = per_second({op: float(n) for (_, op), n in ops.items()}, s, sidecars)
    kinds = {op: kind for (kind, op) in b.store}
    load = b.load - a.load
    redis_cpu = b.redis_cpu_s - a.redis_cpu_s
    return {
        "seconds": round(s, 2),
        "redis": {
            "all_commands_per_s": round(calls.total() / s / sidecars, 3),
            "commandstats": per_second(dict(calls), s, sidecars),
            "commandstats_usec": per_second(dict(usec), s, sidecars),
            "cpu_ms_per_s": round(max(0.0, redis_cpu / s - baseline_cores) / sidecars * 1e3, 3),
            "cpu_ms_per_s_with_baseline": round(redis_cpu / s / sidecars * 1e3, 3),
        },
        "store": {
            "per_s": by_kind(per_op, kinds),
            "by_operation": per_op,
            "failed": per_second(
                {op: float(n) for (_, op), n in (b.store_failed - a.store_failed).items()},
                s,
                sidecars,
            ),
        },
        "daemon_cpu_ms_per_s": round((b.daemons_cpu_s - a.daemons_cpu_s) / s / sidecars * 1e3, 2),
        "load": {
            "updates_per_s": round(load["sent"] / s / sidecars, 3),
            "counts": dict(sorted((k, v) for k, v in load.items() if k != "sent")),
            "posts_late_over_100ms": load["late"],
        },
    }


# --- one case: N daemons, idle then loaded ---------------------------------------------------


@dataclass
class Case:
    label: str
    sidecars: int
    settings: dict[str, str]
    idle_s: float
    window_s: float
    index: int = 0
    warmup_s: float = 0.0
    query_ids: list[list[str]] = field(default_factory=list)


class Load:
    """The drivers: per sidecar one connection, its queries posting on an even schedule."""

    def __init__(self, args: argparse.Namespace, case: Case) -> None:
        self.args, self.case = args, case
        self.counts: Counter[str] = Counter()

    async def drive(self, i: int, socket_path: str, start: float) -> None:
        n, q, every = self.case.sidecars, self.args.queries, self.args.batch_interval_s
        ids = self.case.query_ids[i]
        # query j of sidecar i posts at start + phase + b * every: the fleet's posts spread
        # evenly over the interval, each sidecar's own 1/q of it apart
        phases = [(j * n + i) / (n * q) * every for j in range(q)]
        async with await SidecarClient.connect(socket_path) as client:
            for batch in itertools.count():
                for j in range(q):
                    due = start + phases[j] + batch * every
                    await anyio.sleep(max(0.0, due - time.monotonic()))
                    if time.monotonic() - due > 0.1:
                        self.counts["late"] += 1
                    progress = kafka_progress(
                        ids[j], batch, partitions=self.args.partitions, name=f"q{j:02d}"
                    )
                    self.counts["sent"] += 1
                    self.counts[outcome(await client.progress(progress))] += 1

    async def probe(self, daemon: DaemonProcess, phase: float) -> None:
        """``GET /readyz`` every ``--readyz-every-s``, as a kubelet's readiness probe."""
        every = self.args.readyz_every_s
        await anyio.sleep(phase)
        while True:
            with anyio.CancelScope(shield=True):  # a cancelled wait would outlive its thread
                answer = await anyio.to_thread.run_sync(daemon.readyz)
            self.counts[f"readyz {answer[0] if answer else 'none'}"] += 1
            await anyio.sleep(every)


async def measure_case(
    bench: Bench, args: argparse.Namespace, case: Case, daemons: list[DaemonProcess]
) -> Report:
    load = Load(args, case)
    out: Report = {"idle": None}

    async def sample() -> Sample:
        return await anyio.to_thread.run_sync(bench.sample, daemons, load.counts)

    async with anyio.create_task_group() as tg:
        if args.readyz_every_s > 0:
            for i, d in enumerate(daemons):
                tg.start_soon(load.probe, d, i / len(daemons) * args.readyz_every_s)
        await anyio.sleep(SETTLE_S)
        n, base = case.sidecars, bench.redis_baseline_cores
        if case.idle_s > 0:
            a = await sample()
            await anyio.sleep(case.idle_s)
            out["idle"] = window(a, await sample(), n, base)
            out["idle"]["redis"]["sent"] = await bench.attributed(case.idle_s / 2, n)
        start = time.monotonic() + 0.5
        for i, d in enumerate(daemons):
            tg.start_soon(load.drive, i, d.socket_path, start)
        await anyio.sleep(start + case.warmup_s - time.monotonic())
        a = await sample()
        await anyio.sleep(case.window_s)
        out["loaded"] = window(a, await sample(), n, base)
        out["loaded"]["redis"]["sent"] = await bench.attributed(args.attribution_s, n)
        tg.cancel_scope.cancel()
    return out


def run_case(bench: Bench, args: argparse.Namespace, case: Case) -> Report:
    env_base = {
        "SIDECAR_REDIS_URL": bench.redis_server.url,
        "SIDECAR_METRICS_HOST": "127.0.0.1",
        "SIDECAR_LOG_LEVEL": "WARNING",
        "SIDECAR_CONTAINER": CONTAINER,
        "AZURE_STORAGE_CONNECTION_STRING": bench.proxy.connection_string(),
        **parse_settings(",".join(args.setting)),
        **case.settings,
    }
    s = settings_of(env_base)
    # every query flushed and renewed its lease once before the window
    case.warmup_s = max(
        args.warmup_s, s.time_threshold_s + s.flush_interval_s + s.lease_duration_s / 3 * 1.25 + 5
    )
    case.query_ids = [
        [query_id(case.index, i, j) for j in range(args.queries)] for i in range(case.sidecars)
    ]
    logs = [bench.tmp / f"c{case.index}-d{i}.log" for i in range(case.sidecars)]
    daemons = [
        DaemonProcess(
            {
                **env_base,
                "SIDECAR_NAMESPACE": f"fleet-{case.index}-{i:03d}",
                "SIDECAR_SOCKET_PATH": str(bench.tmp / f"c{case.index}-{i}.sock"),
            },
            logs[i],
        )
        for i in range(case.sidecars)
    ]
    t0 = time.monotonic()
    print(f"[fleet] {case.label}: starting {case.sidecars} daemon(s) ...", flush=True)
    try:
        with ThreadPoolExecutor(case.sidecars) as pool:
            list(pool.map(lambda d: d.start(timeout_s=START_TIMEOUT_S), daemons))
        started_s = time.monotonic() - t0
        print(
            f"[fleet] {case.label}: ready in {started_s:.1f}s; idle {case.idle_s:g}s, "
            f"warm-up {case.warmup_s:g}s, window {case.window_s:g}s",
            flush=True,
        )
        measured = anyio.run(measure_case, bench, args, case, daemons)
        dead = [i for i, d in enumerate(daemons) if not d.running]
        if dead:
            raise BenchError(f"daemon(s) {dead} exited; log:\n{daemons[dead[0]].log()[-2000:]}")
        rss = max(rss_kib(d.pid) for d in daemons) / 1024
    finally:
        with ThreadPoolExecutor(case.sidecars) as pool:
            list(pool.map(lambda d: d.proc is not None and d.stop(timeout_s=30), daemons))
    warnings = [
        ln
        for p in logs
        if p.exists()
        for ln in p.read_text(errors="replace").splitlines()
        if " WARNING " in ln or " ERROR " in ln
    ]
    rate = 1 / args.batch_interval_s
    models = [
        model_rates(ids, rate, s, CADENCE, readyz_every_s=args.readyz_every_s)
        for ids in case.query_ids
    ]
    model = {
        k: {m: round(sum(x[k][m] for x in models) / len(models), 4) for m in v}
        for k, v in models[0].items()
    }
    idle_model = model_rates([], rate, s, CADENCE, readyz_every_s=args.readyz_every_s)
    return {
        "label": case.label,
        "sidecars": case.sidecars,
        "settings": case.settings,
        "model_settings": {f.name: getattr(s, f.name) for f in fields(Settings)},
        "started_in_s": round(started_s, 1),
        "warmup_s": case.warmup_s,
        "daemon_rss_mib_max": round(rss, 1),
        **measured,
        "model_per_sidecar": {"loaded": model, "idle": idle_model},
        "model_behind_s": round(behind_s(s, rate), 2),
        "daemon_warnings": len(warnings),
        "daemon_warnings_first": warnings[:3],
        "case_seconds": round(time.monotonic() - t0, 1),
    }


# --- Redis' CPU per sidecar-second when its commands come densely ----------------------------


async def replay(bench: Bench, args: argparse.Namespace, sidecar_seconds: int) -> Report:
    """One sidecar's Redis traffic, second by second, sent back to back on one connection
    through the daemon's own ``RedisBuffer`` (its scripts, its arguments): per second 10
    applies (one per query, a new batch each), a flush check, half a snapshot of the due
    rows, one mark per flush, a marker read and a tenth of a
    readiness write: the mix the fleet measured. Redis' CPU per sidecar-second here is
    what a busy node pays (warm caches, commands close together); in the fleet the same
    commands come a few hundred a second and cost more each."""
    q = args.queries
    ids = [query_id(0xFFF, 0, j) for j in range(q)]
    rows = [[ckpt.from_progress(msgspec.json.decode(msgspec.json.encode(kafka_progress(
        qid, batch, partitions=args.partitions, name=f"q{j:02d}")), type=ckpt.SparkProgress))
        for j, qid in enumerate(ids)] for batch in range(sidecar_seconds)]  # fmt: skip
    buf = RedisBuffer(bench.redis_server.url, "fleet-replay")
    try:
        await buf.set_marker("replay")
        trips, cpu0, t0 = 0, bench.redis_cpu_s(), time.monotonic()
        for sec, checkpoints in enumerate(rows):
            for c in checkpoints:
                await buf.apply([c], [lua.NO_BLOB])
            await buf.pending()
            trips += q + 2
            if sec % 2:  # a flush pass every other check, two queries due in it
                due = await buf.snapshot([ids[sec % q], ids[(sec + 1) % q]], only=True)
                for pq in due.queries:
                    await buf.mark_flushed(pq, pq.batch_id, None)
                trips += 1 + len(due.queries)
            await buf.marker()
            if sec % 10 == 0:
                await buf.ping()
                trips += 1
        wall = time.monotonic() - t0
        cpu = bench.redis_cpu_s() - cpu0 - bench.redis_baseline_cores * wall
    finally:
        await buf.aclose()
    return {
        "sidecar_seconds": sidecar_seconds,
        "round_trips": trips,
        "wall_s": round(wall, 2),
        "round_trips_per_s": round(trips / wall),
        "redis_cpu_us_per_s": round(cpu / sidecar_seconds * 1e6, 1),
        "redis_cpu_us_per_round_trip": round(cpu / trips * 1e6, 1),
    }


def redis_benchmark(bench: Bench, requests: int) -> Report | None:
    """This machine's redis-server at simple commands, as the published figures are taken:
    ``redis-benchmark -t set -d 1024`` (50 clients, no pipelining); SET/s and Redis' CPU per
    SET. None when redis-benchmark is not installed."""
    binary = shutil.which("redis-benchmark")
    if binary is None or requests <= 0:
        return None
    cpu0 = bench.redis_cpu_s()
    out = subprocess.run(
        [binary, "-p", str(bench.redis_server.port), "-t", "set", "-d", "1024", "-n",
         str(requests), "-q"], capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    cpu = bench.redis_cpu_s() - cpu0
    m = re.search(r"SET: ([\d.]+) requests per second", out.stdout.replace("\r", "\n"))
    return {
        "command": f"redis-benchmark -t set -d 1024 -n {requests} -q",
        "set_per_s": float(m.group(1)) if m else None,
        "redis_cpu_us_per_set": round(cpu / requests * 1e6, 2),
    }


# --- the summary ------------------------------------------------------------------------------


def extrapolation(
    case: Report, drivers: int, replay: Report | None, simple: Report | None
) -> list[Report]:
    """Rows: what the fleet's per-sidecar rates make at ``drivers`` drivers, per limit.
    Redis: its round trips against the published per-node figures; its CPU per
    sidecar-second (the replay) against one core, and in 1-KB SETs' worth (that CPU over
    this machine's CPU per SET, both measured with commands close together) against the
    published figures, which are SET/GET rates."""
    loaded = case["loaded"]
    redis_, store = loaded["redis"], loaded["store"]["per_s"]
    trips = redis_["sent"]["top_level_per_s"]
    per_blob = (store["total"] - store["other"]) / case["queries"]
    rows: list[Report] = []

    def row(what: str, per_sidecar: float, limit: Limit) -> None:
        rows.append({
            "what": what, "per_sidecar_per_s": round(per_sidecar, 3), "limit": limit.name,
            "limit_per_s": limit.per_s, "source": limit.source,
            **extrapolate(per_sidecar, drivers, limit),
        })  # fmt: skip

    for limit in REDIS_LIMITS:
        row("Redis commands sent (round trips)", trips, limit)
    if replay is not None and simple is not None and simple["redis_cpu_us_per_set"]:
        sets = replay["redis_cpu_us_per_s"] / simple["redis_cpu_us_per_set"]
        for limit in REDIS_LIMITS:
            row("Redis load in 1-KB SETs' worth of CPU", sets, limit)
    if replay is not None:
        row("Redis CPU µs per s (replayed)", replay["redis_cpu_us_per_s"], REDIS_CORE)
    row("storage transactions", store["total"], STORAGE_ACCOUNT)
    rows.append(
        {
            "what": "requests per query blob",
            "per_blob_per_s": round(per_blob, 4),
            "limit": SINGLE_BLOB.name,
            "limit_per_s": SINGLE_BLOB.per_s,
            "source": SINGLE_BLOB.source,
            "share_of_limit": round(per_blob / SINGLE_BLOB.per_s, 6),
        }
    )
    return rows


def fmt(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}" if x < 10 else f"{x:.1f}"


def show(report: Report) -> None:
    cases, drivers = report["cases"], report["drivers"]
    print(f"\nfleet bench: {report['workload']}; load avg {report['loadavg']}")
    print("\nPer sidecar per second (store: counting proxy; Redis: commandstats, SLOWLOG):\n")
    rows = []
    for c in cases:
        for phase in ("idle", "loaded"):
            if w := c.get(phase):
                st, rd = w["store"]["per_s"], w["redis"]
                rows.append([
                    f"{c['label']}, N={c['sidecars']}, {phase}",
                    *(fmt(st[k]) for k in (*STORE_KINDS, "total")),
                    fmt(rd["sent"]["top_level_per_s"]), fmt(rd["all_commands_per_s"]),
                    fmt(rd["cpu_ms_per_s"]), fmt(w["daemon_cpu_ms_per_s"]),
                ])  # fmt: skip
    header = ["case", "store write", "lease", "read", "other", "store total", "Redis cmds sent",
              "Redis cmds incl. in scripts", "Redis CPU ms/s", "daemon CPU ms/s"]  # fmt: skip
    print(markdown_table(header, rows))
    ref = cases[report["reference_case"]]
    measured, model = ref["loaded"], ref["model_per_sidecar"]["loaded"]
    print(f"\nRedis commands sent per sidecar per second ({ref['label']}, N={ref['sidecars']}; "
          "model from the settings):\n")  # fmt: skip
    top = measured["redis"]["sent"]["top_level"]
    print(markdown_table(["command", "per s", "model", "what for"], [
        [k, fmt(v), fmt(model["redis"].get(k, 0.0)), REDIS_PURPOSES.get(k, "")]
        for k, v in top.items()]))  # fmt: skip
    queries = report["workload"]["queries_per_sidecar"]
    print(f"\nExtrapolated to {drivers:,} drivers x {queries} queries:\n")
    ext = []
    for r in report["extrapolation"]:
        blob = "per_blob_per_s" in r
        ext.append([
            r["what"], fmt(r["per_blob_per_s"] if blob else r["per_sidecar_per_s"]),
            "—" if blob else f"{r['fleet_per_s']:,.0f}",
            f"{r['limit']} ({r['limit_per_s']:,.0f}/s)",
            f"{r['share_of_limit']:.3%}" if blob else f"{r['share_of_limit']:.1%}",
            "—" if blob else f"{r['sidecars_per_unit']:,}",
        ])  # fmt: skip
    print(markdown_table(["", "per sidecar /s", f"{drivers:,} drivers /s",
                          "one unit's published rate", "share of one unit",
                          "sidecars one unit carries"], ext))  # fmt: skip
    print(f"\nRedis replay (one sidecar's commands back to back): {report['redis_replay']}")
    print(f"This machine's redis-server at simple commands: {report['redis_benchmark']}")
    if report["alternatives"]:
        print(f"\nSettings that trade cost for freshness (N={report['alt_sidecars']}; ratios "
              "to the defaults at that size):\n")  # fmt: skip
        print(markdown_table(
            ["settings", "store write /s", "lease /s", "store total /s (ratio)",
             "Redis cmds sent /s (ratio)", "blob behind by up to (model)"],
            [[a["settings"] or "defaults", fmt(a["write"]), fmt(a["lease"]),
              f"{fmt(a['total'])} (x{a['store_ratio']:.2f})",
              f"{fmt(a['redis'])} (x{a['redis_ratio']:.2f})", f"{a['behind_s']:g} s"]
             for a in report["alternatives"]]))  # fmt: skip


def alternatives(cases: list[Report], alt_sidecars: int) -> list[Report]:
    base = next((c for c in cases if not c["settings"] and c["sidecars"] == alt_sidecars), None)
    if base is None:
        return []
    out = []
    for c in cases:
        if c["sidecars"] != alt_sidecars:
            continue
        st, rd = c["loaded"]["store"]["per_s"], c["loaded"]["redis"]["sent"]["top_level_per_s"]
        b_st, b_rd = (
            base["loaded"]["store"]["per_s"],
            base["loaded"]["redis"]["sent"]["top_level_per_s"],
        )
        out.append(
            {
                "label": c["label"],
                "settings": ", ".join(f"{k}={v}" for k, v in c["settings"].items()),
                "write": st["write"],
                "lease": st["lease"],
                "total": st["total"],
                "redis": rd,
                "behind_s": c["model_behind_s"],
                "store_ratio": round(st["total"] / b_st["total"], 3) if b_st["total"] else None,
                "write_ratio": round(st["write"] / b_st["write"], 3) if b_st["write"] else None,
                "lease_ratio": round(st["lease"] / b_st["lease"], 3) if b_st["lease"] else None,
                "redis_ratio": round(rd / b_rd, 3) if b_rd else None,
            }
        )
    return out


def run(args: argparse.Namespace) -> Report:
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    alts = [] if args.no_alt else [parse_settings(a) for a in (args.alt or DEFAULT_ALTS)]
    cases = [Case("defaults", n, {}, args.idle_s, args.window_s) for n in sizes]
    if alts and args.alt_sidecars not in sizes:
        cases.append(Case("defaults", args.alt_sidecars, {}, 0.0, args.alt_window_s))
    cases += [
        Case(
            "alt " + ",".join(f"{k.removeprefix('SIDECAR_').lower()}={v}" for k, v in a.items()),
            args.alt_sidecars,
            a,
            0.0,
            args.alt_window_s,
        )
        for a in alts
    ]
    for i, c in enumerate(cases):
        c.index = i
    t0 = time.monotonic()
    with ExitStack() as cleanup:
        tmp = Path(tempfile.mkdtemp(prefix="cps-fleet-", dir="/tmp"))
        cleanup.callback(shutil.rmtree, tmp, ignore_errors=True)
        redis_server = cleanup.enter_context(RedisServer())
        azurite = cleanup.enter_context(Azurite(debug_log=False))
        proxy = cleanup.enter_context(CountingProxy(azurite.port))
        r = redis.Redis.from_url(redis_server.url)
        cleanup.callback(r.close)
        bench = Bench(redis_server, r, proxy, tmp)
        cpu0, t1 = bench.redis_cpu_s(), time.monotonic()
        time.sleep(args.baseline_s)
        bench.redis_baseline_cores = (bench.redis_cpu_s() - cpu0) / (time.monotonic() - t1)
        results: list[Report] = []
        for case in cases:
            result = run_case(bench, args, case)
            result["queries"] = args.queries
            results.append(result)
            print(
                f"[fleet] {case.label}, N={case.sidecars}: done in {result['case_seconds']:.0f}s",
                flush=True,
            )
        replayed = None
        if args.replay_sidecar_seconds > 0:
            replayed = anyio.run(replay, bench, args, args.replay_sidecar_seconds)
        simple = redis_benchmark(bench, args.redis_benchmark_requests)
        versions = {
            "redis_server": redis_version(redis_server.binary),
            "aof": r.config_get("appendonly").get("appendonly"),
        }
    base = [c for c in results if not c["settings"]]
    reference = max(base, key=lambda c: c["sidecars"])
    return {
        **environment(),
        **versions,
        "workload": {
            "queries_per_sidecar": args.queries,
            "batch_interval_s": args.batch_interval_s,
            "partitions": args.partitions,
            "readyz_every_s": args.readyz_every_s,
            "settings": args.setting,
        },
        "drivers": args.drivers,
        "reference_case": results.index(reference),  # index in cases
        "cases": results,
        "redis_replay": replayed,
        "redis_benchmark": simple,
        "extrapolation": extrapolation(reference, args.drivers, replayed, simple),
        "alt_sidecars": args.alt_sidecars,
        "alternatives": alternatives(results, args.alt_sidecars),
        "run_seconds": round(time.monotonic() - t0, 1),
        "note": "every process (the drivers in this one, the daemons, redis-server, Azurite, "
        "the proxy) shares the machine's 2 cores with other users; counts do not "
        "depend on it, CPU times do (see the load average)",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--sizes", default="1,5,20", help="fleet sizes, comma-separated")
    parser.add_argument("--queries", type=int, default=10, help="per sidecar")
    parser.add_argument("--partitions", type=int, default=8, help="Kafka partitions per query")
    parser.add_argument("--batch-interval-s", type=float, default=1.0, help="per query")
    parser.add_argument("--idle-s", type=float, default=30, help="idle window (0: none)")
    parser.add_argument("--warmup-s", type=float, default=30, help="at least; see above")
    parser.add_argument("--window-s", type=float, default=60)
    parser.add_argument("--attribution-s", type=float, default=20, help="SLOWLOG window")
    parser.add_argument("--baseline-s", type=float, default=10, help="Redis with no daemon")
    parser.add_argument("--readyz-every-s", type=float, default=10, help="0: no probes")
    parser.add_argument(
        "--alt",
        action="append",
        help=f"SIDECAR_X=v[,SIDECAR_Y=w] (repeat); default: {' and '.join(DEFAULT_ALTS)}",
    )
    parser.add_argument("--alt-sidecars", type=int, default=5)
    parser.add_argument("--alt-window-s", type=float, default=120)
    parser.add_argument("--no-alt", action="store_true")
    parser.add_argument("--drivers", type=int, default=1000, help="extrapolated to")
    parser.add_argument("--replay-sidecar-seconds", type=int, default=2000, help="0: none")
    parser.add_argument("--redis-benchmark-requests", type=int, default=100_000, help="0: none")
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    parser.add_argument("--setting", action="append", default=[], help="SIDECAR_X=v, all cases")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    return bench_main("fleet", lambda: run(args), show, out=args.out, save=not args.no_save)


if __name__ == "__main__":
    raise SystemExit(main())
