"""Hostile clients against a real daemon process (real Redis, real Azurite).

The invariant: no frame and no client behaviour ends the daemon; each bad frame gets an
error reply and its connection goes on (except an oversized one, which is closed); other
connections are unaffected; every update acknowledged `ok` stays stored; memory stays
bounded. The numbers measured here (frames fuzzed, RSS before and after) are printed with
``-s`` and quoted in the closing notes.
"""

from __future__ import annotations

import json
import random
import resource
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import spark_bridge
from sidecar.wire.protocol import MAX_JSON_DEPTH, ClientConnection, Reply, encode_request
from tests.services import DaemonProcess
from tests.sparkshapes import kafka_progress

SENTINEL = "5e1d0000-0000-4000-8000-00000000beef"


@pytest.fixture
def daemon(daemon_env: dict[str, str], short_tmp: Path) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(daemon_env, short_tmp / "daemon.log")
    proc.start()
    yield proc
    # Killed, not stopped: nothing is checked after the test, and a graceful stop after the
    # fuzzer's thousands of made-up queries (each a blob and a lease to give up) takes the
    # whole grace period.
    proc.kill()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


class Client:
    """A blocking NDJSON client that reads exactly the replies it expects."""

    def __init__(self, path: str, timeout_s: float = 30) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)
        self.conn = ClientConnection()
        self.pending: list[Reply] = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def replies(self, n: int) -> list[Reply]:
        while len(self.pending) < n:
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError(f"closed after {len(self.pending)} of {n} replies")
            self.pending += self.conn.receive_data(data)
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def request(self, obj: dict[str, Any]) -> Reply:
        self.send(json.dumps(obj).encode() + b"\n")
        return self.replies(1)[0]

    def close(self) -> None:
        self.sock.close()


def post(socket_path: str, query_id: str, batch: int, name: str = "orders") -> Reply:
    """One ``progress`` of ``kafka_progress(query_id, batch)`` on a connection of its own;
    its reply."""
    client = Client(socket_path)
    try:
        client.send(
            encode_request("progress", batch, progress=kafka_progress(query_id, batch, name=name))
        )
        return client.replies(1)[0]
    finally:
        client.close()


def progress(query_id: str, batch: int, rid: int) -> dict[str, Any]:
    return {"op": "progress", "id": rid, "progress": kafka_progress(query_id, batch)}


def test_a_deeply_nested_frame_is_a_bad_request_and_the_connection_goes_on(
    daemon: DaemonProcess,
) -> None:
    """~2.4 KB nested 1,000 levels: before the fix a RecursionError ended the daemon."""
    other = Client(daemon.socket_path)
    client = Client(daemon.socket_path)
    body = kafka_progress(SENTINEL, 1)
    text = json.dumps({"op": "progress", "id": 7, "progress": body})
    deep = text.replace('"endOffset": {', '"endOffset": ' + "[" * 1000 + "]" * 1000 + ', "x": {')
    assert len(deep) < 4000
    client.send(deep.encode() + b"\n")
    (reply,) = client.replies(1)
    assert reply.ok is False and reply.error is not None
    assert reply.error.code == "bad_request"
    assert f"nested deeper than {MAX_JSON_DEPTH} levels" in reply.error.message
    assert client.request({"op": "ping", "id": 8}).ok  # same connection, still served
    assert other.request(progress(SENTINEL, 2, 9)).applied  # other connection unaffected
    assert daemon.running
    client.close()
    other.close()


def _mutations(rng: random.Random, base: dict[str, Any]) -> bytes:
    """One hostile frame: random bytes, or real progress JSON with one thing wrong."""
    choice = rng.randrange(10)
    if choice == 0:  # random bytes (no newline: one frame)
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))).replace(b"\n", b" ")
    doc = json.loads(json.dumps(base))
    doc["progress"]["id"] = f"fz-{rng.randrange(10**9)}"  # never the sentinel query
    p = doc["progress"]
    if choice == 1:  # wrong types
        key = rng.choice(["batchId", "id", "runId", "timestamp", "sources"])
        p[key] = rng.choice([None, True, 1.5, "x", [], {}, -1])
    elif choice == 2:  # huge and negative numbers
        p["batchId"] = rng.choice([-1, 2**63, 2**64, -(2**70), 10**30])
    elif choice == 3:  # NaN / Infinity (not JSON)
        return json.dumps(doc).replace('"batchId": ', '"batchId": NaN, "y": ').encode()
    elif choice == 4:  # deep nesting inside offsets
        depth = rng.randrange(MAX_JSON_DEPTH - 5, 3000)  # as text: json itself would recurse
        p["sources"][0]["endOffset"] = "DEEP"
        return json.dumps(doc).replace('"DEEP"', "[" * depth + "]" * depth).encode()
    elif choice == 5:  # unicode everywhere
        p["name"] = "".join(chr(rng.randrange(0x20, 0x10FFFF)) for _ in range(20))
        p["sources"][0]["description"] = "\u202e\u0000²ǅ" * 10
        return json.dumps(doc, ensure_ascii=rng.random() < 0.5).encode("utf-8", "replace")
    elif choice == 6:  # duplicate keys
        return json.dumps(doc).replace('"batchId": ', '"batchId": 1, "batchId": ').encode()
    elif choice == 7:  # odd partition keys and offsets
        p["sources"][0]["endOffset"] = {"t": {"²": 1, "-1": -5, "x" * 300: 2**63}}
    elif choice == 8:  # truncated
        text = json.dumps(doc)
        return text[: rng.randrange(1, len(text))].encode()
    else:  # unknown ops and ids
        doc["op"] = rng.choice(["progres", "", None, 3, "get", "ping"])
        doc["id"] = rng.choice([None, {}, [1], "x" * 1000, 2**80, True])
    return json.dumps(doc).encode()


