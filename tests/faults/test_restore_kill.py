"""``restore --all`` killed -9, then run again, on a lost volume: the next run ends with exactly
the snapshot's files and the sidecar's checkpoint at its batch, or a clear refusal — never a
partial directory kept, nor a directory kept while the checkpoint was not moved with it.

The small form of ``make restore-kill`` (``bench/restore_kill.py``: 1 GiB, 10 kill points;
the scenario: ``tests/faults/restore_kill.py``), with real redis-server, Azurite and the
command as a process: a few MiB, three kill points — while the files download, once they are
in place while the checkpoint's move waits for the lease an old pod's daemon still holds (a
restore cut short there used to leave a directory the next run kept, the checkpoint never
moved), and at half of a full run's time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.restore_kill import (
    LOCATION,
    MiB,
    RestoreKill,
    downloading,
    stderr_says,
)
from tests.services import Azurite, RedisServer


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_restore_killed_anywhere_is_finished_exactly_by_the_next_run(
    redis_server: RedisServer, azurite: Azurite, short_tmp: Path
) -> None:
    rk = RestoreKill(short_tmp, redis_server.url, azurite.port, partitions=6,
                     snapshot_bytes=1 * MiB, delta_bytes=50_000)  # fmt: skip
    figures = rk.prepare()
    assert figures["bytes"] > 6 * MiB

    # While the files download: a temporary directory beside the location, nothing at it.
    # The next run is a whole restore: its time is a full run's.
    root = _volume(short_tmp, "downloading")
    killed = rk.killed(root, when=downloading(root))
    assert killed.killed and not killed.left.metadata and killed.left.temp_dirs, killed
    full = rk.run(root)
    assert full.verdict == "exact" and full.outcome == "restored", (killed, full)

    # The files in place, the checkpoint's move waiting for the lease.
    rk.document_ahead()
    root = _volume(short_tmp, "moving")
    with rk.lease_held():
        killed = rk.killed(root, when=stderr_says("waiting for the old owner's lease"))
    assert killed.killed and killed.left.metadata and not killed.left.temp_dirs, killed
    assert (root / LOCATION / "commits" / "5").exists()
    after = rk.run(root)
    assert after.verdict == "exact", (killed, after)
    assert after.outcome == "restored"

    # At half of a full run's time (most of it the interpreter starting, at this size).
    rk.document_ahead()
    root = _volume(short_tmp, "half")
    killed = rk.killed(root, at_s=full.seconds / 2)
    after = rk.run(root)
    assert after.verdict == "exact", (killed, after)


def _volume(tmp: Path, name: str) -> Path:
    root = tmp / f"volume-{name}"
    root.mkdir()
    return root
