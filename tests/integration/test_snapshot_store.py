"""Snapshots stored and restored against real Azurite, from real checkpoint directories on disk
(sidecar/snapshot/upload.py, prune.py, restore.py): the first backup of a new store,
incremental backups that upload only new bytes in a handful of requests, dedup across
snapshots and restarts, restore on a new host verified byte for byte, missing and damaged
packs, files changed mid-copy, failures injected at each stage (a wrapper around the blob
edge, and the HTTP fault proxy for retries), cleanup by a new process, and the no-leak run.

Spark-shaped directories come from tests/snapshotdirs.py; the real-Spark restores are
tests/integration/test_snapshot_restore.py.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio
import anyio.to_thread
import google_crc32c
import msgspec
import pytest

from sidecar.config import Config
from sidecar.errors import SidecarError, StoreError, StoreUnavailable, VersionConflict
from sidecar.model.document import SnapshotRef
from sidecar.snapshot import restore as restore_module
from sidecar.snapshot import stored
from sidecar.snapshot.contents import Contents
from sidecar.snapshot.cut import ListedFile
from sidecar.snapshot.index import FileEntry, SnapshotIndex, pack_name, parse_pack_name, prefix
from sidecar.snapshot.packer import Packed, PackJob, Reader, SmallFile
from sidecar.snapshot.prune import prune
from sidecar.snapshot.restore import (
    RestoreError,
    SnapshotNotFound,
    find_snapshot,
    list_snapshots,
    plan_reads,
    restore,
)
from sidecar.snapshot.retention import ListedLike, classify, marks_name
from sidecar.snapshot.source import FileChanged, FileStream, LocalSource
from sidecar.snapshot.stored import RemoteBlobs, SnapshotStore, chunks_of
from sidecar.snapshot.upload import UploadResult, failure_reason, upload_snapshot
from sidecar.snapshot.worker import Worker, WorkerDied
from sidecar.store.blobs import BlobStore
from sidecar.store.snapshots import BLOCK_BYTES, SnapshotBlobs
from tests.faults.store_proxy import Fault, StoreFaultProxy
from tests.helpers import ConfigFactory
from tests.services import Azurite
from tests.snapshotdirs import QUERY_ID, HdfsCheckpoint, put, tree
from tests.snapshots import copy_cut

# -- the blob edge, real and with faults ---------------------------------------------------


@asynccontextmanager
async def opened(
    config: Config,
    *,
    block_bytes: int = BLOCK_BYTES,
    told: list[tuple[str, str]] | None = None,
) -> AsyncIterator[SnapshotBlobs]:
    """The snapshot blobs of a store of their own (a process: nothing shared); ``told``
    gets each (call, reason) the store counts as failed."""
    store = BlobStore(config, creates_container=True)
    if told is not None:
        store.on_failure = lambda call, reason: told.append((call, reason))
    await store.ensure_container()
    try:
        yield SnapshotBlobs(store.account, block_bytes=block_bytes)
    finally:
        await store.aclose()


@dataclass
class Rule:
    """Fail the next ``times`` calls of ``call`` on a blob whose name contains ``blob``:
    before the call (it did not happen) or after it (it happened; the caller sees an error)."""

    call: str
    blob: str
    error: Callable[[], SidecarError]
    times: int = 1
    landed: bool = False
    #: Matching calls let through before the first failure.
    skip: int = 0
    hits: int = 0
    seen: int = 0


def fatal() -> SidecarError:
    return StoreError("injected: the store refuses this call")


def flaky() -> SidecarError:
    return StoreUnavailable("injected: 503 ServerBusy", reason="503 ServerBusy")


@dataclass
class Faulty:
    """The blob edge with :class:`Rule` failures injected (shared by its counted views)."""

    inner: SnapshotStore
    rules: list[Rule] = field(default_factory=list)

    @property
    def block_bytes(self) -> int:
        return self.inner.block_bytes

    @property
    def requests(self) -> dict[str, int]:
        return self.inner.requests

    def counted(self) -> Faulty:
        return Faulty(self.inner.counted(), self.rules)

    def target(self) -> None:
        """None: the faults are injected in this process, so the packs go up through it."""
        return None

    def sent_elsewhere(
        self, requests: Mapping[str, int], failures: Sequence[tuple[str, str]]
    ) -> None:
        raise AssertionError("no target: nothing is sent elsewhere")

    def _rule(self, call: str, name: str) -> Rule | None:
        for rule in self.rules:
            if rule.call == call and rule.blob in name:
                rule.seen += 1
                if rule.seen > rule.skip and rule.hits < rule.times:
                    rule.hits += 1
                    return rule
        return None

    async def _do(self, call: str, name: str, run: Callable[[], object]) -> object:
        rule = self._rule(call, name)
        if rule is not None and not rule.landed:
            raise rule.error()
        result = await run()  # type: ignore[misc]
        if rule is not None:
            raise rule.error()
        return result

    async def put(self, name: str, chunks: AsyncIterable[bytes]) -> tuple[int, str]:
        out = await self._do("put", name, lambda: self.inner.put(name, chunks))
        return out  # type: ignore[return-value]

    async def replace(self, name: str, body: bytes, version: str) -> str:
        out = await self._do("replace", name, lambda: self.inner.replace(name, body, version))
        return out  # type: ignore[return-value]

    async def list(self, prefix: str) -> Sequence[ListedLike]:
        return await self.inner.list(prefix)

    async def read(self, name: str) -> tuple[bytes, str] | None:
        return await self.inner.read(name)

    async def read_range(self, name: str, offset: int, length: int) -> bytes:
        out = await self._do(
            "read_range", name, lambda: self.inner.read_range(name, offset, length)
        )
        return out  # type: ignore[return-value]

    async def delete(self, name: str, version: str | None = None) -> bool:
        out = await self._do("delete", name, lambda: self.inner.delete(name, version))
        return out  # type: ignore[return-value]


# -- helpers -------------------------------------------------------------------------------


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def crc(data: bytes) -> int:
    return int(google_crc32c.value(data))


def without_crcs(index: SnapshotIndex) -> SnapshotIndex:
    """``index`` as written before indexes kept CRC-32C."""
    files = tuple(msgspec.structs.replace(f, crc32c=None) for f in index.files)
    return msgspec.structs.replace(index, files=files)


async def snapshot(
    ck: HdfsCheckpoint,
    blobs: SnapshotStore,
    namespace: str,
    contents: Contents,
    batch: int | None = None,
    **options: int,
) -> UploadResult:
    return await upload_snapshot(
        LocalSource(ck.root),
        "",
        ck.next_batch - 1 if batch is None else batch,
        blobs,
        namespace,
        QUERY_ID,
        contents,
        **options,  # type: ignore[arg-type]
    )


async def reference(ck: HdfsCheckpoint, batch: int, dest: Path) -> dict[str, bytes]:
    """The cut of ``batch`` copied to ``dest`` now (what a restore of it must equal)."""
    source = LocalSource(ck.root)
    cut = await source.cut("", batch)
    await copy_cut(source, "", cut, dest)
    return tree(dest)


async def blob_names(blobs: SnapshotStore, namespace: str) -> list[str]:
    return sorted(b.name for b in await blobs.list(prefix(namespace, QUERY_ID)))


async def consistent(
    blobs: SnapshotStore, namespace: str, *, named: SnapshotRef | None = None
) -> list[SnapshotIndex]:
    """Every listed index names only stored packs, in range; the snapshots, newest first."""
    listing = classify(await blobs.list(prefix(namespace, QUERY_ID)), namespace, QUERY_ID)
    snapshots = await list_snapshots(blobs, namespace, QUERY_ID)
    assert len(snapshots) == len(listing.indexes)
    for index in snapshots:
        for f in index.files:
            if f.size:
                assert f.pack in listing.packs, f"{index.batch}: {f.path} in missing {f.pack}"
                assert f.offset + f.size <= listing.packs[f.pack].size
    return snapshots


class Meddling(LocalSource):
    """A source whose ``meddle(path, opened)`` runs before each open: Spark at work. Its
    worker's pack jobs open files too: the meddling runs before each job's files."""

    def __init__(self, root: Path, meddle: Callable[[str, int], None]) -> None:
        super().__init__(root, worker=_MeddledWorker(self))
        self.meddle = meddle
        self.opened: dict[str, int] = {}

    async def _opening(self, file: ListedFile) -> None:
        self.opened[file.path] = self.opened.get(file.path, 0) + 1
        await anyio.to_thread.run_sync(self.meddle, file.path, self.opened[file.path])

    @asynccontextmanager
    async def open(self, location: str, file: ListedFile) -> AsyncIterator[FileStream]:
        await self._opening(file)
        async with super().open(location, file) as stream:
            yield stream

    async def read_checked(self, location: str, files: Sequence[ListedFile]) -> list[SmallFile]:
        for file in files:
            await self._opening(file)
        return await super().read_checked(location, files)


class _MeddledWorker(Worker):
    def __init__(self, source: Meddling) -> None:
        super().__init__()
        self.source = source

    async def pack(self, read: Reader, job: PackJob) -> Packed:
        for file in job.files:
            await self.source._opening(file)
        return await super().pack(read, job)


@pytest.fixture
async def blobs(make_config: ConfigFactory) -> AsyncGenerator[SnapshotBlobs, None]:
    async with opened(make_config()) as store:
        yield store


# -- backups -------------------------------------------------------------------------------


async def test_the_first_backup_of_a_new_store(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=4)
    for _ in range(3):
        ck.batch()
    contents = Contents()
    result = await snapshot(ck, blobs, namespace, contents)

    cut = await LocalSource(ck.root).cut("", 2)
    index = result.index
    assert (index.query_id, index.batch, index.location) == (QUERY_ID, 2, "")
    assert [f.path for f in index.files] == [f.path for f in cut.files]
    files = tree(ck.root)
    distinct = {sha(files[f.path]): f.size for f in cut.files if f.size}
    assert all(f.sha256 == sha(files[f.path]) for f in index.files)
    assert all(f.crc32c == crc(files[f.path]) for f in index.files if f.size)
    assert result.uploaded_bytes == sum(distinct.values()) == index.new_bytes
    assert result.new_files == len(distinct) and result.hashed_files == len(cut.files)
    assert result.new_files + result.reused_files == len(cut.files)
    # Everything in one pack (a Put Blob), then the index (another): 2 requests for 23 files.
    assert result.requests == {"put": 2} and result.packs == 1
    names = await blob_names(blobs, namespace)
    assert names == sorted([result.name, pack_name(namespace, QUERY_ID, index.files[-1].pack)])
    assert sum(index.packs.values()) == result.uploaded_bytes
    assert contents.known == len(distinct)


async def test_incremental_backups_upload_only_new_bytes_in_a_handful_of_requests(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=20, delta_bytes=30_000)
    contents = Contents()
    stored: set[bytes] = set()  # every content uploaded so far
    previous: dict[str, str] = {}
    for _ in range(20):
        batch = ck.batch()
        result = await snapshot(ck, blobs, namespace, contents)
        files = tree(ck.root)
        new = [f for f in result.index.files if previous.get(f.path) != stamp(ck, f.path)]
        new_file_bytes = sum(f.size for f in new)
        expected = {f.sha256: f.size for f in new if f.size and f.sha256 not in stored}
        assert result.uploaded_bytes == sum(expected.values())
        assert result.uploaded_bytes <= 1.05 * new_file_bytes
        assert result.new_files == len(expected)
        stored.update(sha(files[f.path]) for f in result.index.files if f.size)
        # Every file carries its CRC-32C, those known by their stamp or content too.
        assert all(f.crc32c == crc(files[f.path]) for f in result.index.files if f.size)
        previous = {f.path: stamp(ck, f.path) for f in result.index.files}
        if batch:
            # 23 new files (20 deltas, offsets, commits, a source entry), 43 with the
            # snapshots every 10th version: one pack, one index.
            assert len(new) >= 23
            assert result.hashed_files == len(new)  # the others known by their stamp
            assert result.requests == {"put": 2}, result.requests
            assert result.index_bytes < 64 * 1024
    # No content was uploaded twice: the packs hold exactly the distinct contents.
    listing = classify(await blobs.list(prefix(namespace, QUERY_ID)), namespace, QUERY_ID)
    snapshots = await list_snapshots(blobs, namespace, QUERY_ID)
    distinct = {f.sha256: f.size for s in snapshots for f in s.files if f.size}
    assert sum(p.size for p in listing.packs.values()) == sum(distinct.values())
    assert [s.batch for s in snapshots] == list(range(19, -1, -1))


def leftovers(directory: Path) -> list[str]:
    """Hidden entries of ``directory``: what a restore leaves beside its destination."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def stamp(ck: HdfsCheckpoint, path: str) -> str:
    st = os.stat(ck.root / path)
    return f"{st.st_ino}:{st.st_mtime_ns}"


