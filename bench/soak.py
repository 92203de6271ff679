"""Soak benchmark: the seeded nemesis soak of tests/faults/nemesis.py for longer (default 30
minutes): two daemons on one namespace under load, a random fault every few seconds.

Writes ``bench/results/soak.json``: the seed (the same seed replays the same faults), faults
injected by kind, updates acknowledged, lost (0: every acknowledged batch in its blob and in
Redis after healing), backward moves (0), the longest any acknowledged batch waited to be
seen in its blob, and the daemons' exit codes on SIGTERM. Exit code 1 when an invariant broke.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from bench.common import BenchError, Report, bench_main, environment
from tests.faults.nemesis import run_soak


def run(seed: int, seconds: float) -> Report:
    tmp = Path(tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
    try:
        return {"environment": environment(), **run_soak(seed, seconds, tmp)}
    except AssertionError as exc:
        raise BenchError(f"an invariant broke: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def show(report: Report) -> None:
    print(f"soak: seed {report['seed']}, {report['duration_s']:.0f} s")
    print(f"  faults: {report['faults_total']} {report['faults_injected']}")
    print(
        f"  acked {report['updates_acked']}, lost {report['lost']}, backward moves "
        f"{report['backward_moves']} (store losses rewritten "
        f"{report['store_losses_rewritten']}), longest blob lag behind an ack "
        f"{report['longest_blob_lag_behind_an_ack_s']} s, daemon restarts "
        f"{report['daemon_restarts']}, SIGTERM exits {sorted(set(report['sigterm_exit_codes']))}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=20261125)
    args = parser.parse_args()
    return bench_main("soak", lambda: run(args.seed, args.seconds), show)


if __name__ == "__main__":
    sys.exit(main())
