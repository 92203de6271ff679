"""``checkpoint-sidecar doctor`` against real misconfigured services, and the same checks at
daemon start (logged, exported as ``checkpoint_sidecar_config_check``)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import anyio
import pytest
from azure.storage.blob import (
    BlobServiceClient,
    ContainerSasPermissions,
    RetentionPolicy,
    generate_container_sas,
)

from sidecar.config import Config
from sidecar.ops.diagnosis import Check, kafka_checks, redis_checks
from tests.helpers import eventually, running_daemon, sample, seed
from tests.services import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    REPO_ROOT,
    Azurite,
    KafkaBroker,
    RedisServer,
    free_port,
)


@pytest.fixture
def container(azurite: Azurite) -> Iterator[str]:
    """A fresh container of this test's own (created with the account key), deleted after."""
    name = f"doc{uuid.uuid4().hex[:12]}"
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    service.create_container(name)
    yield name
    service.delete_container(name)


@pytest.fixture
def env(
    redis_server: RedisServer, azurite: Azurite, namespace: str, container: str
) -> dict[str, str]:
    # Blob soft delete on: Azurite stores the setting (without enforcing it), so "all good"
    # is reachable; the other tests only look at their own checks.
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    service.set_service_properties(delete_retention_policy=RetentionPolicy(enabled=True, days=7))
    return {
        "SIDECAR_REDIS_URL": redis_server.url,
        "SIDECAR_NAMESPACE": namespace,
        "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
        "SIDECAR_CONTAINER": container,
    }


def doctor(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "doctor", *args],
        env={"PATH": "/usr/bin:/bin", **env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def lines(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """Each output line by its check's name, without the name and the padding:
    ``{name: "<status> <detail> -> <what to do>"}``."""
    out = {}
    for line in result.stdout.splitlines():
        status, name, rest = line.split(None, 2)
        out[name] = f"{status} {rest}"
    return out


def blob_names(azurite: Azurite, container: str) -> list[str]:
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    return [b.name for b in service.get_container_client(container).list_blobs()]


def test_all_good_exits_0_and_leaves_no_probe_blob(
    env: dict[str, str], azurite: Azurite, container: str
) -> None:
    result = doctor(env)
    assert result.returncode == 0, result.stdout + result.stderr
    checks = lines(result)
    assert set(checks) == {
        "redis_reachable",
        "redis_writable",
        "redis_appendonly",
        "redis_maxmemory_policy",
        "redis_maxmemory",
        "redis_version",
        "storage_container",
        "storage_probe",
        "storage_lease",
        "storage_features",
    }
    assert all(line.startswith("ok ") for line in checks.values()), result.stdout
    assert "created, wrote, read and deleted" in checks["storage_probe"]
    assert "soft delete on (7 days)" in checks["storage_features"]
    assert blob_names(azurite, container) == []


def test_json_shape(env: dict[str, str]) -> None:
    result = doctor(env, "--json")
    report = json.loads(result.stdout)
    assert set(report) == {"status", "exit_code", "checks"}
    assert (report["status"], report["exit_code"], result.returncode) == ("ok", 0, 0)
    assert [set(c) for c in report["checks"]] == [{"name", "status", "detail", "what_to_do"}] * len(
        report["checks"]
    )
    assert [c["name"] for c in report["checks"]] == list(lines(doctor(env)))


def test_appendonly_no_warns_and_fails_when_aof_is_required(env: dict[str, str]) -> None:
    with RedisServer(appendonly=False) as redis:
        env = {**env, "SIDECAR_REDIS_URL": redis.url}
        result = doctor(env)
        assert result.returncode == 1, result.stdout
        assert lines(result)["redis_appendonly"].startswith("warn appendonly no")
        assert [n for n, line in lines(result).items() if not line.startswith("ok")] == [
            "redis_appendonly"
        ]
        strict = doctor({**env, "SIDECAR_REDIS_REQUIRE_AOF": "true"})
        assert strict.returncode == 2
        assert "the daemon refuses to start" in lines(strict)["redis_appendonly"]


def test_an_eviction_policy_fails(env: dict[str, str]) -> None:
    args = ["--maxmemory-policy", "allkeys-lru", "--maxmemory", "64mb"]
    with RedisServer(extra_args=args) as redis:
        result = doctor({**env, "SIDECAR_REDIS_URL": redis.url})
    assert result.returncode == 2
    line = lines(result)["redis_maxmemory_policy"]
    assert line.startswith("fail maxmemory-policy is allkeys-lru")
    assert "-> CONFIG SET maxmemory-policy noeviction" in line
    assert lines(result)["redis_maxmemory"].startswith("ok ")  # 64 MiB: plenty of headroom


def test_a_replica_is_not_writable(env: dict[str, str]) -> None:
    with RedisServer() as primary:
        replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)])
        with replica:
            result = doctor({**env, "SIDECAR_REDIS_URL": replica.url})
    assert result.returncode == 2
    line = lines(result)["redis_writable"]
    assert line.startswith(f"fail it is a replica of 127.0.0.1:{primary.port}")
    assert "-> point SIDECAR_REDIS_URL at the primary" in line
    assert "(role slave)" in lines(result)["redis_reachable"]


def sas_env(
    env: dict[str, str], azurite: Azurite, container: str, permission: str
) -> dict[str, str]:
    sas = generate_container_sas(
        AZURITE_ACCOUNT,
        container,
        account_key=AZURITE_KEY,
        permission=ContainerSasPermissions.from_string(permission),
        expiry=datetime.now(UTC) + timedelta(hours=1),
    )
    conn = f"BlobEndpoint={azurite.blob_endpoint};SharedAccessSignature={sas}"
    return {**env, "AZURE_STORAGE_CONNECTION_STRING": conn}


