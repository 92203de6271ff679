"""The nemesis soak's short run (``tests/faults/nemesis.py``; 30 minutes: ``bench/soak.py``):
two daemons on one namespace, load on both, a seeded random fault every few seconds. Nothing
acknowledged is lost, nothing moves backwards, every SIGTERM exits 0. ``SOAK_SEED`` and
``SOAK_S`` choose the seed (printed, to replay) and the length."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from tests.faults.nemesis import KINDS, Soak, schedule

#: The short run of `make test`: a seed whose first 40 s strike with every kind of fault
#: (``bench/soak.py`` and ``make soak`` run for longer).
SEED = int(os.environ.get("SOAK_SEED", "20262269"))
SECONDS = float(os.environ.get("SOAK_S", "40"))


def test_the_schedule_is_a_function_of_the_seed_alone() -> None:
    assert schedule(7, 600) == schedule(7, 600)
    assert schedule(7, 600) != schedule(8, 600)
    steps = schedule(SEED, 1800)
    assert {s.kind for s in steps} == set(KINDS)  # 30 minutes strike with every kind
    assert all(b.at_s >= a.at_s + a.duration_s for a, b in itertools.pairwise(steps))


@pytest.mark.slow
async def test_a_seeded_nemesis_soak_loses_nothing_and_moves_nothing_backwards(
    short_tmp: Path,
) -> None:
    report = await Soak(SEED, SECONDS, short_tmp).run()
    print(f"soak: {report}")
    assert report["faults_total"] == len(schedule(SEED, SECONDS)) > 5
    assert {s.kind for s in schedule(SEED, SECONDS)} == set(KINDS) or SECONDS != 40
    assert report["backward_moves"] == 0 and report["updates_acked"] > 1000
    assert set(report["sigterm_exit_codes"]) == {0}
