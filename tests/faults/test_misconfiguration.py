"""A first deploy's misconfigurations are not silent (issue #30): against real services, each
one shows in a metric the shipped alerts read, and the log names it.

* A wrong account key (real Azurite): ``checkpoint_sidecar_store_up`` 0 within 30 s of the
  start, the refusal counted by reason, the config checks run and exported while the store
  still refuses (they used to wait for it), and the pod stays ready (Redis buffers).
* A container deleted under a running daemon: ``store_up`` 0, back to 1 once it exists again.
* A container SAS (a credential that may not create containers, nor read the container's
  properties) opens the store and flushes.
* A failing workload identity (real azure-identity against a stand-in Entra ID token endpoint
  over TLS): the identity library's own words in the log, not "refused (0 )".
* A wrong Redis password, or none where one is required (real redis-server with
  ``requirepass``): an ERROR naming the credential, ``redis_up`` 0, ``/readyz`` saying it.
* No listener since start: ``checkpoint_sidecar_listener_seen`` 0 until the first progress.

The alerts on these metrics: deploy/prometheus/alerts_test.yml (promtool).
"""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import json
import logging
import math
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from azure.storage.blob import (
    BlobServiceClient,
    ContainerSasPermissions,
    generate_container_sas,
)

from sidecar.daemon.app import Daemon
from sidecar.model.checkpoint import decode as decode_checkpoint
from sidecar.ops.client import SidecarClient
from spark_bridge.sender import Sender
from tests.helpers import (
    ConfigFactory,
    eventually,
    http_get,
    metric_value,
    running_daemon,
    sample,
    scrape,
    wait_blob_batch,
    wait_for,
)
from tests.services import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    AZURITE_WRONG_KEY,
    Azurite,
    DaemonProcess,
    RedisServer,
    free_port,
)
from tests.sparkshapes import kafka_progress

QID = "c0ff1900-0000-4000-8000-000000000001"
STORE_UP = "checkpoint_sidecar_store_up"
FAILURES = "checkpoint_sidecar_store_failures_total"
CHECK = "checkpoint_sidecar_config_check"
#: The issue's bound: a store that refuses the daemon reads store_up 0 within this long.
STORE_UP_BOUND_S = 30


