"""What ``restore --all`` does with each query's location (``sidecar.ops.restore.judge``):
every row of the table in its module docstring, on real directories, judged against the
snapshot the checkpoint's marker leads to (its ``offsets/`` and ``commits/`` files)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sidecar.ops.restore import Verdict, judge
from sidecar.snapshot.index import FileEntry, SnapshotIndex

Q = "0c6b7a52-54f4-4d7e-9a53-3f1e8f6b2c11"
OTHER = "9d1e2f30-0000-4000-8000-000000000abc"


def offsets(batch: int, run: str) -> str:
    # Spark writes each batch's trigger time into offsets/N: a re-run batch differs.
    return f'v1\n{{"batchTimestampMs":{run}{batch}}}\n{{"0":{batch * 10}}}'


def checkpoint(dest: Path, query_id: str, *commits: int, run: str = "1") -> Path:
    (dest / "commits").mkdir(parents=True)
    (dest / "offsets").mkdir(parents=True)
    (dest / "metadata").write_text(json.dumps({"id": query_id}))
    for batch in commits:
        (dest / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')
        (dest / "offsets" / str(batch)).write_text(offsets(batch, run))
    return dest


def snapshot(batch: int, *, run: str = "1", keep: range | None = None) -> SnapshotIndex:
    """A snapshot of ``batch`` on the timeline ``run``, holding the logs of ``keep``."""
    files = []
    for b in keep if keep is not None else range(batch + 1):
        for path, text in (
            (f"offsets/{b}", offsets(b, run)),
            (f"commits/{b}", 'v1\n{"nextBatchWatermarkMs":0}'),
        ):
            data = text.encode()
            files.append(FileEntry(path, len(data), hashlib.sha256(data).digest(), "p", 0))
    return SnapshotIndex(
        query_id=Q,
        batch=batch,
        id=f"{run}{batch:031d}",
        created_at="2026-11-28T00:00:00+00:00",
        location="q",
        files=tuple(files),
        packs={"p": 1},
    )


def test_an_absent_or_empty_location_is_restored(tmp_path: Path) -> None:
    assert judge(tmp_path / "lost", Q, snapshot(5)) == Verdict()
    (tmp_path / "empty").mkdir()
    assert judge(tmp_path / "empty", Q, snapshot(5)) == Verdict()


def test_a_location_without_metadata_is_restored_over(tmp_path: Path) -> None:
    # A restore into a mount point cut short moves metadata in last: the rest is there.
    (tmp_path / "cut" / "offsets").mkdir(parents=True)
    verdict = judge(tmp_path / "cut", Q, snapshot(5))
    assert verdict.replace and not (verdict.keep or verdict.refuse)
    assert "no checkpoint metadata" in verdict.why


def test_this_querys_checkpoint_on_the_markers_timeline_is_kept_when_at_least_as_new(
    tmp_path: Path,
) -> None:
    assert judge(checkpoint(tmp_path / "same", Q, 4, 5), Q, snapshot(5)).keep
    assert judge(checkpoint(tmp_path / "newer", Q, 4, 5, 6, 7), Q, snapshot(5)).keep
    # Spark's retention deleted batch 5's logs since: newer, nothing to compare: kept
    assert judge(checkpoint(tmp_path / "far", Q, 107), Q, snapshot(5)).keep


def test_a_rewound_query_run_on_is_kept_not_undone_by_the_abandoned_newest(
    tmp_path: Path,
) -> None:
    # Rewound to 50 (restored: its logs up to 50 are the snapshot's), then ran 51..60 anew.
    rewound = checkpoint(tmp_path / "q", Q, *range(51), run="1")
    for batch in range(51, 61):
        (rewound / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')
        (rewound / "offsets" / str(batch)).write_text(offsets(batch, "2"))
    # The marker leads to the rewind point (no snapshot of the new timeline yet): kept.
    assert judge(rewound, Q, snapshot(50, run="1")).keep
    # ... and to the new timeline's newest once it has one: kept.
    new_head = snapshot(58, run="2", keep=range(51, 59))
    assert judge(rewound, Q, new_head).keep


def test_a_timeline_the_checkpoint_does_not_know_is_never_written_over(tmp_path: Path) -> None:
    # The directory ran batches 51..60 on another timeline than the head's (rewound by hand).
    verdict = judge(checkpoint(tmp_path / "ahead", Q, 58, 59, 60, run="3"), Q, snapshot(58))
    assert verdict.refuse and "does not know" in verdict.why and "offsets/58" in verdict.why
    # Behind the head, and its own newest batch differs from the head's copy: refused too.
    verdict = judge(checkpoint(tmp_path / "behind", Q, 40, run="3"), Q, snapshot(58))
    assert verdict.refuse and "offsets/40" in verdict.why


def test_this_querys_older_or_uncommitted_checkpoint_is_restored_over(tmp_path: Path) -> None:
    assert judge(checkpoint(tmp_path / "older", Q, 3), Q, snapshot(5)) == Verdict(replace=True)
    # Older than anything the head holds: nothing to compare, never newer: restored over.
    far = checkpoint(tmp_path / "far", Q, 3)
    assert judge(far, Q, snapshot(500, keep=range(400, 501))) == Verdict(replace=True)
    # Spark started (metadata written) and was killed before its first commit: not refused
    # as "not empty" at every later start.
    assert judge(checkpoint(tmp_path / "started", Q), Q, snapshot(5)) == Verdict(replace=True)


def test_another_querys_checkpoint_is_never_written_over(tmp_path: Path) -> None:
    # The location reused by a new query, far behind the old one's snapshot.
    verdict = judge(checkpoint(tmp_path / "reused", OTHER, 20), Q, snapshot(500))
    assert verdict.elsewhere == OTHER and OTHER in verdict.why and Q in verdict.why
    assert not (verdict.keep or verdict.replace)
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "metadata").write_text("not json")
    assert judge(tmp_path / "garbled", Q, snapshot(5)).refuse
    (tmp_path / "file").write_text("x")
    assert judge(tmp_path / "file", Q, snapshot(5)).refuse
