"""A snapshot written back as a checkpoint directory; a query's snapshots listed and found.

:func:`restore` writes every file of a snapshot's index under ``dest`` at its relative path:

- **Refuses** a ``dest`` that holds anything unless ``force`` (its content is then replaced,
  only once the snapshot is written and verified), and an index whose paths would leave
  ``dest`` (absolute, ``..``).
- **Checks** that every pack the index names is stored and large enough (one listing, run
  beside the first downloads): a missing or short one fails the restore, naming the pack and a
  file in it; a read that finds a pack gone waits for the listing, so the error says the same
  whichever answers first.
- **Downloads in parallel** (``concurrency`` ranged reads at once): the contents of one pack
  that lie close together (at most :data:`RANGE_GAP_BYTES` apart) are read in one request of
  up to :data:`RANGE_MAX_BYTES`; a larger content in slices of that size that any worker may
  take, each written at its offset as it lands and hashed in order (a slice that lands ahead
  of its turn is read back from the file when its turn comes). Ranges are hashed and written
  in worker threads while the next ones download; memory stays about
  ``2 * concurrency * RANGE_MAX_BYTES`` whatever the checkpoint's size. A content several
  files share is read once.
- **Verifies** every file's size and checksum against the index as it is written — its
  CRC-32C (``sidecar.snapshot.crc``), or its SHA-256 when the index has no CRC for it; a
  mismatch fails the restore (``RestoreError``, reason ``checksum``, naming the file and the
  pack).
- **Points Spark's recorded paths at ``dest``**: the schema file paths Spark 4 writes in
  operator metadata v2 (``transformWithState``) name the directory snapshotted; once every
  file is verified, they are rewritten to the same files under ``dest``
  (``sidecar.snapshot.relocate``), so a restore into another directory, or on another pod,
  restarts with its state. Nothing else is changed.
- **Leaves it writable by the driver**: directories ``2775`` and files ``664`` whatever the
  umask, so another user of the volume's group (the pod's ``fsGroup``: the driver, uid 185 in
  Spark's images, while the restore ran as the sidecar's user) writes the next batch's files.
- **Tells how far it is** to a :class:`Progress` sink when given one (files and bytes
  written and verified, out of the snapshot's), on the event loop's thread; what it shows and
  where is the caller's (``sidecar.cli.progress``).
- **Never leaves a half-written checkpoint in place**: files go to a temporary directory
  beside ``dest`` (``.<name>.restore-<id>``), renamed into place once all are verified and
  durable (each file's data synced as it is written, every directory of the tree before the
  move, the parent after it: a power loss never leaves a checkpoint of empty files). When
  ``dest`` is a mount point (an init container's volume), the temporary directory is inside it
  and its entries are moved into place at the end, ``metadata`` last (what was there goes,
  its ``metadata`` first): until then ``dest`` is no query's checkpoint location. A failure
  removes the temporary directory; what a killed restore left (:func:`tidy`) is removed by
  the next restore into the same ``dest``, or by ``restore --all`` keeping ``dest``.

:func:`list_snapshots` and :func:`find_snapshot` read a query's indexes for ``snapshots`` and
``restore [--batch N]``; :func:`check_snapshots` (restic's ``check``) says of each kept
snapshot whether it can be restored: its index readable and every pack it names stored and
long enough, and with ``read_data`` every file read back and its checksum verified.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Literal, Protocol

import anyio
import anyio.abc
import anyio.to_thread
import msgspec

from sidecar.errors import CorruptRecord, SidecarError
from sidecar.snapshot import crc
from sidecar.snapshot.index import SnapshotIndex, new_id, pack_name, prefix
from sidecar.snapshot.relocate import location_uri, recorded_paths_in, relocate
from sidecar.snapshot.retention import StoredIndex, classify
from sidecar.snapshot.stored import SnapshotStore, first_error, read_index, read_indexes, retried

log = logging.getLogger(__name__)

MiB = 1024 * 1024
#: One ranged read's bytes at most (a larger content is read in slices of this size).
RANGE_MAX_BYTES = 4 * MiB
#: Contents of one pack at most this far apart are read in one request (the dead bytes
#: between them cost less than another request).
RANGE_GAP_BYTES = 64 * 1024
DEFAULT_CONCURRENCY = 8
#: Restored directories and files: writable by the group, whatever the umask, and the group
#: inherited (set-group-ID) — the driver runs as another user of the pod's ``fsGroup`` (uid
#: 185 in Spark's images) and writes the next batch's files and deletes old ones there.
DIR_MODE = 0o2775
FILE_MODE = 0o664
#: Written into place last, when ``dest`` is a mount point: Spark knows a checkpoint location
#: by it.
LAST_FILE = "metadata"

RestoreReason = Literal["not_empty", "unsafe_path", "missing_blob", "checksum", "store"]


class RestoreError(SidecarError):
    """The snapshot cannot be restored there; ``reason`` (one of ``RestoreReason``) says why,
    ``blob`` and ``path`` what it concerns. Nothing is left in ``dest`` that was not there."""

    def __init__(
        self,
        message: str,
        *,
        reason: RestoreReason,
        blob: str | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(message)
        self.reason: RestoreReason = reason
        self.blob = blob
        self.path = path


class SnapshotNotFound(SidecarError):
    """No snapshot of that query (at that batch); ``available`` lists the batches there are."""

    def __init__(self, message: str, *, available: tuple[int, ...]) -> None:
        super().__init__(message)
        self.available = available


class Progress(Protocol):
    """Told how a restore goes (files and bytes written and verified), always on the event
    loop's thread: :meth:`begin` once, :meth:`advance` as files are written, :meth:`end` once
    (also when the restore fails). It decides nothing and raises nothing."""

    def begin(self, files: int, bytes: int) -> None:
        """The snapshot's files and bytes, before any is written."""

    def advance(self, files: int, bytes: int) -> None:
        """``files`` more files are whole, ``bytes`` more bytes written and verified."""

    def end(self, ok: bool) -> None:
        """The restore ended: in place (``ok``) or not."""


