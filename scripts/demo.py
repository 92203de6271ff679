"""`make demo`: a real Spark streaming query whose offsets flow Spark → daemon → Redis → blob.

Everything is real and local: redis-server and Azurite on free ports in temp dirs, the daemon
as its own process, a PySpark streaming query on the built-in ``rate-micro-batch`` source
(PySpark 3.4+ and 4) with the JVM listener registered the conf-only way
(``spark_bridge.configure``: ``spark.jars`` + ``spark.sql.streaming.streamingQueryListeners``).
After a short run it reads the checkpoint back from the blob, checks that it holds Spark's last
batch and end offsets, prints a few lines of /metrics and where a replacement query would
resume; then it stops everything cleanly.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import anyio

from sidecar.config import Config
from sidecar.model.checkpoint import offset_value
from sidecar.model.document import CheckpointDocument
from sidecar.ops.inspection import find_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from tests.services import Azurite, DaemonProcess, RedisServer

RUN_S = float(os.environ.get("DEMO_SECONDS", "15"))
QUERY = "orders-demo"


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="cps-demo-"))
    with RedisServer() as redis, Azurite() as azurite:
        say(f"redis-server  {redis.url}")
        say(f"Azurite       {azurite.blob_endpoint}")
        settings = {
            "SIDECAR_SOCKET_PATH": str(work / "sidecar.sock"),
            "SIDECAR_REDIS_URL": redis.url,
            "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
            "SIDECAR_NAMESPACE": "demo",
            "SIDECAR_CONTAINER": "spark-checkpoints",
            "SIDECAR_METRICS_HOST": "127.0.0.1",
            "SIDECAR_COUNT_THRESHOLD": "5",
            "SIDECAR_TIME_THRESHOLD_S": "2",
            "SIDECAR_FLUSH_INTERVAL_S": "0.2",
            "SIDECAR_LEASE_DURATION_S": "15",
        }
        daemon = DaemonProcess(settings, work / "daemon.log")
        try:
            daemon.start()  # returns once GET /readyz answers 200
            say(
                f"daemon        pid {daemon.pid}, socket {daemon.socket_path}, "
                f"metrics {daemon.admin_url}/metrics (log: {daemon.log_path})"
            )
            # The blob is read back with the daemon's own settings (Config.from_env).
            os.environ.update(daemon.settings)
            code = run_spark(daemon, work)
        finally:
            if daemon.proc is not None:
                exit_code = daemon.stop(timeout_s=60)
                say(f"daemon stopped (SIGTERM) with exit code {exit_code}; last log lines:")
                for line in daemon.log().splitlines()[-4:]:
                    print(f"    {line}")
    return code


def as_json(offset: Any) -> Any:
    """An offset from ``StreamingQuery.lastProgress`` as a JSON value (PySpark 4 gives JSON
    text, PySpark 3.x parsed values)."""
    return json.loads(offset) if isinstance(offset, str) else offset


def read_blob(query: str, batch_id: int, timeout_s: float = 20) -> CheckpointDocument:
    """The query's checkpoint read from the blob itself (not the daemon), once it holds
    ``batch_id`` or ``timeout_s`` passed. Settings from the same environment as the daemon."""
    config = Config.from_env(os.environ)
    deadline = time.monotonic() + timeout_s
    while True:
        doc = anyio.run(find_checkpoint, config, query).document
        assert doc is not None
        if doc.batch_id >= batch_id or time.monotonic() > deadline:
            return doc
        time.sleep(0.2)


def run_spark(daemon: DaemonProcess, work: Path) -> int:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import pyspark
    from pyspark.sql import SparkSession

    import spark_bridge

    say(f"starting a local SparkSession, PySpark {pyspark.__version__} (about 5 s)")
    builder = (
        SparkSession.builder.master("local[2]")
        .appName("checkpoint-sidecar-demo")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
    )
    # The conf-only way (what spark-submit --jars … --conf … does): Spark itself creates the
    # listener in the driver JVM; no Python runs on Spark's listener thread.
    spark = spark_bridge.configure(builder, daemon.socket_path).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    conf = spark.sparkContext.getConf()
    say(f"  spark.jars = {conf.get('spark.jars')}")
    say(f"  spark.sql.streaming.streamingQueryListeners = {spark_bridge.LISTENER_CLASS}")
    handle = spark_bridge.attach(spark)  # finds the listener Spark created: stats and close
    say(f"listener      {handle.kind} ({spark_bridge.LISTENER_CLASS}, registered by Spark conf)")
    query = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", "100")
        .option("numPartitions", "3")
        .load()
        .writeStream.format("noop")
        .queryName(QUERY)
        .trigger(processingTime="500 milliseconds")
        .option("checkpointLocation", str(work / "spark-checkpoint"))
        .start()
    )
    say(f"streaming query {QUERY!r} started (id {query.id}); running for {RUN_S:.0f} s")
    deadline = time.monotonic() + RUN_S
    while time.monotonic() < deadline:
        time.sleep(3)
        last = query.lastProgress
        if last:
            end = as_json(last["sources"][0]["endOffset"])
            say(
                f"  spark batch {last['batchId']:>3}  endOffset {json.dumps(end)}  "
                f"bridge {handle.stats()}"
            )
    query.stop()
    last = query.lastProgress
    spark_end = as_json(last["sources"][0]["endOffset"])
    # Spark's listener bus is asynchronous: close() first waits for the query's terminated
    # event (the last progress comes before it), then for the daemon's acks (bounded).
    delivered = handle.close(timeout_s=10)
    say(f"query stopped after batch {last['batchId']}; all offsets delivered: {delivered}")

    from sidecar.cli.main import main as cli

    doc = read_blob(QUERY, last["batchId"])
    say(f"the checkpoint read back from the blob (checkpoint-sidecar show {QUERY}):")
    cli(["show", QUERY])
    same_batch = doc.batch_id == last["batchId"]
    end = offset_value(doc.sources[0].end_offset)
    agree = end == spark_end
    say(
        f"blob batch {doc.batch_id} == Spark's last batch {last['batchId']}: {same_batch}; "
        f"end offsets equal ({json.dumps(spark_end)}): {agree}"
    )
    say(
        f"resume: a replacement query starts at the saved end offset "
        f"{json.dumps(end)}, the next row to read"
    )
    say(
        "  (rate-micro-batch takes no starting position; for a Kafka source, "
        f"spark_bridge.starting_offsets({QUERY!r}) turns the saved end offsets into its "
        "startingOffsets)"
    )
    say("a few lines of /metrics:")
    with urllib.request.urlopen(f"{daemon.admin_url}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(
                (
                    "checkpoint_sidecar_updates_total",
                    'checkpoint_sidecar_flushes_total{result="ok"',
                    "checkpoint_sidecar_checkpoint_batch_id",
                    "checkpoint_sidecar_lease_held",
                    "checkpoint_sidecar_pending_updates",
                )
            ):
                print(f"    {line}")
    spark.stop()
    return 0 if delivered and same_batch and agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
