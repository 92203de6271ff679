"""Ingest: the socket shell from a client's bytes to an answer, through the Redis buffer.

Owns: one client connection on the event loop (``connection``), the listeners and the
per-connection reading and answering (``server``), what each request does (``handler``) and
the batching of concurrent updates into one Redis round trip (``coalescer``).

May import: ``sidecar.wire``, ``sidecar.model``, ``sidecar.buffer``, ``sidecar.telemetry``,
``sidecar.config``, ``sidecar.errors``. Never ``sidecar.flush``: what ingest needs of the
blobs (a query's floor, waiting for a batch to be durable, a blob lookup, admin ops) reaches
it as callables and protocols wired by ``sidecar.daemon``.
"""
