"""The daemon's snapshots (``SIDECAR_SNAPSHOT_ROOT``: ``sidecar.daemon.snapshots``) and the
``snapshots`` / ``restore`` commands, with real daemon processes, redis-server and Azurite,
on Spark-shaped checkpoint directories written batch by batch (``tests.snapshotdirs``; the
same with a real PySpark query: test_snapshot_e2e.py):

- each progress of a committed batch brings a snapshot of it (the newest, coalesced), listed
  by ``snapshots``, named by the query's next checkpoint document, counted in the metrics;
- a daemon that does not own the query writes no snapshot;
- ``restore QUERY DIR`` writes the checkpoint back byte for byte and moves the sidecar's
  checkpoint to its batch (a reset: through the daemon);
- ``restore --all ROOT``, an init container's form: an empty volume is filled at each query's
  location; a volume holding a checkpoint at least as new is left as it is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from azure.storage.blob.aio import BlobLeaseClient, BlobServiceClient

from sidecar.config import Config
from sidecar.snapshot.index import decode_index, pack_name, prefix
from tests.faults.load import scrape_process
from tests.helpers import cli, metric_value, post_progress, read_blob, wait_blob, wait_for
from tests.services import REPO_ROOT, DaemonProcess
from tests.snapshotdirs import QUERY_ID, HdfsCheckpoint, tree
from tests.sparkshapes import rate_progress

NAME = "counts"


def snapshots(env: dict[str, str]) -> list[dict[str, Any]]:
    listed = cli(env, "snapshots", QUERY_ID, "--json")
    assert listed.returncode == 0, listed.stderr
    found: list[dict[str, Any]] = json.loads(listed.stdout)["snapshots"]
    return found


def commit(proc: DaemonProcess, ck: HdfsCheckpoint) -> int:
    """Spark commits a batch, and its listener reports it."""
    batch = ck.batch()
    progress = rate_progress(QUERY_ID, batch, name=NAME)
    progress["stateOperators"] = [{"operatorName": "stateStoreSave", "numRowsTotal": 3}]
    assert post_progress(proc.socket_path, progress).ok
    return batch


def commit_snapshotted(
    daemon: DaemonProcess, env: dict[str, str], ck: HdfsCheckpoint, batches: int
) -> list[dict[str, bytes]]:
    """Commit ``batches`` batches, each reported and snapshotted before the next; the
    checkpoint's files after each."""
    trees = []
    for _ in range(batches):
        batch = commit(daemon, ck)
        wait_for(
            lambda b=batch: [r["batch_id"] for r in snapshots(env)][:1] == [b],  # type: ignore[misc]
            30,
            f"batch {batch}'s snapshot",
        )
        trees.append(tree(ck.root))
    return trees


def restore_all_into(env: dict[str, str], volume: Path) -> list[dict[str, Any]]:
    """``restore --all`` into a new, empty ``volume`` (exit 0 asserted): its rows."""
    volume.mkdir()
    done = cli(env | {"SIDECAR_SNAPSHOT_ROOT": str(volume)}, "restore", "--all", str(volume),
               "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def snapshot_run(
    daemon_env: dict[str, str],
    procs: list[DaemonProcess],
    tmp_path: Path,
    batches: int,
    *,
    partitions: int = 2,
    delta_bytes: int = 500,
) -> tuple[HdfsCheckpoint, dict[str, str], list[dict[str, bytes]]]:
    """A daemon snapshots ``batches`` batches of a checkpoint under ``tmp_path/root`` (each
    before the next), flushes the last and stops (a pod gone): the checkpoint, the daemon's
    settings and the checkpoint's files after each batch."""
    root = tmp_path / "root"
    ck = HdfsCheckpoint(root / "app" / NAME, partitions=partitions, delta_bytes=delta_bytes)
    env = daemon_env | {"SIDECAR_SNAPSHOT_ROOT": str(root), "SIDECAR_COUNT_THRESHOLD": "1"}
    daemon = started(env, tmp_path / "daemon.log", procs)
    trees = commit_snapshotted(daemon, env, ck, batches)
    wait_blob(env, QUERY_ID, batches - 1)
    assert daemon.stop() == 0
    return ck, env, trees


def started(env: dict[str, str], log: Path, procs: list[DaemonProcess]) -> DaemonProcess:
    proc = DaemonProcess(env, log)
    procs.append(proc)
    proc.start()
    return proc


