"""Take one snapshot: the cut of batch N, its new contents uploaded in packs, its index last.

:func:`upload_snapshot` takes the cut (``CheckpointSource.cut``), then finds each
file's content (SHA-256):

1. a file whose (path, size, stamp) the previous snapshot had is not read: its content is
   known (:class:`~sidecar.snapshot.contents.Contents`);
2. any other file is read and hashed, checked against its listing (a file gone or changed
   meanwhile raises ``FileChanged``): the small ones in groups (below), a large one streamed
   through ``source.open``;
3. a content already stored — by an earlier snapshot, or earlier in this one — is referenced
   where it is; only a new content's bytes are uploaded, once.

New contents of files up to :data:`PACKED_FILE_MAX_BYTES` travel together: appended to a pack
held in memory, which goes up (one Put Blob, or blocks and a Put Block List when larger than
the store's block) once it reaches ``pack_target_bytes``, and at the end. **Where the store
can be written from the source's side** (``SnapshotStore.target``: the daemon's store; and
the source reads in a process of its own, ``source.worker``: a local volume), the small files
go in groups of up to ``max(READ_GROUP_BYTES, pack_target_bytes)`` to that worker
(``Worker.pack``, ``sidecar.snapshot.packer``), which reads them with ``source.reader``,
hashes and packs them and sends the packs itself, so the daemon's event loop gets sums and
places, not bytes, and sends no pack request: CPU on that loop is what acks pay for
(``docs/benchmarks.md``). A pack then holds the new contents of one group; the contents
stored already are told to the job. Otherwise (a store wrapped in this process: the fault
tests') they are read in groups of :data:`READ_GROUP_BYTES` by ``source.read_checked`` and
packed and sent from here. A larger file is
read twice, streamed both times: a first pass hashes it, and only if its content is new a
second pass streams it into a pack of its own, hashed again on the way — a content that
differs from the first pass fails the snapshot (``FileChanged``) before the blob is committed.
So a snapshot's storage requests grow with its new bytes, not its number of files, and
memory stays bounded whatever a file's size: about ``(PACKS_IN_FLIGHT + 1) *
(pack_target_bytes + PACKED_FILE_MAX_BYTES)`` plus a group of reads and a block and a chunk
per large file in flight. Reads, hashes and uploads run under ``limiter`` (one token each;
shared between queries when given).

**The index is written last, create-only.** It exists only when every pack it names is
stored: a snapshot fails as a whole — a file changed mid-copy, a cut refused, the store
failing after retries — and leaves no index, only packs no index names, which prune deletes
after the grace period (``sidecar.snapshot.retention``). ``contents`` learns the snapshot
only once its index is written. The owner check comes right before it; where the packs went up
from the source's side, the index follows them there (``Worker.create``, in the same worker
process), so the loop encodes it and hands it over but does not send it — the write through
the async SDK was half the loop's CPU per snapshot (``docs/benchmarks.md``). Between the check
and the write there may be another query's job in that worker (at most one: two snapshots run
at once), as there may be a retry's backoff on either path.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping
from dataclasses import dataclass

import anyio
import anyio.to_thread
import msgspec

from sidecar.errors import SidecarError, StoreRefused, StoreUnavailable
from sidecar.snapshot import crc, stored
from sidecar.snapshot.contents import Contents
from sidecar.snapshot.cut import Cut, CutError, CutFile, Hints
from sidecar.snapshot.index import (
    FileEntry,
    SnapshotIndex,
    encode_index,
    index_name,
    new_id,
    now_text,
    pack_name,
)
from sidecar.snapshot.lineage import OFF_TIMELINE, OffTimeline
from sidecar.snapshot.packer import PackJob
from sidecar.snapshot.source import CheckpointSource, FileChanged, SourceError
from sidecar.snapshot.stored import SnapshotStore, chunks_of, create, first_error
from sidecar.snapshot.worker import WorkerDied

__all__ = ["Contents", "UploadError", "UploadResult", "failure_reason", "upload_snapshot"]

log = logging.getLogger(__name__)

MiB = 1024 * 1024
#: A pack is sealed and uploaded once it holds this many bytes.
DEFAULT_PACK_TARGET_BYTES = 8 * MiB
#: New files up to this size are read whole and packed together; larger ones are hashed in
#: a first pass and, when new, streamed into a pack of their own.
PACKED_FILE_MAX_BYTES = 1 * MiB
#: Sealed packs held in memory while they upload, per snapshot (the next one fills meanwhile).
PACKS_IN_FLIGHT = 2
#: Large files read at once per snapshot; and the limiter's size when none is given.
DEFAULT_CONCURRENCY = 4
#: Small files are read (and hashed) in groups of at most this many bytes: one call each.
READ_GROUP_BYTES = 4 * MiB
#: Chunks at least this large are hashed in a worker thread (hashlib releases the GIL), not
#: on the event loop.
HASH_IN_THREAD_BYTES = 256 * 1024
EMPTY_SHA256 = hashlib.sha256(b"").digest()

#: Every reason :func:`failure_reason` gives, as metrics label failed snapshots.
FAILURE_REASONS = (
    "file_changed",
    "cut_not_committed",
    "cut_missing_file",
    "cut_unreadable",
    "cut_unsupported",
    "source",
    "store_unavailable",
    "store_refused",
    "store",
    "wrong_query",
    "not_owner",
    "off_timeline",
    "other",
)


class UploadError(SidecarError):
    """The checkpoint at the location is not the query's (its ``metadata`` names another), or
    this process stopped owning the query during the upload (``reason``)."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class UploadResult(msgspec.Struct, frozen=True, kw_only=True):
    """One snapshot written."""

    index: SnapshotIndex
    #: The index blob's name and version.
    name: str
    version: str
    #: Bytes of file contents uploaded (in packs): each new content once.
    uploaded_bytes: int
    #: Files whose content this snapshot uploaded; files whose content was stored already.
    new_files: int
    reused_files: int
    #: Files read and hashed (the others were known by their stamp), and their bytes.
    hashed_files: int
    hashed_bytes: int
    #: Packs written.
    packs: int
    #: Storage requests this snapshot sent, by kind (put, block, commit, ...).
    requests: dict[str, int]
    #: The index blob's size.
    index_bytes: int
    duration_s: float

    @property
    def request_count(self) -> int:
        return sum(self.requests.values())