class RestoreResult(msgspec.Struct, frozen=True, kw_only=True):
    dest: str
    query_id: str
    batch: int
    snapshot_id: str
    files: int
    #: Bytes of the files written; bytes downloaded (ranges may span dead gaps).
    bytes: int
    downloaded_bytes: int
    requests: dict[str, int]
    duration_s: float


class _Content(msgspec.Struct):
    """One content of the snapshot and the files that hold it."""

    offset: int
    size: int
    sha256: bytes
    #: Checked instead of the SHA-256 when known (and CRC-32C is fast here).
    crc32c: int | None
    paths: list[str]


class _Read(msgspec.Struct):
    """One ranged request: whole contents of one pack, or (``sliced``) one slice of a content
    larger than a range (``contents`` is that content alone)."""

    pack: str
    start: int
    length: int
    contents: list[_Content]
    sliced: bool = False


def plan_reads(
    index: SnapshotIndex,
    *,
    max_bytes: int = RANGE_MAX_BYTES,
    gap_bytes: int = RANGE_GAP_BYTES,
) -> list[_Read]:
    """The ranged reads that fetch every non-empty file of ``index``, largest first: a content
    larger than ``max_bytes`` in slices of that size, in order (any worker may take one); the
    others, together when they lie close in a pack. Pure."""
    by_pack: dict[str, dict[int, _Content]] = {}
    for f in index.files:
        if not f.size:
            continue
        at = by_pack.setdefault(f.pack, {})
        if f.offset in at:
            content = at[f.offset]
            content.paths.append(f.path)
            if content.crc32c is None:
                content.crc32c = f.crc32c
        else:
            at[f.offset] = _Content(f.offset, f.size, f.sha256, f.crc32c, [f.path])
    reads: list[_Read] = []
    for pack, contents in by_pack.items():
        current: _Read | None = None
        for offset in sorted(contents):
            content = contents[offset]
            if content.size > max_bytes:
                for part in range(0, content.size, max_bytes):
                    length = min(max_bytes, content.size - part)
                    reads.append(_Read(pack, offset + part, length, [content], sliced=True))
                current = None
                continue
            if current is not None:
                end = current.start + current.length
                joined = offset + content.size - current.start
                if offset - end <= gap_bytes and joined <= max_bytes and offset >= end:
                    current.contents.append(content)
                    current.length = joined
                    continue
            current = _Read(pack, offset, content.size, [content])
            reads.append(current)
    # Stable: a content's slices stay in order, one after the other.
    reads.sort(key=lambda r: -(r.contents[0].size if r.sliced else r.length))
    return reads


