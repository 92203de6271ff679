"""Read side for people and scripts: ``checkpoint-sidecar list``, ``show QUERY`` and
``history QUERY``.

Reads the blobs directly (no daemon, no Redis needed), so it works when the daemon is down —
which is when you need to know where a query stood. A blob that cannot be read is never
skipped in silence: ``list`` marks its row UNREADABLE, and ``show`` / ``starting-offsets``
of that query fail with a message naming it.
"""

from __future__ import annotations

import sys
from typing import TextIO

import msgspec

from sidecar.config import Config
from sidecar.errors import SidecarError
from sidecar.model.checkpoint import Checkpoint, Position
from sidecar.model.document import CheckpointDocument
from sidecar.model.stateful import State, state_of
from sidecar.store.blobs import BlobInfo, BlobStore, newest_named


async def list_checkpoints(config: Config) -> list[BlobInfo]:
    store = BlobStore(config)
    try:
        return await store.list()
    finally:
        await store.aclose()


async def find_checkpoint(config: Config, query: str) -> BlobInfo:
    """The checkpoint of the query with id ``query``, else the newest one named ``query``.

    Raises:
        CorruptRecord: that blob cannot be read (the message names it and what to do).
        SidecarError: no such query.
    """
    infos = await list_checkpoints(config)
    written = [b for b in infos if b.document is not None or b.unreadable is not None]
    found = next((b for b in written if b.query_id == query), None) or newest_named(infos, query)
    if found is None:
        raise SidecarError(
            f"no checkpoint for query {query!r} in namespace {config.namespace!r} "
            f"(container {config.container!r}); `checkpoint-sidecar list` shows what there is"
        )
    found.checked()
    return found


def _end_offsets(doc: CheckpointDocument) -> str:
    return "; ".join(msgspec.json.encode(s.end_offset).decode() for s in doc.sources)


def print_list(infos: list[BlobInfo], *, as_json: bool, out: TextIO = sys.stdout) -> None:
    """One row per written blob; a blob that cannot be read is a row marked UNREADABLE
    (``"unreadable": "<why>"`` in JSON, with ``"checkpoint": null``)."""
    shown = [i for i in infos if i.document is not None or i.unreadable is not None]
    if as_json:
        rows = [
            {
                "blob": i.blob_name,
                "lease_state": i.lease_state,
                "checkpoint": i.document,
                "unreadable": i.unreadable,
            }
            for i in shown
        ]
        out.write(msgspec.json.encode(rows).decode() + "\n")
        return
    header = ("QUERY", "QUERY ID", "BATCH", "WRITTEN AT", "LEASE", "END OFFSETS")
    table = [header]
    for i in shown:
        if (d := i.document) is not None:
            table.append(
                (
                    d.name or "-",
                    d.query_id,
                    str(d.batch_id),
                    d.written_at,
                    i.lease_state,
                    _end_offsets(d),
                )
            )
        else:
            modified = i.last_modified.isoformat(timespec="milliseconds") if i.last_modified else ""
            table.append(
                (
                    i.query_name or "-",
                    i.query_id,
                    "?",
                    modified or "-",
                    i.lease_state,
                    f"UNREADABLE: blob {i.blob_name} {i.unreadable}",
                )
            )
    widths = [max(len(row[c]) for row in table) for c in range(len(header) - 1)]
    for row in table:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)]
        out.write("  ".join([*cells, row[-1]]).rstrip() + "\n")
    if not shown:
        out.write("(no checkpoints yet)\n")
    if any(i.unreadable is not None for i in shown):
        out.write(
            "UNREADABLE blobs are left as they are (the daemon never overwrites a blob it "
            "cannot read): inspect them, then restore or delete them; `show QUERY` says more\n"
        )


