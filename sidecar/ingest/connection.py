"""One client connection on the event loop: bytes in, bytes out, both bounded.

An asyncio ``Protocol`` rather than anyio's socket stream. anyio's Unix stream reads with a
raw ``recv`` and, each time the socket has nothing yet, registers it with the selector and
removes it again (``add_reader``/``remove_reader``); on asyncio's loop every registration of
an unregistered socket first fails a lookup whose ``KeyError`` message formats the socket
(``socket.__repr__`` asks the kernel for both addresses): 11.7 % of the loop's time with one
request at a time. A transport keeps the socket registered for the connection's life, and
its reads and writes take no library lookup and force no extra pass of the loop.

Reads: what arrived is handed over whole by :meth:`Connection.read`; above
``MAX_BUFFERED_BYTES`` not yet read the transport stops reading (the client's writes block:
backpressure). Writes: :meth:`Connection.write` queues the bytes and writes them all at the
end of the loop's current pass, so the replies that are ready together leave in one system
call; while the client does not read them and the transport's buffer is full, the server
waits (:meth:`Connection.drain`).
"""

from __future__ import annotations

import asyncio
import socket
from typing import cast

#: Bytes received and not yet taken by the server before the transport stops reading.
MAX_BUFFERED_BYTES = 1024 * 1024


class Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._received: list[bytes] = []
        self._buffered = 0
        self._paused_reading = False
        self._eof = False
        self._reader: asyncio.Future[None] | None = None
        self._out: list[bytes] = []
        self._drained: asyncio.Future[None] | None = None  # set while writing is paused
        #: True once the transport is gone (the client left, or we closed it).
        self.lost = False

    @classmethod
    async def accepted(cls, sock: socket.socket) -> Connection:
        """Wrap a socket returned by ``accept`` (Unix or TCP)."""
        loop = asyncio.get_running_loop()
        _, protocol = await loop.connect_accepted_socket(cls, sock)
        return protocol

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._received.append(data)
        self._buffered += len(data)
        if self._buffered > MAX_BUFFERED_BYTES and not self._paused_reading:
            self._paused_reading = True
            self._transport.pause_reading()  # type: ignore[union-attr]
        self._wake_reader()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake_reader()
        return True  # keep the transport open: the replies still go out (half-close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = self._eof = True
        self._wake_reader()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # --- the server's side -----------------------------------------------------------------

    async def read(self) -> bytes:
        """Everything received since the last call; ``b""`` at the end of the input (the
        client closed its side or left, or :meth:`stop_reading`)."""
        while not self._received:
            if self._eof:
                return b""
            self._reader = asyncio.get_running_loop().create_future()
            try:
                await self._reader
            finally:
                self._reader = None
        data = self._received[0] if len(self._received) == 1 else b"".join(self._received)
        self._received.clear()
        self._buffered = 0
        if self._paused_reading and not self._eof:
            self._paused_reading = False
            self._transport.resume_reading()  # type: ignore[union-attr]
        return data

    def stop_reading(self) -> None:
        """Read no more (stopping): :meth:`read` returns ``b""`` once it has handed over
        what already arrived, which the server still answers."""
        if not self._eof:
            self._eof = True
            if not self.lost and not self._paused_reading:
                self._paused_reading = True
                self._transport.pause_reading()  # type: ignore[union-attr]
            self._wake_reader()

    def write(self, data: bytes) -> None:
        """Queue ``data``, written at the end of this pass of the loop (dropped when the
        client has left); await :meth:`drain` when :attr:`full`."""
        if self.lost:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(data)

    @property
    def full(self) -> bool:
        """True while the client does not read and the transport's buffer is full."""
        return self._drained is not None and not self._drained.done()

    async def drain(self) -> None:
        """Wait until the client has read enough for the transport to take more."""
        if self._drained is not None:
            await self._drained

    def close(self) -> None:
        """Write what is queued, then close (the transport sends what it holds first)."""
        self._flush()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def _flush(self) -> None:
        if self._out and not self.lost:
            out = self._out[0] if len(self._out) == 1 else b"".join(self._out)
            self._transport.write(out)  # type: ignore[union-attr]
        self._out.clear()

    def _wake_reader(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)
