"""What one process knows is stored of one query's snapshots: each content's place.

A file's **content** is its SHA-256. :class:`Contents` answers two questions for the uploader
(``sidecar.snapshot.upload``):

- *which content is this version of that file?* — (path, size, stamp) → SHA-256, for the files
  of the last snapshot written through it (a stamp is the source's token for one version of a
  file: inode and mtime on a volume, an ETag on blob storage). A file whose listing matches is
  not read again. Only the last cut's files are remembered: memory is bounded by one cut.
- *where are that content's bytes?* — SHA-256 → (pack, offset), for every content of every
  index it learned, and each pack's size. Such a content is never uploaded again; its CRC-32C
  (when an index had it) goes into the entries that reuse it.

It is learned from the indexes a snapshot writes (:meth:`Contents.learn`), and rebuilt from the
kept indexes by a new process (:meth:`Contents.load`: no stamps then, so the first snapshot
after a restart reads and hashes every file once, and uploads none it finds stored). Prune
keeps it true (:meth:`Contents.forget` the packs it deletes, :meth:`Contents.learn` the indexes
it rewrites), and keeps the indexes it read here (name, version) so the next pass reads only
what changed.

**Invariant.** Every place it gives is in a pack that a kept index referenced when it was
learned and that this process has not deleted. A place whose pack another process deleted
meanwhile can only come from a snapshot in flight during an ownership handover; the grace
period of ``sidecar.snapshot.retention`` covers that window, and :meth:`Contents.load`
learns nothing from a pack that is not listed, so a broken index never spreads.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, KeysView, Mapping

from sidecar.snapshot.index import SnapshotIndex, prefix
from sidecar.snapshot.retention import classify
from sidecar.snapshot.stored import SnapshotStore, read_indexes, retried


class Contents:
    """The content map of one query (see the module docstring). Not shared between queries."""

    def __init__(self) -> None:
        self._stamps: dict[tuple[str, int, str], bytes] = {}
        self._where: dict[bytes, tuple[str, int]] = {}
        self._crcs: dict[bytes, int] = {}
        self._packs: dict[str, int] = {}
        self._indexes: dict[str, tuple[str, SnapshotIndex]] = {}

    @classmethod
    async def load(cls, blobs: SnapshotStore, namespace: str, query_id: str) -> Contents:
        """The contents of the query's listed indexes (one listing, a read per index), for a
        process that starts. Unreadable indexes are skipped (logged); so are files whose pack
        is not listed.

        Raises:
            SidecarError: the store's errors (``StoreUnavailable`` after retries).
        """
        contents = cls()
        listed = await retried("list snapshots", lambda: blobs.list(prefix(namespace, query_id)))
        listing = classify(listed, namespace, query_id)
        found = await read_indexes(blobs, [stored.name for stored in listing.indexes])
        for stored in reversed(listing.indexes):  # oldest first: the newest place wins
            if stored.name in found:
                index, version = found[stored.name]
                contents.learn(index, name=stored.name, version=version, present=listing.packs)
        return contents

    def learn(
        self,
        index: SnapshotIndex,
        *,
        name: str | None = None,
        version: str | None = None,
        stamps: Mapping[str, str] | None = None,
        present: Collection[str] | None = None,
    ) -> None:
        """Know ``index``'s contents: each file's place (the newest learned wins) and its
        packs' sizes; keep it as the index blob ``name`` at ``version``, when given (prune's
        reads; a ``version`` of "" — a create that found its blob there, an earlier send of
        its own that landed — keeps it all the same, read again by prune to learn its
        version). ``stamps``: path → stamp of the files of the cut it was taken from, which
        replace the remembered stamps. ``present``: learn only places in these packs."""
        for f in index.files:
            if f.size and (present is None or f.pack in present):
                self._where[f.sha256] = (f.pack, f.offset)
                if f.crc32c is not None:
                    self._crcs[f.sha256] = f.crc32c
        for pack, size in index.packs.items():
            if present is None or pack in present:
                self._packs[pack] = size
        if stamps is not None:
            self._stamps = {
                (f.path, f.size, stamps[f.path]): f.sha256 for f in index.files if f.path in stamps
            }
        if name is not None:
            # Kept even without its version: it is the query's lineage. Left out, the next
            # snapshot took the one before it for its parent while the document named it, and
            # every later one was refused off_timeline until a restart (the snapshot nemesis,
            # a reset after an index write ran).
            self._indexes[name] = (version or "", index)

    def remember(self, name: str, version: str, index: SnapshotIndex) -> None:
        """Keep the index blob ``name`` at ``version`` (prune's reads), learning nothing of
        its places (an index prune may delete must not move the newest places)."""
        self._indexes[name] = (version, index)

    def forget(self, *, packs: Iterable[str] = (), indexes: Iterable[str] = ()) -> None:
        """Forget the places in ``packs`` (deleted) and the index blobs ``indexes`` (deleted)."""
        gone = set(packs)
        if gone:
            self._where = {sha: at for sha, at in self._where.items() if at[0] not in gone}
            self._crcs = {sha: crc for sha, crc in self._crcs.items() if sha in self._where}
            for pack in gone:
                self._packs.pop(pack, None)
        for name in indexes:
            self._indexes.pop(name, None)

    def identify(self, path: str, size: int, stamp: str) -> bytes | None:
        """The SHA-256 of that version of the file, when the last snapshot had it (and a
        stamp is known for it); None: read it."""
        return self._stamps.get((path, size, stamp)) if stamp else None

    def locate(self, sha256: bytes) -> tuple[str, int] | None:
        """Where that content's bytes are stored: (pack, offset); None when not known."""
        return self._where.get(sha256)

    def stored(self) -> KeysView[bytes]:
        """Every content known to be stored (its SHA-256)."""
        return self._where.keys()

    def crc32c(self, sha256: bytes) -> int | None:
        """That content's CRC-32C, when an index learned had it."""
        return self._crcs.get(sha256)

    def pack_size(self, pack: str) -> int | None:
        return self._packs.get(pack)

    def index(self, name: str, version: str) -> SnapshotIndex | None:
        """The index blob ``name`` as learned, if still at ``version``."""
        kept = self._indexes.get(name)
        return kept[1] if kept is not None and kept[0] == version else None

    def indexes(self) -> list[SnapshotIndex]:
        """Every index kept here (the listed ones, as learned): the query's lineage."""
        return [index for _, index in self._indexes.values()]

    def keep_indexes(self, names: Collection[str]) -> None:
        """Forget every index blob kept but ``names`` (those a listing still shows)."""
        self._indexes = {n: kept for n, kept in self._indexes.items() if n in names}

    @property
    def known(self) -> int:
        """Distinct contents known to be stored."""
        return len(self._where)
