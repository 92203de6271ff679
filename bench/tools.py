"""The pure parts of the benchmarks: percentiles, open-loop schedules and their lateness,
ratios of paired rounds, and the count of blob transactions in Azurite's request log.

No I/O here (callers read files and clocks), so tests/unit/test_bench_tools.py checks it on
made-up numbers.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from statistics import median

#: A send later than this after its scheduled time counts as late: the client's own loop
#: could not keep to the schedule (the latency, taken from the schedule, includes it anyway).
LATE_AFTER_S = 0.001
#: An open-loop run sustains its rate when what completed in the second half of the window
#: came at least this close to the rate (the first half absorbs the latency's ramp-up), and
#: at least this share of all its requests was answered (within the grace after it).
SUSTAIN_FRACTION = 0.95
COMPLETED_FRACTION = 0.99


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between closest ranks (like
    ``statistics.quantiles(method="inclusive")``); ``values`` need not be sorted.

    Raises:
        ValueError: ``values`` is empty or ``q`` is outside 0-100.
    """
    if not values:
        raise ValueError("no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0-100")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def latency_summary_ms(seconds: Sequence[float]) -> dict[str, float | int]:
    """p50 / p99 / p99.9 / max in milliseconds of latencies given in seconds."""
    if not seconds:
        return {"samples": 0}
    out: dict[str, float | int] = {"samples": len(seconds)}
    for name, q in (("p50_ms", 50.0), ("p99_ms", 99.0), ("p99_9_ms", 99.9)):
        out[name] = round(percentile(seconds, q) * 1000, 3)
    out["max_ms"] = round(max(seconds) * 1000, 3)
    return out


def schedule(start: float, rate_per_s: float, duration_s: float) -> list[float]:
    """Absolute send times of an open-loop run: ``rate_per_s`` evenly spaced from ``start``
    for ``duration_s`` (times never depend on when earlier requests were answered)."""
    return [start + i / rate_per_s for i in range(round(rate_per_s * duration_s))]


def due_count(times: Sequence[float], now: float, sent: int) -> int:
    """How many of ``times`` (sorted) are due at ``now``, given ``sent`` already were: the
    sender sends ``times[sent:due_count(...)]`` in one go when it wakes up late."""
    n = sent
    while n < len(times) and times[n] <= now:
        n += 1
    return n


@dataclass
class OpenLoop:
    """The record of one open-loop run. Times are in seconds on one clock."""

    rate_per_s: float
    duration_s: float
    scheduled: list[float]
    #: When each request actually went out (same order as ``scheduled``; may be shorter).
    sent: list[float] = field(default_factory=list)
    #: When each request was answered positively, None while not (same order).
    done: list[float | None] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        """Latency from the *scheduled* send time (a stall of the client or the server
        shows, and requests queued behind it), sends late, and whether the rate held."""
        start = self.scheduled[0] if self.scheduled else 0.0
        lat = [d - s for s, d in zip(self.scheduled, self.done, strict=False) if d is not None]
        late = [a - s for s, a in zip(self.scheduled, self.sent, strict=False)]
        half, end = start + self.duration_s / 2, start + self.duration_s
        second_half = sum(1 for d in self.done if d is not None and half <= d < end)
        achieved = second_half / (self.duration_s / 2) if self.duration_s > 0 else 0.0
        sustained = (achieved >= SUSTAIN_FRACTION * self.rate_per_s
                     and len(lat) >= COMPLETED_FRACTION * len(self.scheduled))  # fmt: skip
        return {
            "rate_per_s": self.rate_per_s,
            "duration_s": self.duration_s,
            "scheduled": len(self.scheduled),
            "sent": len(self.sent),
            "completed": len(lat),
            "not_completed": len(self.scheduled) - len(lat),
            "sent_late": sum(1 for x in late if x > LATE_AFTER_S),
            "max_send_lateness_ms": round(max(late, default=0.0) * 1000, 3),
            "achieved_rate_per_s": round(achieved, 1),
            "sustained": sustained,
            "latency_from_schedule": latency_summary_ms(lat),
        }


#: The batch id a :class:`LineTemplate` is made from: distinctive digits, 7 of them.
TEMPLATE_BATCH = 7_777_777


class LineTemplate:
    """Request lines of one query for any batch id, by substitution into one encoded line
    (~1 µs instead of ~20 µs to build and encode the progress: the client must not compete
    with the daemon for the cores).

    ``line`` is a request for batch :data:`TEMPLATE_BATCH` in which every number derived
    from the batch id is written as that batch id's or the next one's decimal digits
    followed by other digits (e.g. Kafka offsets ``batch * 100 + partition`` with fewer than
    100 partitions), so substituting the digits of ``b`` and ``b + 1`` gives batch ``b``'s
    line. Batch ids from 1 on (batch 0 has no start offsets).
    """

    def __init__(self, line: bytes) -> None:
        if b"\0" in line or b"\1" in line:  # JSON text escapes control characters
            raise ValueError("a request line holds no raw control character")
        after = str(TEMPLATE_BATCH + 1).encode()
        self._template = line.replace(after, b"\1").replace(str(TEMPLATE_BATCH).encode(), b"\0")

    def line(self, batch_id: int) -> bytes:
        if batch_id < 1:
            raise ValueError("batch ids from 1 on")
        this, after = str(batch_id).encode(), str(batch_id + 1).encode()
        return self._template.replace(b"\0", this).replace(b"\1", after)


