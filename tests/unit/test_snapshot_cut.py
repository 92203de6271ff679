"""The cut of batch N on synthetic checkpoint listings: every rule of sidecar/snapshot/cut.py.

The same rules against real Spark (restarts from the copied cut): tests/integration/
test_snapshot_restore.py.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.snapshot.cut import (
    HDFS_PROVIDER,
    PROVIDER_CONF,
    ROCKSDB_PROVIDER,
    Cut,
    CutError,
    ListedFile,
    Role,
    cut_of,
    cut_of_names,
    v2_ids,
)

QUERY_ID = "6f9619ff-8b86-d011-b42d-00cf4fc964ff"
JOIN_STORES = (
    "left-keyToNumValues",
    "left-keyWithIndexToValue",
    "right-keyToNumValues",
    "right-keyWithIndexToValue",
)


class Checkpoint:
    """A checkpoint directory as a dict of path -> bytes: its listing and its reader."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.reads: list[str] = []

    def add(self, path: str, data: bytes = b"x") -> None:
        self.files[path] = data

    def remove(self, path: str) -> None:
        del self.files[path]

    def listing(self) -> list[ListedFile]:
        return [ListedFile(p, len(d), f"stamp-{p}") for p, d in self.files.items()]

    def read(self, path: str) -> bytes:
        self.reads.append(path)
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path]

    def cut(self, batch: int) -> Cut:
        return cut_of(self.listing(), self.read, batch)


def offsets_file(
    offsets: list[Any], provider: str | None = HDFS_PROVIDER, names: list[str] | None = None
) -> bytes:
    conf = {"spark.sql.shuffle.partitions": "2"}
    if provider is not None:
        conf[PROVIDER_CONF] = provider
    meta = json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": 1000, "conf": conf})
    lines = ["-" if o is None else json.dumps(o) for o in offsets]
    if names is not None:
        return "\n".join(
            ["v2", meta, *(f"{n}:{line}" for n, line in zip(names, lines, strict=True))]
        ).encode()
    return "\n".join(["v1", meta, *lines]).encode()


def commit_file(ids: dict[int, list[list[str]]] | None = None) -> bytes:
    if ids is None:
        return b'v1\n{"nextBatchWatermarkMs":0}'
    body = {"nextBatchWatermarkMs": 0, "stateUniqueIds": {str(k): v for k, v in ids.items()}}
    return f"v2\n{json.dumps(body)}".encode()


def query(
    ck: Checkpoint,
    batches: int,
    *,
    provider: str | None = HDFS_PROVIDER,
    file_sources: int = 1,
    committed: int | None = None,
) -> None:
    """A query's logs: batches 0..batches-1 planned (one file-source entry each), all
    committed unless ``committed`` says how many."""
    ck.add("metadata", json.dumps({"id": QUERY_ID}).encode())
    ck.add(".metadata.crc")
    for b in range(batches):
        ck.add(f"offsets/{b}", offsets_file([{"logOffset": b}] * file_sources, provider))
        ck.add(f"offsets/.{b}.crc")
        if committed is None or b < committed:
            ck.add(f"commits/{b}", commit_file())
        for i in range(file_sources):
            ck.add(f"sources/{i}/{b}", b'v1\n{"path":"file:///in/f","batchId":0}')


def hdfs_store(
    ck: Checkpoint, directory: str, versions: int, snapshots: tuple[int, ...] = ()
) -> None:
    for v in range(1, versions + 1):
        ck.add(f"{directory}/{v}.delta", b"d" * v)
        ck.add(f"{directory}/.{v}.delta.crc")
    for v in snapshots:
        ck.add(f"{directory}/{v}.snapshot", b"s" * v)


def rocks_zip(ssts: Sequence[tuple[str, int]], logs: Sequence[tuple[str, int]] = ()) -> bytes:
    meta: dict[str, Any] = {
        "sstFiles": [
            {"localFileName": n.split("-")[0] + ".sst", "dfsSstFileName": n, "sizeBytes": s}
            for n, s in ssts
        ],
        "numKeys": 1,
    }
    if logs:
        meta["logFiles"] = [
            {"localFileName": n.split("-")[0] + ".log", "dfsLogFileName": n, "sizeBytes": s}
            for n, s in logs
        ]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("CURRENT", "MANIFEST-000005\n")
        z.writestr("metadata", "v1\n" + json.dumps(meta))
    return out.getvalue()


