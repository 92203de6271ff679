"""A counting HTTP proxy in front of Azurite: every Blob REST request, by kind and operation
(:func:`bench.fleetmodel.classify_request`), and how many were answered with status >= 400.

The daemons are pointed at :attr:`CountingProxy.port` (``connection_string()``). Each request
is forwarded on an upstream connection of its own (``Connection: close``, the body
de-chunked, as ``tests/faults/store_proxy.py`` does), so framing the response is Azurite's
closing of that connection. It runs on its own event loop in a thread; :meth:`counts`
copies the tallies under a lock at any time.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Self

from bench.fleetmodel import classify_request
from tests.services import azurite_connection_string


class CountingProxy:
    """``with CountingProxy(azurite.port) as proxy:`` — requests are counted as they are
    answered."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self.port = 0
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()
        self._failed: Counter[tuple[str, str]] = Counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def __enter__(self) -> Self:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def connection_string(self) -> str:
        """Azurite's account, reached through this proxy."""
        return azurite_connection_string(self.port)

    def counts(self) -> tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]]:
        """Copies of (answered, answered with status >= 400), by (kind, operation)."""
        with self._lock:
            return Counter(self._counts), Counter(self._failed)

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while (request := await _read_request(reader)) is not None:
                method, target, headers, raw = request
                key = classify_request(method, target, headers)
                response = await self._forward(raw)
                status = _status(response)
                with self._lock:
                    self._counts[key] += 1
                    if status >= 400:
                        self._failed[key] += 1
                writer.write(response)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _forward(self, raw: bytes) -> bytes:
        """``raw`` sent to Azurite on a connection of its own; the whole response, framed for
        a client that keeps its connection (no ``Connection`` header)."""
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        try:
            up_writer.write(raw)
            await up_writer.drain()
            data = await up_reader.read()  # Azurite closes: the request said Connection: close
        finally:
            up_writer.close()
        head, sep, body = data.partition(b"\r\n\r\n")
        lines = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"connection:")]
        return b"\r\n".join(lines) + sep + body


def _status(response: bytes) -> int:
    """The status code of a response (``HTTP/1.1 201 Created``); 599 when unreadable."""
    parts = response.split(b"\r\n", 1)[0].split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 599


async def _read_request(
    reader: asyncio.StreamReader,
) -> tuple[str, str, dict[str, str], bytes] | None:
    """One request: method, target, headers (lower-case names) and its bytes as forwarded
    (``Connection: close`` upstream, a chunked body de-chunked with a Content-Length); None
    at the end of the connection. A head beyond the reader's limit (64 KiB; Azure's are a
    few KB) raises ``LimitOverrunError``: the connection is dropped."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    kept = [lines[0]]
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(":")
        name = name.strip().lower()
        headers[name] = value.strip()
        if name not in ("connection", "transfer-encoding", "content-length"):
            kept.append(line)
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    if body or method in ("PUT", "POST"):
        kept.append(f"Content-Length: {len(body)}")
    kept.append("Connection: close")
    return method, target, headers, ("\r\n".join(kept) + "\r\n\r\n").encode("latin-1") + body
