"""The blob store: one JSON document per query, every write under that blob's lease.

Layout: container ``SIDECAR_CONTAINER``, blob ``<namespace>/<query_id>.json``, metadata
``query_name`` (so ``list`` can show names without downloading). The document format is
:class:`sidecar.model.document.CheckpointDocument` (``docs/blob-format.md``).

Azure SDK errors are translated here, once: a refused lease → :class:`LeaseConflict`
(acquire) or :class:`LeaseLost` (renew, write); network errors, timeouts, 5xx and 429 →
:class:`StoreUnavailable`; a refusal of the daemon itself (401/403, no token from the
identity library, no container) → :class:`StoreRefused`; anything else → :class:`StoreError`.
The SDK's own retries are off: the flusher retries with backoff and jitter and sees every
failure. A body that is not a checkpoint document of its query → :class:`CorruptRecord`;
``list`` marks such a blob instead.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from sidecar.config import Config
from sidecar.errors import (
    CorruptRecord,
    LeaseConflict,
    LeaseLost,
    SidecarError,
    StoreError,
    StoreRefused,
    StoreUnavailable,
    VersionConflict,
)
from sidecar.model.document import CheckpointDocument, Stored, decode_document
from sidecar.store.probe import Probe
from sidecar.store.proxies import proxies_for, shown
from sidecar.store.sdk import credential, loaded
from sidecar.store.sdk import load as sdk

if TYPE_CHECKING:
    from azure.core.exceptions import AzureError, HttpResponseError, ResourceNotFoundError
    from azure.storage.blob.aio import (
        BlobClient,
        BlobLeaseClient,
        BlobServiceClient,
        ContainerClient,
    )

log = logging.getLogger(__name__)


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


#: Blob clients kept (:meth:`BlobStore._blob`): the queries flushed most recently.
BLOB_CLIENTS = 64
#: The bytes a response is read by (as the storage SDK's own transport: 256 KiB at a time).
DATA_BLOCK_SIZE = 256 * 1024

#: A refusal of the daemon (:class:`StoreRefused`) keeps :attr:`BlobStore.up` at False this
#: long after it, seconds, unless the refused call succeeds first: the daemon tries a refused
#: call again at least every 30 s (its backoff cap), so a store that refuses writes but
#: answers the idle ping (a read-only role) reads 0 steadily rather than flapping.
REFUSAL_HOLD_S = 60.0


class Refusal(msgspec.Struct, frozen=True):
    """The last refusal of the daemon: the call, its reason, when (``time.monotonic()``)."""

    call: str
    reason: str
    at: float


# Status codes that mean "try again later".
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class BlobStore:
    """Async access to the checkpoint container. Every call is time-limited.

    Raises (every method): :class:`StoreUnavailable`, :class:`StoreError`, and where noted
    :class:`LeaseConflict` / :class:`LeaseLost`.
    """

    def __init__(self, config: Config, *, creates_container: bool = False) -> None:
        """``creates_container``: this store's owner (the daemon) creates the container once
        the store answers, so until then a missing container reads as one without blobs; a
        tool's store reports it (a wrong container must not look empty)."""
        if not (config.azure_connection_string or config.account_url):
            config.require_blob_store()  # raises ConfigError naming both settings
        self._config = config
        self._creates_container = creates_container
        self._identity = not config.azure_connection_string
        self._namespace = config.namespace
        self._timeout_s = config.write_timeout_s
        self.container = config.container
        # The SDK's clients, made at the first store call (``sidecar.store.sdk``).
        self._service: BlobServiceClient | None = None
        self._credential: Any = None
        #: Containers' clients (Event Hubs checkpoints may live in a container of their own).
        self._containers: dict[str, ContainerClient] = {}
        #: The blob clients used last, the oldest first (:meth:`_blob`).
        self._blobs: dict[str, BlobClient] = {}
        #: Whether the store answered the last call that ended (None before any). Any answer
        #: counts, a refusal too (a lease held elsewhere, a missing blob); a timeout, a lost
        #: connection, 408, 429 or 5xx is "down". Transitions are logged once.
        self.available: bool | None = None
        #: Monotonic time the last call ended, either way (an idle store is probed).
        self.last_call_at = 0.0
        #: The last refusal of the daemon's own calls (credentials, no container); cleared when
        #: that call succeeds (:attr:`up`).
        self.refusal: Refusal | None = None
        #: Told (call, reason) of every call the store did not answer or refused (a
        #: :class:`StoreRefused`); the daemon counts them.
        self.on_failure: Callable[[str, str], None] | None = None

    def _open(self) -> BlobServiceClient:
        """The SDK's service client, made (and the SDK imported) on first use."""
        if self._service is None:
            config = self._config
            # The SDK retries are off (retry_total=0): the flusher owns retry policy.
            options: dict[str, Any] = {
                "retry_total": 0,
                "connection_timeout": config.write_timeout_s,
                "read_timeout": config.write_timeout_s,
            }
            self._service = self._client(options)
            # Proxies are looked up once, not by aiohttp in a thread per request (proxies.py).
            proxies = proxies_for(self._service.url)
            if proxies:
                through = ", ".join(shown(p) for p in proxies.values())
                log.info("blob store %s through the proxy %s", self.where, through)
                self._service = self._client({**options, "proxies": proxies})
        return self._service

    def _client(self, options: dict[str, Any]) -> BlobServiceClient:
        config, service = self._config, sdk().BlobServiceClient
        # What the storage SDK gives the transport it makes itself, but the environment's
        # proxy lookup per request (proxies.py).
        transport = sdk().AioHttpTransport(
            use_env_settings=False,
            connection_timeout=options["connection_timeout"],
            read_timeout=options["read_timeout"],
            connection_data_block_size=DATA_BLOCK_SIZE,
        )
        if config.azure_connection_string:
            return service.from_connection_string(
                config.azure_connection_string, transport=transport, **options
            )
        if self._credential is None:
            self._credential = credential()()
        url = config.account_url or ""
        return service(url, credential=self._credential, transport=transport, **options)

    @property
    def _container(self) -> ContainerClient:
        return self._container_named(self.container)

    @property
    def where(self) -> str:
        """The container's URL (for messages; makes the SDK's client if not yet made)."""
        return f"{self._open().url.split('?')[0]}{self.container}"

    def blob_name(self, query_id: str) -> str:
        return f"{self._namespace}/{query_id}.json"

    @property
    def up(self) -> bool:
        """Whether the daemon can use the store: its last call was answered (or none was made
        yet) and no call of the daemon's was refused in the last :data:`REFUSAL_HOLD_S` without
        succeeding since (``checkpoint_sidecar_store_up``). Safe from any thread."""
        refusal = self.refusal
        if refusal is not None and time.monotonic() - refusal.at < REFUSAL_HOLD_S:
            return False
        return self.available is not False

    def _mark(self, available: bool, detail: str = "") -> None:
        self.last_call_at = anyio.current_time()
        if available != self.available:
            if available:
                if self.available is not None:
                    log.info("blob store %s answers again", self.where)
            else:
                log.warning("blob store %s is unavailable: %s", self.where, detail)
        self.available = available

    def _refused(self, what: str, exc: StoreRefused) -> None:
        if self.refusal is None or self.refusal.reason != exc.reason:
            log.error("blob store refuses the daemon (checkpoint_sidecar_store_up 0): %s", exc)
        self.refusal = Refusal(what, exc.reason, time.monotonic())
        if self.on_failure is not None:
            self.on_failure(what, exc.reason)

    @asynccontextmanager
    async def _call(self, what: str, *, health: bool = True) -> AsyncIterator[None]:
        """Time-limit one SDK call, translate its errors, and note whether the store answered.
        ``health``: a refusal of this call is the daemon's (:attr:`up`); False for calls the
        daemon does not need to keep checkpoints (doctor's, Event Hubs')."""
        await loaded(identity=self._identity)
        try:
            async with self._translated(what):
                yield
        except StoreUnavailable as exc:
            self._mark(False, str(exc))
            if self.on_failure is not None:
                self.on_failure(what, exc.reason)
            raise
        except StoreRefused as exc:
            self._mark(True)  # it answered, refusing us
            if health:
                self._refused(what, exc)
            raise
        except SidecarError:
            self._mark(True)  # refused: the store answered
            raise
        self._mark(True)
        if self.refusal is not None and self.refusal.call == what:
            log.info("blob store %s accepts %s again", self.where, what)
            self.refusal = None

    @property
    def _ping_blob(self) -> BlobClient:
        """A blob that is never written (not a ``.json``: never a query's): its properties,
        read by :meth:`ping` and :meth:`ensure_container`, answer "no such blob" from a store
        that works, and "no such container" or "not authorized" from one the daemon cannot use.
        A read: what a container SAS (``r``) or a data role allows, where a container's own
        properties need an account key, an account SAS or a role on the account."""
        return self._container.get_blob_client(f"{self._namespace}/.ping")

    async def _ping_call(self) -> None:
        try:
            await self._ping_blob.get_blob_properties()
        except sdk().ResourceNotFoundError as exc:
            if _code(exc) == "ContainerNotFound":
                raise
            # No such blob: the store answered, and the container exists.

    async def ping(self) -> None:
        """One cheap call (a blob's properties): whether the store answers, and accepts the
        daemon's credentials in its container.

        Raises:
            StoreRefused: credentials refused, or the container does not exist.
        """
        async with self._call("ping"):
            await self._ping_call()

    @asynccontextmanager
    async def _translated(self, what: str) -> AsyncIterator[None]:
        try:
            with anyio.fail_after(self._timeout_s):
                yield
        except TimeoutError as exc:
            raise StoreUnavailable(
                f"blob store {self.where}: {what} timed out after {self._timeout_s}s",
                reason="timeout",
            ) from exc
        except (sdk().AzureError, OSError) as exc:
            raise translated(exc, what, self.where) from exc

    async def ensure_container(self) -> None:
        """Create the container if it does not exist. Whether it does is read first (a
        blob's properties: :attr:`_ping_blob`), so a credential that may not create
        containers (a container SAS, a role on the container) is not refused for one that
        exists.

        Raises:
            StoreRefused: credentials refused, or the container does not exist and the
                credential may not create it.
        """
        async with self._call("open container"):
            try:
                await self._ping_call()
                return
            except sdk().ResourceNotFoundError:
                pass  # ContainerNotFound
            try:
                await self._container.create_container()
                log.info("created blob container %s", self.where)
            except sdk().ResourceExistsError:
                pass
            except sdk().HttpResponseError as exc:
                if exc.status_code not in (401, 403):
                    raise
                raise StoreRefused(
                    f"blob store {self.where}: the container does not exist, and the "
                    f"credential may not create it ({exc.status_code} {_code(exc)}: "
                    f"{_said(exc)}); create it, or give the daemon a credential that may (an "
                    "account key, an account SAS, or a role on the account)",
                    reason="404 ContainerNotFound",
                ) from exc

    async def create_if_absent(self, query_id: str) -> str | None:
        """Create the query's blob (empty) so it can be leased, only if it does not exist
        (``If-None-Match: *``): its version when this call created it, None when it existed."""
        blob = await self._blob(self.blob_name(query_id))
        async with self._call("create blob"):
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
        async with self._call("acquire lease"):
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
        async with self._call("renew lease"):
            await lease.renew()
        return _etag(lease.etag)

    async def release_lease(self, query_id: str, lease_id: str) -> None:
        async with self._call("release lease"):
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
        blob = await self._blob(self.blob_name(query_id))
        name = f"{self._namespace}/archive/{query_id}.{stamp}.json"
        unchanged = sdk().MatchConditions.IfNotModified
        async with self._call("archive checkpoint"):
            stream = await blob.download_blob(etag=version, match_condition=unchanged)
            target = self._container.get_blob_client(name)
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
        blob = await self._blob(self.blob_name(query_id))
        metadata = {"query_id": query_id}
        if query_name:
            metadata["query_name"] = query_name.encode("ascii", "replace").decode()
        async with self._call("write checkpoint"):
            answer = await blob.upload_blob(
                body,
                overwrite=True,
                lease=lease_id,  # type: ignore[arg-type]  # the SDK accepts the id string
                metadata=metadata,
                content_settings=sdk().json,
                etag=version,
                match_condition=sdk().MatchConditions.IfNotModified,
            )
        return str(answer["etag"])

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
        blob = await self._blob(self.blob_name(query_id))
        async with self._call("read checkpoint"):
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
        async with self._call("list checkpoints"), self._not_created_yet():
            async for item in self._container.list_blobs(
                name_starts_with=prefix, include=["metadata"]
            ):
                query_id = item.name.removeprefix(prefix).removesuffix(".json")
                if not item.name.endswith(".json") or "/" in query_id:
                    continue  # not a checkpoint (a doctor probe, an archived one)
                metadata = item.metadata or {}
                stream = await self._container.get_blob_client(item.name).download_blob()
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
        async with self._call("list checkpoint names"), self._not_created_yet():
            async for item in self._container.list_blobs(name_starts_with=prefix):
                if item.name.endswith(".json") and "/" not in item.name[len(prefix) :]:
                    names.add(item.name.removeprefix(prefix).removesuffix(".json"))
        return names

    async def listed_versions(self) -> dict[str, str]:
        """Each query's blob version (ETag) in the namespace, by query id: one listing, nothing
        downloaded (what the audit compares with Redis' record of each query's last flush)."""
        prefix = f"{self._namespace}/"
        out: dict[str, str] = {}
        async with self._call("list checkpoint versions"), self._not_created_yet():
            async for item in self._container.list_blobs(name_starts_with=prefix):
                name = item.name[len(prefix) :]
                if name.endswith(".json") and "/" not in name:
                    out[name.removesuffix(".json")] = quoted_etag(item.etag)
        return out

    async def lease_state(self, query_id: str) -> str:
        """The blob's lease state as the store reports it (available, leased, broken, ...)."""
        blob = await self._blob(self.blob_name(query_id))
        async with self._call("get blob properties"):
            props = await blob.get_blob_properties()
        return str(props.lease.state)

    # --- what ``checkpoint-sidecar doctor`` checks (sidecar.ops.doctor) --------------------------

    async def container_listable(self) -> bool:
        """True when the container exists and may be listed; False when it does not exist."""
        async with self._call("list the container", health=False):
            try:
                pages = self._container.list_blobs(name_starts_with=f"{self._namespace}/")
                async for _ in pages.by_page():
                    break
            except sdk().ResourceNotFoundError:
                return False
        return True

    async def probe(self, token: str) -> Probe:
        """Create, lease, write (under the lease), read, release and delete a probe blob under
        the namespace (not a ``.json``: never taken for a checkpoint). Stops at the first
        refused step; the clean-up (release, delete) is tried whatever happened."""
        blob = await self._blob(f"{self._namespace}/doctor-probe-{token}.tmp")
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
                    async with self._call(f"probe: {name}", health=False):
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
        async with self._call("get service properties", health=False):
            props = await self._open().get_service_properties()
        policy = props.get("delete_retention_policy")
        return int(policy.days or 0) if policy is not None and policy.enabled else None

    # --- Event Hubs checkpoints (sidecar.eventhubs): the SDKs' layout, blobs not leased ------

    def _container_named(self, name: str) -> ContainerClient:
        client = self._containers.get(name)
        if client is None:
            client = self._containers[name] = self._open().get_container_client(name)
        return client

    async def eventhubs_checkpoints(
        self, container: str, prefix: str
    ) -> dict[str, tuple[str | None, str]]:
        """The Event Hubs checkpoint blobs under ``prefix`` in ``container``: each blob's last
        name part (the partition id) → its ``sequencenumber`` metadata as stored (None: none)
        and its version (ETag), which a write of it names.

        Raises:
            StoreError: the container does not exist (the message says so).
        """
        await loaded(identity=self._identity)
        client = self._container_named(container)
        async with self._call("list eventhubs checkpoints", health=False):
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
                raise _no_container(exc, self.where, container) from exc

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
        await loaded(identity=self._identity)
        blob = self._container_named(container).get_blob_client(name)
        async with self._call("write eventhubs checkpoint", health=False):
            try:
                if version is None:
                    answer = await blob.upload_blob(b"", overwrite=False, metadata=metadata)
                else:
                    answer = await blob.set_blob_metadata(
                        metadata, etag=version, match_condition=sdk().MatchConditions.IfNotModified
                    )
            except sdk().ResourceExistsError as exc:
                raise VersionConflict(f"blob store {self.where}: {name} exists already") from exc
            except sdk().ResourceNotFoundError as exc:
                if _code(exc) == "BlobNotFound":
                    raise VersionConflict(
                        f"blob store {self.where}: {name} was deleted since it was listed"
                    ) from exc
                raise _no_container(exc, self.where, container) from exc
        return str(answer["etag"])

    @asynccontextmanager
    async def _not_created_yet(self) -> AsyncIterator[None]:
        """A listing of the container the daemon has not created yet (it does once the store
        answers, after readiness) is an empty listing; for tools, and any other refusal, the
        error propagates."""
        try:
            yield
        except sdk().ResourceNotFoundError as exc:
            if not self._creates_container or _code(exc) != "ContainerNotFound":
                raise

    async def _blob(self, name: str) -> BlobClient:
        """A blob's client (the SDK imported off the loop first, if it was not yet). The
        :data:`BLOB_CLIENTS` used last are kept: making one costs ~0.1 ms, a tenth of the
        CPU of a write (it builds the SDK's pipeline), and holds ~32 KB."""
        await loaded(identity=self._identity)
        client = self._blobs.pop(name, None)
        if client is None:
            client = self._container.get_blob_client(name)
            if len(self._blobs) >= BLOB_CLIENTS:
                del self._blobs[next(iter(self._blobs))]  # the one used longest ago
        self._blobs[name] = client
        return client

    async def _lease_client(self, query_id: str, lease_id: str) -> BlobLeaseClient:
        blob = await self._blob(self.blob_name(query_id))
        return sdk().BlobLeaseClient(blob, lease_id=lease_id)

    async def aclose(self) -> None:
        if self._service is not None:
            await self._service.close()
        if self._credential is not None:
            await self._credential.close()


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


