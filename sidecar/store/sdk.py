"""The Azure Storage SDK, imported the first time the store is used, not when this package is.

Importing ``azure.storage.blob.aio`` takes ~260 ms and ~40 MiB (it brings aiohttp's client,
azure-core's transports and cryptography for client-side encryption), more than half of what
the daemon took to become ready (issue #22). Readiness does not need the store
(docs/flush-owner.md, "Store health and readiness"), so the daemon imports the SDK in a worker
thread right after it is ready (:func:`load`), and a tool imports it at its first store call.
The SDK itself is used as it is: nothing of it is re-implemented here. One call, the checkpoint
write (the hot path, once per flush), is a request the store builds and sends through the SDK's
own pipeline (its credential, transport and error mapping): ``BlobStore.write``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import anyio

if TYPE_CHECKING:
    from azure.core import MatchConditions, exceptions
    from azure.core.pipeline.transport import AioHttpTransport
    from azure.core.rest import HttpRequest
    from azure.identity.aio import DefaultAzureCredential
    from azure.storage.blob.aio import BlobLeaseClient, BlobServiceClient


@dataclass(frozen=True)
class Sdk:
    """The SDK names the store uses."""

    AzureError: type[exceptions.AzureError]
    HttpResponseError: type[exceptions.HttpResponseError]
    ResourceExistsError: type[exceptions.ResourceExistsError]
    ResourceNotFoundError: type[exceptions.ResourceNotFoundError]
    ResourceModifiedError: type[exceptions.ResourceModifiedError]
    ServiceRequestError: type[exceptions.ServiceRequestError]
    ServiceResponseError: type[exceptions.ServiceResponseError]
    BlobLeaseClient: type[BlobLeaseClient]
    BlobServiceClient: type[BlobServiceClient]
    AioHttpTransport: type[AioHttpTransport]
    #: ``If-Match`` / ``If-None-Match`` for conditional calls.
    MatchConditions: type[MatchConditions]
    #: A request built by the store, sent through a client's pipeline (``BlobStore.write``).
    HttpRequest: type[HttpRequest]
    #: The storage SDK's own mapping of a refused request to its error (the code and message
    #: read from the answer), raised: what its calls raise for the same answer.
    storage_error: Callable[[exceptions.HttpResponseError], NoReturn]


async def loaded(*, identity: bool = False) -> Sdk:
    """The SDK (and, with ``identity``, azure-identity's credential), imported in a worker
    thread if it was not yet: the event loop never waits on the import (a call made while
    another thread imports waits in its own thread)."""
    if load.cache_info().currsize and (not identity or credential.cache_info().currsize):
        return load()
    if identity:
        await anyio.to_thread.run_sync(credential)
    return await anyio.to_thread.run_sync(load)


@functools.cache
def credential() -> type[DefaultAzureCredential]:
    """azure-identity's ``DefaultAzureCredential`` (aio), for ``SIDECAR_ACCOUNT_URL``."""
    from azure.identity.aio import DefaultAzureCredential

    return DefaultAzureCredential


@functools.cache
def load() -> Sdk:
    """Import the SDK (once; thread-safe: Python's import lock) and return its names."""
    from azure.core import MatchConditions
    from azure.core import exceptions as e
    from azure.core.pipeline.transport import AioHttpTransport
    from azure.core.rest import HttpRequest
    from azure.storage.blob._shared.response_handlers import process_storage_error
    from azure.storage.blob.aio import BlobLeaseClient, BlobServiceClient

    return Sdk(
        e.AzureError,
        e.HttpResponseError,
        e.ResourceExistsError,
        e.ResourceNotFoundError,
        e.ResourceModifiedError,
        e.ServiceRequestError,
        e.ServiceResponseError,
        BlobLeaseClient,
        BlobServiceClient,
        AioHttpTransport,
        MatchConditions,
        HttpRequest,
        process_storage_error,
    )
