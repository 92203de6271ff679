"""What ``restore --all`` does with each query's location (``sidecar.ops.restore.judge``):
every row of the table in its module docstring, on real directories."""

from __future__ import annotations

import json
from pathlib import Path

from sidecar.ops.restore import Verdict, judge

Q = "0c6b7a52-54f4-4d7e-9a53-3f1e8f6b2c11"
OTHER = "9d1e2f30-0000-4000-8000-000000000abc"


def checkpoint(dest: Path, query_id: str, *commits: int) -> Path:
    (dest / "commits").mkdir(parents=True)
    (dest / "metadata").write_text(json.dumps({"id": query_id}))
    for batch in commits:
        (dest / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')
    return dest


def test_an_absent_or_empty_location_is_restored(tmp_path: Path) -> None:
    assert judge(tmp_path / "lost", Q, 5) == Verdict()
    (tmp_path / "empty").mkdir()
    assert judge(tmp_path / "empty", Q, 5) == Verdict()


def test_a_location_without_metadata_is_restored_over(tmp_path: Path) -> None:
    # A restore into a mount point cut short moves metadata in last: the rest is there.
    (tmp_path / "cut" / "offsets").mkdir(parents=True)
    verdict = judge(tmp_path / "cut", Q, 5)
    assert verdict.replace and not (verdict.keep or verdict.refuse)
    assert "no checkpoint metadata" in verdict.why


def test_this_querys_checkpoint_is_kept_when_at_least_as_new(tmp_path: Path) -> None:
    assert judge(checkpoint(tmp_path / "same", Q, 4, 5), Q, 5).keep
    assert judge(checkpoint(tmp_path / "newer", Q, 7), Q, 5).keep


def test_this_querys_older_or_uncommitted_checkpoint_is_restored_over(tmp_path: Path) -> None:
    assert judge(checkpoint(tmp_path / "older", Q, 3), Q, 5) == Verdict(replace=True)
    # Spark started (metadata written) and was killed before its first commit: not refused
    # as "not empty" at every later start.
    assert judge(checkpoint(tmp_path / "started", Q), Q, 5) == Verdict(replace=True)


def test_another_querys_checkpoint_is_never_written_over(tmp_path: Path) -> None:
    # The location reused by a new query, far behind the old one's snapshot.
    verdict = judge(checkpoint(tmp_path / "reused", OTHER, 20), Q, 500)
    assert verdict.refuse and OTHER in verdict.why and Q in verdict.why
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "metadata").write_text("not json")
    assert judge(tmp_path / "garbled", Q, 5).refuse
    (tmp_path / "file").write_text("x")
    assert judge(tmp_path / "file", Q, 5).refuse
