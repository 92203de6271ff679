"""The application of tests/e2e/'s driver image: one named streaming query, rate-micro-batch
source to the noop sink, one micro-batch per trigger interval, until the JVM is stopped.

Nothing here knows about checkpoint-sidecar: the listener comes in through spark-submit's
confs alone (the jar on the driver's class path, the listener class, the socket path), as in
a real deployment. Spark logs every micro-batch's progress ("Streaming query made progress")
at INFO; that log is what the test compares the blob with.

Settings (environment): QUERY_NAME, TRIGGER_INTERVAL (a Spark interval, default "1 second").
"""

from __future__ import annotations

import os

from pyspark.sql import SparkSession

spark = SparkSession.builder.appName("checkpoint-sidecar-e2e").getOrCreate()
query = (
    spark.readStream.format("rate-micro-batch")
    .option("rowsPerBatch", 10)
    .load()
    .writeStream.format("noop")
    .queryName(os.environ.get("QUERY_NAME", "e2e-rate"))
    .option("checkpointLocation", os.path.join(os.getcwd(), "query-checkpoint"))
    .trigger(processingTime=os.environ.get("TRIGGER_INTERVAL", "1 second"))
    .start()
)
print(f"e2e query started: name={query.name} id={query.id} runId={query.runId}", flush=True)
query.awaitTermination()
