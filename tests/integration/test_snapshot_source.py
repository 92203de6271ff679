"""The reading side's I/O edge on a real directory (sidecar/snapshot/source.py): locations
under a root, listings, small reads, and streams that fail cleanly when Spark deletes or
rewrites a file mid-copy. Async tests run under blockbuster: a blocking call of the source
on the event loop fails them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import google_crc32c
import pytest

from sidecar.config import Config
from sidecar.snapshot import source as source_module
from sidecar.snapshot import worker as worker_module
from sidecar.snapshot.cut import CutError, ListedFile, Role
from sidecar.snapshot.packer import SmallFile
from sidecar.snapshot.source import (
    FileChanged,
    LocalSource,
    Location,
    SourceError,
    configured_source,
    read_hashed,
    read_small,
)
from tests.snapshots import copy_cut

QUERY_A = "11111111-1111-1111-1111-111111111111"
QUERY_B = "22222222-2222-2222-2222-222222222222"
COMMIT = b'v1\n{"nextBatchWatermarkMs":0}'


def write(path: Path, data: bytes | str = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def checkpoint(path: Path, query_id: str, batches: int = 3) -> None:
    """A small stateful checkpoint: logs, a file source's log, an HDFS store's deltas."""
    write(path / "metadata", json.dumps({"id": query_id}))
    write(path / ".metadata.crc")
    for b in range(batches):
        conf = {"spark.sql.streaming.stateStore.providerClass": "x.HDFSBackedStateStoreProvider"}
        offsets = f"v1\n{json.dumps({'conf': conf})}\n{json.dumps({'logOffset': b})}"
        write(path / "offsets" / str(b), offsets)
        write(path / "commits" / str(b), COMMIT)
        write(path / "sources" / "0" / str(b), "v1\n{}")
        write(path / "state" / "0" / "0" / f"{b + 1}.delta", b"d" * (b + 10))


def files_of(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def listing_of(top: Path) -> list[ListedFile]:
    """Every file under ``top`` with its size and stamp (names, then a stat each)."""
    return [source_module.stat_of(top, path) for path in source_module.names_of(top)]


def stamp_of(path: Path) -> str:
    st = path.stat()
    return f"{st.st_ino}:{st.st_mtime_ns}"


def same_bytes(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


def test_a_source_is_shown_as_its_root(tmp_path: Path) -> None:
    # What the daemon's log lines name ("checkpoint snapshots on: root <path>"), not an object.
    source = LocalSource(tmp_path)
    assert str(source) == str(tmp_path) and f"{source}" == str(tmp_path)
    assert repr(source) == f"LocalSource({str(tmp_path)!r})"


async def test_locations_are_found_by_their_metadata_within_the_depth(tmp_path: Path) -> None:
    checkpoint(tmp_path / "app1" / "orders", QUERY_A)
    checkpoint(tmp_path / "app2" / "team" / "payments", QUERY_B)
    checkpoint(tmp_path / "app1" / "orders" / "nested", "33333333-3333-3333-3333-333333333333")
    checkpoint(tmp_path / "app3" / "state" / "looks-like-one", QUERY_B)  # state/ is skipped
    checkpoint(tmp_path / ".trash" / "old", QUERY_B)  # hidden: skipped
    checkpoint(tmp_path / "a" / "b" / "c" / "d" / "too-deep", QUERY_B)  # depth 5
    write(tmp_path / "other" / "metadata", "not a Spark checkpoint")  # walked past
    checkpoint(tmp_path / "other" / "inside", QUERY_A)  # the same query copied: both found
    found = await LocalSource(tmp_path).locations()
    assert found == [
        Location("app1/orders", QUERY_A),
        Location("app2/team/payments", QUERY_B),
        Location("other/inside", QUERY_A),
    ]
    assert await LocalSource(tmp_path / "app1" / "orders").locations() == [Location("", QUERY_A)]
    with pytest.raises(SourceError) as caught:
        await LocalSource(tmp_path / "missing").locations()
    assert "SIDECAR_SNAPSHOT_ROOT" in str(caught.value)


def test_a_listing_has_every_file_and_a_directorys_files_before_its_subdirectories(
    tmp_path: Path,
) -> None:
    checkpoint(tmp_path, QUERY_A)
    write(tmp_path / "state" / "0" / "0" / "3.zip")
    write(tmp_path / "state" / "0" / "0" / "SSTs" / "000008-u.sst", b"s" * 7)
    paths = source_module.names_of(tmp_path)
    listing = [source_module.stat_of(tmp_path, path) for path in paths]
    assert sorted(paths) == files_of(tmp_path)
    assert paths.index("state/0/0/3.zip") < paths.index("state/0/0/SSTs/000008-u.sst")
    sst = next(f for f in listing if f.path.endswith(".sst"))
    assert (sst.size, sst.stamp) == (7, stamp_of(tmp_path / sst.path))
    with pytest.raises(SourceError) as caught:
        source_module.names_of(tmp_path / "no" / "such" / "location")
    assert caught.value.reason == "unreadable"


def test_a_listing_of_names_stats_nothing_and_keeps_regular_files_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a network volume every stat is a round trip: the names come with their type from
    # the directory itself; a cut stats only what it keeps (stat_of).
    checkpoint(tmp_path, QUERY_A)
    write(tmp_path / "state" / "0" / "0" / "1.delta", b"d" * 3)
    (tmp_path / "state" / "0" / "0" / "link.delta").symlink_to(tmp_path / "metadata")
    os.mkfifo(tmp_path / "state" / "0" / "pipe")

    real_stat, real_scandir, stated = os.stat, os.scandir, []

    def counted(path: object, *args: object, **kwargs: Any) -> os.stat_result:
        stated.append(str(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    class Entry:  # a directory entry whose own stat is counted too
        def __init__(self, entry: os.DirEntry[str]) -> None:
            self.name, self.path, self._entry = entry.name, entry.path, entry

        def is_file(self, *, follow_symlinks: bool = True) -> bool:
            return self._entry.is_file(follow_symlinks=follow_symlinks)

        def is_dir(self, *, follow_symlinks: bool = True) -> bool:
            return self._entry.is_dir(follow_symlinks=follow_symlinks)

        def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
            stated.append(self.path)
            return self._entry.stat(follow_symlinks=follow_symlinks)

    @contextlib.contextmanager
    def scandir(path: Path) -> Iterator[list[Entry]]:
        with real_scandir(path) as entries:
            yield [Entry(e) for e in entries]

    with monkeypatch.context() as m:
        m.setattr(os, "stat", counted)
        m.setattr(os, "lstat", counted)
        m.setattr(os, "scandir", scandir)
        names = source_module.names_of(tmp_path)
    assert stated == [str(tmp_path)]  # the location itself (is it a directory?), no file
    regular = [f for f in files_of(tmp_path) if not (tmp_path / f).is_symlink()]
    assert sorted(names) == regular  # neither the link nor the pipe
    assert "state/0/0/link.delta" not in names and "state/0/pipe" not in names
    delta = source_module.stat_of(tmp_path, "state/0/0/1.delta")
    assert (delta.size, delta.stamp) == (3, stamp_of(tmp_path / "state/0/0/1.delta"))
    for gone in ("state/0/0/9.delta", "state/0/0/link.delta", "state/0/pipe"):
        with pytest.raises(FileNotFoundError):
            source_module.stat_of(tmp_path, gone)


def test_small_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint(tmp_path / "q", QUERY_A)
    top = tmp_path / "q"
    assert read_small(top, "commits/1") == COMMIT
    with pytest.raises(FileNotFoundError):
        read_small(top, "commits/9")
    for bad in ("../q/metadata", "/etc/passwd", "commits//1"):
        with pytest.raises(ValueError):
            read_small(top, bad)
    monkeypatch.setattr(source_module, "SMALL_FILE_MAX_BYTES", 10)
    with pytest.raises(SourceError) as caught:
        read_small(top, "offsets/1")
    assert caught.value.reason == "too_large"


async def test_a_cut_taken_and_copied_through_the_source(tmp_path: Path) -> None:
    checkpoint(tmp_path / "ck", QUERY_A, batches=4)
    source = LocalSource(tmp_path / "ck", chunk_bytes=3)
    cut = await source.cut("", 2)
    assert [f.path for f in cut.files if f.role == Role.DELTA] == [
        "state/0/0/1.delta",
        "state/0/0/2.delta",
        "state/0/0/3.delta",
    ]
    await copy_cut(source, "", cut, tmp_path / "copy")
    assert files_of(tmp_path / "copy") == [f.path for f in cut.files]
    for f in cut.files:
        assert same_bytes(tmp_path / "copy" / f.path, tmp_path / "ck" / f.path)


def cut_workers() -> set[int]:
    """The live worker processes (anyio's, the cut's) this test process started."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        state, ppid = fields[0], int(fields[1])
        if ppid == os.getpid() and state != "Z" and b"anyio.to_process" in cmdline:
            found.add(int(entry.name))
    return found


