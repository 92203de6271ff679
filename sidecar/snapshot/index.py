"""What a snapshot is in the store: its blobs' names and its index, the format. Pure.

Restic's design, for Spark checkpoints (``docs/snapshots.md``): file contents are stored once,
recognised by their SHA-256 (under checkpoint v1 a re-run batch can rewrite a state file under
the same name, so a name is not an identity), many of them together in **pack** blobs (each
found by offset and length), so a snapshot costs a request per few MiB of *new* bytes, not one
per file; a snapshot's **index**, written last, lists every file of its cut with where its
bytes are, their size and sums (the SHA-256, and the CRC-32C a restore checks). Anything no
kept index names is garbage (mark and sweep, after a grace period:
``sidecar.snapshot.retention``).

Blobs, in the checkpoint container, beside the query's checkpoint blob::

    <namespace>/snapshots/<query id>/packs/<pack id>             contents, concatenated
    <namespace>/snapshots/<query id>/index/<batch>-<snapshot id>  the index (zlib, msgpack;
                                                                  batch: 20 digits)

Names sort by batch; a pack id and a snapshot id are random (uuid4 hex): immutable blobs,
written once (``If-None-Match: *``). The index holds, besides the files: the batch, the
checkpoint location it was taken from (relative to ``SIDECAR_SNAPSHOT_ROOT``: where
``restore --all`` puts it back) and each pack it uses with its size (for prune's accounting of
dead bytes). The query's checkpoint document names the newest snapshot
(``CheckpointDocument.snapshot``), as of its last write.
"""

from __future__ import annotations

import re
import uuid
import zlib
from datetime import UTC, datetime

import msgspec

from sidecar.errors import CorruptRecord
from sidecar.model.document import SnapshotRef

__all__ = ["SnapshotRef"]  # the document's name for a snapshot, re-exported here

#: The index format this code writes and reads.
INDEX_FORMAT = 1
#: The folder of a query's snapshots, under its namespace.
SNAPSHOTS = "snapshots"
_INDEX_NAME = re.compile(r"(\d{20})-([0-9a-f]{32})")
_ID = re.compile(r"[0-9a-f]{32}")


class FileEntry(msgspec.Struct, frozen=True, array_like=True):
    """One file of a snapshot: where its bytes are, and what they are."""

    #: Relative to the checkpoint location, ``/``-separated.
    path: str
    size: int
    #: SHA-256 of its bytes (32 bytes); the content's identity.
    sha256: bytes
    #: The pack holding its bytes ("" for an empty file: no bytes anywhere).
    pack: str
    offset: int
    #: CRC-32C of its bytes: what a restore checks them by (``sidecar.snapshot.crc``). None
    #: in an index written before it was kept, or where CRC-32C is slow: the SHA-256 then.
    #: Last and optional: an index without it reads the same, and older readers skip it.
    crc32c: int | None = None


class SnapshotIndex(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot: a consistent cut of one query's checkpoint at one batch."""

    format: int = INDEX_FORMAT
    query_id: str
    batch: int
    id: str
    #: When it was written (UTC, ISO 8601).
    created_at: str
    #: The checkpoint location it was cut from, relative to the snapshot root.
    location: str
    #: 1, or 2 when the commit log names state store ids (``sidecar.snapshot.cut``).
    checkpoint_format: int = 1
    files: tuple[FileEntry, ...]
    #: Every pack a file's bytes are in → that pack's size.
    packs: dict[str, int]
    #: Bytes of the files first uploaded by this snapshot (the rest were reused).
    new_bytes: int = 0
    #: Its lineage (``sidecar.snapshot.lineage``): the snapshot it follows — the newest one
    #: whose ``offsets/`` and ``commits/`` file of its batch this cut holds identical — and
    #: the timeline it is on. None in an index written before lineage was kept (and a
    #: parent of None: none provable, a first snapshot or one after a gap).
    parent: str | None = None
    timeline: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def new_id() -> str:
    """A snapshot's or a pack's id."""
    return uuid.uuid4().hex


def now_text() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def prefix(namespace: str, query_id: str) -> str:
    """Every blob of the query's snapshots starts with this."""
    return f"{namespace}/{SNAPSHOTS}/{query_id}/"


def all_prefix(namespace: str) -> str:
    """Every snapshot blob of the namespace starts with this."""
    return f"{namespace}/{SNAPSHOTS}/"


def pack_name(namespace: str, query_id: str, pack_id: str) -> str:
    return f"{prefix(namespace, query_id)}packs/{pack_id}"


def index_name(namespace: str, query_id: str, batch: int, snapshot_id: str) -> str:
    return f"{prefix(namespace, query_id)}index/{batch:020d}-{snapshot_id}"


def parse_index_name(name: str) -> tuple[int, str] | None:
    """(batch, snapshot id) of an index blob's name (its last part); None if not one."""
    match = _INDEX_NAME.fullmatch(name.rsplit("/", 1)[-1])
    return (int(match.group(1)), match.group(2)) if match else None


def parse_pack_name(name: str) -> str | None:
    """The pack id of a pack blob's name; None if not one."""
    parts = name.rsplit("/", 2)
    if len(parts) == 3 and parts[1] == "packs" and _ID.fullmatch(parts[2]):
        return parts[2]
    return None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SnapshotIndex)


def encode_index(index: SnapshotIndex) -> bytes:
    """The index blob's body."""
    return zlib.compress(_encoder.encode(index), 6)


def decode_index(body: bytes, name: str) -> SnapshotIndex:
    """An index blob's body, checked.

    Raises:
        CorruptRecord: not an index of this format (cut short, another version's).
    """
    try:
        index = _decoder.decode(zlib.decompress(body))
    except (zlib.error, msgspec.DecodeError) as exc:
        raise CorruptRecord("blob", name, f"is not a snapshot index ({exc})") from exc
    if index.format != INDEX_FORMAT:
        raise CorruptRecord(
            "blob",
            name,
            f"is a snapshot index of format {index.format}, which this checkpoint-sidecar "
            f"does not read (it reads {INDEX_FORMAT}): run the version that wrote it",
        )
    for f in index.files:
        if (
            len(f.sha256) != 32
            or f.size < 0
            or (f.size and f.pack not in index.packs)
            or (f.crc32c is not None and not 0 <= f.crc32c < 1 << 32)
        ):
            raise CorruptRecord("blob", name, f"has an unreadable entry for {f.path!r}")
    return index
