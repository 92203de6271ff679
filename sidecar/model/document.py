"""The blob document: a query's checkpoint as stored in its blob, with who wrote it, the
history of earlier flushed checkpoints and the record of the last reset. Pure, no I/O.

The checkpoint itself (its fields, offsets kept as the client's JSON text) is
``sidecar.model.checkpoint``; this module adds what only the blob holds, and its format versions
(docs/blob-format.md). ``sidecar.store.blobs`` reads and writes these documents.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec

from sidecar.errors import CorruptRecord
from sidecar.model.checkpoint import (
    NULL,
    Checkpoint,
    Offset,
    SourceOffsets,
    offsets_error,
    source_offsets,
)

_encoder = msgspec.json.Encoder()

#: 2 added ``history``; version 1 documents (no history) are still read.
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)

#: Most bytes a document's ``history`` may take (its JSON). A history that would be larger is
#: thinned: the oldest entries are dropped until it fits (:func:`carry_history`). One entry is
#: about ``HISTORY_ENTRY_BYTES`` plus its end offsets' JSON (a Kafka partition with an offset
#: below 10^10 takes about 17 bytes), so ``min(SIDECAR_HISTORY_SIZE, HISTORY_MAX_BYTES //
#: entry)`` entries are kept: all 20 up to about 750 partitions per query.
HISTORY_MAX_BYTES = 256 * 1024
HISTORY_ENTRY_BYTES = 120


class Writer(msgspec.Struct, frozen=True):
    """Who wrote a checkpoint document."""

    host: str
    pid: int
    instance_id: str


class SnapshotRef(msgspec.Struct, frozen=True):
    """A checkpoint snapshot (``sidecar.snapshot``) as the document names it: its batch and id,
    and the timeline it is on (``sidecar.snapshot.lineage``: a rewind or restore starts a new
    one; None in a document written before timelines were kept)."""

    batch_id: int
    id: str
    timeline: str | None = None


def follows(ref: SnapshotRef | None, marker: SnapshotRef | None) -> bool:
    """Whether the document's marker may move from ``marker`` to ``ref``: a snapshot later on
    the marker's own timeline (a marker of no timeline, written before they were kept: any
    snapshot at least as new). A snapshot of another timeline never replaces it: only a reset
    (a rewind, a restore) moves a marker to another timeline."""
    if ref is None:
        return False
    if marker is None:
        return True
    if marker.timeline is not None and ref.timeline != marker.timeline:
        return False
    return ref.batch_id >= marker.batch_id


class HistoryEntry(msgspec.Struct, frozen=True):
    """An earlier flushed checkpoint of the query: enough to resume from it."""

    batch_id: int
    #: Spark's progress timestamp of that batch.
    timestamp: str
    #: When that checkpoint was written to the blob (UTC).
    written_at: str
    #: Each source's ``end_offset`` (its JSON text), in the order of the query's sources at
    #: the time.
    end_offsets: tuple[Offset, ...]


class CheckpointDocument(Checkpoint, frozen=True, omit_defaults=False):
    """The JSON document stored in a query's blob: the checkpoint's fields plus these.

    ``history``: the earlier flushed checkpoints (schema version 2), newest first, each
    older than ``batch_id``; empty in a version 1 document or with ``SIDECAR_HISTORY_SIZE=0``.

    ``reset_from``, ``reset_at``, ``reset_reason``: the query's last reset (``checkpoint-sidecar
    reset``): the batch the blob held before it (None: no document then), when (UTC) and why.
    Absent (None) until a reset; carried by every later write. Optional fields of version 2:
    older documents decode without them, older readers ignore them.

    ``snapshot``: the **marker** (Samza's state checkpoint marker): the snapshot of the query's
    state that belongs to the position this document records (its batch, id and timeline;
    ``sidecar.snapshot``). Flushes move it along its timeline to newer snapshots
    (:func:`follows`); a reset sets it (a rewind or restore to the snapshot it restored, a reset
    of offsets to none); ``restore`` follows it, never the newest snapshot. None: none.
    """

    schema_version: int
    checkpoint_id: str
    writer: Writer
    written_at: str
    history: tuple[HistoryEntry, ...] = ()
    reset_from: int | None = None
    reset_at: str | None = None
    reset_reason: str | None = None
    snapshot: SnapshotRef | None = None

    @classmethod
    def of(
        cls,
        checkpoint: Checkpoint,
        writer: Writer,
        history: tuple[HistoryEntry, ...] = (),
        *,
        reset_of: CheckpointDocument | None = None,
        snapshot: SnapshotRef | None = None,
    ) -> CheckpointDocument:
        """A new document (fresh checkpoint id, written now) for ``checkpoint``; the record of
        the last reset is carried from ``reset_of`` (the document it replaces), and so is its
        marker unless ``snapshot`` follows it (:func:`follows`)."""
        last = reset_of
        return cls(
            **msgspec.structs.asdict(checkpoint),
            schema_version=SCHEMA_VERSION,
            checkpoint_id=uuid.uuid4().hex,
            writer=writer,
            written_at=datetime.now(UTC).isoformat(timespec="milliseconds"),
            history=history,
            reset_from=last.reset_from if last else None,
            reset_at=last.reset_at if last else None,
            reset_reason=last.reset_reason if last else None,
            snapshot=_marker(snapshot, last.snapshot if last else None, checkpoint.batch_id),
        )

    def at_batch(self, batch_id: int) -> Checkpoint | None:
        """The retained checkpoint of ``batch_id`` (its own or one of its history) as a
        checkpoint: each source's end offset of that batch; None when not retained."""
        if batch_id == self.batch_id:
            return self.checkpoint()
        entry = next((e for e in self.retained() if e.batch_id == batch_id), None)
        if entry is None:
            return None
        sources = [
            SourceOffsets(
                self.sources[i].description if i < len(self.sources) else f"source {i}",
                NULL,
                end,
                NULL,
            )
            for i, end in enumerate(entry.end_offsets)
        ]
        return Checkpoint(
            self.query_id,
            self.run_id,
            self.name,
            batch_id,
            entry.timestamp,
            sources,
            stateful=self.stateful,
        )

    def checkpoint(self) -> Checkpoint:
        """The checkpoint alone, without the document's own fields (nor its history)."""
        return Checkpoint(**{f: getattr(self, f) for f in Checkpoint.__struct_fields__})

    def entry(self) -> HistoryEntry:
        """This document's own checkpoint as a history entry."""
        ends = tuple(s.end_offset for s in self.sources)
        return HistoryEntry(self.batch_id, self.timestamp, self.written_at, ends)

    def retained(self) -> list[HistoryEntry]:
        """Every checkpoint this document can resume from, newest first: its own, then its
        history (entries not older than its own batch, or repeated, are left out: a history
        edited by hand never offers a position newer than the document's)."""
        out = [self.entry()]
        for item in sorted(self.history, key=lambda h: h.batch_id, reverse=True):
            if item.batch_id < out[-1].batch_id:
                out.append(item)
        return out


def _marker(
    ref: SnapshotRef | None, marker: SnapshotRef | None, batch_id: int
) -> SnapshotRef | None:
    """The marker of a document of ``batch_id``: ``ref`` when it follows the one before and
    is not past the position the document records (a snapshot of a batch not flushed yet is
    named by a later write)."""
    return ref if follows(ref, marker) and ref is not None and ref.batch_id <= batch_id else marker


def carry_history(
    previous: CheckpointDocument | None, batch_id: int, size: int
) -> tuple[tuple[HistoryEntry, ...], int]:
    """The history of the document that replaces ``previous`` with ``batch_id``: ``previous``
    itself, then its own history, newest first, at most ``size`` entries older than
    ``batch_id``, within :data:`HISTORY_MAX_BYTES`. Also how many entries were dropped to fit
    that cap (0 when ``size`` alone decided)."""
    if previous is None or size <= 0:
        return (), 0
    # Copies of the offsets' text: a decoded document's point into the buffer it was read
    # from, which would otherwise stay alive for as long as the entry is carried.
    kept = [
        HistoryEntry(e.batch_id, e.timestamp, e.written_at, tuple(o.copy() for o in e.end_offsets))
        for e in previous.retained()
        if e.batch_id < batch_id
    ][:size]
    used, fits = 2, 0
    for e in kept:
        used += len(_encoder.encode(e)) + 1
        if used > HISTORY_MAX_BYTES:
            break
        fits += 1
    return tuple(kept[:fits]), len(kept) - fits


def reset_document(
    previous: CheckpointDocument | None,
    checkpoint: Checkpoint,
    writer: Writer,
    *,
    reason: str,
    history_size: int,
    snapshot: SnapshotRef | None = None,
) -> CheckpointDocument:
    """The document a reset writes: ``checkpoint`` replacing ``previous`` (what the blob held,
    None: nothing), with the history ``previous`` retains below the new batch, the reset
    recorded (``reset_from`` = the batch it replaced, ``reset_at`` = now, ``reset_reason``),
    and ``snapshot`` as its marker, whatever ``previous`` named: the snapshot a restore wrote
    back (its state goes with the new position), None for offsets alone."""
    history, _ = carry_history(previous, checkpoint.batch_id, history_size)
    doc = CheckpointDocument.of(checkpoint, writer, history)
    return msgspec.structs.replace(
        doc,
        snapshot=snapshot,
        reset_from=previous.batch_id if previous is not None else None,
        reset_at=doc.written_at,
        reset_reason=reason,
    )


@dataclass(frozen=True, slots=True)
class Stored:
    """A checkpoint blob as read or written: its version (the store's ETag; None: there is no
    blob) and the document it holds (None: none, or empty, as created for its lease). Every
    write names the version it replaces, so a value and its version always travel together."""

    version: str | None
    document: CheckpointDocument | None

    @property
    def batch_id(self) -> int | None:
        """The batch the blob holds; None when it holds no document."""
        return self.document.batch_id if self.document is not None else None


_doc_decoder = msgspec.json.Decoder(CheckpointDocument)


def encode_document(doc: CheckpointDocument) -> bytes:
    return _encoder.encode(doc)


def decode_document(
    data: bytes, blob_name: str = "blob", query_id: str | None = None
) -> CheckpointDocument | None:
    """Parse a blob's body (schema version 1 or 2); None for the empty body of a freshly
    created blob.

    ``query_id``: the query the blob belongs to (its name says so); a document of another
    query is refused.

    Raises:
        CorruptRecord: the body is not a checkpoint document (another version's, cut short,
            edited by hand, or written by something else), or it is another query's.
    """
    if not data:
        return None
    try:
        doc = _doc_decoder.decode(data)
        bad = offsets_error(source_offsets(doc.sources)) or offsets_error(
            e.end_offsets for e in doc.history
        )
        if bad is not None:
            raise bad
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise CorruptRecord("blob", blob_name, f"is not a checkpoint document ({exc})") from exc
    if doc.schema_version not in READABLE_VERSIONS:
        raise CorruptRecord(
            "blob",
            blob_name,
            f"has schema version {doc.schema_version}, which this checkpoint-sidecar does not "
            f"read (it reads {', '.join(map(str, READABLE_VERSIONS))}): run the version that "
            "wrote it",
        )
    if query_id is not None and doc.query_id != query_id:
        raise CorruptRecord(
            "blob", blob_name, f"holds a checkpoint of query {doc.query_id!r}, not {query_id!r}"
        )
    return doc