def failure_reason(exc: BaseException) -> str:
    """A failed snapshot's reason, one of :data:`FAILURE_REASONS` (a metric's label)."""
    if isinstance(exc, FileChanged):
        return "file_changed"
    if isinstance(exc, CutError):
        return f"cut_{exc.reason}"
    if isinstance(exc, SourceError | WorkerDied):  # its files, or the process reading them
        return "source"
    if isinstance(exc, StoreUnavailable):
        return "store_unavailable"
    if isinstance(exc, StoreRefused):
        return "store_refused"
    if isinstance(exc, UploadError):
        return exc.reason
    if isinstance(exc, SidecarError):
        return "store"
    return "other"


class _Sums:
    """A streamed file's SHA-256 and (where it is fast) CRC-32C, fed chunk by chunk."""

    def __init__(self, *, crc32c: bool = crc.AVAILABLE) -> None:
        self.sha = hashlib.sha256()
        self.crc: int | None = 0 if crc32c else None

    def update(self, chunk: bytes) -> None:
        self.sha.update(chunk)
        if self.crc is not None:
            self.crc = crc.extend(self.crc, chunk)


async def _update(sums: _Sums, chunk: bytes) -> None:
    if len(chunk) >= HASH_IN_THREAD_BYTES:
        await anyio.to_thread.run_sync(sums.update, chunk)
    else:
        sums.update(chunk)


def _groups(files: list[CutFile], max_bytes: int) -> Iterator[list[CutFile]]:
    """``files`` in order, in groups of at most ``max_bytes`` (one file at least)."""
    group: list[CutFile] = []
    size = 0
    for file in files:
        if group and size + file.size > max_bytes:
            yield group
            group, size = [], 0
        group.append(file)
        size += file.size
    if group:
        yield group


class _OpenPack:
    def __init__(self) -> None:
        self.id = new_id()
        self.buffer = bytearray()