def test_ten_thousand_fuzzed_frames_get_one_reply_each_and_lose_no_acknowledged_update(
    daemon: DaemonProcess,
) -> None:
    rng = random.Random(20261121)
    base = progress("fz", 1, 1)
    frames = [f for f in (_mutations(rng, base) for _ in range(10_000)) if f.strip(b" \r")]
    assert len(frames) >= 9_900
    rss_before = rss_kib(daemon.pid)
    # A well-behaved client keeps updating the sentinel query all along, on its own connection.
    acked: list[int] = []

    def steady() -> None:
        client = Client(daemon.socket_path)
        for batch in range(200):
            if client.request(progress(SENTINEL, batch, batch)).ok:
                acked.append(batch)
        client.close()

    worker = threading.Thread(target=steady)
    worker.start()
    fuzzer = Client(daemon.socket_path)
    answered = 0
    for start in range(0, len(frames), 500):
        chunk = frames[start : start + 500]
        fuzzer.send(b"".join(f + b"\n" for f in chunk))
        replies = fuzzer.replies(len(chunk))
        answered += len(replies)
        for reply in replies:
            assert reply.ok or (reply.error is not None and reply.error.code != "internal")
    worker.join(60)
    assert answered == len(frames)
    assert daemon.running
    assert acked == list(range(200))
    saved = spark_bridge.load_checkpoint(SENTINEL, daemon.socket_path)
    assert saved["batch_id"] == 199
    print(f"\nfuzzed {len(frames)} frames; daemon RSS {rss_before} -> {rss_kib(daemon.pid)} KiB")
    fuzzer.close()


def test_mid_frame_disconnects_and_2000_connections_leave_the_daemon_serving(
    daemon: DaemonProcess,
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2100 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2100, hard))
    half = json.dumps(progress(SENTINEL, 1, 1)).encode()[:500]
    for _ in range(200):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(daemon.socket_path)
            s.sendall(half)  # and leave mid-frame
    rss_before = rss_kib(daemon.pid)
    clients = [Client(daemon.socket_path) for _ in range(2000)]
    try:
        for n, client in enumerate(clients):
            client.send(json.dumps({"op": "ping", "id": n}).encode() + b"\n")
        for n, client in enumerate(clients):
            (reply,) = client.replies(1)
            assert reply.ok and reply.id == n
        rss_during = rss_kib(daemon.pid)
    finally:
        for client in clients:
            client.close()
    probe = Client(daemon.socket_path)
    assert probe.request(progress(SENTINEL, 5, 1)).applied
    probe.close()
    assert daemon.running
    print(f"\n2000 connections: daemon RSS {rss_before} -> {rss_during} KiB")


def test_clients_that_never_read_and_a_100_mb_line_keep_memory_bounded(
    daemon: DaemonProcess,
) -> None:
    rss_before = rss_kib(daemon.pid)
    # 20 clients pipeline requests and never read a reply: the daemon's writes block, it
    # stops reading those connections, and the kernel's buffers bound what is held.
    ping = b"".join(json.dumps({"op": "ping", "id": n}).encode() + b"\n" for n in range(2000))
    mute: list[socket.socket] = []
    for _ in range(20):
        s = socket.socket(socket.AF_UNIX)
        s.connect(daemon.socket_path)
        s.setblocking(False)
        sent = 0
        try:
            for _ in range(200):  # up to ~14 MB each, until the socket buffers are full
                sent += s.send(ping)
        except BlockingIOError:
            pass
        assert sent > 0
        mute.append(s)
    # One 100 MB line without a newline: refused once it passes the frame limit.
    huge = Client(daemon.socket_path)
    chunk = b"x" * (1 << 20)
    sent_mb = 0
    try:
        for _ in range(100):
            huge.send(chunk)
            sent_mb += 1
    except (BrokenPipeError, ConnectionResetError):
        pass  # the daemon closed it after refusing the frame
    (refused,) = huge.replies(1)
    assert refused.error is not None and refused.error.code == "frame_too_large"
    with pytest.raises(ConnectionError):
        huge.replies(1)  # ... and closed the connection
    assert sent_mb < 100  # it did not read the whole line
    probe = Client(daemon.socket_path)
    assert probe.request(progress(SENTINEL, 3, 1)).applied  # others unaffected
    rss_after = rss_kib(daemon.pid)
    for s in mute:
        s.close()
    probe.close()
    huge.close()
    assert daemon.running
    print(f"\nmute clients + 100 MB line: daemon RSS {rss_before} -> {rss_after} KiB")
    assert rss_after - rss_before < 64 * 1024, "the daemon held what clients would not read"
