"""Spark's own checkpoint directory, read: the last committed batch and its end offsets. Pure.

``checkpoint-sidecar import-spark-checkpoint`` lets a query that already runs adopt the
sidecar without replaying. Spark keeps, in the checkpoint directory it is given:

```
metadata            {"id":"<query id>"}              the query id, kept across restarts
offsets/<N>         v1                                the write-ahead log: batch N's planned
                    {"batchWatermarkMs":…,            end offsets, written before it runs
                     "batchTimestampMs":…,"conf":{…}}
                    <source 0's offset JSON, or ->    one line per source, in the query's
                    <source 1's …>                    source order; "-": no offset yet
commits/<N>         v1                                written once batch N's output is
                    {"nextBatchWatermarkMs":…}        committed
state/              only for a stateful query         its state store's own checkpoint
```

Spark 4 may write a second version of each log (``spark.sql.streaming.offsetLog.formatVersion
=2``, and source evolution: sources named with ``.name()``): ``offsets/<N>`` is ``v2``, the same
metadata line, then one ``<source id>:<offset JSON>`` line per source — the id is the source's
ordinal (``0``, ``1``, …, in no particular line order) or its name — and ``commits/<N>`` is
``v2`` with ``stateUniqueIds`` (the state store checkpoint ids of state format v2). Both are
read (:data:`OFFSETS_LOG_VERSIONS`): ordinal ids are put in source order, named sources keep
the file's order and their names (:attr:`SparkBatch.source_ids`). A query is *stateful*
(:attr:`SparkBatch.stateful`) when its directory has ``state/`` or its last commit names state
ids: rewinding it needs its state rewound too (``docs/spark-bridge.md``).

(plus ``.<N>.crc`` checksums and ``.<N>.<uuid>.tmp`` files being renamed into place, which
Spark itself ignores: only names that are batch ids count, as here.) On restart, Spark takes
the highest batch C in ``commits/``; the next batch it runs starts from ``offsets/C``'s
lines — if ``offsets/C+1`` exists it was planned but not committed and is run again from
that same start. So the position to import is batch C with end offsets ``offsets/C``
(:func:`last_committed`, :func:`parse_offsets`): resuming from it, as Spark would, neither
skips nor repeats a committed batch.

Spark's offsets log names no source, so :func:`describe` names them: the descriptions of the
query's existing sidecar checkpoint when it has as many sources, else ``source[i]`` — or, for
an offset shaped like the Kafka source's (``{"topic": {"0": 42}}``), ``KafkaV2[<topics>]``,
so the Kafka committer and the lag gauges (which look for a ``Kafka…`` description) treat it
as Kafka, and ``starting-offsets --source i`` (which looks at the shape) works as for any
Kafka source. The next checkpoint the listener sends replaces them with Spark's own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

import msgspec

from sidecar.errors import SidecarError
from sidecar.model.checkpoint import NULL, Checkpoint, Id, Position, SourceOffsets, raw_offset
from sidecar.model.offsets import is_kafka_offsets

#: Offsets log versions read here. Spark 2.x to 4.x write v1; Spark 4.1+ writes v2 (``id:offset``
#: lines) when ``offsetLog.formatVersion`` is 2 or source evolution is enabled.
OFFSETS_LOG_VERSIONS = (1, 2)
#: Commit log versions read here: v1, and v2 (Spark 4.1+: ``stateUniqueIds``).
COMMIT_LOG_VERSIONS = (1, 2)
#: Spark's line for a source that has no offset in that batch.
VOID_OFFSET = "-"
#: The ``run_id`` of an imported checkpoint: Spark's log keeps no run id (a run's, not the
#: query's), and this says where the record came from.
IMPORTED_RUN_ID = "spark-checkpoint-import"
#: Appended to the names of sources described from the offsets log alone.
PLACEHOLDER_NOTE = "(from Spark's offsets log)"


class SparkCheckpointError(SidecarError):
    """The directory is not a readable Spark checkpoint; the message says what to do."""


class SparkBatch(msgspec.Struct, frozen=True):
    """The last committed batch of a Spark checkpoint directory."""

    query_id: str
    batch_id: int
    #: Spark's ``batchTimestampMs`` of that batch as ISO text (UTC), like a progress's
    #: ``timestamp``; empty when the log has none.
    timestamp: str
    #: Each source's end offset (the JSON value of its line; None for "-"), in source order.
    end_offsets: tuple[Any, ...]
    #: Batches planned in ``offsets/`` after it but not committed (Spark runs them again).
    uncommitted: tuple[int, ...] = ()
    #: The offsets log's version (1 or 2).
    log_version: int = 1
    #: Each source's id in a v2 log (its ordinal as text, or its name), in the order of
    #: ``end_offsets``; empty for v1 (sources by position only).
    source_ids: tuple[str, ...] = ()
    #: The query keeps state (``state/`` exists, or the commit names state store ids).
    stateful: bool = False


class SparkOffsets(msgspec.Struct, frozen=True):
    """One ``offsets/<N>`` file, read."""

    version: int
    #: Spark's ``batchTimestampMs`` as ISO text (UTC); empty when absent.
    timestamp: str
    #: Each source's offset (its JSON value; None for "-"), in source order.
    end_offsets: tuple[Any, ...]
    #: v2: each source's id, in the same order; v1: empty.
    source_ids: tuple[str, ...] = ()
    #: The SQL settings Spark records with the batch and restores on restart (the state store
    #: provider class, the number of shuffle partitions, ...), as text.
    conf: dict[str, str] = msgspec.field(default_factory=dict)


class _QueryMetadata(msgspec.Struct):
    id: Id


class _OffsetsMetadata(msgspec.Struct, rename="camel"):
    batch_timestamp_ms: int | None = None
    conf: dict[str, Any] | None = None


class _CommitMetadata(msgspec.Struct, rename="camel"):
    #: v2, stateful: operator id → per-partition state store checkpoint ids.
    state_unique_ids: dict[str, Any] | None = None


def batch_ids(names: Iterable[str]) -> list[int]:
    """The batch ids among a log directory's file names, ascending: names made of digits only
    (``.3.crc``, ``.3.<uuid>.tmp``, ``3.compact`` and anything else are not batches)."""
    return sorted(int(n) for n in names if n.isascii() and n.isdigit())


def last_committed(commit_names: Iterable[str], offset_names: Iterable[str], where: str) -> int:
    """The highest batch id in ``commits/`` (whose ``offsets/`` file must exist).

    Raises:
        SparkCheckpointError: no committed batch, or its offsets file is missing.
    """
    committed = batch_ids(commit_names)
    if not committed:
        raise SparkCheckpointError(
            f"{where}: no committed batch in commits/ (the query never finished a batch): "
            "nothing to import; start the query once, or start it with the sidecar from the "
            "beginning"
        )
    last = committed[-1]
    if last not in set(batch_ids(offset_names)):
        raise SparkCheckpointError(
            f"{where}: batch {last} is committed but offsets/{last} is missing: the checkpoint "
            "is damaged (Spark could not restart from it either); restore it from a backup"
        )
    return last


def parse_query_metadata(data: bytes, where: str) -> str:
    """The query id of the checkpoint's ``metadata`` file (``{"id":"<uuid>"}``).

    Raises:
        SparkCheckpointError: not such a file.
    """
    try:
        return msgspec.json.decode(data.strip(), type=_QueryMetadata).id
    except msgspec.DecodeError as exc:
        raise SparkCheckpointError(
            f'{where}/metadata is not Spark\'s query metadata ({{"id":"<query id>"}}): {exc}; '
            "is PATH the query's checkpointLocation?"
        ) from exc


def _version(header: str, path: str, log: str, readable: tuple[int, ...]) -> int:
    """The version on a log file's first line (``v1``), one of ``readable``.

    Raises:
        SparkCheckpointError: not a version line, or a version not in ``readable``.
    """
    text = header.strip()
    if not (text.startswith("v") and text[1:].isdigit()):
        raise SparkCheckpointError(
            f"{path}: the first line is {text[:40]!r}, not a log version such as 'v1': the "
            "file is damaged or is not Spark's"
        )
    version = int(text[1:])
    if version not in readable:
        raise SparkCheckpointError(
            f"{path} is {log} v{version}; this checkpoint-sidecar reads "
            f"{', '.join(f'v{v}' for v in readable)}: a newer Spark wrote it; upgrade "
            "checkpoint-sidecar, or start the query with the sidecar's listener instead (its "
            "next batch is stored as usual)"
        )
    return version


def parse_commit(data: bytes, path: str) -> bool:
    """Check a ``commits/<N>`` file — a version line (:data:`COMMIT_LOG_VERSIONS`), then its
    metadata — and say whether it names state store ids (a v2 commit of a stateful query).

    Raises:
        SparkCheckpointError: an empty or damaged file, or an unknown version.
    """
    return bool(_commit_metadata(data, path).state_unique_ids)


def parse_commit_state_ids(data: bytes, path: str) -> dict[int, tuple[tuple[str, ...], ...]]:
    """The state store checkpoint ids a ``commits/<N>`` file names (state format v2): for each
    operator id, per partition, the id of each of its stores' version N+1 (one for most
    operators; four for a stream-stream join, in the order of its stores). Empty for a v1
    commit or a stateless query.

    Raises:
        SparkCheckpointError: an empty or damaged file, an unknown version, or ids that are
            not lists of lists of text per operator.
    """
    raw = _commit_metadata(data, path).state_unique_ids or {}
    out: dict[int, tuple[tuple[str, ...], ...]] = {}
    for operator, partitions in raw.items():
        if not (
            operator.isascii()
            and operator.isdigit()
            and isinstance(partitions, list)
            and all(
                isinstance(ids, list) and all(isinstance(i, str) for i in ids) for ids in partitions
            )
        ):
            raise SparkCheckpointError(
                f"{path}: stateUniqueIds of operator {operator!r} is not a list of id lists "
                "per partition; the checkpoint is damaged"
            )
        out[int(operator)] = tuple(tuple(ids) for ids in partitions)
    return out


def _commit_metadata(data: bytes, path: str) -> _CommitMetadata:
    lines = data.decode(errors="replace").splitlines()
    if not lines:
        raise SparkCheckpointError(f"{path} is empty: the checkpoint is damaged")
    _version(lines[0], path, "a commit log", COMMIT_LOG_VERSIONS)
    if len(lines) < 2 or not lines[1].strip():
        return _CommitMetadata()
    try:
        return msgspec.json.decode(lines[1], type=_CommitMetadata)
    except msgspec.DecodeError as exc:
        raise SparkCheckpointError(f"{path} line 2 is not the commit metadata: {exc}") from exc


def parse_offsets(data: bytes, path: str) -> SparkOffsets:
    """Read an ``offsets/<N>`` file of log version 1 or 2 (see the module's docstring).

    Raises:
        SparkCheckpointError: a version other than :data:`OFFSETS_LOG_VERSIONS`, no metadata
            line, no source line, a line that is not JSON (its number is named), a v2 line
            without its source id, or a source id twice.
    """
    try:
        lines = data.decode().split("\n")
    except UnicodeDecodeError as exc:
        raise SparkCheckpointError(f"{path} is not UTF-8 text: {exc}") from exc
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise SparkCheckpointError(f"{path} is empty: the checkpoint is damaged")
    version = _version(lines[0], path, "an offsets log", OFFSETS_LOG_VERSIONS)
    if len(lines) < 3:
        raise SparkCheckpointError(
            f"{path} has {len(lines)} line(s): expected the version, the batch metadata and "
            "one line per source; the checkpoint is damaged"
        )
    try:
        # Spark 2.1 wrote an empty line when the batch had no metadata.
        meta = msgspec.json.decode(lines[1] or "{}", type=_OffsetsMetadata)
    except msgspec.DecodeError as exc:
        raise SparkCheckpointError(f"{path} line 2 is not the batch metadata: {exc}") from exc
    ids: list[str] = []
    offsets: list[Any] = []
    for number, line in enumerate(lines[2:], start=3):
        text = line
        if version == 2:
            source_id, colon, text = line.partition(":")
            if not colon or not source_id.strip():
                raise SparkCheckpointError(
                    f"{path} line {number} ({_shown(line)!r}) is not '<source id>:<offset>' "
                    "as a v2 offsets log has; the checkpoint is damaged"
                )
            if source_id in ids:
                raise SparkCheckpointError(
                    f"{path} line {number} names source {source_id!r} twice; the checkpoint "
                    "is damaged"
                )
            ids.append(source_id)
        offsets.append(_offset(text, path, number, line))
    if ids and all(i.isascii() and i.isdigit() for i in ids):
        order = sorted(range(len(ids)), key=lambda k: int(ids[k]))
        ids, offsets = [ids[k] for k in order], [offsets[k] for k in order]
    timestamp = ""
    if meta.batch_timestamp_ms is not None:
        when = datetime.fromtimestamp(meta.batch_timestamp_ms / 1000, UTC)
        timestamp = when.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    conf = {str(k): v if isinstance(v, str) else str(v) for k, v in (meta.conf or {}).items()}
    return SparkOffsets(version, timestamp, tuple(offsets), tuple(ids), conf)


def _shown(line: str) -> str:
    return line if len(line) <= 60 else line[:60] + "…"


def _offset(text: str, path: str, number: int, line: str) -> Any:
    if text.strip() == VOID_OFFSET:
        return None
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise SparkCheckpointError(
            f"{path} line {number} ({_shown(line)!r}) is not a source offset (JSON or '-'): "
            f"{exc}; the checkpoint is damaged"
        ) from exc


def describe(
    end_offsets: Sequence[Any], known: Sequence[str] | None, source_ids: Sequence[str] = ()
) -> list[str]:
    """Each source's description: ``known`` (the query's existing descriptions) when it has
    one per source and the sources are not named (named sources of a v2 log are in the file's
    order, which need not be the query's); else ``KafkaV2[<topics>]`` for a Kafka-shaped
    offset, ``source[i]`` (or ``source 'name'``) for any other, each followed by
    :data:`PLACEHOLDER_NOTE`."""
    named = any(not (i.isascii() and i.isdigit()) for i in source_ids)
    if known is not None and len(known) == len(end_offsets) and not named:
        return list(known)
    out = []
    for i, offset in enumerate(end_offsets):
        label = f"source {source_ids[i]!r}" if named else f"source[{i}]"
        if is_kafka_offsets(offset):
            label = f"KafkaV2[{','.join(sorted(offset))}]" + (f" {label}" if named else "")
        out.append(f"{label} {PLACEHOLDER_NOTE}")
    return out


def to_checkpoint(batch: SparkBatch, name: str, descriptions: Sequence[str]) -> Checkpoint:
    """The sidecar checkpoint of ``batch`` for the query named ``name``.

    Raises:
        SparkCheckpointError: no source has an offset (nothing says where to resume).
    """
    if all(o is None for o in batch.end_offsets):
        raise SparkCheckpointError(
            f"batch {batch.batch_id} has no offset for any source: nothing says where to "
            "resume; let the query finish a batch that reads something, then import"
        )
    # No state/ and no state ids: not known to be stateless (the usual copy of a directory
    # leaves state/ out), so recorded as unknown, never as stateless (sidecar.model.stateful).
    return Checkpoint(
        stateful=True,
        state_unknown=not batch.stateful,
        position=Position.COMMITTED,
        query_id=batch.query_id,
        run_id=IMPORTED_RUN_ID,
        name=name,
        batch_id=batch.batch_id,
        timestamp=batch.timestamp,
        sources=[
            SourceOffsets(
                description=d, start_offset=NULL, end_offset=raw_offset(o), latest_offset=NULL
            )
            for d, o in zip(descriptions, batch.end_offsets, strict=True)
        ],
    )
