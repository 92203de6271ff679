"""``checkpoint-sidecar snapshots`` and ``restore``: a query's snapshots listed, one written back
as a Spark checkpoint directory, and the sidecar's checkpoint moved with it.

A restore of snapshot N (``sidecar.snapshot.restore``: every file's checksum verified, written
into a directory nothing else uses, renamed into place at the end) then moves the sidecar's
checkpoint of the query to batch N **through the same path as a reset** — an import of the
restored directory (``sidecar.ops.spark_import``): through the daemon when one runs, else
under a lease of its own (taken first: an old pod's daemon may still hold it, so it is waited
for, up to :data:`LEASE_WAIT_S`); the document, its history and reset fields, Redis' rows
newer than N voided. The state moved with the offsets, so the stateful-rewind rule lets it
through (``state_rewound``); ``--force`` is implied for the quiet time (the query is not
running: its checkpoint directory was lost).

Which snapshot: the one the checkpoint document's marker leads to (``sidecar.snapshot.
lineage``: the newest of the marker's timeline at or after it), never merely the newest — a
rewind's abandoned snapshots have higher batch numbers. The restore writes the marker with
the position: on the same timeline when it restored that head, on a new one otherwise (a
rewind).

``restore --all ROOT`` is an init container's form: every query of the namespace that has a
snapshot is put back at the location it was snapshotted from (relative to the root). What it
finds there decides, query by query, by identity before batch numbers (:func:`judge`; B is
the head's batch, C the directory's newest commit):

=============================================  ==========================================
the location holds                             restore --all
=============================================  ==========================================
nothing (a lost or new volume)                 restores the head
no ``metadata`` (a restore cut short, files    restores over it: Spark could not resume
of no checkpoint)                              from it (it would start a new query)
**another query's** ``metadata`` (the          nothing written (outcome ``elsewhere``, not
location reused by a new query)                a failure): this query is gone from there;
                                               its snapshots are reclaimed after a while
this query's, C ≥ B, ``offsets/B`` and         kept (a pod restarted on its volume, or a
``commits/B`` identical to the head's          rewound query run on); when C = B and the
                                               checkpoint document names a later batch
                                               (a restore killed before it moved the
                                               checkpoint), the checkpoint moved to B
this query's, C ≥ B, those files differ        refused: a timeline the document does not
                                               know (rewound by hand?)
this query's, C ≥ B, those files gone          kept (Spark's retention deleted them: it
                                               is newer)
this query's, no commit, or C < B (its own     restores over it (behind on the same line)
files identical to the head's, or gone)
this query's, C < B, its files differ          refused: another timeline
=============================================  ==========================================

A broken snapshot (a pack missing, a checksum) is skipped, said loudly, for the newest intact
one before it on its timeline. One query's failure (refused, no intact snapshot, the store, a
directory it may not write) never stops the others: each gets one line, and the command exits
1 at the end if any failed.

Long work shows progress: each restore tells a ``sidecar.snapshot.restore.Progress`` sink
that the caller makes for it (:data:`Watch`: the CLI's bar on a terminal, or a log line every
few seconds); and its figures (files, bytes, seconds) go with its reset, which keeps them in
Redis for the daemon to export (``checkpoint_sidecar_restore_*``: a restore in an init
container is never scraped).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec

from sidecar.config import Config
from sidecar.errors import AdminRefused, CorruptRecord, NotFound, SidecarError
from sidecar.model.checkpoint import Position
from sidecar.model.document import SnapshotRef
from sidecar.model.restored import RestoreStats
from sidecar.model.spark_dir import SparkCheckpointError, parse_query_metadata
from sidecar.ops import admin_tool, spark_import
from sidecar.snapshot import lineage
from sidecar.snapshot.index import SnapshotIndex, all_prefix
from sidecar.snapshot.reclaim import GoneRecord, mark_gone, read_gone
from sidecar.snapshot.restore import (
    LEFTOVER_QUIET_S,
    Checked,
    Progress,
    RestoreError,
    SnapshotNotFound,
    check_snapshots,
    list_snapshots,
    restore,
    tidy,
)
from sidecar.store.blobs import BlobStore, newest_named
from sidecar.store.snapshots import SnapshotBlobs

log = logging.getLogger(__name__)

#: How long a restore waits for an old pod's daemon to let go of the query's lease.
LEASE_WAIT_S = 120.0

#: The caller's progress sink for one restore: made for the query's label and the snapshot
#: about to be written (a broken one skipped for an older one gets a sink of its own).
Watch = Callable[[str, SnapshotIndex], Progress]


class SnapshotRow(msgspec.Struct, frozen=True):
    """One snapshot as ``snapshots --json`` lists it."""

    batch_id: int
    id: str
    created_at: str
    files: int
    bytes: int
    new_bytes: int
    location: str
    #: Its lineage: the snapshot it follows and its timeline (None: before they were kept).
    parent: str | None = None
    timeline: str | None = None
    #: "current" (on the timeline of the document's marker) or "abandoned" (a rewind point
    #: of a timeline the query left); whether the document names it (its marker).
    line: str = "current"
    marker: bool = False


class Restored(msgspec.Struct, frozen=True):
    """What one restore did (``restore --json``)."""

    query_id: str
    name: str | None
    batch_id: int
    snapshot: str
    directory: str
    files: int
    bytes: int
    seconds: float
    #: "restored", or why not: "newer" (the directory holds a checkpoint on its timeline, at
    #: least as new), "elsewhere" (it holds another query's checkpoint: the location was
    #: reused; this query's snapshots are reclaimed after a while), "refused" (a timeline
    #: the checkpoint does not know, or not a checkpoint location), "failed" (``error``).
    outcome: str = "restored"
    #: The reset's one-line summary (how the sidecar's checkpoint moved), when it did.
    checkpoint: str | None = None
    #: Why it was refused or failed.
    error: str | None = None
    #: Snapshots found broken (a pack missing, a checksum) and skipped for an older one of
    #: the same timeline, each as its error said.
    broken: tuple[str, ...] = ()
    #: The timeline the checkpoint's marker names after the restore (None: not restored, or
    #: a snapshot of before timelines were kept).
    timeline: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome in ("restored", "newer", "elsewhere")

    @classmethod
    def of(
        cls,
        query_id: str,
        name: str | None,
        index: SnapshotIndex,
        dest: Path,
        *,
        seconds: float | None = None,
        outcome: str = "restored",
        checkpoint: str | None = None,
        error: str | None = None,
        broken: tuple[str, ...] = (),
        timeline: str | None = None,
    ) -> Restored:
        """What was done with ``index`` at ``dest``: restored in ``seconds`` (its files and
        bytes counted), or not (``outcome``: none counted)."""
        written = seconds is not None
        return cls(
            query_id,
            name,
            index.batch,
            index.id,
            str(dest),
            len(index.files) if written else 0,
            index.total_bytes if written else 0,
            round(seconds, 3) if seconds is not None else 0.0,
            outcome,
            checkpoint,
            error,
            broken,
            timeline,
        )


def rows(indexes: list[SnapshotIndex], marker: SnapshotRef | None) -> list[SnapshotRow]:
    """The snapshots as listed, each with its line (current or abandoned)."""
    on_line = lineage.current(indexes, marker)
    return [
        SnapshotRow(
            index.batch,
            index.id,
            index.created_at,
            len(index.files),
            index.total_bytes,
            index.new_bytes,
            index.location,
            index.parent,
            index.timeline,
            "current" if index.id in on_line else "abandoned",
            marker is not None and marker.id == index.id,
        )
        for index in indexes
    ]


async def resolve(store: BlobStore, query: str) -> tuple[str, str | None]:
    """A query id, or the name of the newest query of that name with a blob.

    Raises:
        NotFound: no blob of such a query.
    """
    infos = await store.list()
    found = next((i for i in infos if i.query_id == query), None) or newest_named(infos, query)
    if found is not None:
        return found.query_id, found.query_name
    return query, None  # an id whose checkpoint blob is gone: its snapshots may remain


async def marker_of(store: BlobStore, query_id: str) -> SnapshotRef | None:
    """The snapshot the query's checkpoint document names (None: none, or no document)."""
    try:
        doc = await store.read(query_id)
    except CorruptRecord:
        return None
    return doc.snapshot if doc is not None else None


