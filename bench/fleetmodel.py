"""The pure parts of bench/fleet.py: what a request to the blob store or a Redis command is
and what the daemon sends it for, the rates the settings imply, and the extrapolation of a
measured fleet to many drivers against published limits.

No I/O (the bench counts; this module names, models and scales), so
tests/unit/test_bench_tools.py checks it on made-up requests, commands and rates.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from sidecar.backoff import spread

# --- the blob store's requests ------------------------------------------------------------

#: The kinds a storage request is counted under, in the order tables show them.
STORE_KINDS = ("write", "lease", "read", "other")


def classify_request(method: str, target: str, headers: Mapping[str, str]) -> tuple[str, str]:
    """(kind, operation) of one Blob REST request: kind one of :data:`STORE_KINDS`, the
    operation by the REST API's name (``Put Blob``, ``Lease Blob (renew)`` …).

    ``target`` is the request line's path and query; ``headers`` have lower-case names. A
    ``Put Blob`` with ``If-None-Match: *`` is the daemon's create-if-absent before its first
    lease (an empty blob), named apart but a write all the same.
    """
    query = parse_qs(urlsplit(target).query)
    comp = query.get("comp", [""])[0]
    restype = query.get("restype", [""])[0]
    if comp == "lease":
        action = headers.get("x-ms-lease-action", "?").lower()
        return "lease", f"Lease Blob ({action})"
    if restype == "container":
        if comp == "list":
            return "read", "List Blobs"
        if not comp and method in ("GET", "HEAD"):
            return "other", "Get Container Properties"
        if not comp and method == "PUT":
            return "other", "Create Container"
        if not comp and method == "DELETE":
            return "other", "Delete Container"
        return "other", f"{method} container comp={comp}"
    if restype:  # the service or account (properties, statistics, account info)
        return "other", f"{method} {restype} comp={comp}"
    if method == "PUT":
        if comp == "blocklist":
            return "write", "Put Block List"
        if comp == "block":
            return "write", "Put Block"
        if comp == "metadata":
            return "write", "Set Blob Metadata"
        if comp == "properties":
            return "write", "Set Blob Properties"
        if not comp and "x-ms-copy-source" in headers:
            return "write", "Copy Blob"
        if not comp:
            create = headers.get("if-none-match") == "*"
            return "write", "Put Blob (create if absent)" if create else "Put Blob"
    if not comp and method == "GET":
        return "read", "Get Blob"
    if not comp and method == "HEAD":
        return "read", "Get Blob Properties"
    if not comp and method == "DELETE":
        return "other", "Delete Blob"
    if comp == "list":  # on the account: List Containers
        return "other", "List Containers"
    return "other", f"{method} comp={comp}"


# --- Redis' commands ---------------------------------------------------------------------


def script_shas(scripts: Mapping[str, str]) -> dict[str, str]:
    """sha1 (as EVALSHA sends it) -> name, for scripts given as name -> Lua text."""
    return {hashlib.sha1(text.encode()).hexdigest(): name for name, text in scripts.items()}


def sent_key(command: bytes | str, shas: Mapping[str, str]) -> str:
    """What a command a client sent is counted as, from its words as SLOWLOG (or MONITOR)
    gives them (``EVALSHA <sha> 3 …``): ``evalsha <script name>`` for EVALSHA, EVAL or FCALL
    of a known script, else the command's name in lower case (``get``, ``set`` …); a
    subcommand joins with ``|`` as in ``INFO commandstats`` (``config|set``)."""
    text = command.decode("utf-8", "replace") if isinstance(command, bytes) else command
    words = text.split(" ", 2)
    name = words[0].lower()
    if name in ("evalsha", "eval", "fcall") and len(words) > 1:
        return f"{name} {shas.get(words[1].lower(), 'unknown script')}"
    if name in ("config", "client", "slowlog", "script", "cluster") and len(words) > 1:
        return f"{name}|{words[1].lower()}"
    return name


#: Why the daemon sends each top-level command (keys as :func:`monitor_key` makes them).
REDIS_PURPOSES = {
    "evalsha apply": "store an update (one call per coalesced batch of updates): the ack",
    "evalsha pending": "flush check: which queries are due (every SIDECAR_FLUSH_INTERVAL_S)",
    "evalsha snapshot": "read the due queries' rows for their blob writes",
    "evalsha mark_flushed": "after each blob write: record the durable batch, clear pending",
    "get": "durability check: the namespace's marker is still there (every 1 s)",
    "set": "readiness (/readyz): a write of the namespace's probe key",
    "hget": "`get` requests (by id, name lookups), loss reports",
    "ping": "redis-py's check of a pooled connection idle for 30 s before it is used",
}


# --- what the settings imply ----------------------------------------------------------------


@dataclass(frozen=True)
class Cadence:
    """The daemon's fixed schedules (constants in its code, passed in by the bench)."""

    durability_check_s: float  # sidecar.daemon.durability.CHECK_INTERVAL_S
    threshold_jitter: float  # sidecar.flush.flusher.THRESHOLD_JITTER