def paired_ratios(
    values: Sequence[float | None], reference: Sequence[float | None]
) -> dict[str, float | None]:
    """Per-round ratios ``values[i] / reference[i]`` (rounds run back to back, so each pair
    saw the same machine load) and their median; rounds where either is None (not
    measured, e.g. CPU per update with no update) or the reference is 0 are left out.
    Also each side's own median (over its measured rounds)."""
    pairs = [v / r for v, r in zip(values, reference, strict=True) if v is not None and r]
    mine = [v for v in values if v is not None]
    ref = [r for r in reference if r is not None]
    return {
        "median": round(median(mine), 3) if mine else None,
        "reference_median": round(median(ref), 3) if ref else None,
        "ratio_median": round(median(pairs), 3) if pairs else None,
        "ratio_min": round(min(pairs), 3) if pairs else None,
        "ratio_max": round(max(pairs), 3) if pairs else None,
    }


def rotated(items: Sequence[str], round_no: int) -> list[str]:
    """``items`` starting at ``round_no`` (mod len): each subject leads a round in turn."""
    k = round_no % len(items) if items else 0
    return [*items[k:], *items[:k]]


# --- Azurite's request log ---------------------------------------------------------------------

#: Azurite's operation names (its DispatchMiddleware) -> the REST API's names.
OPERATION_NAMES = {
    "BlockBlob_Upload": "Put Blob",
    "Blob_Download": "Get Blob",
    "Blob_GetProperties": "Get Blob Properties",
    "Blob_SetMetadata": "Set Blob Metadata",
    "Blob_AcquireLease": "Lease Blob (acquire)",
    "Blob_RenewLease": "Lease Blob (renew)",
    "Blob_ReleaseLease": "Lease Blob (release)",
    "Blob_BreakLease": "Lease Blob (break)",
    "Blob_ChangeLease": "Lease Blob (change)",
    "Blob_Delete": "Delete Blob",
    "Container_ListBlobFlatSegment": "List Blobs",
    "Container_ListBlobHierarchySegment": "List Blobs",
    "Container_Create": "Create Container",
    "Container_GetProperties": "Get Container Properties",
}
# "<time> <request id> <level>: <component>: <message>"; service lines have no request id.
_LINE = re.compile(r"^\S+ ([0-9a-f-]{36}) \w+: (\w+): (.*)$")
_CONTAINER = re.compile(r"Container=(\S*)")
_OPERATION = re.compile(r"Operation=(\w+)")
_STATUS = re.compile(r"StatusCode=(\d+)")


class AzuriteLogCounter:
    """Counts requests per container and operation in Azurite's ``--debug`` log.

    Azurite logs ~40 lines per request, each carrying the request's id: the container
    (``BlobStorageContextMiddleware: Account=… Container=…``), the operation
    (``DispatchMiddleware: Operation=…``) and, last, the status (``EndMiddleware: …
    StatusCode=…``). A request is counted when its end line is read, so a log read while
    requests are under way counts only finished ones; feed the log in chunks of any size
    (an incomplete last line is kept for the next chunk).
    """

    def __init__(self) -> None:
        self._partial = ""
        self._open: dict[str, dict[str, str]] = {}
        #: (container, operation name) -> finished requests.
        self.counts: Counter[tuple[str, str]] = Counter()
        #: (container, operation name) -> finished requests answered with status >= 400.
        self.failed: Counter[tuple[str, str]] = Counter()

    def feed(self, text: str) -> None:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self._line(line)

    def _line(self, line: str) -> None:
        m = _LINE.match(line)
        if m is None:
            return
        rid, component, message = m.groups()
        req = self._open.setdefault(rid, {})
        if component == "BlobStorageContextMiddleware" and (c := _CONTAINER.search(message)):
            req["container"] = c.group(1)
        elif component == "DispatchMiddleware" and (o := _OPERATION.search(message)):
            req["operation"] = OPERATION_NAMES.get(o.group(1), o.group(1))
        elif component == "EndMiddleware" and (s := _STATUS.search(message)):
            del self._open[rid]
            key = (req.get("container", ""), req.get("operation", "(not dispatched)"))
            self.counts[key] += 1
            if int(s.group(1)) >= 400:
                self.failed[key] += 1

    def of(self, containers: Iterable[str]) -> Counter[str]:
        """Finished requests per operation, over the given containers."""
        wanted = set(containers)
        out: Counter[str] = Counter()
        for (container, operation), n in self.counts.items():
            if container in wanted:
                out[operation] += n
        return out


def per_10k(counts: Counter[str], updates: int) -> dict[str, float]:
    """``counts`` scaled to 10,000 updates, with a ``total``; most frequent first."""
    if updates <= 0:
        return {}
    scaled = {op: round(n * 10_000 / updates, 1) for op, n in counts.most_common()}
    return {"total": round(sum(counts.values()) * 10_000 / updates, 1), **scaled}
