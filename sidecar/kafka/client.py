"""The Kafka client edge: aiokafka's consumer (options, SASL, TLS), its errors as ours.

Kafka is optional and must never stop the core, so aiokafka's errors are translated here,
once: unreachable, timed out or transient → :class:`KafkaUnavailable`; authentication,
ACLs, an invalid group or an unusable TLS setup → :class:`KafkaRefused`. The commit policy
(``sidecar.kafka.committer``) decides what to do with them. The TLS context reads files, so it is
built in a worker thread.
"""

from __future__ import annotations

import functools
import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from aiokafka import AIOKafkaConsumer
from aiokafka import errors as ke
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import ConsumerStoppedError, KafkaError
from aiokafka.helpers import create_ssl_context

from sidecar.config import Config
from sidecar.errors import KafkaRefused, KafkaUnavailable, SidecarError

log = logging.getLogger(__name__)

#: What an operator must fix before a retry can succeed. aiokafka's own ``retriable`` flag
#: cannot decide this: it leaves transient errors unflagged (a KafkaTimeoutError, a broker
#: not available, a rebalance), so everything not named here counts as transient.
# fmt: off
_REFUSED: tuple[type[KafkaError], ...] = (
    ke.AuthenticationFailedError, ke.AuthenticationMethodNotSupported, ke.IllegalSaslStateError,
    ke.SaslAuthenticationFailed, ke.UnsupportedSaslMechanismError,
    ke.TopicAuthorizationFailedError, ke.GroupAuthorizationFailedError,
    ke.ClusterAuthorizationFailedError, ke.InvalidGroupIdError, ke.InvalidTopicError,
    ke.OffsetMetadataTooLargeError, ke.KafkaConfigurationError, ke.IncompatibleBrokerVersion,
    ke.UnrecognizedBrokerVersion, ke.UnsupportedVersionError,
)
# fmt: on


def translate(exc: KafkaError, what: str, where: str) -> SidecarError:
    """aiokafka's error as ours: :class:`KafkaRefused` (not retriable) or
    :class:`KafkaUnavailable`."""
    name = type(exc).__name__
    if isinstance(exc, _REFUSED):
        return KafkaRefused(
            f"Kafka {where} refused {what} ({name}: {exc}): check the credentials, the ACLs "
            "on the group and topics, and SIDECAR_KAFKA_GROUP_TEMPLATE"
        )
    return KafkaUnavailable(f"Kafka {where}: {what} failed ({name}: {exc})")


@asynccontextmanager
async def call(what: str, timeout_s: float, where: str) -> AsyncIterator[None]:
    """Time-limit Kafka calls and translate their errors into ours."""
    try:
        with anyio.fail_after(timeout_s):
            yield
    except TimeoutError as exc:
        raise KafkaUnavailable(f"Kafka {where}: {what} timed out after {timeout_s}s") from exc
    except KafkaError as exc:
        raise translate(exc, what, where) from exc
    except (OSError, ConsumerStoppedError) as exc:
        raise KafkaUnavailable(f"Kafka {where} unreachable during {what}: {exc}") from exc


def options(config: Config, ssl_context: ssl.SSLContext | None) -> dict[str, Any]:
    """The consumer's connection options from the settings."""
    cfg = config
    out: dict[str, Any] = {
        "bootstrap_servers": cfg.kafka_bootstrap_servers,
        "client_id": f"checkpoint-sidecar-{cfg.namespace}",
        "request_timeout_ms": int(cfg.kafka_timeout_s * 1000),
        "security_protocol": cfg.kafka_security_protocol,
    }
    if cfg.kafka_security_protocol.startswith("SASL"):
        out.update(
            sasl_mechanism=cfg.kafka_sasl_mechanism,
            sasl_plain_username=cfg.kafka_sasl_username,
            sasl_plain_password=cfg.kafka_sasl_password,
        )
    if cfg.kafka_security_protocol.endswith("SSL"):
        out["ssl_context"] = ssl_context
    return out


async def open_consumer(group: str, client_options: dict[str, Any]) -> Any:
    """A started consumer of ``group`` that never joins it (manual assignment, no
    auto-commit); whatever a failed start opened is closed."""
    consumer = AIOKafkaConsumer(group_id=group, enable_auto_commit=False, **client_options)
    try:
        await consumer.start()
    except BaseException:
        with anyio.CancelScope(shield=True):  # also when the start itself was cancelled
            await stop_quietly(consumer)
        raise
    return consumer


async def stop_quietly(consumer: Any) -> None:
    """Stop a consumer within 2 s (or the caller's tighter deadline: callers that must not
    be cancelled shield themselves); closing a broken client never fails the caller."""
    with anyio.move_on_after(2):
        try:
            await consumer.stop()
        except Exception as exc:
            log.debug("kafka client did not stop cleanly: %r", exc)


async def ssl_context(config: Config) -> ssl.SSLContext:
    """The TLS context, built in a worker thread (it reads the CA, certificate and key files).

    Raises:
        KafkaRefused: a file is missing, unreadable or not valid PEM.
    """
    files = {"cafile": config.kafka_ssl_cafile}
    files.update(certfile=config.kafka_ssl_certfile, keyfile=config.kafka_ssl_keyfile)
    try:
        context: ssl.SSLContext = await anyio.to_thread.run_sync(
            functools.partial(create_ssl_context, **files)
        )
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise KafkaRefused(
            f"Kafka TLS context cannot be built from {[f for f in files.values() if f]}: "
            f"{exc}; check SIDECAR_KAFKA_SSL_CAFILE, _CERTFILE, _KEYFILE"
        ) from exc
    return context


#: ``authorized_operations`` when the broker did not report them (DescribeGroups < v3).
_NOT_REPORTED = -(2**31)
#: Bit of the READ operation (Kafka's AclOperation code 3), what OffsetCommit needs on a group.
_READ = 1 << 3


async def describe_groups(
    client_options: dict[str, Any], groups: list[str], timeout_s: float, where: str
) -> tuple[int, dict[str, tuple[str, bool | None]]]:
    """The brokers' count and, per group, (the error describing it, "NoError" when
    describable; whether READ — what a commit needs — is authorized, None when the broker
    does not say). Read-only: nothing is joined or committed.

    Raises:
        KafkaUnavailable, KafkaRefused: the cluster cannot be reached or described.
    """
    admin = AIOKafkaAdminClient(**client_options)
    found: dict[str, tuple[str, bool | None]] = {}
    try:
        async with call("describe the cluster", timeout_s, where):
            await admin.start()
            brokers = len((await admin.describe_cluster())["brokers"])
        for group in groups:
            try:
                with anyio.fail_after(timeout_s):
                    replies = await admin.describe_consumer_groups(
                        [group], include_authorized_operations=True
                    )
            except (KafkaError, TimeoutError) as exc:
                found[group] = (type(exc).__name__, None)
                continue
            for reply in replies:
                for g in reply.to_object()["groups"]:
                    ops = g.get("authorized_operations", _NOT_REPORTED)
                    read = None if ops in (_NOT_REPORTED, None) else bool(ops & _READ)
                    found[g["group"]] = (ke.for_code(g["error_code"]).__name__, read)
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(2):
            try:
                await admin.close()
            except Exception as exc:
                log.debug("kafka admin client did not close cleanly: %r", exc)
    return brokers, found
