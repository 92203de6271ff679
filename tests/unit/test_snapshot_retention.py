"""Retention's plan (sidecar/snapshot/retention.py, pure) and restore's reads (plan_reads):
which snapshots are kept, which blobs are swept and when, which packs are repacked, how an
index is rewritten; the same against Azurite: tests/integration/test_snapshot_store.py."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.model.document import SnapshotRef
from sidecar.snapshot.index import FileEntry, SnapshotIndex, index_name, pack_name
from sidecar.snapshot.restore import plan_reads
from sidecar.snapshot.retention import (
    Listing,
    PrunePlan,
    StoredIndex,
    StoredPack,
    classify,
    decode_marks,
    encode_marks,
    marks_name,
    moved,
    plan,
)

NS, QID = "ns", "q"
NOW = 1_000_000.0


def sha(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


class Store:
    """Snapshots and packs as a listing shows them, built by hand."""

    def __init__(self) -> None:
        self.indexes: dict[str, SnapshotIndex] = {}
        self.stored: list[StoredIndex] = []
        self.packs: dict[str, StoredPack] = {}

    def pack(self, pid: str, size: int, written_at: float = 0.0) -> None:
        self.packs[pid] = StoredPack(pack_name(NS, QID, pid), pid, size, written_at)

    def snapshot(
        self, batch: int, files: list[tuple[str, int, int, str, int]], sid: str | None = None
    ) -> StoredIndex:
        """``files``: (path, size, content, pack, offset)."""
        sid = sid or f"{batch:032x}"
        entries = tuple(FileEntry(p, size, sha(c), pack, off) for p, size, c, pack, off in files)
        packs = {f.pack: self.packs[f.pack].size if f.pack in self.packs else 1 for f in entries}
        index = SnapshotIndex(
            query_id=QID,
            batch=batch,
            id=sid,
            created_at="",
            location="",
            files=entries,
            packs={p: s for p, s in packs.items() if p},
        )
        name = index_name(NS, QID, batch, sid)
        self.indexes[name] = index
        stored = StoredIndex(name, batch, sid, '"v"', float(batch))
        self.stored.append(stored)
        return stored

    def listing(self) -> Listing:
        ordered = sorted(self.stored, key=lambda i: (i.batch, i.written_at, i.id), reverse=True)
        return Listing(tuple(ordered), dict(self.packs), None)

    def plan(self, **options: object) -> PrunePlan:
        defaults: dict[str, object] = {"retain": 2, "named": None, "marks": {}, "now": NOW}
        defaults["grace_s"] = 0.0
        defaults.update(options)
        return plan(self.listing(), self.indexes, **defaults)  # type: ignore[arg-type]


def chain(store: Store, batches: int) -> list[StoredIndex]:
    """``batches`` snapshots, each with its own pack of one new 100-byte file, plus
    ``metadata`` (content 0) in pack p0 shared by all."""
    store.pack("p0", 10)
    out = []
    for b in range(batches):
        store.pack(f"p{b + 1}", 100)
        out.append(
            store.snapshot(b, [("metadata", 10, 0, "p0", 0), (f"f{b}", 100, b + 1, f"p{b + 1}", 0)])
        )
    return out


def ids(packs: tuple[StoredPack, ...]) -> list[str]:
    return sorted(p.id for p in packs)


def test_the_newest_are_kept_and_the_rest_deleted_with_what_only_they_reference() -> None:
    store = Store()
    s = chain(store, 5)
    decided = store.plan(retain=2)
    assert decided.kept == (s[4], s[3])
    assert sorted(i.batch for i in decided.delete_indexes) == [0, 1, 2]
    assert ids(decided.delete_packs) == ["p1", "p2", "p3"]
    assert decided.repack == () and decided.marks == {}
    assert (decided.stored_bytes, decided.live_bytes) == (510, 210)


def test_the_snapshot_the_document_names_is_kept_whatever_its_age() -> None:
    store = Store()
    s = chain(store, 5)
    decided = store.plan(retain=1, named=SnapshotRef(1, s[1].id))
    assert decided.kept == (s[4], s[1])
    assert ids(decided.delete_packs) == ["p1", "p3", "p4"]
    # Another snapshot of the same batch is not the one named.
    other = store.snapshot(1, [("metadata", 10, 0, "p0", 0)], sid="f" * 32)
    decided = store.plan(retain=1, named=SnapshotRef(1, s[1].id))
    assert s[1] in decided.kept and other in decided.delete_indexes


def test_a_broken_index_is_not_counted_and_deleted_unless_named() -> None:
    store = Store()
    s = chain(store, 4)
    del store.packs["p4"]  # the newest snapshot's pack is gone
    decided = store.plan(retain=2)
    assert decided.broken == (s[3].name,)
    assert decided.kept == (s[2], s[1])  # two intact ones
    assert s[3] in decided.delete_indexes
    named = store.plan(retain=2, named=SnapshotRef(3, s[3].id))
    assert named.kept == (s[3], s[2], s[1])  # kept, and not counted among the two


def test_an_unreadable_index_blocks_every_pack_deletion_and_repack() -> None:
    store = Store()
    s = chain(store, 4)
    store.indexes[s[0].name] = None  # type: ignore[assignment]
    decided = store.plan(retain=1)
    assert decided.unreadable == (s[0].name,) and decided.blocked
    assert decided.delete_packs == () and decided.repack == ()
    assert s[0] not in decided.delete_indexes and s[0] not in decided.kept
    assert sorted(i.batch for i in decided.delete_indexes) == [1, 2]
    assert set(decided.marks) == {"p1", "p2", "p3"}  # still marked: swept once readable


def test_an_unreferenced_pack_waits_the_grace_period_from_when_it_was_first_seen() -> None:
    store = Store()
    chain(store, 1)
    store.pack("orphan", 50, written_at=NOW - 5000)  # an old pack of a failed snapshot
    first = store.plan(grace_s=600)
    assert first.delete_packs == () and first.marks == {"orphan": NOW}
    later = store.plan(grace_s=600, marks=first.marks, now=NOW + 599)
    assert later.delete_packs == () and later.marks == {"orphan": NOW}
    due = store.plan(grace_s=600, marks=first.marks, now=NOW + 600)
    assert ids(due.delete_packs) == ["orphan"] and due.marks == {}


def test_a_young_pack_is_spared_even_if_marked_long_ago() -> None:
    store = Store()
    chain(store, 1)
    store.pack("inflight", 50, written_at=NOW - 10)  # a snapshot being written
    decided = store.plan(grace_s=600, marks={"inflight": NOW - 9999})
    assert decided.delete_packs == () and decided.marks == {"inflight": NOW - 9999}


def test_a_pack_referenced_again_loses_its_mark_and_marks_of_gone_packs_are_dropped() -> None:
    store = Store()
    chain(store, 2)
    decided = store.plan(grace_s=600, marks={"p1": NOW - 10, "gone": NOW - 10})
    assert decided.marks == {}  # p1 is referenced (retain 2), "gone" is not listed


def test_packs_whose_live_bytes_are_below_the_threshold_are_repacked_sparsest_first() -> None:
    store = Store()
    store.pack("half", 200)
    store.pack("less", 200)
    store.pack("sparse", 1000)
    store.snapshot(
        0,
        [
            ("a", 100, 1, "half", 0),  # 50 %: not repacked
            ("b", 99, 2, "less", 101),  # 49.5 %
            ("c", 10, 3, "sparse", 500),  # 1 %
            ("d", 10, 3, "sparse", 500),  # the same content: counted once
        ],
    )
    decided = store.plan(retain=1)
    assert [r.pack.id for r in decided.repack] == ["sparse", "less"]
    assert decided.repack[0].live_bytes == 10 and decided.repack[1].live[0].offset == 101
    assert [r.pack.id for r in store.plan(retain=1, repack_below=0.005).repack] == []
    # A budget per pass: the sparsest first, at least one.
    assert [r.pack.id for r in store.plan(retain=1, max_repack_bytes=50).repack] == ["sparse"]
    assert [r.pack.id for r in store.plan(retain=1, max_repack_bytes=1).repack] == ["sparse"]


def test_the_plan_refuses_nonsense() -> None:
    store = Store()
    chain(store, 1)
    with pytest.raises(ValueError, match="retain must be >= 1"):
        store.plan(retain=0)
    with pytest.raises(ValueError):
        store.plan(repack_below=1.5)


def test_moved_points_each_moved_content_to_its_new_place() -> None:
    store = Store()
    store.pack("old", 1000)
    store.pack("keep", 10)
    s = store.snapshot(
        0,
        [("a", 10, 1, "old", 500), ("b", 10, 2, "keep", 0), ("c", 0, 9, "", 0)],
    )
    index = store.indexes[s.name]
    out = moved(index, {("old", 500): ("new", 0)}, {"new": 10})
    assert out is not None
    assert [(f.path, f.pack, f.offset) for f in out.files] == [
        ("a", "new", 0),
        ("b", "keep", 0),
        ("c", "", 0),
    ]
    assert out.packs == {"keep": 10, "new": 10}
    assert msgspec.structs.replace(out, files=index.files, packs=index.packs) == index
    assert moved(index, {("other", 0): ("new", 0)}, {"new": 10}) is None


def test_a_listing_is_sorted_into_indexes_packs_marks_and_others() -> None:
    class Blob(msgspec.Struct):
        name: str
        size: int
        version: str
        last_modified: datetime | None

    t = datetime(2026, 1, 1, tzinfo=UTC)
    pid = "a" * 32
    listed = [
        Blob(index_name(NS, QID, 3, "1" * 32), 10, "v3", t),
        Blob(index_name(NS, QID, 12, "2" * 32), 10, "v12", None),
        Blob(index_name(NS, QID, 12, "3" * 32), 10, "v12b", t),
        Blob(pack_name(NS, QID, pid), 99, "vp", t),
        Blob(marks_name(NS, QID), 5, "vm", t),
        Blob(f"{NS}/snapshots/{QID}/packs/not-an-id", 1, "x", t),
        Blob(f"{NS}/snapshots/{QID}/index/junk", 1, "x", t),
    ]
    listing = classify(listed, NS, QID)
    assert [(i.batch, i.id[0]) for i in listing.indexes] == [(12, "3"), (12, "2"), (3, "1")]
    assert listing.packs == {pid: StoredPack(pack_name(NS, QID, pid), pid, 99, t.timestamp(), "vp")}
    assert listing.marks_version == "vm" and len(listing.other) == 2


@given(st.dictionaries(st.text(min_size=1, max_size=40), st.floats(allow_nan=False)))
@settings(max_examples=50)
def test_marks_round_trip_and_garbage_reads_as_none(marks: dict[str, float]) -> None:
    assert decode_marks(encode_marks(marks)) == marks
    assert decode_marks(b"\xc1 not msgpack") == {}


def test_restore_reads_close_contents_of_a_pack_together_and_shared_ones_once() -> None:
    big = 9 * 1024 * 1024
    index = SnapshotIndex(
        query_id=QID,
        batch=0,
        id="0" * 32,
        created_at="",
        location="",
        files=(
            FileEntry("a", 100, sha(1), "p", 0),
            FileEntry("b", 100, sha(2), "p", 100),
            FileEntry("b2", 100, sha(2), "p", 100),  # the same content: read once
            FileEntry("c", 100, sha(3), "p", 100_000),  # 99,800 bytes further: another read
            FileEntry("d", big, sha(4), "p", 200_000),  # larger than a range: in slices
            FileEntry("e", 50, sha(5), "q", 0),
            FileEntry("empty", 0, sha(6), "", 0),  # no read
        ),
        packs={"p": 200_000 + big, "q": 50},
    )
    reads = plan_reads(index)
    shape = [(r.pack, r.start, r.length, [c.paths for c in r.contents], r.sliced) for r in reads]
    mib = 1024 * 1024
    assert shape == [
        # The largest first; a large content's slices in order, each a read of its own that
        # any worker may take.
        ("p", 200_000, 4 * mib, [["d"]], True),
        ("p", 200_000 + 4 * mib, 4 * mib, [["d"]], True),
        ("p", 200_000 + 8 * mib, mib, [["d"]], True),
        ("p", 0, 200, [["a"], ["b", "b2"]], False),
        ("p", 100_000, 100, [["c"]], False),
        ("q", 0, 50, [["e"]], False),
    ]
    assert [r.length for r in plan_reads(index, gap_bytes=100_000)][3] == 100_100
    # A content of exactly a range is one read, not sliced.
    first = plan_reads(index, max_bytes=big)[0]
    assert (first.length, first.sliced) == (big, False)
