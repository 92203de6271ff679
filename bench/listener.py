"""Listener benchmark: what the checkpoint listener costs a real Spark driver, JVM vs Python.

One invocation, interleaved rounds (each round runs every case once, in a rotated order); every
run is a fresh driver process (this script with ``--driver``: PySpark 4 in local[2] mode and
its JVM), so the driver CPU measured is that run's alone. One real daemon
(``tests.services.DaemonProcess``, settings shaped like tests/conftest.py's ``daemon_env``) with a
real redis-server and Azurite (``tests.services``) serves every run.

1. Time on Spark's listener thread per progress event, measured on that thread. Two tiny JVM
   marker listeners (bench/jvm/MarkerListener.java, compiled here with javac against the
   pyspark wheel's jars, loaded by ``spark.jars``) bracket ours on the same session: ``Before``
   first, by Spark conf; ours next (JVM: by conf, listed after Before; Python:
   ``spark.streams.addListener``, which appends after every conf listener); ``After`` last,
   by ``addListener`` through Before's class loader. Spark's StreamingQueryListenerBus calls a
   session's listeners in registration order on one thread, so After's ``System.nanoTime`` minus
   Before's is what our listener costs that thread per event, including for the Python listener
   PySpark's conversion of the event (``QueryProgressEvent.fromJObject``, inside the Py4J
   callback Spark's thread waits on); the same bracket in the thread's CPU time tells work on
   the thread from waiting for a core. Each driver checks the order (``listListeners``) and
   that every event was paired on one thread. The "none" runs measure the empty bracket (the
   bus's dispatch of one listener, the markers themselves). Events of the warm-up are dropped.
2. One query (``rate-micro-batch``, 10 rows per batch, ``noop`` sink, 100 ms trigger) for
   ``--duration-s``, with no listener, the Python listener, the JVM listener: batch duration
   (``durationMs.triggerExecution`` of every progress event, as the marker sees it) median and
   p99, and the driver's CPU seconds (Python process + its JVM, from /proc, over the same
   window), pooled over the rounds, as ratios to "none".
3. 20 such queries at a 500 ms trigger for ``--duration-s``, JVM and Python listener: events
   Spark's ``streams`` queue dropped (its ``queue.streams.numDroppedEvents`` counter, and the
   driver log's "Dropping event from queue" / "Dropped N events from" lines), the daemon's lag
   in batches sampled every second (Spark's ``lastProgress.batchId`` of each query, then the
   daemon's ``get`` at once, and again 100 ms later: a batch Spark finished just before the
   sample may still be on its way, which the strict figure counts as lag 1), and
   after ``stop()`` of all 20 and ``handle.close(60)``: queries whose last batch the daemon holds.

The machine may be shared: the 1-minute load average and the whole machine's busy cores are
recorded per run. Results: bench/results/listener.json. ``--quick``: 10 s windows, 1 round.
Exit code 1 when a run failed or a marker bracket was not intact; a missed target is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from sidecar.wire.protocol import ClientConnection, encode_request

# tests.services (the local services; not in the wheel) from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import bench_main, git_commit, package_versions, services
from tests.services import REPO_ROOT, DaemonProcess

MARKER_SOURCE = REPO_ROOT / "bench" / "jvm" / "MarkerListener.java"
BEFORE, AFTER = "bench.MarkerListener$Before", "bench.MarkerListener$After"
LISTENERS_CONF = "spark.sql.streaming.streamingQueryListeners"
ONE = {"queries": 1, "trigger": "100 milliseconds"}  # scenario 2
MANY = {"queries": 20, "trigger": "500 milliseconds"}  # scenario 3 (and 1 with >= 20 queries)
ROWS_PER_BATCH, CLOSE_TIMEOUT_S, SAMPLE_S, GRACE_S = 10, 60.0, 1.0, 0.1
TARGET_ON_THREAD_P99_MS, TARGET_RATIO = 1.0, 1.05
RAW = ("trigger_ms", "bracket_ns", "bracket_cpu_ns")  # per event: summarized, not stored
RATIO_TARGETS = ("batch_median_ms", "batch_p99_ms", "driver_cpu_s")  # JVM vs none, <= 1.05
Result = dict[str, Any]


class BenchError(Exception):
    """A run did not measure what it should (wrong listener order, unpaired events, crash)."""


# --- helpers shared by both processes ------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """CPU time (user + system, all threads) of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU time every process on the machine used so far (all but idle and iowait)."""
    ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def pct(values: list[int], q: int) -> int:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, -(-len(s) * q // 100) - 1))]


class DaemonGets:
    """One blocking connection to the daemon; ``batches`` pipelines a ``get`` per query."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.conn = ClientConnection()

    def batches(self, query_ids: list[str]) -> list[int]:
        """The batch id the daemon holds per query (-1: none)."""
        self.sock.sendall(b"".join(encode_request("get", i, query_id=q) for i, q in
                                   enumerate(query_ids)))  # fmt: skip
        replies: dict[Any, Any] = {}
        while len(replies) < len(query_ids):
            data = self.sock.recv(1 << 16)
            if not data:
                raise BenchError("the daemon closed the connection")
            replies.update((r.id, r) for r in self.conn.receive_data(data))
        out = []
        for i in range(len(query_ids)):
            if not replies[i].ok:
                raise BenchError(f"get failed: {replies[i].error}")
            out.append((replies[i].checkpoint or {}).get("batch_id", -1))
        return out

    def close(self) -> None:
        self.sock.close()


