"""Flush: from the Redis buffer to each query's blob, under that blob's lease.

Owns: the lease state machine (``lease``), what each query's blob holds — its floor, the acks
waiting for it, the document, the write in flight — with its one owner (``blob_state``) and
its pure decisions (``core``), the flusher's loop (``flusher``), the documents it writes
(``documents``) and unreadable records set aside (``quarantine``).

May import: ``sidecar.model``, ``sidecar.buffer``, ``sidecar.telemetry``, ``sidecar.config``,
``sidecar.errors``, ``sidecar.backoff``. Never ``sidecar.ingest``; the blob store only
through the protocols it declares (``LeaseStore``, ``BlobReads``, ``BlobWrites``), so the
flush core and its shell run against a fake store in the simulation.
"""
