"""``Contents`` keeps every index a snapshot wrote, with its version or without one."""

from __future__ import annotations

from sidecar.snapshot.contents import Contents
from sidecar.snapshot.index import FileEntry, SnapshotIndex


def index(batch: int, snapshot_id: str) -> SnapshotIndex:
    data = FileEntry(f"commits/{batch}", 3, bytes([batch]) * 32, "p" * 32, 3 * batch, 7)
    return SnapshotIndex(
        query_id="q",
        batch=batch,
        id=snapshot_id,
        created_at="2026-11-29T00:00:00.000+00:00",
        location="app/q",
        files=(data,),
        packs={"p" * 32: 64},
    )


def test_an_index_whose_create_found_it_written_is_kept_for_the_lineage() -> None:
    # An index write reset after it ran: the retry finds the blob there (an earlier send of
    # its own landed) and has no version for it. It is still the query's newest snapshot: the
    # next one's parent. Dropped here, that one named the snapshot before it as parent, the
    # document named this one, and every later snapshot was refused off_timeline.
    contents = Contents()
    contents.learn(index(12, "a" * 32), name="ns/snapshots/q/index/12-a", version="v12")
    contents.learn(index(13, "b" * 32), name="ns/snapshots/q/index/13-b", version="")
    assert sorted(i.batch for i in contents.indexes()) == [12, 13]
    assert contents.locate(bytes([13]) * 32) == ("p" * 32, 39)
    # Its version unknown: prune reads it again (no listed version matches "").
    assert contents.index("ns/snapshots/q/index/13-b", "v13") is None
    assert contents.index("ns/snapshots/q/index/12-a", "v12") is not None