async def test_a_cut_runs_in_a_worker_process_at_a_lower_priority_and_its_errors_arrive_whole(
    tmp_path: Path,
) -> None:
    checkpoint(tmp_path, QUERY_A, batches=3)
    source = LocalSource(tmp_path)
    before = await anyio.to_thread.run_sync(cut_workers)
    cut = await source.cut("", 2)
    assert cut.query_id == QUERY_A and "commits/2" in [f.path for f in cut.files]
    (worker,) = await anyio.to_thread.run_sync(cut_workers) - before
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, worker) == min(19, own + worker_module.NICE)
    assert os.sched_getscheduler(worker) == os.SCHED_IDLE  # preempted by any task that wakes

    with pytest.raises(CutError) as caught:  # raised in the worker, arrives with its reason
        await source.cut("", 7)
    assert caught.value.reason == "not_committed" and "7" in str(caught.value)
    with pytest.raises(SourceError) as unreadable:
        await LocalSource(tmp_path / "gone").cut("", 2)
    assert unreadable.value.reason == "unreadable"
    assert await anyio.to_thread.run_sync(cut_workers) - before == {worker}  # reused
    assert os.getpriority(os.PRIO_PROCESS, 0) == own  # the daemon's own is untouched


async def test_a_cut_whose_worker_dies_fails_cleanly_and_the_next_cut_starts_a_new_one(
    tmp_path: Path,
) -> None:
    checkpoint(tmp_path, QUERY_A, batches=3)
    source = LocalSource(tmp_path)
    before = await anyio.to_thread.run_sync(cut_workers)

    def kill_the_new_worker() -> int:
        while not (new := cut_workers() - before):
            time.sleep(0.001)
        (pid,) = new
        os.kill(pid, signal.SIGKILL)  # the OOM killer, say: before it answered
        return pid

    async with anyio.create_task_group() as tg:
        killed: list[int] = []

        async def killer() -> None:
            killed.append(await anyio.to_thread.run_sync(kill_the_new_worker))

        tg.start_soon(killer)
        with pytest.raises(SourceError) as caught:
            await source.cut("", 2)
    assert caught.value.reason == "worker" and "next one starts a new worker" in str(caught.value)
    cut = await source.cut("", 2)
    assert cut.query_id == QUERY_A
    assert killed[0] not in await anyio.to_thread.run_sync(cut_workers)


