"""Both Spark-side clients against the protocol's documented frames and the real daemon.

The JVM listener's sender (driven without Spark by ``tests/jvm/SenderHarness.java``) and the
Python fallback's sender (``spark_bridge.sender``) run the same scenarios, so the two classify
every reply the same way: ``ok`` → sent; ``unavailable``/``not_durable``/``shutting_down``/
``internal`` → retried; any other error → failed and not resent; a malformed reply, a wrong
id or a closed connection → reconnect and resend what was not answered.

The scripted peer below is a stand-in for the daemon that answers with exact frames (the
pure-protocol side); the tests at the end run the same clients against the real daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import pytest

import spark_bridge
import spark_bridge.sender as python_sender
from sidecar.wire import endpoint
from sidecar.wire.protocol import (
    AUTH_ID,
    CLOSING_CODES,
    RETRIABLE_CODES,
    Authenticated,
    ServerConnection,
)
from spark_bridge.handle import SenderStats
from tests.helpers import wait_for
from tests.jvmharness import JavaClient
from tests.services import DaemonProcess, free_port
from tests.sparkshapes import kafka_progress

QID = "5e1d0000-0000-4000-8000-000000000001"
#: How long a flush may take against a real daemon. Not a timing target: a fresh daemon
#: reads a new query's floor from its blob, which waits for the store to open after ready
#: (the SDK imported, a listing): well under a second here, unbounded on a loaded CI machine.
DELIVERY_S = 30
#: Both clients' wait for a reply: a slow first reply (the floor read above) would otherwise
#: cost a resend and a new connection, which some tests count.
REPLY_TIMEOUT_S = 20.0


def payload(batch: int, query_id: str = QID, partitions: int = 3) -> bytes:
    return json.dumps(kafka_progress(query_id, batch, partitions=partitions)).encode()


# --- the two clients behind one interface ---------------------------------------------------


class Client(Protocol):
    def offer(self, query_id: str, data: bytes) -> None: ...
    def flush(self, timeout_s: float) -> bool: ...
    def stats(self) -> SenderStats: ...
    def close(self, timeout_s: float) -> bool: ...


class PythonClient:
    def __init__(self, socket_path: str) -> None:
        self.sender = python_sender.Sender(socket_path, timeout_s=REPLY_TIMEOUT_S)

    def offer(self, query_id: str, data: bytes) -> None:
        self.sender.offer(query_id, data)

    def flush(self, timeout_s: float) -> bool:
        return self.sender.flush(timeout_s)

    def stats(self) -> SenderStats:
        return self.sender.stats()

    def close(self, timeout_s: float) -> bool:
        return self.sender.close(timeout_s)


ClientFactory = Callable[..., Client]


@pytest.fixture(params=["jvm", "python"])
def make_client(
    request: pytest.FixtureRequest,
    harness_classpath: str,
    short_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[ClientFactory]:
    """Build the client under test for a socket path (fast backoff for both)."""
    monkeypatch.setattr(python_sender, "BACKOFF_MAX_S", 0.2)
    clients: list[Client] = []

    def make(socket_path: str, **settings: str) -> Client:
        client: Client
        if request.param == "jvm":
            conf = {
                "socketPath": socket_path,
                "backoffMaxMs": "200",
                "replyTimeoutMs": str(int(REPLY_TIMEOUT_S * 1000)),
            }
            client = JavaClient(harness_classpath, {**conf, **settings}, short_tmp / "jvm.log")
        else:
            client = PythonClient(socket_path)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close(0.5)


# --- a peer that answers with exact, scripted frames --------------------------------------

Respond = Callable[[int, dict[str, object]], bytes | None]


class ScriptedPeer:
    """A Unix-socket server; ``respond(connection_number, request)`` returns the bytes to send
    back, or None to close the connection without answering."""

    def __init__(self, path: str, respond: Respond) -> None:
        self.path = path
        self.respond = respond
        self.requests: list[tuple[int, dict[str, object]]] = []
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(path)
        self._server.listen()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        number = 0
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            number += 1
            threading.Thread(target=self._handle, args=(conn, number), daemon=True).start()

    def _handle(self, conn: socket.socket, number: int) -> None:
        buf = b""
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    request = json.loads(line)
                    self.requests.append((number, request))
                    answer = self.respond(number, request)
                    if answer is None:
                        return
                    conn.sendall(answer)

    def batches(self) -> list[int]:
        return [int(r["progress"]["batchId"]) for _, r in self.requests]  # type: ignore[index]

    def close(self) -> None:
        self._server.close()


def ok(request: dict[str, object]) -> bytes:
    return json.dumps({"id": request["id"], "ok": True, "applied": True}).encode() + b"\n"


def error(request_id: object, code: str, message: str = "scripted") -> bytes:
    body = {"id": request_id, "ok": False, "error": {"code": code, "message": message}}
    return json.dumps(body).encode() + b"\n"


@pytest.fixture
def peer(short_tmp: Path) -> Iterator[Callable[[Respond], ScriptedPeer]]:
    peers: list[ScriptedPeer] = []

    def start(respond: Respond) -> ScriptedPeer:
        p = ScriptedPeer(str(short_tmp / f"peer{len(peers)}.sock"), respond)
        peers.append(p)
        return p

    yield start
    for p in peers:
        p.close()


# --- documented frames --------------------------------------------------------------------


def test_the_jvm_listener_classifies_error_codes_as_the_protocol_module_does(
    harness_classpath: str, short_tmp: Path
) -> None:
    client = JavaClient(harness_classpath, {"socketPath": "/nonexistent"}, short_tmp / "j.log")
    try:
        assert client.call("retriable") == ",".join(sorted(RETRIABLE_CODES))
        assert client.call("closing") == ",".join(sorted(CLOSING_CODES))
    finally:
        client.close(0.1)


@pytest.mark.parametrize("code", sorted(RETRIABLE_CODES))
def test_a_retriable_error_is_resent_until_acknowledged(
    make_client: ClientFactory, peer: Callable[[Respond], ScriptedPeer], code: str
) -> None:
    answered: list[int] = []

    def respond(conn: int, request: dict[str, object]) -> bytes:
        answered.append(1)
        return error(request["id"], code) if len(answered) <= 2 else ok(request)

    p = peer(respond)
    client = make_client(p.path)
    client.offer(QID, payload(7))
    assert client.flush(10)
    stats = client.stats()
    assert (stats.sent, stats.failed, stats.retried, stats.pending) == (1, 0, 2, 0)
    assert p.batches() == [7, 7, 7]
    assert stats.reconnects == 0  # an error reply does not cost the connection


@pytest.mark.parametrize("code", ["bad_request", "bad_json", "unknown_op", "some_future_code"])
def test_a_final_error_is_counted_as_failed_and_never_resent(
    make_client: ClientFactory, peer: Callable[[Respond], ScriptedPeer], code: str
) -> None:
    p = peer(lambda conn, request: error(request["id"], code, "nope"))
    client = make_client(p.path)
    client.offer(QID, payload(1))
    assert client.flush(10)
    stats = client.stats()
    assert (stats.sent, stats.failed, stats.retried, stats.pending) == (0, 1, 0, 0)
    assert stats.last_error is not None and code in stats.last_error
    time.sleep(0.3)  # a resend would come within the 50 ms backoff
    assert p.batches() == [1]


def test_frame_too_large_settles_earlier_replies_and_resends_the_rest_on_a_new_connection(
    make_client: ClientFactory, peer: Callable[[Respond], ScriptedPeer]
) -> None:
    other, third = QID[:-1] + "2", QID[:-1] + "3"

    def respond(conn: int, request: dict[str, object]) -> bytes | None:
        query = request["progress"]["id"]  # type: ignore[index]
        if conn == 1 and query == other:
            # What the daemon does: an error without an id (it could not read one), then close.
            return error(None, "frame_too_large", "request line exceeds 4096 bytes")
        return ok(request)

    p = peer(respond)
    client = make_client(p.path)
    # One offer at a time until the first is acknowledged, so the order on the wire is known.
    client.offer(QID, payload(1))
    assert client.flush(10)
    client.offer(other, payload(2, other))
    client.offer(third, payload(3, third))
    assert client.flush(10)
    stats = client.stats()
    assert (stats.sent, stats.failed, stats.pending) == (2, 1, 0)
    resent = [r["progress"]["id"] for conn, r in p.requests if conn == 2]  # type: ignore[index]
    assert other not in resent


@pytest.mark.parametrize(
    "bad_reply",
    [
        b'{"id":1,"ok":tru\n',  # not JSON
        b"[1,2]\n",  # not an object
        b'{"id":1}\n',  # no "ok"
        b'{"id":999999,"ok":true}\n',  # not the id that was due
        b'{"ok":true}\n',  # a success without the request's id
        b'{"id":1,"ok":false,"error":"x"}\n',  # an error without an error object
    ],
    ids=["not-json", "array", "no-ok", "wrong-id", "success-without-id", "bad-error"],
)
def test_a_malformed_reply_drops_the_connection_and_the_update_is_resent(
    make_client: ClientFactory, peer: Callable[[Respond], ScriptedPeer], bad_reply: bytes
) -> None:
    p = peer(lambda conn, request: bad_reply if conn == 1 else ok(request))
    client = make_client(p.path)
    client.offer(QID, payload(4))
    assert client.flush(10)
    stats = client.stats()
    assert (stats.sent, stats.failed, stats.pending) == (1, 0, 0)
    assert stats.retried >= 1 and stats.reconnects >= 1
    assert [conn for conn, _ in p.requests][-1] >= 2


def test_a_connection_closed_without_a_reply_is_resent_with_only_the_newest_batch(
    make_client: ClientFactory, peer: Callable[[Respond], ScriptedPeer]
) -> None:
    gate = threading.Event()

    def respond(conn: int, request: dict[str, object]) -> bytes | None:
        if conn == 1:
            gate.wait(5)  # hold the first batch until a newer one was offered
            return None
        return ok(request)

    p = peer(respond)
    client = make_client(p.path)
    client.offer(QID, payload(1))
    wait_for(lambda: p.requests, 10, "the first request")
    client.offer(QID, payload(2))  # supersedes batch 1 while it is in flight
    gate.set()
    assert client.flush(10)
    assert p.batches()[0] == 1 and p.batches()[1:] == [2]  # batch 1 is not resent
    stats = client.stats()
    assert (stats.sent, stats.pending, stats.reconnects) == (1, 0, 1)
    # Every offer is settled exactly once: batch 1 counts as superseded, not lost.
    assert (stats.offered, stats.conflated, stats.failed) == (2, 1, 0)


def test_one_listener_releasing_does_not_hold_up_another_listeners_acquire(
    harness_classpath: str, short_tmp: Path
) -> None:
    """Two users of one sender (two Spark Connect sessions' listeners), an update that no
    daemon answers: one user's release waits up to a minute for its flush. Meanwhile another
    session's listener is created (a sender for another endpoint): it must not wait for that
    flush (it did, for the whole timeout, while release flushed under the registry's lock)."""
    client = JavaClient(
        harness_classpath, {"socketPath": str(short_tmp / "absent.sock")}, short_tmp / "j.log"
    )
    try:
        assert client.call("acquire") == "ok"
        client.offer(QID, payload(1))
        assert client.call("release-async 60000") == "releasing"
        answers: list[str] = []

        def acquire_other() -> None:
            # AssertionError: the JVM was killed at the end of a failed test.
            with contextlib.suppress(AssertionError):
                answers.append(client.call(f"acquire-other {short_tmp / 'o.sock'}"))

        threading.Thread(target=acquire_other, daemon=True).start()
        wait_for(lambda: answers, 15, "the other listener's acquire, while the release flushes")
        assert answers == ["acquired"]
    finally:
        client.release()


# --- the real daemon ------------------------------------------------------------------------


def test_pipelined_updates_of_many_queries_are_all_stored(
    make_client: ClientFactory,
    daemon_env: dict[str, str],
    procs: list[DaemonProcess],
    short_tmp: Path,
) -> None:
    daemon = DaemonProcess(daemon_env, short_tmp / "d.log")
    procs.append(daemon)
    daemon.start()
    client = make_client(daemon_env["SIDECAR_SOCKET_PATH"])
    queries = [f"5e1d0000-0000-4000-8000-{n:012d}" for n in range(40)]
    for batch in range(5):
        for query in queries:
            client.offer(query, payload(batch, query))
    assert client.flush(DELIVERY_S)
    stats = client.stats()
    assert stats.offered == 200 and stats.failed == 0 and stats.pending == 0
    assert stats.sent + stats.conflated == 200
    for query in queries:
        saved = spark_bridge.load_checkpoint(query, daemon_env["SIDECAR_SOCKET_PATH"])
        assert saved["batch_id"] == 4


def test_a_daemon_killed_and_restarted_mid_stream_gets_the_newest_batch(
    make_client: ClientFactory,
    daemon_env: dict[str, str],
    procs: list[DaemonProcess],
    short_tmp: Path,
) -> None:
    daemon = DaemonProcess(daemon_env, short_tmp / "d.log")
    procs.append(daemon)
    daemon.start()
    client = make_client(daemon_env["SIDECAR_SOCKET_PATH"])
    client.offer(QID, payload(1))
    assert client.flush(DELIVERY_S)
    daemon.signal(signal.SIGKILL)
    daemon.wait()
    os.unlink(daemon_env["SIDECAR_SOCKET_PATH"])
    for batch in range(2, 30):
        client.offer(QID, payload(batch))
    wait_for(lambda: client.stats().retried > 0, 10, "a failed attempt")
    assert client.stats().pending == 1
    restarted = DaemonProcess(daemon_env, short_tmp / "d2.log")
    procs.append(restarted)
    restarted.start()
    assert client.flush(DELIVERY_S)
    stats = client.stats()
    assert stats.reconnects >= 1 and stats.failed == 0
    saved = spark_bridge.load_checkpoint(QID, daemon_env["SIDECAR_SOCKET_PATH"])
    assert saved["batch_id"] == 29


def test_an_update_over_the_daemons_frame_limit_fails_alone(
    make_client: ClientFactory,
    daemon_env: dict[str, str],
    procs: list[DaemonProcess],
    short_tmp: Path,
) -> None:
    daemon = DaemonProcess({**daemon_env, "SIDECAR_MAX_FRAME_BYTES": "4096"}, short_tmp / "d.log")
    procs.append(daemon)
    daemon.start()
    client = make_client(daemon_env["SIDECAR_SOCKET_PATH"])
    other = QID[:-1] + "9"
    huge = payload(1, partitions=400)
    assert len(huge) > 4096
    client.offer(QID, huge)
    client.offer(other, payload(5, other))
    assert client.flush(DELIVERY_S)
    stats = client.stats()
    assert (stats.failed, stats.sent, stats.pending) == (1, 1, 0)
    assert stats.last_error is not None and "frame_too_large" in stats.last_error
    assert spark_bridge.load_checkpoint(other, daemon_env["SIDECAR_SOCKET_PATH"])["batch_id"] == 5
    retried = stats.retried
    client.offer(other, payload(6, other))  # on a new connection, not the one the daemon closed
    assert client.flush(DELIVERY_S)
    assert client.stats().retried == retried


def test_the_jvm_sender_speaks_loopback_tcp_with_the_published_token(
    harness_classpath: str,
    daemon_env: dict[str, str],
    procs: list[DaemonProcess],
    short_tmp: Path,
) -> None:
    """What a JVM without Unix sockets does (forced here on Java 17 with transport=tcp): the
    port and the token from the endpoint file beside the socket, the daemon on its defaults."""
    daemon = DaemonProcess(daemon_env, short_tmp / "d.log")
    procs.append(daemon)
    daemon.start()
    sock = daemon_env["SIDECAR_SOCKET_PATH"]
    client = JavaClient(
        harness_classpath, {"transport": "tcp", "socketPath": sock}, short_tmp / "j.log"
    )
    try:
        client.offer(QID, payload(3))
        assert client.flush(DELIVERY_S)
        stats = json.loads(client.call("stats"))
        assert stats["endpoint"] == f"tcp:{sock}.tcp" and stats["failed"] == 0
    finally:
        client.close(1)
    assert spark_bridge.load_checkpoint(QID, sock)["batch_id"] == 3


def test_a_fixed_tcp_port_takes_the_token_from_the_endpoint_file(
    harness_classpath: str,
    daemon_env: dict[str, str],
    procs: list[DaemonProcess],
    short_tmp: Path,
) -> None:
    port = free_port()
    daemon = DaemonProcess({**daemon_env, "SIDECAR_TCP_PORT": str(port)}, short_tmp / "d.log")
    procs.append(daemon)
    daemon.start()
    sock = daemon_env["SIDECAR_SOCKET_PATH"]
    settings = {"transport": "tcp", "tcpPort": str(port), "socketPath": sock}
    client = JavaClient(harness_classpath, settings, short_tmp / "j.log")
    try:
        client.offer(QID, payload(4))
        assert client.flush(DELIVERY_S)
        assert json.loads(client.call("stats"))["endpoint"] == f"tcp:127.0.0.1:{port}"
    finally:
        client.close(1)
    assert spark_bridge.load_checkpoint(QID, sock)["batch_id"] == 4


def test_a_refused_token_is_retried_with_the_endpoint_file_read_again(
    harness_classpath: str,
    daemon_env: dict[str, str],
    procs: list[DaemonProcess],
    short_tmp: Path,
) -> None:
    """A file whose token the daemon refuses (another daemon's, from before a restart): the
    listener is refused, keeps the update, and delivers it once the file is right."""
    daemon = DaemonProcess(daemon_env, short_tmp / "d.log")
    procs.append(daemon)
    daemon.start()
    sock = daemon_env["SIDECAR_SOCKET_PATH"]
    published = Path(endpoint.path_for(sock))
    right = published.read_bytes()
    found = endpoint.decode(right)
    wrong = endpoint.Endpoint(found.host, found.port, "another-daemons-token", found.pid)
    published.write_bytes(endpoint.encode(wrong))
    client = JavaClient(
        harness_classpath, {"transport": "tcp", "socketPath": sock}, short_tmp / "j.log"
    )
    try:
        client.offer(QID, payload(5))
        wait_for(lambda: client.stats().retried >= 2, 10, "refused attempts")
        stats = client.stats()
        assert stats.pending == 1 and stats.sent == 0 and stats.failed == 0
        assert stats.last_error is not None and "refused the token" in stats.last_error
        published.write_bytes(right)
        assert client.flush(DELIVERY_S)
    finally:
        client.close(1)
    assert "unauthenticated" in daemon.log()
    assert spark_bridge.load_checkpoint(QID, sock)["batch_id"] == 5


def test_a_crashed_daemons_endpoint_file_does_not_mislead_the_listener(
    harness_classpath: str,
    daemon_env: dict[str, str],
    procs: list[DaemonProcess],
    short_tmp: Path,
) -> None:
    """kill -9 leaves the endpoint file naming a port nobody answers: the listener retries
    with backoff, and delivers to the restarted daemon (a new port, a new token)."""
    daemon = DaemonProcess(daemon_env, short_tmp / "d.log")
    procs.append(daemon)
    daemon.start()
    sock = daemon_env["SIDECAR_SOCKET_PATH"]
    client = JavaClient(
        harness_classpath,
        {"transport": "tcp", "socketPath": sock, "backoffMaxMs": "200"},
        short_tmp / "j.log",
    )
    try:
        client.offer(QID, payload(1))
        assert client.flush(DELIVERY_S)
        stale = endpoint.decode(Path(endpoint.path_for(sock)).read_bytes())
        daemon.signal(signal.SIGKILL)
        daemon.wait()
        assert Path(endpoint.path_for(sock)).exists()  # left behind
        client.offer(QID, payload(2))
        wait_for(lambda: client.stats().retried >= 2, 10, "failed attempts")
        restarted = DaemonProcess(daemon_env, short_tmp / "d2.log")
        procs.append(restarted)
        restarted.start()
        fresh = endpoint.decode(Path(endpoint.path_for(sock)).read_bytes())
        assert fresh.token != stale.token
        assert client.flush(20)
        assert client.stats().failed == 0
    finally:
        client.close(1)
    assert spark_bridge.load_checkpoint(QID, sock)["batch_id"] == 2


def test_the_jvm_auth_frame_and_endpoint_file_are_the_protocols(
    harness_classpath: str, short_tmp: Path
) -> None:
    client = JavaClient(harness_classpath, {"socketPath": "/nonexistent"}, short_tmp / "j.log")
    try:
        token = endpoint.new_token()
        frame = client.call(f"authframe {token}").encode() + b"\n"
        conn = ServerConnection(auth_token=token)
        assert conn.receive_data(frame) == [Authenticated(AUTH_ID)] and conn.authenticated
        assert client.call("endpointfile /run/x/s.sock") == endpoint.path_for("/run/x/s.sock")
        assert client.call("route") == "unix:/nonexistent"  # Java 17: the Unix socket
    finally:
        client.close(0.1)
    # tcpPort=auto, as the daemon's SIDECAR_TCP_PORT may say it in a shared environment.
    settings = {"transport": "tcp", "tcpPort": "auto", "socketPath": "/run/x/s.sock"}
    client = JavaClient(harness_classpath, settings, short_tmp / "j2.log")
    try:
        assert client.call("route") == "tcp:/run/x/s.sock.tcp"
    finally:
        client.close(0.1)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("tcpPort=http", "spark.checkpointSidecar.tcpPort=http: not a whole number"),
        ("transport=udp", "spark.checkpointSidecar.transport=udp: use auto, unix or tcp"),
        ("tcpHost=10.0.0.1", "loopback only"),
        ("sockePath=/x", "unknown setting spark.checkpointSidecar.sockePath"),
    ],
)
def test_a_bad_listener_setting_is_refused_with_its_name(
    harness_classpath: str, short_tmp: Path, setting: str, message: str
) -> None:
    key, value = setting.split("=")
    client = JavaClient(harness_classpath, {key: value}, short_tmp / "bad.log")
    assert client.proc.wait(10) != 0
    client.release()
    assert message in (short_tmp / "bad.log").read_text()
