"""Retention and cleanup of one query's snapshots: the I/O shell of
``sidecar.snapshot.retention`` (which decides; its docstring says what and why).

One pass (:func:`prune`): list the query's snapshot blobs; read the indexes (those
``contents`` holds at the listed version are not read again) and the marks; plan; then, in
this order:

1. write the marks (conditionally: ``If-Match`` on the version read, or create-only) — a
   conflict means another pass is running: this one stops, changing nothing else;
2. delete the indexes beyond retention, then the packs the plan sweeps (idempotent: a blob
   already gone is fine). Indexes first: a crash between leaves unreferenced packs (swept by
   the next pass), never an index naming a deleted pack. Each delete names the version
   listed (``If-Match``): a blob changed since (an index another pass rewrote) is left for a
   later pass to judge;
3. repack: copy the live contents of the sparse packs into new packs (each content's
   SHA-256 checked on the way: a damaged one stops that repack and is reported), then rewrite
   every kept index that references them (``If-Match`` on the listed version: an index changed
   meanwhile is left as it is, its new pack unreferenced and swept later). The old packs,
   now unreferenced, are marked by the next pass and swept after the grace period.

A crash or failure at any point leaves only blobs a later pass deletes, and running a pass
twice is harmless. Run it from the owner of the query only, and never while that owner
uploads a snapshot of it (the snapshot loop runs them one after the other): ``contents`` is
kept true here (places in deleted packs forgotten, rewritten indexes learned). Ownership is
checked again before each phase (``owner``): a pass whose owner lost the query's lease
stops there, leaving the rest to the new owner.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from functools import partial

import anyio
import msgspec

from sidecar.errors import CorruptRecord, VersionConflict
from sidecar.model.document import SnapshotRef
from sidecar.snapshot.contents import Contents
from sidecar.snapshot.index import SnapshotIndex, encode_index, new_id, pack_name, prefix
from sidecar.snapshot.retention import (
    DEFAULT_ABANDONED_S,
    DEFAULT_GRACE_S,
    MAX_REPACK_BYTES,
    REPACK_BELOW,
    Listing,
    LiveEntry,
    PrunePlan,
    Repack,
    classify,
    decode_marks,
    encode_marks,
    marks_name,
    moved,
    plan,
)
from sidecar.snapshot.stored import (
    SnapshotStore,
    chunks_of,
    create,
    first_error,
    read_index,
    retried,
)

log = logging.getLogger(__name__)

#: Blobs read or deleted at once by a pass.
CONCURRENCY = 8
#: New packs of a repack are about this large (as the uploader's).
REPACK_TARGET_BYTES = 8 * 1024 * 1024
#: Live contents of one pack at most this far apart are read in one ranged request.
RANGE_GAP_BYTES = 64 * 1024


class PackDamaged(Exception):
    """A repacked content's bytes do not match its SHA-256."""


class PruneResult(msgspec.Struct, frozen=True, kw_only=True):
    """One pass: its plan, and what was done of it."""

    plan: PrunePlan
    deleted_indexes: int = 0
    deleted_packs: int = 0
    deleted_bytes: int = 0
    #: Packs repacked, live bytes copied, new packs written, indexes rewritten.
    repacked_packs: int = 0
    repacked_bytes: int = 0
    new_packs: int = 0
    rewritten_indexes: int = 0
    #: Another pass changed the marks or an index meanwhile: this one left that to it.
    conflicts: int = 0
    #: Packs whose contents do not match their checksums (not repacked).
    damaged: tuple[str, ...] = ()
    requests: dict[str, int] = {}