async def test_a_content_rewritten_under_its_name_is_uploaded_again_an_unchanged_one_never(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=4, idle_every=0)
    for _ in range(3):
        ck.batch()
    contents = Contents()
    first = await snapshot(ck, blobs, namespace, contents)

    again = await snapshot(ck, blobs, namespace, contents)
    assert (again.uploaded_bytes, again.new_files, again.hashed_files) == (0, 0, 0)
    assert again.requests == {"put": 1}  # the index alone
    assert [f.sha256 for f in again.index.files] == [f.sha256 for f in first.index.files]

    # A re-run batch rewrites a state file under the same name (checkpoint v1).
    ck.rewrite("state/0/1/3.delta")
    rewritten = await snapshot(ck, blobs, namespace, contents)
    assert (rewritten.new_files, rewritten.hashed_files) == (1, 1)
    assert rewritten.uploaded_bytes == (ck.root / "state/0/1/3.delta").stat().st_size
    changed = {f.path for f in rewritten.index.files} - {
        f.path for f, g in zip(rewritten.index.files, first.index.files, strict=True) if f == g
    }
    assert changed == {"state/0/1/3.delta"}


async def test_a_restarted_process_uploads_no_content_twice(
    make_config: ConfigFactory, namespace: str, tmp_path: Path
) -> None:
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=6)
    async with opened(make_config()) as first:
        contents = Contents()
        for _ in range(4):
            ck.batch()
            await snapshot(ck, first, namespace, contents)
    ck.batch()
    async with opened(make_config()) as second:  # a new process: nothing in memory
        loaded = await Contents.load(second, namespace, QUERY_ID)
        assert loaded.known == contents.known
        result = await snapshot(ck, second, namespace, loaded)
        cut = await LocalSource(ck.root).cut("", 4)
        assert result.hashed_files == len(cut.files)  # no stamps after a restart: read again
        new = {sha((ck.root / f"state/0/{p}/5.delta").read_bytes()) for p in range(6)}
        new |= {sha((ck.root / f"{d}/4").read_bytes()) for d in ("offsets", "commits")}
        new |= {sha((ck.root / "sources/0/4").read_bytes())}
        expected = {
            f.sha256: f.size
            for f in result.index.files
            if f.sha256 in new and contents.locate(f.sha256) is None
        }
        assert result.uploaded_bytes == sum(expected.values())
        files = tree(ck.root)
        assert all(f.crc32c == crc(files[f.path]) for f in result.index.files if f.size)


