"""The snapshot index's format (sidecar/snapshot/index.py): what older and newer writers' index
blobs read as."""

from __future__ import annotations

import hashlib
import zlib

import msgspec
import pytest

from sidecar.errors import CorruptRecord
from sidecar.snapshot.index import FileEntry, SnapshotIndex, decode_index, encode_index

SHA = hashlib.sha256(b"x").digest()


def index_of(*files: FileEntry) -> SnapshotIndex:
    return SnapshotIndex(
        query_id="q",
        batch=3,
        id="a" * 32,
        created_at="2026-11-27T00:00:00.000+00:00",
        location="",
        files=files,
        packs={"p": 100},
    )


def test_an_index_written_before_crcs_were_kept_reads_with_none() -> None:
    class OldEntry(msgspec.Struct, frozen=True, array_like=True):  # the format as it was
        path: str
        size: int
        sha256: bytes
        pack: str
        offset: int

    old = msgspec.structs.asdict(index_of())
    old["files"] = (OldEntry("state/0/0/1.delta", 1, SHA, "p", 7),)
    body = zlib.compress(msgspec.msgpack.encode(old))
    (entry,) = decode_index(body, "old").files
    assert entry == FileEntry("state/0/0/1.delta", 1, SHA, "p", 7, None)


def test_a_crc_round_trips_and_one_out_of_range_is_refused() -> None:
    entry = FileEntry("a", 1, SHA, "p", 0, 0xFFFFFFFF)
    assert decode_index(encode_index(index_of(entry)), "new").files == (entry,)
    for bad in (1 << 32, -1):
        body = encode_index(index_of(FileEntry("a", 1, SHA, "p", 0, bad)))
        with pytest.raises(CorruptRecord, match="unreadable entry for 'a'"):
            decode_index(body, "bad")