async def prune(
    blobs: SnapshotStore,
    namespace: str,
    query_id: str,
    *,
    retain: int,
    named: SnapshotRef | None,
    contents: Contents | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    repack_below: float = REPACK_BELOW,
    max_repack_bytes: int = MAX_REPACK_BYTES,
    repack_target_bytes: int = REPACK_TARGET_BYTES,
    clock: Callable[[], float] = time.time,
    owner: Callable[[], bool] = lambda: True,
    abandoned_s: float = DEFAULT_ABANDONED_S,
) -> PruneResult:
    """One pass over the query's snapshots (see the module docstring): keep the newest
    ``retain`` of the current timeline, the one the document ``named``, those of abandoned
    timelines younger than ``abandoned_s``, sweep what no kept index references after
    ``grace_s`` seconds, repack packs whose live share is below ``repack_below``.
    ``owner()``: whether this process still owns the query, asked before each phase.

    Raises:
        ValueError: ``retain`` < 1 (the newest snapshot is always kept) and the like.
        SidecarError: the store's errors after retries (``StoreUnavailable``); what was done
            before stays done, the next pass does the rest.
    """
    counted = blobs.counted()
    base = prefix(namespace, query_id)
    listed = await retried("list snapshots", lambda: counted.list(base))
    listing = classify(listed, namespace, query_id)
    listing, indexes = await _read_indexes(counted, listing, contents)
    marks = await _read_marks(counted, marks_name(namespace, query_id), listing.marks_version)
    decided = plan(
        listing,
        indexes,
        retain=retain,
        named=named,
        marks=marks.by_pack,
        now=clock(),
        grace_s=grace_s,
        repack_below=repack_below,
        max_repack_bytes=max_repack_bytes,
        abandoned_s=abandoned_s,
    )
    result = _Pass(counted, namespace, query_id, contents, decided, owner)
    if not result.still_owner("its marks"):
        return result.done()
    if not await result.write_marks(marks):
        return result.done()
    if not result.still_owner("its deletes"):
        return result.done()
    await result.delete()
    if not result.still_owner("its repack"):
        return result.done()
    await result.repack(repack_target_bytes)
    done = result.done()
    _report(query_id, done)
    return done


@dataclass(frozen=True, slots=True)
class _Marks:
    """The marks blob as read: its name, its marks (pack id → when first found unreferenced)
    and its version (None: not there, so written create-only)."""

    name: str
    by_pack: dict[str, float]
    version: str | None


async def _read_indexes(
    blobs: SnapshotStore, listing: Listing, contents: Contents | None
) -> tuple[Listing, dict[str, SnapshotIndex | None]]:
    """The listed indexes, :data:`CONCURRENCY` at a time (those ``contents`` holds at the listed
    version are not read again), None for one this version cannot read; and the listing
    without those deleted since it was taken."""
    if contents is not None:  # deleted elsewhere since: not kept in memory
        contents.keep_indexes({s.name for s in listing.indexes})
    indexes: dict[str, SnapshotIndex | None] = {}
    limiter = anyio.CapacityLimiter(CONCURRENCY)

    async def read(name: str, version: str) -> None:
        known = contents.index(name, version) if contents is not None else None
        if known is not None:
            indexes[name] = known
            return
        async with limiter:
            try:
                got = await read_index(blobs, name)
            except CorruptRecord as exc:
                log.error("snapshot index unreadable: blob=%s problem=%s", name, exc.problem)
                indexes[name] = None
                return
        if got is None:  # deleted since the listing (another pass): not ours to judge now
            return
        indexes[name] = got[0]
        if contents is not None:
            contents.remember(name, got[1], got[0])

    with first_error():
        async with anyio.create_task_group() as tg:
            for stored in listing.indexes:
                tg.start_soon(read, stored.name, stored.version)
    gone = {s.name for s in listing.indexes if s.name not in indexes}
    if gone:
        listing = msgspec.structs.replace(
            listing, indexes=tuple(s for s in listing.indexes if s.name not in gone)
        )
    return listing, indexes


async def _read_marks(blobs: SnapshotStore, name: str, listed_version: str | None) -> _Marks:
    """The marks blob ``name``, read only when the listing had it: none, and no version, when
    it was not listed or is gone since."""
    if listed_version is None:
        return _Marks(name, {}, None)
    found = await retried("read marks", lambda: blobs.read(name))
    if found is None:
        return _Marks(name, {}, None)
    return _Marks(name, decode_marks(found[0]), found[1])


def _report(query_id: str, done: PruneResult) -> None:
    """Log what the pass ``done`` did, if anything, and why it swept nothing when an index
    was unreadable."""
    decided = done.plan
    if done.deleted_indexes or done.deleted_packs or done.repacked_packs:
        log.info(
            "snapshots pruned: query=%s kept=%d deleted_indexes=%d deleted_packs=%d "
            "deleted_bytes=%d repacked_packs=%d repacked_bytes=%d live_bytes=%d "
            "stored_bytes=%d",
            query_id,
            len(decided.kept),
            done.deleted_indexes,
            done.deleted_packs,
            done.deleted_bytes,
            done.repacked_packs,
            done.repacked_bytes,
            decided.live_bytes,
            decided.stored_bytes,
        )
    if decided.unreadable:
        log.error(
            "snapshot prune swept nothing: query=%s unreadable_indexes=%s -- an index this "
            "version cannot read may reference any pack; run the version that wrote it, or "
            "delete the damaged index blob",
            query_id,
            ",".join(decided.unreadable),
        )


