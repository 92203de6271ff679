"""Configuration: one typed object, built once at the edge, validated when it is built.

Every setting has an environment variable (the daemon runs in containers) and a flag of the
same name; a flag wins. Fields are declared by component in the order data flows, and
``--help`` shows the same groups. Unknown ``SIDECAR_*`` variables are refused (a typo must
not fall back to a default). Secrets are redacted in ``repr``, :meth:`Config.redacted` and
error messages.

* Text to value is :meth:`Config.from_env`'s job: a number, octal bits, ``off``, a list, a
  choice in any case. Its errors name the variable or flag and the text given.
* Validation is ``Config.__post_init__``'s, so it runs on every construction and nowhere
  else: each value against its annotation (``msgspec.Meta`` bounds and patterns, ``Literal``
  choices) through ``msgspec.convert``, plus a few hand-written checks msgspec cannot express;
  then the rules over several settings (Kafka SASL, mutual TLS). All problems at once.
* A blob store is not part of validity (``checkpoint-sidecar config`` shows a configuration
  without one): :meth:`Config.require_blob_store` is called where the blobs are used, by
  ``BlobStore``, so the daemon, the read commands and ``spark_bridge.load_checkpoint`` stop
  with the same message (exit code 2 from the CLI).
"""

from __future__ import annotations

import contextlib
import difflib
import ipaddress
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit, urlunsplit

import msgspec
from msgspec import Meta

from sidecar.config.help import HELP as _HELP
from sidecar.errors import ConfigError

ENV_PREFIX = "SIDECAR_"
# Variables Kubernetes adds for a Service named "sidecar" (docker-link style service env).
_K8S_SERVICE_ENV = re.compile(r"^SIDECAR_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\w+)?)$")
_SECRET_PART = re.compile(r"(?i)((?:^|;)\s*(?:AccountKey|SharedAccessSignature)=)[^;]*")
_SECRET_QUERY = re.compile(r"(?i)((?:^|&)(?:password|pass|pwd)=)[^&]*")
_HOST_PORT = re.compile(r"^[A-Za-z0-9._\[\]:-]+:\d{1,5}$")


def redact_connection_string(text: str) -> str:
    """Return an Azure Storage connection string with its key or SAS as ``***``."""
    return _SECRET_PART.sub(r"\1***", text)


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


# --- syntax (text -> value) and the rules msgspec cannot express (value -> ValueError) -------


def _bool(text: str) -> bool:
    if (value := text.strip().lower()) in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value in ("1", "true", "yes", "on")
    raise ValueError("must be true or false")


def _loopback(text: str) -> None:
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(text).is_loopback:
            return
    raise ValueError("must be a loopback IP address (127.0.0.0/8 or ::1)")


def _host_ports(text: str) -> None:
    if bad := [s for s in text.split(",") if not _HOST_PORT.match(s)]:
        raise ValueError(f"must be host:port[,host:port...]; not {', '.join(bad)}")


def _tcp_port(text: str) -> int | None:
    word = text.strip().lower()
    if word in ("off", "none"):
        return None
    if word in ("", "auto"):
        return 0
    if not word.isdigit():
        raise ValueError("must be auto, off or a port number 1-65535")
    return int(word)


def _group_template(text: str) -> None:
    try:
        text.format(query_name="q", query_id="i", namespace="n")
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"unknown placeholder {exc}; use {{query_name}}, {{query_id}}, {{namespace}}"
        ) from None


# Constrained types. ``extra`` holds what msgspec does not: "must" (said of a value outside the
# constraint), "parse" (text -> value), "check", "show" and "redact" (a secret).
# fmt: off
Port = Annotated[int, Meta(ge=1, le=65535)]
# A loopback TCP port: 0 (auto) lets the kernel pick a free one; None (off): no listener.
TcpPort = Annotated[Annotated[int, Meta(ge=0, le=65535)] | None, Meta(extra={
    "parse": _tcp_port, "show": lambda port: "auto" if port == 0 else str(port),
    "must": "must be auto, off or a port number 1-65535"})]
Octal = Annotated[int, Meta(ge=0, le=0o777, extra={
    "parse": lambda text: int(text, 8), "show": "{:o}".format,
    "must": "must be a permission mode in octal, e.g. 600 or 660"})]
Loopback = Annotated[str, Meta(extra={"check": _loopback})]
RedisUrl = Annotated[str, Meta(pattern=r"(?i)^(rediss?|unix):", extra={
    "redact": redact_url, "must": "must be a redis://, rediss:// or unix:// URL"})]
Namespace = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", extra={
    "must": "must be 1-64 characters of A-Z a-z 0-9 . _ - (starting alphanumeric)"})]
