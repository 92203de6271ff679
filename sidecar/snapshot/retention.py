"""Which snapshots a query keeps, which blobs are garbage, which packs to repack. Pure.

Given one listing of a query's snapshot blobs (:func:`classify`), the indexes read, the marks
of the previous pass and the clock, :func:`plan` decides; ``sidecar.snapshot.prune`` performs
what it decides. Mark and sweep, as restic's ``prune`` and git's ``gc``:

**Kept** are, by timeline (``sidecar.snapshot.lineage``): always the one the checkpoint
document names (its marker, ``SnapshotRef``), whatever its age or state; the newest ``retain``
intact snapshots (by batch, then time written) of the marker's current line; and abandoned
ones (a rewind's old timeline, kept as rewind points) while younger than ``abandoned_s``. An index
naming a pack that is not in the listing is **broken** (it cannot be restored): reported,
never counted among the ``retain``, deleted unless the document names it. An index that
cannot be read (damaged, or another version's format) is **unreadable**: never deleted, and
while one exists no pack is deleted or repacked — what it references is unknown.

**Deleted** are every other readable index (beyond retention, or broken), and every pack no
kept index references once it has been seen unreferenced for ``grace_s`` *and* was written
at least ``grace_s`` ago. The first time a pass sees a pack unreferenced it **marks** it
(the marks blob, :func:`marks_name`: pack id → when first seen so); a pack referenced again
loses its mark. So the grace period is "unreferenced for that long", which protects:

- a snapshot being written: its packs are up before its index (written last) names them;
- a snapshot in flight that reuses content of a pack this pass finds unreferenced (another
  process's upload during an ownership handover): once its index lands, the pack is
  referenced again and spared;
- a restore reading an index that was deleted or rewritten meanwhile.

The grace period must outlast the longest snapshot upload and restore (``DEFAULT_GRACE_S``).

**Repacked** are packs whose live bytes — the distinct contents kept indexes reference in
them — are below ``repack_below`` of their size (:data:`REPACK_BELOW`, 50 %): their live
contents are copied into new packs, every kept index referencing them is rewritten to point
there (:func:`moved`), and the old packs, unreferenced, are swept by a later pass after the
grace period. After a pass every pack kept has at least half its bytes live, so dead bytes
stay under half of what is stored (plus, until swept, what the grace period holds).
At most ``max_repack_bytes`` of live bytes are copied per pass, the sparsest packs first.

Index deletions never break a kept snapshot (packs a kept index references are never
deleted), and nothing here needs a lock: every decision is taken again, from a new listing,
by the next pass; a crash at any point leaves blobs that pass deletes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Protocol

import msgspec

from sidecar.model.document import SnapshotRef
from sidecar.snapshot import lineage
from sidecar.snapshot.index import (
    FileEntry,
    SnapshotIndex,
    parse_index_name,
    parse_pack_name,
    prefix,
)

#: A pack is repacked when its live bytes are below this share of its size.
REPACK_BELOW = 0.5
#: How long a pack stays after a pass first finds no kept index referencing it, seconds: it
#: must outlast the longest snapshot upload and the longest restore.
DEFAULT_GRACE_S = 3600.0
#: How long snapshots of an abandoned timeline (a rewind's old one) are kept after they were
#: taken, seconds (``SIDECAR_SNAPSHOT_ABANDONED_KEEP_S``).
DEFAULT_ABANDONED_S = 7 * 86400.0
#: Live bytes copied by one pass's repacks at most (the sparsest packs first).
MAX_REPACK_BYTES = 256 * 1024 * 1024
#: The marks blob's name, under the query's snapshot prefix.
MARKS = "unreferenced"


class ListedLike(Protocol):
    """A blob as a listing shows it (``sidecar.store.snapshots.ListedBlob``)."""

    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def version(self) -> str: ...
    @property
    def last_modified(self) -> datetime | None: ...


class StoredIndex(msgspec.Struct, frozen=True):
    """An index blob as listed."""

    name: str
    batch: int
    id: str
    version: str
    #: Seconds since the epoch; 0 when the listing did not say.
    written_at: float


class StoredPack(msgspec.Struct, frozen=True):
    """A pack blob as listed."""

    name: str
    id: str
    size: int
    #: Seconds since the epoch; 0 when the listing did not say.
    written_at: float
    #: Its version as listed: a delete names it (``If-Match``).
    version: str = ""


class Listing(msgspec.Struct, frozen=True):
    """One listing of a query's snapshot blobs, sorted out."""

    #: Newest first: by batch, then time written, then id.
    indexes: tuple[StoredIndex, ...]
    packs: dict[str, StoredPack]
    #: The marks blob's version, when listed.
    marks_version: str | None
    #: Other blobs under the prefix (not ours to judge): left alone.
    other: tuple[str, ...] = ()