class _Pass:
    """The effects of one plan, and their count."""

    def __init__(
        self,
        blobs: SnapshotStore,
        namespace: str,
        query_id: str,
        contents: Contents | None,
        decided: PrunePlan,
        owner: Callable[[], bool],
    ) -> None:
        self.blobs, self.namespace, self.query_id = blobs, namespace, query_id
        self.contents, self.plan, self.owner = contents, decided, owner
        self.counts: dict[str, int] = {}
        self.damaged: list[str] = []
        self.indexes: dict[str, SnapshotIndex] = {}

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def done(self) -> PruneResult:
        n = self.counts.get
        return PruneResult(
            plan=self.plan,
            deleted_indexes=n("deleted_indexes", 0),
            deleted_packs=n("deleted_packs", 0),
            deleted_bytes=n("deleted_bytes", 0),
            repacked_packs=n("repacked_packs", 0),
            repacked_bytes=n("repacked_bytes", 0),
            new_packs=n("new_packs", 0),
            rewritten_indexes=n("rewritten_indexes", 0),
            conflicts=n("conflicts", 0),
            damaged=tuple(self.damaged),
            requests=dict(self.blobs.requests),
        )

    def still_owner(self, phase: str) -> bool:
        """Whether this process still owns the query, asked before each phase: if not, the
        pass stops before ``phase`` (counted as a conflict), leaving the rest to the new owner."""
        if self.owner():
            return True
        log.info(
            "snapshot prune stopped before %s: query=%s is no longer owned", phase, self.query_id
        )
        self.add("conflicts")
        return False

    async def write_marks(self, read: _Marks) -> bool:
        """Write the plan's marks where they differ from those ``read``, conditionally on the
        version read (create-only when none). False on a conflict: another pass is running,
        and this one stops, changing nothing else."""
        if self.plan.marks != read.by_pack or (read.version is None and self.plan.marks):
            body, version = encode_marks(self.plan.marks), read.version
            try:
                if version is None:
                    await create(self.blobs, read.name, lambda: chunks_of(body, len(body)))
                else:
                    await retried(
                        "write marks", lambda: self.blobs.replace(read.name, body, version)
                    )
            except VersionConflict:
                log.info("snapshot prune left to another pass: query=%s", self.query_id)
                self.add("conflicts")
                return False
        return True

    async def delete(self) -> None:
        limiter = anyio.CapacityLimiter(CONCURRENCY)

        async def delete(name: str, version: str | None, size: int, kind: str) -> None:
            async with limiter:
                try:
                    await retried(f"delete {name}", partial(self.blobs.delete, name, version))
                except VersionConflict:  # changed since listed: a later pass judges it
                    self.add("conflicts")
                    return
            self.add(kind)
            if kind == "deleted_packs":
                self.add("deleted_bytes", size)

        # Forgotten before they are deleted: a delete that fails may have landed, and a
        # place forgotten for nothing costs one upload again, never a broken snapshot.
        if self.contents is not None:
            self.contents.forget(indexes=[s.name for s in self.plan.delete_indexes])
        with first_error():
            async with anyio.create_task_group() as tg:
                for stored in self.plan.delete_indexes:
                    tg.start_soon(delete, stored.name, stored.version, 0, "deleted_indexes")
        if not self.still_owner("its pack deletes"):
            return
        if self.contents is not None:
            self.contents.forget(packs=[p.id for p in self.plan.delete_packs])
        with first_error():
            async with anyio.create_task_group() as tg:
                for pack in self.plan.delete_packs:
                    tg.start_soon(
                        delete, pack.name, pack.version or None, pack.size, "deleted_packs"
                    )

    async def repack(self, target_bytes: int) -> None:
        if not self.plan.repack:
            return
        # Group the sparse packs into new packs of about target_bytes of live contents.
        groups: list[list[Repack]] = [[]]
        size = 0
        for item in self.plan.repack:
            if groups[-1] and size + item.live_bytes > target_bytes:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += item.live_bytes
        moves: dict[tuple[str, int], tuple[str, int]] = {}
        sizes: dict[str, int] = {}
        retired: list[str] = []
        for group in groups:
            new_pack = new_id()
            placed: dict[tuple[str, int], tuple[str, int]] = {}
            offset = 0
            for item in group:
                for entry in item.live:
                    placed[(item.pack.id, entry.offset)] = (new_pack, offset)
                    offset += entry.size
            try:
                await create(
                    self.blobs,
                    pack_name(self.namespace, self.query_id, new_pack),
                    partial(self._copied, group),
                )
            except PackDamaged as exc:
                log.error("snapshot repack skipped: query=%s problem=%s", self.query_id, exc)
                continue
            moves.update(placed)
            sizes[new_pack] = offset
            retired.extend(item.pack.id for item in group)
            self.add("new_packs")
            self.add("repacked_packs", len(group))
            self.add("repacked_bytes", offset)
        if moves:
            await self._rewrite(moves, sizes)

    async def _copied(self, group: list[Repack]) -> AsyncGenerator[bytes, None]:
        """The live contents of ``group``'s packs, in order, each checked against its
        SHA-256; raises :class:`PackDamaged` (before the new pack is committed) on a mismatch."""
        block = self.blobs.block_bytes
        for item in group:
            for run in _runs(item.live, block):
                start = run[0].offset
                length = run[-1].offset + run[-1].size - start
                if len(run) == 1 and length > block:  # one large content: in slices
                    digest = hashlib.sha256()
                    for at in range(0, length, block):
                        piece = await retried(
                            f"read {item.pack.name}",
                            partial(
                                self.blobs.read_range,
                                item.pack.name,
                                start + at,
                                min(block, length - at),
                            ),
                        )
                        digest.update(piece)
                        yield piece
                    self._check(item, run[0], digest.digest())
                    continue
                data = await retried(
                    f"read {item.pack.name}",
                    partial(self.blobs.read_range, item.pack.name, start, length),
                )
                for entry in run:
                    piece = data[entry.offset - start : entry.offset - start + entry.size]
                    self._check(item, entry, hashlib.sha256(piece).digest())
                    yield piece

    def _check(self, item: Repack, entry: LiveEntry, sha: bytes) -> None:
        if sha != entry.sha256:
            self.damaged.append(item.pack.name)
            raise PackDamaged(
                f"{item.pack.name} at offset {entry.offset} ({entry.size} bytes) does not match "
                "its checksum: the pack is damaged; the snapshots using it cannot be restored "
                "(restore says which files)"
            )

    async def _rewrite(
        self, moves: dict[tuple[str, int], tuple[str, int]], sizes: dict[str, int]
    ) -> None:
        for stored in self.plan.kept:
            index = self.contents.index(stored.name, stored.version) if self.contents else None
            if index is None:
                got = await read_index(self.blobs, stored.name)
                if got is None or got[1] != stored.version:
                    self.add("conflicts")
                    continue
                index = got[0]
            rewritten = moved(index, moves, sizes)
            if rewritten is None:
                continue
            try:
                version = await retried(
                    f"rewrite {stored.name}",
                    partial(
                        self.blobs.replace, stored.name, encode_index(rewritten), stored.version
                    ),
                )
            except VersionConflict:
                self.add("conflicts")
                continue
            self.add("rewritten_indexes")
            if self.contents is not None:
                self.contents.learn(rewritten, name=stored.name, version=version)


def _runs(live: tuple[LiveEntry, ...], max_bytes: int) -> list[list[LiveEntry]]:
    """``live`` (by offset) in runs read by one ranged request each: entries at most
    :data:`RANGE_GAP_BYTES` apart, up to ``max_bytes`` a run (a larger entry alone)."""
    runs: list[list[LiveEntry]] = []
    for entry in live:
        if runs:
            run = runs[-1]
            start = run[0].offset
            gap = entry.offset - (run[-1].offset + run[-1].size)
            if gap <= RANGE_GAP_BYTES and entry.offset + entry.size - start <= max_bytes:
                run.append(entry)
                continue
        runs.append([entry])
    return runs