@dataclass(frozen=True)
class Settings:
    """The settings that move a sidecar's cost (the daemon's defaults)."""

    count_threshold: int = 100
    time_threshold_s: float = 10.0
    flush_interval_s: float = 1.0
    lease_duration_s: int = 30
    write_timeout_s: float = 10.0


def flush_period_s(query_id: str, batches_per_s: float, s: Settings, cadence: Cadence) -> float:
    """Mean seconds between two blob writes of a query posting ``batches_per_s``: due at
    ``count_threshold`` updates or when its oldest pending update is ``time_threshold_s``
    times its own factor in [1 - jitter, 1] old, whichever comes first; then found by the
    next flush check (half an interval on average), and the next update comes half a batch
    interval after the write on average."""
    factor = 1 - cadence.threshold_jitter * spread(query_id)
    until_due = min(s.time_threshold_s * factor, (s.count_threshold - 1) / batches_per_s)
    return until_due + s.flush_interval_s / 2 + 0.5 / batches_per_s


def behind_s(s: Settings, batches_per_s: float) -> float:
    """How long an acknowledged batch waits for its blob write at most (the blob's
    staleness, before the write's own time): the threshold that comes first, plus one flush
    check interval."""
    return min(s.time_threshold_s, (s.count_threshold - 1) / batches_per_s) + s.flush_interval_s


def checks_with_a_write(writes_per_s: float, interval_s: float) -> float:
    """Flush checks per second that find at least one query due, each reading all the due
    rows in one snapshot: writes arriving at random (Poisson), ``1 - e^-(writes per
    check)`` of the checks."""
    return (1 - math.exp(-writes_per_s * interval_s)) / interval_s


def model_rates(
    query_ids: Sequence[str],
    batches_per_s: float,
    s: Settings,
    cadence: Cadence,
    *,
    readyz_every_s: float = 0.0,
) -> dict[str, dict[str, float]]:
    """Per-second rates one sidecar should show with these queries at these settings.

    ``storage``: writes (one Put Blob per flush), lease renewals (one per held lease every
    third of its duration), the idle ping (container properties, only when no call ended
    for a write timeout). ``redis`` (top-level commands): one apply per update (nothing to
    coalesce at one update per query per second on one connection), one pending-index read
    per flush check, one snapshot per check that finds a query due and one mark per
    write, the marker read and the readiness probe's write.
    """
    writes = sum(1 / flush_period_s(q, batches_per_s, s, cadence) for q in query_ids)
    idle = not query_ids
    return {
        "storage": {
            "write": writes,
            "lease": len(query_ids) * 3 / s.lease_duration_s,
            "read": 0.0,
            "other": 1 / s.write_timeout_s if idle else 0.0,
        },
        "redis": {
            "evalsha apply": len(query_ids) * batches_per_s,
            "evalsha pending": 1 / s.flush_interval_s,
            "evalsha snapshot": checks_with_a_write(writes, s.flush_interval_s),
            "evalsha mark_flushed": writes,
            "get": 1 / cadence.durability_check_s,
            "set": 1 / readyz_every_s if readyz_every_s > 0 else 0.0,
        },
    }