class _Upload:
    """One snapshot being written: the files' entries, the contents it placed, its packs."""

    def __init__(
        self,
        source: CheckpointSource,
        location: str,
        blobs: SnapshotStore,
        namespace: str,
        query_id: str,
        contents: Contents,
        limiter: anyio.CapacityLimiter,
        pack_target_bytes: int,
        packed_file_max_bytes: int,
    ) -> None:
        self.source, self.location, self.blobs = source, location, blobs
        self.namespace, self.query_id, self.contents = namespace, query_id, contents
        self.limiter = limiter
        self.pack_target_bytes = pack_target_bytes
        self.packed_file_max_bytes = packed_file_max_bytes
        self.entries: dict[str, FileEntry] = {}
        #: Contents this snapshot placed: SHA-256 → (pack, offset), and their CRC-32C.
        self.placed: dict[bytes, tuple[str, int]] = {}
        self.crcs: dict[bytes, int] = {}
        #: Packs this snapshot writes → size.
        self.new_packs: dict[str, int] = {}
        self.open: _OpenPack | None = None
        self.slots = anyio.Semaphore(PACKS_IN_FLIGHT)
        self.uploaded_bytes = self.new_files = self.reused_files = 0
        self.hashed_files = self.hashed_bytes = 0
        self.tg: anyio.abc.TaskGroup | None = None

    def where(self, sha: bytes) -> tuple[str, int] | None:
        return self.placed.get(sha) or self.contents.locate(sha)

    def reuse(
        self, file: CutFile, sha: bytes, at: tuple[str, int], crc32c: int | None = None
    ) -> None:
        """``file``'s content is stored at ``at``; its CRC-32C as known, or as just read."""
        known = self.crcs.get(sha)
        if known is None:
            known = self.contents.crc32c(sha)
        entry = FileEntry(
            file.path, file.size, sha, at[0], at[1], crc32c if known is None else known
        )
        self.entries[file.path] = entry
        self.reused_files += 1

    def hashed(self, file: CutFile, sha: bytes, crc32c: int | None) -> bool:
        """``file`` was read and hashed: counted; True when its content is stored already
        (the file then references it there), False when it is new to place."""
        self.hashed_files += 1
        self.hashed_bytes += file.size
        at = self.where(sha)
        if at is None:
            return False
        self.reuse(file, sha, at, crc32c)
        return True

    def placed_new(
        self, file: CutFile, sha: bytes, crc32c: int | None, at: tuple[str, int]
    ) -> None:
        self.entries[file.path] = FileEntry(file.path, file.size, sha, at[0], at[1], crc32c)
        self.placed[sha] = at
        if crc32c is not None:
            self.crcs[sha] = crc32c
        self.new_files += 1
        self.uploaded_bytes += file.size

    async def run(self, files: list[CutFile]) -> None:
        small: list[CutFile] = []
        large: list[CutFile] = []
        for file in files:
            if file.size == 0:
                self.entries[file.path] = FileEntry(file.path, 0, EMPTY_SHA256, "", 0)
                self.reused_files += 1
                continue
            sha = self.contents.identify(file.path, file.size, file.stamp)
            at = self.where(sha) if sha is not None else None
            if sha is not None and at is not None:
                self.reuse(file, sha, at)
            elif file.size <= self.packed_file_max_bytes:
                small.append(file)
            else:
                large.append(file)
        # The largest first: a long second pass starts early.
        queue = iter(sorted(large, key=lambda f: -f.size))

        async def worker() -> None:
            for file in queue:  # shared: each file goes to one worker
                await self.large_file(file)

        with first_error():
            async with anyio.create_task_group() as tg:
                self.tg = tg
                async with anyio.create_task_group() as readers:
                    for _ in range(min(DEFAULT_CONCURRENCY, len(large))):
                        readers.start_soon(worker)
                    if small:
                        readers.start_soon(self.small_files, small)
                await self.seal()

    async def small_files(self, files: list[CutFile]) -> None:
        """Packed where they are read when the store can be written from there (the source's
        worker process), else here."""
        target, worker = self.blobs.target(), self.source.worker
        if target is None or worker is None:
            await self.small_files_here(files)
            return
        read = self.source.reader(self.location)
        for group in _groups(files, max(READ_GROUP_BYTES, self.pack_target_bytes)):
            known = frozenset(self.contents.stored()).union(self.placed)
            job = PackJob(
                [f.listed for f in group],
                known,
                target,
                self.namespace,
                self.query_id,
                self.pack_target_bytes,
                stored.ATTEMPTS,
            )
            async with self.limiter:
                packed = await worker.pack(read, job)
            _tell(self.blobs, packed.sent, "write snapshot pack")
            if packed.error is not None:
                raise packed.error
            self.new_packs.update(packed.packs)
            for file, got in zip(group, packed.files, strict=True):
                if got.placed is not None:
                    self.hashed_files += 1
                    self.hashed_bytes += file.size
                    self.placed_new(file, got.sha256, got.crc32c, got.placed)
                elif not self.hashed(file, got.sha256, got.crc32c):
                    # Known when the job started; prune never runs beside a snapshot of the
                    # same query, so this is a bug, not the store's.
                    raise AssertionError(f"content of {file.path} known to its pack job, now not")

    async def small_files_here(self, files: list[CutFile]) -> None:
        """Read and hashed a group at a time; each new content appended to the open pack,
        which this process sends."""
        for group in _groups(files, READ_GROUP_BYTES):
            async with self.limiter:
                read = await self.source.read_checked(self.location, [f.listed for f in group])
            for file, (sha, crc32c, data) in zip(group, read, strict=True):
                if self.hashed(file, sha, crc32c):
                    continue
                # Placed without an await in between: a same content a large file's worker
                # hashes meanwhile finds it placed.
                pack = self.open = self.open or _OpenPack()
                self.placed_new(file, sha, crc32c, (pack.id, len(pack.buffer)))
                pack.buffer += data
                if len(pack.buffer) >= self.pack_target_bytes:
                    await self.seal()

    async def large_file(self, file: CutFile) -> None:
        """Hashed in a first pass; if its content is new, streamed into a pack of its own."""
        async with self.limiter:
            sha, crc32c = await self.hash_stream(file)
        if self.hashed(file, sha, crc32c):
            return
        pack_id = new_id()
        self.placed_new(file, sha, crc32c, (pack_id, 0))
        async with self.limiter:
            await create(
                self.blobs,
                pack_name(self.namespace, self.query_id, pack_id),
                lambda: self.stream_checked(file, sha),
            )
        self.new_packs[pack_id] = file.size

    async def hash_stream(self, file: CutFile) -> tuple[bytes, int | None]:
        """The file's SHA-256 and CRC-32C (None where CRC-32C is slow)."""
        sums = _Sums()
        async with self.source.open(self.location, file.listed) as stream:
            async for chunk in stream:
                await _update(sums, chunk)
        return sums.sha.digest(), sums.crc

    async def stream_checked(self, file: CutFile, sha: bytes) -> AsyncGenerator[bytes, None]:
        """The file's chunks for its upload; raises before the end (so the put commits
        nothing) when its content is not the one hashed in the first pass."""
        sums = _Sums(crc32c=False)
        async with self.source.open(self.location, file.listed) as stream:
            async for chunk in stream:
                await _update(sums, chunk)
                yield chunk
        if sums.sha.digest() != sha:
            raise FileChanged(
                f"{file.path} changed between its hash and its upload (same listing, other "
                "bytes): this snapshot fails; the next one reads it again",
                reason="changed",
            )

    async def seal(self) -> None:
        """Send the open pack up (waiting while :data:`PACKS_IN_FLIGHT` are)."""
        pack, self.open = self.open, None
        if pack is None or not pack.buffer:
            return
        assert self.tg is not None
        await self.slots.acquire()
        self.tg.start_soon(self.upload_pack, pack)

    async def upload_pack(self, pack: _OpenPack) -> None:
        try:
            async with self.limiter:
                await create(
                    self.blobs,
                    pack_name(self.namespace, self.query_id, pack.id),
                    lambda: chunks_of(pack.buffer, self.blobs.block_bytes),
                )
            self.new_packs[pack.id] = len(pack.buffer)
        finally:
            self.slots.release()


