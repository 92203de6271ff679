"""The snapshot blobs' I/O (``sidecar.snapshot``: packs and indexes), in the checkpoint
container: immutable blobs written once (``If-None-Match: *``), streamed up in blocks (memory
bounded by one block whatever a file's size), listed, read whole or by range, deleted
idempotently. The format of what they hold is ``sidecar.snapshot.index``'s; this module knows
names and bytes only. Every call goes through the account's ``call`` (time limit, errors
translated, health noted), like the checkpoint blobs'.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Mapping, Sequence
from datetime import datetime

import msgspec

from sidecar.errors import VersionConflict
from sidecar.store.account import StoreAccount
from sidecar.store.blobs import quoted_etag
from sidecar.store.remote import BlobTarget, block_id
from sidecar.store.sdk import load as sdk

#: A pack is staged in blocks of this size (Azure's block blobs: a Put Block each, then one
#: Put Block List); a pack no larger goes up in a single Put Blob.
BLOCK_BYTES = 4 * 1024 * 1024


class ListedBlob(msgspec.Struct, frozen=True):
    """A snapshot blob as listed."""

    name: str
    size: int
    version: str
    last_modified: datetime | None


class SnapshotBlobs:
    """Reads and writes the snapshot blobs of one store account's container (the daemon's, or
    a tool's): beside the checkpoint blobs (``sidecar.store.blobs``), sharing only the
    account's edge (clients, time limits, health)."""

    def __init__(
        self,
        account: StoreAccount,
        *,
        block_bytes: int = BLOCK_BYTES,
        parent: SnapshotBlobs | None = None,
    ) -> None:
        self._account = account
        self.block_bytes = block_bytes
        #: Requests sent, by kind (put, block, commit, list, read, delete): what a snapshot
        #: costs in storage transactions (metrics, benchmarks).
        self.requests: dict[str, int] = {}
        self._parent = parent

    def counted(self) -> SnapshotBlobs:
        """A view of the same store whose :attr:`requests` counts only the calls made through
        it (they count in this one's too): one snapshot's, one prune's, one restore's, while
        others share the store."""
        return SnapshotBlobs(self._account, block_bytes=self.block_bytes, parent=self)

    def _count(self, kind: str, n: int = 1) -> None:
        self.requests[kind] = self.requests.get(kind, 0) + n
        if self._parent is not None:
            self._parent._count(kind, n)

    def target(self) -> BlobTarget:
        """Where another process writes blobs of this store (a snapshot's packs and index,
        from the worker that reads the files: ``sidecar.store.remote``)."""
        config = self._account.config
        return BlobTarget(
            self._account.container,
            config.write_timeout_s,
            self.block_bytes,
            connection_string=config.azure_connection_string or None,
            account_url=config.account_url or None,
        )

    def sent_elsewhere(
        self, requests: Mapping[str, int], failures: Sequence[tuple[str, str]]
    ) -> None:
        """Requests another process sent to :meth:`target`, counted as this object's, and the
        calls that failed there, (call, reason), told to the store's failure count."""
        for kind, n in requests.items():
            self._count(kind, n)
        if self._account.on_failure is not None:
            for what, reason in failures:
                self._account.on_failure(what, reason)

    def _client(self, name: str):  # type: ignore[no-untyped-def]  # the SDK's BlobClient
        return self._account.container_client.get_blob_client(name)

    async def put(self, name: str, chunks: AsyncIterable[bytes]) -> tuple[int, str]:
        """Write the blob ``name`` from ``chunks``, only if it does not exist; its size and
        version. Up to one block is held in memory: a body no larger than a block goes up in
        one Put Blob, a larger one in blocks (a Put Block each) and one Put Block List.

        Raises:
            VersionConflict: the blob exists already (ids are random: a retry of a write that
                landed; the caller uses a new id).
            SidecarError: the store's errors (``StoreUnavailable``: retry).
        """
        blob = self._client(name)
        buffer = bytearray()
        blocks: list[str] = []
        size = 0
        async for chunk in chunks:
            buffer += chunk
            size += len(chunk)
            while len(buffer) >= self.block_bytes:
                await self._stage(blob, blocks, bytes(buffer[: self.block_bytes]))
                del buffer[: self.block_bytes]
        # The SDK's "exists" is caught inside the store's call, which would translate it into
        # a plain StoreError.
        if not blocks:  # one request
            self._count("put")
            async with self._account.call("write snapshot blob"):
                try:
                    answer = await blob.upload_blob(bytes(buffer), overwrite=False)
                except sdk().ResourceExistsError as exc:
                    raise VersionConflict(f"snapshot blob {name} exists already") from exc
            return size, str(answer["etag"])
        if buffer:
            await self._stage(blob, blocks, bytes(buffer))
        self._count("commit")
        async with self._account.call("commit snapshot blob"):
            try:
                # IfMissing alone is If-None-Match: * (an etag beside it would reach aiohttp)
                answer = await blob.commit_block_list(
                    blocks, match_condition=sdk().MatchConditions.IfMissing
                )
            except sdk().ResourceExistsError as exc:
                raise VersionConflict(f"snapshot blob {name} exists already") from exc
        return size, str(answer["etag"])

    async def _stage(self, blob, blocks: list[str], data: bytes) -> None:  # type: ignore[no-untyped-def]
        block = block_id(len(blocks))
        self._count("block")
        async with self._account.call("stage snapshot block"):
            await blob.stage_block(block, data)
        blocks.append(block)

    async def replace(self, name: str, body: bytes, version: str) -> str:
        """Overwrite ``name`` if it is still at ``version`` (a repacked index); its new version.

        Raises:
            VersionConflict: it changed (or is gone) since.
        """
        self._count("put")
        async with self._account.call("replace snapshot blob"):
            try:
                answer = await self._client(name).upload_blob(
                    body,
                    overwrite=True,
                    etag=version,
                    match_condition=sdk().MatchConditions.IfNotModified,
                )
            except sdk().ResourceNotFoundError as exc:
                raise VersionConflict(f"snapshot blob {name} is gone") from exc
        return str(answer["etag"])

    async def list(self, prefix: str) -> list[ListedBlob]:
        """Every blob whose name starts with ``prefix`` (one listing request per page); each
        version as the other calls give it (a listing's ETags come without their quotes)."""
        out: list[ListedBlob] = []
        async with (
            self._account.call("list snapshot blobs"),
            self._account.not_created_yet(),
        ):
            pages = self._account.container_client.list_blobs(name_starts_with=prefix).by_page()
            async for page in pages:
                self._count("list")
                async for item in page:
                    out.append(
                        ListedBlob(
                            item.name,
                            int(item.size or 0),
                            quoted_etag(item.etag),
                            item.last_modified,
                        )
                    )
        return out

    async def read(self, name: str) -> tuple[bytes, str] | None:
        """The blob's body and version; None when it does not exist."""
        self._count("read")
        async with self._account.call("read snapshot blob"):
            try:
                stream = await self._client(name).download_blob()
                return await stream.readall(), str(stream.properties.etag)
            except sdk().ResourceNotFoundError:
                return None

    async def read_range(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of ``name`` from ``offset`` (one ranged Get Blob up to 32 MiB, the
        SDK's single-request size; up to 4 MiB, its chunk size, the bytes come back uncopied).

        Raises:
            SidecarError: the store's errors; a missing blob is a ``StoreError`` naming it.
        """
        self._count("read")
        async with self._account.call("read snapshot pack"):
            stream = await self._client(name).download_blob(offset=offset, length=length)
            # The response body as the SDK holds it: readall() would copy it into a BytesIO
            # (a copy and fresh pages per byte: ~0.15 CPU-s per GiB here, 4 MiB ranges).
            parts: list[bytes] = [part async for part in stream.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def delete(self, name: str, version: str | None = None) -> bool:
        """Delete ``name`` (if still at ``version``, when given); False when it was gone:
        deletes are idempotent.

        Raises:
            VersionConflict: it changed since ``version``.
        """
        self._count("delete")
        options = (
            {}
            if version is None
            else {"etag": version, "match_condition": sdk().MatchConditions.IfNotModified}
        )
        async with self._account.call("delete snapshot blob"):
            try:
                await self._client(name).delete_blob(**options)
            except sdk().ResourceNotFoundError:
                return False
        return True
