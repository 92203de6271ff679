"""The checkpoint record and the blob document that carries it. Pure, no I/O.

A checkpoint is derived from one Spark ``StreamingQueryProgress`` (as serialized by
``StreamingQueryProgress.json``): the query's identity, the finished micro-batch id, and for
each source its offsets *as JSON values* (numbers for the rate source, objects such as
``{"topic": {"0": 42}}`` for Kafka, or null). Spark's ``endOffset`` is the next offset to
read, so resuming from it neither skips nor repeats the batch.

Offsets as sent: each offset is carried as the JSON text the client sent (:data:`Offset`, a
``msgspec.Raw``), from the request to Redis to the blob, never decoded and re-encoded on the
way: the bytes of the value, from its first to its last character, are stored as they are
(the client's key order, spacing and number spelling included; Spark's own JSON is compact).
Only the places that need the value decode it (:func:`offset_value`: Kafka commits, lag,
``starting-offsets``). A value is still checked as a decode into Python values would check it
(:func:`offsets_error`), so what is stored is always readable by any JSON reader.

Ordering rule: a query's checkpoint only moves forward. Spark keeps a query's ``id`` across
restarts from the same checkpoint directory (``runId`` changes on every start), and batch
ids grow by one per finished micro-batch, so "newer" means "greater ``batch_id`` for the same
query id". The rule is enforced atomically in Redis (see ``sidecar.buffer``).

Position rule: a progress in which no source reports an end offset says nothing about where
to resume, so it is never stored (:func:`has_position`). Spark 3.4 and older report a trigger
that ran no batch (an idle query) that way, under the *next* batch id: stored, it would
replace the last real offsets with nulls and make that batch's real update look stale.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Annotated, Any

import msgspec

from sidecar import rawjson
from sidecar.errors import CorruptRecord

#: Longest accepted query id / run id. Spark uses UUIDs (36 characters).
MAX_ID_CHARS = 256

#: Query and run ids (Spark uses UUIDs). The id names a blob and a Redis key, so it is kept to
#: a safe alphabet: no "/" or ".." can step outside the namespace.
Id = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS, pattern=r"^[A-Za-z0-9][A-Za-z0-9_:.-]*$"),
]
#: Spark batch ids are Java longs.
BatchId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


#: A source offset: its JSON text as the client sent it (syntax checked, value not decoded).
Offset = msgspec.Raw
#: The offset of a source that reported none (JSON null, or the field absent).
NULL = msgspec.Raw(b"null")


class SparkSourceProgress(msgspec.Struct, rename="camel"):
    """One entry of ``StreamingQueryProgress.sources`` (fields we do not use are ignored)."""

    description: str
    start_offset: Offset = NULL
    end_offset: Offset = NULL
    latest_offset: Offset = NULL
    num_input_rows: int | None = None


class SparkProgress(msgspec.Struct, rename="camel"):
    """The parts of Spark's ``StreamingQueryProgress`` JSON that a checkpoint needs."""

    id: Id
    run_id: Id
    batch_id: BatchId
    timestamp: str
    sources: list[SparkSourceProgress]
    name: str | None = None


class SourceOffsets(msgspec.Struct, frozen=True):
    """A source's offsets after one micro-batch, as the JSON text Spark reported
    (:func:`offset_value` decodes one)."""

    description: str
    start_offset: Offset
    end_offset: Offset
    latest_offset: Offset
    num_input_rows: int | None = None


class Checkpoint(msgspec.Struct, frozen=True):
    """The latest known position of one streaming query."""

    query_id: str
    run_id: str
    name: str | None
    batch_id: int
    timestamp: str
    sources: list[SourceOffsets]

    @property
    def label(self) -> str:
        """How the query is named in logs and metrics: its name, or its id when unnamed."""
        return self.name or self.query_id


# Some sources describe themselves with a JVM object hash ("...MicroBatchStream@4d007824"),
# which changes on every run; sources are identified by position and this stable form.
_OBJECT_HASH = re.compile(r"@[0-9a-f]{4,16}\b")


def normalize_description(description: str) -> str:
    """A source description without JVM object hashes, stable across query runs."""
    return _OBJECT_HASH.sub("", description)


def has_position(checkpoint: Checkpoint) -> bool:
    """True when some source reports an end offset, i.e. the checkpoint says where to resume.

    False for a progress whose sources' end offsets are all null (or that has no source):
    the daemon acknowledges such an update (``applied: false``) and stores nothing. A query
    with several sources, some of which have not produced offsets yet, does have a position.
    """
    return any(source.end_offset != NULL for source in checkpoint.sources)