async def test_a_wrong_account_key_reads_store_up_0_and_the_checks_are_exported(
    make_config: ConfigFactory, azurite: Azurite, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(
        azure_connection_string=azurite.connection_string.replace(AZURITE_KEY, AZURITE_WRONG_KEY)
    )
    with caplog.at_level(logging.INFO, logger="sidecar"):
        async with running_daemon(config) as daemon:  # ready: the store is not part of it
            started = anyio.current_time()
            await eventually(lambda: sample(daemon, STORE_UP) == 0, timeout_s=STORE_UP_BOUND_S)
            print(f"store_up 0 {anyio.current_time() - started:.2f}s after ready")
            assert sample(daemon, FAILURES, call="open container",
                          reason="403 AuthorizationFailure") >= 1  # fmt: skip
            # The config checks ran while the store refuses, and say why.
            await eventually(lambda: not math.isnan(sample(daemon, CHECK, check="redis_version")))
            assert sample(daemon, CHECK, check="storage_container") == 0
            assert sample(daemon, CHECK, check="redis_reachable") == 1
            assert sample(daemon, STORE_UP) == 0  # still refused: the flush loop waits
            assert sample(daemon, "checkpoint_sidecar_flush_checks_total") == 0
            status, body = await anyio.to_thread.run_sync(scrape, daemon, "/readyz")
            assert (status, body) == (200, "ready\n")
            # Updates are still accepted and buffered in Redis meanwhile (the alert's point).
            async with await SidecarClient.connect(config.socket_path) as c:
                reply = await c.progress(kafka_progress(QID, 1))
            assert reply.error is not None  # a new query's floor cannot be read
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    refused = [m for m in errors if m.startswith("blob store refuses the daemon")]
    assert len(refused) == 1, errors  # once, when it began
    assert "403 AuthorizationFailure" in refused[0]
    assert "Server failed to authenticate the request" in refused[0]  # the store's words
    assert "check the credentials" in refused[0]
    assert any(m.startswith("config check storage_container: fail") for m in errors)
    assert AZURITE_WRONG_KEY not in caplog.text


async def test_a_container_deleted_under_the_daemon_reads_store_up_0_until_it_exists(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    container = f"gone{uuid.uuid4().hex[:12]}"
    # Pinged every second when idle; leases longer than the test (only the ping calls).
    config = make_config(
        container=container, count_threshold=1, write_timeout_s=1, lease_duration_s=60
    )
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    async with running_daemon(config) as daemon:
        async with await SidecarClient.connect(config.socket_path) as c:
            assert (await c.progress(kafka_progress(QID, 1))).applied
        await wait_blob_batch(daemon.store, QID, 1, timeout_s=20)
        await eventually(lambda: sample(daemon, STORE_UP) == 1)

        await anyio.to_thread.run_sync(service.delete_container, container)
        await eventually(lambda: sample(daemon, STORE_UP) == 0, timeout_s=STORE_UP_BOUND_S)
        assert sample(daemon, FAILURES, call="ping", reason="404 ContainerNotFound") >= 1
        assert daemon.store.refusal is not None
        assert daemon.store.refusal.reason == "404 ContainerNotFound"

        await anyio.to_thread.run_sync(service.create_container, container)
        await eventually(lambda: sample(daemon, STORE_UP) == 1, timeout_s=STORE_UP_BOUND_S)
        assert daemon.store.refusal is None
    service.close()


async def test_a_container_sas_opens_the_store_and_flushes(
    make_config: ConfigFactory, azurite: Azurite
) -> None:
    """A container SAS may neither create a container nor read its properties (403 to both):
    the daemon reads whether it exists from a blob's properties, so it opens (it used to
    retry the creation forever, never flushing)."""
    container = f"sas{uuid.uuid4().hex[:12]}"
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    service.create_container(container)
    sas = generate_container_sas(
        AZURITE_ACCOUNT,
        container,
        account_key=AZURITE_KEY,
        permission=ContainerSasPermissions.from_string("racwdl"),
        expiry=datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1),
    )
    config = make_config(
        container=container,
        count_threshold=1,
        azure_connection_string=f"BlobEndpoint={azurite.blob_endpoint};SharedAccessSignature={sas}",
    )
    try:
        async with running_daemon(config) as daemon:
            async with await SidecarClient.connect(config.socket_path) as c:
                assert (await c.progress(kafka_progress(QID, 1))).applied
            await wait_blob_batch(daemon.store, QID, 1, timeout_s=20)
            # The config checks' calls the SAS is refused (the account's properties) are the
            # checks' to report, not the store's health.
            await eventually(
                lambda: not math.isnan(sample(daemon, CHECK, check="storage_features"))
            )
            assert sample(daemon, CHECK, check="storage_probe") == 1
            assert sample(daemon, STORE_UP) == 1
    finally:
        service.delete_container(container)
        service.close()


# --- workload identity ------------------------------------------------------------------------

#: What Entra ID answers a federated token it has no federated credential for (its words).
ENTRA_REFUSAL = (
    "AADSTS70021: No matching federated identity record found for presented assertion. "
    "Assertion Issuer: 'https://oidc.example.test'. Assertion Subject: "
    "'system:serviceaccount:spark-apps:spark-driver'."
)


@dataclass
class TokenEndpoint:
    """A stand-in for Entra ID's token endpoint over TLS (its certificate in ``ca_file``):
    every token request is refused as Entra ID refuses a federated credential it does not
    know. No Entra ID runs here; the identity library in front of it is the real one."""

    authority: str
    ca_file: Path
    requests: list[str]


@pytest.fixture
def token_endpoint(tmp_path: Path) -> Iterator[TokenEndpoint]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "token endpoint")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "ca.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    requests: list[str] = []

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            requests.append(self.path)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.dumps(
                {"error": "invalid_client", "error_description": ENTRA_REFUSAL,
                 "error_codes": [70021]}
            ).encode()  # fmt: skip
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield TokenEndpoint(f"https://127.0.0.1:{server.server_address[1]}", cert_file, requests)
    finally:
        server.shutdown()
        server.server_close()