InstanceId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$", extra={
    "must": "must be 1-253 characters of A-Z a-z 0-9 . _ - (starting alphanumeric)"})]
ConnectionString = Annotated[str, Meta(pattern=r"(?:^|;)(?:AccountName|BlobEndpoint)=", extra={
    "redact": redact_connection_string,
    "must": "must be an Azure Storage connection string (AccountName=...;...)"})]
HttpsUrl = Annotated[str, Meta(pattern=r"(?i)^https?://[^/?#]", extra={
    "must": "must be a URL such as https://<account>.blob.core.windows.net"})]
ContainerName = Annotated[str, Meta(pattern=r"^(?!.*--)[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$", extra={
    "must": "must be an Azure container name: 3-63 of a-z 0-9 -, no '--'"})]
HostPorts = Annotated[str, Meta(extra={"check": _host_ports, "parse": lambda text: ",".join(
    s.strip() for s in text.split(",") if s.strip()) or None})]
GroupTemplate = Annotated[str, Meta(extra={"check": _group_template})]
EventHubsNamespace = Annotated[str, Meta(
    pattern=r"^(?=.{3,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)+$",
    extra={"must": "must be the fully qualified namespace, a host name such as "
           "<namespace>.servicebus.windows.net (no sb://, no path)"})]
Password = Annotated[str, Meta(extra={"redact": lambda _: "***"})]
AbsolutePath = Annotated[str, Meta(pattern=r"^/", extra={
    "must": "must be an absolute directory path (a checkpoint on abfss:// or wasbs:// is not "
    "read yet: mount a volume holding it)"})]
# fmt: on


