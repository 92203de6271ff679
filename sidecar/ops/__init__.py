"""Operator tools, with or without a running daemon.

Owns: the async socket client (``client``), ``doctor``'s checks (``doctor``, gathering facts
through the edges; ``diagnosis``, the pure rules), ``list``/``show``/``history`` read from
the blobs (``inspection``), the steps of ``reset``/``retire`` that both the daemon and the
CLI run (``admin_steps``), the CLI's side of them (``admin_tool``: through the daemon, else
under a lease of its own) and ``import-spark-checkpoint``'s reading side
(``spark_import``).

May import: ``sidecar.wire``, ``sidecar.model``, ``sidecar.buffer``, ``sidecar.store``,
``sidecar.kafka`` (doctor's consumer-group check; a reset's groups set without a daemon),
``sidecar.eventhubs`` (a reset's checkpoints set without a daemon), ``sidecar.config``,
``sidecar.errors``.
Never the daemon's components: the daemon imports these, not the other way round.
"""
