"""Configuration: one typed, validated object built once at the edge.

Every setting has an environment variable (the daemon runs in containers) and an equivalent
``checkpoint-sidecar run`` flag; a flag wins over the environment. Values are validated when
the :class:`Config` is built, so a bad value stops the daemon at start with a message that
names the variable and what it accepts. Unknown ``SIDECAR_*`` variables are refused (a typo
must not silently fall back to a default), except the ``SIDECAR_SERVICE_*``/``SIDECAR_PORT*``
variables Kubernetes injects for a Service named ``sidecar``. Secrets are redacted in ``repr``.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from sidecar.errors import ConfigError

ENV_PREFIX = "SIDECAR_"
# Variables Kubernetes adds for a Service named "sidecar" (docker-link style service env).
_K8S_SERVICE_ENV = re.compile(r"^SIDECAR_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\w+)?)$")
# A namespace goes inside a Redis hash tag and a blob prefix: keep it to a safe alphabet.
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _setting(env: str, help: str, parse: Callable[[str], Any], default: Any, **kw: Any) -> Any:
    """A Config field with its env var, help, parser; ``redact=`` marks a secret."""
    return field(default=default, metadata={"env": env, "help": help, "parse": parse, **kw})


def _int(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if not lo <= value <= hi:
            raise ValueError(f"must be between {lo} and {hi}")
        return value

    return parse


def _float(lo: float, hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if not lo <= value <= hi:
            raise ValueError(f"must be between {lo} and {hi}")
        return value

    return parse


def _optional_port(text: str) -> int | None:
    return None if text.strip() in ("", "0", "off", "none") else _int(1, 65535)(text)


def _mode(text: str) -> int:
    value = int(text, 8)
    if value & ~0o777:
        raise ValueError("must be a permission mode in octal, e.g. 600 or 660")
    return value


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR")
    return level


def _namespace(text: str) -> str:
    if not _NAMESPACE.match(text):
        raise ValueError("must be 1-64 characters of A-Z a-z 0-9 . _ - (starting alphanumeric)")
    return text


def _redis_url(text: str) -> str:
    if urlsplit(text).scheme not in ("redis", "rediss", "unix"):
        raise ValueError("must be a redis://, rediss:// or unix:// URL")
    return text


def _loopback(text: str) -> str:
    try:
        loopback = ipaddress.ip_address(text).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError("must be a loopback IP address (127.0.0.0/8 or ::1)")
    return text


_SECRET_PART = re.compile(r"(?i)((?:^|;)\s*(?:AccountKey|SharedAccessSignature)=)[^;]*")


def redact_connection_string(text: str) -> str:
    """Return an Azure Storage connection string with its key or SAS as ``***``."""
    return _SECRET_PART.sub(r"\1***", text)


_SECRET_QUERY = re.compile(r"(?i)((?:^|&)(?:password|pass|pwd)=)[^&]*")


def _connection_string(text: str) -> str:
    parts = dict(p.split("=", 1) for p in text.strip(";").split(";") if "=" in p)
    if not ({"AccountName", "BlobEndpoint"} & parts.keys()):
        raise ValueError("must be an Azure Storage connection string (AccountName=...;...)")
    return text


def _https_url(text: str) -> str:
    if urlsplit(text).scheme not in ("https", "http") or not urlsplit(text).netloc:
        raise ValueError("must be a URL such as https://<account>.blob.core.windows.net")
    return text


_CONTAINER = re.compile(r"^(?!.*--)[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")


def _container(text: str) -> str:
    if not _CONTAINER.match(text):
        raise ValueError("must be an Azure container name: 3-63 of a-z 0-9 -, no '--'")
    return text


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().upper()
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return value

    return parse


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be true or false")


_HOST_PORT = re.compile(r"^[A-Za-z0-9._\[\]:-]+:\d{1,5}$")


def _bootstrap(text: str) -> str | None:
    servers = [s.strip() for s in text.split(",") if s.strip()]
    if not servers:
        return None
    bad = [s for s in servers if not _HOST_PORT.match(s)]
    if bad:
        raise ValueError(f"must be host:port[,host:port...]; not {', '.join(bad)}")
    return ",".join(servers)


def _group_template(text: str) -> str:
    try:
        text.format(query_name="q", query_id="i", namespace="n")
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"unknown placeholder {exc}; use {{query_name}}, {{query_id}}, {{namespace}}"
        ) from None
    return text


def _ack_mode(text: str) -> str:
    if text not in ("redis", "blob"):
        raise ValueError("must be 'redis' or 'blob'")
    return text


def redact_url(url: str) -> str:
    """Return ``url`` with any password (userinfo or ``?password=``) as ``***``, for logs."""
    parts = urlsplit(url)
    if parts.password is not None:
        netloc = parts.netloc.rsplit("@", 1)[1]
        user = f"{parts.username}:" if parts.username else ":"
        parts = parts._replace(netloc=f"{user}***@{netloc}")
    if parts.query:
        parts = parts._replace(query=_SECRET_QUERY.sub(r"\1***", parts.query))
    return urlunsplit(parts)


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """All daemon settings. Build with :meth:`from_env`; fields are validated values."""

    socket_path: str = _setting(
        "SIDECAR_SOCKET_PATH",
        "Unix socket the Spark listener connects to",
        str,
        "/tmp/checkpoint-sidecar.sock",
    )
    socket_mode: int = _setting(
        "SIDECAR_SOCKET_MODE",
        "permission bits of the socket file, octal (660 to share with a group)",
        _mode,
        0o600,
    )
    tcp_port: int | None = _setting(
        "SIDECAR_TCP_PORT",
        "also listen on this TCP port on a loopback address (0/unset: off)",
        _optional_port,
        None,
    )
    tcp_host: str = _setting(
        "SIDECAR_TCP_HOST", "loopback address for the optional TCP listener", _loopback, "127.0.0.1"
    )
    redis_url: str = _setting(
        "SIDECAR_REDIS_URL",
        "Redis holding the offset buffer (password is never logged)",
        _redis_url,
        "redis://127.0.0.1:6379/0",
        redact=redact_url,
    )
    namespace: str = _setting(
        "SIDECAR_NAMESPACE",
        "isolates one Spark application's keys and blobs",
        _namespace,
        "default",
    )
    metrics_host: str = _setting(
        "SIDECAR_METRICS_HOST", "address for /metrics, /healthz, /readyz", str, "0.0.0.0"
    )
    metrics_port: int = _setting(
        "SIDECAR_METRICS_PORT",
        "port for /metrics, /healthz, /readyz (0: pick a free one)",
        _int(0, 65535),
        9400,
    )
    max_frame_bytes: int = _setting(
        "SIDECAR_MAX_FRAME_BYTES",
        "largest accepted request line, in bytes",
        _int(1024, 64 * 1024 * 1024),
        1024 * 1024,
    )
    redis_timeout_s: float = _setting(
        "SIDECAR_REDIS_TIMEOUT_S", "timeout of one Redis call, seconds", _float(0.05, 60), 2.0
    )
    shutdown_grace_s: float = _setting(
        "SIDECAR_SHUTDOWN_GRACE_S",
        "time allowed for a graceful stop, seconds",
        _float(0.1, 3600),
        20.0,
    )
    log_level: str = _setting(
        "SIDECAR_LOG_LEVEL", "DEBUG, INFO, WARNING or ERROR", _log_level, "INFO"
    )
    # --- blob store ------------------------------------------------------------------------
    azure_connection_string: str | None = _setting(
        "AZURE_STORAGE_CONNECTION_STRING",
        "Azure Storage connection string (key or SAS is never logged)",
        _connection_string,
        None,
        redact=redact_connection_string,
    )
    account_url: str | None = _setting(
        "SIDECAR_ACCOUNT_URL",
        "blob account URL, authenticated with DefaultAzureCredential (managed/workload "
        "identity); used when no connection string is set",
        _https_url,
        None,
    )
    container: str = _setting(
        "SIDECAR_CONTAINER",
        "blob container for checkpoints (created if missing)",
        _container,
        "spark-checkpoints",
    )
    lease_duration_s: int = _setting(
        "SIDECAR_LEASE_DURATION_S",
        "blob lease duration, seconds (15-60); renewed every third of it",
        _int(15, 60),
        30,
    )
    count_threshold: int = _setting(
        "SIDECAR_COUNT_THRESHOLD",
        "flush a query after this many applied updates",
        _int(1, 10_000_000),
        100,
    )
    time_threshold_s: float = _setting(
        "SIDECAR_TIME_THRESHOLD_S",
        "flush a query when its oldest unflushed update is this old, seconds",
        _float(0.0, 86_400),
        10.0,
    )
    flush_interval_s: float = _setting(
        "SIDECAR_FLUSH_INTERVAL_S",
        "how often thresholds are checked, seconds",
        _float(0.01, 3600),
        1.0,
    )
    flush_concurrency: int = _setting(
        "SIDECAR_FLUSH_CONCURRENCY", "queries flushed at the same time", _int(1, 256), 8
    )
    write_timeout_s: float = _setting(
        "SIDECAR_WRITE_TIMEOUT_S",
        "timeout of one blob call (write, lease, read), seconds",
        _float(0.1, 600),
        10.0,
    )
    ack_mode: str = _setting(
        "SIDECAR_ACK_MODE",
        "redis: ack once buffered in Redis; blob: ack once the batch is in the blob",
        _ack_mode,
        "redis",
    )
    blob_ack_timeout_s: float = _setting(
        "SIDECAR_BLOB_ACK_TIMEOUT_S",
        "in blob ack mode, reply not_durable after waiting this long, seconds",
        _float(0.1, 3600),
        30.0,
    )

    def __repr__(self) -> str:
        shown = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if (redact := f.metadata.get("redact")) and value is not None:
                value = redact(value)
            shown.append(
                f"{f.name}={value:o}" if f.name == "socket_mode" else f"{f.name}={value!r}"
            )
        return f"Config({', '.join(shown)})"

    @classmethod
    def from_env(
        cls, env: Mapping[str, str], overrides: Mapping[str, str | None] | None = None
    ) -> Config:
        """Build from environment variables, then ``overrides`` (CLI flags, by field name).

        Raises:
            ConfigError: naming every invalid or unknown setting at once.
        """
        known = {f.metadata["env"]: f for f in dataclasses.fields(cls)}
        problems: list[str] = []
        for name in sorted(env):
            if (
                name.startswith(ENV_PREFIX)
                and name not in known
                and not _K8S_SERVICE_ENV.match(name)
            ):
                # Compare without the shared prefix, or every name looks alike.
                suffixes = {k.removeprefix(ENV_PREFIX): k for k in known}
                hint = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), suffixes, n=1)
                problems.append(
                    f"{name}: unknown setting"
                    + (f" (did you mean {suffixes[hint[0]]}?)" if hint else "")
                )
        values: dict[str, Any] = {}
        for env_name, f in known.items():
            raw = (overrides or {}).get(f.name)
            source = f"--{f.name.replace('_', '-')}"
            if raw is None:
                raw, source = env.get(env_name), env_name
            if raw is None:
                continue
            try:
                values[f.name] = f.metadata["parse"](raw)
            except ValueError as exc:
                shown = "(hidden)" if f.metadata.get("redact") else repr(raw)
                problems.append(f"{source}={shown}: {exc}")
        if problems:
            raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
        return cls(**values)

    # --- Kafka consumer-group commits (off unless bootstrap servers are set) ----------------
    kafka_bootstrap_servers: str | None = _setting(
        "SIDECAR_KAFKA_BOOTSTRAP_SERVERS",
        "commit durable offsets of Kafka sources to consumer groups on these brokers "
        "(host:port,...; unset: off)",
        _bootstrap,
        None,
    )
    kafka_group_template: str = _setting(
        "SIDECAR_KAFKA_GROUP_TEMPLATE",
        "consumer group name; placeholders {query_name} (id when unnamed), {query_id}, {namespace}",
        _group_template,
        "spark-{query_name}",
    )
    kafka_queries: str = _setting(
        "SIDECAR_KAFKA_QUERIES",
        "also commit Kafka-shaped offsets of non-Kafka sources for these queries "
        "(comma-separated names or ids)",
        str,
        "",
    )
    kafka_recommit_interval_s: float = _setting(
        "SIDECAR_KAFKA_RECOMMIT_INTERVAL_S",
        "re-commit the current offsets when idle this often, so retention does not expire "
        "the group and lag tools do not call it stopped",
        _float(1, 86_400),
        60.0,
    )
    kafka_timeout_s: float = _setting(
        "SIDECAR_KAFKA_TIMEOUT_S", "timeout of one Kafka request, seconds", _float(0.5, 300), 10.0
    )
    kafka_security_protocol: str = _setting(
        "SIDECAR_KAFKA_SECURITY_PROTOCOL",
        "PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL",
        _choice("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"),
        "PLAINTEXT",
    )
    kafka_sasl_mechanism: str | None = _setting(
        "SIDECAR_KAFKA_SASL_MECHANISM",
        "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512",
        _choice("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"),
        None,
    )
    kafka_sasl_username: str | None = _setting(
        "SIDECAR_KAFKA_SASL_USERNAME", "SASL user name", str, None
    )
    kafka_sasl_password: str | None = _setting(
        "SIDECAR_KAFKA_SASL_PASSWORD",
        "SASL password (never logged)",
        str,
        None,
        redact=lambda _v: "***",
    )
    kafka_ssl_cafile: str | None = _setting(
        "SIDECAR_KAFKA_SSL_CAFILE", "CA bundle to verify the brokers (SSL)", str, None
    )
    kafka_ssl_certfile: str | None = _setting(
        "SIDECAR_KAFKA_SSL_CERTFILE", "client certificate (mutual TLS)", str, None
    )
    kafka_ssl_keyfile: str | None = _setting(
        "SIDECAR_KAFKA_SSL_KEYFILE", "client private key (mutual TLS)", str, None
    )
    kafka_lag_per_partition: bool = _setting(
        "SIDECAR_KAFKA_LAG_PER_PARTITION",
        "export lag per partition (false: per topic, for wide topics)",
        _bool,
        True,
    )

    def check_runnable(self) -> None:
        """Checks that need several settings together, made before the daemon starts.

        Raises:
            ConfigError: the blob store is not configured.
        """
        self.check_kafka()
        if not self.azure_connection_string and not self.account_url:
            raise ConfigError(
                "no blob store configured: set AZURE_STORAGE_CONNECTION_STRING, or "
                "SIDECAR_ACCOUNT_URL (https://<account>.blob.core.windows.net) for "
                "DefaultAzureCredential"
            )

    def check_kafka(self) -> None:
        """Kafka settings that only make sense together.

        Raises:
            ConfigError: naming what is missing.
        """
        if not self.kafka_bootstrap_servers:
            return
        sasl = self.kafka_security_protocol.startswith("SASL")
        if sasl and not (
            self.kafka_sasl_mechanism and self.kafka_sasl_username and self.kafka_sasl_password
        ):
            raise ConfigError(
                f"SIDECAR_KAFKA_SECURITY_PROTOCOL={self.kafka_security_protocol} needs "
                "SIDECAR_KAFKA_SASL_MECHANISM, SIDECAR_KAFKA_SASL_USERNAME and "
                "SIDECAR_KAFKA_SASL_PASSWORD"
            )
        if bool(self.kafka_ssl_certfile) != bool(self.kafka_ssl_keyfile):
            raise ConfigError(
                "SIDECAR_KAFKA_SSL_CERTFILE and SIDECAR_KAFKA_SSL_KEYFILE go together (mutual TLS)"
            )

    @property
    def kafka_query_set(self) -> frozenset[str]:
        """Queries (names or ids) whose Kafka-shaped non-Kafka sources are committed too."""
        return frozenset(q.strip() for q in self.kafka_queries.split(",") if q.strip())

    def redacted(self, name: str) -> str:
        """A setting's value as it may be shown to people (secrets redacted)."""
        f = next(f for f in dataclasses.fields(self) if f.name == name)
        value = getattr(self, name)
        if value is None:
            return ""
        if redact := f.metadata.get("redact"):
            return str(redact(value))
        if name == "socket_mode":
            return f"{value:o}"
        return str(value)

    @classmethod
    def settings(cls) -> list[dataclasses.Field[Any]]:
        """The settings with their metadata (env, help, default), for ``--help`` and docs."""
        return list(dataclasses.fields(cls))