class Config(msgspec.Struct, frozen=True, kw_only=True):
    """All daemon settings, validated (see the module docstring). Build with :meth:`from_env`.

    Raises:
        ConfigError: on construction, naming every invalid setting.
    """

    # socket
    socket_path: str = "/tmp/checkpoint-sidecar.sock"
    socket_mode: Octal = 0o600
    tcp_port: TcpPort = 0
    tcp_host: Loopback = "127.0.0.1"
    max_frame_bytes: Annotated[int, Meta(ge=1024, le=64 * 1024 * 1024)] = 1024 * 1024
    admin_ops: bool = False
    admin_ops_tcp: bool = False
    admin_quiet_s: Annotated[float, Meta(ge=0, le=86_400)] = 60.0
    # Redis
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0"
    redis_mode: Literal["standalone", "cluster", "sentinel"] = "standalone"
    redis_sentinels: HostPorts | None = None
    redis_sentinel_master: str | None = None
    redis_sentinel_password: Password | None = None
    namespace: Namespace = "default"
    redis_timeout_s: Annotated[float, Meta(ge=0.05, le=60)] = 2.0
    redis_require_aof: bool = False
    redis_min_replicas: Annotated[int, Meta(ge=0, le=16)] = 0
    # blob store and leases
    azure_connection_string: ConnectionString | None = None
    account_url: HttpsUrl | None = None
    container: ContainerName = "spark-checkpoints"
    lease_duration_s: Annotated[int, Meta(ge=15, le=60)] = 30
    instance_id: InstanceId | None = None
    state_dir: str | None = None
    write_timeout_s: Annotated[float, Meta(ge=0.1, le=600)] = 10.0
    history_size: Annotated[int, Meta(ge=0, le=1000)] = 20
    # flushing and acknowledgements
    count_threshold: Annotated[int, Meta(ge=1, le=10_000_000)] = 100
    time_threshold_s: Annotated[float, Meta(ge=0.0, le=86_400)] = 10.0
    flush_interval_s: Annotated[float, Meta(ge=0.01, le=3600)] = 1.0
    flush_concurrency: Annotated[int, Meta(ge=1, le=256)] = 32
    ack_mode: Literal["redis", "blob"] = "redis"
    blob_ack_timeout_s: Annotated[float, Meta(ge=0.1, le=3600)] = 30.0
    query_idle_s: Annotated[float, Meta(ge=1, le=30 * 86_400)] = 3600.0
    # Kafka consumer-group commits
    kafka_bootstrap_servers: HostPorts | None = None
    kafka_group_template: GroupTemplate = "spark-{query_name}"
    kafka_queries: str = ""
    kafka_recommit_interval_s: Annotated[float, Meta(ge=1, le=86_400)] = 60.0
    kafka_timeout_s: Annotated[float, Meta(ge=0.5, le=300)] = 10.0
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: Password | None = None
    kafka_ssl_cafile: str | None = None
    kafka_ssl_certfile: str | None = None
    kafka_ssl_keyfile: str | None = None
    kafka_lag_per_partition: bool = True
    kafka_lag_partition_series_max: Annotated[int, Meta(ge=0, le=10_000_000)] = 10_000
    # Event Hubs checkpoints
    eventhubs_namespace: EventHubsNamespace | None = None
    eventhubs_consumer_group_template: GroupTemplate = "spark-{query_name}"
    eventhubs_container: ContainerName | None = None
    # checkpoint snapshots
    snapshot_root: AbsolutePath | None = None
    snapshot_retain: Annotated[int, Meta(ge=1, le=10_000)] = 10
    snapshot_abandoned_keep_s: Annotated[float, Meta(ge=0, le=366 * 86400)] = 7 * 86400.0
    # admin endpoint, logging, event loop, shutdown
    metrics_host: str = "0.0.0.0"
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 9400
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    shutdown_grace_s: Annotated[float, Meta(ge=0.1, le=3600)] = 20.0

    def __post_init__(self) -> None:
        problems: list[tuple[str | None, str]] = [
            (s.name, p) for s in _SETTINGS.values() if (p := s.problem(getattr(self, s.name)))
        ]
        if problems := problems + [(None, p) for p in self._problems_together()]:
            raise _Invalid(problems)

    def _problems_together(self) -> list[str]:
        problems = []
        sentinel = (self.redis_sentinels, self.redis_sentinel_master)
        if self.redis_mode == "sentinel" and not all(sentinel):
            problems.append(
                "SIDECAR_REDIS_MODE=sentinel needs SIDECAR_REDIS_SENTINELS (host:port,...) and "
                "SIDECAR_REDIS_SENTINEL_MASTER (the service name the sentinels monitor)"
            )
        if self.admin_ops_tcp and not self.admin_ops:
            problems.append("SIDECAR_ADMIN_OPS_TCP=true needs SIDECAR_ADMIN_OPS=true")
        if self.redis_mode == "cluster" and self.redis_url.lower().startswith("unix:"):
            problems.append("SIDECAR_REDIS_MODE=cluster needs a redis:// or rediss:// URL")
        if not self.kafka_bootstrap_servers:  # Kafka commits are off: nothing to combine
            return problems
        sasl = (self.kafka_sasl_mechanism, self.kafka_sasl_username, self.kafka_sasl_password)
        if str(self.kafka_security_protocol).startswith("SASL") and not all(sasl):
            problems.append(
                f"SIDECAR_KAFKA_SECURITY_PROTOCOL={self.kafka_security_protocol} needs "
                "SIDECAR_KAFKA_SASL_MECHANISM, SIDECAR_KAFKA_SASL_USERNAME and "
                "SIDECAR_KAFKA_SASL_PASSWORD"
            )
        if bool(self.kafka_ssl_certfile) != bool(self.kafka_ssl_keyfile):
            problems.append(
                "SIDECAR_KAFKA_SSL_CERTFILE and SIDECAR_KAFKA_SSL_KEYFILE go together (mutual TLS)"
            )
        return problems

    def __repr__(self) -> str:
        def shown(s: Setting, value: Any) -> str:
            if "show" in s.metadata:  # socket_mode=600, as it is written
                return s.show(value)
            return repr(s.show(value) if value is not None and "redact" in s.metadata else value)

        fields = (f"{n}={shown(s, getattr(self, n))}" for n, s in _SETTINGS.items())
        return f"Config({', '.join(fields)})"

    @classmethod
    def from_env(
        cls, env: Mapping[str, str], overrides: Mapping[str, str | None] | None = None
    ) -> Config:
        """Build from environment variables, then ``overrides`` (CLI flags, by field name).

        Raises:
            ConfigError: naming every invalid or unknown setting at once.
        """
        known = {s.metadata["env"]: s for s in _SETTINGS.values()}
        suffixes = {k.removeprefix(ENV_PREFIX): k for k in known}  # else every name looks alike
        problems = []
        for name in sorted(env.keys() - known.keys()):
            if name.startswith(ENV_PREFIX) and not _K8S_SERVICE_ENV.match(name):
                hint = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), suffixes, n=1)
                guess = f" (did you mean {suffixes[hint[0]]}?)" if hint else ""
                problems.append(f"{name}: unknown setting{guess}")
        values: dict[str, Any] = {}
        given: dict[str | None, str] = {}  # field name -> "SOURCE='text'", for messages
        for env_name, s in known.items():
            raw, source = (overrides or {}).get(s.name), f"--{s.name.replace('_', '-')}"
            if raw is None:
                raw, source = env.get(env_name), env_name
            if raw is None:
                continue
            given[s.name] = f"{source}={'(hidden)' if 'redact' in s.metadata else repr(raw)}"
            try:
                values[s.name] = s.metadata["parse"](raw)
            except ValueError as exc:
                problems.append(f"{given[s.name]}: {exc}")
        try:
            config = cls(**values)
        except _Invalid as exc:
            problems += [f"{given[n]}: {m}" if n in given else m for n, m in exc.problems]
        if problems:
            raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
        return config

    def require_blob_store(self) -> None:
        """Called by ``BlobStore``, the one user of these settings.

        Raises:
            ConfigError: neither a connection string nor an account URL is set.
        """
        if not self.azure_connection_string and not self.account_url:
            raise ConfigError(
                "no blob store configured: set AZURE_STORAGE_CONNECTION_STRING, or "
                "SIDECAR_ACCOUNT_URL (https://<account>.blob.core.windows.net) for "
                "DefaultAzureCredential"
            )

    @property
    def kafka_query_set(self) -> frozenset[str]:
        """Queries (names or ids) whose Kafka-shaped non-Kafka sources are committed too."""
        return frozenset(q.strip() for q in self.kafka_queries.split(",") if q.strip())

    def redacted(self, name: str) -> str:
        """A setting's value as it may be shown to people (secrets redacted, ``""`` unset)."""
        return _SETTINGS[name].show(getattr(self, name))

    @classmethod
    def settings(cls) -> list[Setting]:
        """Every setting in declaration order, which is also ``--help``'s."""
        return list(_SETTINGS.values())


