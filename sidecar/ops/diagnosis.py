"""What makes a setup unable to keep checkpoints: the rules of ``checkpoint-sidecar doctor``.

Pure: each rule turns what a service reported (Redis' ``INFO`` and a write probe, the storage
probe and the account's properties, the Kafka groups' descriptions) into :class:`Check`
results: ``ok`` / ``warn`` / ``fail``, what was seen, what to do. ``sidecar.ops.doctor`` gathers
the facts. A check whose prerequisite failed (Redis unreachable, container missing, brokers
unreachable) is not listed: the failing one says what was not checked.

Decisions: ``appendonly no`` is a warning (acks are "in Redis memory", as documented), a
failure only with ``SIDECAR_REDIS_REQUIRE_AOF=true`` (the daemon refuses to start then); any
``maxmemory-policy`` but ``noeviction`` is a failure (eviction drops buffered checkpoints
silently); a missing container is a failure (no probe can run). Everything is read from
``INFO``, which managed services answer where they refuse ``CONFIG``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from sidecar.buffer import refusals
from sidecar.store.probe import Probe

Status = Literal["ok", "warn", "fail"]
#: Exit code of ``doctor`` by the worst status.
EXIT_CODES: dict[str, int] = {"ok": 0, "warn": 1, "fail": 2}

#: ``used_memory / maxmemory`` at which the headroom check warns, and fails (with
#: ``noeviction`` a full Redis refuses writes: every update answers ``unavailable``).
MEMORY_WARN, MEMORY_FAIL = 0.80, 0.95
#: The oldest Redis the suite runs against; older ones are a warning, not a refusal.
TESTED_REDIS = (7, 0)

_PRIMARY = (
    "point SIDECAR_REDIS_URL at the primary, or set SIDECAR_REDIS_MODE=sentinel to follow failovers"
)
_GRANT = (
    "grant create, write, read, delete and list on the container (a SAS: sp=racwdl; Azure "
    "RBAC: Storage Blob Data Contributor)"
)


class Check(msgspec.Struct, frozen=True):
    """One check's result: ``what_to_do`` is empty when there is nothing to do."""

    name: str
    status: Status
    detail: str
    what_to_do: str = ""


def worst(checks: list[Check]) -> Status:
    """The worst status of ``checks`` (``ok`` for none)."""
    statuses: tuple[Status, ...] = ("fail", "warn")
    for status in statuses:
        if any(c.status == status for c in checks):
            return status
    return "ok"


def exit_code(checks: list[Check]) -> int:
    """0 all ok, 1 a warning, 2 a failure."""
    return EXIT_CODES[worst(checks)]


# --- the rules (pure) --------------------------------------------------------------------------


def redis_checks(
    url: str, info: Mapping[str, Any] | str, write_error: str | None, *, require_aof: bool
) -> list[Check]:
    """Redis' checks from its ``INFO`` (or the error that prevented it) and the write probe."""
    if isinstance(info, str):
        return [
            Check(
                "redis_reachable",
                "fail",
                f"{info} (no other Redis check ran)",
                refusals.fix(info)
                or "check SIDECAR_REDIS_URL (and SIDECAR_REDIS_MODE) and that Redis runs; the "
                "daemon waits for it at start",
            )
        ]
    role = str(info.get("role", "?"))
    version = str(info.get("redis_version", "?"))
    out = [Check("redis_reachable", "ok", f"Redis {version} at {url} answered (role {role})")]
    if write_error is None:
        out.append(Check("redis_writable", "ok", "a write to the namespace's node succeeded"))
    else:
        replica = (
            f"it is a replica of {info.get('master_host')}:{info.get('master_port')}; "
            if role == "slave"
            else ""
        )
        out.append(
            Check(
                "redis_writable",
                "fail",
                f"{replica}{write_error}",
                refusals.fix(write_error) or _PRIMARY,
            )
        )
    aof = info.get("aof_enabled")
    if aof is None:
        out.append(
            Check(
                "redis_appendonly",
                "warn",
                "INFO reports no aof_enabled: whether acks survive a Redis restart is unknown",
                "check the persistence settings with your Redis provider",
            )
        )
    elif int(aof):
        out.append(Check("redis_appendonly", "ok", "appendonly yes: acks survive a restart"))
    else:
        out.append(
            Check(
                "redis_appendonly",
                "fail" if require_aof else "warn",
                "appendonly no: an ack is only in Redis memory; a Redis restart loses every "
                "update acknowledged since the last snapshot"
                + (" (SIDECAR_REDIS_REQUIRE_AOF=true: the daemon refuses to start)" * require_aof),
                "CONFIG SET appendonly yes (and appendonly yes in redis.conf); "
                "SIDECAR_REDIS_REQUIRE_AOF=true makes the daemon refuse to start without it",
            )
        )
    out.append(_policy_check(str(info.get("maxmemory_policy", "?"))))
    out.append(_memory_check(int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))))
    out.append(_version_check(version))
    return out


