"""Redis saying "not now", against a real daemon process and real redis-servers: MISCONF (a
background save failed: the disk is full or not writable), LOADING (a restart replaying a
large dataset). Each is a clear retriable refusal — the reply, ``/readyz`` and ``doctor`` say
which and what to do — and nothing acknowledged is lost: the resend is stored once Redis takes
writes again, and reaches the blob. (``maxmemory`` reached with ``noeviction``:
tests/integration/test_ingest.py.)"""

from __future__ import annotations

from pathlib import Path

import redis

from sidecar.buffer.refusals import LOADING, MISCONF
from sidecar.wire.protocol import Reply
from tests.faults.test_hostile_clients import post as post_progress
from tests.helpers import cli, wait_blob, wait_for
from tests.services import DaemonProcess, RedisServer

QID = "4ed15000-0000-4000-8000-000000000001"


def post(proc: DaemonProcess, batch: int) -> Reply:
    return post_progress(proc.socket_path, QID, batch)


def doctor_line(env: dict[str, str], refusal: str) -> str:
    """doctor's line naming ``refusal`` (``redis_reachable`` when even INFO is refused,
    ``redis_writable`` when only writes are)."""
    result = cli(env, "doctor")
    line = next((ln for ln in result.stdout.splitlines() if refusal in ln), "")
    assert line, result.stdout + result.stderr
    return line


def daemon(env: dict[str, str], tmp_path: Path, procs: list[DaemonProcess]) -> DaemonProcess:
    proc = DaemonProcess(env, tmp_path / "daemon.log")
    procs.append(proc)
    proc.start()
    return proc


def test_misconf_a_failed_background_save_is_a_named_retriable_refusal(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    # RDB snapshots on (MISCONF needs save points), no AOF; `dir` may be changed at runtime.
    args = ["--save", "3600 1", "--enable-protected-configs", "yes"]
    with RedisServer(appendonly=False, extra_args=args) as server:
        env = daemon_env | {"SIDECAR_REDIS_URL": server.url, "SIDECAR_COUNT_THRESHOLD": "1"}
        proc = daemon(env, tmp_path, procs)
        assert post(proc, 1).ok
        admin = redis.Redis(port=server.port)
        admin.config_set("dir", "/proc")  # no file can be created there, not even by root
        admin.bgsave()
        wait_for(
            lambda: admin.info("persistence")["rdb_last_bgsave_status"] == "err",
            10,
            "the background save to fail",
        )

        reply = post(proc, 2)
        assert not reply.ok and reply.error is not None
        assert reply.error.code == "unavailable" and MISCONF in reply.error.message
        status, text = proc.readyz() or (0, "")
        assert status == 503 and MISCONF in text
        line = doctor_line(env, MISCONF)
        assert line.startswith("fail") and "-> free disk space" in line

        admin.config_set("dir", str(server.dir))
        admin.bgsave()
        wait_for(
            lambda: admin.info("persistence")["rdb_last_bgsave_status"] == "ok",
            10,
            "the background save to succeed",
        )
        assert post(proc, 2).ok  # the listener's resend
        assert wait_blob(env, QID, 2).batch_id == 2
        assert (proc.readyz() or (0, ""))[0] == 200
        assert proc.stop() == 0


def test_loading_a_redis_replaying_its_dataset_is_a_named_retriable_refusal(
    daemon_env: dict[str, str], procs: list[DaemonProcess], tmp_path: Path
) -> None:
    # 20,000 keys loaded at 500 µs each: ~10 s of LOADING after a restart, answering clients
    # (LOADING) every 1 KiB loaded rather than every 2 MiB (the whole dataset here).
    args = ["--key-load-delay", "500", "--loading-process-events-interval-bytes", "1024"]
    with RedisServer(extra_args=args) as server:
        admin = redis.Redis(port=server.port)
        with admin.pipeline(transaction=False) as pipe:
            for i in range(20_000):
                pipe.set(f"filler:{i}", "x" * 64)
            pipe.execute()
        admin.bgrewriteaof()  # the AOF's base is an RDB: loaded key by key, with the delay
        wait_for(
            lambda: not admin.info("persistence")["aof_rewrite_in_progress"],
            30,
            "the AOF rewrite",
        )
        env = daemon_env | {"SIDECAR_REDIS_URL": server.url, "SIDECAR_COUNT_THRESHOLD": "1"}
        proc = daemon(env, tmp_path, procs)
        assert post(proc, 1).ok
        admin.close()

        server.stop()
        server.start(loaded=False)  # listening at once, loading for seconds

        def refused() -> Reply | None:  # the first call may meet the old connection closed
            answer = post(proc, 2)
            assert not answer.ok, "Redis loaded before the update was refused"
            return answer if answer.error and LOADING in answer.error.message else None

        reply = wait_for(refused, 8, "an update refused while Redis loads")
        assert reply.error is not None and reply.error.code == "unavailable"
        status, text = proc.readyz() or (0, "")
        assert status == 503 and LOADING in text
        line = doctor_line(env, LOADING)
        assert line.startswith("fail") and "-> wait: Redis answers once loaded" in line

        def resent() -> bool:
            answer = post(proc, 2)
            return answer.ok

        wait_for(resent, 60, "Redis to load and the resend to be stored")
        assert wait_blob(env, QID, 2).batch_id == 2
        assert proc.stop() == 0
