"""Which snapshots are one timeline of a query, and which one a restore follows. Pure.

Batch numbers do not identify a timeline: after a rewind to batch M, Spark commits M + 1 …
again, and the abandoned M + 1 … are still stored. Samza's Checkpoint V2 ties a checkpoint
to its state by a marker; here the same three things do it:

- **The marker** is the checkpoint document's ``snapshot`` (``SnapshotRef``: batch, id and
  timeline). A flush moves it only along its own timeline (``follows``); a rewind or restore
  writes it with the new position, on a new timeline.
- **A snapshot's parent** is found by content, clock-free: the newest known snapshot of a
  batch b ≤ N whose ``offsets/b`` and ``commits/b`` the new cut of N holds byte-identical
  (Spark writes ``offsets/b`` with the batch's trigger time: a re-run batch differs).
- **A snapshot's timeline** is its parent's, or the marker's when its parent is the marker or
  a later snapshot of the marker's timeline. A cut whose parent is an older snapshot than
  the marker (or of another timeline) was taken of a directory on a timeline the document
  does not know: it is refused (:data:`OFF_TIMELINE`), never named.

::

    batch     48 ─ 49 ─ 50 ─ 51 ─ 52 … 100        timeline T1 (abandoned)
                         \\
                          51' ─ 52' … 61'         timeline T2 (current: the marker's)
    restore --batch 50 wrote the marker (50, T2)

The **current line** is the marker, the snapshots of its timeline, and its ancestors (by
parent). The **head** — what a restore writes back by default — is the newest snapshot of the
marker's timeline at or after it, else the marker itself. Everything else is **abandoned**:
rewind points, kept for a while by retention, never chosen by default.

A document whose marker has no timeline (written before timelines were kept), or no marker
at all, makes every snapshot current and the newest the head: as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from sidecar.model.document import SnapshotRef
from sidecar.snapshot.index import SnapshotIndex, new_id

#: The reason a cut off the document's timeline is refused.
OFF_TIMELINE = "off_timeline"


def tip_paths(batch: int) -> tuple[str, str]:
    """The files that identify a checkpoint's batch ``batch`` on its timeline."""
    return f"offsets/{batch}", f"commits/{batch}"


def tip(index: SnapshotIndex) -> tuple[bytes, bytes] | None:
    """The SHA-256 of ``index``'s own ``offsets/`` and ``commits/`` file (None: not both)."""
    wanted = tip_paths(index.batch)
    found = {f.path: f.sha256 for f in index.files if f.path in wanted}
    if len(found) != 2:
        return None
    return found[wanted[0]], found[wanted[1]]


def _newest_first(indexes: Iterable[SnapshotIndex]) -> list[SnapshotIndex]:
    return sorted(indexes, key=lambda i: (i.batch, i.created_at), reverse=True)


def parent_of(
    batch: int, shas: Mapping[str, bytes], known: Iterable[SnapshotIndex]
) -> SnapshotIndex | None:
    """The snapshot a cut of ``batch`` (its files' SHA-256 by path) follows: the newest of
    ``known`` at or below ``batch`` whose own ``offsets/`` and ``commits/`` files the cut
    holds identical; None when none is provable (a first snapshot, or Spark's retention
    deleted the files since the last one)."""
    for candidate in _newest_first(known):
        if candidate.batch > batch:
            continue
        mine = tip(candidate)
        if mine is not None and tuple(shas.get(p) for p in tip_paths(candidate.batch)) == mine:
            return candidate
    return None


class OffTimeline(Exception):
    """A cut whose lineage leaves the document's timeline (see the module docstring)."""