class Listed(msgspec.Struct, frozen=True):
    """``snapshots QUERY``: the query's snapshots, newest first, each with its line; and,
    when ``restore --all`` found its location holding another query's checkpoint, that."""

    query_id: str
    name: str | None
    snapshots: list[SnapshotRow]
    gone: GoneRecord | None = None


async def snapshots(config: Config, query: str) -> Listed:
    """The query's snapshots as ``snapshots QUERY`` lists them."""
    store = BlobStore(config)
    try:
        query_id, name = await resolve(store, query)
        blobs = SnapshotBlobs(store.account)
        found = await list_snapshots(blobs, config.namespace, query_id)
        marker = await marker_of(store, query_id)
        gone = await read_gone(blobs, config.namespace, query_id)
        return Listed(query_id, name, rows(found, marker), gone)
    finally:
        await store.aclose()


async def _chosen(
    store: BlobStore, blobs: SnapshotBlobs, namespace: str, query_id: str, batch: int | None
) -> tuple[SnapshotIndex, SnapshotRef]:
    """The snapshot a restore writes back (``lineage.choose``), and the marker the document
    names with it.

    Raises:
        SnapshotNotFound: there is no such snapshot.
    """
    found = await list_snapshots(blobs, namespace, query_id)
    marker = await marker_of(store, query_id)
    index = lineage.choose(found, marker, batch)
    if index is None:
        available = tuple(sorted({i.batch for i in found}))
        shown = ", ".join(str(b) for b in available[-20:]) or "none"
        what = f"of batch {batch}" if batch is not None else "at all"
        raise SnapshotNotFound(
            f"query {query_id} has no snapshot {what} (batches with one: {shown})",
            available=available,
        )
    return index, lineage.marker_for(index, found, marker)


