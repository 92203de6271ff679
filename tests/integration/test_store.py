"""The blob store's edge against real Azurite: the HTTP proxy from the environment (read once,
not by aiohttp per request), and what it keeps between calls."""

from __future__ import annotations

import base64
import logging

import pytest

from sidecar.errors import LeaseLost, StoreRefused, VersionConflict
from sidecar.model.document import encode_document
from sidecar.store import account as store_account
from sidecar.store.blobs import BlobStore, quoted_etag
from sidecar.store.proxies import proxies_for, shown
from tests.faults.store_proxy import StoreFaultProxy
from tests.helpers import ConfigFactory
from tests.services import AZURITE_KEY, AZURITE_WRONG_KEY, Azurite
from tests.unit.fakes import document

QID = "5f2c9a41-7a0e-4c7b-9d51-0f6a8e2b3c10"


class Recording(StoreFaultProxy):
    """The fault proxy, faultless, recording the Proxy-Authorization of what it forwards."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.authorizations: set[str | None] = set()

    def answered(self, method: str, target: str, headers: dict[str, str], response: bytes) -> None:
        self.authorizations.add(headers.get("proxy-authorization"))


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("http_proxy", "https_proxy", "no_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


def test_the_proxy_is_chosen_by_scheme_and_no_proxy(no_proxy_env: pytest.MonkeyPatch) -> None:
    account = "https://acct.blob.core.windows.net/"
    assert proxies_for(account) is None
    no_proxy_env.setenv("HTTPS_PROXY", "http://u:p@proxy.corp:3128")
    no_proxy_env.setenv("HTTP_PROXY", "http://plain.corp:8080")
    assert proxies_for(account) == {"https": "http://u:p@proxy.corp:3128"}
    assert proxies_for("http://127.0.0.1:10000/devstoreaccount1") == {
        "http": "http://plain.corp:8080"
    }
    no_proxy_env.setenv("NO_PROXY", "localhost,.core.windows.net")
    assert proxies_for(account) is None
    assert shown("http://u:p@proxy.corp:3128") == "http://proxy.corp:3128"  # no credentials


async def test_the_store_goes_through_the_proxy_the_environment_names(
    make_config: ConfigFactory,
    azurite: Azurite,
    no_proxy_env: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Azurite is plain HTTP: HTTP_PROXY applies; the proxy forwards to it as it is.
    with Recording(azurite.port) as proxy:
        no_proxy_env.setenv("HTTP_PROXY", f"http://user:s3cret@127.0.0.1:{proxy.port}")
        caplog.set_level(logging.INFO, "sidecar.store.blobs")
        store = BlobStore(make_config(), creates_container=True)
        try:
            await store.ensure_container()
            await store.create_if_absent(QID)
            listed = await store.list()
        finally:
            await store.aclose()
    assert [b.query_id for b in listed] == [QID]
    assert sum(proxy.requests.values()) >= 3  # every call went through it
    # ... with the credentials of the proxy's URL, and only those, for the proxy
    assert proxy.authorizations == {"Basic " + base64.b64encode(b"user:s3cret").decode()}
    assert f"through the proxy http://127.0.0.1:{proxy.port}" in caplog.text
    assert "s3cret" not in caplog.text


async def test_no_proxy_keeps_the_store_off_the_proxy(
    make_config: ConfigFactory, azurite: Azurite, no_proxy_env: pytest.MonkeyPatch
) -> None:
    with StoreFaultProxy(azurite.port) as proxy:
        no_proxy_env.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
        no_proxy_env.setenv("NO_PROXY", "127.0.0.1")
        store = BlobStore(make_config(), creates_container=True)
        try:
            await store.ensure_container()
            await store.create_if_absent(QID)
        finally:
            await store.aclose()
    assert sum(proxy.requests.values()) == 0


async def test_blob_clients_are_kept_for_the_queries_used_last(
    make_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_account, "BLOB_CLIENTS", 2)
    store = BlobStore(make_config(), creates_container=True)
    try:
        await store.ensure_container()
        made = []  # the clients themselves (held: no id reused)
        for query_id in ("a", "b", "a", "c", "a", "b"):
            await store.create_if_absent(query_id)
            made.append(await store.account.blob(store.blob_name(query_id)))
        # "a" kept while used (one client for all its calls), "b" dropped for "c", then made
        # again; never more than two kept
        assert made[0] is made[2] is made[4] and made[1] is not made[5]
        assert len(store.account._blobs) == 2
    finally:
        await store.aclose()


async def test_the_lease_and_the_listing_report_the_version_a_write_returned(
    make_config: ConfigFactory,
) -> None:
    # The store-went-back checks compare versions from four answers: a write's, a renewal's,
    # an acquisition's and the listing's. Each is the same text for the same version, and a
    # renewal after someone else's change of the blob (here: the store's own older content
    # written back, as a restore would) reports the new one.
    store = BlobStore(make_config(), creates_container=True)
    lease_id = "0f0f0f0f-0000-4000-8000-00000000000a"
    try:
        await store.ensure_container()
        created = await store.create_if_absent(QID)
        assert created is not None
        assert await store.acquire_lease(QID, lease_id, 15) == created
        first = await store.write(
            QID, encode_document(document(QID, 3)), lease_id=lease_id, query_name="q",
            version=created,
        )  # fmt: skip
        assert await store.renew_lease(QID, lease_id) == first
        assert (await store.listed_versions())[QID] == first
        second = await store.write(
            QID, encode_document(document(QID, 6)), lease_id=lease_id, query_name="q", version=first
        )
        assert await store.renew_lease(QID, lease_id) == second != first
        restored = await store.write(
            QID, encode_document(document(QID, 3)), lease_id=lease_id, query_name="q",
            version=second,
        )  # fmt: skip
        assert await store.renew_lease(QID, lease_id) == restored
        assert (await store.listed_versions()) == {QID: restored}
        assert (await store.read_stored(QID)).version == restored
    finally:
        await store.aclose()


async def test_a_write_stores_what_the_sdk_upload_did_and_is_refused_as_it_was(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    # The checkpoint write is a Put Blob built by the store and sent through the SDK's
    # pipeline. What it leaves (bytes, content type, metadata) and how the store's refusals
    # reach the flusher (the store's code, its own words) are what the SDK's upload_blob gave.
    store = BlobStore(make_config(), creates_container=True)
    lease_id = "0f0f0f0f-0000-4000-8000-00000000000b"
    body = encode_document(document(QID, 4))
    try:
        await store.ensure_container()
        created = await store.create_if_absent(QID)
        assert created is not None
        await store.acquire_lease(QID, lease_id, 15)
        written = await store.write(
            QID, body, lease_id=lease_id, query_name="orders\u00e9", version=created
        )
        assert written.startswith('"') and written != created
        blob = await store.account.blob(store.blob_name(QID))
        props = await blob.get_blob_properties()
        assert props.content_settings.content_type == "application/json"
        assert props.metadata == {"query_id": QID, "query_name": "orders?"}
        assert quoted_etag(props.etag) == written
        assert (await store.read_stored(QID)).version == written

        with pytest.raises(VersionConflict, match=r"refused \(412 ConditionNotMet\)"):
            await store.write(QID, body, lease_id=lease_id, query_name=None, version=created)
        other_lease = "0f0f0f0f-0000-4000-8000-00000000000c"
        with pytest.raises(LeaseLost, match=r"refused \(412 LeaseIdMismatchWithBlobOperation\)"):
            await store.write(QID, body, lease_id=other_lease, query_name=None, version=written)
        assert (await store.read_stored(QID)).version == written  # neither was stored
        assert store.account.refusal is None and store.up
    finally:
        await store.aclose()

    wrong_key = azurite.connection_string.replace(AZURITE_KEY, AZURITE_WRONG_KEY)
    refused = BlobStore(make_config(azure_connection_string=wrong_key))
    try:
        said = r"refused \(403 AuthorizationFailure\): Server failed to authenticate the request"
        with pytest.raises(StoreRefused, match=said):
            await refused.write(QID, body, lease_id=lease_id, query_name=None, version=written)
        assert refused.account.refusal is not None
        assert refused.account.refusal.call == "write checkpoint"
    finally:
        await refused.aclose()
