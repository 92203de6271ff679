"""Flush: from the Redis buffer to each query's blob, under that blob's lease.

Owns: the lease state machine (``lease``), the flusher's loop (``flusher``), the documents it
writes (``documents``), unreadable records set aside (``quarantine``) and what each query's
blob holds: its floor, the acks waiting for it, the write in flight.

May import: ``sidecar.model``, ``sidecar.buffer``, ``sidecar.store``, ``sidecar.telemetry``,
``sidecar.config``, ``sidecar.errors``, ``sidecar.backoff``. Never ``sidecar.ingest``.
"""
