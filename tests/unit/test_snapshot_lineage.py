"""A query's snapshots as timelines (sidecar/snapshot/lineage.py, pure), the document's marker
that follows one (``follows``), and retention by timeline (``retention.plan``): a rewind to
batch 50 run on to 61, with the abandoned 51..100 still stored. The same through a real
daemon, Azurite and a rewound directory: tests/integration/test_snapshot_daemon.py."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

import msgspec
import pytest

from sidecar.model.document import SnapshotRef, follows
from sidecar.snapshot import lineage
from sidecar.snapshot.index import FileEntry, SnapshotIndex
from sidecar.snapshot.lineage import OffTimeline
from sidecar.snapshot.retention import plan
from tests.unit.test_snapshot_retention import NOW, Store


def logs(batch: int, run: str, keep: int = 10) -> dict[str, bytes]:
    """The SHA-256 of a checkpoint's logs at ``batch``, the last ``keep`` batches retained;
    ``run``: the timeline that wrote them (Spark writes each trigger's time in offsets/N)."""
    out = {}
    for b in range(max(0, batch - keep + 1), batch + 1):
        out[f"offsets/{b}"] = hashlib.sha256(f"{run}:{b}".encode()).digest()
        out[f"commits/{b}"] = hashlib.sha256(b"v1 nextBatchWatermarkMs 0").digest()
    return out


def index(
    batch: int,
    run: str,
    *,
    timeline: str | None,
    parent: str | None = None,
    created: float = NOW,
    history: str | None = None,
) -> SnapshotIndex:
    """A snapshot of ``batch`` of the directory written by ``run`` (the logs before the
    rewind point by ``history``, when given)."""
    sums = logs(batch, run)
    if history is not None:
        for path in sums:
            if int(path.split("/")[1]) <= 50:
                sums[path] = logs(50, history)[path]
    return SnapshotIndex(
        query_id="q",
        batch=batch,
        id=f"{run}-{batch}",
        created_at=datetime.fromtimestamp(created, UTC).isoformat(),
        location="q",
        files=tuple(FileEntry(p, 1, s, "p", 0) for p, s in sums.items()),
        packs={"p": 1},
        parent=parent,
        timeline=timeline,
    )


def rewound() -> tuple[list[SnapshotIndex], SnapshotRef]:
    """Snapshots 48..52 and 100 of timeline t1, a rewind to 50 (the marker: 50 on t2), and
    the new timeline's 51'..53' taken since."""
    old = [index(b, "a", timeline="t1", parent=f"a-{b - 1}") for b in (48, 49, 50, 51, 52)]
    old.append(index(100, "a", timeline="t1", parent="a-52"))
    new = [
        index(b, "b", timeline="t2", parent="a-50" if b == 51 else f"b-{b - 1}", history="a")
        for b in (51, 52, 53)
    ]
    return old + new, SnapshotRef(50, "a-50", "t2")


def test_a_cut_follows_the_newest_snapshot_whose_logs_it_holds_identical() -> None:
    known, _ = rewound()
    old = [i for i in known if i.timeline == "t1"]
    # The directory rewound to 50 and run to 55 anew: its 51..55 differ from t1's.
    cut = logs(55, "b") | {p: s for p, s in logs(50, "a").items()}
    assert lineage.parent_of(55, cut, old).id == "a-50"  # type: ignore[union-attr]
    # The same directory never rewound: the newest at or below the cut's batch.
    assert lineage.parent_of(60, logs(60, "a"), old).id == "a-52"  # type: ignore[union-attr]
    # Spark's retention deleted the logs of every snapshot since: none provable.
    assert lineage.parent_of(200, logs(200, "a"), old) is None


def test_a_new_snapshot_takes_the_markers_timeline_and_off_timeline_cuts_are_refused() -> None:
    known, marker = rewound()
    by_id = {i.id: i for i in known}
    assert lineage.place(by_id["a-50"], marker) == "t2"  # the rewind point itself
    assert lineage.place(by_id["b-52"], marker) == "t2"  # later on the marker's timeline
    with pytest.raises(OffTimeline, match="did not record"):
        lineage.place(by_id["a-49"], marker)  # older than the marker: rewound again by hand
    with pytest.raises(OffTimeline):
        lineage.place(by_id["a-52"], marker)  # the abandoned timeline (an old driver still on)
    assert lineage.place(None, marker) == "t2"  # a gap: nothing provable, the query's own
    # No marker, or one of before timelines: as before (the parent's, or a new timeline).
    assert lineage.place(by_id["a-52"], None) == "t1"
    legacy = SnapshotRef(49, "a-49")
    assert lineage.place(by_id["a-49"], legacy) == "t1"
    with pytest.raises(OffTimeline):
        lineage.place(by_id["a-48"], legacy)


def test_the_current_line_is_the_markers_timeline_and_its_ancestors() -> None:
    known, marker = rewound()
    line = lineage.current(known, marker)
    assert line == {"a-48", "a-49", "a-50", "b-51", "b-52", "b-53"}
    # The restore wants the new timeline's newest, not the abandoned 100.
    assert lineage.head(known, marker).id == "b-53"  # type: ignore[union-attr]
    assert lineage.choose(known, marker).id == "b-53"  # type: ignore[union-attr]
    # By batch: the current line's 51, or the abandoned 100 when asked for by its batch.
    assert lineage.choose(known, marker, 51).id == "b-51"  # type: ignore[union-attr]
    assert lineage.choose(known, marker, 100).id == "a-100"  # type: ignore[union-attr]
    assert lineage.choose(known, marker, 77) is None
    # Right after the rewind, before any snapshot of t2: the rewind point itself.
    before = [i for i in known if i.timeline == "t1"]
    assert lineage.head(before, marker).id == "a-50"  # type: ignore[union-attr]
    # No marker (or one of before timelines): every snapshot current, the newest the head.
    assert lineage.current(known, None) == {i.id for i in known}
    assert lineage.head(known, None).id == "a-100"  # type: ignore[union-attr]


def test_a_restore_keeps_the_timeline_of_its_head_and_starts_a_new_one_for_a_rewind() -> None:
    known, marker = rewound()
    by_id = {i.id: i for i in known}
    assert lineage.marker_for(by_id["b-53"], known, marker) == SnapshotRef(53, "b-53", "t2")
    rewind = lineage.marker_for(by_id["b-51"], known, marker)
    assert (rewind.batch_id, rewind.id) == (51, "b-51") and rewind.timeline not in ("t1", "t2")


def test_the_marker_moves_only_along_its_timeline() -> None:
    marker = SnapshotRef(50, "a-50", "t2")
    assert follows(SnapshotRef(53, "b-53", "t2"), marker)
    assert not follows(SnapshotRef(100, "a-100", "t1"), marker)  # abandoned, though higher
    assert not follows(SnapshotRef(49, "x", "t2"), marker)
    assert follows(SnapshotRef(3, "x", "t9"), None)
    assert follows(SnapshotRef(60, "x", "t9"), SnapshotRef(50, "y"))  # a marker of before
    assert not follows(None, marker)


def test_retention_keeps_the_current_line_and_abandoned_rewind_points_for_a_while() -> None:
    known, marker = rewound()
    store = Store()
    store.pack("p", 1)
    week = 7 * 86400.0
    for i in known:
        young = i.batch != 48 and i.id != "a-51"  # a-48 and a-51 taken long ago
        made = msgspec.structs.replace(
            i,
            created_at=datetime.fromtimestamp(NOW - (0 if young else 2 * week), UTC).isoformat(),
        )
        stored = store.snapshot(i.batch, [("metadata", 1, 0, "p", 0)], sid=i.id)
        store.indexes[stored.name] = made
    decided = plan(
        store.listing(), store.indexes, retain=3, named=marker, marks={}, now=NOW,
        abandoned_s=week,
    )  # fmt: skip
    kept = {s.id for s in decided.kept}
    # The current line's newest 3 (b-53, b-52, b-51) and the marker (a-50); the abandoned
    # t1 snapshots younger than a week (a-52, a-100); never the old abandoned a-51.
    assert kept == {"b-53", "b-52", "b-51", "a-50", "a-52", "a-100"}
    assert {s.id for s in decided.delete_indexes} == {"a-51", "a-49", "a-48"}


def test_snapshots_taken_before_lineage_was_kept_stay_on_the_line_below_it() -> None:
    # An upgrade: snapshots 10..12 of no timeline; the first one taken since follows 12.
    legacy = [index(b, "a", timeline=None) for b in (10, 11, 12)]
    first = index(13, "a", timeline="t1", parent="a-12")
    marker = SnapshotRef(13, "a-13", "t1")
    assert lineage.current([*legacy, first], marker) == {"a-10", "a-11", "a-12", "a-13"}
    # A rewind to a legacy snapshot: those after it are abandoned, those before it are not.
    rewind = SnapshotRef(11, "a-11", "t2")
    assert lineage.current(legacy, rewind) == {"a-10", "a-11"}


def test_the_marker_never_names_a_snapshot_past_the_documents_position() -> None:
    from sidecar.model.document import CheckpointDocument
    from tests.unit.fakes import WRITER, checkpoint

    at_50 = CheckpointDocument.of(checkpoint("q", 50), WRITER)  # a reset named none
    ahead = SnapshotRef(100, "a-100", "t1")  # of the timeline before it, in flight
    assert CheckpointDocument.of(checkpoint("q", 51), WRITER, reset_of=at_50,
                                 snapshot=ahead).snapshot is None  # fmt: skip
    named = SnapshotRef(51, "b-51", "t2")
    assert CheckpointDocument.of(checkpoint("q", 51), WRITER, reset_of=at_50,
                                 snapshot=named).snapshot == named  # fmt: skip