async def check(
    config: Config, query: str, *, read_data: bool = False
) -> tuple[str, str | None, list[Checked]]:
    """The query's id, name and each of its snapshots checked (``snapshots --check``)."""
    store = BlobStore(config)
    try:
        query_id, name = await resolve(store, query)
        found = await check_snapshots(
            SnapshotBlobs(store.account), config.namespace, query_id, read_data=read_data
        )
        return query_id, name, found
    finally:
        await store.aclose()


async def restore_query(
    config: Config,
    query: str,
    dest: Path,
    *,
    batch: int | None = None,
    force: bool = False,
    progress: Watch | None = None,
) -> Restored:
    """Write snapshot ``batch`` (None: the newest) of ``query`` into ``dest`` and move the
    sidecar's checkpoint with it; ``progress``: a sink for the restore, told how far it is.

    Raises:
        NotFound: no such query or snapshot.
        SidecarError: the store, a checksum, a non-empty ``dest`` without ``force``, or the
            checkpoint's move (the files are in place then: run it again).
    """
    store = BlobStore(config)
    try:
        query_id, name = await resolve(store, query)
        blobs = SnapshotBlobs(store.account)
        index, marker = await _chosen(store, blobs, config.namespace, query_id, batch)
        sink = progress(name or query_id, index) if progress is not None else None
        started = time.perf_counter()
        await restore(index, blobs, config.namespace, dest, force=force, progress=sink)
        seconds = time.perf_counter() - started
    finally:
        await store.aclose()
    return await _moved(config, query_id, name, index, marker, dest, seconds)