def _tell(blobs: SnapshotStore, sent: stored.Sent, call: str) -> None:
    """What a job sent from the source's side counted in ``blobs`` (its failed tries as
    ``call``'s), and its log lines logged here."""
    blobs.sent_elsewhere(sent.requests, [(call, reason) for reason in sent.failures])
    for level, line in sent.said:
        log.log(level, "%s", line)


async def upload_snapshot(
    source: CheckpointSource,
    location: str,
    batch: int,
    blobs: SnapshotStore,
    namespace: str,
    query_id: str,
    contents: Contents,
    *,
    limiter: anyio.CapacityLimiter | None = None,
    pack_target_bytes: int = DEFAULT_PACK_TARGET_BYTES,
    packed_file_max_bytes: int = PACKED_FILE_MAX_BYTES,
    owner: Callable[[], bool] = lambda: True,
    lineage: Callable[[int, Mapping[str, bytes]], tuple[str | None, str | None]] | None = None,
    hints: tuple[str, Hints] | None = None,
) -> UploadResult:
    """Take the cut of ``batch`` of the checkpoint at ``location`` (under ``source``'s root)
    and store it as a snapshot of ``query_id`` (see the module docstring); ``contents``
    learns it.

    Raises (nothing of the snapshot is then named by an index; ``contents`` is unchanged):
        CutError: no consistent cut of ``batch`` (not committed yet, a file missing, ...).
        FileChanged: a file was deleted or rewritten while it was copied; a later batch's
            snapshot will do.
        SourceError: the location cannot be read.
        UploadError: the checkpoint at ``location`` is another query's (``wrong_query``), or
            ``owner()`` said, right before the index, that this process no longer owns the
            query (``not_owner``: its packs are orphans, swept after the grace period), or
            ``lineage`` refused the cut (``off_timeline``: ``sidecar.snapshot.lineage``).
        SidecarError: the store's errors, after retries (``StoreUnavailable``,
            ``StoreRefused``, ...).
    """
    started = time.monotonic()
    counted = blobs.counted()
    asked = _Asked(source, location, batch, query_id, lineage, hints)
    cut = await _cut(asked)
    upload = _Upload(
        source,
        location,
        counted,
        namespace,
        query_id,
        contents,
        limiter or anyio.CapacityLimiter(DEFAULT_CONCURRENCY),
        pack_target_bytes,
        packed_file_max_bytes,
    )
    await upload.run(list(cut.files))
    index = _index(asked, cut, upload)
    body = encode_index(index)
    name = index_name(namespace, query_id, batch, index.id)
    if not owner():  # only the owner names a snapshot (its packs alone name nothing)
        raise UploadError(
            f"query {query_id}: its lease was lost during the snapshot of batch {batch}: no "
            "index written (the new owner snapshots it)",
            reason="not_owner",
        )
    version = await _write_index(source, counted, name, body)
    contents.learn(index, name=name, version=version, stamps={f.path: f.stamp for f in cut.files})
    return _written(upload, index, name, version, len(body), started)


