"""An HTTP-aware fault proxy in front of Azurite: the failures Azure Storage shows in
production, chosen per kind of call and share of requests, with a seed.

Azure answers a throttled account with ``503 ServerBusy`` (and ``Retry-After``), an operation
that ran out of server time with ``500 OperationTimedOut``, a slow client with ``408``, and
networks drop connections mid-response. :class:`StoreFaultProxy` forwards each request to
Azurite (one upstream connection per request, so a fault never leaks into the next) and, when
a :class:`Fault` matches, answers or breaks it instead:

- ``status``: 503 / 500 / 408 with Azure's error body and ``x-ms-error-code`` — before the
  request reaches Azurite (``forward=False``: not executed, as ServerBusy) or after
  (``forward=True``: executed, then the client sees the error, as OperationTimedOut can be);
- ``reset``: the request runs upstream, the client gets half of the response and then a TCP
  reset (the call's outcome is unknown to the daemon: the write may have landed);
- ``drop``: the connection reset before the request reaches Azurite (a store that is down);
- ``delay_headers`` / ``delay_body``: the response, or its body, held ``delay_s``;
- ``hold``: the request kept in the network (never answered, not yet sent upstream) until
  :meth:`StoreFaultProxy.deliver_held` sends it on — a write delayed past its client's
  timeout, or past its client's death, that lands later.

The kind of a call is read from the REST request: ``acquire``, ``renew``, ``release``,
``break`` (lease actions), ``create`` (an empty blob, if absent), ``upload``, ``read``,
``list``, ``ping`` (container properties), ``other``. The proxy runs on its own event loop
in a thread, so sync tests of real daemon processes and async tests both use it; it counts
requests and faults injected per kind.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Literal, Self
from urllib.parse import parse_qs, urlsplit

from tests.services import azurite_connection_string

Action = Literal["status", "reset", "drop", "delay_headers", "delay_body", "hold"]
_REASONS = {503: "Service Unavailable", 500: "Internal Server Error", 408: "Request Timeout"}
_CODES = {503: "ServerBusy", 500: "OperationTimedOut", 408: "RequestTimeout"}


@dataclass(frozen=True)
class Fault:
    action: Action
    #: Kinds of call it applies to (None: every kind).
    kinds: frozenset[str] | None = None
    #: Share of the matching requests it applies to (by the proxy's seeded random).
    share: float = 1.0
    status: int = 503
    #: ``status``: whether the request reaches the store first (it ran, the client sees an
    #: error) or not (it never ran).
    forward: bool = False
    delay_s: float = 0.0
    retry_after_s: int = 1
    #: Only requests whose path holds this (a blob name's part: ``/packs/``); None: any.
    path_has: str | None = None
    #: Applied this many times at most (None: no limit).
    times: int | None = None


def kind_of(method: str, target: str, headers: dict[str, str]) -> str:
    query = parse_qs(urlsplit(target).query)
    comp = query.get("comp", [""])[0]
    if comp == "lease":
        return headers.get("x-ms-lease-action", "lease")
    if query.get("restype", [""])[0] == "container":
        return "list" if comp == "list" else ("ping" if method in ("GET", "HEAD") else "other")
    if method == "PUT" and not comp and headers.get("x-ms-blob-type"):
        return "create" if headers.get("if-none-match") == "*" else "upload"
    if method == "GET" and not comp:
        return "read"
    return "other"


class StoreFaultProxy:
    """``with StoreFaultProxy(azurite.port, seed=7) as proxy:`` — point the daemon at
    ``proxy.port``; set :attr:`faults` at any time (the first matching fault applies)."""

    def __init__(self, upstream_port: int, *, seed: int = 0) -> None:
        self._upstream_port = upstream_port
        self._random = random.Random(seed)
        self.faults: list[Fault] = []
        self.port = 0
        #: Requests seen and faults injected, by kind of call ("<action> <status>" too).
        self.requests: Counter[str] = Counter()
        self.injected: Counter[tuple[str, str]] = Counter()
        #: Every fault injected: (action, kind, request line), in order.
        self.struck: list[tuple[str, str, str]] = []
        #: Requests held by a ``hold`` fault, in order, until delivered.
        self.held: list[bytes] = []
        #: Times each fault was applied.
        self._applied: Counter[Fault] = Counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def __enter__(self) -> Self:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self.port = future.result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def connection_string(self) -> str:
        """Azurite's account, reached through this proxy."""
        return azurite_connection_string(self.port)

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _stop(self) -> None:
        """Stop listening, drop every connection, end every task of the proxy's loop."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def answered(self, method: str, target: str, headers: dict[str, str], response: bytes) -> None:
        """Called with each request forwarded and answered untouched (on the proxy's loop):
        a subclass counts them (``bench/store_counter.py``)."""

    def _choose(self, kind: str, target: str) -> Fault | None:
        for fault in list(self.faults):
            if fault.kinds is not None and kind not in fault.kinds:
                continue
            if fault.path_has is not None and fault.path_has not in urlsplit(target).path:
                continue
            if fault.times is not None and self._applied[fault] >= fault.times:
                continue
            if self._random.random() < fault.share:
                self._applied[fault] += 1
                return fault
        return None

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                method, target, headers, raw = request
                kind = kind_of(method, target, headers)
                self.requests[kind] += 1
                fault = self._choose(kind, target)
                if fault is not None:
                    label = (
                        f"{fault.action} {fault.status}"
                        if fault.action == "status"
                        else fault.action
                    )
                    self.injected[(label, kind)] += 1
                    self.struck.append((label, kind, f"{method} {target}"))
                if fault is not None and fault.action == "drop":
                    _reset(writer)
                    return
                if fault is not None and fault.action == "hold":
                    self.held.append(raw)
                    await asyncio.Event().wait()  # never answered: the client gives up or dies
                if fault is not None and fault.action == "status" and not fault.forward:
                    writer.write(_error(fault))
                    await writer.drain()
                    continue
                response = await self._forward(raw)
                if fault is None:
                    self.answered(method, target, headers, response)
                    writer.write(response)
                elif fault.action == "status":
                    writer.write(_error(fault))  # it ran upstream; the client sees an error
                elif fault.action == "reset":
                    writer.write(response[: max(1, len(response) // 2)])
                    await writer.drain()
                    _reset(writer)
                    return
                elif fault.action == "delay_headers":
                    await asyncio.sleep(fault.delay_s)
                    writer.write(response)
                else:  # delay_body
                    head, _, body = response.partition(b"\r\n\r\n")
                    writer.write(head + b"\r\n\r\n")
                    await writer.drain()
                    await asyncio.sleep(fault.delay_s)
                    writer.write(body)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def deliver_held(self) -> list[int]:
        """Send every held request on to the store now; the status of each answer."""
        held, self.held = self.held, []
        answers = [
            asyncio.run_coroutine_threadsafe(self._forward(raw), self._loop).result(timeout=30)
            for raw in held
        ]
        return [int(answer.split(b" ", 2)[1]) for answer in answers]

    async def _forward(self, raw: bytes) -> bytes:
        """Send ``raw`` to Azurite on a connection of its own; the whole response, framed
        for a client that keeps its connection (no ``Connection: close``)."""
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        try:
            up_writer.write(raw)
            await up_writer.drain()
            data = await up_reader.read()  # Azurite closes: the request said Connection: close
        finally:
            up_writer.close()
        head, sep, body = data.partition(b"\r\n\r\n")
        lines = [
            line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")
        ]
        return b"\r\n".join(lines) + sep + body


async def _read_request(
    reader: asyncio.StreamReader,
) -> tuple[str, str, dict[str, str], bytes] | None:
    """One request: method, target, headers (lower-case names) and its bytes as forwarded
    (``Connection: close`` upstream, the body de-chunked with a Content-Length)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    kept: list[str] = [lines[0]]
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
        if name.strip().lower() not in ("connection", "transfer-encoding", "content-length"):
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
    raw = ("\r\n".join(kept) + "\r\n\r\n").encode("latin-1") + body
    return method, target, headers, raw


def _error(fault: Fault) -> bytes:
    code = _CODES.get(fault.status, "InternalError")
    body = (
        '<?xml version="1.0" encoding="utf-8"?><Error><Code>'
        f"{code}</Code><Message>fault proxy: {code}</Message></Error>"
    ).encode()
    headers = [
        f"HTTP/1.1 {fault.status} {_REASONS.get(fault.status, 'Error')}",
        "Content-Type: application/xml",
        f"Content-Length: {len(body)}",
        f"x-ms-error-code: {code}",
        "x-ms-request-id: 00000000-0000-0000-0000-000000000000",
    ]
    if fault.status == 503:
        headers.append(f"Retry-After: {fault.retry_after_s}")
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + body


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), not a clean FIN: the connection is dropped."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