def test_a_failing_workload_identity_logs_the_identity_librarys_words(
    redis_server: RedisServer, namespace: str, short_tmp: Path, token_endpoint: TokenEndpoint
) -> None:
    """The environment the workload identity webhook gives a labelled pod, with a federated
    credential Entra ID does not know: the store is never called (no token), and the log
    carries azure-identity's explanation, one line."""
    token_file = short_tmp / "azure-identity-token"
    token_file.write_text("eyJhbGciOiJub25lIn0.eyJzdWIiOiJzcGFyay1kcml2ZXIifQ.")
    log_path = short_tmp / "daemon.log"
    settings = {
        "SIDECAR_REDIS_URL": redis_server.url,
        "SIDECAR_NAMESPACE": namespace,
        "SIDECAR_SOCKET_PATH": str(short_tmp / "sidecar.sock"),
        # Nothing listens there: without a token no request is sent.
        "SIDECAR_ACCOUNT_URL": f"https://127.0.0.1:{free_port()}/{AZURITE_ACCOUNT}",
        "AZURE_CLIENT_ID": str(uuid.uuid4()),
        "AZURE_TENANT_ID": str(uuid.uuid4()),
        "AZURE_FEDERATED_TOKEN_FILE": str(token_file),
        "AZURE_AUTHORITY_HOST": token_endpoint.authority,
        "SSL_CERT_FILE": str(token_endpoint.ca_file),
    }
    daemon = DaemonProcess(settings, log_path=log_path)
    for name in [k for k in daemon.env if k.startswith(("AZURE_", "IDENTITY_", "MSI_"))]:
        if name not in settings:  # only what the webhook would set
            del daemon.env[name]
    with daemon:

        def store_up() -> float | None:
            answer = http_get(f"{daemon.admin_url}/metrics")
            if answer is None or answer[0] != 200:
                return None
            return metric_value(answer[1], STORE_UP) == 0 or None

        wait_for(store_up, timeout_s=STORE_UP_BOUND_S, what="store_up 0")
        wait_for(lambda: "blob store refuses the daemon" in log_path.read_text(), 30, "log")
        text = log_path.read_text()
    assert token_endpoint.requests  # the identity library asked for a token
    [line] = [x for x in text.splitlines() if "blob store refuses the daemon" in x]
    assert "the credential could not get a token" in line
    assert "WorkloadIdentityCredential" in line and ENTRA_REFUSAL in line  # its words
    assert "refused (0 )" not in text


# --- Redis credentials -------------------------------------------------------------------------