async def read_all(source: LocalSource, file: ListedFile, after_first: object = None) -> bytes:
    """Stream ``file``; ``after_first`` (a callable) runs once the first chunk arrived."""
    out = b""
    async with source.open("", file) as stream:
        async for chunk in stream:
            if not out and callable(after_first):
                await anyio.to_thread.run_sync(after_first)
            out += chunk
    return out


async def listed(source: LocalSource, path: str) -> ListedFile:
    listing = await anyio.to_thread.run_sync(listing_of, source.root)
    return next(f for f in listing if f.path == path)


async def test_a_stream_gives_the_listed_bytes_in_bounded_chunks(tmp_path: Path) -> None:
    write(tmp_path / "state" / "5.delta", bytes(range(256)) * 4)
    source = LocalSource(tmp_path, chunk_bytes=100)
    file = await listed(source, "state/5.delta")
    chunks = []
    async with source.open("", file) as stream:
        async for chunk in stream:
            chunks.append(chunk)
    assert b"".join(chunks) == bytes(range(256)) * 4
    assert max(len(c) for c in chunks) == 100 and len(chunks) == 11
    write(tmp_path / "empty")
    (tmp_path / "empty").write_bytes(b"")
    assert await read_all(source, await listed(source, "empty")) == b""


async def test_a_file_changed_or_gone_before_it_is_opened_fails_the_copy(tmp_path: Path) -> None:
    write(tmp_path / "7.zip", b"old zip")
    source = LocalSource(tmp_path)
    file = await listed(source, "7.zip")
    # Spark's createAtomic: a new file renamed over the old one (same size, new inode)
    write(tmp_path / ".7.zip.tmp", b"new zip")
    os.replace(tmp_path / ".7.zip.tmp", tmp_path / "7.zip")
    with pytest.raises(FileChanged) as caught:
        await read_all(source, file)
    assert caught.value.reason == "changed" and caught.value.retriable
    os.remove(tmp_path / "7.zip")
    with pytest.raises(FileChanged) as caught:
        await read_all(source, file)
    assert caught.value.reason == "gone"