def _unsafe(path: str) -> bool:
    parts = path.split("/")
    return (
        not path or path.startswith("/") or "\0" in path or any(p in ("", ".", "..") for p in parts)
    )


def _is_mount(dest: Path) -> bool:
    return dest.is_dir() and os.path.ismount(dest)


def _stale_prefix(dest: Path, mount: bool) -> str:
    return ".restore-" if mount else f".{dest.name}.restore-"


#: ``restore --all`` keeping a location removes what a killed restore left beside it only once
#: nothing in it changed for this long: a restore still running (an operator's, into the same
#: location) writes into its temporary directory.
LEFTOVER_QUIET_S = 600.0


def tidy(dest: Path, *, quiet_s: float = 0.0) -> list[str]:
    """Remove what a restore into ``dest`` killed before its end left: its temporary
    directory (inside ``dest`` when a mount point, else beside it), or the old checkpoint it
    had set aside; with ``quiet_s``, only what nothing changed in for that long. Run by every
    restore into ``dest`` and by ``restore --all`` when it keeps ``dest`` as it is (a restore
    killed after its last move leaves a whole checkpoint, and what it left would stay for
    good). The names removed."""
    mount = _is_mount(dest)
    parent = dest if mount else dest.parent
    stale = _stale_prefix(dest, mount)
    removed = []
    if parent.is_dir():
        for entry in parent.iterdir():
            if not entry.name.startswith(stale) or not entry.is_dir() or entry.is_symlink():
                continue
            if quiet_s > 0 and time.time() - _newest_change(entry) < quiet_s:
                continue
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry.name)
    return removed


def _newest_change(top: Path) -> float:
    """The newest modification time of ``top`` and anything under it (no link followed)."""
    newest = top.lstat().st_mtime
    for root, dirs, files in os.walk(top):
        for name in [*dirs, *files]:
            try:
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
            except FileNotFoundError:
                continue
    return newest


def _prepare(dest: Path, force: bool, token: str) -> tuple[Path, bool]:
    """Check ``dest``, remove what a killed restore left beside it, make the temporary
    directory; (it, whether ``dest`` is a mount point)."""
    if dest.exists() and not dest.is_dir():
        raise RestoreError(
            f"{dest} is a file, not a directory: restore into a directory",
            reason="not_empty",
            path=str(dest),
        )
    mount = _is_mount(dest)
    parent = dest if mount else dest.parent
    tidy(dest)
    if dest.is_dir() and any(dest.iterdir()) and not force:
        raise RestoreError(
            f"{dest} is not empty: a checkpoint may be there. Restore into an empty or new "
            "directory, or pass force to replace its content",
            reason="not_empty",
            path=str(dest),
        )
    temp = parent / f"{_stale_prefix(dest, mount)}{token}"
    temp.mkdir(parents=True)
    _chmod(temp)
    return temp, mount


