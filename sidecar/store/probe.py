"""What the storage probe did (``BlobStore.probe``), for ``doctor``'s rules. Pure."""

from __future__ import annotations

import msgspec


class Probe(msgspec.Struct):
    """What the storage probe did (``BlobStore.probe``): each step tried (create, lease,
    write, read, release, delete), with its error (None: done)."""

    blob_name: str
    steps: dict[str, str | None]
    #: The version id the store gave the write (only when blob versioning is on).
    version_id: str | None = None

    @property
    def ok(self) -> bool:
        """No step tried so far was refused."""
        return all(error is None for error in self.steps.values())
