"""The pure parts of bench/snapshots.py: backup lags (commit → the first snapshot or copy
that holds the batch), what each snapshot uploaded against what was new in its cut (from the
indexes in order), contents uploaded twice, a directory walk's new files, and percentiles.

No I/O (the bench reads clocks, logs, directories and blobs; this module compares them), so
tests/unit/test_bench_snapshots.py checks it on made-up commits, snapshots and indexes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from bench.tools import percentile

# --- backup lag ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    """A copy of a query's checkpoint that holds every batch up to ``batch``, complete at
    ``at`` (seconds, wall clock): a snapshot's index written, or a full copy's last upload."""

    batch: int
    at: float


@dataclass(frozen=True)
class Lag:
    """Batch ``batch``, committed at ``committed_at`` (its ``commits/N`` file's mtime), first
    held by the copy of ``by_batch`` complete at ``stored_at`` (None: no copy holds it)."""

    batch: int
    committed_at: float
    stored_at: float | None
    by_batch: int | None

    @property
    def seconds(self) -> float | None:
        return None if self.stored_at is None else self.stored_at - self.committed_at

    @property
    def coalesced(self) -> bool:
        """Held first by a copy of a later batch (the one of this batch was skipped)."""
        return self.by_batch is not None and self.by_batch > self.batch


def backup_lags(commits: Mapping[int, float], stored: Iterable[Stored]) -> list[Lag]:
    """For each committed batch N (batch → commit time), the first copy that holds it: the
    earliest complete among those of a batch ≥ N (a copy of batch b is taken once
    ``commits/b`` exists, so after every commit ≤ b). Sorted by batch."""
    by_batch = sorted(stored, key=lambda s: -s.batch)
    out: list[Lag] = []
    best: Stored | None = None
    i = 0
    for batch in sorted(commits, reverse=True):
        while i < len(by_batch) and by_batch[i].batch >= batch:
            if best is None or by_batch[i].at < best.at:
                best = by_batch[i]
            i += 1
        out.append(
            Lag(batch, commits[batch], best.at if best else None, best.batch if best else None)
        )
    return out[::-1]


def lag_summary(lags: Sequence[Lag], end: float | None = None) -> dict[str, float | int | None]:
    """Count, percentiles (seconds) of the lags of held batches, how many were coalesced
    into a later batch's copy and how many no copy held; with ``end`` (when the copies
    stopped), how long the oldest batch not held had waited by then (its lag's lower bound)."""
    held = [s for lag in lags if (s := lag.seconds) is not None]
    waiting = [end - lag.committed_at for lag in lags if lag.stored_at is None and end]
    out: dict[str, float | int | None] = {
        "batches": len(lags),
        "not_held": len(lags) - len(held),
        "coalesced": sum(lag.coalesced for lag in lags),
        **spread_s(held),
    }
    if end is not None:
        out["not_held_waited_s"] = round(max(waiting), 3) if waiting else None
    return out


# --- what each snapshot uploaded -------------------------------------------------------------


@dataclass(frozen=True)
class IndexFacts:
    """One snapshot's index, as much as the comparison needs: each file's path → (size,
    SHA-256, pack id, offset in the pack), and each pack it uses → size."""

    batch: int
    files: Mapping[str, tuple[int, bytes, str, int]]
    packs: Mapping[str, int]


@dataclass(frozen=True)
class Change:
    """One snapshot against the previous one of its query."""

    batch: int
    files: int
    cut_bytes: int
    #: Files of the cut that the previous cut did not have with these bytes (new path, or
    #: other size or content), and their bytes: what a copy of changed files would send.
    new_files: int
    new_bytes: int
    #: Bytes of contents no earlier snapshot had stored (each once): the least to upload.
    new_content_bytes: int
    #: Bytes of the packs this snapshot named first (it wrote them): what it uploaded.
    uploaded_bytes: int
    #: Contents in those packs that an earlier snapshot had stored already, or that they
    #: hold twice.
    duplicate_files: int
    duplicate_bytes: int
    #: The query's first snapshot (everything is new).
    first: bool

    @property
    def uploaded_per_new_byte(self) -> float | None:
        return self.uploaded_bytes / self.new_bytes if self.new_bytes else None


def changes(indexes: Sequence[IndexFacts]) -> list[Change]:
    """Each snapshot of one query, in the order written, against the one before it and
    against everything stored before it."""
    out: list[Change] = []
    previous: Mapping[str, tuple[int, bytes, str, int]] = {}
    stored: set[bytes] = set()
    known_packs: set[str] = set()
    for n, index in enumerate(indexes):
        new = [
            (size, sha)
            for path, (size, sha, _, _) in index.files.items()
            if previous.get(path, (None, None))[:2] != (size, sha)
        ]
        fresh = {sha: size for size, sha in new if sha not in stored}
        first_named = {p: s for p, s in index.packs.items() if p not in known_packs}
        places: dict[bytes, set[tuple[str, int]]] = {}
        sizes: dict[bytes, int] = {}
        for size, sha, pack, offset in index.files.values():
            if pack in first_named:
                places.setdefault(sha, set()).add((pack, offset))
                sizes[sha] = size
        # Each place of a content beyond its first, and its first too if stored before.
        twice = {sha: len(at) - (sha not in stored) for sha, at in places.items()}
        out.append(
            Change(
                batch=index.batch,
                files=len(index.files),
                cut_bytes=sum(f[0] for f in index.files.values()),
                new_files=len(new),
                new_bytes=sum(size for size, _ in new),
                new_content_bytes=sum(fresh.values()),
                uploaded_bytes=sum(first_named.values()),
                duplicate_files=sum(twice.values()),
                duplicate_bytes=sum(k * sizes[sha] for sha, k in twice.items()),
                first=n == 0,
            )
        )
        previous = index.files
        stored.update(f[1] for f in index.files.values())
        known_packs.update(index.packs)
    return out


# --- a directory walked per batch (the full copy's, and a file-by-file copy's count) --------


def new_since(
    before: Mapping[str, tuple[int, int]], now: Mapping[str, tuple[int, int]]
) -> tuple[int, int]:
    """(files, bytes) of ``now`` (path → (size, mtime ns)) not in ``before`` as they are:
    what a copy of new and changed files (one request each) would send."""
    new = [size for path, (size, stamp) in now.items() if before.get(path) != (size, stamp)]
    return len(new), sum(new)


# --- numbers ---------------------------------------------------------------------------------


def spread(values: Sequence[float], digits: int = 3) -> dict[str, float | int | None]:
    """n, p50, p90, p99 and max of ``values`` (None each when there are none)."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "n": len(values),
        **{f"p{q}": round(percentile(values, q), digits) for q in (50, 90, 99)},
        "max": round(max(values), digits),
    }


def spread_s(seconds: Sequence[float]) -> dict[str, float | int | None]:
    """:func:`spread` with keys naming the unit (``p99_s``)."""
    return {(k if k == "n" else f"{k}_s"): v for k, v in spread(seconds).items()}


def ratio(value: float | None, reference: float | None, digits: int = 3) -> float | None:
    """``value / reference``, None when either is missing or the reference is 0."""
    if value is None or not reference:
        return None
    return round(value / reference, digits)


def files_per_batch(commits: Mapping[int, float], mtimes: Iterable[float]) -> dict[int, int]:
    """Files written for each batch N (> the first committed), counted by their mtime between
    ``commits/N-1`` and ``commits/N`` (both times from ``commits``: batch → mtime): the
    requests a copy of new files after each batch would send. Files after the last commit
    belong to a batch not committed yet and are left out."""
    order = sorted(commits.items())
    counts = {batch: 0 for batch, _ in order[1:]}
    bounds = [t for _, t in order]
    for t in mtimes:
        # The first commit at or after the file: the batch that wrote it.
        lo, hi = 0, len(bounds)
        while lo < hi:
            mid = (lo + hi) // 2
            if bounds[mid] < t:
                lo = mid + 1
            else:
                hi = mid
        if 0 < lo < len(order):
            counts[order[lo][0]] += 1
    return counts


def overlapping(spans: Sequence[tuple[float, float]], start: float, end: float) -> bool:
    """Whether [start, end] meets one of ``spans`` (each (from, to))."""
    return any(a <= end and start <= b for a, b in spans)