def _chmod(target: Path | int, mode: int = DIR_MODE) -> None:
    """``mode`` on a directory (path) or a file (descriptor); a file system that keeps no
    modes (SMB, some FUSE mounts) refusing it is not a failure: it has its own rules."""
    try:
        if isinstance(target, int):
            os.fchmod(target, mode)
        else:
            os.chmod(target, mode)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL):
            raise


def _make_dirs(temp: Path, paths: list[str]) -> None:
    for directory in sorted({str(Path(p).parent) for p in paths} - {"."}):
        made = temp
        for part in Path(directory).parts:
            made = made / part
            if not made.is_dir():
                made.mkdir()
                _chmod(made)


#: ``fdatasync`` where there is one (not on macOS): a new file's data and size on disk.
_sync_data: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)


def _write_all(fd: int, data: bytes | memoryview, at: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, at)
        view, at = view[done:], at + done


def _write_durably(target: Path, data: bytes | memoryview) -> None:
    """``data`` as the new file ``target``, on disk when this returns."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        _chmod(fd, FILE_MODE)  # whatever the umask
        _write_all(fd, data, 0)
        _sync_data(fd)
    finally:
        os.close(fd)


def _relocate(temp: Path, paths: list[str], dest: Path) -> None:
    """The full paths Spark recorded in ``paths`` (verified already) pointed at ``dest``, where
    the checkpoint is put (``sidecar.snapshot.relocate``). A file that is not what its name
    says is left as it is: Spark says what it makes of it."""
    location = location_uri(os.path.abspath(dest))
    for path in paths:
        data = (temp / path).read_bytes()
        try:
            moved = relocate(data, location)
        except ValueError as exc:
            log.warning("restore: %s left as it is, its paths not rewritten: %s", path, exc)
            continue
        if moved != data:
            _write_durably(temp / path, moved)


def _write_empty(targets: list[Path]) -> None:
    for target in targets:
        _write_durably(target, b"")


def _sync_dir(directory: Path) -> None:
    """Make ``directory``'s entries durable (the files and directories made or renamed in it)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some network and FUSE file systems refuse fsync on a directory; their entries are
        # written through by the server.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _sync_tree(top: Path) -> None:
    """Make every directory's entries under ``top`` (and its own) durable: ~0.05 s for the
    ~330 directories of a 1 GiB checkpoint here, once the files are synced."""
    for directory, _, _ in os.walk(top):
        _sync_dir(Path(directory))


def _place(temp: Path, dest: Path, mount: bool, token: str) -> None:
    """Move the restored tree, durable already, into place (see the module docstring)."""
    _sync_tree(temp)
    if mount:
        # metadata goes first and comes back last: cut short anywhere in between, dest is
        # no query's checkpoint (restore --all restores over it), never a partial one that
        # looks whole.
        old = dest / LAST_FILE
        if old.exists() or old.is_symlink():
            old.unlink()
            _sync_dir(dest)
        for entry in list(dest.iterdir()):
            if entry != temp:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        names = sorted(os.listdir(temp), key=lambda n: n == LAST_FILE)
        for name in names:
            if name == LAST_FILE:
                _sync_dir(dest)  # everything else is in place before metadata is
            os.rename(temp / name, dest / name)
        temp.rmdir()
        _sync_dir(dest)
        return
    if dest.exists():
        aside = dest.parent / f".{dest.name}.restore-{token}-old"
        os.rename(dest, aside)
        os.rename(temp, dest)
        _sync_dir(dest.parent)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(temp, dest)
        _sync_dir(dest.parent)