# --- the driver: one fresh PySpark process per run ----------------------------------------------


def run_driver(cfg: Result) -> Result:
    """Start a session with the markers and the listener ``cfg["kind"]``; measure; stop."""
    from pyspark.sql import SparkSession

    import spark_bridge

    builder = (
        SparkSession.builder.master("local[2]")
        .appName(f"bench-listener-{cfg['kind']}")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.jars", cfg["marker_jar"])
        .config(LISTENERS_CONF, BEFORE)
    )
    if cfg["kind"] == "jvm":  # appends the jar and the class after Before: Spark keeps the order
        builder = spark_bridge.configure(builder, cfg["socket_path"])
    spark = builder.getOrCreate()
    try:
        return measure_driver(spark, cfg)
    finally:
        spark.stop()


def measure_driver(spark: Any, cfg: Result) -> Result:
    import spark_bridge

    spark.sparkContext.setLogLevel("WARN")  # keeps the bus's drop ERROR/WARN lines
    kind, jvm, gateway = cfg["kind"], spark._jvm, spark.sparkContext._gateway
    handle = None
    if kind == "python":
        handle = spark_bridge.attach(spark, cfg["socket_path"], listener="python")
    elif kind == "jvm":
        handle = spark_bridge.attach(spark)  # the one Spark created from the conf
    manager = spark._jsparkSession.streams()
    before = manager.listListeners()[0]
    after_cls = jvm.java.lang.Class.forName(AFTER, True, before.getClass().getClassLoader())
    no_types = gateway.new_array(jvm.java.lang.Class, 0)
    after = after_cls.getConstructor(no_types).newInstance(
        gateway.new_array(jvm.java.lang.Object, 0)
    )
    manager.addListener(after)
    order = [str(x.getClass().getName()) for x in manager.listListeners()]
    inner = order[1:-1]
    if kind == "python":  # PySpark's wrapper, which calls back into Python over Py4J
        inner_ok = len(inner) == 1 and "Python" in inner[0]
    else:
        inner_ok = inner == ([spark_bridge.LISTENER_CLASS] if kind == "jvm" else [])
    if order[0] != BEFORE or order[-1] != AFTER or not inner_ok:
        raise BenchError(f"the markers do not bracket exactly our listener: {order}")

    n, work = cfg["queries"], Path(cfg["workdir"])
    queries = [
        spark.readStream.format("rate-micro-batch").option("rowsPerBatch", str(ROWS_PER_BATCH))
        .load().writeStream.format("noop").queryName(f"bench_{kind}_{i}")
        .trigger(processingTime=cfg["trigger"]).option("checkpointLocation", str(work / f"ck{i}"))
        .start()
        for i in range(n)
    ]  # fmt: skip
    jqs, ids = [q._jsq for q in queries], [str(q.id) for q in queries]

    def batch(jq: Any) -> int:
        last = jq.lastProgress()  # the JVM object: PySpark's conversion would cost ~50 ms
        return -1 if last is None else int(last.batchId())

    deadline = time.monotonic() + 180
    while min(batch(jq) for jq in jqs) < 2:
        if time.monotonic() > deadline:
            raise BenchError("queries did not reach batch 2 within 180 s")
        time.sleep(0.2)
    time.sleep(cfg["warmup_s"])
    registry = spark.sparkContext._jsc.sc().listenerBus().metrics().metricRegistry()
    dropped = registry.getCounters().get("queue.streams.numDroppedEvents")
    queue = registry.getGauges().get("queue.streams.size")
    jvm_pid = int(jvm.java.lang.ProcessHandle.current().pid())

    after.drain()  # the warm-up's events
    b0, load0 = [batch(jq) for jq in jqs], os.getloadavg()[0]
    t0, cpu0 = time.monotonic(), (proc_cpu_s(os.getpid()), proc_cpu_s(jvm_pid), machine_busy_s())
    samples: list[tuple[int, int, int]] = []  # (max lag, max lag 100 ms later, queue size)
    lags: Counter[int] = Counter()  # per query and sample
    client = DaemonGets(cfg["socket_path"])
    try:
        if n == 1:
            time.sleep(cfg["duration_s"])  # nothing else in this process: its CPU is the listener's
        else:
            while (now := time.monotonic()) < t0 + cfg["duration_s"]:
                spark_b = [batch(jq) for jq in jqs]  # Spark first: the listener gets the gap
                saved = client.batches(ids)
                lag = [max(0, s - d) for s, d in zip(spark_b, saved, strict=True)]
                time.sleep(GRACE_S)
                later = client.batches(ids)
                old = [max(0, s - d) for s, d in zip(spark_b, later, strict=True)]
                lags.update(lag)
                samples.append((max(lag), max(old), int(queue.getValue()) if queue else -1))
                time.sleep(max(0.0, now + SAMPLE_S - time.monotonic()))
        t1 = time.monotonic()
        cpu1 = (proc_cpu_s(os.getpid()), proc_cpu_s(jvm_pid), machine_busy_s())
        rows = [[int(x) for x in line.split(",")] for line in after.drain().splitlines()]
        b1, load1 = [batch(jq) for jq in jqs], os.getloadavg()[0]

        for q in queries:
            q.stop()
        started = time.monotonic()
        closed = handle.close(CLOSE_TIMEOUT_S) if handle is not None else True
        close_s = time.monotonic() - started
        last, saved = [batch(jq) for jq in jqs], client.batches(ids)
    finally:
        client.close()
    window = t1 - t0
    return {
        "kind": kind, "queries": n, "listeners": order, "listener_thread": after.threadName(),
        "unpaired_events": int(after.unpaired()), "java": jvm.java.lang.System.getProperty(
            "java.version"),
        "window_s": round(window, 2), "loadavg_1min": [round(load0, 2), round(load1, 2)],
        "machine_busy_cores": round((cpu1[2] - cpu0[2]) / window, 2),
        "cpu_s": {"python": round(cpu1[0] - cpu0[0], 2), "jvm": round(cpu1[1] - cpu0[1], 2),
                  "driver": round(cpu1[0] + cpu1[1] - cpu0[0] - cpu0[1], 2)},
        "batches": sum(b1) - sum(b0),
        "trigger_ms": [r[2] for r in rows if r[2] >= 0], "bracket_ns": [r[3] for r in rows],
        "bracket_cpu_ns": [r[4] for r in rows],
        "events_per_query": dict(Counter(r[0] for r in rows)),
        "lag": {"samples": len(samples), "max": max((s[0] for s in samples), default=None),
                "max_100ms_later": max((s[1] for s in samples), default=None),
                "samples_all_zero": sum(s[0] == 0 for s in samples),
                "samples_all_zero_100ms_later": sum(s[1] == 0 for s in samples),
                "per_query_histogram": dict(sorted(lags.items())),
                "max_streams_queue_size": max((s[2] for s in samples), default=None)},
        "dropped_counter": int(dropped.getCount()) if dropped is not None else None,
        "closed": bool(closed), "close_s": round(close_s, 2),
        "last_present": sum(a == b for a, b in zip(last, saved, strict=True)),
        "missing": [[a, b] for a, b in zip(last, saved, strict=True) if a != b],
        "stats": handle.stats().__dict__ if handle is not None else None,
    }  # fmt: skip