def rocks_snapshot(ck: Checkpoint, directory: str, name: str, sst_names: list[str]) -> None:
    """``name`` (``<v>.zip`` or ``<v>_<id>.zip``) naming SSTs of ``directory``/SSTs."""
    for sst in sst_names:
        ck.add(f"{directory}/SSTs/{sst}", b"t" * 10)
    ck.add(f"{directory}/{name}", rocks_zip([(s, 10) for s in sst_names]))


def paths(cut: Cut, role: Role | None = None) -> list[str]:
    return [f.path for f in cut.files if role is None or f.role == role]


def state_paths(cut: Cut) -> list[str]:
    return [f.path for f in cut.files if f.path.startswith("state/")]


def refused(ck: Checkpoint, batch: int) -> CutError:
    with pytest.raises(CutError) as caught:
        ck.cut(batch)
    return caught.value


# -- the logs -----------------------------------------------------------------------------


def test_a_stateless_cut_is_the_logs_up_to_n_and_nothing_later() -> None:
    ck = Checkpoint()
    query(ck, 6, committed=5)  # batch 5 planned (offsets/5, its source entry), not committed
    ck.add("offsets/.3.5c1a2b.tmp")
    cut = ck.cut(3)
    assert cut.query_id == QUERY_ID and cut.batch == 3 and cut.checkpoint_format == 1
    assert paths(cut) == [
        "commits/0",
        "commits/1",
        "commits/2",
        "commits/3",
        "metadata",
        "offsets/0",
        "offsets/1",
        "offsets/2",
        "offsets/3",
        "sources/0/0",
        "sources/0/1",
        "sources/0/2",
        "sources/0/3",
    ]
    roles = {f.path: f.role for f in cut.files}
    assert roles["metadata"] == Role.METADATA and roles["offsets/3"] == Role.OFFSETS
    assert roles["commits/0"] == Role.COMMITS and roles["sources/0/2"] == Role.SOURCE_LOG
    assert cut.stores == () and cut.ignored == ()
    listed = {f.path: f for f in ck.listing()}
    assert all(f.size == listed[f.path].size and f.stamp == listed[f.path].stamp for f in cut.files)
    assert cut.total_bytes == sum(len(ck.files[p]) for p in paths(cut))


def test_a_batch_not_committed_yet_is_refused_as_such() -> None:
    ck = Checkpoint()
    query(ck, 6, committed=5)
    for batch in (5, 9):  # planned but running; not even planned
        error = refused(ck, batch)
        assert error.reason == "not_committed"
        assert "newest committed batch is 4" in str(error)


def test_a_batch_whose_logs_spark_has_purged_is_refused_as_missing() -> None:
    ck = Checkpoint()
    query(ck, 8)
    ck.remove("commits/1")
    assert refused(ck, 1).reason == "missing_file"
    ck.remove("offsets/2")  # a restart from 3 reads offsets/2 as well as offsets/3
    error = refused(ck, 3)
    assert error.reason == "missing_file" and "offsets/2" in str(error)
    assert [p for p in paths(ck.cut(4)) if p.startswith("offsets/")] == [
        "offsets/0",
        "offsets/1",
        "offsets/3",
        "offsets/4",
    ]


def test_batch_zero_needs_no_earlier_offsets() -> None:
    ck = Checkpoint()
    query(ck, 1)
    assert paths(ck.cut(0), Role.OFFSETS) == ["offsets/0"]


def test_no_metadata_or_a_damaged_one_is_refused() -> None:
    ck = Checkpoint()
    query(ck, 2)
    ck.add("metadata", b"not json")
    assert refused(ck, 1).reason == "unreadable"
    ck.remove("metadata")
    error = refused(ck, 1)
    assert error.reason == "missing_file" and "not a Spark checkpoint" in str(error)
    with pytest.raises(ValueError):
        ck.cut(-1)


def test_a_damaged_offsets_file_is_unreadable() -> None:
    ck = Checkpoint()
    query(ck, 3)
    ck.add("offsets/2", b"v1\n{}")
    assert refused(ck, 2).reason == "unreadable"


