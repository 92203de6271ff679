"""The checkpoint record: a query's position, from Spark's progress to Redis. Pure, no I/O.

The blob document that carries it (writer, history, reset record) is ``sidecar.model.document``.

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
query id". The rule is enforced atomically in Redis (see ``sidecar.buffer.redis_buffer``).

Position rule: a progress in which no source reports an end offset says nothing about where
to resume, so it is never stored (:func:`has_position`). Spark 3.4 and older report a trigger
that ran no batch (an idle query) that way, under the *next* batch id: stored, it would
replace the last real offsets with nulls and make that batch's real update look stale.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from typing import Annotated, Any

import msgspec

from sidecar.errors import CorruptRecord
from sidecar.model import rawjson

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
    #: Only whether there are any: a query with state operators is stateful.
    state_operators: list[msgspec.Raw] | None = None


class Tracking(enum.StrEnum):
    """How the query tracks progress, as the listener saw it (``tracking`` of a progress
    request): it decides which position a checkpoint is (:class:`Position`)."""

    SYNC = "sync"  # Spark's default: the offsets and commits logs are written every batch
    ASYNC = "async"  # asyncProgressTrackingEnabled: the logs are written every interval
    REAL_TIME = "real_time"  # Spark 4.1's real-time mode (async progress tracking within)


class Position(enum.StrEnum):
    """Which position a checkpoint holds, next to Spark's own checkpoint directory."""

    #: The batch is in Spark's commit log too (synchronous progress tracking): a restart from
    #: Spark's directory resumes from the same offsets.
    COMMITTED = "committed"
    #: The sink wrote the batch, but Spark's own logs may still hold an earlier one (async
    #: progress tracking, real-time mode): Spark's restart replays what lies between, a
    #: restart from this checkpoint does not.
    PROCESSED = "processed"


def position_of(tracking: Tracking | None) -> Position | None:
    """The position a progress of a query tracked so holds; None: the listener did not say."""
    if tracking is None:
        return None
    return Position.COMMITTED if tracking is Tracking.SYNC else Position.PROCESSED


class SourceOffsets(msgspec.Struct, frozen=True):
    """A source's offsets after one micro-batch, as the JSON text Spark reported
    (:func:`offset_value` decodes one)."""

    description: str
    start_offset: Offset
    end_offset: Offset
    latest_offset: Offset
    num_input_rows: int | None = None


class _Position(msgspec.Struct, frozen=True):
    query_id: str
    run_id: str
    name: str | None
    batch_id: int
    timestamp: str
    sources: list[SourceOffsets]


class Checkpoint(_Position, frozen=True, kw_only=True, omit_defaults=True):
    """The latest known position of one streaming query.

    ``stateful``: the query keeps state (its progress lists state operators): rewinding it
    needs its state store rewound too, so admin tools refuse without ``--state-rewound``.
    ``state_unknown``: whether it keeps state is not known (imported from a checkpoint
    directory copied without ``state/``): ``stateful`` is then true, so older readers refuse
    to rewind it too (``sidecar.model.stateful``). ``position``: which position this is next
    to Spark's own checkpoint (:class:`Position`; None: the listener did not say). All are
    left out of the JSON when unset (older records and readers are unchanged).
    """

    stateful: bool = False
    state_unknown: bool = False
    position: Position | None = None

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


def from_progress(progress: SparkProgress, tracking: Tracking | None = None) -> Checkpoint:
    """Build the checkpoint record for a validated Spark progress event (its offsets checked
    by :func:`offsets_error`), of a query tracked as ``tracking`` (None: not said)."""
    return Checkpoint(
        stateful=bool(progress.state_operators),
        position=position_of(tracking),
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
#: The JSON value of an offset (None for null), decoded now (``sidecar.model.rawjson``).
offset_value = rawjson.value
#: The offset of a decoded value (None: null), encoded once (``sidecar.model.rawjson``): for
#: checkpoints built from values (a reset's offsets, an import), not from a client's text.
raw_offset = rawjson.raw_of
#: The error decoding offsets into values would raise, or None (``sidecar.model.rawjson``).
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