def test_each_committed_batch_is_snapshotted_restored_and_the_checkpoint_moves_with_it(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    ck = HdfsCheckpoint(root / "app" / NAME, partitions=4, delta_bytes=2000, snapshot_every=3)
    env = daemon_env | {
        "SIDECAR_SNAPSHOT_ROOT": str(root),
        "SIDECAR_COUNT_THRESHOLD": "1",
        "SIDECAR_ADMIN_OPS": "true",
        "SIDECAR_ADMIN_QUIET_S": "0",
    }
    daemon = started(env, tmp_path / "daemon.log", procs)
    wait_for(lambda: "checkpoint snapshots on" in daemon.log(), 30, "the snapshot loop's start")
    assert f"checkpoint snapshots on: root {root}, keeping 10 per query" in daemon.log()
    for _ in range(4):
        commit(daemon, ck)
        last = ck.next_batch - 1
        wait_for(lambda n=last: snapshots(env) and snapshots(env)[0]["batch_id"] == n, 30,  # type: ignore[misc]
                 f"the snapshot of batch {last}")  # fmt: skip
    listed = snapshots(env)
    assert [s["batch_id"] for s in listed] == [3, 2, 1, 0]  # newest first, one each
    assert listed[0]["location"] == f"app/{NAME}"
    assert listed[0]["new_bytes"] < listed[0]["bytes"]  # incremental
    page = scrape_process(daemon)[1]
    assert metric_value(page, "checkpoint_sidecar_snapshots_total", result="ok") == 4
    assert metric_value(page, "checkpoint_sidecar_snapshot_batch_id", query=NAME) == 3
    assert metric_value(page, "checkpoint_sidecar_snapshot_lag_batches", query=NAME) == 0

    # The next checkpoint document names the newest snapshot.
    commit(daemon, ck)
    wait_for(lambda: snapshots(env)[0]["batch_id"] == 4, 30, "the snapshot of batch 4")
    commit(daemon, ck)
    doc = wait_blob(env, QUERY_ID, 5)
    assert doc.snapshot is not None and doc.snapshot.batch_id >= 4

    # The volume is lost; batch 2 is restored byte for byte, and the checkpoint moves to it.
    wait_for(lambda: snapshots(env)[0]["batch_id"] == 5, 30, "the snapshot of batch 5")
    reference = tmp_path / "reference"
    ck.copy_to(reference)
    restored = tmp_path / "restored"
    done = cli(env, "restore", NAME, str(restored), "--batch", "5", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["batch_id"] == 5
    assert tree(restored).keys() <= tree(reference).keys()
    assert all(tree(restored)[p] == tree(reference)[p] for p in tree(restored))
    older = tmp_path / "older"
    done = cli(env, "restore", NAME, str(older), "--batch", "2")
    assert done.returncode == 0, done.stderr
    assert "restored batch 2 of query counts" in done.stdout
    moved = read_blob(env, QUERY_ID)
    assert moved is not None and moved.batch_id == 2 and moved.reset_reason is not None
    assert "restored snapshot" in moved.reset_reason
    commits = sorted(int(p.name) for p in (older / "commits").iterdir() if p.name.isdigit())
    assert commits[-1] == 2  # nothing of a later batch
    # A non-empty directory is refused without --force.
    again = cli(env, "restore", NAME, str(older), "--batch", "3")
    assert again.returncode == 1 and "not empty" in again.stderr.lower()
    # Said in one line, with progress shown (stderr is no terminal here: log lines).
    assert "Traceback" not in again.stderr and "TaskGroup" not in again.stderr, again.stderr
    assert again.stderr.strip().splitlines()[-1].startswith("checkpoint-sidecar: ")


def test_a_daemon_that_does_not_own_the_query_writes_no_snapshot(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path, short_tmp: Path
) -> None:
    root = tmp_path / "root"
    ck = HdfsCheckpoint(root / NAME, partitions=2, delta_bytes=500)
    owner_env = daemon_env | {"SIDECAR_SNAPSHOT_ROOT": str(root), "SIDECAR_COUNT_THRESHOLD": "1"}
    (short_tmp / "b").mkdir()
    other_env = owner_env | {"SIDECAR_SOCKET_PATH": str(short_tmp / "b" / "s.sock")}
    owner = started(owner_env, tmp_path / "owner.log", procs)
    commit(owner, ck)
    wait_for(lambda: snapshots(owner_env), 30, "the owner's snapshot")
    other = started(other_env, tmp_path / "other.log", procs)
    progress = rate_progress(QUERY_ID, ck.batch(), name=NAME)
    assert post_progress(other.socket_path, progress).ok  # buffered; the lease is the owner's
    wait_for(
        lambda: (
            metric_value(
                scrape_process(other)[1], "checkpoint_sidecar_snapshots_total", result="not_owner"
            )
            >= 1
        ),
        30,
        "the other daemon to skip the snapshot",
    )
    page = scrape_process(other)[1]
    assert metric_value(page, "checkpoint_sidecar_snapshots_total", result="ok") == 0
    assert [s["batch_id"] for s in snapshots(owner_env)] == [0]


def test_restore_all_fills_an_empty_volume_and_keeps_a_newer_checkpoint(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    _, env, _ = snapshot_run(daemon_env, procs, tmp_path, 3, partitions=3, delta_bytes=1000)
    # the pod is gone; an init container restores before the next

    # A new volume: every query is put back where it was taken from.
    volume = tmp_path / "new-volume"
    (row,) = restore_all_into(env, volume)
    init = env | {"SIDECAR_SNAPSHOT_ROOT": str(volume)}
    assert (row["outcome"], row["batch_id"], row["directory"]) == (
        "restored",
        2,
        str(volume / "app" / NAME),
    )
    restored = tree(volume / "app" / NAME)
    assert restored == {p: b for p, b in tree(root / "app" / NAME).items() if p in restored}
    assert "commits/2" in restored

    # A volume that kept a checkpoint at least as new: left as it is.
    commit_more = HdfsCheckpoint(tmp_path / "scratch", partitions=1)
    del commit_more
    (volume / "app" / NAME / "commits" / "7").write_bytes(b'v1\n{"nextBatchWatermarkMs":0}')
    before = tree(volume / "app" / NAME)
    kept = cli(init, "restore", "--all", str(volume))
    assert kept.returncode == 0, kept.stderr
    assert "kept" in kept.stdout and tree(volume / "app" / NAME) == before


def test_restore_all_shows_progress_in_a_log_and_ends_with_what_it_did(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    # An init container's standard error is no terminal (a pod's log): progress comes as log
    # lines (every --progress-every seconds; here every few milliseconds), then one as the
    # restore ends and a summary line, each with the snapshot's own file and byte counts.
    _, env, _ = snapshot_run(daemon_env, procs, tmp_path, 3, partitions=3, delta_bytes=20_000)
    (head,) = [s for s in snapshots(env) if s["batch_id"] == 2]
    files, size = head["files"], head["bytes"]
    volume = tmp_path / "volume"
    volume.mkdir()
    init = env | {"SIDECAR_SNAPSHOT_ROOT": str(volume)}
    done = cli(init, "restore", "--all", str(volume), "--progress-every", "0.001")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "restore progress: " in line]
    assert lines, done.stderr
    seen = []
    for line in lines:
        assert f"query={NAME} batch=2 " in line and " rate=" in line and " left=" in line
        got = re.search(r"files=(\d+)/(\d+) bytes=(\d+)/(\d+)", line)
        assert got is not None, line
        assert (int(got[2]), int(got[4])) == (files, size)
        seen.append((int(got[1]), int(got[3])))
    assert seen == sorted(seen) and seen[-1][1] <= size  # it only moves on
    finished = f"restore finished: query={NAME} batch=2 files={files}/{files} bytes={size}/{size}"
    assert finished in done.stderr
    assert f"restored batch 2 of query {NAME} (snapshot {head['id']}, timeline " in done.stdout
    assert done.stdout.splitlines()[-1].startswith(
        f"restore --all: 1 query: 1 restored; {files} files, {size} bytes ("
    )
    # Without progress: no such line; the result lines stay.
    again = cli(init, "restore", "--all", str(volume), "--no-progress")
    assert again.returncode == 0, again.stderr
    assert "restore progress" not in again.stderr and "restore finished" not in again.stderr
    assert again.stdout.splitlines()[-1].startswith("restore --all: 1 query: 1 kept; 0 files")


def test_the_daemon_exports_the_restore_that_moved_its_checkpoint(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    # restore --all runs in an init container, before the daemon, and nothing scrapes it: its
    # reset keeps its figures in Redis, and the daemon that starts next exports them. A later
    # restore through that daemon's socket replaces them at once.
    _, env, _ = snapshot_run(daemon_env, procs, tmp_path, 3, partitions=3, delta_bytes=5000)
    before = time.time()
    (row,) = restore_all_into(env, tmp_path / "volume")
    assert row["outcome"] == "restored" and row["files"] > 0
    env = env | {
        "SIDECAR_SNAPSHOT_ROOT": str(tmp_path / "volume"),
        "SIDECAR_ADMIN_OPS": "true",
        "SIDECAR_ADMIN_QUIET_S": "0",
    }
    daemon = started(env, tmp_path / "after.log", procs)
    page = scrape_process(daemon)[1]
    assert metric_value(page, "checkpoint_sidecar_restore_bytes", query=NAME) == row["bytes"]
    assert metric_value(page, "checkpoint_sidecar_restore_files", query=NAME) == row["files"]
    seconds = metric_value(page, "checkpoint_sidecar_restore_duration_seconds", query=NAME)
    assert seconds == row["seconds"] > 0
    at = metric_value(page, "checkpoint_sidecar_restore_timestamp_seconds", query=NAME)
    assert before <= at <= time.time()

    # Through the running daemon (its reset): exported at once.
    (older,) = [s for s in snapshots(env) if s["batch_id"] == 0]
    assert older["bytes"] != row["bytes"]
    done = cli(env, "restore", NAME, str(tmp_path / "elsewhere"), "--batch", "0", "--json")
    assert done.returncode == 0, done.stderr
    again = json.loads(done.stdout)
    assert "by the daemon" in again["checkpoint"]
    page = scrape_process(daemon)[1]
    assert metric_value(page, "checkpoint_sidecar_restore_bytes", query=NAME) == older["bytes"]
    assert metric_value(page, "checkpoint_sidecar_restore_files", query=NAME) == older["files"]
    assert (
        metric_value(page, "checkpoint_sidecar_restore_duration_seconds", query=NAME)
        == again["seconds"]
    )


def test_restore_all_leaves_a_reused_location_to_its_new_query_and_restores_the_others(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    # Two queries snapshotted; the pod's volume is then reused: one location now holds a new
    # query's checkpoint (far behind the old one's snapshot), the other was cut short by a
    # killed restore (files, no metadata). restore --all writes nothing over the new query,
    # says so on its line, still restores the other, and exits 0 (the pod starts: the old
    # query is gone from there). Its snapshots are listed as gone, and a daemon reclaims
    # them once the stated time is over (0 here); the other query's stay.
    root = tmp_path / "root"
    other_id = "7a7a7a7a-0000-4000-8000-0000000000b2"
    cks = {
        QUERY_ID: HdfsCheckpoint(root / "app" / NAME, partitions=2, delta_bytes=500),
        other_id: HdfsCheckpoint(
            root / "app" / "other", partitions=2, delta_bytes=500, query_id=other_id
        ),
    }
    env = daemon_env | {"SIDECAR_SNAPSHOT_ROOT": str(root), "SIDECAR_COUNT_THRESHOLD": "1"}
    daemon = started(env, tmp_path / "daemon.log", procs)
    for query_id, ck in cks.items():
        for _ in range(3):
            batch = ck.batch()
            progress = rate_progress(query_id, batch, name=f"n-{query_id[:4]}")
            progress["stateOperators"] = [{"operatorName": "stateStoreSave", "numRowsTotal": 3}]
            assert post_progress(daemon.socket_path, progress).ok

    def newest(query_id: str) -> int | None:
        listed = cli(env, "snapshots", query_id, "--json")
        rows = json.loads(listed.stdout)["snapshots"] if listed.returncode == 0 else []
        return rows[0]["batch_id"] if rows else None

    wait_for(lambda: newest(QUERY_ID) == 2 and newest(other_id) == 2, 30, "both snapshots")
    assert daemon.stop() == 0

    volume = tmp_path / "volume"
    reused = HdfsCheckpoint(volume / "app" / NAME, partitions=1, query_id="new-query-id")
    reused.batch()
    cut = volume / "app" / "other"
    (cut / "offsets").mkdir(parents=True)
    (cut / "offsets" / "0").write_bytes(b"v1\n")
    before = tree(volume / "app" / NAME)
    init = env | {"SIDECAR_SNAPSHOT_ROOT": str(volume)}
    done = cli(init, "restore", "--all", str(volume), "--json")
    assert done.returncode == 0, done.stderr
    rows = {r["query_id"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert rows[QUERY_ID]["outcome"] == "elsewhere"
    assert "another query (new-query-id)" in rows[QUERY_ID]["error"]
    assert tree(volume / "app" / NAME) == before  # not a byte written
    assert rows[other_id]["outcome"] == "restored" and rows[other_id]["batch_id"] == 2
    assert "commits/2" in tree(cut)
    plain = cli(init, "restore", "--all", str(volume))
    assert plain.returncode == 0, plain.stderr
    assert f"not restored query n-{QUERY_ID[:4]}" in plain.stdout
    assert "kept" in plain.stdout  # the other query's, restored just now
    listed = json.loads(cli(env, "snapshots", QUERY_ID, "--json").stdout)
    assert listed["gone"]["found_query"] == "new-query-id"
    assert listed["gone"]["location"] == f"app/{NAME}"
    assert "gone from its location" in cli(env, "snapshots", QUERY_ID).stdout

    # A daemon reclaims them (kept 0 s here; 7 days by default), and only them.
    reclaiming = started(
        env | {"SIDECAR_SNAPSHOT_ABANDONED_KEEP_S": "0"}, tmp_path / "reclaim.log", procs
    )
    wait_for(lambda: newest(QUERY_ID) is None, 30, "the gone query's snapshots reclaimed")
    assert newest(other_id) == 2
    assert "snapshots of query " + QUERY_ID + " reclaimed" in reclaiming.log()
    assert json.loads(cli(env, "snapshots", QUERY_ID, "--json").stdout)["gone"] is None


def test_a_snapshot_after_another_owner_pruned_names_no_pack_that_is_gone(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    # The daemon snapshots batch 1 and keeps what it stored where. Its lease is then broken,
    # another owner takes the query, prunes every pack (as a repack would) and lets go; the
    # daemon takes the lease back under a new term and snapshots batch 2, whose files are
    # mostly batch 1's. What it knew of the stored contents is from the old term: loaded
    # again, the packs are written anew, and snapshot 2 restores. (Kept from before, the
    # index named the deleted packs: counted good, failing only on restore, missing_blob.)
    root = tmp_path / "root"
    ck = HdfsCheckpoint(root / "app" / NAME, partitions=2, delta_bytes=500)
    env = daemon_env | {
        "SIDECAR_SNAPSHOT_ROOT": str(root),
        "SIDECAR_COUNT_THRESHOLD": "1",
        "SIDECAR_ADMIN_OPS": "true",
        "SIDECAR_ADMIN_QUIET_S": "0",
    }
    daemon = started(env, tmp_path / "daemon.log", procs)
    commit(daemon, ck)
    commit(daemon, ck)
    wait_for(lambda: snapshots(env) and snapshots(env)[0]["batch_id"] == 1, 30, "batch 1's")

    async def another_owner_prunes() -> int:
        config = Config.from_env(env)
        service = BlobServiceClient.from_connection_string(env["AZURE_STORAGE_CONNECTION_STRING"])
        async with service:
            container = service.get_container_client(config.container)
            blob = container.get_blob_client(f"{config.namespace}/{QUERY_ID}.json")
            await BlobLeaseClient(blob).break_lease(lease_break_period=0)
            lease = BlobLeaseClient(blob)
            await lease.acquire(lease_duration=15)
            packs = [
                b.name
                async for b in container.list_blobs(
                    name_starts_with=prefix(config.namespace, QUERY_ID)
                )
                if "/index/" not in b.name
            ]
            for name in packs:
                await container.delete_blob(name)
            await lease.release()
            return len(packs)

    assert anyio.run(another_owner_prunes) > 0

    def retaken() -> bool:  # the loss noticed (its renewal refused), then held again
        log = daemon.log()
        return "renewal refused" in log and "-> HELD" in log.split("renewal refused")[-1]

    wait_for(retaken, 30, "a new term")
    commit(daemon, ck)
    wait_for(lambda: snapshots(env)[0]["batch_id"] == 2, 30, "batch 2's")
    assert daemon.stop() == 0
    done = cli(env, "restore", QUERY_ID, str(tmp_path / "back"), "--batch", "2", "--json")
    assert done.returncode == 0, done.stderr
    assert "commits/2" in tree(tmp_path / "back")
    # snapshots --check: batch 2's whole, batch 1 names the packs pruned (exit 1); batch 0
    # has a snapshot of its own too, or not (snapshots coalesce to the newest batch).
    checked = cli(env, "snapshots", QUERY_ID, "--check", "--read-data")
    assert checked.returncode == 1, checked.stderr
    lines = {
        line.split()[1]: line for line in checked.stdout.splitlines() if line[:8] == "  batch "
    }
    assert lines["2"].endswith(" ok") and "is not stored" in lines["1"], checked.stdout
    assert "checked (every file read back and verified)" in checked.stdout


async def lose_the_pack_only(env: dict[str, str], batch: int) -> None:
    """Delete the pack only ``batch``'s snapshot uses (its new contents), as a store's fault
    or a hand would."""
    config = Config.from_env(env)
    service = BlobServiceClient.from_connection_string(env["AZURE_STORAGE_CONNECTION_STRING"])
    async with service:
        container = service.get_container_client(config.container)
        used: dict[int, set[str]] = {}  # batch -> the packs its snapshot uses
        async for b in container.list_blobs(
            name_starts_with=prefix(config.namespace, QUERY_ID) + "index/"
        ):
            body = await (await container.download_blob(b.name)).readall()
            index = decode_index(body, b.name)
            used[index.batch] = set(index.packs)
        others = set().union(*(packs for b, packs in used.items() if b != batch))
        (only,) = used[batch] - others
        await container.delete_blob(pack_name(config.namespace, QUERY_ID, only))


def test_a_prune_pass_reports_the_snapshots_it_finds_broken(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    # Snapshot 1's own pack is lost while no daemon runs; the next daemon's first snapshot
    # (of batch 2) is followed by a prune pass, which finds snapshot 1 broken: the gauge and
    # the log say so (the alert CheckpointSidecarSnapshotsBroken fires on it).
    ck, env, _ = snapshot_run(daemon_env, procs, tmp_path, 2)
    anyio.run(lose_the_pack_only, env, 1)
    again = started(env, tmp_path / "again.log", procs)
    commit(again, ck)

    def broken() -> float | None:
        page = scrape_process(again)[1]
        try:
            return metric_value(page, "checkpoint_sidecar_snapshots_broken", query=NAME)
        except AssertionError:
            return None

    wait_for(lambda: broken() is not None, 30, "a prune pass")
    assert broken() == 1
    page = scrape_process(again)[1]
    assert (
        metric_value(page, "checkpoint_sidecar_snapshots_checked_timestamp_seconds", query=NAME) > 0
    )
    assert "1 snapshot(s) could not be restored" in again.log()


def test_restore_all_skips_a_broken_snapshot_for_the_one_before_it_on_its_timeline(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    # Batches 0..2 snapshotted one by one; the pack only batch 2's snapshot uses is then lost
    # (deleted by hand, a store's fault). A lost volume's restore --all says so loudly and
    # restores batch 1's snapshot, the newest intact one of the timeline, and moves the
    # checkpoint there; the restored directory is batch 1's checkpoint, byte for byte.
    _, env, trees = snapshot_run(daemon_env, procs, tmp_path, 3)
    at_1 = trees[1]

    anyio.run(lose_the_pack_only, env, 2)
    volume = tmp_path / "volume"
    volume.mkdir()
    init = env | {"SIDECAR_SNAPSHOT_ROOT": str(volume)}
    done = cli(init, "restore", "--all", str(volume), "--json")
    assert done.returncode == 0, done.stderr
    (row,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert (row["outcome"], row["batch_id"]) == ("restored", 1)
    assert len(row["broken"]) == 1 and "is not stored" in row["broken"][0]
    assert "broken (" in done.stderr and "--check" in done.stderr
    restored = tree(volume / "app" / NAME)
    assert restored == {p: b for p, b in at_1.items() if p in restored}
    assert "commits/1" in restored and "commits/2" not in restored
    assert wait_blob(env, QUERY_ID, 1).batch_id == 1  # the checkpoint moved with it


FS_GROUP = 10001  # the shipped templates' fsGroup
DRIVER_UID = 185  # Spark's images


def as_user(uid: int, groups: list[int]) -> Callable[[], None]:
    def switch() -> None:
        os.umask(0o022)  # the usual one: what restore must not depend on
        if uid:
            os.setgroups(groups)
            os.setgid(uid)
            os.setuid(uid)

    return switch


@pytest.mark.skipif(os.geteuid() != 0, reason="switches users: needs root")
def test_the_driver_writes_its_next_batches_in_a_directory_the_sidecar_restored(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    # As in the shipped template: the volume's root group-owned by the pod's fsGroup with
    # set-group-ID; restore --all runs as another user than the driver (here root, with the
    # usual umask 022), the driver as uid 185 in the fsGroup. The driver must write the next
    # batch's offsets/, commits/ and state files (and delete old ones) in what the restore
    # created.
    _, env, _ = snapshot_run(daemon_env, procs, tmp_path, 2)
    volume = tmp_path / "volume"
    volume.mkdir()
    os.chown(volume, 0, FS_GROUP)
    os.chmod(volume, 0o2775)
    for up in (tmp_path, *tmp_path.parents):  # the driver reaches the volume
        if not up.stat().st_mode & 0o001:
            up.chmod(up.stat().st_mode | 0o005)
    init = env | {"SIDECAR_SNAPSHOT_ROOT": str(volume)}
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "restore", "--all", str(volume)],
        env={"PATH": "/usr/bin:/bin", **init, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=as_user(0, []),
    )
    assert done.returncode == 0, done.stderr
    top = volume / "app" / NAME
    assert (top / "offsets").stat().st_gid == FS_GROUP
    driver = (
        f"cd {top} && echo v1 > offsets/.2.tmp && mv offsets/.2.tmp offsets/2 && "
        "echo v1 > commits/2 && : > state/0/0/3.delta && rm offsets/0 && "
        "mkdir state/0/0/_x && stat -c %u commits/2"
    )
    wrote = subprocess.run(
        ["/bin/sh", "-c", driver],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=as_user(DRIVER_UID, [FS_GROUP]),
    )
    assert wrote.returncode == 0, wrote.stderr
    assert wrote.stdout.strip() == str(DRIVER_UID)


def test_restore_all_gives_a_reused_location_to_its_newest_query_on_an_empty_volume(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    # Query A was snapshotted at app/counts; its checkpoint was cleared and query B started
    # on the same path and was snapshotted too. The volume is lost. restore --all restores B
    # there (the query of the newest snapshots, which has a checkpoint), never A over it nor
    # A then B, and marks A gone from that location.
    root = tmp_path / "root"
    b_id = "7a7a7a7a-0000-4000-8000-0000000000b3"
    env = daemon_env | {"SIDECAR_SNAPSHOT_ROOT": str(root), "SIDECAR_COUNT_THRESHOLD": "1"}
    daemon = started(env, tmp_path / "daemon.log", procs)

    def run(query_id: str, name: str) -> None:
        ck = HdfsCheckpoint(root / "app" / NAME, partitions=2, delta_bytes=500, query_id=query_id)
        for _ in range(2):
            batch = ck.batch()
            progress = rate_progress(query_id, batch, name=name)
            progress["stateOperators"] = [{"operatorName": "stateStoreSave", "numRowsTotal": 3}]
            assert post_progress(daemon.socket_path, progress).ok

        def newest() -> int | None:
            listed = cli(env, "snapshots", query_id, "--json")
            rows = json.loads(listed.stdout)["snapshots"] if listed.returncode == 0 else []
            return rows[0]["batch_id"] if rows else None

        wait_for(lambda: newest() == 1, 30, f"{name}'s snapshot of batch 1")

    run(QUERY_ID, "a")
    shutil.rmtree(root / "app" / NAME)
    run(b_id, "b")
    wait_blob(env, b_id, 1)
    assert daemon.stop() == 0
    volume = tmp_path / "volume"
    volume.mkdir()
    done = cli(env | {"SIDECAR_SNAPSHOT_ROOT": str(volume)}, "restore", "--all", str(volume),
               "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {r["query_id"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert rows[b_id]["outcome"] == "restored" and rows[QUERY_ID]["outcome"] == "elsewhere"
    assert json.loads((volume / "app" / NAME / "metadata").read_text())["id"] == b_id
    gone = json.loads(cli(env, "snapshots", QUERY_ID, "--json").stdout)["gone"]
    assert gone["found_query"] == b_id
