"""Kafka: Spark's durable position as consumer-group commits, and lag.

Owns: the client edge (``client``: consumer options, aiokafka's errors as ours; with
``committer`` the only importers of ``aiokafka``), the committer (``committer``: commits
after durable writes) and lag computed at scrape time (``lag``; it also serves Event Hubs
sources, with their own metric names: ``lag.EVENTHUBS``).

May import: ``sidecar.model``, ``sidecar.telemetry``, ``sidecar.sinks``, ``sidecar.config``,
``sidecar.errors``, ``sidecar.backoff``.
"""
