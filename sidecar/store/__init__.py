"""The blob store: one checkpoint document per query in Azure Blob Storage.

Owns: the Azure edge (``blobs``: leased writes, reads, listing, lease calls, errors
translated; the only importer of ``azure``) and what the storage probe reports
(``probe``, pure). The lease *state* is the flusher's (``sidecar.flush.lease``).

May import: ``sidecar.model``, ``sidecar.config``, ``sidecar.errors``.
"""