def test_a_file_gone_between_the_listing_and_its_read_is_missing() -> None:
    ck = Checkpoint()
    query(ck, 3)
    listing = ck.listing()
    del ck.files["offsets/2"]
    with pytest.raises(CutError) as caught:
        cut_of(listing, ck.read, 2)
    assert caught.value.reason == "missing_file" and "went away" in str(caught.value)


def test_unknown_files_are_ignored_and_reported_never_copied() -> None:
    ck = Checkpoint()
    query(ck, 3)
    ck.add("notes.txt")
    ck.add("offsets/readme")
    ck.add("sources/0/.2.crc")
    ck.add("sources/0/2.crc")  # Spark's own checksum: not copied, not reported either
    cut = ck.cut(2)
    assert cut.ignored == ("notes.txt", "offsets/readme")
    assert not [p for p in paths(cut) if p.endswith(".crc") or "readme" in p or "notes" in p]


# -- sources ------------------------------------------------------------------------------


def test_a_file_source_log_is_kept_up_to_the_entry_offsets_n_points_at() -> None:
    ck = Checkpoint()
    query(ck, 2, file_sources=0)
    ck.add("offsets/1", offsets_file([{"logOffset": 12}]))
    # compacted every 10 entries: 9.compact holds 0..9; 0..8 deleted by Spark's cleanup
    for e in (9, 19):
        ck.add(f"sources/0/{e}.compact")
    for e in (10, 11, 12, 13, 14, 15, 16, 17, 18, 20):
        ck.add(f"sources/0/{e}")
    assert paths(ck.cut(1), Role.SOURCE_LOG) == [
        "sources/0/10",
        "sources/0/11",
        "sources/0/12",
        "sources/0/9.compact",
    ]
    ck.remove("sources/0/11")  # after the last compaction ≤ 12: needed
    error = refused(ck, 1)
    assert error.reason == "missing_file" and "sources/0/11" in str(error)
    ck.add("sources/0/11")
    ck.remove("sources/0/9.compact")  # without it, 0..9 are needed
    assert refused(ck, 1).reason == "missing_file"


def test_a_file_source_log_is_whole_before_its_first_compaction() -> None:
    ck = Checkpoint()
    query(ck, 4)
    ck.remove("sources/0/1")
    error = refused(ck, 3)
    assert error.reason == "missing_file" and "sources/0/1" in str(error)


def test_other_sources_keep_their_directory_and_a_source_without_offset_keeps_nothing() -> None:
    ck = Checkpoint()
    query(ck, 3, file_sources=0)
    kafka = {"orders": {"0": 42, "1": 7}}
    for b in range(3):
        ck.add(f"offsets/{b}", offsets_file([kafka, None]))
    ck.add("sources/0/0", b"v1\n{initial offsets}")
    ck.add("sources/1/0")  # source 1 has no offset in batch 2: this entry is a later batch's
    cut = ck.cut(2)
    assert paths(cut, Role.SOURCE_LOG) == ["sources/0/0"]
    assert cut.ignored == ()


def test_named_sources_of_a_v2_offsets_log_keep_their_named_directories() -> None:
    ck = Checkpoint()
    query(ck, 2, file_sources=0)
    for b in range(2):
        ck.add(f"offsets/{b}", offsets_file([{"logOffset": b}], names=["orders"]))
        ck.add(f"sources/orders/{b}")
    assert paths(ck.cut(1), Role.SOURCE_LOG) == ["sources/orders/0", "sources/orders/1"]


# -- HDFS-backed state store --------------------------------------------------------------


def test_hdfs_without_snapshot_is_every_delta_up_to_n_plus_1() -> None:
    ck = Checkpoint()
    query(ck, 7)  # batch 6 committed: state version 7 written
    for p in (0, 1):
        hdfs_store(ck, f"state/0/{p}", 7)
        ck.add(f"state/0/{p}/.7.delta.3f2a.tmp")
    ck.add("state/0/0/_metadata/schema")
    cut = ck.cut(4)  # loads version 5
    assert state_paths(cut) == [
        *(f"state/0/0/{v}.delta" for v in range(1, 6)),
        "state/0/0/_metadata/schema",
        *(f"state/0/1/{v}.delta" for v in range(1, 6)),
    ]
    assert [
        (s.partition, s.store, s.provider, s.version, s.base, s.replayed) for s in cut.stores
    ] == [
        (0, "default", "hdfs", 5, 0, 5),
        (1, "default", "hdfs", 5, 0, 5),
    ]
    assert {f.role for f in cut.files if f.path.endswith(".delta")} == {Role.DELTA}
    assert [f.role for f in cut.files if f.path.endswith("schema")] == [Role.STATE_SCHEMA]