# --- from a measured fleet to many drivers ----------------------------------------------------


@dataclass(frozen=True)
class Limit:
    """A published capacity of one unit (a Redis node, a storage account), per second."""

    name: str
    per_s: float
    source: str


#: Redis: requests/s one node serves for simple 1-KB GET/SET (redis-benchmark). A script
#: call costs more than one simple command: the bench also measures Redis' CPU (REDIS_CORE).
REDIS_LIMITS = (
    Limit(
        "Redis node, simple commands (~100,000/s, no pipelining)",
        100_000,
        "redis.io, 'Redis benchmark' (redis-benchmark on a Linux box: on the order of "
        "100,000 SET/GET per second per node without pipelining)",
    ),
    Limit(
        "Azure Cache for Redis Standard C1, TLS",
        20_720,
        "Microsoft Learn, 'Azure Cache for Redis planning FAQs', performance table "
        "(1-KB values, redis-benchmark): C1 38,000 RPS non-TLS, 20,720 TLS",
    ),
    Limit(
        "Azure Cache for Redis Premium P1 (per shard), TLS",
        172_000,
        "Microsoft Learn, 'Azure Cache for Redis planning FAQs': P1 180,000 RPS non-TLS, "
        "172,000 TLS per shard",
    ),
)
#: Redis runs commands on one thread: one core's CPU time per second is what a node has. The
#: bench measures Redis' CPU per sidecar on its own machine (a cloud node's core differs).
REDIS_CORE = Limit(
    "one Redis core (this machine), µs of CPU per second",
    1_000_000,
    "Redis executes commands on one thread (redis.io, 'Redis benchmark': Redis is mostly "
    "single-threaded); measured on the bench machine",
)
STORAGE_ACCOUNT = Limit(
    "storage account (standard, GPv2)",
    20_000,
    "Microsoft Learn, 'Scalability and performance targets for standard storage accounts': "
    "maximum request rate per storage account 20,000 requests per second",
)
SINGLE_BLOB = Limit(
    "one blob",
    500,
    "Microsoft Learn, 'Scalability and performance targets for Blob storage': target request "
    "rate for a single blob up to 500 requests per second",
)


def extrapolate(per_sidecar_per_s: float, drivers: int, limit: Limit) -> dict[str, float | int]:
    """A fleet of ``drivers`` sidecars against one unit of ``limit``: the fleet's rate, its
    share of the unit, how many sidecars one unit carries and how many units the fleet
    needs (at 100 % of the published figure: plan with headroom)."""
    fleet = per_sidecar_per_s * drivers
    carries = math.floor(limit.per_s / per_sidecar_per_s) if per_sidecar_per_s > 0 else 0
    return {
        "fleet_per_s": round(fleet, 1),
        "share_of_limit": round(fleet / limit.per_s, 4),
        "sidecars_per_unit": carries,
        "units_needed": math.ceil(fleet / limit.per_s) if fleet else 0,
    }


def per_second(deltas: Mapping[str, float], seconds: float, sidecars: int) -> dict[str, float]:
    """Counts over a window -> per sidecar per second, rounded, zeros left out, largest
    first."""
    if seconds <= 0 or sidecars <= 0:
        raise ValueError("a window and a fleet are needed")
    rates = {k: v / seconds / sidecars for k, v in deltas.items() if v}
    return {k: round(v, 4) for k, v in sorted(rates.items(), key=lambda kv: -kv[1])}


def by_kind(per_operation: Mapping[str, float], kinds: Mapping[str, str]) -> dict[str, float]:
    """Rates per operation summed per kind (``kinds``: operation -> kind), every kind of
    :data:`STORE_KINDS` present, plus ``total``."""
    out = dict.fromkeys(STORE_KINDS, 0.0)
    for op, rate in per_operation.items():
        out[kinds[op]] += rate
    out = {k: round(v, 4) for k, v in out.items()}
    out["total"] = round(sum(per_operation.values()), 4)
    return out


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub markdown table; numbers as given (format them first)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# --- snapshots: storage traffic per sidecar (a model) -------------------------------------------