@dataclass(frozen=True, slots=True)
class _Asked:
    """The snapshot asked for: of ``batch`` of the checkpoint at ``location`` under
    ``source``'s root, for ``query_id``; ``lineage`` and ``hints`` as
    :func:`upload_snapshot` takes them."""

    source: CheckpointSource
    location: str
    batch: int
    query_id: str
    lineage: Callable[[int, Mapping[str, bytes]], tuple[str | None, str | None]] | None
    hints: tuple[str, Hints] | None


async def _cut(asked: _Asked) -> Cut:
    """The cut of the batch asked for (from the hints, when given); refused when the
    checkpoint is another query's."""
    source, location, batch, hints = asked.source, asked.location, asked.batch, asked.hints
    cut = await (source.cut(location, batch, hints[1]) if hints else source.cut(location, batch))
    if cut.query_id != asked.query_id:
        raise UploadError(
            f"the checkpoint at {location or '.'} is query {cut.query_id}'s, not "
            f"{asked.query_id}'s (its metadata file names it): snapshots of a location go to "
            "its own query",
            reason="wrong_query",
        )
    return cut


def _index(asked: _Asked, cut: Cut, upload: _Upload) -> SnapshotIndex:
    """The snapshot's index: the cut's files where ``upload`` found or put their contents,
    the size of each pack they name, its parent and timeline."""
    files = tuple(upload.entries[f.path] for f in cut.files)
    packs: dict[str, int] = {}
    for f in files:
        if f.size and f.pack not in packs:
            size = upload.new_packs.get(f.pack) or upload.contents.pack_size(f.pack)
            if size is None:  # a place Contents gave without its pack: a bug, not the store's
                raise AssertionError(f"no size known for pack {f.pack} of {f.path}")
            packs[f.pack] = size
    parent, timeline = _lineage(asked, cut, files)
    return SnapshotIndex(
        query_id=asked.query_id,
        batch=asked.batch,
        id=new_id(),
        created_at=now_text(),
        location=asked.location,
        checkpoint_format=cut.checkpoint_format,
        files=files,
        packs=packs,
        new_bytes=upload.uploaded_bytes,
        parent=parent,
        timeline=timeline,
    )


