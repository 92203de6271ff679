"""Framing of the socket protocol: newline-delimited frames, each capped. Sans-IO.

``sidecar.protocol`` builds on it (and re-exports these names); kept apart so that the
protocol module holds the requests and replies.
"""

from __future__ import annotations

#: Default cap on one request line, newline excluded. A Spark progress event for a Kafka
#: source with a few thousand partitions is ~100-300 KiB; 1 MiB leaves room and still bounds
#: what one connection can make the daemon hold in memory before it sees a newline.
MAX_FRAME_BYTES = 1024 * 1024


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