def test_hdfs_takes_the_newest_snapshot_at_or_below_n_plus_1_and_the_deltas_after() -> None:
    ck = Checkpoint()
    query(ck, 9)
    hdfs_store(ck, "state/0/0", 9, snapshots=(3, 6, 8))
    cut = ck.cut(6)  # version 7: snapshot 6 (8 is a later batch's), delta 7
    assert state_paths(cut) == ["state/0/0/6.snapshot", "state/0/0/7.delta"]
    assert [f.role for f in cut.files if f.path.startswith("state/")] == [Role.SNAPSHOT, Role.DELTA]
    assert state_paths(ck.cut(7)) == ["state/0/0/8.snapshot"]  # version 8: the snapshot alone
    assert cut.stores[0].base == 6 and cut.stores[0].replayed == 1


def test_hdfs_with_a_delta_gone_is_refused() -> None:
    ck = Checkpoint()
    query(ck, 9)
    hdfs_store(ck, "state/0/0", 9, snapshots=(3,))
    ck.remove("state/0/0/5.delta")
    error = refused(ck, 5)
    assert error.reason == "missing_file" and "state/0/0/5.delta" in str(error)
    # maintenance deleted the old files: a cut of an old batch is refused, a newer one works
    for v in (1, 2):
        ck.remove(f"state/0/0/{v}.delta")
    assert refused(ck, 1).reason == "missing_file"
    ck.add("state/0/0/5.delta")
    assert state_paths(ck.cut(4)) == [
        "state/0/0/3.snapshot",
        "state/0/0/4.delta",
        "state/0/0/5.delta",
    ]


def test_a_partition_without_its_files_is_refused() -> None:
    ck = Checkpoint()
    query(ck, 4)
    hdfs_store(ck, "state/0/0", 4)
    hdfs_store(ck, "state/0/1", 4)
    ck.add(
        "state/0/_metadata/metadata",
        b'v1\n{"operatorInfo":{"operatorId":0,"operatorName":"stateStoreSave"},'
        b'"stateStoreInfo":[{"storeName":"default","numColsPrefixKey":0,"numPartitions":3}]}',
    )
    error = refused(ck, 3)  # the metadata says 3 partitions: partition 2 has no file
    assert error.reason == "missing_file" and "partition 2" in str(error)
    hdfs_store(ck, "state/0/2", 4)
    cut = ck.cut(3)
    assert [s.partition for s in cut.stores] == [0, 1, 2]
    assert "state/0/_metadata/metadata" in paths(cut, Role.OPERATOR_METADATA)


def test_damaged_operator_metadata_is_unreadable() -> None:
    ck = Checkpoint()
    query(ck, 2)
    hdfs_store(ck, "state/0/0", 2)
    ck.add("state/0/_metadata/metadata", b"v1\n{nope")
    assert refused(ck, 1).reason == "unreadable"


def test_the_provider_comes_from_the_offsets_log_and_a_custom_one_is_unsupported() -> None:
    ck = Checkpoint()
    query(ck, 3, provider="com.example.MyStateStoreProvider")
    hdfs_store(ck, "state/0/0", 3)
    assert refused(ck, 2).reason == "unsupported"
    query(ck, 3, provider=None)  # no recorded provider: the files say HDFS
    assert ck.cut(2).stores[0].provider == "hdfs"
    query(ck, 3, provider=ROCKSDB_PROVIDER)  # RocksDB recorded: its files are wanted
    assert refused(ck, 2).reason == "missing_file"


# -- RocksDB state store ------------------------------------------------------------------