# -- restore -------------------------------------------------------------------------------


async def test_restore_on_a_new_host_is_the_checkpoint_byte_for_byte(
    make_config: ConfigFactory, namespace: str, tmp_path: Path
) -> None:
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=5)
    refs: dict[int, dict[str, bytes]] = {}
    async with opened(make_config()) as blobs:
        contents = Contents()
        for _ in range(12):
            batch = ck.batch()
            await snapshot(ck, blobs, namespace, contents)
            if batch in (5, 11):
                refs[batch] = await reference(ck, batch, tmp_path / f"ref{batch}")
        ck.rewrite("state/0/2/12.delta")  # the source moves on: the snapshot does not

    async with opened(make_config()) as host2:
        newest = await find_snapshot(host2, namespace, QUERY_ID)
        assert newest.batch == 11
        result = await restore(newest, host2, namespace, tmp_path / "host2" / "ck")
        assert tree(tmp_path / "host2" / "ck") == refs[11]
        assert (result.batch, result.files) == (11, len(newest.files))
        assert result.bytes == sum(len(b) for b in refs[11].values())
        # It is a checkpoint: its own cut of 11 is every file it holds.
        cut = await LocalSource(tmp_path / "host2" / "ck").cut("", 11)
        assert [f.path for f in cut.files] == sorted(refs[11])

        older = await find_snapshot(host2, namespace, QUERY_ID, 5)
        await restore(older, host2, namespace, tmp_path / "older")
        assert tree(tmp_path / "older") == refs[5]
        assert [s.batch for s in await list_snapshots(host2, namespace, QUERY_ID)] == list(
            range(11, -1, -1)
        )
        with pytest.raises(SnapshotNotFound) as missing:
            await find_snapshot(host2, namespace, QUERY_ID, 99)
        assert missing.value.available == tuple(range(12))
        assert "no snapshot of batch 99" in str(missing.value)

        # Not over a directory holding something, unless forced: then replaced whole.
        with pytest.raises(RestoreError) as refused:
            await restore(newest, host2, namespace, tmp_path / "older")
        assert refused.value.reason == "not_empty"
        assert tree(tmp_path / "older") == refs[5]
        (tmp_path / "older" / "stray").write_bytes(b"left by someone")
        await restore(newest, host2, namespace, tmp_path / "older", force=True)
        assert tree(tmp_path / "older") == refs[11]
        assert leftovers(tmp_path) == []


async def test_restore_checks_each_file_by_its_crc32c_or_by_its_sha256_in_an_older_index(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=3, delta_bytes=150_000)
    for _ in range(3):
        ck.batch()
    index = (await snapshot(ck, blobs, namespace, Contents())).index
    ref = await reference(ck, 2, tmp_path / "ref")
    piece = 64 * 1024  # the deltas come back in slices too
    assert any(f.size > piece for f in index.files)

    for n, shown in enumerate((index, without_crcs(index))):
        for range_bytes in (piece, 4 * 1024 * 1024):
            dest = tmp_path / f"ok-{n}-{range_bytes}"
            await restore(shown, blobs, namespace, dest, range_bytes=range_bytes)
            assert tree(dest) == ref

    # The CRC is what is checked: one that is not the file's fails it, bytes intact.
    for f in (
        min(index.files, key=lambda f: f.size or 1 << 60),
        max(index.files, key=lambda f: f.size),
    ):
        wrong = msgspec.structs.replace(f, crc32c=(f.crc32c or 0) ^ 1)
        bad = msgspec.structs.replace(
            index, files=tuple(wrong if g.path == f.path else g for g in index.files)
        )
        with pytest.raises(RestoreError) as caught:
            await restore(bad, blobs, namespace, tmp_path / "bad", range_bytes=piece)
        assert caught.value.reason == "checksum" and f.path in str(caught.value), f.path
        assert not (tmp_path / "bad").exists() and leftovers(tmp_path) == []

    # Without CRCs, the SHA-256 finds a damaged byte: in a small file and in a slice.
    for f in (
        min(index.files, key=lambda f: f.size or 1 << 60),
        max(index.files, key=lambda f: f.size),
    ):
        name = pack_name(namespace, QUERY_ID, f.pack)
        body, version = await blobs.read(name) or (b"", "")
        at = f.offset + f.size - 1
        flipped = body[:at] + bytes([body[at] ^ 0xFF]) + body[at + 1 :]
        version = await blobs.replace(name, flipped, version)
        with pytest.raises(RestoreError) as caught:
            await restore(
                without_crcs(index), blobs, namespace, tmp_path / "bad", range_bytes=piece
            )
        assert (caught.value.reason, caught.value.blob) == ("checksum", name)
        assert f.path in str(caught.value) and not (tmp_path / "bad").exists()
        await blobs.replace(name, body, version)


async def test_restore_names_a_missing_or_damaged_pack_and_leaves_dest_as_it_was(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=4)
    contents = Contents()
    for _ in range(3):
        ck.batch()
        result = await snapshot(ck, blobs, namespace, contents, pack_target_bytes=50_000)
    index = result.index
    assert len(index.packs) > 2
    listing = classify(await blobs.list(prefix(namespace, QUERY_ID)), namespace, QUERY_ID)
    packs = sorted(index.packs)

    # Damaged: same size, other bytes. Restored over an existing checkpoint (force): that
    # checkpoint is left as it was.
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "metadata").write_bytes(b"the checkpoint that was here")
    damaged = listing.packs[packs[0]]
    body, version = await blobs.read(damaged.name) or (b"", "")
    flipped = bytes([body[0] ^ 0xFF]) + body[1:]
    await blobs.replace(damaged.name, flipped, version)
    with pytest.raises(RestoreError) as caught:
        await restore(index, blobs, namespace, dest, force=True)
    assert caught.value.reason == "checksum" and caught.value.blob == damaged.name
    first = min((f for f in index.files if f.pack == packs[0]), key=lambda f: f.offset)
    assert caught.value.path == first.path and first.path in str(caught.value)
    assert tree(dest) == {"metadata": b"the checkpoint that was here"}
    assert leftovers(tmp_path) == []

    # Shorter than the index says, then gone: refused before anything is written.
    short = listing.packs[packs[1]]
    body, version = await blobs.read(short.name) or (b"", "")
    await blobs.replace(short.name, body[:-1], version)
    with pytest.raises(RestoreError) as caught:
        await restore(index, blobs, namespace, tmp_path / "new")
    assert (caught.value.reason, caught.value.blob) == ("missing_blob", short.name)
    assert f"{short.name} holds {short.size - 1} bytes" in str(caught.value)
    missing = listing.packs[packs[2]]
    await blobs.delete(missing.name)
    await blobs.delete(short.name)
    with pytest.raises(RestoreError) as caught:
        await restore(index, blobs, namespace, tmp_path / "new")
    assert (caught.value.reason, caught.value.blob) == (
        "missing_blob",
        min(short.name, missing.name),
    )
    assert "is not stored" in str(caught.value)
    assert not (tmp_path / "new").exists()
    assert leftovers(tmp_path) == []


