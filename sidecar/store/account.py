"""The storage account's edge, shared by the store's blob kinds (checkpoint documents,
snapshot blobs, Event Hubs checkpoints): the SDK's clients and credential, made at the first
call; every call time-limited, its errors translated and the store's health noted
(:meth:`StoreAccount.call`); the container made if missing.

Azure SDK errors are translated here, once: a refused lease → :class:`LeaseConflict`
(acquire) or :class:`LeaseLost` (renew, write); network errors, timeouts, 5xx and 429 →
:class:`StoreUnavailable`; a refusal of the daemon itself (401/403, no token from the
identity library, no container) → :class:`StoreRefused`; anything else → :class:`StoreError`.
The SDK's own retries are off: the flusher retries with backoff and jitter and sees every
failure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from sidecar.config import Config
from sidecar.errors import (
    LeaseConflict,
    LeaseLost,
    SidecarError,
    StoreError,
    StoreRefused,
    StoreUnavailable,
    VersionConflict,
)
from sidecar.store.proxies import proxies_for, shown
from sidecar.store.sdk import credential, loaded
from sidecar.store.sdk import load as sdk

if TYPE_CHECKING:
    from azure.core.exceptions import AzureError, HttpResponseError
    from azure.storage.blob.aio import BlobClient, BlobServiceClient, ContainerClient

# The store's log lines keep the name they have always had (operators and tests grep it).
log = logging.getLogger("sidecar.store.blobs")

#: Blob clients kept (:meth:`StoreAccount.blob`): the queries flushed most recently.
BLOB_CLIENTS = 64
#: The bytes a response is read by (as the storage SDK's own transport: 256 KiB at a time).
DATA_BLOCK_SIZE = 256 * 1024

#: A refusal of the daemon (:class:`StoreRefused`) keeps :attr:`StoreAccount.up` at False this
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


class StoreAccount:
    """The account and container the store's calls go to, and its health. Every call is
    time-limited.

    Raises (every call): :class:`StoreUnavailable`, :class:`StoreRefused`, :class:`StoreError`.
    """

    def __init__(self, config: Config, *, creates_container: bool = False) -> None:
        """``creates_container``: this store's owner (the daemon) creates the container once
        the store answers, so until then a missing container reads as one without blobs; a
        tool's store reports it (a wrong container must not look empty)."""
        if not (config.azure_connection_string or config.account_url):
            config.require_blob_store()  # raises ConfigError naming both settings
        self.config = config
        self._creates_container = creates_container
        self.identity = not config.azure_connection_string
        self._namespace = config.namespace  # where the ping blob is
        self._timeout_s = config.write_timeout_s
        self.container = config.container
        # The SDK's clients, made at the first store call (``sidecar.store.sdk``).
        self._service: BlobServiceClient | None = None
        self._credential: Any = None
        #: Containers' clients (Event Hubs checkpoints may live in a container of their own).
        self._containers: dict[str, ContainerClient] = {}
        #: The blob clients used last, the oldest first (:meth:`blob`).
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

    def service(self) -> BlobServiceClient:
        """The SDK's service client, made (and the SDK imported) on first use."""
        if self._service is None:
            config = self.config
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
        config, service = self.config, sdk().BlobServiceClient
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
    def container_client(self) -> ContainerClient:
        return self.container_named(self.container)

    @property
    def where(self) -> str:
        """The container's URL (for messages; makes the SDK's client if not yet made)."""
        return f"{self.service().url.split('?')[0]}{self.container}"

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
    async def call(self, what: str, *, health: bool = True) -> AsyncIterator[None]:
        """Time-limit one SDK call, translate its errors, and note whether the store answered.
        ``health``: a refusal of this call is the daemon's (:attr:`up`); False for calls the
        daemon does not need to keep checkpoints (doctor's, Event Hubs')."""
        await loaded(identity=self.identity)
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
        return self.container_client.get_blob_client(f"{self._namespace}/.ping")

    async def _ping_call(self) -> None:
        try:
            await self._ping_blob.get_blob_properties()
        except sdk().ResourceNotFoundError as exc:
            if _code(exc) == "ContainerNotFound":
                raise

    async def ping(self) -> None:
        """One cheap call (a blob's properties): whether the store answers, and accepts the
        daemon's credentials in its container.

        Raises:
            StoreRefused: credentials refused, or the container does not exist.
        """
        async with self.call("ping"):
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
        async with self.call("open container"):
            try:
                await self._ping_call()
                return
            except sdk().ResourceNotFoundError:
                pass  # ContainerNotFound
            try:
                await self.container_client.create_container()
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

    def container_named(self, name: str) -> ContainerClient:
        client = self._containers.get(name)
        if client is None:
            client = self._containers[name] = self.service().get_container_client(name)
        return client

    @asynccontextmanager
    async def not_created_yet(self) -> AsyncIterator[None]:
        """A listing of the container the daemon has not created yet (it does once the store
        answers, after readiness) is an empty listing; for tools, and any other refusal, the
        error propagates."""
        try:
            yield
        except sdk().ResourceNotFoundError as exc:
            if not self._creates_container or _code(exc) != "ContainerNotFound":
                raise

    async def blob(self, name: str) -> BlobClient:
        """A blob's client (the SDK imported off the loop first, if it was not yet). The
        :data:`BLOB_CLIENTS` used last are kept: making one costs ~0.1 ms, a tenth of the
        CPU of a write (it builds the SDK's pipeline), and holds ~32 KB."""
        await loaded(identity=self.identity)
        client = self._blobs.pop(name, None)
        if client is None:
            client = self.container_client.get_blob_client(name)
            if len(self._blobs) >= BLOB_CLIENTS:
                del self._blobs[next(iter(self._blobs))]  # the one used longest ago
        self._blobs[name] = client
        return client

    async def aclose(self) -> None:
        if self._service is not None:
            await self._service.close()
        if self._credential is not None:
            await self._credential.close()


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