def _policy_check(policy: str) -> Check:
    if policy == "noeviction":
        return Check(
            "redis_maxmemory_policy", "ok", "maxmemory-policy noeviction: nothing is evicted"
        )
    return Check(
        "redis_maxmemory_policy",
        "fail",
        f"maxmemory-policy is {policy}: at maxmemory Redis silently evicts keys, buffered "
        "checkpoints included (acknowledged, maybe not yet in the blob)",
        "CONFIG SET maxmemory-policy noeviction (and in redis.conf): a full Redis then refuses "
        "writes, which clients see as `unavailable` and retry",
    )


def _memory_check(used: int, limit: int) -> Check:
    mib = f"{used / 2**20:.1f} MiB used"
    if limit <= 0:
        return Check("redis_maxmemory", "ok", f"no maxmemory limit ({mib})")
    share = used / limit
    detail = f"{mib} of maxmemory {limit / 2**20:.1f} MiB ({share:.0%})"
    if share < MEMORY_WARN:
        return Check("redis_maxmemory", "ok", detail)
    return Check(
        "redis_maxmemory",
        "fail" if share >= MEMORY_FAIL else "warn",
        f"{detail}: at the limit every update is refused (`unavailable`)",
        "raise maxmemory or free memory (other data sharing this Redis)",
    )


def _version_check(version: str) -> Check:
    try:
        major_minor = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        major_minor = ()
    if major_minor >= TESTED_REDIS:
        return Check("redis_version", "ok", f"Redis {version}")
    return Check(
        "redis_version",
        "warn",
        f"Redis {version} is older than the versions tested (7.0 and newer)",
        "upgrade Redis to 7.0 or newer",
    )


def storage_checks(
    where: str,
    container: bool | str,
    probe: Probe | None,
    soft_delete: int | str | None,
) -> list[Check]:
    """The storage checks: ``container`` True (exists), False (missing) or the error;
    ``probe`` None when it could not run; ``soft_delete`` the retention in days, None when
    off, or the error that kept the service properties from being read."""
    if container is not True:
        detail = (
            f"container {where} does not exist"
            if container is False
            else f"container {where} cannot be listed: {container}"
        )
        return [
            Check(
                "storage_container",
                "fail",
                f"{detail} (no probe blob was written)",
                "create it (az storage container create), or let the daemon create it at "
                "start with a credential that may (an account key or account SAS; a "
                "container SAS may not)"
                if container is False
                else f"check AZURE_STORAGE_CONNECTION_STRING / SIDECAR_ACCOUNT_URL; {_GRANT}",
            )
        ]
    out = [Check("storage_container", "ok", f"container {where} exists and can be listed")]
    if probe is not None:
        out += _probe_checks(probe)
    out.append(_features_check(soft_delete, probe.version_id if probe else None))
    return out


def _probe_checks(probe: Probe) -> list[Check]:
    refused = {step: err for step, err in probe.steps.items() if err is not None}
    blob_steps = [s for s in ("create", "write", "read", "delete") if s in refused]
    left = " (the probe blob is left behind: delete it)" if "delete" in refused else ""
    if blob_steps:
        step = blob_steps[0]
        probe_check = Check(
            "storage_probe",
            "fail",
            f"{step} of probe blob {probe.blob_name} refused: {refused[step]}{left}",
            _GRANT,
        )
    else:
        probe_check = Check(
            "storage_probe",
            "ok",
            f"created, wrote, read and deleted {probe.blob_name}"
            if "delete" in probe.steps
            else f"{probe.blob_name}: not all steps ran",
        )
    out = [probe_check]
    lease_steps = [s for s in ("lease", "release") if s in probe.steps]
    if lease_steps:
        errors = [f"{s}: {refused[s]}" for s in lease_steps if s in refused]
        out.append(
            Check(
                "storage_lease",
                "fail",
                f"lease refused on the probe blob ({'; '.join(errors)}): every checkpoint "
                "is written under its blob's lease",
                f"a lease needs write permission; {_GRANT}",
            )
            if errors
            else Check("storage_lease", "ok", "acquired and released a lease on the probe blob")
        )
    return out


