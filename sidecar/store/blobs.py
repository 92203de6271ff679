"""The blob store: one JSON document per query, every write under that blob's lease.

Layout: container ``SIDECAR_CONTAINER``, blob ``<namespace>/<query_id>.json``, metadata
``query_name`` (so ``list`` can show names without downloading). The document format is
:class:`sidecar.model.document.CheckpointDocument` (``docs/blob-format.md``).

The account's edge (clients, time limits, health, the container) is
:class:`sidecar.store.account.StoreAccount`; Azure SDK errors are translated there, once
(its module docstring says how). A body that is not a checkpoint document of its query →
:class:`CorruptRecord`; ``list`` marks such a blob instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from sidecar.config import Config
from sidecar.errors import CorruptRecord, SidecarError
from sidecar.model.document import CheckpointDocument, Stored, decode_document
from sidecar.store.account import Refusal, StoreAccount

# Re-exported: imported from here by the snapshot blobs and the worker process's writes.
from sidecar.store.account import quoted_etag as quoted_etag
from sidecar.store.account import translated as translated
from sidecar.store.probe import Probe
from sidecar.store.sdk import load as sdk

if TYPE_CHECKING:
    from azure.storage.blob.aio import BlobLeaseClient


class BlobInfo(msgspec.Struct, frozen=True):
    """A checkpoint blob as listed: its document (None while still empty, or unreadable) and
    lease state."""

    blob_name: str
    lease_state: str
    document: CheckpointDocument | None
    #: The query the blob belongs to (from its name) and, when written by the daemon, the
    #: query's name (from the blob's metadata, so an unreadable blob is still named).
    query_id: str = ""
    query_name: str | None = None
    last_modified: datetime | None = None
    #: Why the document cannot be read (the CorruptRecord's ``problem``); None when readable.
    unreadable: str | None = None

    def checked(self) -> CheckpointDocument | None:
        """The document; None while the blob is still empty.

        Raises:
            CorruptRecord: the blob cannot be read (it is left as it is).
        """
        if self.unreadable is not None:
            raise CorruptRecord("blob", self.blob_name, self.unreadable)
        return self.document


class BlobStore:
    """Async access to the checkpoint container: the checkpoint documents and their leases,
    and what ``doctor`` checks. Every call is time-limited (:attr:`account`'s).

    Raises (every method): :class:`StoreUnavailable`, :class:`StoreError`, and where noted
    :class:`LeaseConflict` / :class:`LeaseLost`.
    """

    def __init__(
        self,
        config: Config,
        *,
        creates_container: bool = False,
        account: StoreAccount | None = None,
    ) -> None:
        """``creates_container``: this store's owner (the daemon) creates the container once
        the store answers, so until then a missing container reads as one without blobs; a
        tool's store reports it (a wrong container must not look empty). ``account``: the
        account's edge to share (default: one made from ``config``)."""
        #: The account's edge: clients, time limits, health (shared with the snapshot blobs and
        #: the Event Hubs checkpoints).
        self.account = account or StoreAccount(config, creates_container=creates_container)
        self._namespace = config.namespace

    # --- the account's, as callers have always read them --------------------------------

    @property
    def container(self) -> str:
        return self.account.container

    @property
    def where(self) -> str:
        """The container's URL (for messages; makes the SDK's client if not yet made)."""
        return self.account.where

    @property
    def up(self) -> bool:
        """Whether the daemon can use the store (:attr:`StoreAccount.up`). Safe from any
        thread."""
        return self.account.up

    @property
    def available(self) -> bool | None:
        """Whether the store answered the last call that ended (:attr:`StoreAccount.available`)."""
        return self.account.available

    @property
    def last_call_at(self) -> float:
        """Monotonic time the last call ended, either way (an idle store is probed)."""
        return self.account.last_call_at

    @property
    def refusal(self) -> Refusal | None:
        """The last refusal of the daemon's own calls (:attr:`StoreAccount.refusal`)."""
        return self.account.refusal

    @property
    def on_failure(self) -> Callable[[str, str], None] | None:
        """Told (call, reason) of every call the store did not answer or refused."""
        return self.account.on_failure

    @on_failure.setter
    def on_failure(self, told: Callable[[str, str], None] | None) -> None:
        self.account.on_failure = told

    async def ping(self) -> None:
        """:meth:`StoreAccount.ping`."""
        await self.account.ping()

    async def ensure_container(self) -> None:
        """:meth:`StoreAccount.ensure_container`."""
        await self.account.ensure_container()

    async def aclose(self) -> None:
        await self.account.aclose()

    # --- checkpoint documents and their leases ---------------------------------------------

    def blob_name(self, query_id: str) -> str:
        return f"{self._namespace}/{query_id}.json"

    async def create_if_absent(self, query_id: str) -> str | None:
        """Create the query's blob (empty) so it can be leased, only if it does not exist
        (``If-None-Match: *``): its version when this call created it, None when it existed."""
        blob = await self.account.blob(self.blob_name(query_id))
        async with self.account.call("create blob"):
            try:
                created = await blob.upload_blob(b"", overwrite=False)
            except sdk().ResourceExistsError:
                return None
            except sdk().HttpResponseError as exc:
                # An existing blob under someone's lease answers 412 to a lease-less create.
                if exc.status_code != 412:
                    raise
                return None
        return str(created["etag"])

    async def acquire_lease(self, query_id: str, lease_id: str, duration_s: int) -> str | None:
        """Acquire (or re-acquire) the lease with our ``lease_id``; the blob's version (ETag)
        as the store reports it with the lease (None: not reported).

        Raises:
            LeaseConflict: another lease is active on the blob.
        """
        lease = await self._lease_client(query_id, lease_id)
        async with self.account.call("acquire lease"):
            await lease.acquire(lease_duration=duration_s)
        return _etag(lease.etag)

    async def renew_lease(self, query_id: str, lease_id: str) -> str | None:
        """Renew the lease; the blob's version (ETag) as the store reports it (None: not
        reported): another than the one last written or read here means the blob changed under
        the lease (the store went back, or was restored).

        Raises:
            LeaseLost: the lease expired and was taken, or was broken.
        """
        lease = await self._lease_client(query_id, lease_id)
        async with self.account.call("renew lease"):
            await lease.renew()
        return _etag(lease.etag)

    async def release_lease(self, query_id: str, lease_id: str) -> None:
        async with self.account.call("release lease"):
            with contextlib.suppress(sdk().ResourceNotFoundError):  # archived: no lease left
                await (await self._lease_client(query_id, lease_id)).release()

    async def archive(self, query_id: str, lease_id: str, stamp: str, version: str) -> str:
        """Move the query's blob to ``<namespace>/archive/<id>.<stamp>.json`` (never listed as
        a query): copy it (metadata kept), then delete it under ``lease_id``; the new name.
        Both the copy's read and the delete are conditional on ``version``, the one the caller
        decided on: a blob changed meanwhile is neither copied nor deleted.

        Raises:
            VersionConflict: the blob is no longer at ``version`` (nothing was deleted).
        """
        blob = await self.account.blob(self.blob_name(query_id))
        name = f"{self._namespace}/archive/{query_id}.{stamp}.json"
        unchanged = sdk().MatchConditions.IfNotModified
        async with self.account.call("archive checkpoint"):
            stream = await blob.download_blob(etag=version, match_condition=unchanged)
            target = self.account.container_client.get_blob_client(name)
            await target.upload_blob(await stream.readall(), metadata=stream.properties.metadata)
            await blob.delete_blob(lease=lease_id, etag=version, match_condition=unchanged)
        return name

    async def write(
        self, query_id: str, body: bytes, *, lease_id: str, query_name: str | None, version: str
    ) -> str:
        """Replace the query's document, conditionally: the store refuses it unless
        ``lease_id`` holds the blob's lease and the blob is still at ``version`` (``If-Match``,
        the version the writer read or wrote last). Returns the new version.

        Raises:
            LeaseLost: the store refused the lease (expired, broken, another owner).
            VersionConflict: the blob changed since ``version`` (another writer): nothing
                was written; read it again.
        """
        blob = await self.account.blob(self.blob_name(query_id))
        # Put Blob as the SDK's ``upload_blob`` sends it for these arguments, built here and
        # sent through the blob client's own pipeline (credential, transport, request id):
        # the SDK's option handling, request building and response deserialization were
        # ~0.2-0.3 ms of the event loop's CPU per write, of ~1.2 ms (docs/decisions.md,
        # "The checkpoint write").
        headers = {
            "x-ms-blob-type": "BlockBlob",
            "x-ms-version": blob.api_version,
            "x-ms-lease-id": lease_id,
            "If-Match": version,
            "x-ms-blob-content-type": "application/json",
            "x-ms-meta-query_id": query_id,
            "Content-Type": "application/octet-stream",
            "Accept": "application/xml",
        }
        if query_name:
            headers["x-ms-meta-query_name"] = query_name.encode("ascii", "replace").decode()
        request = sdk().HttpRequest("PUT", blob.url, headers=headers, content=body)
        async with self.account.call("write checkpoint"):
            answer = await blob._client._client.send_request(request)
            if answer.status_code != 201:
                sdk().storage_error(sdk().HttpResponseError(response=answer))
        return str(answer.headers["ETag"])

    async def read(self, query_id: str) -> CheckpointDocument | None:
        """The query's document, or None when there is no blob (or it is still empty).

        Raises:
            CorruptRecord: the blob is not a checkpoint document of that query.
        """
        return (await self.read_stored(query_id)).document

    async def read_stored(self, query_id: str) -> Stored:
        """The query's blob as it is now: its version and document (both None: no blob).

        Raises:
            CorruptRecord: the blob is not a checkpoint document of that query.
        """
        blob = await self.account.blob(self.blob_name(query_id))
        async with self.account.call("read checkpoint"):
            try:
                stream = await blob.download_blob()
                data = await stream.readall()
            except sdk().ResourceNotFoundError:
                return Stored(None, None)
        return Stored(str(stream.properties.etag), decode_document(data, blob.blob_name, query_id))

    async def find(self, query_id: str | None, name: str | None) -> CheckpointDocument | None:
        """The document of query ``query_id``, else the newest of the queries named ``name``.

        Raises:
            CorruptRecord: that blob (for ``name``: the newest blob of that name) cannot be
                read.
        """
        if query_id is not None:
            return await self.read(query_id)
        if name is None:
            return None
        newest = newest_named(await self.list(), name)
        return newest.checked() if newest is not None else None

    async def list(self) -> list[BlobInfo]:
        """Every checkpoint blob of the namespace, with its document and lease state; a blob
        that cannot be read is listed with ``unreadable`` set (see :meth:`BlobInfo.checked`)."""
        out: list[BlobInfo] = []
        prefix = f"{self._namespace}/"
        async with self.account.call("list checkpoints"), self.account.not_created_yet():
            async for item in self.account.container_client.list_blobs(
                name_starts_with=prefix, include=["metadata"]
            ):
                query_id = item.name.removeprefix(prefix).removesuffix(".json")
                if not item.name.endswith(".json") or "/" in query_id:
                    continue  # not a checkpoint (a doctor probe, an archived one)
                metadata = item.metadata or {}
                stream = await self.account.container_client.get_blob_client(
                    item.name
                ).download_blob()
                doc, unreadable = None, None
                try:
                    doc = decode_document(await stream.readall(), item.name, query_id)
                except CorruptRecord as exc:
                    unreadable = exc.problem
                out.append(
                    BlobInfo(
                        item.name,
                        str(item.lease.state or "available"),
                        doc,
                        query_id=query_id,
                        query_name=doc.name if doc is not None else metadata.get("query_name"),
                        last_modified=item.last_modified,
                        unreadable=unreadable,
                    )
                )
        return out

    async def query_ids(self) -> set[str]:
        """The ids of the namespace's queries that have a blob: a listing, nothing downloaded."""
        prefix = f"{self._namespace}/"
        names: set[str] = set()
        async with self.account.call("list checkpoint names"), self.account.not_created_yet():
            async for item in self.account.container_client.list_blobs(name_starts_with=prefix):
                if item.name.endswith(".json") and "/" not in item.name[len(prefix) :]:
                    names.add(item.name.removeprefix(prefix).removesuffix(".json"))
        return names

    async def listed_versions(self) -> dict[str, str]:
        """Each query's blob version (ETag) in the namespace, by query id: one listing, nothing
        downloaded (what the audit compares with Redis' record of each query's last flush)."""
        prefix = f"{self._namespace}/"
        out: dict[str, str] = {}
        async with self.account.call("list checkpoint versions"), self.account.not_created_yet():
            async for item in self.account.container_client.list_blobs(name_starts_with=prefix):
                name = item.name[len(prefix) :]
                if name.endswith(".json") and "/" not in name:
                    out[name.removesuffix(".json")] = quoted_etag(item.etag)
        return out

    async def lease_state(self, query_id: str) -> str:
        """The blob's lease state as the store reports it (available, leased, broken, ...)."""
        blob = await self.account.blob(self.blob_name(query_id))
        async with self.account.call("get blob properties"):
            props = await blob.get_blob_properties()
        return str(props.lease.state)

    async def _lease_client(self, query_id: str, lease_id: str) -> BlobLeaseClient:
        blob = await self.account.blob(self.blob_name(query_id))
        return sdk().BlobLeaseClient(blob, lease_id=lease_id)

    # --- what ``checkpoint-sidecar doctor`` checks (sidecar.ops.doctor) --------------------------

    async def container_listable(self) -> bool:
        """True when the container exists and may be listed; False when it does not exist."""
        async with self.account.call("list the container", health=False):
            try:
                pages = self.account.container_client.list_blobs(
                    name_starts_with=f"{self._namespace}/"
                )
                async for _ in pages.by_page():
                    break
            except sdk().ResourceNotFoundError:
                return False
        return True

    async def probe(self, token: str) -> Probe:
        """Create, lease, write (under the lease), read, release and delete a probe blob under
        the namespace (not a ``.json``: never taken for a checkpoint). Stops at the first
        refused step; the clean-up (release, delete) is tried whatever happened."""
        blob = await self.account.blob(f"{self._namespace}/doctor-probe-{token}.tmp")
        lease = sdk().BlobLeaseClient(blob, lease_id=token)
        body = f"checkpoint-sidecar doctor probe {token}".encode()
        result = Probe(blob.blob_name, {})
        steps: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("create", lambda: blob.upload_blob(b"", overwrite=False)),
            ("lease", lambda: lease.acquire(lease_duration=15)),
            ("write", lambda: blob.upload_blob(body, overwrite=True, lease=token)),  # type: ignore[arg-type]
            ("read", lambda: _read_all(blob)),
            ("release", lease.release),
            ("delete", blob.delete_blob),
        ]
        for name, call in steps:
            cleanup = name in ("release", "delete")
            needs = {"release": "lease", "delete": "create"}.get(name)
            if (not cleanup and not result.ok) or (
                needs and result.steps.get(needs, "") is not None
            ):
                continue  # a step was refused: only clean up what was done
            try:
                with anyio.CancelScope(shield=cleanup):
                    async with self.account.call(f"probe: {name}", health=False):
                        answer = await call()
            except SidecarError as exc:
                result.steps[name] = str(exc)
                continue
            result.steps[name] = None
            if name == "write":
                result.version_id = answer.get("version_id")
            elif name == "read" and answer != body:
                result.steps[name] = f"read back {len(answer)} bytes, not the {len(body)} written"
        return result

    async def soft_delete_days(self) -> int | None:
        """The account's blob soft-delete retention in days (None: off), from the blob
        service properties (an account-level call: a container SAS is refused it)."""
        async with self.account.call("get service properties", health=False):
            props = await self.account.service().get_service_properties()
        policy = props.get("delete_retention_policy")
        return int(policy.days or 0) if policy is not None and policy.enabled else None


async def _read_all(blob: Any) -> bytes:
    stream = await blob.download_blob()
    data: bytes = await stream.readall()
    return data


def newest_named(infos: list[BlobInfo], name: str) -> BlobInfo | None:
    """The most recently written blob of a query named ``name`` (a query restarted without
    its Spark checkpoint gets a new id but keeps its name), readable or not: when the newest
    one cannot be read, an older one is not the answer (:meth:`BlobInfo.checked` says why).
    Empty blobs (created for their lease, never written) are no answer either."""
    named = [
        i
        for i in infos
        if i.query_name == name and (i.document is not None or i.unreadable is not None)
    ]
    return max(named, key=_written, default=None)


def _written(info: BlobInfo) -> str:
    """When the blob was written, as sortable ISO text: the document's own time, else the
    store's (an unreadable blob has only that)."""
    if info.document is not None:
        return info.document.written_at
    return info.last_modified.isoformat(timespec="milliseconds") if info.last_modified else ""


def _etag(value: object) -> str | None:
    """:func:`quoted_etag`, or None when the answer had none."""
    return None if value is None else quoted_etag(value)