def test_a_read_only_sas_fails_the_probe(
    env: dict[str, str], azurite: Azurite, container: str
) -> None:
    result = doctor(sas_env(env, azurite, container, "rl"))
    assert result.returncode == 2
    checks = lines(result)
    assert checks["storage_container"].startswith("ok ")  # r and l: it can be listed
    assert checks["storage_probe"].startswith("fail create of probe blob")
    assert "403 AuthorizationPermissionMismatch" in checks["storage_probe"]
    assert "storage_lease" not in checks  # nothing to lease
    # A container SAS may not read the account's properties: said, not guessed.
    assert checks["storage_features"].startswith("warn the account's blob")
    assert blob_names(azurite, container) == []


def test_a_sas_without_delete_fails_and_names_the_blob_left_behind(
    env: dict[str, str], azurite: Azurite, container: str
) -> None:
    result = doctor(sas_env(env, azurite, container, "racwl"))
    assert result.returncode == 2
    checks = lines(result)
    assert checks["storage_lease"].startswith("ok ")
    line = checks["storage_probe"]
    assert line.startswith("fail delete of probe blob")
    (left,) = blob_names(azurite, container)
    assert left.startswith(f"{env['SIDECAR_NAMESPACE']}/doctor-probe-") and left in line
    assert "the probe blob is left behind: delete it" in line


def test_a_missing_container_fails_and_is_not_created(
    env: dict[str, str], azurite: Azurite
) -> None:
    missing = f"gone{uuid.uuid4().hex[:12]}"
    result = doctor({**env, "SIDECAR_CONTAINER": missing})
    assert result.returncode == 2
    checks = lines(result)
    assert checks["storage_container"].startswith("fail container ")
    assert f"{missing} does not exist" in checks["storage_container"]
    assert not {"storage_probe", "storage_lease"} & set(checks)
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    assert not service.get_container_client(missing).exists()


def test_kafka_brokers_and_groups(env: dict[str, str]) -> None:
    with KafkaBroker() as broker:
        kafka_env = {**env, "SIDECAR_KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap}
        anyio.run(seed, env["SIDECAR_REDIS_URL"], env["SIDECAR_NAMESPACE"], "q-1", 3, "orders")
        result = doctor(kafka_env)
    checks = lines(result)
    assert checks["kafka_brokers"].startswith("ok 1 broker(s) reachable")
    assert checks["kafka_groups"].startswith("ok ")
    assert checks["kafka_groups"].endswith("1 group(s) describable: spark-orders")
    # Tansu answers DescribeGroups v2: no authorized operations, so READ is not checked.
    assert checks["kafka_commit_acl"].startswith("warn not checked")
    assert result.returncode == 1

    down = doctor({**env, "SIDECAR_KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}"})
    assert down.returncode == 2
    assert lines(down)["kafka_brokers"].startswith("fail Kafka")
    assert "kafka_groups" not in lines(down)


async def test_the_daemon_starts_logs_and_exports_failing_checks(
    make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture
) -> None:
    with RedisServer(extra_args=["--maxmemory-policy", "volatile-lru"]) as redis:
        config = make_config(redis_url=redis.url)
        with caplog.at_level(logging.INFO, logger="sidecar"):
            async with running_daemon(config) as daemon:  # started: nothing refused it
                name = "checkpoint_sidecar_config_check"
                await eventually(lambda: sample(daemon, name, check="redis_version") == 1)
                assert sample(daemon, name, check="redis_maxmemory_policy") == 0
                assert sample(daemon, name, check="redis_reachable") == 1
                assert sample(daemon, name, check="storage_probe") == 1
    failed = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage().split(": ")[0] for r in failed] == [
        "config check redis_maxmemory_policy"
    ]
    assert "maxmemory-policy is volatile-lru" in failed[0].getMessage()


# --- the rules alone (pure) ---------------------------------------------------------------------


def status_of(checks: list[Check], name: str) -> str:
    return next(c.status for c in checks if c.name == name)


@pytest.mark.parametrize(
    ("used", "limit", "status"),
    [(10, 0, "ok"), (79, 100, "ok"), (80, 100, "warn"), (94, 100, "warn"), (95, 100, "fail")],
)
def test_memory_headroom(used: int, limit: int, status: str) -> None:
    info = {"role": "master", "aof_enabled": 1, "maxmemory_policy": "noeviction"}
    checks = redis_checks(
        "redis://r", {**info, "used_memory": used, "maxmemory": limit}, None, require_aof=False
    )
    assert status_of(checks, "redis_maxmemory") == status


@pytest.mark.parametrize(
    ("groups", "groups_status", "acl_status"),
    [
        ({"g": ("NoError", True)}, "ok", "ok"),
        ({"g": ("NoError", False)}, "ok", "fail"),
        ({"g": ("NoError", None)}, "ok", "warn"),
        ({"g": ("GroupAuthorizationFailedError", None)}, "fail", None),
        ({"g": ("CoordinatorNotAvailableError", None)}, "warn", None),
    ],
)
def test_kafka_group_rules(
    groups: dict[str, tuple[str, bool | None]], groups_status: str, acl_status: str | None
) -> None:
    checks = kafka_checks("k:9092", (3, groups))
    assert status_of(checks, "kafka_groups") == groups_status
    acl = [c.status for c in checks if c.name == "kafka_commit_acl"]
    assert acl == ([acl_status] if acl_status else [])
