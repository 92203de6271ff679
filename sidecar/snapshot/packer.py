"""A snapshot's small files, read and packed where they are read: what the snapshot's worker
process (``sidecar.snapshot.worker``) does for the uploader (``sidecar.snapshot.upload``), so
that the daemon's event loop receives sums and places, not bytes, and sends no pack request.

:func:`pack_files` reads each file of a :class:`PackJob` (checked against its listing, hashed),
and appends each content that is neither :attr:`PackJob.known` nor placed earlier in the job to
an open pack, which goes up create-only (:func:`~sidecar.snapshot.stored.create_blocking`:
retried as the daemon retries) once it holds ``pack_target_bytes``, and at the end. It answers,
per file in order, the sums and — for the first file of each new content — where the job placed
it; a later file of that content, and a known one, get no place: the uploader references them
where it already knows the content to be. Memory: one pack and one file.

A job fails as a whole (``FileChanged``, the store's errors after retries): it answers its
error beside what it sent (:attr:`Packed.error`), so the daemon counts the requests and
failures of a failed job too, then raises it. Packs it wrote before are named by no index and
pruned after the grace period, as any failed snapshot's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from sidecar.errors import SidecarError
from sidecar.snapshot.cut import ListedFile
from sidecar.snapshot.index import new_id, pack_name
from sidecar.snapshot.stored import RemoteBlobs, Sent, create_blocking


class SmallFile(NamedTuple):
    """A file read whole, with its sums (``CheckpointSource.read_checked``, and what
    :func:`pack_files` reads with)."""

    sha256: bytes
    #: None where CRC-32C is slow (``sidecar.snapshot.crc``).
    crc32c: int | None
    data: bytes


#: A blocking, picklable reader of one location's small files, whole with their sums and
#: checked against their listing (``CheckpointSource.reader``): what a pack job reads with.
Reader = Callable[[ListedFile], SmallFile]


class PackJob(NamedTuple):
    """Small files of one location to read, and where their new contents go."""

    files: list[ListedFile]
    #: Contents stored already (by kept snapshots, or earlier in this one): not sent again.
    known: frozenset[bytes]
    blobs: RemoteBlobs
    namespace: str
    query_id: str
    pack_target_bytes: int
    #: Tries of each pack's write (``sidecar.snapshot.stored.ATTEMPTS``, as the daemon has it).
    attempts: int


class PackedFile(NamedTuple):
    sha256: bytes
    #: None where CRC-32C is slow (``sidecar.snapshot.crc``).
    crc32c: int | None
    #: Where this job placed the content, (pack, offset); None: it was known or placed for
    #: an earlier file of the job.
    placed: tuple[str, int] | None


class Packed(NamedTuple):
    """A :class:`PackJob` done: its files' sums and places, in order; the packs it wrote,
    with their sizes; and what its store calls sent and met. With :attr:`error`, the job
    failed there: the files and packs are what it did before."""

    files: list[PackedFile]
    packs: dict[str, int]
    sent: Sent
    error: SidecarError | None = None


def pack_files(read: Reader, job: PackJob) -> Packed:
    """Do ``job`` (blocking), reading each file with ``read`` (see the module docstring).
    Its failures — ``FileChanged`` (a file is gone or not as listed), the store's errors after
    retries — are answered in :attr:`Packed.error`; anything else (a bug) raises."""
    sent = Sent({}, [], [])
    out: list[PackedFile] = []
    packs: dict[str, int] = {}
    seen = set(job.known)
    pack_id, buffer = new_id(), bytearray()

    def seal() -> None:
        nonlocal pack_id, buffer
        if buffer:
            name = pack_name(job.namespace, job.query_id, pack_id)
            create_blocking(job.blobs, name, bytes(buffer), sent, attempts=job.attempts)
            packs[pack_id] = len(buffer)
        pack_id, buffer = new_id(), bytearray()

    try:
        for file in job.files:
            small = read(file)
            if small.sha256 in seen:
                out.append(PackedFile(small.sha256, small.crc32c, None))
                continue
            seen.add(small.sha256)
            out.append(PackedFile(small.sha256, small.crc32c, (pack_id, len(buffer))))
            buffer += small.data
            if len(buffer) >= job.pack_target_bytes:
                seal()
        seal()
    except SidecarError as exc:
        return Packed(out, packs, sent, exc)
    return Packed(out, packs, sent)
