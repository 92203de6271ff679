"""The snapshot nemesis' short run (``tests/faults/snapshot_nemesis.py``; longer:
``make snapshot-soak``): one real stateful PySpark query snapshotted by a daemon under kill -9
mid-snapshot, in pack and index writes and in prunes, store faults, a lease moved mid-prune,
rewinds and pod restarts that run ``restore --all`` on an intact, a lost and a half-restored
volume. Every snapshot listed restores verified, every run from a restore resumes at the
right batch with exact counts, no restore takes another query's or an abandoned timeline's
snapshot, nothing is leaked after cleanup. ``SNAPSHOT_SOAK_SEED`` chooses the seed (printed,
to replay), ``SNAPSHOT_SOAK_ROUNDS`` the rounds (default 6: under a minute), and
``SNAPSHOT_SOAK_S`` a time to go on for (whole rounds, after those)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from tests.faults.snapshot_nemesis import KINDS, SnapshotSoak, schedule
from tests.services import Azurite

#: Its first 6 rounds: a kill -9 in an index write and one in a prune, a lease moved mid-prune,
#: 503s, a rewind followed by a pod restart on a lost volume, a half-restored volume.
SEED = int(os.environ.get("SNAPSHOT_SOAK_SEED", "20261164"))
ROUNDS = int(os.environ.get("SNAPSHOT_SOAK_ROUNDS", "6"))
SECONDS = float(os.environ.get("SNAPSHOT_SOAK_S", "0"))


def test_the_rounds_are_a_function_of_the_seed_alone() -> None:
    assert schedule(7, 40) == schedule(7, 40)
    assert schedule(7, 40) != schedule(8, 40)
    assert schedule(7, 40)[:13] == schedule(7, 13)  # a longer run replays a shorter one first
    rounds = schedule(SEED, 3 * len(KINDS))
    for at in range(0, len(rounds), len(KINDS)):  # every kind in every block
        assert sorted(r.kind for r in rounds[at : at + len(KINDS)]) == sorted(KINDS)


@pytest.mark.spark
@pytest.mark.one_spark
@pytest.mark.slow
@pytest.mark.timeout(max(600, 4 * SECONDS))
def test_a_seeded_snapshot_nemesis_restores_right_and_leaks_nothing(
    spark: SparkSession,
    daemon_env: dict[str, str],
    azurite: Azurite,
    short_tmp: Path,
    tmp_path: Path,
) -> None:
    """Under PySpark 4 only (``one_spark``): its faults are the daemon's and the store's. What
    Spark's version changes, the files a stateful query's checkpoint holds and a run resumed
    from a restored one, runs under 3.5 in test_snapshot_e2e.py (a lost checkpoint restored
    and rewound with its state, HDFS and RocksDB with changelog) and test_snapshot_restore.py
    (a query restarted from a cut, maintenance deleting files)."""
    soak = SnapshotSoak(spark, daemon_env, azurite.port, short_tmp, tmp_path, SEED, ROUNDS, SECONDS)
    report = soak.run()
    print(f"snapshot soak: {report}")
    assert report["wrong_restores"] == 0, report["wrong"]
    assert report["stuck"] == [], report["stuck"]
    assert report["leaked_blobs"] == 0, report["leaked"]
    assert set(report["sigterm_exit_codes"]) == {0}
    assert report["rounds"] == sum(report["faults"].values()) >= ROUNDS
    assert report["restores"].get("rewind", 0) >= report["faults"].get("rewind", 0)
    assert report["restores"]["restore --all"] >= 1  # the last one, from what cleanup kept
    assert report["distinct_snapshots_checked"] > ROUNDS