#: The one setting whose variable is not SIDECAR_<FIELD>: the Azure SDK's conventional name.
_ENV = {"azure_connection_string": "AZURE_STORAGE_CONNECTION_STRING"}


@dataclass(frozen=True)
class Setting:
    """A field of :class:`Config` as the CLI and docs see it: ``metadata`` has ``env``,
    ``help``, ``parse`` and the type's ``must``, ``check``, ``show``, ``redact``."""

    name: str
    default: Any
    group: str
    type: Any
    metadata: Mapping[str, Any]

    def show(self, value: Any) -> str:
        """``value`` as people may see it: secrets redacted, ``""`` when unset."""
        shown = self.metadata.get("redact") or self.metadata.get("show") or str
        return "" if value is None else str(shown(value))

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` for this setting, or None."""
        try:
            msgspec.convert(value, self.type)
            if value is not None and (check := self.metadata.get("check")):
                check(value)
        except msgspec.ValidationError as exc:
            return str(self.metadata.get("must", exc))
        except ValueError as exc:
            return str(exc)
        return None


class _Invalid(ConfigError):
    def __init__(self, problems: list[tuple[str | None, str]]) -> None:
        self.problems = problems  # (field name, or None for a rule over several; message)
        lines = [f"{_SETTINGS[n].metadata['env']}: {m}" if n else m for n, m in problems]
        super().__init__("invalid configuration:\n  " + "\n  ".join(lines))


def _setting(f: msgspec.structs.FieldInfo, group: str, help: str) -> Setting:
    metas: list[Meta] = []
    kinds, todo = [], [f.type]
    while todo:  # unwrap Annotated[...] and X | None, collecting the Meta on the way
        t = todo.pop()
        if get_origin(t) is Annotated:
            todo.append(get_args(t)[0])
            metas += [m for m in get_args(t)[1:] if isinstance(m, Meta)]
        elif get_origin(t) in (Union, types.UnionType):
            todo += get_args(t)
        elif t is not type(None):
            kinds.append(t)
    metadata: dict[str, Any] = {"env": _ENV.get(f.name, ENV_PREFIX + f.name.upper()), "help": help}
    for meta in metas:
        metadata |= meta.extra or {}
    if choices := get_args(kinds[0]) if get_origin(kinds[0]) is Literal else ():
        # Any case in, the canonical spelling out; none matching is told the choices.
        metadata.setdefault(
            "parse", lambda t: next((c for c in choices if c.upper() == t.strip().upper()), t)
        )
        metadata.setdefault("must", f"must be one of {', '.join(choices)}")
    if bounds := [(m.ge, m.le) for m in metas if m.ge is not None]:
        metadata.setdefault("must", f"must be between {bounds[0][0]} and {bounds[0][1]}")
    metadata.setdefault("parse", {int: int, float: float, bool: _bool}.get(kinds[0], str))
    return Setting(f.name, f.default, group, f.type, metadata)


_HELP_OF = {name: (group, text) for group, texts in _HELP.items() for name, text in texts.items()}
_SETTINGS = {f.name: _setting(f, *_HELP_OF[f.name]) for f in msgspec.structs.fields(Config)}
