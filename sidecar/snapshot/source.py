"""Where a checkpoint's files are read from: the reading side's I/O edge.

A :class:`CheckpointSource` is one root holding query checkpoint locations. It answers these
questions, and nothing above it touches the files another way:

- :meth:`~CheckpointSource.locations`: each query's checkpoint location under the root — a
  directory with a ``metadata`` file holding the query id (Spark writes ``{"id": …}`` there
  when the query first starts). Found by a walk of bounded depth that does not descend into
  a location once found, nor into ``state/``, ``_spark_metadata/`` or hidden directories.
- :meth:`~CheckpointSource.cut`: the cut of one batch of a location
  (:func:`~sidecar.snapshot.cut.cut_of_names`): every file listed by name (relative
  ``/``-separated path; a directory entry says what it is, so no ``stat`` per file), then the
  few files it parses read, and only the files it keeps or reads stat-ed (size, and a stamp of
  this version of the file, :class:`ListedFile`): on a network volume (NFS, Azure Files) each
  stat is a round trip, and a checkpoint holds ten times the files a cut keeps (Spark's
  retained batches, every state version). A directory's own files are listed before its
  subdirectories are walked:
  RocksDB uploads a snapshot's SST files before its ``.zip``, so a ``.zip`` in the listing
  finds its SSTs listed after it (unless Spark deleted them since). A local volume's cut runs
  in the snapshot's worker process (``sidecar.snapshot.worker``) at the lowest priority:
  listing thousands of files and parsing the cut is the snapshot's main CPU cost, and in a
  thread of the daemon it would hold the interpreter lock the acks need (measured:
  ``docs/benchmarks.md``).
- :meth:`~CheckpointSource.read_checked`: small files whole with their sums (SHA-256,
  CRC-32C), each checked against its listing as :meth:`~CheckpointSource.open` checks it,
  several in one call: the many small files a snapshot uploads cost the daemon one call per
  group, not a step per file (open, read, check, close, hash). A local volume reads and
  hashes them in the cut's worker process, so the daemon only receives their bytes.
- :meth:`~CheckpointSource.reader` and :attr:`~CheckpointSource.worker`: where the packs
  are made beside the reads. A local volume names its worker process and a picklable reader
  of a location's files (checked and hashed as :meth:`read_checked` does); the uploader hands
  both to :meth:`~sidecar.snapshot.worker.Worker.pack`, which sends the new contents in
  packs from there: the daemon then receives sums and places, neither the bytes nor the
  store's requests pass through its event loop. The source itself only reads.
- :meth:`~CheckpointSource.open`: a file for streaming, checked against its listing: opened
  only if it still has the listed size and stamp, and checked again when its last byte was
  read — a file Spark deleted, rewrote or replaced meanwhile raises :class:`FileChanged`, so
  that snapshot fails cleanly and a later one (a new listing, a new cut) succeeds. Memory is
  bounded by the chunk size whatever the file's size.
- :meth:`~CheckpointSource.server_copy`: how the destination can copy the file itself, with
  no bytes through the pod, or None. A local or shared volume (:class:`LocalSource`) has no
  such way: its bytes are streamed.

**Where the checkpoint is, next.** A checkpoint already on Azure storage (``abfss://``,
``wasbs://``) is a source of the same shape: ``locations`` lists blob prefixes holding a
``metadata`` blob, ``cut`` a flat blob listing (path, size, the ETag as stamp) and
:func:`~sidecar.snapshot.cut.cut_of` in a worker thread reading blobs through
``anyio.from_thread`` (the daemon's CPU is then a listing's, not a walk's), ``open``,
``read_checked`` and ``reader`` ranged downloads with ``If-Match`` on the listed ETag (a
rewritten blob answers 412: :class:`FileChanged`), and ``server_copy`` answers a
:class:`ServerCopy` (the blob's URL and ETag) so the uploader copies it server-side (Put Block
From URL with a source ``If-Match``) instead of streaming it. The cut, the uploader and the
index do not change.

Everything here runs its blocking calls in worker threads or a worker process; nothing blocks
the event loop.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Literal, Protocol, TypeVar

import anyio
import anyio.to_thread
import msgspec

from sidecar.config import Config
from sidecar.errors import SidecarError
from sidecar.model.spark_dir import SparkCheckpointError, parse_query_metadata
from sidecar.snapshot import crc
from sidecar.snapshot.cut import Cut, Hints, ListedFile, cut_of_names
from sidecar.snapshot.packer import Reader, SmallFile
from sidecar.snapshot.worker import Worker, WorkerDied

#: How deep under the root checkpoint locations are looked for (the root itself is depth 0):
#: ``<root>/<app>/<query>`` is depth 2.
MAX_LOCATION_DEPTH = 4
#: Directory names never walked into while looking for locations: a checkpoint's state (its
#: largest subtree), the file sink's log, hidden directories.
SKIPPED_DIRS = frozenset({"state", "_spark_metadata"})
#: A ``metadata`` file larger than this is not Spark's (``{"id":"<uuid>"}`` is 45 bytes).
METADATA_MAX_BYTES = 4096
#: The largest file :meth:`CheckpointSource.read` returns whole: the cut reads logs, operator
#: metadata and RocksDB ``.zip`` files (a few KiB to a few MiB: MANIFEST, OPTIONS, metadata).
SMALL_FILE_MAX_BYTES = 64 * 1024 * 1024
#: Bytes read per chunk when a file is streamed: the copy's memory per file in flight.
CHUNK_BYTES = 1024 * 1024

A = TypeVar("A")
R = TypeVar("R")


class Location(msgspec.Struct, frozen=True):
    """One query's checkpoint location under a source's root."""

    #: Relative to the root, ``/``-separated; ``""`` is the root itself.
    path: str
    query_id: str


class ServerCopy(msgspec.Struct, frozen=True):
    """A file the destination can copy by itself: from ``url``, if it still has ``etag``."""

    url: str
    etag: str


class SourceError(SidecarError):
    """The source cannot be read (its root is missing, a file is too large to read whole, the
    cut's worker process died)."""

    def __init__(
        self, message: str, *, reason: Literal["unreadable", "too_large", "worker"]
    ) -> None:
        super().__init__(message)
        self.reason = reason


class FileChanged(SidecarError):
    """A file is no longer the one listed: gone, rewritten or replaced. That copy fails; a
    new listing and cut will do (Spark deletes and rewrites files as it runs)."""

    retriable = True

    def __init__(self, message: str, *, reason: Literal["gone", "changed"]) -> None:
        super().__init__(message)
        self.reason = reason


class FileStream(Protocol):
    """An open file, read in chunks; the last chunk comes only after the file was checked."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...


class CheckpointSource(Protocol):
    """A root holding Spark checkpoint locations (see the module's docstring)."""

    async def locations(self) -> list[Location]:
        """Every checkpoint location under the root, sorted by path.

        Raises:
            SourceError: the root cannot be read.
        """
        ...

    async def cut(self, location: str, batch: int, hints: Hints | None = None) -> Cut:
        """The cut of ``batch`` of the checkpoint at ``location`` (a :attr:`Location.path`):
        listed, then cut (``hints``: format v2's ids of an earlier snapshot, ``cut_of``).

        Raises:
            CutError: see :func:`~sidecar.snapshot.cut.cut_of` (a file gone since the listing
                is ``missing_file``).
            SourceError: the location cannot be listed, or a file the cut parses is too
                large.
        """
        ...

    def open(self, location: str, file: ListedFile) -> AbstractAsyncContextManager[FileStream]:
        """``file`` of ``location`` to stream, checked against its listing.

        Raises:
            FileChanged: when opened or after its last byte: it is gone or not as listed.
        """
        ...

    async def read_checked(self, location: str, files: Sequence[ListedFile]) -> list[SmallFile]:
        """Each of ``files`` of ``location`` whole with its sums, in order (small ones: the
        caller bounds their sizes), each checked against its listing as :meth:`open` checks
        it.

        Raises:
            FileChanged: one is gone or not as listed.
            SourceError: the worker reading them died (``worker``).
        """
        ...

    @property
    def worker(self) -> Worker | None:
        """The process this source reads in, from where a snapshot's packs and index are sent
        too (its reads are there already); None: a source read from the daemon's process."""
        ...

    def reader(self, location: str) -> Reader:
        """A blocking, picklable reader of ``location``'s files, each whole with its sums and
        checked against its listing as :meth:`read_checked` does (``FileChanged``): for a
        pack job in :attr:`worker` (``sidecar.snapshot.worker.Worker.pack``)."""
        ...

    def server_copy(self, location: str, file: ListedFile) -> ServerCopy | None:
        """Where the destination can copy ``file`` from by itself; None: stream it."""
        ...


def configured_source(config: Config) -> CheckpointSource | None:
    """The source ``SIDECAR_SNAPSHOT_ROOT`` names; None when it is unset (snapshots off)."""
    return LocalSource(Path(config.snapshot_root)) if config.snapshot_root else None


def _relative(path: str) -> str:
    """``path`` checked to stay below its location: relative, no ``..``, no empty part."""
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"not a relative checkpoint path: {path!r}")
    return path


def _stamp(st: os.stat_result) -> str:
    return f"{st.st_ino}:{st.st_mtime_ns}"


class LocalSource:
    """A checkpoint root on a local or shared (NFS, Azure Files) volume: ``SIDECAR_SNAPSHOT_ROOT``.

    The stamp of a file is its inode and modification time: Spark writes each file to a
    temporary name and renames it into place, so a rewrite is a new inode.
    """

    def __init__(
        self,
        root: Path,
        *,
        max_depth: int = MAX_LOCATION_DEPTH,
        chunk_bytes: int = CHUNK_BYTES,
        worker: Worker | None = None,
    ) -> None:
        self.root = root
        self.max_depth = max_depth
        self.chunk_bytes = chunk_bytes
        #: Its cuts and reads, one at a time, and the packs made from them.
        self.worker = worker or Worker()

    def __str__(self) -> str:
        """The root's path: what the daemon's log lines name (``root %s``, ``under %s``)."""
        return str(self.root)

    def __repr__(self) -> str:
        return f"LocalSource({str(self.root)!r})"

    def _dir(self, location: str) -> Path:
        return self.root / _relative(location) if location else self.root

    async def locations(self) -> list[Location]:
        return await anyio.to_thread.run_sync(self._locations)

    def _locations(self) -> list[Location]:
        if not self.root.is_dir():
            raise SourceError(
                f"the snapshot root {self.root} is not a directory: mount the checkpoint "
                "volume there (read-only is enough) or set SIDECAR_SNAPSHOT_ROOT to where it is",
                reason="unreadable",
            )
        found: list[Location] = []
        pending: list[tuple[Path, str, int]] = [(self.root, "", 0)]
        while pending:
            directory, rel, depth = pending.pop()
            try:
                with os.scandir(directory) as entries:
                    listed = list(entries)
            except OSError:  # gone or not readable meanwhile: not a location
                continue
            query_id = self._query_id(listed, rel)
            if query_id is not None:
                found.append(Location(rel, query_id))
                continue
            if depth >= self.max_depth:
                continue
            for entry in listed:
                if (
                    entry.name.startswith(".")
                    or entry.name in SKIPPED_DIRS
                    or not entry.is_dir(follow_symlinks=False)
                ):
                    continue
                pending.append((Path(entry.path), f"{rel}/{entry.name}".lstrip("/"), depth + 1))
        return sorted(found, key=lambda loc: loc.path)

    @staticmethod
    def _query_id(entries: list[os.DirEntry[str]], rel: str) -> str | None:
        for entry in entries:
            if entry.name == "metadata" and entry.is_file(follow_symlinks=False):
                try:
                    with open(entry.path, "rb") as f:
                        data = f.read(METADATA_MAX_BYTES + 1)
                except OSError:
                    return None
                if len(data) > METADATA_MAX_BYTES:
                    return None
                try:
                    return parse_query_metadata(data, rel or ".")
                except SparkCheckpointError:
                    return None
        return None

    async def cut(self, location: str, batch: int, hints: Hints | None = None) -> Cut:
        return await self._in_worker_at("cutting", location, cut_here, (batch, hints))

    async def _in_worker_at(
        self, doing: str, location: str, job: Callable[[str, A], R], arg: A
    ) -> R:
        """``job(directory, arg)`` in the worker process, on ``location``'s directory.

        Raises:
            SourceError: the worker died before it answered (``worker``).
        """
        top = self._dir(location)
        try:
            return await self.worker.run(f"{doing} {top}", partial(job, str(top), arg))
        except WorkerDied as exc:
            raise SourceError(str(exc), reason="worker") from exc

    @asynccontextmanager
    async def open(self, location: str, file: ListedFile) -> AsyncIterator[FileStream]:
        full = self._dir(location) / _relative(file.path)
        fd = await anyio.to_thread.run_sync(_open_checked, full, file)
        try:
            yield _LocalStream(fd, full, file, self.chunk_bytes)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(os.close, fd)

    async def read_checked(self, location: str, files: Sequence[ListedFile]) -> list[SmallFile]:
        return await self._in_worker_at("reading", location, read_checked_here, list(files))

    def reader(self, location: str) -> Reader:
        return partial(read_hashed, self._dir(location))

    def server_copy(self, location: str, file: ListedFile) -> ServerCopy | None:
        return None


def cut_here(top: str, job: tuple[int, Hints | None]) -> Cut:
    """The cut of a batch of the checkpoint directory ``top`` (``job``: the batch and the
    hints), listed and cut in this process (:meth:`LocalSource.cut`'s worker: a picklable
    job)."""
    directory = Path(top)
    batch, hints = job
    return cut_of_names(
        names_of(directory),
        partial(read_small, directory),
        partial(stat_of, directory),
        batch,
        hints,
    )


def read_checked_here(top: str, files: list[ListedFile]) -> list[SmallFile]:
    """Each of ``files`` under ``top`` whole and hashed, checked against its listing, in this
    process (:meth:`LocalSource.read_checked`'s worker)."""
    directory = Path(top)
    return [read_hashed(directory, f) for f in files]


def read_hashed(top: Path, file: ListedFile) -> SmallFile:
    """``file`` under ``top`` whole with its sums, checked when opened and after its last
    byte (blocking).

    Raises:
        FileChanged: it is gone or not as listed.
    """
    data = _read_checked(top / _relative(file.path), file)
    return SmallFile(
        hashlib.sha256(data).digest(), crc.crc32c(data) if crc.AVAILABLE else None, data
    )


def names_of(top: Path) -> list[str]:
    """Every regular file under the directory ``top``, as relative paths, a directory's own
    files before its subdirectories' (blocking: the cut's worker calls it). No ``stat`` per
    file: what a directory entry is comes with it (``d_type``: local file systems, NFS,
    Azure Files), so a listing costs one call per directory; the cut stats only the files
    it keeps or reads (:func:`stat_of`).

    Raises:
        SourceError: ``top`` is not a directory.
    """
    if not top.is_dir():
        raise SourceError(
            f"{top} is not a directory: the checkpoint location is gone or not mounted",
            reason="unreadable",
        )
    out: list[str] = []
    pending: list[tuple[Path, str]] = [(top, "")]
    while pending:
        directory, rel = pending.pop()
        try:
            with os.scandir(directory) as entries:
                listed = list(entries)
        except FileNotFoundError:  # Spark removed it meanwhile
            continue
        subdirs = []
        # A directory's files first, then its subdirectories (see the module docstring).
        for entry in listed:
            path = f"{rel}/{entry.name}" if rel else entry.name
            try:
                if entry.is_file(follow_symlinks=False):
                    out.append(path)
                elif entry.is_dir(follow_symlinks=False):
                    subdirs.append((Path(entry.path), path))
            except FileNotFoundError:  # where the type needs a stat: gone meanwhile
                continue
        pending.extend(sorted(subdirs, reverse=True))
    return out


def stat_of(top: Path, path: str) -> ListedFile:
    """The file ``path`` (relative) under ``top`` with its size and stamp (blocking).

    Raises:
        FileNotFoundError: it is gone, or no longer a regular file.
    """
    st = os.stat(top / _relative(path), follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise FileNotFoundError(f"{path} is no longer a regular file")
    return ListedFile(path, st.st_size, _stamp(st))


def read_small(top: Path, path: str) -> bytes:
    """The file ``path`` (relative) under ``top`` whole: one the cut parses (blocking).

    Raises:
        FileNotFoundError: it is gone.
        ValueError: ``path`` is not relative to ``top``.
        SourceError: it is larger than :data:`SMALL_FILE_MAX_BYTES`.
    """
    full = top / _relative(path)
    with open(full, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > SMALL_FILE_MAX_BYTES:
            raise SourceError(
                f"{full} has {size} bytes, more than the {SMALL_FILE_MAX_BYTES} read whole "
                "for a cut: it is not a file Spark writes that small; is the checkpoint "
                "damaged?",
                reason="too_large",
            )
        return f.read()


def _read_checked(full: Path, file: ListedFile) -> bytes:
    """``file`` whole, checked when opened and after its last byte."""
    fd = _open_checked(full, file)
    try:
        parts: list[bytes] = []
        got = 0
        while got < file.size:
            chunk = os.pread(fd, file.size - got, got)
            if not chunk:
                raise _ended(file, got)
            parts.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    _check_after(full, file)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _ended(file: ListedFile, offset: int) -> FileChanged:
    return FileChanged(
        f"{file.path} ended after {offset} of its {file.size} listed bytes: Spark rewrote it; "
        "this copy fails, the next snapshot lists it again",
        reason="changed",
    )


def _check_after(full: Path, file: ListedFile) -> None:
    """``file`` is still at ``full`` as listed, after its last byte was read."""
    try:
        st = os.stat(full)
    except FileNotFoundError as exc:
        raise FileChanged(
            f"{file.path} was deleted while it was copied (Spark's retention or a rewrite): "
            "this copy fails; the next snapshot lists the checkpoint again",
            reason="gone",
        ) from exc
    _check(st, file, "after it was read")


def _open_checked(full: Path, file: ListedFile) -> int:
    try:
        fd = os.open(full, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise FileChanged(
            f"{file.path} is gone since it was listed (Spark deleted it): this copy fails; "
            "the next snapshot lists the checkpoint again",
            reason="gone",
        ) from exc
    try:
        _check(os.fstat(fd), file, "when opened")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check(st: os.stat_result, file: ListedFile, when: str) -> None:
    if st.st_size != file.size or _stamp(st) != file.stamp:
        raise FileChanged(
            f"{file.path} changed since it was listed ({when}: {st.st_size} bytes, stamp "
            f"{_stamp(st)}; listed {file.size} bytes, stamp {file.stamp}): Spark rewrote or "
            "replaced it; this copy fails, the next snapshot lists the checkpoint again",
            reason="changed",
        )


class _LocalStream:
    """Chunks of an open file up to its listed size; the file is checked again by path after
    its last chunk was read (still there, same inode, size and mtime) before the iteration
    ends, so a consumer that read every chunk without error holds the listed file."""

    def __init__(self, fd: int, full: Path, file: ListedFile, chunk_bytes: int) -> None:
        self.fd, self.full, self.file, self.chunk_bytes = fd, full, file, chunk_bytes
        self.offset = 0
        self.checked = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self.offset >= self.file.size:
            if not self.checked:
                await anyio.to_thread.run_sync(_check_after, self.full, self.file)
                self.checked = True
            raise StopAsyncIteration
        want = min(self.chunk_bytes, self.file.size - self.offset)
        chunk = await anyio.to_thread.run_sync(os.pread, self.fd, want, self.offset)
        if not chunk:
            raise _ended(self.file, self.offset)
        self.offset += len(chunk)
        return chunk