async def restore(
    index: SnapshotIndex,
    blobs: SnapshotStore,
    namespace: str,
    dest: Path,
    *,
    force: bool = False,
    concurrency: int = DEFAULT_CONCURRENCY,
    range_bytes: int = RANGE_MAX_BYTES,
    progress: Progress | None = None,
) -> RestoreResult:
    """Write the snapshot ``index`` as a checkpoint directory at ``dest`` (see the module
    docstring); ``range_bytes``: one ranged read's bytes at most; ``progress``: told how far
    it is.

    Raises:
        RestoreError: ``not_empty`` (``dest`` holds something and ``force`` is not given),
            ``unsafe_path`` (the index names a path outside ``dest``), ``missing_blob`` (a
            pack is not stored, or shorter than the index says), ``checksum`` (a file's bytes
            are not the ones the index names), ``store`` (a pack could not be read).
        SidecarError: the store's errors after retries (``StoreUnavailable``).
    """
    for f in index.files:
        if _unsafe(f.path):
            raise RestoreError(
                f"the snapshot names a file {f.path!r} outside its directory: the index is "
                "damaged or not this tool's; nothing was written",
                reason="unsafe_path",
                path=f.path,
            )

    if progress is not None:
        progress.begin(len(index.files), index.total_bytes)
    try:
        result = await _restore(index, blobs, namespace, dest, force, concurrency, range_bytes,
                                progress)  # fmt: skip
    except BaseException:
        if progress is not None:
            progress.end(False)
        raise
    if progress is not None:
        progress.end(True)
    log.info(
        "snapshot restored: query=%s batch=%d snapshot=%s dest=%s files=%d bytes=%d "
        "requests=%d duration_s=%.3f",
        index.query_id,
        index.batch,
        index.id,
        dest,
        result.files,
        result.bytes,
        sum(result.requests.values()),
        result.duration_s,
    )
    return result


async def _restore(
    index: SnapshotIndex,
    blobs: SnapshotStore,
    namespace: str,
    dest: Path,
    force: bool,
    concurrency: int,
    range_bytes: int,
    progress: Progress | None,
) -> RestoreResult:
    started = time.monotonic()
    counted = blobs.counted()
    token = new_id()
    temp, mount = await anyio.to_thread.run_sync(_prepare, dest, force, token)
    downloaded = 0
    sliced: dict[tuple[str, int], _Sliced] = {}
    try:
        reads = plan_reads(index, max_bytes=range_bytes)
        queue: Iterator[_Read] = iter(reads)
        checked = anyio.Event()
        try:
            with first_error():
                async with anyio.create_task_group() as tg:
                    # The listing runs beside the first downloads (it is a serial second
                    # before them otherwise, at 1 GiB here); a missing or short pack fails
                    # the restore when it answers, and a read that finds one waits for it.
                    tg.start_soon(_check_packs, index, counted, namespace, checked)
                    paths = [f.path for f in index.files]
                    await anyio.to_thread.run_sync(_make_dirs, temp, paths)
                    empty = [temp / f.path for f in index.files if not f.size]
                    await anyio.to_thread.run_sync(_write_empty, empty)
                    if progress is not None and empty:
                        progress.advance(len(empty), 0)
                    writer = _Writer(tg, concurrency, progress)

                    async def worker() -> None:
                        nonlocal downloaded
                        for read in queue:
                            name = pack_name(namespace, index.query_id, read.pack)
                            data = await _ranged(counted, name, read.start, read.length, checked)
                            downloaded += read.length
                            if read.sliced:
                                content = read.contents[0]
                                key = (read.pack, content.offset)
                                if key not in sliced:
                                    sliced[key] = _Sliced(content, temp / content.paths[0])
                                at = read.start - content.offset
                                job = partial(_land, sliced[key], at, data, name, temp)
                            else:
                                job = partial(_verify_and_write, read, data, name, temp)
                            await writer.submit(job)

                    for _ in range(max(1, min(concurrency, len(reads)))):
                        tg.start_soon(worker)
        finally:
            for state in sliced.values():
                state.close()
        recorded = [f.path for f in index.files if recorded_paths_in(f.path)]
        if recorded:
            await anyio.to_thread.run_sync(_relocate, temp, recorded, dest)
        await anyio.to_thread.run_sync(_place, temp, dest, mount, token)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(partial(shutil.rmtree, temp, ignore_errors=True))
        raise
    return RestoreResult(
        dest=str(dest),
        query_id=index.query_id,
        batch=index.batch,
        snapshot_id=index.id,
        files=len(index.files),
        bytes=index.total_bytes,
        downloaded_bytes=downloaded,
        requests=dict(counted.requests),
        duration_s=time.monotonic() - started,
    )


