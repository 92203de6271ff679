"""Event Hubs: Spark's durable position as Event Hubs checkpoints, in the SDKs' blob layout.

Owns: where and what a checkpoint is (``plan``, pure: blob names, metadata, which partitions
to write and which would move backwards) and the checkpointer (``checkpointer``: writes after
durable blob writes, retries, metrics). The blobs themselves are written by the store
(``sidecar.store.eventhubs``, at the Azure edge), reached through a protocol that
``sidecar.daemon.app`` wires, as the flusher reaches it; lag is ``sidecar.kafka.lag``'s
collector, run with the Event Hubs names. See docs/eventhubs.md.

May import: ``sidecar.model``, ``sidecar.telemetry``, ``sidecar.sinks``, ``sidecar.config``,
``sidecar.errors``, ``sidecar.backoff``.
"""
