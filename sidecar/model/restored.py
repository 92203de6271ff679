"""What a restore (``checkpoint-sidecar restore``) did, as a value: carried by the reset that
moves the sidecar's checkpoint with it (``Reset.restored``), kept in Redis beside the query's
record (``sidecar.buffer.keys``: ``restores``) and exported by the daemon as
``checkpoint_sidecar_restore_*``. A restore runs in its own process, often an init container
that nothing scrapes: the daemon that starts after it (or performs its reset) says it."""

from __future__ import annotations

import msgspec


class RestoreStats(msgspec.Struct, frozen=True, kw_only=True):
    """One restore's figures. ``at``: when its checkpoint moved, Unix seconds (0: not stamped
    yet; whoever records it stamps it); ``name``: the query's name then (None: none)."""

    seconds: float
    bytes: int
    files: int
    batch_id: int
    snapshot: str
    at: float = 0.0
    name: str | None = None


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(RestoreStats)


def encode_stats(stats: RestoreStats) -> bytes:
    return _encoder.encode(stats)


def decode_stats(data: bytes | str) -> RestoreStats | None:
    """A stored record; None when it cannot be read (another version's, edited by hand): a
    metric left out, never a reason to fail."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