async def _check_packs(
    index: SnapshotIndex, blobs: SnapshotStore, namespace: str, checked: anyio.Event
) -> None:
    """Every pack the index uses is listed, at least as long as its contents need; then
    ``checked`` is set."""
    needed: dict[str, tuple[int, str]] = {}
    for f in index.files:
        if f.size:
            end = f.offset + f.size
            if end > needed.get(f.pack, (0, ""))[0]:
                needed[f.pack] = (end, f.path)
    if needed:
        base = f"{prefix(namespace, index.query_id)}packs/"
        listed = await retried("list packs", lambda: blobs.list(base))
        sizes = {blob.name: blob.size for blob in listed}
        for pack, (end, path) in sorted(needed.items()):
            name = pack_name(namespace, index.query_id, pack)
            size = sizes.get(name)
            if size is None or size < end:
                found = "is not stored" if size is None else f"holds {size} bytes, not {end}"
                raise RestoreError(
                    f"pack {name} {found}: snapshot {index.id} of batch {index.batch} cannot "
                    f"be restored ({path} and others are in it). It was deleted or damaged; "
                    "restore another snapshot (--batch)",
                    reason="missing_blob",
                    blob=name,
                    path=path,
                )
    checked.set()


async def _ranged(
    blobs: SnapshotStore, name: str, start: int, length: int, checked: anyio.Event
) -> bytes:
    """``length`` bytes of the pack ``name`` from ``start``, retried. A pack that cannot be
    read, or is short, fails the restore as the listing says when it says so (missing or
    short: ``missing_blob``), else ``store`` or ``missing_blob`` here."""
    try:
        data = await retried(f"read {name}", partial(blobs.read_range, name, start, length))
    except SidecarError as exc:
        if exc.retriable:
            raise
        await checked.wait()
        raise RestoreError(
            f"pack {name} could not be read ({exc}): it was deleted since the restore "
            "began, or the store refuses it",
            reason="store",
            blob=name,
        ) from exc
    if len(data) != length:
        await checked.wait()
        raise RestoreError(
            f"pack {name} returned {len(data)} bytes at {start}, not {length}: it is "
            "shorter than the snapshot says (damaged)",
            reason="missing_blob",
            blob=name,
        )
    return data


#: What a writer's job did: files made whole, bytes written (for :class:`Progress`).
Written = tuple[int, int]


class _Writer:
    """Verifies and writes downloaded ranges in worker threads beside the downloads (a
    download does not wait for the previous range's hash and write), holding ``pending``
    ranges at most; tells ``progress`` what each did, back on the event loop's thread."""

    def __init__(
        self, tg: anyio.abc.TaskGroup, pending: int, progress: Progress | None = None
    ) -> None:
        self.tg = tg
        self.slots = anyio.Semaphore(max(1, pending))
        self.progress = progress

    async def submit(self, job: Callable[[], Written]) -> None:
        await self.slots.acquire()
        self.tg.start_soon(self._run, job)

    async def _run(self, job: Callable[[], Written]) -> None:
        try:
            files, written = await anyio.to_thread.run_sync(job)
        finally:
            self.slots.release()
        if self.progress is not None:
            self.progress.advance(files, written)


