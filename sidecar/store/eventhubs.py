"""Event Hubs checkpoints (``sidecar.eventhubs``) in the account's blobs: the Event Hubs SDKs'
layout (``BlobCheckpointStore``), in a container of their own or the checkpoint container;
blobs not leased, every write conditional on the version listed (``docs/eventhubs.md``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sidecar.errors import StoreError, VersionConflict
from sidecar.store.account import StoreAccount, _code, _translate
from sidecar.store.sdk import load as sdk
from sidecar.store.sdk import loaded

if TYPE_CHECKING:
    from azure.core.exceptions import ResourceNotFoundError


class EventHubsBlobs:
    """The Event Hubs checkpoint blobs of one account (``sidecar.eventhubs.checkpointer``'s
    ``CheckpointBlobs``). Calls go through the account's (time limit, errors translated); a
    refusal of them does not count against the store's health (:attr:`StoreAccount.up`).

    Raises (every method): :class:`StoreUnavailable`, :class:`StoreError`.
    """

    def __init__(self, account: StoreAccount) -> None:
        self._account = account

    async def eventhubs_checkpoints(
        self, container: str, prefix: str
    ) -> dict[str, tuple[str | None, str]]:
        """The Event Hubs checkpoint blobs under ``prefix`` in ``container``: each blob's last
        name part (the partition id) → its ``sequencenumber`` metadata as stored (None: none)
        and its version (ETag), which a write of it names.

        Raises:
            StoreError: the container does not exist (the message says so).
        """
        await loaded(identity=self._account.identity)
        client = self._account.container_named(container)
        async with self._account.call("list eventhubs checkpoints", health=False):
            try:
                return {
                    item.name.rsplit("/", 1)[-1]: (
                        (item.metadata or {}).get("sequencenumber"),
                        str(item.etag),
                    )
                    async for item in client.list_blobs(
                        name_starts_with=prefix, include=["metadata"]
                    )
                }
            except sdk().ResourceNotFoundError as exc:
                raise _no_container(exc, self._account.where, container) from exc

    async def write_eventhubs_checkpoint(
        self, container: str, name: str, metadata: dict[str, str], version: str | None
    ) -> str:
        """Set the metadata of the checkpoint blob ``name`` if it is still at ``version``
        (``If-Match``), or, with ``version`` None, create it (empty, ``If-None-Match: *``):
        what the SDKs' ``BlobCheckpointStore.update_checkpoint`` does, but never blind. Returns
        the blob's new version.

        Raises:
            VersionConflict: the blob changed since ``version`` was listed, was deleted, or
                exists already (another writer): list it again before deciding.
            StoreError: the container does not exist (the message says so).
        """
        await loaded(identity=self._account.identity)
        blob = self._account.container_named(container).get_blob_client(name)
        async with self._account.call("write eventhubs checkpoint", health=False):
            try:
                if version is None:
                    answer = await blob.upload_blob(b"", overwrite=False, metadata=metadata)
                else:
                    answer = await blob.set_blob_metadata(
                        metadata, etag=version, match_condition=sdk().MatchConditions.IfNotModified
                    )
            except sdk().ResourceExistsError as exc:
                raise VersionConflict(
                    f"blob store {self._account.where}: {name} exists already"
                ) from exc
            except sdk().ResourceNotFoundError as exc:
                if _code(exc) == "BlobNotFound":
                    raise VersionConflict(
                        f"blob store {self._account.where}: {name} was deleted since it was listed"
                    ) from exc
                raise _no_container(exc, self._account.where, container) from exc
        return str(answer["etag"])


def _no_container(exc: ResourceNotFoundError, where: str, container: str) -> Exception:
    """A 404 on a container the daemon does not create (Event Hubs checkpoints)."""
    if _code(exc) != "ContainerNotFound":
        return _translate(exc, "eventhubs checkpoint", where)
    account = where.rsplit("/", 1)[0]
    return StoreError(
        f"blob store {account}: container {container!r} does not exist; create it (the "
        "daemon does not create the Event Hubs checkpoint container) or set "
        "SIDECAR_EVENTHUBS_CONTAINER"
    )
