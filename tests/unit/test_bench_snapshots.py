"""The pure parts of bench/snapshots.py (bench/snapshotstats.py), on made-up commits, copies,
indexes and directories: which copy first holds a batch and how late, what each snapshot
uploaded against what was new, contents uploaded twice, files written per batch; and its
``--placement pod`` pinning, on real processes. No timing is asserted."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.common import BenchError, Cpus, pin
from bench.snapshotstats import (
    IndexFacts,
    Stored,
    backup_lags,
    changes,
    files_per_batch,
    lag_summary,
    new_since,
    overlapping,
    ratio,
    spread,
)


def sha(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def test_a_batch_is_held_by_the_first_copy_of_it_or_of_a_later_batch() -> None:
    commits = {0: 10.0, 1: 20.0, 2: 30.0, 3: 40.0}
    stored = [Stored(0, 11.0), Stored(2, 33.5), Stored(1, 34.0)]  # 1's came after 2's
    lags = backup_lags(commits, stored)
    assert [lag.batch for lag in lags] == [0, 1, 2, 3]
    assert lags[0].seconds == pytest.approx(1.0) and not lags[0].coalesced
    # batch 1: the copy of batch 2 was complete first
    assert lags[1].by_batch == 2 and lags[1].seconds == pytest.approx(13.5) and lags[1].coalesced
    assert lags[2].by_batch == 2 and lags[2].seconds == pytest.approx(3.5)
    assert lags[3].stored_at is None and lags[3].seconds is None  # no copy holds it (yet)
    s = lag_summary(lags)
    assert s["batches"] == 4 and s["not_held"] == 1 and s["coalesced"] == 1
    assert s["max_s"] == pytest.approx(13.5) and s["n"] == 3


def test_lags_without_copies_or_commits() -> None:
    assert backup_lags({}, [Stored(1, 1.0)]) == []
    lags = backup_lags({4: 1.0}, [])
    assert lags[0].stored_at is None
    assert lag_summary([])["p99_s"] is None


def index(
    batch: int, files: dict[str, tuple[int, str, str, int]], packs: dict[str, int]
) -> IndexFacts:
    return IndexFacts(
        batch, {p: (size, sha(text), pack, off) for p, (size, text, pack, off) in files.items()},
        packs,
    )  # fmt: skip


def test_changes_compare_each_snapshot_with_the_one_before_and_with_all_stored() -> None:
    first = index(0, {"metadata": (10, "m", "p1", 0), "state/1.changelog": (100, "a", "p1", 10)},
                  {"p1": 110})  # fmt: skip
    second = index(
        1,
        {"metadata": (10, "m", "p1", 0), "state/1.changelog": (100, "a", "p1", 10),
         "state/2.changelog": (200, "b", "p2", 0),
         "commits/1": (10, "m", "p1", 0)},  # same content as metadata: stored, not new content
        {"p1": 110, "p2": 200},
    )  # fmt: skip
    a, b = changes([first, second])
    assert a.first and a.new_files == 2 and a.uploaded_bytes == 110 and a.duplicate_bytes == 0
    assert not b.first and b.files == 4 and b.cut_bytes == 320
    assert b.new_files == 2 and b.new_bytes == 210  # the new changelog and commits/1
    assert b.new_content_bytes == 200  # commits/1's bytes were stored already
    assert b.uploaded_bytes == 200 and b.duplicate_files == 0
    assert b.uploaded_per_new_byte == pytest.approx(200 / 210)


def test_a_content_stored_before_and_uploaded_again_is_a_duplicate() -> None:
    first = index(0, {"a": (100, "a", "p1", 0)}, {"p1": 100})
    # After a restart the same content went up again in a new pack, and twice in it.
    again = index(1, {"a": (100, "a", "p2", 0), "b": (50, "b", "p2", 100),
                      "c": (50, "b", "p2", 150)}, {"p2": 200})  # fmt: skip
    _, b = changes([first, again])
    assert b.uploaded_bytes == 200
    assert b.duplicate_files == 2 and b.duplicate_bytes == 150  # a again; b's second copy
    assert b.new_bytes == 100 and b.uploaded_per_new_byte == pytest.approx(2.0)  # b, c new


def test_a_snapshot_with_no_new_file_has_no_ratio() -> None:
    same = index(0, {"a": (0, "", "", 0)}, {})
    _, b = changes([same, IndexFacts(1, same.files, {})])
    assert b.new_files == 0 and b.uploaded_per_new_byte is None


def test_new_since_counts_new_and_changed_files() -> None:
    before = {"a": (1, 100), "b": (2, 100)}
    now = {"a": (1, 100), "b": (3, 200), "c": (5, 300)}
    assert new_since(before, now) == (2, 8)
    assert new_since({}, now) == (3, 9)


def test_files_per_batch_by_mtime_between_commits() -> None:
    commits = {0: 10.0, 1: 20.0, 2: 30.0}
    mtimes = [5.0, 10.0, 12.0, 20.0, 25.0, 29.0, 31.0]  # ≤ 10: batch 0's; > 30: not committed
    assert files_per_batch(commits, mtimes) == {1: 2, 2: 2}
    assert files_per_batch({}, mtimes) == {}


def test_overlapping_spans_and_numbers() -> None:
    spans = [(1.0, 2.0), (5.0, 6.0)]
    assert overlapping(spans, 1.5, 1.6) and overlapping(spans, 0.5, 1.0)
    assert not overlapping(spans, 2.5, 4.9) and not overlapping([], 0, 9)
    s = spread([1.0, 2.0, 3.0, 4.0])
    assert s["n"] == 4 and s["p50"] == 2.5 and s["max"] == 4.0
    assert spread([])["p50"] is None
    assert ratio(3.0, 2.0) == 1.5 and ratio(None, 1.0) is None and ratio(1.0, 0.0) is None


def test_batches_no_copy_held_say_how_long_they_waited() -> None:
    lags = backup_lags({1: 10.0, 2: 20.0, 3: 30.0}, [Stored(1, 15.0)])
    s = lag_summary(lags, end=40.0)
    assert s["not_held"] == 2 and s["not_held_waited_s"] == pytest.approx(20.0)
    assert lag_summary(lags[:1], end=40.0)["not_held_waited_s"] is None


def children_of(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]  # fmt: skip


def test_pod_placement_pins_each_side_and_its_children_to_its_own_cpus() -> None:
    """``--placement pod``: the sidecar's side on the first CPU, the rest on the others, a
    process's threads and children with it; ``shared`` pins nothing; anything else is refused."""
    assert Cpus.of("shared") == Cpus()
    with pytest.raises(BenchError, match="'shared', or 'pod'"):
        Cpus.of("pods")
    every = sorted(os.sched_getaffinity(0))
    if len(every) < 2:
        with pytest.raises(BenchError, match="2 CPUs or more"):
            Cpus.of("pod")
        return
    cpus = Cpus.of("pod")
    assert (sorted(cpus.sidecar), sorted(cpus.spark)) == ([every[0]], every[1:])
    # A parent with a child already running: both are moved, and back.
    script = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", script, "sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while not (kids := children_of(parent.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(kids) == 1
        pin(parent.pid, cpus.sidecar)
        assert os.sched_getaffinity(parent.pid) == os.sched_getaffinity(kids[0]) == cpus.sidecar
        pin(parent.pid, cpus.every)
        assert os.sched_getaffinity(kids[0]) == set(every)
    finally:
        parent.kill()
        parent.wait()
