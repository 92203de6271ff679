"""``checkpoint-sidecar import-spark-checkpoint``, the reading side: Spark's checkpoint
directory (local files) and the query's existing sidecar checkpoint (its blob), combined into
the checkpoint to write, and what the command prints.

The rules live in ``sidecar.model.spark_dir`` (pure); the write is
``sidecar.ops.admin_tool.apply_reset`` (a reset: through the running daemon, else under a
lease of the tool's own), after :func:`check_write`, the import's own rule.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, TextIO

import msgspec

from sidecar.config import Config
from sidecar.errors import AdminRefused
from sidecar.model.checkpoint import Checkpoint
from sidecar.model.document import CheckpointDocument
from sidecar.model.spark_dir import (
    SparkBatch,
    SparkCheckpointError,
    batch_ids,
    describe,
    last_committed,
    parse_commit,
    parse_offsets,
    parse_query_metadata,
    to_checkpoint,
)
from sidecar.model.stateful import State, rewind_refusal, state_of
from sidecar.store.blobs import BlobStore, newest_named


class Adoption(msgspec.Struct, frozen=True):
    """What an import writes, and what it found."""

    spark_checkpoint: str
    batch: SparkBatch
    checkpoint: Checkpoint
    blob: str
    #: The query's own blob (same query id) before the import; None: absent or empty.
    existing: CheckpointDocument | None
    #: Where the source descriptions come from, for people.
    described_by: str


def read_spark_checkpoint(location: str | Path) -> SparkBatch:
    """The last committed batch of the Spark checkpoint directory ``location`` (blocking file
    reads: call it before the event loop). Only ``metadata``, the names in ``commits/`` and
    ``offsets/``, and the last committed batch's two files are read.

    Raises:
        SparkCheckpointError: not a local Spark checkpoint directory, no committed batch, an
            unsupported or damaged log (the message says what to do).
    """
    where, path = str(location), Path(location)
    if "://" in where:
        raise SparkCheckpointError(
            f"{where}: only a local directory is read; copy the checkpoint's metadata, "
            "offsets/ and commits/ here first (e.g. `azcopy copy --recursive`, `hdfs dfs "
            "-get`, `aws s3 cp --recursive`) and pass that copy"
        )
    if not path.is_dir():
        raise SparkCheckpointError(
            f"{where} is not a directory: pass the query's checkpointLocation"
        )
    if not (path / "metadata").is_file():
        raise SparkCheckpointError(
            f"{where} is not a Spark checkpoint directory: it has no metadata file (a "
            "streaming query's checkpointLocation holds metadata, offsets/ and commits/)"
        )
    try:
        query_id = parse_query_metadata((path / "metadata").read_bytes(), where)
        commits = os.listdir(path / "commits") if (path / "commits").is_dir() else []
        offsets = os.listdir(path / "offsets") if (path / "offsets").is_dir() else []
        last = last_committed(commits, offsets, where)
        state_ids = parse_commit(
            (path / "commits" / str(last)).read_bytes(), f"{where}/commits/{last}"
        )
        read = parse_offsets((path / "offsets" / str(last)).read_bytes(), f"{where}/offsets/{last}")
        has_state = (path / "state").is_dir()
    except OSError as exc:
        raise SparkCheckpointError(f"{where}: cannot read the checkpoint: {exc}") from exc
    return SparkBatch(
        query_id=query_id,
        batch_id=last,
        timestamp=read.timestamp,
        end_offsets=read.end_offsets,
        uncommitted=tuple(b for b in batch_ids(offsets) if b > last),
        log_version=read.version,
        source_ids=read.source_ids,
        stateful=state_ids or has_state,
    )


async def plan(config: Config, spark_checkpoint: str, batch: SparkBatch, name: str) -> Adoption:
    """The checkpoint to write for ``batch`` as query ``name``, its sources described by the
    query's existing sidecar checkpoint when it has as many sources: the query's own blob
    (same id), else the newest blob of a query named ``name`` (the same query, run before
    from another Spark checkpoint directory). Reads the blobs; writes nothing.

    Raises:
        CorruptRecord: the query's own blob cannot be read (it is never overwritten).
        SparkCheckpointError: the batch has no offset at all.
    """
    store = BlobStore(config)
    try:
        own, known = None, None
        if await store.container_listable():  # else nothing was ever written
            own = known = await store.read(batch.query_id)
            if known is None:
                info = newest_named(await store.list(), name)
                known = info.document if info is not None else None
        blob = store.blob_name(batch.query_id)
    finally:
        await store.aclose()
    descriptions = None
    described_by = "placeholders: no sidecar checkpoint of this query or name"
    if known is not None:
        descriptions = [s.description for s in known.sources]
        whose = "its blob" if known is own else f"the blob of query {known.query_id}"
        if len(descriptions) == len(batch.end_offsets):
            described_by = f"{whose} (batch {known.batch_id})"
        else:
            described_by = (
                f"placeholders: {whose} has {len(descriptions)} source(s), Spark's log "
                f"{len(batch.end_offsets)}"
            )
    if any(not i.isdigit() for i in batch.source_ids):  # a v2 log's named sources
        described_by = "placeholders and names: Spark's log names its sources, in its own order"
    described = describe(batch.end_offsets, descriptions, batch.source_ids)
    checkpoint = to_checkpoint(batch, name, described)
    return Adoption(spark_checkpoint, batch, checkpoint, blob, own, described_by)


def check_write(adoption: Adoption, *, force: bool, state_rewound: bool = False) -> None:
    """The import's own rules, before the write: never move a query back silently. A reset
    may go back on purpose, so ``apply_reset`` does not check this; an import goes back only
    with ``force`` (an older copy of a checkpoint directory is an easy mistake), and a
    stateful query (or one that may be) only with ``state_rewound`` as well: its state store
    must move too (``sidecar.model.stateful``; the daemon checks that again).

    Raises:
        AdminRefused: the query's blob holds a newer batch (unless ``force``; and, for a
            stateful query, ``state_rewound``), or another number of sources than Spark's
            log (a reset keeps the sources: never forced).
    """
    a, c = adoption, adoption.checkpoint
    if a.existing is None:
        return
    if a.existing.batch_id > c.batch_id and not force:
        raise AdminRefused(
            f"blob {a.blob} already holds batch {a.existing.batch_id}, newer than batch "
            f"{c.batch_id}: nothing written. The sidecar is ahead of this Spark checkpoint (an "
            "older copy, or the query kept running with the listener); pass --force to move the "
            f"query back to batch {c.batch_id}"
        )
    refusal = rewind_refusal(a.existing, to_batch=c.batch_id, explicit=False)
    if refusal is not None and not state_rewound:
        raise AdminRefused(f"import refused, nothing written: {refusal}")
    if len(a.existing.sources) != len(c.sources):
        raise AdminRefused(
            f"blob {a.blob} holds {len(a.existing.sources)} source(s) for this query, Spark's "
            f"log {len(c.sources)}: nothing written (a reset keeps the query's sources). If the "
            f"query's sources changed, retire the old record first (`checkpoint-sidecar retire "
            f"{c.query_id} --archive`), then import"
        )


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def print_adoption(
    adoption: Adoption,
    *,
    via: str | None,
    as_json: bool,
    force: bool = False,
    state_rewound: bool = False,
    out: TextIO = sys.stdout,
) -> None:
    """What was written (``via`` "daemon" or "lease": ``AdminResult.via``) or, ``via`` None,
    would be written, for people or (``as_json``) scripts."""
    a, c = adoption, adoption.checkpoint
    written = via is not None
    if as_json:
        row = {
            "spark_checkpoint": a.spark_checkpoint,
            "batch_id": c.batch_id,
            "uncommitted": a.batch.uncommitted,
            "blob": a.blob,
            "blob_batch_id": a.existing.batch_id if a.existing is not None else None,
            "descriptions": a.described_by,
            "offsets_log_version": a.batch.log_version,
            "source_ids": a.batch.source_ids,
            "stateful": c.stateful,
            "state": state_of(c).value,
            "written": written,
            "via": via,
            "checkpoint": c,
        }
        out.write(_json(row) + "\n")
        return
    planned = ""
    if a.batch.uncommitted:
        ids = ", ".join(map(str, a.batch.uncommitted))
        planned = f"; {ids} planned, not committed (Spark runs it again from these offsets)"
    held = "nothing yet"
    if a.existing is not None:
        held = f"batch {a.existing.batch_id} (written {a.existing.written_at})"
    lines = [
        f"spark checkpoint  {a.spark_checkpoint}",
        f"query id          {c.query_id}",
        f"last committed    batch {c.batch_id} (Spark timestamp {c.timestamp or '-'}){planned}",
        f"logs              offsets v{a.batch.log_version}"
        + (
            "; stateful (state/ or state ids in commits/)"
            if state_of(c) is State.STATEFUL
            else "; state unknown (no state/: the query's next progress tells)"
        ),
        f"sources           described by {a.described_by}",
    ]
    for i, s in enumerate(c.sources):
        lines += [f"  [{i}] {s.description}", f"      end    {_json(s.end_offset)}"]
    lines.append(f"blob              {a.blob}: {'held' if written else 'holds'} {held}")
    if written:
        how = "by the daemon" if via == "daemon" else "under the tool's own lease"
        lines.append(
            f"wrote batch {c.batch_id} of query {c.name!r} as a reset, {how}: run with the "
            f"sidecar's listener, its next batches ({c.batch_id + 1}, ...) are stored on top of it"
        )
    else:
        try:
            check_write(a, force=force, state_rewound=state_rewound)
        except AdminRefused as exc:
            lines.append(f"the write would be refused: {exc}")
        lines.append("dry run: nothing written (run it again without --dry-run to write)")
    out.write("\n".join(lines) + "\n")
