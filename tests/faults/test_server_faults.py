"""Server faults: a bug in one request, slow blob-mode acks, a contested socket, a taken port.

Real Redis and Azurite throughout; the daemon runs in-process where a fault must be injected
into its own code (the only way to reach a bug path), as a process where start-up is tested.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

import pytest

from sidecar.ingest.handler import Answer
from sidecar.ops.client import SidecarClient
from sidecar.store.blobs import BlobStore
from sidecar.wire.protocol import Event, Ping
from tests.faults.store_proxy import Fault, StoreFaultProxy
from tests.helpers import ConfigFactory, running_daemon, sample
from tests.services import Azurite, DaemonProcess, ServiceError, free_port
from tests.sparkshapes import kafka_progress


async def test_an_unexpected_error_answers_internal_is_counted_and_the_connection_goes_on(
    make_config: ConfigFactory, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config()
    async with running_daemon(config) as daemon:
        begin = daemon.handler.begin

        async def buggy(event: Event) -> Answer:
            # A fault injected into the daemon's own code: a bug has no other way in.
            if isinstance(event, Ping) and event.id in (2, 3):
                raise RuntimeError("a bug in the handler")
            return await begin(event)

        monkeypatch.setattr(daemon.handler, "begin", buggy)
        async with await SidecarClient.connect(config.socket_path) as c:
            replies = await c.send_many(
                [
                    ("progress", {"progress": kafka_progress("q-ok", 1)}),
                    ("ping", {}),
                    ("ping", {}),
                    ("progress", {"progress": kafka_progress("q-ok", 2)}),
                ]
            )
            assert [r.ok for r in replies] == [True, False, False, True]
            assert {r.error.code for r in replies if r.error} == {"internal"}
            assert (await c.request("ping")).ok  # the same connection, still served
        assert sample(daemon, "checkpoint_sidecar_bad_requests_total", code="internal") == 2
    logged = [r for r in caplog.records if "failed unexpectedly" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None  # once, with the traceback


async def test_blob_mode_acks_of_one_read_wait_together_not_one_after_another(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    """Four queries whose blob writes are held in the network: each ack waits
    blob_ack_timeout_s for a write that does not return. Before the fix they waited in turn
    (4 times the timeout)."""
    timeout_s = 1.0
    queries = [f"5e1d0000-0000-4000-8000-00000000000{n}" for n in range(4)]
    with StoreFaultProxy(azurite.port) as proxy:
        config = make_config(
            ack_mode="blob",
            blob_ack_timeout_s=timeout_s,
            azure_connection_string=proxy.connection_string(),
        )
        store = BlobStore(config)
        try:
            await store.ensure_container()
        finally:
            await store.aclose()
        proxy.faults = [Fault("hold", kinds=frozenset({"upload"}))]
        async with running_daemon(config), await SidecarClient.connect(config.socket_path) as c:
            started = time.monotonic()
            replies = await c.send_many(
                [("progress", {"progress": kafka_progress(q, 1)}) for q in queries]
            )
            elapsed = time.monotonic() - started
    assert [r.error.code if r.error else "ok" for r in replies] == ["not_durable"] * 4
    ids = [int(str(r.id)) for r in replies]
    assert ids == sorted(ids)  # still in request order
    assert elapsed < 2.5 * timeout_s, f"acks waited in turn: {elapsed:.1f}s"


def test_a_daemon_holding_the_socket_lock_is_never_displaced(
    daemon_env: dict[str, str], short_tmp: Path, procs: list[DaemonProcess]
) -> None:
    path = daemon_env["SIDECAR_SOCKET_PATH"]
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a starting daemon holds it
    try:
        second = DaemonProcess(daemon_env, short_tmp / "second.log")
        procs.append(second)
        with pytest.raises(ServiceError, match="exited with code 1"):
            second.start(timeout_s=30)
        assert f"holds {path}.lock" in second.log()
        assert not os.path.exists(path)  # nothing bound, nothing removed
    finally:
        os.close(fd)
    first = DaemonProcess(daemon_env, short_tmp / "first.log")
    procs.append(first)
    first.start()  # the lock is free: it starts
    try:
        racer = DaemonProcess(daemon_env, short_tmp / "racer.log")
        procs.append(racer)
        with pytest.raises(ServiceError, match="exited with code 1"):
            racer.start(timeout_s=30)
        with socket.socket(socket.AF_UNIX) as s:  # the first one still owns the socket
            s.connect(path)
            s.sendall(b'{"op":"ping","id":1}\n')
            assert b'"ok":true' in s.recv(100)
    finally:
        assert first.stop() == 0


def test_a_taken_tcp_port_is_a_clear_error_and_leaks_no_unix_socket(
    daemon_env: dict[str, str], short_tmp: Path, procs: list[DaemonProcess]
) -> None:
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        proc = DaemonProcess({**daemon_env, "SIDECAR_TCP_PORT": str(port)}, short_tmp / "d.log")
        procs.append(proc)
        with pytest.raises(ServiceError, match="exited with code 1"):
            proc.start(timeout_s=30)
    assert f"cannot listen on tcp:127.0.0.1:{port}" in proc.log()
    assert "Traceback" not in proc.log()
    assert not os.path.exists(daemon_env["SIDECAR_SOCKET_PATH"])
    # ... and the path is free for the next start.
    retry = DaemonProcess(daemon_env, short_tmp / "retry.log")
    procs.append(retry)
    retry.start()
    assert retry.stop() == 0
