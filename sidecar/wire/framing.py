"""Framing of the socket protocol: newline-delimited frames, each capped in length, and the
cap on a frame's JSON nesting, checked on its bytes before it is decoded. Sans-IO.

``sidecar.wire.protocol`` builds on it (and re-exports these names); kept apart so that the
protocol module holds the requests and replies.
"""

from __future__ import annotations

import re

#: Default cap on one request line, newline excluded. A Spark progress event for a Kafka
#: source with a few thousand partitions is ~100-300 KiB; 1 MiB leaves room and still bounds
#: what one connection can make the daemon hold in memory before it sees a newline.
MAX_FRAME_BYTES = 1024 * 1024

#: Deepest JSON nesting accepted in a request. Spark's progress JSON nests about six levels
#: (request → progress → sources → source → offsets → topic → partition). Without a cap, a
#: small hostile frame nested ~1,000 levels deep makes the decoder (and any later encode)
#: hit Python's recursion limit: a RecursionError, not a bad request. 64 leaves room for any
#: source's offsets and keeps every decode and encode far from that limit.
MAX_JSON_DEPTH = 64


class FrameTooLarge(Exception):
    """A frame exceeded the limit; ``frames`` holds those completed before it in the same feed."""

    def __init__(self, size: int, frames: list[bytes]) -> None:
        super().__init__(size)
        self.size = size
        self.frames = frames


class LineFramer:
    """Split a byte stream into newline-terminated frames, never holding more than the limit.

    Incremental: a frame may arrive one byte at a time or many frames in one chunk; the
    scan resumes where it stopped, so byte-at-a-time input stays linear.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._max = max_frame_bytes
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf already known to hold no newline

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data``; return the complete frames it finished (newline stripped).

        Raises:
            FrameTooLarge: a frame is longer than the limit (the framer is then unusable).
        """
        self._buf += data
        frames: list[bytes] = []
        start = 0
        while True:
            end = self._buf.find(b"\n", max(start, self._scanned))
            if end < 0:
                break
            frame = bytes(self._buf[start:end])
            if frame.endswith(b"\r"):  # CRLF: the \r is part of the line ending, not the frame
                frame = frame[:-1]
            if len(frame) > self._max:
                raise FrameTooLarge(len(frame), frames)
            if frame:
                frames.append(frame)
            start = end + 1
        del self._buf[:start]
        self._scanned = len(self._buf)
        pending = self._scanned - self._buf.endswith(b"\r")  # a \r may be half a CRLF
        if pending > self._max:
            raise FrameTooLarge(self._scanned, frames)
        return frames

    @property
    def buffered(self) -> int:
        """Bytes held for an unfinished frame."""
        return len(self._buf)


# A JSON string literal (escapes included); brackets inside strings are not nesting.
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nesting_exceeds(frame: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text ``frame`` nests arrays/objects deeper than ``limit``."""
    if frame.count(b"[") + frame.count(b"{") <= limit:
        return False  # fewer openers than the limit: cannot be deeper (the common case)
    depth = 0
    for b in _JSON_STRING.sub(b'""', frame).translate(None, _NOT_BRACKETS):
        depth += 1 if b in b"[{" else -1
        if depth > limit:
            return True
    return False