async def restore_all(
    config: Config, root: Path, *, progress: Watch | None = None
) -> list[Restored]:
    """``restore --all ROOT``: every query with a snapshot, back to where it was taken from,
    as :func:`judge` decides; each query's outcome, failures included (never raised for one
    query: the others go on). ``progress``: a sink for each restore, told how far it is.

    Raises:
        SidecarError: the store cannot be listed (nothing was restored).
    """
    store = BlobStore(config)
    blobs = SnapshotBlobs(store.account)
    out: list[Restored] = []
    try:
        prefix = all_prefix(config.namespace)
        query_ids = sorted(
            {b.name[len(prefix) :].split("/", 1)[0] for b in await blobs.list(prefix)}
        )
        infos = {i.query_id: i for i in await store.list()}
        names = {q: (i.query_name if (i := infos.get(q)) is not None else None) for q in query_ids}
        # Each location is one query's: several with snapshots of one location (it was
        # reused) are told apart first, so that an empty volume gets the right one.
        # Each query's snapshots, listed once: where it was taken from (its newest's
        # location), who owns a location, and what is restored all read this.
        listed: dict[str, list[SnapshotIndex]] = {}
        by_location: dict[str, list[str]] = {}
        for query_id in query_ids:
            try:
                found = listed[query_id] = await list_snapshots(blobs, config.namespace, query_id)
            except (SidecarError, OSError) as exc:
                out.append(_failed(query_id, names[query_id], exc))
                continue
            if found:
                by_location.setdefault(found[0].location, []).append(query_id)
        for location, queries in sorted(by_location.items()):
            try:
                owner = await _owner_of(config, blobs, root, location, listed, queries, set(infos))
            except (SidecarError, OSError) as exc:
                out.extend(_failed(q, names[q], exc) for q in queries)
                continue
            for query_id in queries:
                name, found = names[query_id], listed[query_id]
                done: Restored | None
                try:
                    if owner is not None and query_id != owner:
                        done = await _elsewhere(config, blobs, root, location, found, query_id,
                                                name, owner)  # fmt: skip
                    else:
                        done = await _restore_one(config, store, blobs, root, found, query_id,
                                                  name, progress)  # fmt: skip
                except (SidecarError, OSError) as exc:
                    done = _failed(query_id, name, exc)
                if done is not None:
                    out.append(done)
    finally:
        await store.aclose()
    return out


def _failed(query_id: str, name: str | None, exc: BaseException) -> Restored:
    reason = _said(exc)
    log.error("restore query=%s failed: %s", name or query_id, reason)
    return Restored(query_id, name, -1, "", "", 0, 0, 0.0, "failed", error=reason)


async def _owner_of(
    config: Config,
    blobs: SnapshotBlobs,
    root: Path,
    location: str,
    listed: dict[str, list[SnapshotIndex]],
    queries: list[str],
    with_checkpoint: set[str],
) -> str | None:
    """Which of ``queries`` (all with snapshots taken from ``location``) the location is
    restored for: the one whose checkpoint it holds; else (lost, empty, cut short) the one
    not gone from it, still with a checkpoint blob (not retired), whose newest snapshot was
    taken last. None when only one query has snapshots there (it is judged as usual)."""
    if len(queries) == 1:
        return None
    dest = root / location if location else root
    try:
        held = parse_query_metadata((dest / "metadata").read_bytes(), str(dest))
    except (FileNotFoundError, NotADirectoryError, SparkCheckpointError):
        held = None
    if held in queries:
        return held
    candidates = []
    for query_id in queries:
        gone = await read_gone(blobs, config.namespace, query_id)
        if gone is not None and gone.location == location:
            continue
        candidates.append((query_id in with_checkpoint, listed[query_id][0].created_at, query_id))
    return max(candidates)[2] if candidates else max(queries)


async def _elsewhere(
    config: Config,
    blobs: SnapshotBlobs,
    root: Path,
    location: str,
    found: list[SnapshotIndex],
    query_id: str,
    name: str | None,
    owner: str,
) -> Restored:
    """``query_id``'s location is ``owner``'s: nothing written, the query marked gone."""
    dest = root / location if location else root
    why = (
        f"is query {owner}'s location now (it holds or is restored with that query's "
        f"checkpoint, whose snapshots are newer): nothing written for {query_id} (restore it "
        "elsewhere with 'checkpoint-sidecar restore QUERY DIR')"
    )
    await mark_gone(blobs, config.namespace, query_id, location, owner)
    log.warning("restore query=%s: %s: %s", name or query_id, dest, why)
    return Restored.of(query_id, name, found[0], dest, outcome="elsewhere", error=why)