def test_rocksdb_takes_the_zip_of_n_plus_1_and_exactly_the_ssts_it_names() -> None:
    ck = Checkpoint()
    query(ck, 5, provider=ROCKSDB_PROVIDER)
    d = "state/0/0"
    for v in range(1, 6):
        rocks_snapshot(ck, d, f"{v}.zip", [f"00000{v}-u{v}.sst", "000001-u1.sst"])
    cut = ck.cut(2)  # version 3
    assert state_paths(cut) == [
        "state/0/0/3.zip",
        "state/0/0/SSTs/000001-u1.sst",
        "state/0/0/SSTs/000003-u3.sst",
    ]
    assert [f.role for f in cut.files if f.path.startswith("state/")] == [
        Role.ZIP,
        Role.SST,
        Role.SST,
    ]
    assert cut.stores[0].provider == "rocksdb" and cut.stores[0].base == 3
    assert "state/0/0/3.zip" in ck.reads and "state/0/0/4.zip" not in ck.reads


def test_rocksdb_archived_logs_named_by_the_zip_are_kept() -> None:
    ck = Checkpoint()
    query(ck, 2, provider=ROCKSDB_PROVIDER)
    ck.add("state/0/0/SSTs/000008-a.sst", b"t" * 5)
    ck.add("state/0/0/logs/000009-b.log", b"l" * 7)
    ck.add("state/0/0/logs/000004-old.log", b"l")
    ck.add("state/0/0/2.zip", rocks_zip([("000008-a.sst", 5)], [("000009-b.log", 7)]))
    cut = ck.cut(1)
    assert paths(cut, Role.ROCKSDB_LOG) == ["state/0/0/logs/000009-b.log"]
    assert cut.ignored == ()


def test_rocksdb_an_sst_missing_or_of_another_size_is_refused_without_changelogs() -> None:
    ck = Checkpoint()
    query(ck, 3, provider=ROCKSDB_PROVIDER)
    rocks_snapshot(ck, "state/0/0", "3.zip", ["000010-a.sst"])
    ck.add("state/0/0/SSTs/000010-a.sst", b"t" * 9)
    error = refused(ck, 2)
    assert error.reason == "missing_file" and "has 9 bytes" in str(error)
    ck.remove("state/0/0/SSTs/000010-a.sst")
    error = refused(ck, 2)
    assert error.reason == "missing_file" and "is not in the listing" in str(error)


def test_rocksdb_changelogs_after_the_newest_zip_at_or_below_n_plus_1() -> None:
    ck = Checkpoint()
    query(ck, 9, provider=ROCKSDB_PROVIDER)
    d = "state/0/0"
    for v in range(1, 10):
        ck.add(f"{d}/{v}.changelog", b"c" * v)
    for v in (2, 4, 8):
        rocks_snapshot(ck, d, f"{v}.zip", [f"0000{v}-u.sst"])
    cut = ck.cut(6)  # version 7: zip 4, changelogs 5..7; zip 8 is a later batch's
    assert state_paths(cut) == [
        f"{d}/4.zip",
        f"{d}/5.changelog",
        f"{d}/6.changelog",
        f"{d}/7.changelog",
        f"{d}/SSTs/00004-u.sst",
    ]
    assert (cut.stores[0].base, cut.stores[0].replayed) == (4, 3)
    cut = ck.cut(0)  # version 1: no zip yet, its changelog replayed on empty state
    assert state_paths(cut) == [f"{d}/1.changelog"]
    assert (cut.stores[0].base, cut.stores[0].replayed) == (0, 1)


def test_rocksdb_falls_back_to_an_older_zip_when_the_newest_ones_ssts_are_not_listed() -> None:
    ck = Checkpoint()
    query(ck, 6, provider=ROCKSDB_PROVIDER)
    d = "state/0/0"
    for v in range(1, 7):
        ck.add(f"{d}/{v}.changelog")
    rocks_snapshot(ck, d, "2.zip", ["000002-a.sst"])
    rocks_snapshot(ck, d, "5.zip", ["000005-b.sst"])
    ck.remove(f"{d}/SSTs/000005-b.sst")  # being uploaded (or deleted) as the listing ran
    cut = ck.cut(5)  # version 6: zip 5 unusable; zip 2 and changelogs 3..6
    assert state_paths(cut) == [
        f"{d}/2.zip",
        f"{d}/3.changelog",
        f"{d}/4.changelog",
        f"{d}/5.changelog",
        f"{d}/6.changelog",
        f"{d}/SSTs/000002-a.sst",
    ]
    assert f"{d}/5.zip" not in paths(cut)  # Spark restarted from the cut loads zip 2
    ck.add(f"{d}/5.zip", b"PK damaged")
    assert ck.cut(5).stores[0].base == 2
    ck.remove(f"{d}/3.changelog")  # and no way around it: the first problem is told
    error = refused(ck, 5)
    assert error.reason == "unreadable" and "5.zip" in str(error)