@dataclass
class HeldBack:
    """The blob edge holding back the first slice of each large content until the content's
    other slices have landed in the restore's file (its size is whole), so that they land
    first and are read back to be hashed; and the listing, when ``list_after`` is given,
    until a read has failed."""

    inner: SnapshotStore
    firsts: dict[tuple[str, int], Callable[[], bool]] = field(default_factory=dict)
    list_after: anyio.Event | None = None

    @property
    def block_bytes(self) -> int:
        return self.inner.block_bytes

    @property
    def requests(self) -> dict[str, int]:
        return self.inner.requests

    def counted(self) -> HeldBack:
        return HeldBack(self.inner.counted(), self.firsts, self.list_after)

    def target(self) -> RemoteBlobs | None:
        return self.inner.target()

    def sent_elsewhere(
        self, requests: Mapping[str, int], failures: Sequence[tuple[str, str]]
    ) -> None:
        self.inner.sent_elsewhere(requests, failures)

    async def put(self, name: str, chunks: AsyncIterable[bytes]) -> tuple[int, str]:
        return await self.inner.put(name, chunks)

    async def replace(self, name: str, body: bytes, version: str) -> str:
        return await self.inner.replace(name, body, version)

    async def list(self, prefix: str) -> Sequence[ListedLike]:
        if self.list_after is not None:
            await self.list_after.wait()
        return await self.inner.list(prefix)

    async def read(self, name: str) -> tuple[bytes, str] | None:
        return await self.inner.read(name)

    async def read_range(self, name: str, offset: int, length: int) -> bytes:
        landed = self.firsts.get((name, offset))
        if landed is not None:
            with anyio.fail_after(10):
                while not await anyio.to_thread.run_sync(landed):  # noqa: ASYNC110 - polls files
                    await anyio.sleep(0.01)
        try:
            return await self.inner.read_range(name, offset, length)
        except SidecarError:
            if self.list_after is not None:
                self.list_after.set()
            raise

    async def delete(self, name: str, version: str | None = None) -> bool:
        return await self.inner.delete(name, version)


