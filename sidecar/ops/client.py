"""An async client for the daemon's socket, built on :mod:`sidecar.wire.protocol`.

For tools, tests and benchmarks. The Spark-side listener (``spark_bridge``) drives the same
protocol module from a synchronous background thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import ByteStream

from sidecar.wire import endpoint
from sidecar.wire.protocol import ClientConnection, Reply, encode_request


class SidecarClient:
    """One connection. Requests may be pipelined with :meth:`send_many`."""

    def __init__(self, stream: ByteStream) -> None:
        self._stream = stream
        self._conn = ClientConnection()
        self._ids = itertools.count(1)
        self._replies: list[Reply] = []

    @classmethod
    async def connect(
        cls,
        socket_path: str | None = None,
        *,
        tcp: bool = False,
        tcp_port: int | None = None,
        token: str | None = None,
    ) -> SidecarClient:
        """Connect to the daemon's Unix socket at ``socket_path``; with ``tcp``, to its
        loopback TCP listener instead, as the endpoint file beside ``socket_path`` names it,
        authenticated with the token there. ``tcp_port``: that port on 127.0.0.1, sending
        ``auth`` with ``token`` when given (none: for tests of the refusal).

        Raises:
            OSError: cannot connect, or the endpoint file cannot be read.
            EndpointError: the endpoint file is not one.
            ConnectionRefusedError: the daemon refused the token.
        """
        if tcp:
            assert socket_path is not None
            path = anyio.Path(endpoint.path_for(socket_path))
            found = endpoint.decode(await path.read_bytes())
            tcp_port, token = found.port, found.token
            host = found.host
        else:
            host = "127.0.0.1"
        if tcp_port is None:
            assert socket_path is not None
            return cls(await anyio.connect_unix(socket_path))
        client = cls(await anyio.connect_tcp(host, tcp_port))
        if token is not None:
            reply = await client.request("auth", token=token)
            if not reply.ok:
                await client.aclose()
                why = reply.error.message if reply.error else "refused"
                raise ConnectionRefusedError(f"the daemon refused the token: {why}")
        return client

    async def __aenter__(self) -> SidecarClient:
        return self

    async def __aexit__(
        self, *exc: type[BaseException] | BaseException | TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def send_raw(self, data: bytes) -> None:
        """Send bytes as they are (for protocol tests)."""
        await self._stream.send(data)

    async def receive(self, count: int = 1) -> list[Reply]:
        """Wait for ``count`` more replies.

        Raises:
            anyio.EndOfStream: the daemon closed the connection first.
        """
        while len(self._replies) < count:
            self._replies += self._conn.receive_data(await self._stream.receive())
        out, self._replies = self._replies[:count], self._replies[count:]
        return out

    async def request(self, op: str, **fields: Any) -> Reply:
        await self._stream.send(encode_request(op, next(self._ids), **fields))
        (reply,) = await self.receive(1)
        return reply

    async def send_many(self, requests: Sequence[tuple[str, dict[str, Any]]]) -> list[Reply]:
        """Pipeline several requests in one write; return their replies in order."""
        data = b"".join(encode_request(op, next(self._ids), **f) for op, f in requests)
        await self._stream.send(data)
        return await self.receive(len(requests))

    async def progress(self, progress: dict[str, Any]) -> Reply:
        return await self.request("progress", progress=progress)

    async def get(self, query_id: str) -> Reply:
        return await self.request("get", query_id=query_id)

    async def ping(self) -> Reply:
        return await self.request("ping")