MiB = 1024 * 1024

#: An account's ingress, the bytes side of snapshots (GPv2, regions not in the 60 Gbps list).
ACCOUNT_INGRESS = Limit(
    "storage account ingress (standard GPv2, 25 Gbps)",
    25e9 / 8,
    "Microsoft Learn, 'Scalability and performance targets for standard storage accounts': "
    "default maximum ingress per GPv2 account 60 Gbps in the listed regions, 25 Gbps in others",
)


@dataclass(frozen=True)
class CheckpointGrowth:
    """How one stateful query's checkpoint grows per batch (measured: issue #29's figures)."""

    label: str
    new_files: float
    new_bytes: float
    #: The whole directory (what a full copy per batch uploads).
    dir_files: int
    dir_bytes: float
    #: One snapshot's index (it lists the cut: the files Spark needs for the next batch).
    index_bytes: float


def pack_requests(
    new_bytes: float, *, pack_bytes: int = 8 * MiB, block_bytes: int = 4 * MiB
) -> int:
    """Requests that upload ``new_bytes`` of small contents in packs (sidecar.snapshot.upload):
    a pack up to a block is one Put Blob, a larger one a Put Block per block and a Put Block
    List."""
    if new_bytes <= 0:
        return 0
    requests, left = 0, new_bytes
    while left > 0:
        pack = min(left, pack_bytes)
        requests += 1 if pack <= block_bytes else math.ceil(pack / block_bytes) + 1
        left -= pack
    return requests


def snapshot_traffic(
    growth: CheckpointGrowth,
    queries: int,
    batches_per_s: float,
    *,
    prune_every_s: float = 300,
) -> dict[str, dict[str, float]]:
    """Storage requests and bytes per second one sidecar sends for its queries' snapshots, a
    snapshot per batch: the sidecar's (packs and an index; in time each written blob is
    deleted once, and a prune pass lists, reads and writes its marks), a file-by-file
    incremental copy (a request per new file) and a full copy per batch (every file)."""
    snapshots = queries * batches_per_s
    packs = pack_requests(growth.new_bytes)
    writes = packs + 1  # packs, then the index
    deletes = math.ceil(growth.new_bytes / (8 * MiB)) + 1  # each pack and index, once
    prune = queries * 3 / prune_every_s
    index = growth.index_bytes
    return {
        "sidecar": {
            "requests_per_snapshot": writes,
            "requests_per_s": round(snapshots * (writes + deletes) + prune, 2),
            "bytes_per_s": round(snapshots * (growth.new_bytes + index)),
        },
        "file by file": {
            "requests_per_snapshot": growth.new_files + 1,
            "requests_per_s": round(snapshots * (growth.new_files + 1), 2),
            "bytes_per_s": round(snapshots * growth.new_bytes),
        },
        "full copy": {
            "requests_per_snapshot": growth.dir_files,
            "requests_per_s": round(snapshots * growth.dir_files, 2),
            "bytes_per_s": round(snapshots * growth.dir_bytes),
        },
    }


def snapshot_fleet(
    growth: CheckpointGrowth, queries: int, batches_per_s: float, drivers: int
) -> dict[str, Any]:
    """:func:`snapshot_traffic` of one sidecar, and of ``drivers`` sidecars sharing one storage
    account: each way of copying against the account's request rate and its ingress."""
    traffic = snapshot_traffic(growth, queries, batches_per_s)
    return {
        "growth": asdict(growth),
        "queries_per_sidecar": queries,
        "batches_per_s_per_query": batches_per_s,
        "per_sidecar": traffic,
        "drivers": drivers,
        "requests": {
            how: extrapolate(t["requests_per_s"], drivers, STORAGE_ACCOUNT)
            for how, t in traffic.items()
        },
        "ingress": {
            how: extrapolate(t["bytes_per_s"], drivers, ACCOUNT_INGRESS)
            for how, t in traffic.items()
        },
        "limits": {
            "requests": asdict(STORAGE_ACCOUNT),
            "ingress_bytes": asdict(ACCOUNT_INGRESS),
        },
    }
