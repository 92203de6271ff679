"""This process's lease id (``sidecar.daemon.ownership``): its own, taken over only from a
dead daemon of the same state directory, with real processes killed -9. The whole daemon
restarted in its pod, twins on separate Redis and two daemons on one Redis server:
tests/faults/test_ownership.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.daemon.ownership import StateDirInUse, claim, lease_file
from tests.services import REPO_ROOT

HOLDER = """
import sys, time
from pathlib import Path
from sidecar.daemon.ownership import claim
held = claim(Path(sys.argv[1]))
print(held.lease_id, held.inherited, flush=True)
time.sleep(600)
"""


def hold_in_a_process(path: Path) -> tuple[subprocess.Popen[str], str]:
    """A process that claims ``path`` and keeps it; its lease id."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.stdout is not None
    lease_id, _ = proc.stdout.readline().split()
    return proc, lease_id


def test_the_lease_file_sits_beside_the_socket_unless_a_state_dir_is_set() -> None:
    assert lease_file(None, "/run/sidecar/sidecar.sock") == Path("/run/sidecar/sidecar.sock.lease")
    assert lease_file("/state", "/run/sidecar/sidecar.sock") == Path("/state/sidecar.sock.lease")


def test_a_new_directory_gets_a_new_id_and_a_clean_stop_hands_it_to_the_next(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state" / "sidecar.sock.lease"
    first = claim(path)
    assert not first.inherited and path.read_text().startswith(f"{first.lease_id}\n")
    first.close()
    second = claim(path)
    assert second.inherited and second.lease_id == first.lease_id
    second.close()


def test_a_daemon_killed_9_hands_its_id_to_the_next_of_its_directory(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.sock.lease"
    proc, lease_id = hold_in_a_process(path)
    try:
        with pytest.raises(StateDirInUse, match=rf"pid {proc.pid} .*holds {path}"):
            claim(path)  # alive: its id is its own
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
    successor = claim(path)  # the kernel released the dead process's lock
    assert successor.inherited and successor.lease_id == lease_id
    successor.close()


def test_another_directory_never_shares_an_id(tmp_path: Path) -> None:
    # Another pod (its own emptyDir), whatever its HOSTNAME or SIDECAR_INSTANCE_ID.
    ours = claim(tmp_path / "a" / "sidecar.sock.lease")
    theirs = claim(tmp_path / "b" / "sidecar.sock.lease")
    assert ours.lease_id != theirs.lease_id
    ours.close()
    theirs.close()


def test_an_unreadable_file_gets_a_new_id(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.sock.lease"
    path.write_text("cut sh")
    held = claim(path)
    assert not held.inherited and len(held.lease_id) == 36
    held.close()