# -- checkpoint format v2 -----------------------------------------------------------------


def v2_query(
    ck: Checkpoint, batches: int, stores: int = 1, snapshots: tuple[int, ...] = ()
) -> None:
    """Operator 0, 2 partitions, ``stores`` stores each; batch b commits version b+1 with id
    ``i<b+1>p<p>s<s>``; a failed attempt left ``<v>_retry.changelog`` files beside them."""
    query(ck, batches, provider=ROCKSDB_PROVIDER)
    names = ["default"] if stores == 1 else list(JOIN_STORES)
    for b in range(batches):
        v = b + 1
        ck.add(
            f"commits/{b}",
            commit_file({0: [[f"i{v}p{p}s{s}" for s in range(stores)] for p in range(2)]}),
        )
        for p in range(2):
            for s, name in enumerate(names):
                d = f"state/0/{p}" if stores == 1 else f"state/0/{p}/{name}"
                ck.add(f"{d}/{v}_i{v}p{p}s{s}.changelog")
                ck.add(f"{d}/{v}_0000-retry.changelog")
                if v in snapshots:
                    rocks_snapshot(ck, d, f"{v}_i{v}p{p}s{s}.zip", [f"00{v}-p{p}s{s}.sst"])


def test_v2_follows_the_ids_the_commit_log_names_back_to_the_snapshot() -> None:
    ck = Checkpoint()
    v2_query(ck, 8, snapshots=(3, 7))
    cut = ck.cut(5)  # version 6: commits/5 names i6; zip of version 3 (i3), changelogs 4..6
    assert cut.checkpoint_format == 2
    assert state_paths(cut) == [
        "state/0/0/3_i3p0s0.zip",
        "state/0/0/4_i4p0s0.changelog",
        "state/0/0/5_i5p0s0.changelog",
        "state/0/0/6_i6p0s0.changelog",
        "state/0/0/SSTs/003-p0s0.sst",
        "state/0/1/3_i3p1s0.zip",
        "state/0/1/4_i4p1s0.changelog",
        "state/0/1/5_i5p1s0.changelog",
        "state/0/1/6_i6p1s0.changelog",
        "state/0/1/SSTs/003-p1s0.sst",
    ]
    assert [s.unique_id for s in cut.stores] == ["i6p0s0", "i6p1s0"]
    assert not [p for p in paths(cut) if "retry" in p]
    assert state_paths(ck.cut(6))[0:2] == ["state/0/0/7_i7p0s0.zip", "state/0/0/SSTs/007-p0s0.sst"]
    assert state_paths(ck.cut(1)) == [  # no snapshot: version 1 and 2 replayed on empty state
        "state/0/0/1_i1p0s0.changelog",
        "state/0/0/2_i2p0s0.changelog",
        "state/0/1/1_i1p1s0.changelog",
        "state/0/1/2_i2p1s0.changelog",
    ]


def test_v2_needs_the_commits_of_the_chain() -> None:
    ck = Checkpoint()
    v2_query(ck, 8, snapshots=(3,))
    ck.remove("commits/4")  # names version 5's ids, between the snapshot (3) and version 7
    error = refused(ck, 6)
    assert error.reason == "missing_file" and "commits/4" in str(error)


def test_v2_where_retention_deleted_the_commits_an_earlier_snapshots_ids_stand_in() -> None:
    """Spark's retention (minBatchesToRetain) deletes commits/ while the newest zip is older:
    the cut then takes the ids an earlier snapshot of the same timeline held (its files), and
    says so (``hinted``: the upload checks the new snapshot follows that one)."""
    ck = Checkpoint()
    v2_query(ck, 12, snapshots=(3,))
    earlier = ck.cut(7)  # versions 3 (zip) .. 8, while their commits are kept
    for b in range(0, 8):  # retention: commits 0..7 gone (they name versions 1..8)
        ck.remove(f"commits/{b}")
    error = refused(ck, 10)  # without hints: as before
    assert error.reason == "missing_file" and "commits/7" in str(error)
    hints = v2_ids(f.path for f in earlier.files)
    assert hints["state/0/0"] == {v: f"i{v}p0s0" for v in range(3, 9)}
    cut = cut_of(ck.listing(), ck.read, 10, hints)  # 9..11 by their commits, 3..8 by hints
    assert cut.hinted
    assert sorted(p for p in state_paths(cut) if p.startswith("state/0/0/")) == sorted(
        [f"state/0/0/{v}_i{v}p0s0.changelog" for v in range(4, 12)]
        + ["state/0/0/3_i3p0s0.zip", "state/0/0/SSTs/003-p0s0.sst"]
    )
    assert not [p for p in paths(cut) if "retry" in p]
    # Every commit it needs kept: the hints are not used, and the cut says so.