class _Check:
    """A content's check, fed in order: its CRC-32C when the index has it (and CRC-32C is
    fast here), else its SHA-256."""

    def __init__(self, content: _Content) -> None:
        self.crc = 0 if content.crc32c is not None and crc.AVAILABLE else None
        self.sha = hashlib.sha256() if self.crc is None else None

    def update(self, data: bytes) -> None:
        if self.sha is not None:
            self.sha.update(data)
        else:
            assert self.crc is not None
            self.crc = crc.extend(self.crc, data)

    def passed(self, content: _Content) -> bool:
        if self.sha is not None:
            return self.sha.digest() == content.sha256
        return self.crc == content.crc32c


def _verify(content: _Content, check: _Check, blob: str) -> None:
    if not check.passed(content):
        raise RestoreError(
            f"{content.paths[0]} ({content.size} bytes at {content.offset} of pack {blob}) "
            "does not match its checksum: the pack is damaged. Nothing was put in place; "
            "restore another snapshot (--batch)",
            reason="checksum",
            blob=blob,
            path=content.paths[0],
        )


def _verify_and_write(read: _Read, data: bytes, blob: str, temp: Path) -> Written:
    """A worker thread's job: each content of ``read`` checked, then written (each of its
    files, durably)."""
    files = written = 0
    for content in read.contents:
        at = content.offset - read.start
        # bytes, not a view, for the CRC; a range of one content (the large ones) is not copied.
        piece = data if len(read.contents) == 1 else data[at : at + content.size]
        check = _Check(content)
        check.update(piece)
        _verify(content, check, blob)
        for path in content.paths:
            _write_durably(temp / path, piece)
        files += len(content.paths)
        written += content.size * len(content.paths)
    return files, written


