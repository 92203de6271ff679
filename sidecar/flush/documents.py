"""The document each flush writes: the new checkpoint, its writer, and the history carried
from what the blob holds (thinned to ``HISTORY_MAX_BYTES`` when offsets are wide, which is
logged once per query until it fits again).

The history (at most ``history_size`` earlier flushed checkpoints, newest first) is taken
from the document the blob holds — the one the flusher read after acquiring the lease, or the
one it last wrote under it (``QueryLease.blob_document``) — so keeping history costs no extra
blob read or write.
"""

from __future__ import annotations

import logging

from sidecar.model import checkpoint as ckpt
from sidecar.model import document

log = logging.getLogger("sidecar.flush.flusher")


class DocumentBuilder:
    def __init__(self, writer: document.Writer, history_size: int) -> None:
        self._writer = writer
        self._history_size = history_size
        #: Queries whose history was last thinned (logged once).
        self._thinned: set[str] = set()

    def build(
        self, checkpoint: ckpt.Checkpoint, previous: document.CheckpointDocument | None
    ) -> document.CheckpointDocument:
        """The document replacing ``previous`` (what the blob holds) with ``checkpoint``."""
        history, thinned = document.carry_history(previous, checkpoint.batch_id, self._history_size)
        query_id = checkpoint.query_id
        if thinned and query_id not in self._thinned:
            self._thinned.add(query_id)
            log.warning(
                "flush query=%s batch=%d: history thinned to %d of %d checkpoints to stay "
                "within %d bytes (wide offsets); lower SIDECAR_HISTORY_SIZE to silence this",
                checkpoint.label,
                checkpoint.batch_id,
                len(history),
                len(history) + thinned,
                document.HISTORY_MAX_BYTES,
            )
        elif not thinned:
            self._thinned.discard(query_id)
        return document.CheckpointDocument.of(checkpoint, self._writer, history, reset_of=previous)

    def forget(self, query_id: str) -> None:
        self._thinned.discard(query_id)