def test_v2_a_version_with_no_file_for_its_id_is_refused() -> None:
    ck = Checkpoint()
    v2_query(ck, 4)
    ck.remove("state/0/1/4_i4p1s0.changelog")
    error = refused(ck, 3)
    assert error.reason == "missing_file" and "commits/3" in str(error)


def test_v2_ids_for_an_hdfs_store_are_unsupported() -> None:
    ck = Checkpoint()
    query(ck, 2)
    hdfs_store(ck, "state/0/0", 2)
    ck.add("commits/1", commit_file({0: [["abc"]]}))
    assert refused(ck, 1).reason == "unsupported"


def test_v2_ids_for_an_operator_with_no_state_directory_are_refused() -> None:
    ck = Checkpoint()
    query(ck, 2, provider=ROCKSDB_PROVIDER)
    ck.add("commits/1", commit_file({3: [["abc"]]}))
    error = refused(ck, 1)
    assert error.reason == "missing_file" and "state/3" in str(error)


# -- several stores per partition ---------------------------------------------------------


def test_a_join_keeps_every_store_of_every_partition() -> None:
    ck = Checkpoint()
    query(ck, 4, file_sources=2)
    for p in (0, 1):
        for store in JOIN_STORES:
            hdfs_store(ck, f"state/0/{p}/{store}", 4, snapshots=(2,))
            ck.add(f"state/0/{p}/{store}/_metadata/schema")
    cut = ck.cut(2)  # version 3: snapshot 2 and delta 3 of each of 8 stores
    assert [(s.partition, s.store) for s in cut.stores] == [
        (p, store) for p in (0, 1) for store in JOIN_STORES
    ]
    assert len(state_paths(cut)) == 8 * 3
    assert "state/0/1/right-keyWithIndexToValue/3.delta" in state_paths(cut)
    assert paths(cut, Role.SOURCE_LOG) == [f"sources/{i}/{b}" for i in (0, 1) for b in range(3)]
    # one store of one partition lost its files: a restart would fail, so the cut does
    for v in range(1, 5):
        ck.remove(f"state/0/1/left-keyToNumValues/{v}.delta")
    ck.remove("state/0/1/left-keyToNumValues/2.snapshot")
    error = refused(ck, 2)
    assert error.reason == "missing_file" and "left-keyToNumValues" in str(error)


def test_a_v2_join_matches_each_stores_id_whatever_the_order() -> None:
    ck = Checkpoint()
    v2_query(ck, 3, stores=4, snapshots=(2,))
    cut = ck.cut(2)
    assert [s.unique_id for s in cut.stores if s.partition == 1] == [f"i3p1s{s}" for s in range(4)]
    assert "state/0/1/right-keyToNumValues/2_i2p1s2.zip" in state_paths(cut)


# -- Spark 4's operator metadata and schemas ----------------------------------------------


def test_operator_metadata_v2_and_state_schemas_up_to_n() -> None:
    ck = Checkpoint()
    query(ck, 6, provider=ROCKSDB_PROVIDER)
    for v in range(1, 7):
        ck.add(f"state/0/0/{v}.changelog")
    meta = b'v2\n{"operatorInfo":{"operatorId":0,"operatorName":"transformWithStateExec"},'
    meta += b'"stateStoreInfo":[{"storeName":"default","numColsPrefixKey":0,"numPartitions":1,'
    meta += b'"stateSchemaFilePath":"x"}],"operatorPropertiesJson":"{}"}'
    for b in (0, 4):
        ck.add(f"state/0/_metadata/v2/{b}", meta)
        ck.add(f"state/0/_stateSchema/default/{b}_5d1e.schema-id")
    cut = ck.cut(3)
    assert paths(cut, Role.OPERATOR_METADATA) == ["state/0/_metadata/v2/0"]
    assert paths(cut, Role.STATE_SCHEMA) == ["state/0/_stateSchema/default/0_5d1e.schema-id"]
    assert cut.ignored == ()
    assert "state/0/_metadata/v2/4" in paths(ck.cut(4))


