"""The instance identity against real processes, redis-server and Azurite: a daemon killed
and restarted in its pod resumes its own leases at once; a second live daemon with the same
identity writes nothing until the first stops (``sidecar.daemon.instance``)."""

from __future__ import annotations

from pathlib import Path

from tests.faults.load import scrape_process
from tests.faults.test_hostile_clients import post as post_progress
from tests.helpers import metric_value, wait_blob, wait_for
from tests.services import DaemonProcess

QID = "1a570000-0000-4000-8000-000000000001"


def post(proc: DaemonProcess, batch: int) -> None:
    assert post_progress(proc.socket_path, QID, batch, name="pod").ok


def lock_held(proc: DaemonProcess) -> float:
    return metric_value(scrape_process(proc)[1], "checkpoint_sidecar_instance_lock_held")


def test_a_daemon_killed_and_restarted_in_its_pod_resumes_its_own_leases_at_once(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    # 60 s leases: without the stable lease id the restarted daemon could not write the blob
    # for a minute (the killed one's lease would have to expire first).
    env = daemon_env | {
        "SIDECAR_INSTANCE_ID": "driver-pod-0",
        "SIDECAR_LEASE_DURATION_S": "60",
        "SIDECAR_COUNT_THRESHOLD": "1",
    }
    first = DaemonProcess(env, tmp_path / "first.log")
    procs.append(first)
    first.start()
    post(first, 1)
    written_by = wait_blob(env, QID, 1).writer.instance_id  # the lease id
    first.kill()  # SIGKILL: no final flush, no lease or lock released

    # The same pod restarts the container: same environment, same admin port.
    second = DaemonProcess(first.settings, tmp_path / "second.log")
    assert second.admin_port == first.admin_port
    procs.append(second)
    second.start()
    post(second, 2)
    doc = wait_blob(env, QID, 2, timeout_s=30)  # well inside the killed daemon's 60 s lease
    assert doc.batch_id == 2 and doc.writer.instance_id == written_by
    assert "took over from a previous run in this network namespace" in second.log()
    assert lock_held(second) == 1


def test_a_second_live_daemon_with_the_same_identity_writes_nothing_until_the_first_stops(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path, short_tmp: Path
) -> None:
    env = daemon_env | {"SIDECAR_INSTANCE_ID": "same-pod", "SIDECAR_COUNT_THRESHOLD": "1"}
    first = DaemonProcess(env, tmp_path / "first.log")
    procs.append(first)
    first.start()
    twin_env = env | {"SIDECAR_SOCKET_PATH": str(short_tmp / "twin.sock")}
    twin = DaemonProcess(twin_env, tmp_path / "twin.log")  # another free admin port
    procs.append(twin)
    twin.start(wait=False)

    def unready() -> str | None:
        status, text = twin.readyz() or (0, "")  # None: not listening yet
        return text if status == 503 and "held by another live daemon" in text else None

    # (Before its first claim, the twin says it has not claimed the lock yet.)
    wait_for(unready, 30, "the twin's /readyz to name the live holder")
    assert lock_held(twin) == 0
    assert "held by another live daemon" in twin.log()

    # The first stops cleanly (its lock released): the twin takes over, becomes ready, and
    # what it is sent reaches the blob under its lease.
    assert first.stop() == 0
    twin.wait_ready(timeout_s=30)
    post(twin, 7)
    assert wait_blob(env, QID, 7).batch_id == 7
