"""CRC-32C (Castagnoli) of file contents: what a restore checks each file's bytes by.

A snapshot's index keeps two sums per file: the SHA-256, the content's identity (what
deduplication recognises, never a CRC), and the CRC-32C, the check a restore makes on every
byte it writes — as Samza's blob store keeps a CRC-32 per file and Azure Storage a CRC-64 per
transfer. A restore is bound by its CPU when the store is near (the emulator on the same
cores, a fast network): SHA-256 runs at ~1.1 GiB/s per core here, CRC-32C at ~3.8 GiB/s
(``google-crc32c``'s C extension, which releases the interpreter lock), and the SHA-256 was
the whole gap to a plain download (``docs/benchmarks.md``). A damaged or misplaced byte
fails either check; a CRC is no defence against a forger, and neither is a SHA-256 beside
an index the same forger can rewrite.

Without the C extension (a platform with no wheel) the CRC is neither kept nor checked:
files then carry none and a restore checks their SHA-256, as for an index written before
CRCs were kept.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # its "slow pure Python" warning: see below
    import google_crc32c

#: Whether CRC-32C is fast here (the C extension); when not, none is kept or checked.
AVAILABLE = google_crc32c.implementation == "c"


def crc32c(data: bytes) -> int:
    """The CRC-32C of ``data`` (bytes: not a view)."""
    return int(google_crc32c.value(data))


def extend(crc: int, data: bytes) -> int:
    """The CRC-32C of what ``crc`` covered followed by ``data``."""
    return int(google_crc32c.extend(crc, data))
