"""A restore cut short at every step of putting its tree in place (``_place`` in
sidecar/snapshot/restore.py), into a plain directory and into a mount point's: what is left is
the old checkpoint whole, the new one whole, or no checkpoint at all (no ``metadata``:
``restore --all`` restores over it) — never a partial checkpoint that the next
``restore --all`` would keep. What ``restore --all`` does with a location a killed restore
left (files, no metadata), against Azurite: tests/integration/test_snapshot_daemon.py."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sidecar.ops.restore import judge
from sidecar.snapshot import restore as restoring
from tests.unit.test_restore_judge import Q, snapshot


class Crash(Exception):
    """The process died here."""


def write(top: Path, batch: int) -> None:
    (top / "offsets").mkdir(parents=True)
    (top / "commits").mkdir()
    (top / "state" / "0" / "0").mkdir(parents=True)
    (top / "metadata").write_text(json.dumps({"id": Q}))
    for b in range(batch + 1):
        (top / "offsets" / str(b)).write_text(f'v1\n{{"batchTimestampMs":1{b}}}\n{{"0":{b * 10}}}')
        (top / "commits" / str(b)).write_text('v1\n{"nextBatchWatermarkMs":0}')
        (top / "state" / "0" / "0" / f"{b + 1}.delta").write_text(f"state of {b}")


def tree(top: Path) -> dict[str, str]:
    """Every file under ``top`` but a restore's temporary directories."""
    out = {}
    for path in sorted(top.rglob("*")):
        rel = path.relative_to(top).as_posix()
        if path.is_file() and ".restore-" not in rel:
            out[rel] = path.read_text()
    return out


def steps(monkeypatch: pytest.MonkeyPatch, crash_at: int | None) -> list[str]:
    """Count each step that changes the file system (renames, unlinks, removals); raise
    :class:`Crash` instead of the ``crash_at``-th."""
    done: list[str] = []

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            if crash_at is not None and len(done) == crash_at:
                raise Crash(name)
            done.append(name)
            return real(*args, **kwargs)

        return step

    # A file system may list a directory in any order (ext4: by hash; tmpfs: newest first):
    # here metadata comes last, where a removal in listing order reaches it last.
    listed = Path.iterdir
    monkeypatch.setattr(
        Path, "iterdir", lambda p: iter(sorted(listed(p), key=lambda e: e.name == "metadata"))
    )
    monkeypatch.setattr(os, "rename", counted("rename", os.rename))
    monkeypatch.setattr(Path, "unlink", counted("unlink", Path.unlink))
    monkeypatch.setattr(Path, "rmdir", counted("rmdir", Path.rmdir))
    monkeypatch.setattr(shutil, "rmtree", counted("rmtree", shutil.rmtree))
    return done


def place(tmp: Path, mount: bool) -> Path:
    """A newer checkpoint (batch 8) in the location, the restored tree (batch 5) beside it,
    ready to be put in place (as ``restore --batch 5 --force`` does)."""
    dest = tmp / "volume" if mount else tmp / "app" / "q"
    write(dest, 8)
    temp = dest / ".restore-t" if mount else dest.parent / f".{dest.name}.restore-t"
    write(temp, 5)
    return dest


@pytest.mark.parametrize("mount", [False, True], ids=["directory", "mount point"])
def test_a_restore_cut_short_at_any_step_leaves_a_whole_checkpoint_or_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mount: bool
) -> None:
    whole = place(tmp_path / "whole", mount)
    old = tree(whole)
    with monkeypatch.context() as m:
        total = steps(m, None)
        restoring._place(
            whole / ".restore-t" if mount else whole.parent / f".{whole.name}.restore-t",
            whole,
            mount,
            "t",
        )
    new = tree(whole)
    assert new != old and new["commits/5"] and "commits/6" not in new
    assert len(total) >= 2
    head = snapshot(5)
    for k in range(len(total)):
        dest = place(tmp_path / f"crash-{k}", mount)
        temp = dest / ".restore-t" if mount else dest.parent / f".{dest.name}.restore-t"
        with monkeypatch.context() as m, pytest.raises(Crash):
            steps(m, k)
            restoring._place(temp, dest, mount, "t")
        left = tree(dest) if dest.exists() else {}
        verdict = judge(dest, Q, head)
        if "metadata" in left:  # a checkpoint: whole, the old one or the new one
            assert left in (old, new), f"cut short at step {k}: a partial checkpoint"
        else:  # none: the next restore --all restores over it
            assert not verdict.keep and not verdict.refuse, f"step {k}: {verdict}"
        if left == new:
            # Whole and kept by the next restore --all, which removes what the restore left
            # (a mount point's emptied temporary directory, a directory's old checkpoint set
            # aside) and nothing else.
            assert verdict.keep, f"step {k}: {verdict}"
            with monkeypatch.context() as m:
                m.setattr(os.path, "ismount", lambda p, top=dest: mount and Path(p) == top)
                restoring.tidy(dest)
            assert tree(dest) == new
            beside = dest if mount else dest.parent
            assert not [e.name for e in beside.iterdir() if ".restore-" in e.name], f"step {k}"


def test_tidy_leaves_another_location_and_a_file_alone(tmp_path: Path) -> None:
    dest, other = tmp_path / "app" / "q", tmp_path / "app" / "q2"
    write(dest, 3)
    write(other, 3)
    (dest.parent / ".q.restore-t-old").mkdir()  # a set-aside old checkpoint of q
    (dest.parent / ".q2.restore-t").mkdir()  # q2's: not q's to remove
    (dest.parent / ".q.restore-note").write_text("a file, not a restore's")
    assert restoring.tidy(dest) == [".q.restore-t-old"]
    assert sorted(e.name for e in dest.parent.iterdir()) == [
        ".q.restore-note",
        ".q2.restore-t",
        "q",
        "q2",
    ]


def test_tidy_with_a_quiet_period_leaves_a_restore_that_may_still_run(tmp_path: Path) -> None:
    # restore --all keeping a location removes a leftover only once nothing in it changed for
    # LEFTOVER_QUIET_S: an operator's restore into the same location may be writing there.
    dest = tmp_path / "app" / "q"
    write(dest, 3)
    live = dest.parent / ".q.restore-live"
    write(live, 2)
    assert restoring.tidy(dest, quiet_s=restoring.LEFTOVER_QUIET_S) == []
    old = 1_000_000_000.0
    for path in [live, *live.rglob("*")]:
        os.utime(path, (old, old), follow_symlinks=False)
    (live / "state" / "0" / "0" / "4.delta").write_text("a file being written now")
    assert restoring.tidy(dest, quiet_s=restoring.LEFTOVER_QUIET_S) == []  # one fresh file
    os.utime(live / "state" / "0" / "0" / "4.delta", (old, old))
    os.utime(live / "state" / "0" / "0", (old, old))
    assert restoring.tidy(dest, quiet_s=restoring.LEFTOVER_QUIET_S) == [".q.restore-live"]
    assert tree(dest) and not live.exists()
