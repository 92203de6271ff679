"""The daemon: the components wired into one task group, and what spans them.

Owns: the wiring and the start and stop order (``app``), the stop's budget (``shutdown``),
``/metrics``, ``/healthz`` and ``/readyz`` (``http``), what an ack is worth (``durability``),
retiring idle queries (``retirement``), the daemon's side of ``reset``/``retire``
(``admin_ops``), this process's lease id, handed over only within its pod (``ownership``), and
the store's health when idle (``store_watch``).

May import: every package below it (``ingest``, ``flush``, ``kafka``, ``ops``, ``buffer``,
``store``, ``telemetry``, ``wire``, ``model``) and the base modules. Nothing imports it but
``sidecar.cli``.
"""