def place(parent: SnapshotIndex | None, marker: SnapshotRef | None) -> str:
    """The timeline of a new snapshot whose parent is ``parent``, the document's marker being
    ``marker``.

    Raises:
        OffTimeline: the parent is older than the marker on its line, or of another timeline:
            the directory is not where the document says the query is.
    """
    if marker is None:
        return (parent.timeline if parent is not None else None) or new_id()
    if parent is None:  # nothing provable: the directory is the query's, go on with it
        return marker.timeline or new_id()
    if parent.id == marker.id:
        return marker.timeline or parent.timeline or new_id()
    if marker.timeline is None:  # a marker of before timelines: by batch, as then
        if parent.batch >= marker.batch_id:
            return parent.timeline or new_id()
    elif parent.timeline == marker.timeline and parent.batch >= marker.batch_id:
        return marker.timeline
    raise OffTimeline(
        f"the checkpoint directory follows snapshot {parent.id} of batch {parent.batch} "
        f"(timeline {parent.timeline or 'none'}), not the snapshot its checkpoint document "
        f"names ({marker.id} of batch {marker.batch_id}, timeline {marker.timeline}): it was "
        "rewound or restored by something the sidecar did not record; not snapshotted until "
        "the two agree (restore it with 'checkpoint-sidecar restore', or reset the query)"
    )


def current(indexes: Iterable[SnapshotIndex], marker: SnapshotRef | None) -> set[str]:
    """The ids of ``indexes`` on the marker's current line (the module docstring): the
    marker, the snapshots of its timeline, and its ancestors."""
    found = list(indexes)
    if marker is None or marker.timeline is None:
        return {i.id for i in found}
    by_id = {i.id: i for i in found}
    line = {i.id for i in found if i.timeline == marker.timeline}
    line.add(marker.id)
    # Ancestors of the line's oldest snapshots (the marker's, then those before the rewind).
    for start in list(line):
        at = by_id.get(start)
        while at is not None and at.parent is not None and at.parent not in line:
            line.add(at.parent)
            at = by_id.get(at.parent)
    # Snapshots taken before lineage was kept (no timeline, no parent) up to the line's
    # oldest: its history, as far as can be told.
    on = [by_id[i] for i in line if i in by_id]
    if on:
        floor = min(i.batch for i in on)
        line.update(i.id for i in found if i.timeline is None and i.batch <= floor)
    return {i for i in line if i in by_id}


def head(indexes: Iterable[SnapshotIndex], marker: SnapshotRef | None) -> SnapshotIndex | None:
    """The snapshot a restore writes back by default: the newest of the marker's timeline at
    or after the marker, else the marker's own (None: it is not among ``indexes``); without a
    marker (or one of before timelines), the newest."""
    ordered = _newest_first(indexes)
    if marker is None:
        return ordered[0] if ordered else None
    for index in ordered:
        if index.id == marker.id:
            return index
        if (marker.timeline is None or index.timeline == marker.timeline) and (
            index.batch >= marker.batch_id
        ):
            return index
    return None


def marker_for(restored: SnapshotIndex, indexes: Iterable[SnapshotIndex],
               marker: SnapshotRef | None) -> SnapshotRef:  # fmt: skip
    """The marker a restore of ``restored`` writes: on the current timeline when it is that
    timeline's head (a lost volume restored: the timeline goes on), else on a new one (a
    rewind: the snapshots after it on its old timeline are abandoned)."""
    now = head(indexes, marker)
    if now is not None and now.id == restored.id and marker is not None and marker.timeline:
        return SnapshotRef(restored.batch, restored.id, marker.timeline)
    if now is not None and now.id == restored.id and restored.timeline and marker is None:
        return SnapshotRef(restored.batch, restored.id, restored.timeline)
    return SnapshotRef(restored.batch, restored.id, new_id())


def choose(
    indexes: Iterable[SnapshotIndex], marker: SnapshotRef | None, batch: int | None = None
) -> SnapshotIndex | None:
    """The snapshot a restore writes back: the head (``batch`` None), else one of ``batch`` —
    the current line's when it has one, else the newest of that batch (a rewind point of an
    abandoned timeline, asked for by its batch). None: there is none."""
    found = list(indexes)
    on_line = current(found, marker)
    if batch is None:
        chosen = head(found, marker)
        if chosen is None:  # the marker's snapshot is gone: the newest of its line
            chosen = next((i for i in _newest_first(found) if i.id in on_line), None)
        return chosen
    of_batch = [i for i in _newest_first(found) if i.batch == batch]
    return next((i for i in of_batch if i.id in on_line), of_batch[0] if of_batch else None)
