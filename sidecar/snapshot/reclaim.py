"""Snapshots of queries that are gone, reclaimed after a stated time (nothing is kept forever
by accident).

A query's snapshots are pruned by the daemon that owns it, between its snapshots. A query
no daemon runs any more leaves them behind:

- **retired** (``checkpoint-sidecar retire``: its checkpoint blob deleted or archived), or
  stopped for good: no checkpoint blob, and no snapshot written for ``keep_s``;
- **gone from its location**: ``restore --all`` found the location its snapshots were taken
  from holding another query's checkpoint (a location reused by a new query) and wrote a
  ``gone`` record beside its snapshots; no snapshot of it written since, for ``keep_s``.

Every daemon with snapshots on runs :func:`reclaim` now and then over its namespace (one
listing): the blobs of such a query are deleted, its indexes first (a snapshot no longer
listed is never restored half-deleted), then its packs and records. A query that runs again
writes snapshots, so it is never reclaimed; deletes are idempotent, so two daemons doing the
same pass are harmless. :func:`decide` is the pure part.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import msgspec

from sidecar.errors import VersionConflict
from sidecar.snapshot.index import all_prefix, prefix
from sidecar.snapshot.stored import SnapshotStore, chunks_of, retried

log = logging.getLogger(__name__)

#: The record ``restore --all`` writes beside a query's snapshots when their location holds
#: another query's checkpoint.
GONE = "gone"


class GoneRecord(msgspec.Struct, frozen=True):
    """Where a query's snapshots were taken from, the query found there instead, and when."""

    location: str
    found_query: str
    at: str


def gone_name(namespace: str, query_id: str) -> str:
    return f"{prefix(namespace, query_id)}{GONE}"


async def mark_gone(
    blobs: SnapshotStore, namespace: str, query_id: str, location: str, found_query: str
) -> None:
    """Record that the query's location holds ``found_query``'s checkpoint (the first record
    stays: the time it was first found so)."""
    record = GoneRecord(location, found_query, datetime.now(UTC).isoformat(timespec="seconds"))
    body = msgspec.json.encode(record)
    name = gone_name(namespace, query_id)
    with contextlib.suppress(VersionConflict):  # recorded before: its time stands
        await retried("write gone record", lambda: blobs.put(name, chunks_of(body, len(body))))


async def read_gone(blobs: SnapshotStore, namespace: str, query_id: str) -> GoneRecord | None:
    """The query's gone record, if any (an unreadable one: none)."""
    found = await retried("read gone record", lambda: blobs.read(gone_name(namespace, query_id)))
    if found is None:
        return None
    try:
        return msgspec.json.decode(found[0], type=GoneRecord)
    except msgspec.DecodeError:
        return None


@dataclass
class QueryBlobs:
    """What one listing shows of one query's snapshot blobs."""

    query_id: str
    names: list[str] = field(default_factory=list)
    #: When its newest blob (an index, a pack, prune's marks; not the gone record) was
    #: written, seconds since the epoch (None: none).
    newest_at: float | None = None
    #: When its gone record was written (None: none).
    gone_at: float | None = None


def group(listed: Iterable[tuple[str, datetime | None]], namespace: str) -> list[QueryBlobs]:
    """The namespace's snapshot blobs (name, written at) by query."""
    top = all_prefix(namespace)
    out: dict[str, QueryBlobs] = {}
    for name, written in listed:
        query_id, _, rest = name[len(top) :].partition("/")
        q = out.setdefault(query_id, QueryBlobs(query_id))
        q.names.append(name)
        at = written.timestamp() if written is not None else 0.0
        if rest == GONE:
            q.gone_at = at
        else:
            q.newest_at = max(q.newest_at or 0.0, at)
    return list(out.values())


def decide(q: QueryBlobs, *, has_checkpoint: bool, now: float, keep_s: float) -> str | None:
    """Why ``q``'s snapshots are reclaimed now (None: they are kept). Anything written since
    (a snapshot's packs, its index, a prune) keeps them: the query runs somewhere."""
    newest = q.newest_at or 0.0
    if q.gone_at is not None and newest <= q.gone_at and now - q.gone_at >= keep_s:
        return f"its location holds another query's checkpoint for {now - q.gone_at:.0f} s"
    if not has_checkpoint and now - newest >= keep_s:
        return (
            f"it has no checkpoint blob (retired) and nothing was written for {now - newest:.0f} s"
        )
    return None


async def reclaim(
    blobs: SnapshotStore,
    namespace: str,
    checkpoints: Callable[[], Awaitable[set[str]]],
    *,
    keep_s: float,
    now: float,
    busy: Iterable[str] = (),
) -> dict[str, int]:
    """One pass over the namespace (see the module docstring): query id → blobs deleted, for
    each query reclaimed. ``checkpoints()``: the ids of the queries with a checkpoint blob,
    asked after the listing; ``busy``: queries this daemon is snapshotting (never reclaimed).

    Raises:
        SidecarError: the store's errors after retries (what was deleted stays deleted).
    """
    listed = await retried("list snapshots", lambda: blobs.list(all_prefix(namespace)))
    queries = group(((b.name, b.last_modified) for b in listed), namespace)
    if not queries:
        return {}
    with_checkpoint = await checkpoints()
    skip = set(busy)
    done: dict[str, int] = {}
    for q in queries:
        if q.query_id in skip:
            continue
        why = decide(q, has_checkpoint=q.query_id in with_checkpoint, now=now, keep_s=keep_s)
        if why is None:
            continue
        ordered = sorted(q.names, key=lambda n: "/index/" not in n)  # indexes first
        for name in ordered:
            await retried("delete snapshot blob", lambda n=name: blobs.delete(n))  # type: ignore[misc]
        done[q.query_id] = len(ordered)
        log.warning(
            "snapshots of query %s reclaimed (%d blobs): %s (kept %.0f s: "
            "SIDECAR_SNAPSHOT_ABANDONED_KEEP_S)",
            q.query_id,
            len(ordered),
            why,
            keep_s,
        )
    return done