async def test_large_files_come_back_in_slices_that_every_worker_takes(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    # Deltas of 300 KB restored in ranges of 64 KB: five slices each, downloaded by any of
    # the workers, written where they belong as they land, hashed in order.
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=4, delta_bytes=300_000, idle_every=0)
    for _ in range(2):
        ck.batch()
    # One content in two files: read once, copied.
    put(ck.root / "state/0/1/2.delta", (ck.root / "state/0/0/2.delta").read_bytes())
    index = (await snapshot(ck, blobs, namespace, Contents())).index
    ref = await reference(ck, 1, tmp_path / "ref")
    piece = 64 * 1024
    large: dict[tuple[str, int], FileEntry] = {}
    for f in index.files:
        if f.size > piece:
            large.setdefault((f.pack, f.offset), f)  # the first of its files: written first
    assert len(large) == 7  # eight deltas, one content twice
    dest = tmp_path / "restored"

    def whole(f: FileEntry) -> Callable[[], bool]:
        def landed() -> bool:  # the content's last slice is in its file
            return any(p.stat().st_size == f.size for p in tmp_path.glob(f".*.restore-*/{f.path}"))

        return landed

    held = HeldBack(
        blobs,
        {(pack_name(namespace, QUERY_ID, f.pack), f.offset): whole(f) for f in large.values()},
    )
    done = await restore(index, held, namespace, dest, range_bytes=piece, concurrency=8)
    assert tree(dest) == ref
    # A request per slice (and per range of the small files), each content once.
    reads = plan_reads(index, max_bytes=piece)
    assert sum(r.sliced for r in reads) == sum(-(-f.size // piece) for f in large.values())
    assert done.requests["read"] == len(reads)
    assert done.downloaded_bytes >= sum(f.size for f in large.values())
    assert leftovers(tmp_path) == []

    # A damaged slice in the middle of a file (it lands before the first and is read back
    # to be hashed): that file's checksum fails, nothing is put in place.
    f = max(large.values(), key=lambda f: f.offset)
    name = pack_name(namespace, QUERY_ID, f.pack)
    body, version = await blobs.read(name) or (b"", "")
    at = f.offset + 2 * piece + 5
    await blobs.replace(name, body[:at] + bytes([body[at] ^ 0xFF]) + body[at + 1 :], version)
    with pytest.raises(RestoreError) as caught:
        await restore(index, held, namespace, tmp_path / "again", range_bytes=piece)
    assert (caught.value.reason, caught.value.blob) == ("checksum", name)
    assert caught.value.path in {e.path for e in index.files if e.offset == f.offset}
    assert not (tmp_path / "again").exists() and leftovers(tmp_path) == []


async def test_a_read_that_finds_a_pack_gone_before_the_listing_fails_as_the_listing_says(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    # The listing runs beside the downloads: here it answers only after a read of the
    # missing pack has failed, which waits for it, so the error names the pack as missing.
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=4)
    ck.batch()
    index = (await snapshot(ck, blobs, namespace, Contents(), pack_target_bytes=50_000)).index
    gone = pack_name(namespace, QUERY_ID, sorted(index.packs)[0])
    await blobs.delete(gone)
    held = HeldBack(blobs, list_after=anyio.Event())
    with pytest.raises(RestoreError) as caught:
        await restore(index, held, namespace, tmp_path / "new")
    assert held.list_after is not None and held.list_after.is_set()
    assert (caught.value.reason, caught.value.blob) == ("missing_blob", gone)
    assert "is not stored" in str(caught.value)
    assert not (tmp_path / "new").exists() and leftovers(tmp_path) == []


async def test_restored_files_and_directories_are_on_disk_before_they_are_moved_into_place(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A crash (power lost) after the move must not leave a checkpoint of empty files: every
    # file's data and every directory's entries are synced first, the move itself after.
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=3, delta_bytes=300_000)
    for _ in range(2):
        ck.batch()
    index = (await snapshot(ck, blobs, namespace, Contents())).index
    events: list[tuple[str, str]] = []
    real_sync, real_fsync, real_rename = restore_module._sync_data, os.fsync, os.rename

    def path_of(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    def sync_data(fd: int) -> None:
        events.append(("data", path_of(fd)))
        real_sync(fd)

    def fsync(fd: int) -> None:
        events.append(("fsync", path_of(fd)))
        real_fsync(fd)

    def rename(src: str | Path, dst: str | Path) -> None:
        events.append(("rename", str(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(restore_module, "_sync_data", sync_data)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    dest = tmp_path / "dest"
    await restore(index, blobs, namespace, dest, range_bytes=64 * 1024)
    monkeypatch.undo()
    assert tree(dest) == await reference(ck, 1, tmp_path / "ref")

    moved = events.index(("rename", str(dest)))
    before = {(kind, Path(p).relative_to(dest.parent)) for kind, p in events[:moved]}
    temp = Path(events[0][1]).relative_to(dest.parent).parts[0]  # .dest.restore-<id>
    files = [p.relative_to(dest) for p in dest.rglob("*") if p.is_file()]
    dirs = [p.relative_to(dest) for p in dest.rglob("*") if p.is_dir()]
    assert len(files) == len(index.files)
    assert all(("data", Path(temp, f)) in before for f in files)
    assert all(("fsync", Path(temp, d)) in before for d in [Path(), *dirs])
    assert ("fsync", str(dest.parent)) in events[moved:]


# -- failures ------------------------------------------------------------------------------


class _DyingWorker(Worker):
    """A worker process the OOM killer takes at its first pack job."""

    def __init__(self) -> None:
        super().__init__()
        self.packs = 0

    async def pack(self, read: Reader, job: PackJob) -> Packed:
        self.packs += 1
        if self.packs == 1:
            await self.run("packing", partial(os._exit, 137))
        return await super().pack(read, job)


async def test_a_worker_dying_while_packing_fails_the_snapshot_as_its_source_the_next_succeeds(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    """The packs go up from the worker process the source reads in; one that dies mid-job
    fails that snapshot (no index, reason ``source``), and the next starts a new worker."""
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=4)
    for _ in range(3):
        ck.batch()
    worker = _DyingWorker()
    source = LocalSource(ck.root, worker=worker)
    contents = Contents()
    with pytest.raises(WorkerDied) as died:
        await upload_snapshot(source, "", 2, blobs, namespace, QUERY_ID, contents)
    assert failure_reason(died.value) == "source" and died.value.reason == "worker"
    assert "next one starts a new worker" in str(died.value)
    assert not [n for n in await blob_names(blobs, namespace) if "/index/" in n]
    result = await upload_snapshot(source, "", 2, blobs, namespace, QUERY_ID, contents)
    assert result.index.batch == 2 and worker.packs >= 2
    await consistent(blobs, namespace)


async def test_a_file_changed_mid_copy_fails_the_snapshot_cleanly_and_the_next_succeeds(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=4, idle_every=0)
    for _ in range(3):
        ck.batch()
    contents = Contents()
    await snapshot(ck, blobs, namespace, contents)
    known = contents.known
    ck.batch()
    before = await blob_names(blobs, namespace)

    def rewrite(path: str, opened: int) -> None:  # Spark rewrites it after the listing
        if path == "state/0/2/4.delta" and opened == 1:
            ck.rewrite(path)

    source = Meddling(ck.root, rewrite)
    with pytest.raises(FileChanged) as caught:
        await upload_snapshot(source, "", 3, blobs, namespace, QUERY_ID, contents)
    assert "state/0/2/4.delta" in str(caught.value)
    after = await blob_names(blobs, namespace)
    assert [n for n in after if "/index/" in n] == [n for n in before if "/index/" in n]
    assert contents.known == known  # nothing learned of a snapshot without an index
    result = await upload_snapshot(source, "", 3, blobs, namespace, QUERY_ID, contents)
    assert result.index.batch == 3
    await consistent(blobs, namespace)

    # A large file (its own pack, read twice) whose bytes change between the two passes but
    # not its listing (same inode, size and mtime): refused before its pack is committed.
    ck.batch()

    def in_place(path: str, opened: int) -> None:
        if path == "state/0/1/5.delta" and opened == 2:
            full = ck.root / path
            st = full.stat()
            with open(full, "r+b") as f:
                f.write(b"\x00" * 8)
            os.utime(full, ns=(st.st_atime_ns, st.st_mtime_ns))

    before = await blob_names(blobs, namespace)
    source = Meddling(ck.root, in_place)
    with pytest.raises(FileChanged) as caught:
        await upload_snapshot(
            source, "", 4, blobs, namespace, QUERY_ID, contents, packed_file_max_bytes=1000
        )
    assert "changed between its hash and its upload" in str(caught.value)
    assert [n for n in await blob_names(blobs, namespace) if "/index/" in n] == [
        n for n in before if "/index/" in n
    ]
    changed = (ck.root / "state/0/1/5.delta").read_bytes()
    for listed in await blobs.list(prefix(namespace, QUERY_ID)):
        if listed.name not in before:  # other files' packs: fine (orphans, prune's)
            body = await blobs.read(listed.name)
            assert body is not None and changed[8:] not in body[0]  # that one not committed


@pytest.mark.parametrize("landed", [False, True], ids=["refused", "landed-then-error"])
@pytest.mark.parametrize("stage", ["pack", "index"])
async def test_an_upload_failing_at_a_stage_leaves_no_snapshot_and_prune_cleans_it(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path, stage: str, landed: bool
) -> None:
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=6, idle_every=0)
    contents = Contents()
    ck.batch()
    await snapshot(ck, blobs, namespace, contents)
    ck.batch()
    faulty = Faulty(blobs)
    # The second pack, or the index, fails for good.
    blob = "/packs/" if stage == "pack" else "/index/"
    faulty.rules.append(Rule("put", blob, fatal, landed=landed, skip=stage == "pack"))
    known = contents.known
    with pytest.raises(StoreError):
        await snapshot(ck, faulty, namespace, contents, pack_target_bytes=60_000)
    snapshots = await consistent(blobs, namespace)
    if stage == "index" and landed:  # the index is there: a snapshot, whole
        assert [s.batch for s in snapshots] == [1, 0]
    else:
        assert [s.batch for s in snapshots] == [0]
    assert contents.known == known
    referenced = {f.pack for s in snapshots for f in s.files}
    stored = await blobs.list(prefix(namespace, QUERY_ID))
    orphans = [b for b in stored if parse_pack_name(b.name) not in referenced | {None}]
    # Sure to be left: the failed pack that landed, or the packs of the index that did not
    # (a refused pack's siblings may have been cut short).
    assert len(orphans) >= (landed if stage == "pack" else not landed)

    # Cleaned: nothing but what the kept snapshots reference (grace 0: nothing in flight).
    await prune(blobs, namespace, QUERY_ID, retain=5, named=None, grace_s=0)
    await assert_no_leak(blobs, namespace, retain=5, named=None)
    result = await snapshot(ck, blobs, namespace, contents)
    restored = tmp_path / "restored"
    await restore(result.index, blobs, namespace, restored)
    assert tree(restored) == await reference(ck, 1, tmp_path / "ref")


async def assert_no_leak(
    blobs: SnapshotStore,
    namespace: str,
    *,
    retain: int,
    named: SnapshotRef | None,
    repack_below: float = 0.5,
) -> list[SnapshotIndex]:
    """Every blob is a kept index, a pack a kept index references, or the marks; every
    pack has at least ``repack_below`` of its bytes live. The kept snapshots, newest first."""
    snapshots = await consistent(blobs, namespace)
    kept = snapshots[:retain]
    if named is not None:
        assert any((s.batch, s.id) == (named.batch_id, named.id) for s in snapshots)
        kept += [s for s in snapshots[retain:] if (s.batch, s.id) == (named.batch_id, named.id)]
    assert len(snapshots) == len(kept), [s.batch for s in snapshots]
    live: dict[str, dict[int, int]] = {}
    for s in kept:
        for f in s.files:
            if f.size:
                live.setdefault(f.pack, {})[f.offset] = f.size
    for blob in await blobs.list(prefix(namespace, QUERY_ID)):
        if blob.name == marks_name(namespace, QUERY_ID):
            continue
        pack = parse_pack_name(blob.name)
        if pack is None:
            assert any(blob.name.endswith(f"-{s.id}") for s in kept), blob.name
            continue
        assert pack in live, f"{blob.name} is referenced by no kept snapshot"
        assert sum(live[pack].values()) >= repack_below * blob.size, blob.name
    return kept


async def test_a_failed_prune_is_finished_by_the_next_pass_and_by_a_new_process(
    make_config: ConfigFactory, namespace: str, tmp_path: Path
) -> None:
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=6, snapshot_every=4)
    async with opened(make_config()) as blobs:
        contents = Contents()
        for _ in range(10):
            ck.batch()
            await snapshot(ck, blobs, namespace, contents)
        # An upload that failed at its index (orphan packs), then a prune failing midway
        # through its deletes: packs of dropped snapshots and the orphans.
        ck.batch()
        with pytest.raises(StoreError):
            await snapshot(ck, Faulty(blobs, [Rule("put", "/index/", fatal)]), namespace, contents)
        faulty = Faulty(blobs, [Rule("delete", "/packs/", fatal, times=1)])
        with pytest.raises(StoreError):
            await prune(
                faulty, namespace, QUERY_ID, retain=2, named=None, grace_s=0, contents=contents
            )
        await consistent(blobs, namespace)
        # The process that owned it stops here; its snapshot loop would go on like this:
        result = await snapshot(ck, blobs, namespace, contents)
        assert result.index.batch == 10
    async with opened(make_config()) as fresh:  # a new process
        passes = [
            await prune(fresh, namespace, QUERY_ID, retain=2, named=None, grace_s=0)
            for _ in range(3)
        ]
        assert passes[0].deleted_packs > 0 and passes[0].deleted_indexes > 0
        assert passes[-1].deleted_packs == passes[-1].deleted_indexes == 0  # harmless again
        kept = await assert_no_leak(fresh, namespace, retain=2, named=None)
        assert [s.batch for s in kept] == [10, 9]
        restored = tmp_path / "restored"
        await restore(kept[0], fresh, namespace, restored)
        assert tree(restored) == await reference(ck, 10, tmp_path / "ref")


async def test_the_grace_period_spares_unreferenced_packs_until_it_has_passed(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=4)
    contents = Contents()
    ck.batch()
    await snapshot(ck, blobs, namespace, contents)
    ck.batch()
    with pytest.raises(StoreError):  # as if still in flight: packs up, no index yet
        await snapshot(ck, Faulty(blobs, [Rule("put", "/index/", fatal)]), namespace, contents)
    orphans = {b.name for b in await blobs.list(prefix(namespace, QUERY_ID))} - set(
        await blob_names(blobs, namespace)
    )
    now = [1e10]

    async def pass_() -> int:
        result = await prune(
            blobs, namespace, QUERY_ID, retain=1, named=None, grace_s=600, clock=lambda: now[0]
        )
        return result.deleted_packs

    assert await pass_() == 0  # marked now
    marks = await blobs.read(marks_name(namespace, QUERY_ID))
    assert marks is not None
    now[0] += 599
    assert await pass_() == 0
    now[0] += 1
    assert await pass_() == 1  # unreferenced for the grace period: swept
    assert not orphans
    await assert_no_leak(blobs, namespace, retain=1, named=None)


async def test_retries_carry_uploads_prunes_and_restores_through_a_flaky_store(
    make_config: ConfigFactory,
    azurite: Azurite,
    namespace: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ~130 calls, one in six failing at each try: with 8 tries none gives up (with the
    # daemon's 4, one in ~800 calls would, and its snapshot fail: a later one is taken).
    monkeypatch.setattr(stored, "ATTEMPTS", 8)
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=6, snapshot_every=3)
    with StoreFaultProxy(azurite.port, seed=29) as proxy:
        config = make_config(azure_connection_string=proxy.connection_string())
        async with opened(config) as blobs:
            contents = Contents()
            proxy.faults = [
                # A create that ran, whose answer was lost: the retry finds it there.
                Fault("reset", kinds=frozenset({"create"}), share=0.25),
                # ServerBusy / OperationTimedOut on anything, before it ran.
                Fault("status", status=503, share=0.1, retry_after_s=0),
                Fault("status", status=500, share=0.05),
            ]
            for _ in range(6):
                ck.batch()
                await snapshot(
                    ck,
                    blobs,
                    namespace,
                    contents,
                    pack_target_bytes=70_000,
                    packed_file_max_bytes=20_000,
                )
                await prune(
                    blobs,
                    namespace,
                    QUERY_ID,
                    retain=2,
                    named=None,
                    grace_s=0,
                    contents=contents,
                )
            newest = await find_snapshot(blobs, namespace, QUERY_ID)
            await restore(newest, blobs, namespace, tmp_path / "restored")
            assert proxy.injected[("reset", "create")] > 0
            assert sum(n for (label, _), n in proxy.injected.items() if "status" in label) > 5
            proxy.faults = []
            await prune(blobs, namespace, QUERY_ID, retain=2, named=None, grace_s=0)
            kept = await assert_no_leak(blobs, namespace, retain=2, named=None)
    assert [s.batch for s in kept] == [5, 4]  # one index each: no retry wrote another
    assert tree(tmp_path / "restored") == await reference(ck, 5, tmp_path / "ref")


def busy_on(blobs: str, **options: object) -> Fault:
    """ServerBusy on the creates of blobs whose path holds ``/<blobs>/`` only (packs, index)."""
    return Fault(
        "status",
        status=503,
        kinds=frozenset({"create"}),
        path_has=f"/{blobs}/",
        retry_after_s=0,
        **options,  # type: ignore[arg-type]
    )


#: What a snapshot's blobs of each kind are called in the store's failure count when their
#: worker sent them (the daemon's own writes are "write snapshot blob").
SENT_BY_WORKER = {"packs": "write snapshot pack", "index": "write snapshot index"}


@pytest.mark.parametrize("refused", ["packs", "index"])
async def test_packs_and_index_go_up_from_the_worker_process_retried_and_counted_there(
    make_config: ConfigFactory, azurite: Azurite, namespace: str, tmp_path: Path, refused: str
) -> None:
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=4)
    for _ in range(2):
        ck.batch()
    told: list[tuple[str, str]] = []
    with StoreFaultProxy(azurite.port) as proxy:
        config = make_config(azure_connection_string=proxy.connection_string())
        async with opened(config, told=told) as blobs:
            proxy.faults = [busy_on(refused, times=2)]
            result = await snapshot(ck, blobs, namespace, Contents())
            # The worker sent the refused blob three times (two refused), the other once:
            # all counted in the snapshot's requests and the store's, the refusals told under
            # the worker's names (the daemon's would be "write snapshot blob").
            assert proxy.injected[("status 503", "create")] == 2
            assert result.packs == 1 and result.requests == {"put": 4}
            assert blobs.requests == {"put": 4}
            assert told == [(SENT_BY_WORKER[refused], "503 ServerBusy")] * 2
            newest = await find_snapshot(blobs, namespace, QUERY_ID)
            assert newest.id == result.index.id
            await restore(newest, blobs, namespace, tmp_path / "restored")
    assert tree(tmp_path / "restored") == await reference(ck, 1, tmp_path / "ref")


@pytest.mark.parametrize("refused", ["packs", "index"])
async def test_a_pack_or_index_the_store_keeps_refusing_fails_its_snapshot_and_names_nothing(
    make_config: ConfigFactory,
    azurite: Azurite,
    namespace: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    refused: str,
) -> None:
    monkeypatch.setattr(stored, "ATTEMPTS", 2)  # the worker tries as often as the daemon says
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=4)
    ck.batch()
    told: list[tuple[str, str]] = []
    with StoreFaultProxy(azurite.port) as proxy:
        config = make_config(azure_connection_string=proxy.connection_string())
        async with opened(config, told=told) as blobs:
            contents = Contents()
            proxy.faults = [busy_on(refused)]
            with pytest.raises(StoreUnavailable, match="503 ServerBusy") as raised:
                await snapshot(ck, blobs, namespace, contents)
            assert failure_reason(raised.value) == "store_unavailable"
            assert proxy.injected[("status 503", "create")] == 2
            # A failed job's requests and failures count too (a refused index: its pack went
            # up first, once).
            assert blobs.requests == {"put": 2 if refused == "packs" else 3}
            assert told == [(SENT_BY_WORKER[refused], "503 ServerBusy")] * 2
            assert not [n for n in await blob_names(blobs, namespace) if "/index/" in n]
            assert contents.known == 0
            proxy.faults = []
            result = await snapshot(ck, blobs, namespace, contents)
            assert result.index.batch == 0 and result.packs == 1
            newest = await find_snapshot(blobs, namespace, QUERY_ID)
            await restore(newest, blobs, namespace, tmp_path / "restored")
    assert tree(tmp_path / "restored") == await reference(ck, 0, tmp_path / "ref")


async def test_prune_keeps_the_newest_and_the_named_snapshot_and_repacks_sparse_packs(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=8, snapshot_every=5)
    contents = Contents()
    named: SnapshotRef | None = None
    repacked = rewritten = 0
    for _ in range(16):
        batch = ck.batch()
        result = await snapshot(ck, blobs, namespace, contents)
        if batch == 3:  # the document names it, and keeps naming it
            named = SnapshotRef(3, result.index.id)
            ref3 = await reference(ck, 3, tmp_path / "ref3")
        outcome = await prune(
            blobs, namespace, QUERY_ID, retain=2, named=named, grace_s=0, contents=contents
        )
        repacked += outcome.repacked_packs
        rewritten += outcome.rewritten_indexes
        # The snapshot loop's steady state: nothing read again that it wrote or read.
        assert outcome.requests.get("read", 0) <= 2 * outcome.repacked_packs
    await prune(blobs, namespace, QUERY_ID, retain=2, named=named, grace_s=0, contents=contents)
    assert repacked > 0 and rewritten > 0
    kept = await assert_no_leak(blobs, namespace, retain=2, named=named)
    assert [s.batch for s in kept] == [15, 14, 3]
    assert all(f.crc32c is not None for s in kept for f in s.files if f.size)  # moved along
    await restore(kept[-1], blobs, namespace, tmp_path / "named")
    assert tree(tmp_path / "named") == ref3
    await restore(kept[0], blobs, namespace, tmp_path / "newest")
    assert tree(tmp_path / "newest") == await reference(ck, 15, tmp_path / "ref15")
    # Contents follows the repacks: the next snapshot reuses what they moved.
    ck.batch()
    result = await snapshot(ck, blobs, namespace, contents)
    assert result.requests == {"put": 2}
    await consistent(blobs, namespace)


async def test_no_blob_leaks_after_failures_at_every_stage_and_a_prune(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    rng = random.Random(29)
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=6, snapshot_every=4, seed=29)
    contents = Contents()
    faulty = Faulty(blobs)
    named: SnapshotRef | None = None
    newest_ref: dict[str, bytes] = {}
    upload_stages = ["pack", "pack_landed", "pack_flaky", "index", "index_landed", "changed"]
    prune_stages = ["delete_index", "delete_pack", "marks", "repack_pack", "rewrite_index"]
    failed: set[str] = set()
    now = [1e10]
    # Every stage three times, in a random order; a prune stage's fault stays armed until a
    # pass makes that call (a repack happens only now and then).
    schedule = [*upload_stages, *prune_stages, "none"] * 3
    rng.shuffle(schedule)
    armed: list[Rule] = []
    for step, stage in enumerate(schedule):
        batch = ck.batch()
        faulty.rules[:] = {
            "pack": [Rule("put", "/packs/", fatal)],
            "pack_landed": [Rule("put", "/packs/", fatal, landed=True)],
            "pack_flaky": [Rule("put", "/packs/", flaky, times=2)],
            "index": [Rule("put", "/index/", fatal)],
            "index_landed": [Rule("put", "/index/", fatal, landed=True)],
        }.get(stage, [])

        def meddle(path: str, opened: int, batch: int = batch, stage: str = stage) -> None:
            if stage == "changed" and path == f"state/0/1/{batch + 1}.delta" and opened == 1:
                ck.rewrite(path)

        try:
            result = await upload_snapshot(
                Meddling(ck.root, meddle),
                "",
                batch,
                faulty,
                namespace,
                QUERY_ID,
                contents,
                pack_target_bytes=70_000,
                packed_file_max_bytes=40_000,
            )
        except (StoreError, FileChanged):
            failed.add(stage)
        else:
            newest_ref = await reference(ck, batch, tmp_path / f"ref{step}")
            if named is None or rng.random() < 0.4:  # the document's write lags at times
                named = SnapshotRef(batch, result.index.id)

        armed += {
            "delete_index": [Rule("delete", "/index/", fatal)],
            "delete_pack": [Rule("delete", "/packs/", fatal, skip=rng.randrange(3))],
            "marks": [Rule("put", "unreferenced", fatal), Rule("replace", "unreferenced", fatal)],
            "repack_pack": [Rule("put", "/packs/", fatal)],
            "rewrite_index": [Rule("replace", "/index/", fatal)],
        }.get(stage, [])
        faulty.rules[:] = armed = [r for r in armed if r.hits < r.times]
        hits = sum(r.hits for r in armed)
        now[0] += 100  # a step: more than the grace period (marked, swept next step)
        try:
            await prune(
                faulty,
                namespace,
                QUERY_ID,
                retain=3,
                named=named,
                grace_s=60,
                contents=contents,
                clock=lambda: now[0],
            )
        except StoreError:
            assert sum(r.hits for r in armed) > hits
            failed.update(f"{r.call} {r.blob}" for r in armed if r.hits)
        await consistent(blobs, namespace)  # after every step: no index names a missing pack

    assert failed >= {*upload_stages} - {"pack_flaky"}, failed  # that one is retried
    assert failed >= {"delete /index/", "delete /packs/", "put /packs/", "replace /index/"}
    assert failed & {"put unreferenced", "replace unreferenced"}, failed
    for _ in range(2):
        now[0] += 100
        await prune(
            blobs, namespace, QUERY_ID, retain=3, named=named, grace_s=60, clock=lambda: now[0]
        )
    kept = await assert_no_leak(blobs, namespace, retain=3, named=named)
    for i, index in enumerate(kept):
        await restore(index, blobs, namespace, tmp_path / f"restored{i}")  # verified
    assert tree(tmp_path / "restored0") == newest_ref


async def test_a_content_swept_by_prune_and_seen_again_is_uploaded_again(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    ck = HdfsCheckpoint(
        tmp_path / "ck", partitions=1, delta_bytes=50_000, snapshot_every=0, idle_every=0
    )
    contents = Contents()
    ck.batch()
    await snapshot(ck, blobs, namespace, contents)
    content = (ck.root / "state/0/0/1.delta").read_bytes()
    ck.batch()
    put(ck.root / "state/0/0/2.snapshot", ck.noise(1000))  # maintenance: 1.delta leaves the cut
    await snapshot(ck, blobs, namespace, contents)
    swept = 0
    for _ in range(2):  # the first pass repacks the sparse first pack, the next sweeps it
        outcome = await prune(
            blobs, namespace, QUERY_ID, retain=1, named=None, grace_s=0, contents=contents
        )
        swept += outcome.deleted_packs
    assert swept >= 1 and contents.locate(sha(content)) is None
    ck.batch()
    put(ck.root / "state/0/0/3.delta", content)  # the same bytes again, later
    result = await snapshot(ck, blobs, namespace, contents)
    assert result.uploaded_bytes >= len(content)
    await consistent(blobs, namespace)
    await restore(result.index, blobs, namespace, tmp_path / "restored")
    assert tree(tmp_path / "restored") == await reference(ck, 2, tmp_path / "ref")


async def test_packs_larger_than_a_block_go_up_in_blocks_and_come_back_whole(
    make_config: ConfigFactory, namespace: str, tmp_path: Path
) -> None:
    ck = HdfsCheckpoint(tmp_path / "ck", partitions=3, delta_bytes=70_000, idle_every=0)
    for _ in range(2):
        ck.batch()
    async with opened(make_config(), block_bytes=64 * 1024) as blobs:
        contents = Contents()
        # One pack of ~210 KB: four blocks and a commit.
        result = await snapshot(ck, blobs, namespace, contents, packed_file_max_bytes=100_000)
        assert result.requests["block"] >= 4 and result.requests["commit"] == 1
        # Past packed_file_max_bytes, a pack of its own per delta: blocks and a commit each.
        ck.batch()
        result = await snapshot(ck, blobs, namespace, contents, packed_file_max_bytes=50_000)
        assert result.requests["commit"] == 3
        await restore(result.index, blobs, namespace, tmp_path / "restored")
        assert tree(tmp_path / "restored") == await reference(ck, 2, tmp_path / "ref")
        # Create-only in blocks too: the same name again is refused, typed.
        name = pack_name(namespace, QUERY_ID, next(iter(result.index.packs)))
        with pytest.raises(VersionConflict):
            await blobs.put(name, chunks_of(b"x" * 200_000, 200_000))


async def snapshots_of(
    ck: HdfsCheckpoint, count: int, blobs: SnapshotStore, namespace: str
) -> list[SnapshotIndex]:
    """``count`` batches of ``ck``, each snapshotted (knowing nothing stored before it)."""
    made = []
    for _ in range(count):
        ck.batch()
        made.append((await snapshot(ck, blobs, namespace, Contents())).index)
    return made


async def test_a_prune_stops_at_the_phase_where_its_owner_lost_the_query(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    # Six snapshots, two kept. The owner loses the query's lease after the marks are written
    # (a new owner may be pruning by now): the pass deletes nothing; its owner back, the
    # next pass does it all.
    await snapshots_of(HdfsCheckpoint(tmp_path / "ck", partitions=4, snapshot_every=2), 6, blobs,
                       namespace)  # fmt: skip
    asked: list[bool] = []

    def owner() -> bool:
        asked.append(len(asked) < 1)  # owned for the marks, lost before the deletes
        return asked[-1]

    stopped = await prune(blobs, namespace, QUERY_ID, retain=2, named=None, grace_s=0, owner=owner)
    assert asked == [True, False]
    assert (stopped.deleted_indexes, stopped.deleted_packs) == (0, 0)
    assert len(await consistent(blobs, namespace)) == 6
    done = await prune(blobs, namespace, QUERY_ID, retain=2, named=None, grace_s=0)
    assert done.deleted_indexes == 4 and len(await consistent(blobs, namespace)) == 2


async def test_a_prune_deletes_no_blob_changed_since_it_listed_it(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    # An index beyond retention is rewritten (by another pass's repack) between this pass's
    # listing and its delete: the delete names the version listed and is refused; the index
    # stays for a later pass to judge, the others go.
    await snapshots_of(HdfsCheckpoint(tmp_path / "ck", partitions=4, snapshot_every=2), 4, blobs,
                       namespace)  # fmt: skip
    oldest = classify(await blobs.list(prefix(namespace, QUERY_ID)), namespace, QUERY_ID)
    target = oldest.indexes[-1]

    class RewrittenFirst(Faulty):
        def counted(self) -> RewrittenFirst:
            return RewrittenFirst(self.inner.counted(), self.rules)

        async def delete(self, name: str, version: str | None = None) -> bool:
            if name == target.name:
                got = await self.inner.read(name)
                assert got is not None and version == target.version
                await self.inner.replace(name, got[0], got[1])  # same body, a new version
            return await super().delete(name, version)

    result = await prune(
        RewrittenFirst(blobs), namespace, QUERY_ID, retain=1, named=None, grace_s=3600
    )
    left = {s.name for s in classify(await blobs.list(prefix(namespace, QUERY_ID)), namespace,
                                     QUERY_ID).indexes}  # fmt: skip
    assert result.deleted_indexes == 2 and result.conflicts >= 1
    assert target.name in left and len(left) == 2


async def test_check_finds_each_snapshot_that_cannot_be_restored(
    blobs: SnapshotBlobs, namespace: str, tmp_path: Path
) -> None:
    # Three snapshots, each with a pack of its own (every file is new in each). The newest's
    # pack is damaged (same size, other bytes): only reading it back finds that. The oldest's
    # is deleted: a listing finds that. The middle one is whole.
    made = await snapshots_of(
        HdfsCheckpoint(tmp_path / "ck", partitions=2, delta_bytes=400), 3, blobs, namespace
    )
    own = [set(i.packs) - set().union(*(set(o.packs) for o in made if o is not i)) for i in made]
    assert all(own), "each snapshot has a pack no other uses"
    gone = pack_name(namespace, QUERY_ID, sorted(own[0])[0])
    await blobs.delete(gone)
    damaged = pack_name(namespace, QUERY_ID, sorted(own[2])[0])
    body, version = await blobs.read(damaged) or (b"", "")
    await blobs.replace(damaged, bytes([body[0] ^ 0xFF]) + body[1:], version)

    listed = await restore_module.check_snapshots(blobs, namespace, QUERY_ID)
    assert [(c.batch_id, c.problem is None) for c in listed] == [(2, True), (1, True), (0, False)]
    assert listed[2].problem is not None and gone in listed[2].problem
    read = await restore_module.check_snapshots(
        blobs, namespace, QUERY_ID, read_data=True, scratch=tmp_path
    )
    assert [(c.batch_id, c.problem is None) for c in read] == [(2, False), (1, True), (0, False)]
    assert read[0].problem is not None and damaged in read[0].problem
    assert leftovers(tmp_path) == []  # nothing left behind