async def test_small_files_are_read_whole_and_hashed_in_the_worker_process_checked_against_their_listing(  # noqa: E501
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint(tmp_path / "q", QUERY_A)
    write(tmp_path / "q" / "state" / "0" / "0" / "2.delta", b"D" * 50)
    source = LocalSource(tmp_path)
    files = {f.path: f for f in await anyio.to_thread.run_sync(listing_of, tmp_path / "q")}
    delta, commit = files["state/0/0/2.delta"], files["commits/1"]
    before = await anyio.to_thread.run_sync(cut_workers)
    await source.cut("q", 2)
    (worker,) = await anyio.to_thread.run_sync(cut_workers) - before
    got = await source.read_checked("q", [delta, commit])
    assert got == [
        SmallFile(hashlib.sha256(b"D" * 50).digest(), google_crc32c.value(b"D" * 50), b"D" * 50),
        SmallFile(hashlib.sha256(COMMIT).digest(), google_crc32c.value(COMMIT), COMMIT),
    ]
    assert await anyio.to_thread.run_sync(cut_workers) - before == {worker}  # the cut's

    target = tmp_path / "q" / delta.path
    real_pread = os.pread

    def replace_after_read(fd: int, n: int, at: int) -> bytes:  # Spark rewrites it meanwhile
        data = real_pread(fd, n, at)
        write(target.with_name(".2.delta.tmp"), b"E" * 50)
        os.replace(target.with_name(".2.delta.tmp"), target)
        return data

    monkeypatch.setattr(os, "pread", replace_after_read)  # in this process: the worker's job
    with pytest.raises(FileChanged) as caught:
        await anyio.to_thread.run_sync(read_hashed, tmp_path / "q", delta)
    assert caught.value.reason == "changed" and "after it was read" in str(caught.value)
    monkeypatch.undo()
    with pytest.raises(FileChanged) as caught:  # listed before the rewrite: refused at open
        await source.read_checked("q", [commit, delta])
    assert caught.value.reason == "changed" and "when opened" in str(caught.value)
    os.remove(target)
    with pytest.raises(FileChanged) as caught:
        await source.read_checked("q", [delta])
    assert caught.value.reason == "gone" and delta.path in str(caught.value)


@pytest.mark.parametrize("how", ["deleted", "replaced", "appended"])
async def test_a_file_changed_mid_copy_fails_it_and_the_next_copy_succeeds(
    tmp_path: Path, how: str
) -> None:
    ck = tmp_path / "ck"
    checkpoint(ck, QUERY_A, batches=4)
    target = ck / "state" / "0" / "0" / "2.delta"
    write(target, b"D" * 50)
    source = LocalSource(ck, chunk_bytes=8)
    cut = await source.cut("", 2)

    def meddle() -> None:  # what Spark's maintenance or a re-run does under the copy
        if how == "deleted":
            os.remove(target)
        elif how == "replaced":
            write(target.with_name(".2.delta.tmp"), b"E" * 50)
            os.replace(target.with_name(".2.delta.tmp"), target)
        else:
            with open(target, "ab") as f:
                f.write(b"more")

    file = next(f for f in cut.files if f.path == "state/0/0/2.delta")
    with pytest.raises(FileChanged) as caught:
        await read_all(source, file.listed, after_first=meddle)
    assert caught.value.reason == ("gone" if how == "deleted" else "changed")
    if how == "deleted":  # the next cut sees the file is missing: refused, nothing copied
        write(target, b"D" * 50)  # (Spark would have moved on to a newer batch)
    cut = await source.cut("", 2)
    await copy_cut(source, "", cut, tmp_path / "copy")
    assert same_bytes(tmp_path / "copy" / "state/0/0/2.delta", target)


async def test_the_copy_of_a_cut_fails_when_a_file_is_deleted_under_it(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    checkpoint(ck, QUERY_A, batches=4)
    source = LocalSource(ck)
    cut = await source.cut("", 3)
    os.remove(ck / "state" / "0" / "0" / "4.delta")
    with pytest.raises(FileChanged):
        await copy_cut(source, "", cut, tmp_path / "copy")


def test_the_source_is_configured_by_the_snapshot_root(tmp_path: Path) -> None:
    assert configured_source(Config.from_env({})) is None
    made = configured_source(Config.from_env({"SIDECAR_SNAPSHOT_ROOT": str(tmp_path)}))
    assert isinstance(made, LocalSource) and made.root == tmp_path
    assert made.server_copy("", ListedFile("metadata", 1, "")) is None