class _Sliced:
    """A content larger than a range, restored from slices that any worker downloads: each
    written at its offset as it lands (``pwrite``, in worker threads), the hash fed in order.
    A slice that lands before those ahead of it is read back from the file when its turn
    comes, so none is held in memory for long whatever the file's size."""

    def __init__(self, content: _Content, target: Path) -> None:
        self.content = content
        self.target = target
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.check = _Check(content)
        #: Bytes hashed from the content's start; slices landed beyond them, by offset.
        self.hashed = 0
        self.landed: dict[int, int] = {}
        self.written = 0

    def land(self, at: int, data: bytes) -> bool:
        """Write ``data`` at ``at`` of the content and hash what is in order; whether the
        whole content is written and hashed."""
        with self.lock:
            if self.fd is None:
                self.fd = os.open(self.target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, FILE_MODE)
                _chmod(self.fd, FILE_MODE)
            fd = self.fd
        _write_all(fd, data, at)
        with self.lock:
            self.written += len(data)
            if at != self.hashed:
                self.landed[at] = len(data)
            else:
                self.check.update(data)
                self.hashed += len(data)
                while self.hashed in self.landed:
                    self.hashed = self._hash_back(fd, self.hashed, self.landed.pop(self.hashed))
            return self.written == self.content.size

    def _hash_back(self, fd: int, at: int, length: int) -> int:
        end = at + length
        while at < end:
            piece = os.pread(fd, min(end - at, 1024 * 1024), at)
            if not piece:
                raise OSError(errno.EIO, f"{self.target} is shorter than what was written to it")
            self.check.update(piece)
            at += len(piece)
        return at

    def finish(self, blob: str, temp: Path) -> None:
        """The whole content is written: on disk, checked, copied to its other paths."""
        assert self.fd is not None and self.hashed == self.content.size
        _sync_data(self.fd)
        self.close()
        _verify(self.content, self.check, blob)
        for other in self.content.paths[1:]:
            shutil.copyfile(self.target, temp / other)
            fd = os.open(temp / other, os.O_RDONLY)
            try:
                _sync_data(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


def _land(state: _Sliced, at: int, data: bytes, blob: str, temp: Path) -> Written:
    """A worker thread's job: one slice of a large content (its file whole with the last)."""
    if not state.land(at, data):
        return 0, len(data)
    state.finish(blob, temp)
    copies = len(state.content.paths) - 1
    return copies + 1, len(data) + copies * state.content.size


async def list_snapshots(
    blobs: SnapshotStore, namespace: str, query_id: str
) -> list[SnapshotIndex]:
    """Every readable snapshot of the query, newest first (by batch, then time written);
    unreadable index blobs are skipped (logged).

    Raises:
        SidecarError: the store's errors after retries.
    """
    stored = await _indexes(blobs, namespace, query_id)
    found = await read_indexes(blobs, [s.name for s in stored])
    return [found[s.name][0] for s in stored if s.name in found]


async def find_snapshot(
    blobs: SnapshotStore, namespace: str, query_id: str, batch: int | None = None
) -> SnapshotIndex:
    """The newest snapshot of ``batch`` (None: of the newest batch). One listing, one read.

    Raises:
        SnapshotNotFound: there is none (``available`` says which batches there are).
        CorruptRecord: its index cannot be read.
        SidecarError: the store's errors after retries.
    """
    stored = await _indexes(blobs, namespace, query_id)
    available = tuple(sorted({s.batch for s in stored}))
    wanted = batch if batch is not None else (available[-1] if available else None)
    for s in stored:  # newest first
        if s.batch == wanted:
            got = await read_index(blobs, s.name)
            if got is not None:
                return got[0]
    shown = ", ".join(str(b) for b in available[-20:]) or "none"
    what = f"of batch {batch}" if batch is not None else "at all"
    raise SnapshotNotFound(
        f"query {query_id} has no snapshot {what} (batches with one: {shown})",
        available=available,
    )


class Checked(msgspec.Struct, frozen=True):
    """One snapshot as :func:`check_snapshots` found it."""

    batch_id: int
    id: str
    #: None: it can be restored; else why not (the index unreadable, a pack missing or cut
    #: short, a file whose bytes are not the ones the index names).
    problem: str | None = None


async def check_snapshots(
    blobs: SnapshotStore,
    namespace: str,
    query_id: str,
    *,
    read_data: bool = False,
    scratch: Path | None = None,
) -> list[Checked]:
    """Each of the query's snapshots, newest first, checked: its index read, every pack it
    names listed and long enough; with ``read_data``, restored into a temporary directory
    under ``scratch`` (default: the system's) and removed, every file's size and checksum
    verified on the way. A snapshot that fails says why; the others are still checked.

    Raises:
        SidecarError: the store cannot be listed (after retries).
    """
    out: list[Checked] = []
    for stored in await _indexes(blobs, namespace, query_id):
        try:
            got = await read_index(blobs, stored.name)
        except CorruptRecord as exc:
            out.append(Checked(stored.batch, stored.id, f"its index cannot be read: {exc}"))
            continue
        if got is None:
            continue  # deleted since the listing (a prune)
        index = got[0]
        try:
            if read_data:
                await _read_back(index, blobs, namespace, scratch)
            else:
                await _check_packs(index, blobs, namespace, anyio.Event())
        except RestoreError as exc:
            out.append(Checked(stored.batch, stored.id, str(exc)))
            continue
        out.append(Checked(stored.batch, stored.id))
    return out


async def _read_back(
    index: SnapshotIndex, blobs: SnapshotStore, namespace: str, scratch: Path | None
) -> None:
    """Restore ``index`` into a temporary directory (every checksum verified), then remove it."""
    top = Path(
        await anyio.to_thread.run_sync(
            partial(tempfile.mkdtemp, prefix=".snapshot-check-", dir=scratch)
        )
    )
    try:
        await restore(index, blobs, namespace, top / "checkpoint")
    finally:
        await anyio.to_thread.run_sync(partial(shutil.rmtree, top, ignore_errors=True))


async def _indexes(blobs: SnapshotStore, namespace: str, query_id: str) -> list[StoredIndex]:
    base = prefix(namespace, query_id)
    listed = await retried("list snapshots", lambda: blobs.list(f"{base}index/"))
    return list(classify(listed, namespace, query_id).indexes)
