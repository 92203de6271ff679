"""Checkpoint snapshots: the state half of a Spark checkpoint, copied at consistent batch cuts.

Owns the reading side: which files of a query's Spark checkpoint directory form a
consistent cut of batch N — exactly what a restart from N reads, nothing of a later batch
(``cut``, pure: given a listing and a reader of a few small files) — and where those files
are read from: checkpoint locations found under a root, their listings, small reads, and
streams checked against the listing so that a file Spark deletes or rewrites mid-copy fails
that copy cleanly (``source``, the I/O edge, behind the ``CheckpointSource`` protocol; it only
reads), in one process at the lowest priority from where the packs are sent too (``worker``).

And the store's side, restic's design: the format — contents in packs, an index per snapshot,
their blob names (``index``, pure); one snapshot taken and uploaded, each content once, its
index last (``upload``), knowing what is stored where (``contents``); which snapshots are kept,
which blobs swept and which packs repacked (``retention``, pure) and the pass that does it
(``prune``); a snapshot restored into a directory, verified, and a query's snapshots listed
and found (``restore``), the full paths Spark recorded in it pointed at that directory
(``relocate``, pure). The blobs are reached through the ``SnapshotStore`` protocol
(``stored``, with retries), which ``sidecar.store.snapshots.SnapshotBlobs`` meets; the
daemon and the CLI hand it in. ``docs/snapshots.md`` says what a cut holds, how a snapshot is
stored, kept and restored.

May import: ``sidecar.model`` (Spark's log formats: ``spark_dir``; ``SnapshotRef``),
``sidecar.config``, ``sidecar.errors``, ``sidecar.backoff``; ``msgspec`` and, outside the pure
modules (``cut``, ``index``, ``relocate``, ``retention``), ``anyio`` (blocking file calls run
in worker threads). No SDK: the store only through ``stored.SnapshotStore``.
"""