def _retry_after(exc: HttpResponseError) -> float | None:
    """The response's ``Retry-After`` in seconds (Azure sends it with 503 ServerBusy)."""
    response = getattr(exc, "response", None)
    value = response.headers.get("Retry-After") if response is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: not sent by Azure Storage


def _code(exc: HttpResponseError) -> str:
    """The Azure error code of a refusal (``BlobNotFound``, ``ContainerNotFound``, …)."""
    raw_code = getattr(exc, "error_code", None)  # set by the storage SDK's error mapping
    return str(getattr(raw_code, "value", raw_code) or "")


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


def _said(exc: HttpResponseError) -> str:
    """The store's own words about a refusal, on one line (a HEAD's answer has no body: its
    status line's reason then)."""
    text = (exc.message or "").strip()
    first = text.splitlines()[0] if text else ""
    if not first or first.startswith("Operation returned an invalid status"):
        first = str(getattr(exc, "reason", None) or first)
    return first.strip()


def translated(exc: AzureError | OSError, what: str, where: str) -> SidecarError:
    """The daemon's error for an SDK call's failure (the module docstring's mapping), for
    the async store and for the snapshot packs a worker process writes
    (``sidecar.store.remote``)."""
    if isinstance(exc, (sdk().ServiceRequestError, sdk().ServiceResponseError, OSError)):
        return StoreUnavailable(
            f"blob store {where} unreachable during {what}: {exc}", reason="connection"
        )
    if isinstance(exc, sdk().HttpResponseError):
        return _translate(exc, what, where)
    return StoreError(f"blob store {where}: {what} failed: {exc}")


