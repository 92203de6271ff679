"""Flush: from the Redis buffer to each query's blob, under that blob's lease.

Owns: each query's record — what its blob holds (one value: its version and document, or
unknown), its lease, the acks waiting, the write in flight, the last row applied — with its
pure decisions (``core``) and their I/O shell (``blob_state``; what it keeps of a query is on
the record too: ``shell``), behind the one door the rest of the daemon holds (``owner``:
``FlushOwner``, fourteen verbs); the lease state machine
(``lease``, pure) and the calls that keep leases (``lease_manager``); the flusher's loop
(``flusher``), the documents it writes (``documents``) and unreadable records set aside
(``quarantine``).

May import: ``sidecar.model``, ``sidecar.buffer``, ``sidecar.telemetry``, ``sidecar.config``,
``sidecar.errors``, ``sidecar.backoff``. Never ``sidecar.ingest``; the blob store only
through the protocols it declares (``LeaseStore``, ``BlobReads``, ``BlobWrites``), so the
flush core and its shell run against a fake store in the simulation.
"""
