"""The flush state of a query as the Redis scripts return it, read and checked. Pure.

A row of the snapshot script becomes a :class:`PendingQuery` (or a
:class:`~sidecar.errors.CorruptRecord` naming the key), and so does the row the apply script
returns for an update it applied (``APPLY_ROWS``); a row of the pending index, without the
checkpoint, a :class:`PendingEntry`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sidecar.errors import CorruptRecord
from sidecar.model import checkpoint as ckpt
from sidecar.model.checkpoint import Checkpoint


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


COUNTER_RE = re.compile(rb"-?[0-9]{1,18}")


def counter(value: bytes) -> int | None:
    """A stored integer (a counter, a time in ms); None when it is not one."""
    return int(value) if COUNTER_RE.fullmatch(value) else None


@dataclass(frozen=True, slots=True)
class PendingQuery:
    """One query's flush state as read by :meth:`RedisBuffer.snapshot`."""

    query_id: str
    pending: int
    first_pending_ms: int | None
    version: str
    batch_id: int
    checkpoint: Checkpoint
    flushed_batch_id: int | None
    snapshot_ms: int
    #: Resets of the query in Redis so far (``checkpoint-sidecar reset``): one that changes
    #: means the blob may have been lowered.
    resets: int = 0
    #: The reset record (``reset_at``; "": none) of the document Redis' flushed batch is in;
    #: None: not recorded (no flush yet, or recorded by a version before it was kept).
    flushed_reset: str | None = None


@dataclass(frozen=True, slots=True)
class PendingEntry:
    """One query's flush state without its checkpoint (:meth:`RedisBuffer.pending`);
    ``pending`` is None when the stored counter cannot be read."""

    query_id: str
    pending: int | None  # None: absent or unreadable (a snapshot of the query tells which)
    first_pending_ms: int | None
    flushed_batch_id: int | None
    resets: int = 0
    flushed_reset: str | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    now_ms: int
    queries: list[PendingQuery]
    #: Queries whose record cannot be read, by query id (left as they are in Redis).
    corrupt: dict[str, CorruptRecord]


def pending_query(
    query_id: str, key: str, fields: list[bytes | None], now_ms: int
) -> PendingQuery | None:
    """One row of the snapshot script, checked; None for an id Redis knows nothing of.

    Raises:
        CorruptRecord: the record's checkpoint, batch id or counters cannot be read, or
            they disagree with each other.
    """
    pending, first_ms, version, batch, doc, flushed, resets, reset_mark = fields
    if doc is None:
        if pending is None and version is None and batch is None:
            return None  # an extra id Redis knows nothing about (or a deleted record)
        raise CorruptRecord("redis", key, "has no checkpoint field")
    checkpoint = ckpt.decode(bytes(doc), key, query_id)
    batch_id = ckpt.decode_batch_id(batch, key)
    if checkpoint.batch_id != batch_id:
        raise CorruptRecord(
            "redis",
            key,
            f"has batch_id {batch_id} but a checkpoint of batch {checkpoint.batch_id}",
        )
    count = counter(pending) if pending is not None else 0
    if count is None or version is None or counter(version) is None:
        raise CorruptRecord(
            "redis",
            key,
            f"has counters that are not integers (pending {pending!r}, version {version!r})",
        )
    return PendingQuery(
        query_id=query_id,
        pending=count,
        # Bookkeeping only: unreadable reads as unknown (the flusher flushes a pending query
        # of unknown age at once, reading the blob's batch first; the flush rewrites both).
        first_pending_ms=counter(first_ms) if first_ms is not None else None,
        version=text(version),
        batch_id=batch_id,
        checkpoint=checkpoint,
        flushed_batch_id=counter(flushed) if flushed is not None else None,
        snapshot_ms=now_ms,
        resets=(counter(resets) or 0) if resets is not None else 0,
        flushed_reset=text(reset_mark) if reset_mark is not None else None,
    )


def applied_query(checkpoint: Checkpoint, row: list[Any]) -> PendingQuery:
    """The row ``APPLY_ROWS`` returns for ``checkpoint``, which it applied: ``[1, pending,
    version, first_pending_ms, flushed_batch_id, resets, flushed_reset, now_ms]`` (an absent
    field None)."""
    pending, version, first_ms, flushed, resets, reset_mark, now_ms = row[1:]
    return PendingQuery(
        query_id=checkpoint.query_id,
        pending=int(pending),
        first_pending_ms=counter(first_ms) if first_ms is not None else None,
        version=str(int(version)),
        batch_id=checkpoint.batch_id,
        checkpoint=checkpoint,
        flushed_batch_id=counter(flushed) if flushed is not None else None,
        snapshot_ms=int(now_ms),
        resets=(counter(resets) or 0) if resets is not None else 0,
        flushed_reset=text(reset_mark) if reset_mark is not None else None,
    )
