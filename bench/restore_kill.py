"""``restore --all`` killed -9 at 10 points of a 1 GiB restore (issue #39): every next run ends
with exactly the snapshot's files and the sidecar's checkpoint at its batch, or a clear
refusal; never a partial directory kept.

The scenario is ``tests/faults/restore_kill.py``'s (the suite runs a small form of it,
``tests/faults/test_restore_kill.py``): redis-server and Azurite started here (request log
off); a Spark-shaped HDFS checkpoint of ``--mib`` MiB (3 MiB state snapshot files and
~100 KB deltas, as ``bench/snapshot_store.py``'s restore part) snapshotted at batch 5 from
``app/counts``; the sidecar's checkpoint document at batch 7 (the query ran on), which a
restore moves back to 5 under a lease of its own (no daemon runs: an init container).

1. ``--full-runs`` full ``python -m sidecar restore --all ROOT`` into empty roots, timed
   (and judged): their median is the duration the kill points are spread over.
2. For each of ``--points`` kill points spread over that time (5 %, 15 %, … 95 %): the
   document back at batch 7, ``restore --all`` into an empty root (a lost volume), SIGKILLed
   at that point; what it left (files, bytes, whether ``metadata`` existed, temporary
   directories); then ``restore --all`` again, not killed: its verdict (exact, refused, wrong)
   and seconds.
3. Kills at phases no time point is sure to hit, each as soon as it is seen: every byte
   downloaded (the syncs and the rename next), the files renamed into place (the checkpoint's
   move next), and the files in place with the checkpoint's move waiting for the lease an old
   pod's daemon still holds.
4. ``--kept-points`` kills of ``restore --all`` on a volume that holds the restored
   checkpoint (it keeps it), then a run again.

Results: ``bench/results/restore_kill.json``; exit code 1 when any next run is ``wrong``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from bench.common import BenchError, Report, bench_main, environment
from tests.faults.restore_kill import (
    Killed,
    Outcome,
    RestoreKill,
    downloaded,
    placed,
    stderr_says,
)
from tests.services import Azurite, RedisServer

MiB = 1024 * 1024
SNAPSHOT_BYTES = 3 * MiB
DELTA_BYTES = 100_000


def point(name: str, killed: Killed, after: Outcome, again: Outcome | None = None) -> Report:
    row: Report = {"point": name, "killed": asdict(killed), "next_run": asdict(after)}
    if again is not None:  # a refusal: is it for good?
        row["run_after_refusal"] = asdict(again)
    return row


def run(args: argparse.Namespace) -> Report:
    # Each kill point's document_ahead() is an admin reset in this process: its WARNING line
    # is the reset doing its job, not news.
    logging.getLogger("sidecar.ops.admin_steps").setLevel(logging.ERROR)
    with ExitStack() as cleanup:
        work = Path(tempfile.mkdtemp(prefix="restorekill-", dir="/tmp"))
        cleanup.callback(shutil.rmtree, work, ignore_errors=True)
        redis = cleanup.enter_context(RedisServer())
        azurite = cleanup.enter_context(Azurite(debug_log=False))
        partitions = max(1, round(args.mib * MiB / (SNAPSHOT_BYTES + 2 * DELTA_BYTES)))
        rk = RestoreKill(work, redis.url, azurite.port, partitions=partitions,
                         snapshot_bytes=SNAPSHOT_BYTES, delta_bytes=DELTA_BYTES)  # fmt: skip
        setup = rk.prepare()
        volumes = iter(range(1_000_000))

        def volume() -> Path:
            root = work / f"volume-{next(volumes)}"
            root.mkdir()
            return root

        def next_run(root: Path) -> tuple[Outcome, Outcome | None]:
            after = rk.run(root)
            again = rk.run(root) if after.verdict == "refused" else None
            shutil.rmtree(root)
            return after, again

        # The kill points are spread over the median of a few full runs: one run's time
        # swings with the machine's load, and a point past a run's end kills nothing.
        fulls: list[Outcome] = []
        full_root = volume()  # kept: the kept-volume points' volume
        for i in range(args.full_runs):
            if i:
                rk.document_ahead()
            root = full_root if i == 0 else volume()
            fulls.append(rk.run(root))
            if fulls[-1].verdict != "exact":
                raise BenchError(f"a restore --all that was not killed: {fulls[-1]}")
            if root != full_root:
                shutil.rmtree(root)
        duration = median(f.seconds for f in fulls)
        print(f"full restore --all: {[f.seconds for f in fulls]} s", flush=True)
        points: list[Report] = []
        for i in range(args.points):
            at = duration * (i + 0.5) / args.points
            rk.document_ahead()
            root = volume()
            killed = rk.killed(root, at_s=at)
            after, again = next_run(root)
            points.append(point(f"{100 * (i + 0.5) / args.points:.0f} %", killed, after, again))
            print(f"  {points[-1]['point']}: {killed.left} -> {after.verdict} "
                  f"in {after.seconds} s", flush=True)  # fmt: skip

        # Phases a time point is not sure to hit, each killed as soon as it is seen.
        phases: list[Report] = []
        for what, when in (
            ("every byte downloaded", lambda r: downloaded(r, rk.index.total_bytes)),
            ("renamed into place", placed),
        ):
            rk.document_ahead()
            root = volume()
            killed = rk.killed(root, when=when(root))
            after, again = next_run(root)
            phases.append(point(what, killed, after, again))
        rk.document_ahead()
        root = volume()
        with rk.lease_held():
            killed = rk.killed(root, when=stderr_says("waiting for the old owner's lease"))
        after, again = next_run(root)
        phases.append(point("files in place, move waiting for the lease", killed, after, again))

        # A pod restarted on its volume: it holds the restored checkpoint (batch 5, the
        # sidecar's checkpoint there too); restore --all keeps it.
        kept_full = rk.run(full_root)
        kept: list[Report] = []
        for i in range(args.kept_points):
            at = kept_full.seconds * (i + 1) / (args.kept_points + 1)
            killed = rk.killed(full_root, at_s=at)
            after = rk.run(full_root)
            kept.append(point(f"kept volume, {100 * (i + 1) / (args.kept_points + 1):.0f} %",
                              killed, after))  # fmt: skip
    every = [*points, *phases, *kept]
    verdicts = [p["next_run"]["verdict"] for p in every]
    return {
        "checkpoint": setup,
        "full_restores": [asdict(f) for f in fulls],
        "full_restore_median_s": duration,
        "kept_restore": asdict(kept_full),
        "points": points,
        "phase_points": phases,
        "kept_points": kept,
        "summary": {
            "points": len(every),
            # A point past its run's end (the run was quicker than the median) kills nothing.
            "killed": sum(p["killed"]["killed"] for p in every),
            "exact": verdicts.count("exact"),
            "refused": verdicts.count("refused"),
            "wrong": verdicts.count("wrong"),
            # What the killed runs left: a restore's temporary directory, or the location
            # with its metadata (files in place: the checkpoint's move cut short, or kept).
            "left_temp_dir": sum(bool(p["killed"]["left"]["temp_dirs"]) for p in every),
            "left_metadata": sum(p["killed"]["left"]["metadata"] for p in every),
            "next_run_max_s": max(p["next_run"]["seconds"] for p in every),
        },
        "environment": environment(["azure-storage-blob", "aiohttp"]),
    }


def show(report: Report) -> None:
    c = report["checkpoint"]
    print(f"restore --all killed -9: {c['files']} files, {c['bytes'] / MiB:.0f} MiB in "
          f"{c['packs']} packs; a full run {report['full_restore_median_s']:.2f} s (median), on a "
          f"volume that holds it {report['kept_restore']['seconds']:.2f} s")  # fmt: skip
    print(
        "  point                                       at_s  left: files      MiB meta  "
        "temp -> next run        s"
    )
    for p in [*report["points"], *report["phase_points"], *report["kept_points"]]:
        k, n = p["killed"], p["next_run"]
        left = k["left"]
        at = f"{k['at_s']:6.2f}" if k["killed"] else " ended"
        print(
            f"  {p['point'][:42]:42s} {at} {left['files']:11d} {left['bytes'] / MiB:8.1f} "
            f"{'yes' if left['metadata'] else 'no':>4s} {len(left['temp_dirs']):5d} -> "
            f"{n['verdict']:7s} {n['outcome'] or '-':9s} {n['seconds']:6.2f}"
        )
        for problem in n["problems"]:
            print(f"      {problem}")
        if n["said"]:
            print(f"      said: {n['said']}")
    print(f"  summary: {report['summary']}")


def ok(report: Report) -> bool:
    return bool(report["summary"]["wrong"] == 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--points", type=int, default=10)
    parser.add_argument("--kept-points", type=int, default=3)
    parser.add_argument("--full-runs", type=int, default=3)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    return bench_main("restore_kill", lambda: run(args), show, ok, save=not args.no_save)


if __name__ == "__main__":
    sys.exit(main())