@pytest.mark.parametrize("password", ["not-the-password", None], ids=["wrong", "missing"])
async def test_a_wrong_redis_password_is_named_as_a_credential_problem(
    make_config: ConfigFactory, password: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    with RedisServer(extra_args=["--requirepass", "the-password"]) as redis:
        url = redis.url.replace("redis://", f"redis://:{password}@" if password else "redis://")
        daemon = Daemon(make_config(redis_url=url))
        with caplog.at_level(logging.WARNING, logger="sidecar"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(daemon.run)
                await eventually(lambda: "refused the daemon's credentials" in caplog.text)
                status, body = await anyio.to_thread.run_sync(scrape, daemon, "/readyz")
                assert sample(daemon, "checkpoint_sidecar_redis_up") == 0
                daemon.request_stop()
            await daemon.stopped.wait()
    assert status == 503 and "refused the daemon's credentials" in body
    [waiting] = {
        r.getMessage().split(" (retry")[0]: r
        for r in caplog.records
        if r.getMessage().startswith("waiting for Redis")
    }.values()
    assert waiting.levelno == logging.ERROR  # a configuration error, not an outage
    message = waiting.getMessage()
    # Redis' own words (redis-py drops the WRONGPASS / NOAUTH prefix).
    said = "invalid username-password pair" if password else "Authentication required"
    assert said in message
    assert "a configuration error" in message and "SIDECAR_REDIS_URL" in message
    assert "unreachable" not in message
    assert "the-password" not in caplog.text and "not-the-password" not in caplog.text


async def test_redis_down_at_start_keeps_no_driver_back_and_its_position_lands_when_it_returns(
    make_config: ConfigFactory,
) -> None:
    # Redis is down when the pod starts. The socket accepts at once (/startupz 200: the
    # driver starts), /readyz says why the daemon is not ready, and an update is answered
    # unavailable: the bridge's sender (the listener's) keeps the newest position and
    # retries. Redis comes back: the position is in Redis within 10 s.
    redis = RedisServer()  # its port chosen, not started
    daemon = Daemon(make_config(redis_url=f"redis://127.0.0.1:{redis.port}/0"))
    sender: Sender | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(daemon.run)
            await eventually(lambda: daemon.server.bound)
            status, _ = await anyio.to_thread.run_sync(scrape, daemon, "/startupz")
            assert status == 200
            status, body = await anyio.to_thread.run_sync(scrape, daemon, "/readyz")
            assert status == 503 and "waiting for Redis" in body
            async with await SidecarClient.connect(daemon.config.socket_path) as client:
                reply = await client.progress(kafka_progress(QID, 7))
            assert not reply.ok and reply.error is not None
            assert reply.error.code == "unavailable" and "waiting for Redis" in reply.error.message
            sender = await anyio.to_thread.run_sync(Sender, daemon.config.socket_path)
            for batch in (8, 9):  # the newest supersedes the one unsent
                update = json.dumps(kafka_progress(QID, batch)).encode()
                await anyio.to_thread.run_sync(sender.offer, QID, update)
            await anyio.sleep(1.0)
            assert sender.stats().sent == 0 and sender.stats().retried > 0
            await anyio.to_thread.run_sync(redis.start)
            back = time.monotonic()

            async def stored() -> bool:
                raw = await daemon.buffer.get(QID)
                return raw is not None and decode_checkpoint(raw).batch_id == 9

            for _ in range(100):  # 10 s
                if await stored():
                    break
                await anyio.sleep(0.1)
            assert await stored(), "the newest position not in Redis 10 s after it returned"
            assert time.monotonic() - back < 10.5
            daemon.request_stop()
        await daemon.stopped.wait()
    finally:
        if sender is not None:
            await anyio.to_thread.run_sync(sender.close)
        redis.close()  # stopped, and its temp dir removed


# --- no listener -------------------------------------------------------------------------------


async def test_listener_seen_turns_1_at_the_first_progress_only(
    make_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config()
    with caplog.at_level(logging.INFO, logger="sidecar.ingest"):
        async with running_daemon(config) as daemon:
            seen = "checkpoint_sidecar_listener_seen"
            assert sample(daemon, seen) == 0
            async with await SidecarClient.connect(config.socket_path) as c:
                assert (await c.ping()).ok
                assert (await c.get(QID)).ok  # a lookup is not a listener's progress
                assert sample(daemon, seen) == 0
                assert (await c.progress(kafka_progress(QID, 1))).applied
                assert sample(daemon, seen) == 1
                assert (await c.progress(kafka_progress(QID, 2))).applied
            _, text = await anyio.to_thread.run_sync(scrape, daemon)
            assert metric_value(text, seen) == 1
    first = [r for r in caplog.records if r.getMessage().startswith("first progress update")]
    assert len(first) == 1 and "batch=1" in first[0].getMessage()


async def test_the_last_updates_time_is_exported_for_a_listener_that_goes_quiet(
    make_config: ConfigFactory,
) -> None:
    # A ping or a lookup is no listener's progress: only progress updates move it.
    config = make_config()
    last = "checkpoint_sidecar_last_update_timestamp_seconds"
    async with running_daemon(config) as daemon:
        assert sample(daemon, last) == 0
        async with await SidecarClient.connect(config.socket_path) as c:
            before = time.time()
            assert (await c.progress(kafka_progress(QID, 1))).applied
            after = time.time()
            at = sample(daemon, last)
            assert before <= at <= after
            assert (await c.ping()).ok and (await c.get(QID)).ok
            assert sample(daemon, last) == at
        _, text = await anyio.to_thread.run_sync(scrape, daemon)
        assert metric_value(text, last) == at