# -- nothing of a later batch, on any history ---------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    versions=st.integers(min_value=1, max_value=25),
    snapshot_every=st.integers(min_value=1, max_value=6),
    rocksdb=st.booleans(),
    batch_fraction=st.floats(min_value=0, max_value=1),
)
def test_the_cut_holds_the_load_path_of_n_plus_1_and_nothing_later(
    versions: int, snapshot_every: int, rocksdb: bool, batch_fraction: float
) -> None:
    ck = Checkpoint()
    query(ck, versions, provider=ROCKSDB_PROVIDER if rocksdb else HDFS_PROVIDER)
    d = "state/0/0"
    snapshots = [v for v in range(1, versions + 1) if v % snapshot_every == 0]
    for v in range(1, versions + 1):
        ck.add(f"{d}/{v}.{'changelog' if rocksdb else 'delta'}")
        if v in snapshots:
            if rocksdb:
                rocks_snapshot(ck, d, f"{v}.zip", [f"{v:06d}-u.sst"])
            else:
                ck.add(f"{d}/{v}.snapshot")
    batch = min(versions - 1, int(batch_fraction * versions))
    cut = ck.cut(batch)
    v = batch + 1
    base = max((s for s in snapshots if s <= v), default=0)
    step = "changelog" if rocksdb else "delta"
    expected = [f"{d}/{x}.{step}" for x in range(base + 1, v + 1)]
    if base:
        expected += [f"{d}/{base}.{'zip' if rocksdb else 'snapshot'}"]
        expected += [f"{d}/SSTs/{base:06d}-u.sst"] if rocksdb else []
    assert sorted(state_paths(cut)) == sorted(expected)
    for f in cut.files:
        if f.role == Role.METADATA:
            continue
        name = f.path.rpartition("/")[2]
        number = int(name.split(".")[0].split("-")[0])
        limit = v if f.path.startswith("state/") else batch
        assert number <= limit, f"{f.path} is of a later batch than {batch}"


# -- a listing of names: only what the cut keeps or reads is stat-ed --------------------------


def test_a_cut_from_names_stats_only_the_files_it_keeps_or_reads_each_once() -> None:
    # 20 retained batches, 8 partitions with 20 state versions each and a snapshot at 16:
    # the cut of batch 18 keeps snapshot 16 and deltas 17-19 of each partition, and the
    # logs; a listing that stats every file pays for all the deltas and checksums too.
    ck = Checkpoint()
    query(ck, 20)
    for p in range(8):
        hdfs_store(ck, f"state/0/{p}", 20, snapshots=(8, 16))
    stated: list[str] = []

    def stat(path: str) -> ListedFile:
        stated.append(path)
        return ListedFile(path, len(ck.files[path]), f"stamp-{path}")

    cut = cut_of_names(list(ck.files), ck.read, stat, 18)
    read = set(ck.reads)
    assert cut == ck.cut(18)  # the very cut a listing with every stat gives
    assert len(stated) == len(set(stated))  # each once
    assert set(stated) == set(paths(cut)) | read
    assert read <= set(stated)
    # 3 x 19 logs (offsets, commits, the source's entries) + metadata + 8 x 4 state files,
    # of 418 listed
    assert len(stated) == 90 and len(ck.files) == 418


def test_a_file_gone_between_the_listing_of_names_and_its_stat_is_missing() -> None:
    ck = Checkpoint()
    query(ck, 4)
    hdfs_store(ck, "state/0/0", 4)
    names = list(ck.files)
    ck.remove("state/0/0/2.delta")  # Spark's maintenance, after the listing

    def stat(path: str) -> ListedFile:
        if path not in ck.files:
            raise FileNotFoundError(path)
        return ListedFile(path, len(ck.files[path]), "")

    with pytest.raises(CutError) as caught:
        cut_of_names(names, ck.read, stat, 2)
    assert caught.value.reason == "missing_file" and "state/0/0/2.delta" in str(caught.value)