# --- the orchestrator -----------------------------------------------------------------------------


def compile_markers(tmp: Path) -> Path:
    """javac the marker listeners against the pyspark wheel's jars (like scripts/build_jar.sh)."""
    import zipfile

    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    classes = tmp / "marker-classes"
    subprocess.run(
        ["javac", "--release", "8", "-Xlint:all,-options,-path", "-Werror", "-encoding",
         "UTF-8", "-cp", f"{jars}/*", "-d", str(classes), str(MARKER_SOURCE)],
        check=True,
    )  # fmt: skip
    jar = tmp / "bench-markers.jar"
    with zipfile.ZipFile(jar, "w") as z:
        for f in sorted(classes.rglob("*.class")):
            z.write(f, f.relative_to(classes).as_posix())
    return jar


def wait_group_gone(pgid: int, timeout_s: float = 30) -> None:
    """Wait until the driver's process group (Python and its JVM) is gone; kill it after that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)


def run_one(base: Result, scenario: str, kind: str, label: str) -> Result:
    """One driver process; its result plus what its log says about dropped events."""
    work = Path(base["tmp"]) / label
    work.mkdir()
    cfg = {**base, **(ONE if scenario == "one" else MANY), "kind": kind, "workdir": str(work)}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env.update(PYTHONPATH=str(REPO_ROOT), SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    log_path = work / "driver.log"
    print(f"  {label}: {scenario} query(ies), {kind} listener ...", flush=True)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--driver", json.dumps(cfg)],
            stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True,
        )  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=cfg["duration_s"] + cfg["warmup_s"] + 600)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        wait_group_gone(proc.pid)
    text = log_path.read_text(errors="replace")
    result_line = [x for x in out.decode().splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not result_line:
        return {"scenario": scenario, "kind": kind, "label": label,
                "error": f"driver exited {proc.returncode}: {text[-3000:]}"}  # fmt: skip
    result: Result = json.loads(result_line[-1][len("RESULT ") :])
    result.update(
        scenario=scenario, label=label, run_s=round(time.monotonic() - started, 1),
        log_dropping_lines=text.count("Dropping event from queue"),
        log_dropped_counts=sum(int(m) for m in re.findall(r"Dropped (\d+) events from", text)),
    )  # fmt: skip
    return result


def on_thread(runs: list[Result]) -> Result:
    ns = [x for r in runs for x in r["bracket_ns"]]
    cpu = [x for r in runs for x in r["bracket_cpu_ns"]]
    if not ns:
        return {"events": 0}
    return {"events": len(ns), "p50_us": round(pct(ns, 50) / 1e3, 1),
            "p99_us": round(pct(ns, 99) / 1e3, 1), "max_us": round(max(ns) / 1e3, 1),
            "mean_us": round(sum(ns) / len(ns) / 1e3, 1),
            "thread_cpu": {"p50_us": round(pct(cpu, 50) / 1e3, 1),
                           "p99_us": round(pct(cpu, 99) / 1e3, 1),
                           "max_us": round(max(cpu) / 1e3, 1)},
            "unpaired": sum(r["unpaired_events"] for r in runs)}  # fmt: skip


def summarize(runs: list[Result]) -> Result:
    ok = [r for r in runs if "error" not in r]
    pick = {(s, k): [r for r in ok if r["scenario"] == s and r["kind"] == k]
            for s in ("one", "many") for k in ("none", "python", "jvm")}  # fmt: skip
    thread = {f"{s}_{k}": on_thread(rs) for (s, k), rs in pick.items() if rs}
    one: Result = {}
    for kind in ("none", "python", "jvm"):
        rs = pick["one", kind]
        trig = [x for r in rs for x in r["trigger_ms"]]
        if not trig:
            continue
        one[kind] = {"runs": len(rs), "batches": sum(r["batches"] for r in rs),
                     "batch_median_ms": pct(trig, 50), "batch_p99_ms": pct(trig, 99),
                     "driver_cpu_s": round(sum(r["cpu_s"]["driver"] for r in rs), 2),
                     "driver_cpu_ms_per_batch": round(sum(r["cpu_s"]["driver"] for r in rs)
                                                      * 1e3 / max(1, sum(r["batches"]
                                                                         for r in rs)), 1),
                     "window_s": round(sum(r["window_s"] for r in rs), 1),
                     "per_round_driver_cpu_s": [r["cpu_s"]["driver"] for r in rs]}  # fmt: skip
    for kind in ("python", "jvm"):
        if kind in one and "none" in one:
            one[kind]["ratio_to_none"] = {
                m: round(one[kind][m] / max(one["none"][m], 1e-9), 3)
                for m in (*RATIO_TARGETS, "driver_cpu_ms_per_batch")
            }
    many: Result = {}
    for kind in ("python", "jvm"):
        rs = pick["many", kind]
        if rs:
            many[kind] = {
                "runs": len(rs),
                "dropped_events": sum(r["dropped_counter"] or 0 for r in rs),
                "dropped_per_run": [r["dropped_counter"] for r in rs],
                "log_dropping_lines": sum(r["log_dropping_lines"] for r in rs),
                "log_dropped_counts": sum(r["log_dropped_counts"] for r in rs),
                "max_lag_batches": max(r["lag"]["max"] or 0 for r in rs),
                "max_lag_100ms_later": max(r["lag"]["max_100ms_later"] or 0 for r in rs),
                "samples_all_zero": f"{sum(r['lag']['samples_all_zero'] for r in rs)}/"
                                    f"{sum(r['lag']['samples'] for r in rs)}",
                "samples_all_zero_100ms_later": "{}/{}".format(
                    sum(r["lag"]["samples_all_zero_100ms_later"] for r in rs),
                    sum(r["lag"]["samples"] for r in rs)),
                "max_streams_queue_size": max(r["lag"]["max_streams_queue_size"] or 0
                                              for r in rs),
                "last_present": [f"{r['last_present']}/{r['queries']}" for r in rs],
                "closed_in_time": [r["closed"] for r in rs],
                "close_s": [r["close_s"] for r in rs],
                "batches": sum(r["batches"] for r in rs),
            }  # fmt: skip
    jt, jo, jm = thread.get("many_jvm", {}), one.get("jvm", {}), many.get("jvm", {})
    ratios = jo.get("ratio_to_none", {})
    targets = {
        "jvm_on_thread_p99_ms_20_queries": {
            "target": TARGET_ON_THREAD_P99_MS, "measured": (jt.get("p99_us") or 0) / 1e3,
            "met": bool(jt.get("events")) and jt["p99_us"] / 1e3 <= TARGET_ON_THREAD_P99_MS},
        **{f"jvm_ratio_{m}": {"target": TARGET_RATIO, "measured": ratios.get(m),
                              "met": ratios.get(m, 99) <= TARGET_RATIO} for m in RATIO_TARGETS},
        "jvm_dropped_events_20_queries": {"target": 0, "measured": jm.get("dropped_events"),
                                          "met": jm.get("dropped_events") == 0},
        "jvm_max_lag_batches_20_queries": {"target": 0, "measured": jm.get("max_lag_batches"),
                                           "met": jm.get("max_lag_batches") == 0},
        "jvm_last_batch_present_20_queries": {
            "target": "20/20", "measured": jm.get("last_present"),
            "met": bool(jm) and all(x == "20/20" for x in jm["last_present"])},
    }  # fmt: skip
    return {"on_spark_listener_thread": thread, "one_query": one, "twenty_queries": many,
            "targets": targets}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--duration-s", type=float, default=60.0, help="measured window per run")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 s windows, 1 round")
    parser.add_argument("--driver", help=argparse.SUPPRESS)  # internal: one run's config
    args = parser.parse_args()
    if args.driver:
        print("RESULT " + json.dumps(run_driver(json.loads(args.driver))), flush=True)
        return 0
    if args.quick:
        args.duration_s, args.rounds = 10.0, 1
    return bench_main("listener", lambda: run(args), show, ok)


def failures(report: Result) -> tuple[list[Result], list[str]]:
    """Runs that failed, and labels of runs whose marker bracket was not intact."""
    failed = [r for r in report["runs"] if "error" in r]
    return failed, [r["label"] for r in report["runs"] if r.get("unpaired_events")]


def ok(report: Result) -> bool:
    failed, bad = failures(report)
    return not failed and not bad


def show(report: Result) -> None:
    print_table(report)
    failed, bad = failures(report)
    for r in failed:
        print(f"run {r['label']} FAILED: {r['error']}", file=sys.stderr)
    if bad:
        print(f"unpaired marker events in {bad}: the bracket was not intact", file=sys.stderr)


def run(args: argparse.Namespace) -> Result:
    load_before, started = os.getloadavg(), time.monotonic()
    runs: list[Result] = []
    with ExitStack() as cleanup:  # unwinds in reverse: daemon, Azurite, Redis, temp dir
        tmp, redis_server, azurite = services(cleanup, "cps-bl-")
        marker_jar = compile_markers(tmp)
        env = {
            "SIDECAR_SOCKET_PATH": str(tmp / "s.sock"), "SIDECAR_REDIS_URL": redis_server.url,
            "SIDECAR_NAMESPACE": "bench-listener", "SIDECAR_METRICS_HOST": "127.0.0.1",
            "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
            "SIDECAR_CONTAINER": "checkpoints", "SIDECAR_LEASE_DURATION_S": "15",
            "SIDECAR_FLUSH_INTERVAL_S": "0.05",
        }  # fmt: skip
        daemon = DaemonProcess(env, tmp / "daemon.log")
        cleanup.callback(daemon.kill)
        daemon.start()
        redis_version = subprocess.run([redis_server.binary, "--version"], capture_output=True,
                                       text=True).stdout.split()[2]  # fmt: skip
        base = {"tmp": str(tmp), "marker_jar": str(marker_jar), "socket_path": env[
            "SIDECAR_SOCKET_PATH"], "duration_s": args.duration_s,
            "warmup_s": 2.0 if args.quick else 5.0}  # fmt: skip
        print(f"listener bench: {args.rounds} round(s), {args.duration_s:g} s windows, "
              f"load avg before {load_before}", flush=True)  # fmt: skip
        for rnd in range(args.rounds):
            kinds1 = ["none", "python", "jvm"][rnd % 3 :] + ["none", "python", "jvm"][: rnd % 3]
            kinds3 = ["jvm", "python"][rnd % 2 :] + ["jvm", "python"][: rnd % 2]
            for kind in kinds1:
                runs.append(run_one(base, "one", kind, f"r{rnd}-one-{kind}"))
            for kind in kinds3:
                runs.append(run_one(base, "many", kind, f"r{rnd}-many-{kind}"))
        daemon.stop()
    summary = summarize(runs)
    java = next((r["java"] for r in runs if "java" in r), None)
    import pyspark

    return {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "cpu": next((ln.split(":", 1)[1].strip() for ln in
                                 Path("/proc/cpuinfo").read_text().splitlines()
                                 if ln.startswith("model name")), None)},
        "versions": {"python": platform.python_version(), "pyspark": pyspark.__version__,
                     "java": java, "redis_server": redis_version},
        "loadavg": {"before": [round(x, 2) for x in load_before],
                    "after": [round(x, 2) for x in os.getloadavg()],
                    "per_run_1min": {r["label"]: r["loadavg_1min"] for r in runs
                                     if "loadavg_1min" in r},
                    "per_run_machine_busy_cores": {r["label"]: r["machine_busy_cores"]
                                                   for r in runs if "machine_busy_cores" in r}},
        "conditions": {
            "duration_s": args.duration_s, "rounds": args.rounds, "quick": args.quick,
            "warmup_s": base["warmup_s"], "total_s": round(time.monotonic() - started),
            "driver": "PySpark local[2], spark.sql.shuffle.partitions=2, UI off, log level WARN;"
                      " a fresh process per run; rounds interleave the cases, order rotated",
            "one_query": {**ONE, "source": f"rate-micro-batch rowsPerBatch={ROWS_PER_BATCH}",
                          "sink": "noop"},
            "twenty_queries": {**MANY, "lag_sample_s": SAMPLE_S, "lag_grace_s": GRACE_S,
                               "close_timeout_s": CLOSE_TIMEOUT_S},
            "markers": "bench/jvm/MarkerListener.java: Before (conf, first) and After "
                       "(addListener, last) bracket ours on Spark's listener thread; present in "
                       "every run, none included",
            "daemon": "python -m sidecar run, settings of tests/conftest.py daemon_env, real "
                      "redis-server and Azurite, on the same machine",
            "shared_machine": "other workers may run tests on the same cores: see loadavg",
        },
        **summary,
        "git_commit": git_commit(), "packages": package_versions(),
        "runs": [{k: v for k, v in r.items() if k not in RAW} for r in runs],
    }  # fmt: skip


def print_table(report: Result) -> None:
    t, one, many = (report["on_spark_listener_thread"], report["one_query"],
                    report["twenty_queries"])  # fmt: skip
    c, la, v = report["conditions"], report["loadavg"], report["versions"]
    names = {"none": "nothing between the markers", "jvm": "JVM listener",
             "python": "Python listener incl. PySpark's conversion"}  # fmt: skip
    # fmt: off
    print(f"\nlistener bench: {report['machine']['cpu_count']} cores, load avg 1/5/15 before "
          f"{la['before']}, after {la['after']}; {c['rounds']} round(s), {c['duration_s']:g} s "
          f"windows; PySpark {v['pyspark']}, Java {v['java']}")
    print(f"{'on Spark listener thread per event (After - Before), us':<58}{'p50':>9}{'p99':>10}"
          f"{'max':>10}{'events':>7}   thread CPU p50 / p99")
    for key, x in t.items():
        scenario, kind = key.split("_", 1)
        if x.get("events"):
            label = f"{'1 query' if scenario == 'one' else '20 queries':<11}{names[kind]}"
            print(f"  {label:<56}{x['p50_us']:>9}{x['p99_us']:>10}{x['max_us']:>10}"
                  f"{x['events']:>7}   {x['thread_cpu']['p50_us']} / {x['thread_cpu']['p99_us']}")
    print("1 query, 100 ms trigger: batch median / p99 ms, driver CPU s (ms per batch); "
          "ratios to none")
    for kind, x in one.items():
        r = x.get("ratio_to_none")
        ratios = (f"  ratios {r['batch_median_ms']} / {r['batch_p99_ms']} / "
                  f"{r['driver_cpu_s']} ({r['driver_cpu_ms_per_batch']})") if r else ""
        print(f"  {kind:<8}{x['batch_median_ms']:>5} / {x['batch_p99_ms']:<5}"
              f"{x['driver_cpu_s']:>8} s ({x['driver_cpu_ms_per_batch']}){ratios}")
    print("20 queries, 500 ms trigger: events dropped, max lag in batches at once / 100 ms later,"
          " samples with lag 0, last batch in the daemon after stop + close, close s")
    for kind, x in many.items():
        print(f"  {kind:<8}dropped {x['dropped_events']}  lag {x['max_lag_batches']} / "
              f"{x['max_lag_100ms_later']}  lag 0 in {x['samples_all_zero']} / "
              f"{x['samples_all_zero_100ms_later']}  last batch "
              f"{', '.join(x['last_present'])}  close {x['close_s']}")
    for name, tg in report["targets"].items():
        print(f"  target {name}: {'met' if tg['met'] else 'MISSED'} ({tg['measured']} vs "
              f"{tg['target']})")
    # fmt: on


if __name__ == "__main__":
    sys.exit(main())
