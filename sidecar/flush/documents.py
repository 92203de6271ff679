"""The document each flush writes: the new checkpoint, its writer, and the history carried
from what the blob holds (thinned to ``HISTORY_MAX_BYTES`` when offsets are wide, which is
logged once per query until it fits again).

The history (at most ``history_size`` earlier flushed checkpoints, newest first) is taken
from the document the blob holds — the one read after acquiring the lease, or the one last
written under it (``sidecar.flush.core``: the query's ``document``) — so keeping history costs
no extra blob read or write.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sidecar.model import checkpoint as ckpt
from sidecar.model import document, stateful

log = logging.getLogger("sidecar.flush.flusher")


class DocumentBuilder:
    def __init__(self, writer: document.Writer, history_size: int) -> None:
        self._writer = writer
        self._history_size = history_size

    def build(
        self,
        checkpoint: ckpt.Checkpoint,
        previous: document.CheckpointDocument | None,
        first_thinned: Callable[[bool], bool],
        snapshot: document.SnapshotRef | None = None,
    ) -> document.CheckpointDocument:
        """The document replacing ``previous`` (what the blob holds) with ``checkpoint``;
        ``first_thinned(thinned)``: told whether its history was thinned, says whether that
        is new (the query's record remembers: logged once until it fits again); ``snapshot``:
        the query's newest snapshot, which the document names (else ``previous``'s)."""
        history, thinned = document.carry_history(previous, checkpoint.batch_id, self._history_size)
        if first_thinned(bool(thinned)):
            log.warning(
                "flush query=%s batch=%d: history thinned to %d of %d checkpoints to stay "
                "within %d bytes (wide offsets); lower SIDECAR_HISTORY_SIZE to silence this",
                checkpoint.label,
                checkpoint.batch_id,
                len(history),
                len(history) + thinned,
                document.HISTORY_MAX_BYTES,
            )
        # What the blob said of state sticks (sidecar.model.stateful): a progress without state
        # operators settles "unknown", never lowers "stateful".
        checkpoint = stateful.carry(previous, checkpoint)
        return document.CheckpointDocument.of(
            checkpoint, self._writer, history, reset_of=previous, snapshot=snapshot
        )
