"""What a snapshot's listing and cut cost: every file stat-ed, against names alone and a stat of
only what the cut keeps (``sidecar.snapshot.source.names_of`` / ``stat_of``).

Writes a synthetic checkpoint as Spark leaves one with its defaults (``--batches`` retained
batches, 100 by ``minBatchesToRetain``; one stateful operator on the HDFS provider with
``--partitions`` partitions, a delta per version with its ``.crc``, a snapshot every 10
versions) in a temporary directory, then times, alternating and in the same process, the two
ways of taking the cut of its last batch (the same cut, checked): ``every_stat`` (the listing
stat-ed whole, as before) and ``names`` (names from the directories, stats of the files kept).
Reports the files listed and stat-ed each way and the median time of ``--rounds`` each; on a
network volume (NFS, Azure Files) each stat is a round trip, so the stats are the figure that
carries over. Results: ``bench/results/cut_listing.json``.

    .venv/bin/python bench/cut_listing.py [--batches 100] [--partitions 20] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import BenchError, Report, bench_main
from sidecar.snapshot.cut import HDFS_PROVIDER, PROVIDER_CONF, Cut, ListedFile, cut_of, cut_of_names
from sidecar.snapshot.source import names_of, read_small, stat_of

QUERY_ID = "6f9619ff-8b86-d011-b42d-00cf4fc964ff"


def write_checkpoint(top: Path, batches: int, partitions: int) -> int:
    """The synthetic checkpoint under ``top``; its number of files."""
    count = 0

    def put(rel: str, data: bytes = b"x") -> None:
        nonlocal count
        path = top / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        count += 1

    conf = {"spark.sql.shuffle.partitions": str(partitions), PROVIDER_CONF: HDFS_PROVIDER}
    meta = json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": 1000, "conf": conf})
    put("metadata", json.dumps({"id": QUERY_ID}).encode())
    put(".metadata.crc")
    for b in range(batches):
        put(f"offsets/{b}", "\n".join(["v1", meta, json.dumps({"t": {"0": b}})]).encode())
        put(f"offsets/.{b}.crc")
        put(f"commits/{b}", b'v1\n{"nextBatchWatermarkMs":0}')
        put(f"commits/.{b}.crc")
    for p in range(partitions):
        for v in range(1, batches + 2):
            put(f"state/0/{p}/{v}.delta", b"d" * 64)
            put(f"state/0/{p}/.{v}.delta.crc")
            if v % 10 == 0:
                put(f"state/0/{p}/{v}.snapshot", b"s" * 64)
    return count


def measure(args: argparse.Namespace) -> Report:
    top = Path(tempfile.mkdtemp(prefix="cps-cut-listing-"))
    try:
        files = write_checkpoint(top, args.batches, args.partitions)
        batch = args.batches - 1
        stats = {"every_stat": 0, "names": 0}

        def counted(
            way: str, stat: Callable[[Path, str], ListedFile]
        ) -> Callable[[str], ListedFile]:
            def call(path: str) -> ListedFile:
                stats[way] += 1
                return stat(top, path)

            return call

        def every_stat() -> Cut:  # the listing as it was: a stat per file
            listing = [stat_of(top, path) for path in names_of(top)]
            stats["every_stat"] += len(listing)
            return cut_of(listing, partial(read_small, top), batch)

        def names() -> Cut:
            return cut_of_names(
                names_of(top), partial(read_small, top), counted("names", stat_of), batch
            )

        if every_stat() != names():
            raise BenchError("the two ways took different cuts")
        kept = len(names().files)
        per_cut = {way: stats[way] // (2 if way == "names" else 1) for way in stats}
        times: dict[str, list[float]] = {"every_stat": [], "names": []}
        ways = {"every_stat": every_stat, "names": names}
        for i in range(args.rounds):
            for way in ("every_stat", "names") if i % 2 else ("names", "every_stat"):
                began = time.perf_counter()
                ways[way]()
                times[way].append((time.perf_counter() - began) * 1000)
        ms = {way: round(median(t), 1) for way, t in times.items()}
        return {
            "checkpoint": {"batches": args.batches, "partitions": args.partitions, "files": files},
            "cut_files": kept,
            "stats_per_cut": per_cut,
            "median_ms": ms,
            "rounds": args.rounds,
            "ratio_every_stat_to_names": round(ms["every_stat"] / ms["names"], 2),
        }
    finally:
        shutil.rmtree(top, ignore_errors=True)


def show(report: Report) -> None:
    c, s, ms = report["checkpoint"], report["stats_per_cut"], report["median_ms"]
    print(f"cut of batch {c['batches'] - 1}: {c['files']} files listed, {report['cut_files']} kept")
    print(f"  every file stat-ed: {s['every_stat']} stats, {ms['every_stat']} ms (median)")
    print(f"  names, then stats of what is kept: {s['names']} stats, {ms['names']} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--partitions", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    return bench_main("cut_listing", lambda: measure(args), show)


if __name__ == "__main__":
    sys.exit(main())