def marks_name(namespace: str, query_id: str) -> str:
    """The blob holding the marks (pack id → when first found unreferenced)."""
    return f"{prefix(namespace, query_id)}{MARKS}"


def _seconds(when: datetime | None) -> float:
    return when.timestamp() if when is not None else 0.0


def classify(listed: Iterable[ListedLike], namespace: str, query_id: str) -> Listing:
    """The blobs of one listing of the query's prefix (``index.prefix``), sorted out."""
    base = prefix(namespace, query_id)
    indexes: list[StoredIndex] = []
    packs: dict[str, StoredPack] = {}
    marks_version: str | None = None
    other: list[str] = []
    for blob in listed:
        rest = blob.name.removeprefix(base)
        parsed = parse_index_name(blob.name) if rest.startswith("index/") else None
        pack_id = parse_pack_name(blob.name) if rest.startswith("packs/") else None
        if parsed is not None and rest.count("/") == 1:
            batch, snapshot_id = parsed
            indexes.append(
                StoredIndex(
                    blob.name, batch, snapshot_id, blob.version, _seconds(blob.last_modified)
                )
            )
        elif pack_id is not None and rest.count("/") == 1:
            packs[pack_id] = StoredPack(
                blob.name, pack_id, blob.size, _seconds(blob.last_modified), blob.version
            )
        elif rest == MARKS:
            marks_version = blob.version
        else:
            other.append(blob.name)
    indexes.sort(key=lambda i: (i.batch, i.written_at, i.id), reverse=True)
    return Listing(tuple(indexes), packs, marks_version, tuple(other))


_marks_encoder = msgspec.msgpack.Encoder()
_marks_decoder = msgspec.msgpack.Decoder(dict[str, float])


def encode_marks(marks: Mapping[str, float]) -> bytes:
    return _marks_encoder.encode(dict(sorted(marks.items())))


def decode_marks(body: bytes) -> dict[str, float]:
    """The marks; empty when the body is not readable (marking starts again: that only
    delays a deletion by the grace period, never hastens one)."""
    try:
        return _marks_decoder.decode(body)
    except msgspec.DecodeError:
        return {}


class LiveEntry(msgspec.Struct, frozen=True, array_like=True):
    """A content a kept index references in a pack."""

    offset: int
    size: int
    sha256: bytes


class Repack(msgspec.Struct, frozen=True):
    """A pack to repack: its live contents, by offset."""

    pack: StoredPack
    live: tuple[LiveEntry, ...]

    @property
    def live_bytes(self) -> int:
        return sum(e.size for e in self.live)


class PrunePlan(msgspec.Struct, frozen=True):
    """What one pass does (see the module docstring)."""

    kept: tuple[StoredIndex, ...]
    delete_indexes: tuple[StoredIndex, ...]
    delete_packs: tuple[StoredPack, ...]
    repack: tuple[Repack, ...]
    #: The marks after this pass (pack id → seconds since the epoch).
    marks: dict[str, float]
    #: Indexes naming a pack not in the listing.
    broken: tuple[str, ...]
    #: Indexes that could not be read: they block every pack deletion and repack.
    unreadable: tuple[str, ...]
    #: Bytes of every pack listed; of the contents kept indexes reference in them.
    stored_bytes: int
    live_bytes: int

    @property
    def dead_bytes(self) -> int:
        return self.stored_bytes - self.live_bytes

    @property
    def blocked(self) -> bool:
        """No pack is deleted or repacked this pass (an index could not be read)."""
        return bool(self.unreadable)


def _broken(index: SnapshotIndex, packs: Mapping[str, StoredPack]) -> bool:
    return any(f.size and f.pack not in packs for f in index.files)