def from_progress(progress: SparkProgress) -> Checkpoint:
    """Build the checkpoint record for a validated Spark progress event (its offsets checked
    by :func:`offsets_error`)."""
    return Checkpoint(
        query_id=progress.id,
        run_id=progress.run_id,
        name=progress.name,
        batch_id=progress.batch_id,
        timestamp=progress.timestamp,
        sources=[
            SourceOffsets(
                description=(
                    normalize_description(s.description) if "@" in s.description else s.description
                ),
                start_offset=s.start_offset,
                end_offset=s.end_offset,
                latest_offset=s.latest_offset,
                num_input_rows=s.num_input_rows,
            )
            for s in progress.sources
        ],
    )


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Checkpoint)
_value_decoder = msgspec.json.Decoder()
#: The JSON value of an offset (None for null), decoded now (``sidecar.rawjson``).
offset_value = rawjson.value
#: The offset of a decoded value (None: null), encoded once (``sidecar.rawjson``): for
#: checkpoints built from values (a reset's offsets, an import), not from a client's text.
raw_offset = rawjson.raw_of
#: The error decoding offsets into values would raise, or None (``sidecar.rawjson``).
offsets_error = rawjson.first_error


def source_offsets(
    sources: list[SparkSourceProgress] | list[SourceOffsets],
) -> Iterator[tuple[Offset, Offset, Offset]]:
    """Each source's (start, end, latest) offsets, for :func:`offsets_error`."""
    return ((s.start_offset, s.end_offset, s.latest_offset) for s in sources)


def as_builtins(checkpoint: Checkpoint) -> dict[str, Any]:
    """The checkpoint as ``get`` returns it: dicts, lists and values (offsets decoded)."""
    value: dict[str, Any] = _value_decoder.decode(_encoder.encode(checkpoint))
    return value


# --- the blob document ----------------------------------------------------------------------

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


class CheckpointDocument(Checkpoint, frozen=True):
    """The JSON document stored in a query's blob: the checkpoint's fields plus these.

    ``history``: the earlier flushed checkpoints (schema version 2), newest first, each
    older than ``batch_id``; empty in a version 1 document or with ``SIDECAR_HISTORY_SIZE=0``.

    ``reset_from``, ``reset_at``, ``reset_reason``: the query's last reset (``checkpoint-sidecar
    reset``): the batch the blob held before it (None: no document then), when (UTC) and why.
    Absent (None) until a reset; carried by every later write. Optional fields of version 2:
    older documents decode without them, older readers ignore them.
    """

    schema_version: int
    checkpoint_id: str
    writer: Writer
    written_at: str
    history: tuple[HistoryEntry, ...] = ()
    reset_from: int | None = None
    reset_at: str | None = None
    reset_reason: str | None = None

    @classmethod
    def of(
        cls,
        checkpoint: Checkpoint,
        writer: Writer,
        history: tuple[HistoryEntry, ...] = (),
        *,
        reset_of: CheckpointDocument | None = None,
    ) -> CheckpointDocument:
        """A new document (fresh checkpoint id, written now) for ``checkpoint``; the record of
        the last reset is carried from ``reset_of`` (the document it replaces)."""
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
        return Checkpoint(self.query_id, self.run_id, self.name, batch_id, entry.timestamp, sources)

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
) -> CheckpointDocument:
    """The document a reset writes: ``checkpoint`` replacing ``previous`` (what the blob held,
    None: nothing), with the history ``previous`` retains below the new batch, and the reset
    recorded (``reset_from`` = the batch it replaced, ``reset_at`` = now, ``reset_reason``)."""
    history, _ = carry_history(previous, checkpoint.batch_id, history_size)
    doc = CheckpointDocument.of(checkpoint, writer, history)
    return msgspec.structs.replace(
        doc,
        reset_from=previous.batch_id if previous is not None else None,
        reset_at=doc.written_at,
        reset_reason=reason,
    )


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


def encode(checkpoint: Checkpoint) -> bytes:
    """Serialize a checkpoint to compact JSON (the form stored in Redis)."""
    return _encoder.encode(checkpoint)


def decode(data: bytes, key: str = "checkpoint", query_id: str | None = None) -> Checkpoint:
    """Parse a checkpoint previously produced by :func:`encode`, read from Redis ``key`` (the
    record of query ``query_id``, when given: another query's checkpoint is refused).

    Raises:
        CorruptRecord: ``data`` is not a checkpoint record (another version's, cut short,
            edited by hand), or it is another query's.
    """
    try:
        checkpoint = _decoder.decode(data)
        bad = offsets_error(source_offsets(checkpoint.sources))
        if bad is not None:
            raise bad
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise CorruptRecord(
            "redis", key, f"has a checkpoint field that is not a checkpoint record ({exc})"
        ) from exc
    if query_id is not None and checkpoint.query_id != query_id:
        raise CorruptRecord("redis", key, f"holds a checkpoint of query {checkpoint.query_id!r}")
    return checkpoint


_BATCH_ID = re.compile(r"0|[1-9][0-9]{0,18}")


def decode_batch_id(value: bytes | str | None, key: str, field: str = "batch_id") -> int:
    """A batch id as stored in Redis (canonical decimal, at most a Java long's maximum).

    Raises:
        CorruptRecord: ``value`` is anything else (or absent).
    """
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    if text is not None and _BATCH_ID.fullmatch(text) and int(text) < 2**63:
        return int(text)
    shown = "none" if text is None else repr(text if len(text) <= 40 else text[:40] + "…")
    raise CorruptRecord("redis", key, f"has a {field} field that is not a batch id ({shown})")
