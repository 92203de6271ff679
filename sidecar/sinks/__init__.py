"""Position sinks: what the places that hold Spark's durable positions for other tools share —
Kafka consumer groups (``sidecar.kafka``), Event Hubs checkpoints (``sidecar.eventhubs``).

Owns: the commit loop every sink runs (``loop``: each consumer group told of durable
checkpoints, its commits one at a time, the passes, retirement, the final commit, backoff and
containment of failures) and what a commit says (``report``: its log lines and result counts,
in one voice, each sink naming its own). How a group is read and written is each sink's edge:
aiokafka in ``sidecar.kafka``, the blob store's protocol in ``sidecar.eventhubs``.

May import: ``sidecar.model``, ``sidecar.config``, ``sidecar.errors``, ``sidecar.backoff``.
"""