async def _restore_one(
    config: Config,
    store: BlobStore,
    blobs: SnapshotBlobs,
    root: Path,
    found: list[SnapshotIndex],
    query_id: str,
    name: str | None,
    progress: Watch | None = None,
) -> Restored | None:
    if not found:
        return None  # packs of a failed first snapshot only: nothing to restore
    marker = await marker_of(store, query_id)
    head = lineage.choose(found, marker)
    if head is None:
        raise SnapshotNotFound(
            f"query {query_id}: the snapshot its checkpoint names ({marker}) is gone, and no "
            "other is on its timeline: restore one by its batch with 'checkpoint-sidecar "
            "restore QUERY DIR --batch N'",
            available=tuple(sorted({i.batch for i in found})),
        )
    # The head, then (when it is broken) the snapshots before it on its line, newest first.
    on_line = lineage.current(found, marker)
    older = [i for i in found if i.id in on_line and (i.batch, i.created_at) < (head.batch,
             head.created_at)]  # fmt: skip
    label = name or query_id
    broken: list[RestoreError] = []
    for index in [head, *older]:
        dest = root / index.location if index.location else root
        verdict = await anyio.to_thread.run_sync(judge, dest, query_id, index)
        moved = lineage.marker_for(index, found, marker)  # what a restore of it writes
        done = await _as_it_is(config, store, blobs, verdict, dest, query_id, name, index, moved)
        if done is not None:
            return msgspec.structs.replace(done, broken=tuple(str(e) for e in broken))
        if verdict.why:
            log.warning("restore query=%s: %s: %s", label, dest, verdict.why)
        sink = progress(label, index) if progress is not None else None
        started = time.perf_counter()
        try:
            await restore(index, blobs, config.namespace, dest, force=verdict.replace,
                          progress=sink)  # fmt: skip
        except RestoreError as exc:
            if exc.reason not in ("missing_blob", "checksum"):
                raise
            broken.append(exc)
            log.error(
                "restore query=%s: snapshot %s of batch %d is broken (%s); trying the one "
                "before it on its timeline: run 'checkpoint-sidecar snapshots %s --check'",
                label,
                index.id,
                index.batch,
                exc,
                label,
            )
            continue
        seconds = time.perf_counter() - started
        done = await _moved(config, query_id, name, index, moved, dest, seconds)
        return msgspec.structs.replace(done, broken=tuple(str(e) for e in broken))
    raise broken[0]


async def _as_it_is(
    config: Config,
    store: BlobStore,
    blobs: SnapshotBlobs,
    verdict: Verdict,
    dest: Path,
    query_id: str,
    name: str | None,
    index: SnapshotIndex,
    moved: SnapshotRef,
) -> Restored | None:
    """What ``restore --all`` does with ``dest`` without restoring ``index`` into it, by
    ``verdict``: another query's location now (the query marked gone), this query's to keep
    (what a killed restore left beside it removed; the checkpoint moved to ``moved`` when the
    restore's move was cut short), or refused. None: restore it."""
    label = name or query_id
    quiet_tidy = functools.partial(tidy, quiet_s=LEFTOVER_QUIET_S)
    if verdict.keep and (left := await anyio.to_thread.run_sync(quiet_tidy, dest)):
        log.warning(
            "restore query=%s: %s: removed what a restore killed before its end left: %s",
            label,
            dest,
            ", ".join(left),
        )
    if verdict.elsewhere is not None:
        await mark_gone(blobs, config.namespace, query_id, index.location, verdict.elsewhere)
        keep_days = config.snapshot_abandoned_keep_s / 86400
        log.warning(
            "restore query=%s: %s: %s; its snapshots are kept %.3g days from the first time "
            "this was found (SIDECAR_SNAPSHOT_ABANDONED_KEEP_S), then reclaimed",
            label,
            dest,
            verdict.why,
            keep_days,
        )
        return Restored.of(query_id, name, index, dest, outcome="elsewhere", error=verdict.why)
    if verdict.keep and await _move_cut_short(store, query_id, dest, index):
        # A restore of this snapshot put the files in place and was cut short before it
        # moved the checkpoint (killed, or the lease or Redis refused it): kept as it is,
        # Spark would resume at the snapshot's batch while the sidecar names a later one.
        log.warning(
            "restore query=%s: %s holds batch %d of snapshot %s while the sidecar's "
            "checkpoint names a later batch: a restore whose checkpoint move was cut short "
            "(killed, or refused); moving the checkpoint now",
            label,
            dest,
            index.batch,
            index.id,
        )
        return await _moved(config, query_id, name, index, moved, dest, 0.0)
    if verdict.keep or verdict.refuse:
        log.log(
            logging.ERROR if verdict.refuse else logging.INFO,
            "restore query=%s: %s: %s",
            label,
            dest,
            verdict.why,
        )
        return Restored.of(
            query_id,
            name,
            index,
            dest,
            outcome="refused" if verdict.refuse else "newer",
            error=verdict.why if verdict.refuse else None,
        )
    return None