def _features_check(soft_delete: int | str | None, version_id: str | None) -> Check:
    versioning = (
        "versioning on (the write got a version id)"
        if version_id
        else "no version id on the probe write (versioning off, or a store without it: "
        "Azurite never versions blobs, and stores the soft-delete setting without enforcing it)"
    )
    if isinstance(soft_delete, str):
        return Check(
            "storage_features",
            "warn",
            f"the account's blob service properties cannot be read ({soft_delete}); {versioning}",
            "check blob soft delete and versioning on the account (az storage account "
            "blob-service-properties show); the credential need not change",
        )
    if soft_delete is not None or version_id:
        kept = f"soft delete on ({soft_delete} days)" if soft_delete else "soft delete off"
        return Check("storage_features", "ok", f"blob {kept}; {versioning}")
    return Check(
        "storage_features",
        "warn",
        f"blob soft delete is off; {versioning}: a deleted or overwritten checkpoint blob "
        "cannot be restored",
        "enable blob soft delete (and versioning) on the storage account",
    )


def kafka_checks(
    bootstrap: str,
    described: tuple[int, dict[str, tuple[str, bool | None]]] | str,
) -> list[Check]:
    """The Kafka checks from the brokers' count and each group's (error, READ authorized),
    or the error that kept the cluster from being described."""
    if isinstance(described, str):
        return [
            Check(
                "kafka_brokers",
                "fail",
                f"{described} (groups not checked)",
                "check SIDECAR_KAFKA_BOOTSTRAP_SERVERS, the security settings and the network; "
                "acks and flushes go on without Kafka, commits catch up later",
            )
        ]
    brokers, groups = described
    out = [Check("kafka_brokers", "ok", f"{brokers} broker(s) reachable via {bootstrap}")]
    if not groups:
        out.append(
            Check(
                "kafka_groups",
                "ok",
                "no named query known to Redis yet: no consumer group to describe",
            )
        )
        return out
    bad = {g: err for g, (err, _) in groups.items() if err != "NoError"}
    denied = [g for g, err in bad.items() if "Authorization" in err]
    out.append(
        Check(
            "kafka_groups",
            "fail" if denied else "warn" if bad else "ok",
            f"not describable: {', '.join(f'{g} ({e})' for g, e in sorted(bad.items()))}"
            if bad
            else f"{len(groups)} group(s) describable: {', '.join(sorted(groups))}",
            "grant DESCRIBE and READ on the groups (or fix SIDECAR_KAFKA_GROUP_TEMPLATE)"
            if bad
            else "",
        )
    )
    reads = {g: read for g, (err, read) in groups.items() if err == "NoError"}
    unread = sorted(g for g, read in reads.items() if read is False)
    if unread:
        out.append(
            Check(
                "kafka_commit_acl",
                "fail",
                f"READ not authorized on group(s) {', '.join(unread)}: commits will be refused",
                "grant READ on the groups (kafka-acls --add --operation Read --group …)",
            )
        )
    elif reads and all(read is True for read in reads.values()):
        out.append(
            Check(
                "kafka_commit_acl",
                "ok",
                "READ authorized on every group (READ on the topics is not checked)",
            )
        )
    elif reads:
        out.append(
            Check(
                "kafka_commit_acl",
                "warn",
                "not checked: the broker does not report authorized operations (DescribeGroups "
                "v3, Kafka 2.3+), and doctor does not commit to find out; READ on the topics "
                "is never checked",
                "check the ACLs (kafka-acls --list --group …); a refused commit shows as an "
                'ERROR and in checkpoint_sidecar_kafka_commits_total{result="error"}',
            )
        )
    return out


# --- output ------------------------------------------------------------------------------------


def render(checks: list[Check]) -> str:
    """One line per check: status, name, what was seen and, when any, what to do."""
    width = max((len(c.name) for c in checks), default=0)
    return "\n".join(
        f"{c.status:<4}  {c.name:<{width}}  {c.detail}"
        + (f" -> {c.what_to_do}" if c.what_to_do else "")
        for c in checks
    )


def to_json(checks: list[Check]) -> bytes:
    """``{"status": worst, "exit_code": n, "checks": [{name, status, detail, what_to_do}]}``."""
    return msgspec.json.encode(
        {"status": worst(checks), "exit_code": exit_code(checks), "checks": checks}
    )
