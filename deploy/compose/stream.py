"""The quickstart's streaming application: one named query, the ``rate-micro-batch`` source
into the ``noop`` sink, one micro-batch per trigger, until stopped. Nothing in it knows of
checkpoint-sidecar: the listener comes in through spark-submit's confs alone (the jar on the
class path, the listener class, the socket path), as in a real deployment.

Settings (environment): QUERY_NAME (default ``quickstart-rate``), TRIGGER_INTERVAL (a Spark
interval, default ``2 seconds``), CHECKPOINT_DIR (Spark's own checkpoint, default under /tmp).
"""

from __future__ import annotations

import os

from pyspark.sql import SparkSession

spark = SparkSession.builder.appName("checkpoint-sidecar-quickstart").getOrCreate()
name = os.environ.get("QUERY_NAME", "quickstart-rate")
query = (
    spark.readStream.format("rate-micro-batch")
    .option("rowsPerBatch", 10)
    .load()
    .writeStream.format("noop")
    .queryName(name)
    .option("checkpointLocation", os.environ.get("CHECKPOINT_DIR", f"/tmp/{name}-checkpoint"))
    .trigger(processingTime=os.environ.get("TRIGGER_INTERVAL", "2 seconds"))
    .start()
)
print(f"quickstart query started: name={query.name} id={query.id}", flush=True)
query.awaitTermination()