def print_show(info: BlobInfo, *, as_json: bool, out: TextIO = sys.stdout) -> None:
    doc = info.document
    assert doc is not None
    if as_json:
        out.write(msgspec.json.encode(doc).decode() + "\n")
        return
    w = doc.writer
    lines = [
        f"query       {doc.name or '-'}",
        f"query id    {doc.query_id}",
        f"run id      {doc.run_id}",
        f"batch       {doc.batch_id}   (Spark timestamp {doc.timestamp})",
        f"written     {doc.written_at} by {w.host} pid {w.pid} (instance {w.instance_id})",
        f"blob        {info.blob_name}   lease {info.lease_state}",
        f"position    {position_text(doc)}",
        f"state       {state_text(doc)}",
        *(
            [f"reset       from {_was(doc.reset_from)} at {doc.reset_at}: {doc.reset_reason}"]
            if doc.reset_at
            else []
        ),
        "sources:",
    ]
    for i, s in enumerate(doc.sources):
        lines += [
            f"  [{i}] {s.description}",
            f"      start  {msgspec.json.encode(s.start_offset).decode()}",
            f"      end    {msgspec.json.encode(s.end_offset).decode()}",
            f"      latest {msgspec.json.encode(s.latest_offset).decode()}",
        ]
    out.write("\n".join(lines) + "\n")


def print_history(info: BlobInfo, *, as_json: bool, out: TextIO = sys.stdout) -> None:
    """The checkpoints the query's blob retains, newest first: its own, then its history.
    ``--batch`` / ``--before`` of ``starting-offsets`` resume from any of them."""
    doc = info.document
    assert doc is not None
    retained = doc.retained()
    if as_json:
        rows = [
            {**msgspec.json.decode(msgspec.json.encode(e)), "current": i == 0}  # offsets: values
            for i, e in enumerate(retained)
        ]
        head = {
            "query_id": doc.query_id,
            "name": doc.name,
            "schema_version": doc.schema_version,
            "position": doc.position,
            "stateful": doc.stateful,
            "state": state_of(doc).value,
        }
        out.write(msgspec.json.encode({**head, "checkpoints": rows}).decode() + "\n")
        return
    out.write(
        f"query {doc.name or '-'} ({doc.query_id}): {len(retained)} checkpoint(s) retained, "
        "newest first\n"
    )
    table = [("BATCH", "SPARK TIMESTAMP", "WRITTEN AT", "END OFFSETS")]
    for i, e in enumerate(retained):
        ends = "; ".join(msgspec.json.encode(o).decode() for o in e.end_offsets)
        table.append((str(e.batch_id), e.timestamp, e.written_at, ends + (" (current)" * (i == 0))))
    widths = [max(len(row[c]) for row in table) for c in range(3)]
    for row in table:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)]
        out.write("  ".join([*cells, row[-1]]).rstrip() + "\n")
    out.write(f"position {position_text(doc)}; {state_text(doc)}\n")


def position_text(doc: Checkpoint) -> str:
    """Which position the checkpoint is, next to Spark's own checkpoint directory."""
    if doc.position is Position.COMMITTED:
        return "committed (in Spark's commit log too: synchronous progress tracking)"
    if doc.position is Position.PROCESSED:
        return (
            "processed (async progress tracking or real-time mode: written by the sink; Spark's "
            "own offsets/commits logs may hold an earlier batch, which its restart replays)"
        )
    return "not reported (a listener that cannot tell; Spark's default is committed)"


def state_text(doc: Checkpoint) -> str:
    """Whether the query keeps state, and what that means for moving it back."""
    match state_of(doc):
        case State.STATEFUL:
            return "stateful (rewinding it needs its state store rewound: --state-rewound)"
        case State.UNKNOWN:
            return (
                "state unknown (imported without state/; rewinding it needs --state-rewound "
                "until its next progress tells)"
            )
    return "stateless"


def _was(batch_id: int | None) -> str:
    """What a reset replaced: a batch, or nothing (an import of a query never stored)."""
    return "nothing" if batch_id is None else f"batch {batch_id}"
