"""Snapshot blobs written from another process: a snapshot's packs, and then its index, go up
from the worker process that reads the checkpoint's files (``sidecar.snapshot.source``), so
neither their bytes nor their requests pass through the daemon's event loop, whose CPU the
acks pay for (``docs/benchmarks.md``, the snapshots section).

:class:`BlobTarget` is what crosses to that process: where the container is and how to reach
it — picklable, no client in it, and no secret in its ``repr``. There the SDK's synchronous
client is made once per process and kept (:func:`_container`), and :meth:`BlobTarget.put`
writes a blob create-only as ``SnapshotBlobs.put`` does (one Put Blob up to a block, else
blocks and a Put Block List with ``If-None-Match: *``). Its errors are the daemon's, translated
as every store call's are (``sidecar.store.blobs.translated``); the SDK's own retries are off
here too: the caller retries (``sidecar.snapshot.stored.create_blocking``).

``ServiceRequestError`` and friends are the same classes in the synchronous SDK, so the
translation is shared. The client's per-read timeout stands in for the async store's overall
time limit: a stalled socket fails the call after ``timeout_s``.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sidecar.errors import VersionConflict
from sidecar.store.blobs import translated
from sidecar.store.sdk import load as sdk

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient


@dataclass(frozen=True)
class BlobTarget:
    """A container another process can write snapshot blobs to."""

    container: str
    #: Seconds a connection or a read may take before the call fails (retriably).
    timeout_s: float
    #: A body up to this size goes up in one request, a larger one in blocks of it.
    block_bytes: int
    #: One of the two, as the daemon's config has it (``SIDECAR_AZURE_CONNECTION_STRING``,
    #: else ``SIDECAR_ACCOUNT_URL`` with the environment's identity).
    connection_string: str | None = field(default=None, repr=False)
    account_url: str | None = None

    def put(self, name: str, body: bytes, count: Callable[[str], None]) -> str:
        """Create the blob ``name`` holding ``body`` (never overwrites); its version.
        ``count`` is told each request's kind (put, block, commit) as it is sent.

        Raises:
            VersionConflict: it exists already (a random name: an earlier send landed).
            SidecarError: the store's errors, translated (``StoreUnavailable``: retry).
        """
        container = _container(self)
        where = container.url.split("?")[0]
        blob = container.get_blob_client(name)
        what = "write snapshot blob"
        try:
            if len(body) <= self.block_bytes:
                count("put")
                answer = blob.upload_blob(body, overwrite=False)
            else:
                from azure.storage.blob import BlobBlock

                blocks: list[BlobBlock] = []
                view = memoryview(body)
                what = "stage snapshot block"
                for start in range(0, len(view), self.block_bytes):
                    count("block")
                    block = block_id(len(blocks))
                    blob.stage_block(block, bytes(view[start : start + self.block_bytes]))
                    blocks.append(BlobBlock(block))
                what = "commit snapshot blob"
                count("commit")
                answer = blob.commit_block_list(
                    blocks, match_condition=sdk().MatchConditions.IfMissing
                )
        except sdk().ResourceExistsError as exc:
            raise VersionConflict(f"snapshot blob {name} exists already") from exc
        except (sdk().AzureError, OSError) as exc:
            raise translated(exc, what, where) from exc
        return str(answer["etag"])


def block_id(n: int) -> str:
    """The id of a blob's ``n``-th block (ids of one blob must be of one length)."""
    return base64.b64encode(f"{n:08d}".encode()).decode()


@functools.lru_cache(maxsize=4)
def _container(target: BlobTarget) -> ContainerClient:
    """The synchronous SDK's client of ``target``'s container, made once in this process."""
    from azure.storage.blob import BlobServiceClient

    options: dict[str, Any] = {
        "retry_total": 0,
        "connection_timeout": target.timeout_s,
        "read_timeout": target.timeout_s,
    }
    if target.connection_string:
        service = BlobServiceClient.from_connection_string(target.connection_string, **options)
    else:
        from azure.identity import DefaultAzureCredential

        service = BlobServiceClient(
            target.account_url or "", credential=DefaultAzureCredential(), **options
        )
    return service.get_container_client(target.container)
