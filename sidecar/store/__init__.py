"""The blob store: one checkpoint document per query in Azure Blob Storage.

Owns: the Azure edge, one job per module: the account (``account``: clients and credential,
every call time-limited with its errors translated, the store's health, the container), the
checkpoint documents (``blobs``: leased writes, reads, listing, lease calls; doctor's probe
calls), the Event Hubs checkpoint blobs (``eventhubs``), the snapshot blobs (``snapshots``,
and ``remote`` from a worker process); the SDK imported at first use (``sdk``; ``account``,
``blobs``, ``eventhubs`` and ``remote`` the only other importers of ``azure``); and what the
storage probe reports (``probe``, pure). The lease *state* is the flusher's
(``sidecar.flush.lease``).

May import: ``sidecar.model``, ``sidecar.config``, ``sidecar.errors``.
"""