def _translate(exc: HttpResponseError, what: str, where: str) -> SidecarError:
    if exc.status_code is None:
        # No HTTP answer at all: the credential raised before the request was sent
        # (azure-identity's ClientAuthenticationError). Its message is the identity
        # library's explanation, one line per credential it tried: kept, on one line.
        said = " ".join((exc.message or str(exc)).split())
        return StoreRefused(
            f"blob store {where}: {what} not sent: the credential could not get a token: "
            f"{said} -- check the identity's set-up (workload identity: the pod label "
            "azure.workload.identity/use, the service account's client-id annotation and the "
            "federated credential, deploy/README.md)",
            reason="credential",
        )
    status = exc.status_code
    code = _code(exc)
    detail = f"blob store {where}: {what} refused ({status} {code})"
    if status == 412 and code == "ConditionNotMet":
        return VersionConflict(
            f"{detail}: the blob is no longer the version it was read at (changed since, or the "
            "store went back)"
        )
    if code == "LeaseAlreadyPresent":
        return LeaseConflict(f"{detail}: another owner holds the lease")
    if status in (409, 412) and code.startswith("Lease"):
        return LeaseLost(f"{detail}: our lease is no longer valid")
    if status in _TRANSIENT_STATUS:
        return StoreUnavailable(
            f"{detail}; will retry",
            reason=f"{status} {code}".strip(),
            retry_after_s=_retry_after(exc),
        )
    if status in (401, 403):
        return StoreRefused(
            f"{detail}: {_said(exc)} -- check the credentials (an account key or SAS: its "
            "value, permissions and expiry; an identity: its role on the container, e.g. "
            "Storage Blob Data Contributor) and the account's firewall",
            reason=f"{status} {code}".strip(),
        )
    if code == "ContainerNotFound":
        return StoreRefused(
            f"{detail}: the container does not exist -- create it, or restart the daemon: it "
            "creates a missing container at start when its credential may",
            reason=f"{status} {code}",
        )
    return StoreError(detail)


def quoted_etag(value: object) -> str:
    """An ETag in the form a write's and a download's answers give it, quoted: ``"0x…"`` (the
    lease client and the listings give it bare): the same text for the same version."""
    text = str(value or "")
    return text if text.startswith('"') else f'"{text}"'


def _etag(value: object) -> str | None:
    """:func:`quoted_etag`, or None when the answer had none."""
    return None if value is None else quoted_etag(value)
