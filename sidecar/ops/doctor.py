"""``checkpoint-sidecar doctor``: gather what Redis, the storage account and Kafka report,
through their edges (``sidecar.buffer.redis_buffer``, ``sidecar.store.blobs``,
``sidecar.kafka.client``), and judge it with the rules of ``sidecar.ops.diagnosis``.

Side effects, all small and undone: the Redis write probe is the readiness key (60 s TTL);
the storage probe creates, leases, writes, reads and deletes
``<namespace>/doctor-probe-<uuid>.tmp`` (not a ``.json``: never taken for a checkpoint).
Nothing is committed to Kafka: READ on the groups is read from DescribeGroups' authorized
operations where the broker reports them (v3, Kafka 2.3+), else reported as not checked.

The daemon runs the same checks once at start, in the background (logged, exported as
``checkpoint_sidecar_config_check``), and starts whatever they say.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from sidecar.buffer.redis_buffer import RedisBuffer
from sidecar.buffer.topology import Topology
from sidecar.config import Config
from sidecar.errors import SidecarError
from sidecar.ops.diagnosis import Check, kafka_checks, redis_checks, storage_checks
from sidecar.store.blobs import BlobStore

log = logging.getLogger(__name__)

#: At most this many consumer groups are described (one request each).
MAX_GROUPS = 50
_LEVELS = {"ok": logging.INFO, "warn": logging.WARNING, "fail": logging.ERROR}
#: The Kafka client options to use (the daemon's, with its TLS context), None when unusable.
KafkaOptions = Callable[[], dict[str, Any] | None]


async def run_checks(
    config: Config,
    buffer: RedisBuffer | None = None,
    store: BlobStore | None = None,
    kafka_options: KafkaOptions | None = None,
) -> list[Check]:
    """Every check, in order Redis, storage, Kafka (when configured). ``buffer``, ``store``
    and ``kafka_options``: the daemon's own clients and Kafka client options (its TLS context
    is built once; None from it: that failed, as logged), else made here. Never raises for
    what a service answers: that is a check's result."""
    own_buffer = buffer is None
    if buffer is None:
        buffer = RedisBuffer(
            config.redis_url,
            config.namespace,
            timeout_s=config.redis_timeout_s,
            topology=Topology.of(config),
        )
    try:
        checks = await _redis(config, buffer)
        checks += await _storage(config, store)
        if config.kafka_bootstrap_servers:
            checks += await _kafka(config, buffer, kafka_options)
    finally:
        if own_buffer:
            await buffer.aclose()
    return checks


async def _redis(config: Config, buffer: RedisBuffer) -> list[Check]:
    try:
        info: dict[str, Any] | str = await buffer.info()
    except SidecarError as exc:
        info = str(exc)
    write_error = None
    if not isinstance(info, str):
        try:
            await buffer.ping()
        except SidecarError as exc:
            write_error = str(exc)
    return redis_checks(buffer.url, info, write_error, require_aof=config.redis_require_aof)


async def _storage(config: Config, store: BlobStore | None) -> list[Check]:
    own = store is None
    try:
        if store is None:
            store = BlobStore(config)
    except SidecarError as exc:  # no blob store configured
        return [Check("storage_container", "fail", str(exc), "configure the blob store")]
    try:
        try:
            container: bool | str = await store.container_listable()
        except SidecarError as exc:
            container = str(exc)
        probe = await store.probe(str(uuid.uuid4())) if container is True else None
        try:
            soft_delete: int | str | None = await store.soft_delete_days()
        except SidecarError as exc:
            soft_delete = str(exc)
        return storage_checks(store.where, container, probe, soft_delete)
    finally:
        if own:
            await store.aclose()


async def _kafka(
    config: Config, buffer: RedisBuffer, kafka_options: KafkaOptions | None
) -> list[Check]:
    where = str(config.kafka_bootstrap_servers)
    try:
        names = await buffer.known_names()
    except SidecarError:
        names = {}  # Redis' own check says why
    groups = sorted(
        {
            config.kafka_group_template.format(
                query_name=name, query_id=query_id, namespace=config.namespace
            )
            for name, query_id in names.items()
        }
    )[:MAX_GROUPS]
    from sidecar.kafka import client  # aiokafka: imported only where Kafka is configured

    try:
        if kafka_options is None:
            context = await client.ssl_context(config) if _tls(config) else None
            options: dict[str, Any] | None = client.options(config, context)
        else:
            options = kafka_options()
        described: Any = (
            "the TLS context could not be built at start (the ERROR logged then says why)"
            if options is None
            else await client.describe_groups(options, groups, config.kafka_timeout_s, where)
        )
    except SidecarError as exc:
        described = str(exc)
    return kafka_checks(where, described)


def _tls(config: Config) -> bool:
    return str(config.kafka_security_protocol).endswith("SSL")


def log_results(checks: list[Check]) -> None:
    """Each check as a log line: INFO ok, WARNING warn, ERROR fail."""
    for c in checks:
        log.log(
            _LEVELS[c.status],
            "config check %s: %s: %s%s",
            c.name,
            c.status,
            c.detail,
            f" -> {c.what_to_do}" if c.what_to_do else "",
        )