def _lineage(
    asked: _Asked, cut: Cut, files: tuple[FileEntry, ...]
) -> tuple[str | None, str | None]:
    """The snapshot's parent and timeline, by ``asked.lineage`` (None, None without it).

    Raises:
        UploadError: ``lineage`` refused the cut (``off_timeline``).
        CutError: the cut took state ids from the hints' snapshot, which it does not follow.
    """
    parent, timeline = None, None
    if asked.lineage is not None:  # its place among the query's snapshots, by content
        try:
            parent, timeline = asked.lineage(asked.batch, {f.path: f.sha256 for f in files})
        except OffTimeline as exc:
            what = f"query {asked.query_id} batch {asked.batch}: {exc}"
            raise UploadError(what, reason=OFF_TIMELINE) from exc
    hints = asked.hints
    if cut.hinted and (hints is None or parent != hints[0]):
        raise CutError(
            f"the cut of batch {asked.batch} took state ids from snapshot "
            f"{hints[0] if hints else '?'} where Spark's retention deleted the commits naming "
            "them, but this checkpoint does not follow that snapshot (its logs differ): "
            "a later batch's cut will do",
            reason="missing_file",
        )
    return parent, timeline


async def _write_index(
    source: CheckpointSource, blobs: SnapshotStore, name: str, body: bytes
) -> str:
    """Write the index blob ``name``, create-only, from where the packs went up (the source's
    worker process when the store can be written from there, else here); its version."""
    target, worker = blobs.target(), source.worker
    if target is None or worker is None:
        return await create(blobs, name, lambda: chunks_of(body, len(body)))
    # Sent by the worker that sent the packs: the loop only hands it the bytes.
    created = await worker.create(stored.CreateJob(target, name, body, stored.ATTEMPTS))
    _tell(blobs, created.sent, "write snapshot index")
    if created.error is not None:
        raise created.error
    return created.version


def _written(
    upload: _Upload, index: SnapshotIndex, name: str, version: str, index_bytes: int, started: float
) -> UploadResult:
    """The snapshot written, as its result (the requests its store ``upload.blobs`` counted,
    the index's too; its duration since ``started``), logged."""
    result = UploadResult(
        index=index,
        name=name,
        version=version,
        uploaded_bytes=upload.uploaded_bytes,
        new_files=upload.new_files,
        reused_files=upload.reused_files,
        hashed_files=upload.hashed_files,
        hashed_bytes=upload.hashed_bytes,
        packs=len(upload.new_packs),
        requests=dict(upload.blobs.requests),
        index_bytes=index_bytes,
        duration_s=time.monotonic() - started,
    )
    log.info(
        "snapshot written: query=%s batch=%d snapshot=%s files=%d new_files=%d reused=%d "
        "uploaded_bytes=%d packs=%d requests=%d index_bytes=%d duration_s=%.3f",
        index.query_id,
        index.batch,
        index.id,
        len(index.files),
        result.new_files,
        result.reused_files,
        result.uploaded_bytes,
        result.packs,
        result.request_count,
        result.index_bytes,
        result.duration_s,
    )
    return result