class Verdict(msgspec.Struct, frozen=True):
    """What ``restore --all`` does with a query's location (module docstring's table)."""

    #: Leave it as it is: it holds this query's checkpoint, at least as new.
    keep: bool = False
    #: Write nothing: it holds what the checkpoint does not know (another timeline), or is
    #: not a checkpoint location at all.
    refuse: bool = False
    #: Write nothing: it holds another query's checkpoint (this id): the location was reused,
    #: this query is gone from it.
    elsewhere: str | None = None
    #: Restore over what it holds (else it must be empty or absent).
    replace: bool = False
    #: Why, for the log and the command's line.
    why: str = ""


def judge(dest: Path, query_id: str, head: SnapshotIndex) -> Verdict:
    """What ``restore --all`` does with ``dest``, the location of ``query_id``'s snapshot
    ``head`` (the one its marker leads to), from what it holds (blocking: call from a thread;
    the module docstring's table).

    Raises:
        OSError: ``dest`` cannot be read (permissions).
    """
    if not dest.exists():
        return Verdict()
    if not dest.is_dir():
        return Verdict(refuse=True, why="is not a directory: nothing written")
    if not any(dest.iterdir()):
        return Verdict()
    try:
        owner = parse_query_metadata((dest / "metadata").read_bytes(), str(dest))
    except FileNotFoundError:
        return Verdict(
            replace=True,
            why="holds files but no checkpoint metadata (a restore cut short?): restored over",
        )
    except SparkCheckpointError as exc:
        return Verdict(refuse=True, why=f"nothing written: {exc}")
    if owner != query_id:
        return Verdict(
            elsewhere=owner,
            why=(
                f"holds the checkpoint of another query ({owner}), not of {query_id}: nothing "
                "written (the location was reused by a new query; restore this one elsewhere "
                "with 'checkpoint-sidecar restore QUERY DIR')"
            ),
        )
    held = _committed(dest)
    if held is None:
        return Verdict(replace=True)
    same = _same_line(dest, head, min(held, head.batch))
    if same is False:
        at = min(held, head.batch)
        return Verdict(
            refuse=True,
            why=(
                f"holds batch {held} of a timeline the checkpoint does not know: its "
                f"offsets/{at} and commits/{at} differ from those of snapshot {head.id} "
                f"(batch {head.batch}, which the checkpoint's marker leads to): nothing written "
                "(rewound or restored by hand? keep it with 'checkpoint-sidecar "
                "import-spark-checkpoint', or replace it with 'checkpoint-sidecar restore QUERY "
                "DIR --force')"
            ),
        )
    if held >= head.batch:
        return Verdict(
            keep=True,
            why=f"holds batch {held}, on the timeline of its snapshot of batch {head.batch}: kept",
        )
    return Verdict(replace=True)


async def _move_cut_short(
    store: BlobStore, query_id: str, dest: Path, index: SnapshotIndex
) -> bool:
    """Whether ``dest`` (kept: ``index``'s timeline) holds the batch of ``index`` while the
    query's checkpoint document names a later one: a restore of ``index`` that put the files
    in place and never moved the checkpoint.

    Not a directory Spark wrote: under synchronous progress tracking Spark commits a batch
    before its listener reports it, so the document is never ahead of such a directory;
    under async progress tracking or real-time mode (the document's position ``processed``)
    it may well be, and is left alone. Spark's local file system also writes a checksum
    beside each commit (``commits/.N.crc``), which a restore never writes: its presence
    says Spark wrote the directory too."""
    held = await anyio.to_thread.run_sync(_committed, dest)
    if held != index.batch:
        return False
    if await anyio.to_thread.run_sync((dest / "commits" / f".{held}.crc").exists):
        return False
    try:
        doc = await store.read(query_id)
    except CorruptRecord:
        return False
    return doc is not None and doc.batch_id > held and doc.position is not Position.PROCESSED


