"""What ``--help`` (and ``checkpoint-sidecar config``) says about each setting, by component.

The groups and the order of the fields in them are :class:`sidecar.config.settings.Config`'s
declaration order (a test checks it). Pure text: no imports.
"""

from __future__ import annotations

#: ``--help`` text by component, the fields in declaration order.
HELP = {
    "socket, where the Spark listener connects": {
        "socket_path": "Unix socket the Spark listener connects to",
        "socket_mode": "permission bits of the socket file, octal (660 to share with a group)",
        "tcp_port": "also listen on loopback TCP, for JVMs without Unix sockets (Java < 16): "
        "auto (a free port, published with a token in <socket_path>.tcp), a port, or off",
        "tcp_host": "loopback address of the TCP listener",
        "max_frame_bytes": "largest accepted request line, in bytes",
        "admin_ops": "accept the admin ops reset and retire on the Unix socket (checkpoint-sidecar "
        "reset / retire; the daemon then performs them under its leases)",
        "admin_ops_tcp": "also accept them on the TCP listener, which any local process can "
        "reach (needs admin_ops)",
        "admin_quiet_s": "reset and retire refuse a query heard from (or updated in Redis) "
        "within this many seconds, as it may still be running, unless forced",
    },
    "Redis, the offset buffer": {
        "redis_url": "Redis holding the offset buffer (password is never logged; "
        "URL-encode a password with characters such as @ : / ? # + or spaces); in "
        "cluster mode any node, in sentinel mode only its password, db and TLS are used",
        "redis_mode": "standalone, cluster (Redis Cluster: any node as seed) or sentinel "
        "(the primary found through the sentinels, followed across failovers)",
        "redis_sentinels": "sentinel mode: the sentinels, host:port,...",
        "redis_sentinel_master": "sentinel mode: the service name the sentinels monitor",
        "redis_sentinel_password": "sentinel mode: the sentinels' own password, if they "
        "have one (never logged)",
        "namespace": "isolates one Spark application's keys and blobs",
        "redis_timeout_s": "timeout of one Redis call, seconds",
        "redis_require_aof": "refuse to start (exit 2) when Redis reports appendonly off: "
        "acknowledged updates would not survive a Redis restart",
        "redis_min_replicas": "acknowledge an update only once this many replicas have it "
        "(WAIT after each batch; else not_durable); 0: once the primary has it",
    },
    "blob store and leases": {
        "azure_connection_string": "Azure Storage connection string (key or SAS is never logged)",
        "account_url": "blob account URL, authenticated with DefaultAzureCredential "
        "(managed/workload identity); used when no connection string is set",
        "container": "blob container for checkpoints (created if missing, when the credential may)",
        "lease_duration_s": "blob lease duration, seconds (15-60); renewed every third of it",
        "instance_id": "this daemon's name in logs and in the documents it writes (default: "
        "HOSTNAME, the pod name); it does not decide who may write (the lease id does: "
        "SIDECAR_STATE_DIR)",
        "state_dir": "directory where this daemon keeps its lease id, locked while it runs "
        "(default: the socket's directory, the pod's shared emptyDir): the same container "
        "restarted in its pod takes its leases over at once; any other daemon has its own "
        "lease id and waits for the lease. Must be local to the pod",
        "write_timeout_s": "timeout of one blob call (write, lease, read), seconds",
        "history_size": "earlier flushed checkpoints each blob keeps for rewinding, newest "
        "first (0: none); thinned to fit 256 KiB for very wide queries",
    },
    "flushing and acknowledgements": {
        "count_threshold": "flush a query after this many applied updates",
        "time_threshold_s": "flush a query when its oldest unflushed update is this old, seconds",
        "flush_interval_s": "how often thresholds are checked, seconds (further apart while a "
        "check takes over a fifth of it)",
        "flush_concurrency": "queries flushed at the same time",
        "ack_mode": "redis: ack once buffered in Redis; blob: ack once the batch is in the blob",
        "blob_ack_timeout_s": "in blob ack mode, reply not_durable after waiting this long",
        "query_idle_s": "retire a query idle this long with nothing pending from memory, seconds",
    },
    "Kafka consumer-group commits (off unless bootstrap servers are set)": {
        "kafka_bootstrap_servers": "commit durable offsets of Kafka sources to consumer groups "
        "on these brokers (host:port,...; unset: off)",
        "kafka_group_template": "consumer group name; placeholders {query_name} (id when "
        "unnamed), {query_id}, {namespace}",
        "kafka_queries": "also commit Kafka-shaped offsets of non-Kafka sources for these "
        "queries (comma-separated names or ids)",
        "kafka_recommit_interval_s": "re-commit the current offsets when idle this often, so "
        "retention does not expire the group and lag tools do not call it stopped",
        "kafka_timeout_s": "timeout of one Kafka request, seconds",
        "kafka_security_protocol": "PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL",
        "kafka_sasl_mechanism": "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512",
        "kafka_sasl_username": "SASL user name",
        "kafka_sasl_password": "SASL password (never logged)",
        "kafka_ssl_cafile": "CA bundle to verify the brokers (SSL)",
        "kafka_ssl_certfile": "client certificate (mutual TLS)",
        "kafka_ssl_keyfile": "client private key (mutual TLS)",
        "kafka_lag_per_partition": "export lag per partition (false: per topic, for wide topics)",
        "kafka_lag_partition_series_max": "at most this many per-partition lag series; queries "
        "beyond it get per-topic series (checkpoint_sidecar_kafka_lag_series_dropped counts "
        "what was left out)",
    },
    "Event Hubs checkpoints (off unless a namespace is set)": {
        "eventhubs_namespace": "write the durable sequence numbers of Event Hubs sources as "
        "Event Hubs checkpoints (the SDKs' blob layout) for this fully qualified namespace, "
        "<namespace>.servicebus.windows.net (unset: off)",
        "eventhubs_consumer_group_template": "consumer group the checkpoints are written "
        "for; placeholders {query_name} (id when unnamed), {query_id}, {namespace}",
        "eventhubs_container": "blob container of the Event Hubs checkpoints (default: "
        "the checkpoint container); never created by the daemon",
    },
    "checkpoint snapshots (off unless a root is set)": {
        "snapshot_root": "directory holding the queries' Spark checkpoint locations, as mounted "
        "in this container (read-only is enough): each location is found by its metadata "
        "file, and the state of stateful queries is snapshotted from it (unset: off)",
        "snapshot_retain": "snapshots kept per query on its current timeline (and always the "
        "one its checkpoint document names); older ones, and bytes no kept snapshot needs, "
        "are deleted",
        "snapshot_abandoned_keep_s": "seconds a snapshot of an abandoned timeline (the batches "
        "after a rewind's point, as they were) is kept after it was taken, as a rewind point; "
        "and the snapshots of a query gone (retired, or its location reused by another "
        "query) after nothing more was written for it",
    },
    "admin endpoint, logging, event loop, shutdown": {
        "metrics_host": "address for /metrics, /healthz, /readyz",
        "metrics_port": "port for /metrics, /healthz, /readyz (0: pick a free one)",
        "log_level": "DEBUG, INFO, WARNING or ERROR",
        "log_format": "text (one line per record, as always) or json (one object per line: "
        "timestamp, level, logger, message and the query, batch, lease state and error "
        "fields the line names; see docs/operations.md, Logs)",
        "event_loop": "asyncio, uvloop (faster; needs the uvloop package, which the image "
        "has) or auto (uvloop when it is installed, else asyncio)",
        "shutdown_grace_s": "time allowed for a graceful stop, seconds",
    },
}
