"""Checkpoint snapshots: the state half of a Spark checkpoint, copied at consistent batch cuts.

Owns, so far, the reading side: which files of a query's Spark checkpoint directory form a
consistent cut of batch N — exactly what a restart from N reads, nothing of a later batch
(``cut``, pure: given a listing and a reader of a few small files) — and where those files
are read from: checkpoint locations found under a root, their listings, small reads, and
streams checked against the listing so that a file Spark deletes or rewrites mid-copy fails
that copy cleanly (``source``, the I/O edge, behind the ``CheckpointSource`` protocol).
``docs/snapshots.md`` says what a cut holds and why.

May import: ``sidecar.model`` (Spark's log formats: ``spark_dir``), ``sidecar.config``,
``sidecar.errors``; ``msgspec`` and, in ``source`` only, ``anyio`` (blocking file calls run
in worker threads). ``cut`` is pure: no event loop, no SDK, no filesystem call of its own.
"""