def _same_line(dest: Path, head: SnapshotIndex, batch: int) -> bool | None:
    """Whether ``dest``'s ``offsets/`` and ``commits/`` file of ``batch`` are byte-identical
    to ``head``'s copies (None: one side does not have them: nothing to compare)."""
    theirs = {f.path: f.sha256 for f in head.files}
    for path in lineage.tip_paths(batch):
        if path not in theirs:
            return None
        try:
            mine = hashlib.sha256((dest / path).read_bytes()).digest()
        except FileNotFoundError:
            return None
        if mine != theirs[path]:
            return False
    return True


def _committed(directory: Path) -> int | None:
    """The newest batch ``directory``'s commit log holds; None: no checkpoint there."""
    commits = directory / "commits"
    try:
        batches = [int(p.name) for p in commits.iterdir() if p.name.isdigit()]
    except FileNotFoundError:
        return None
    return max(batches, default=None)


def _said(exc: BaseException) -> str:
    """An error as one line an operator can act on."""
    if isinstance(exc, PermissionError):
        return (
            f"{exc.filename or 'the directory'}: permission denied: run the restore as a user "
            "that may write the volume (the pod's fsGroup), or fix the volume's permissions"
        )
    if isinstance(exc, OSError) and not isinstance(exc, SidecarError):
        return f"{exc.filename or 'the directory'}: {exc.strerror or exc}"
    return str(exc)


async def _moved(
    config: Config,
    query_id: str,
    name: str | None,
    index: SnapshotIndex,
    marker: SnapshotRef,
    dest: Path,
    seconds: float,
) -> Restored:
    """A restore written into ``dest`` in ``seconds``: the sidecar's checkpoint moved with it,
    naming ``marker`` (:func:`_move_checkpoint`), and what was done."""
    stats = RestoreStats(
        seconds=round(seconds, 3),
        bytes=index.total_bytes,
        files=len(index.files),
        batch_id=index.batch,
        snapshot=index.id,
        at=time.time(),
        name=name,
    )
    summary = await _move_checkpoint(config, dest, name or query_id, index, marker, stats)
    return Restored.of(query_id, name, index, dest, seconds=seconds, checkpoint=summary,
                       timeline=marker.timeline)  # fmt: skip


async def _move_checkpoint(
    config: Config,
    dest: Path,
    name: str,
    index: SnapshotIndex,
    marker: SnapshotRef,
    stats: RestoreStats,
) -> str:
    """Make the restored batch the sidecar's checkpoint of the query, as an import of the
    restored directory (a reset: the daemon's, or under a lease waited for). The reset's
    reason, kept in the document and its history, says what was restored and how long it
    took; its ``restored`` figures are kept in Redis for the daemon to export (a restore runs
    in its own process, often an init container: nothing scrapes it)."""
    try:
        batch = await anyio.to_thread.run_sync(spark_import.read_spark_checkpoint, dest)
    except SparkCheckpointError as exc:
        raise SidecarError(f"the restored directory {dest} is not a checkpoint: {exc}") from exc
    found = await spark_import.plan(config, str(dest), batch, name)
    reason = (
        f"restored snapshot {index.id} of batch {index.batch} into {dest} "
        f"({stats.files} files, {stats.bytes} bytes in {stats.seconds:.1f} s)"
    )
    deadline = time.monotonic() + LEASE_WAIT_S
    while True:
        try:
            result = await admin_tool.apply_reset(
                config,
                found.checkpoint,
                reason=reason,
                force=True,
                from_spark=True,
                state_rewound=True,
                snapshot=marker,
                restored=stats,
            )
            return result.summary()
        except AdminRefused as exc:
            if "another owner holds the lease" not in str(exc) or time.monotonic() > deadline:
                raise
            log.info("restore query=%s: waiting for the old owner's lease: %s", name, exc)
            await anyio.sleep(5)
        except NotFound:
            raise