def plan(
    listing: Listing,
    indexes: Mapping[str, SnapshotIndex | None],
    *,
    retain: int,
    named: SnapshotRef | None,
    marks: Mapping[str, float],
    now: float,
    grace_s: float = DEFAULT_GRACE_S,
    repack_below: float = REPACK_BELOW,
    max_repack_bytes: int = MAX_REPACK_BYTES,
    abandoned_s: float = DEFAULT_ABANDONED_S,
) -> PrunePlan:
    """The pass over ``listing`` (see the module docstring).

    ``indexes``: each listed index's name → its content, or None when it could not be read;
    a listed index missing here counts as unreadable. ``named``: the snapshot the checkpoint
    document names (kept whatever happens; its timeline is the current one). ``marks``: as
    the marks blob held them. ``now`` and the marks are seconds since the epoch.
    ``abandoned_s``: how long a snapshot off the current line is kept after it was taken.

    Raises:
        ValueError: ``retain`` < 1, ``grace_s`` < 0 or ``repack_below`` not in [0, 1].
    """
    if retain < 1:
        raise ValueError(f"retain must be >= 1 (the newest snapshot is always kept), got {retain}")
    if grace_s < 0 or not 0 <= repack_below <= 1:
        raise ValueError(f"need grace_s >= 0 and 0 <= repack_below <= 1: {grace_s}, {repack_below}")
    kept: list[StoredIndex] = []
    delete: list[StoredIndex] = []
    broken: list[str] = []
    unreadable: list[str] = []
    intact = 0
    on_line = lineage.current([i for i in indexes.values() if i is not None], named)
    for stored in listing.indexes:  # newest first
        index = indexes.get(stored.name)
        if index is None:
            unreadable.append(stored.name)
            continue
        is_named = named is not None and (named.batch_id, named.id) == (stored.batch, stored.id)
        is_broken = _broken(index, listing.packs)
        if is_broken:
            broken.append(stored.name)
        if index.id not in on_line:  # abandoned: a rewind point, for a while
            young = now - _taken_at(index) < abandoned_s
            (kept if is_named or (young and not is_broken) else delete).append(stored)
        elif is_named or (not is_broken and intact < retain):
            kept.append(stored)
            intact += not is_broken
        else:
            delete.append(stored)

    # What kept snapshots reference: pack → offset → entry.
    live: dict[str, dict[int, LiveEntry]] = {}
    for stored in kept:
        for f in _files(indexes[stored.name]):
            if f.size and f.pack in listing.packs:
                live.setdefault(f.pack, {})[f.offset] = LiveEntry(f.offset, f.size, f.sha256)

    blocked = bool(unreadable)
    new_marks: dict[str, float] = {}
    delete_packs: list[StoredPack] = []
    candidates: list[Repack] = []
    for pack_id, pack in sorted(listing.packs.items()):
        entries = live.get(pack_id)
        if entries is None:
            marked = marks.get(pack_id, now)
            new_marks[pack_id] = marked
            old_enough = now - pack.written_at >= grace_s
            if not blocked and now - marked >= grace_s and old_enough:
                delete_packs.append(pack)
            continue
        live_bytes = sum(e.size for e in entries.values())
        if live_bytes < repack_below * pack.size:
            candidates.append(Repack(pack, tuple(entries[o] for o in sorted(entries))))
    for pack in delete_packs:
        del new_marks[pack.id]

    repack: list[Repack] = []
    if not blocked:
        budget = max_repack_bytes
        candidates.sort(key=lambda r: (r.live_bytes / max(r.pack.size, 1), r.pack.id))
        for candidate in candidates:
            if repack and candidate.live_bytes > budget:
                break
            repack.append(candidate)
            budget -= candidate.live_bytes

    return PrunePlan(
        kept=tuple(kept),
        delete_indexes=tuple(delete),
        delete_packs=tuple(delete_packs),
        repack=tuple(repack),
        marks=new_marks,
        broken=tuple(broken),
        unreadable=tuple(unreadable),
        stored_bytes=sum(p.size for p in listing.packs.values()),
        live_bytes=sum(e.size for entries in live.values() for e in entries.values()),
    )


def _taken_at(index: SnapshotIndex) -> float:
    """When ``index`` was written, seconds since the epoch (0: not readable: old)."""
    try:
        return datetime.fromisoformat(index.created_at).timestamp()
    except ValueError:
        return 0.0


def _files(index: SnapshotIndex | None) -> tuple[FileEntry, ...]:
    return () if index is None else index.files


def moved(
    index: SnapshotIndex,
    moves: Mapping[tuple[str, int], tuple[str, int]],
    sizes: Mapping[str, int],
) -> SnapshotIndex | None:
    """``index`` with each file whose bytes are at a (pack, offset) of ``moves`` pointing to
    where they were copied, and its packs recounted (``sizes``: the new packs' sizes); None
    when no file of it moved.

    Raises:
        KeyError: a new pack's size is not in ``sizes``.
    """
    files = []
    changed = False
    for f in index.files:
        to = moves.get((f.pack, f.offset)) if f.size else None
        if to is None:
            files.append(f)
        else:
            files.append(msgspec.structs.replace(f, pack=to[0], offset=to[1]))
            changed = True
    if not changed:
        return None
    used = {f.pack for f in files if f.size}
    packs = {p: index.packs[p] if p in index.packs else sizes[p] for p in sorted(used)}
    return msgspec.structs.replace(index, files=tuple(files), packs=packs)
