"""Unit tests of the daemon's configuration (``sidecar.config.settings``) and Redis key names.

Pure logic: every test passes its own environment mapping, never ``os.environ``.
"""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.buffer.keys import Keys
from sidecar.config import Config, redact_url
from sidecar.errors import ConfigError

DEFAULTS = {
    "socket_path": "/tmp/checkpoint-sidecar.sock",
    "socket_mode": 0o600,
    "tcp_port": 0,
    "tcp_host": "127.0.0.1",
    "redis_url": "redis://127.0.0.1:6379/0",
    "namespace": "default",
    "metrics_host": "0.0.0.0",
    "metrics_port": 9400,
    "max_frame_bytes": 1024 * 1024,
    "admin_ops": False,
    "admin_ops_tcp": False,
    "admin_quiet_s": 60.0,
    "redis_timeout_s": 2.0,
    "redis_require_aof": False,
    "redis_mode": "standalone",
    "redis_sentinels": None,
    "redis_sentinel_master": None,
    "redis_sentinel_password": None,
    "redis_min_replicas": 0,
    "shutdown_grace_s": 20.0,
    "log_level": "INFO",
    "log_format": "text",
    "event_loop": "auto",
    "azure_connection_string": None,
    "account_url": None,
    "container": "spark-checkpoints",
    "lease_duration_s": 30,
    "instance_id": None,
    "state_dir": None,
    "count_threshold": 100,
    "time_threshold_s": 10.0,
    "flush_interval_s": 1.0,
    "flush_concurrency": 32,
    "write_timeout_s": 10.0,
    "history_size": 20,
    "ack_mode": "redis",
    "blob_ack_timeout_s": 30.0,
    "query_idle_s": 3600.0,
    "kafka_bootstrap_servers": None,
    "kafka_group_template": "spark-{query_name}",
    "kafka_queries": "",
    "kafka_recommit_interval_s": 60.0,
    "kafka_timeout_s": 10.0,
    "kafka_security_protocol": "PLAINTEXT",
    "kafka_sasl_mechanism": None,
    "kafka_sasl_username": None,
    "kafka_sasl_password": None,
    "kafka_ssl_cafile": None,
    "kafka_ssl_certfile": None,
    "kafka_ssl_keyfile": None,
    "kafka_lag_per_partition": True,
    "kafka_lag_partition_series_max": 10_000,
    "eventhubs_namespace": None,
    "eventhubs_consumer_group_template": "spark-{query_name}",
    "eventhubs_container": None,
    "snapshot_root": None,
    "snapshot_retain": 10,
    "snapshot_abandoned_keep_s": 7 * 86400.0,
}


def problems(env: dict[str, str], overrides: dict[str, str | None] | None = None) -> str:
    """The message of the ConfigError that ``env`` must raise."""
    with pytest.raises(ConfigError) as excinfo:
        Config.from_env(env, overrides)
    return str(excinfo.value)


def fields_of(config: Config) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in Config.settings()}


# --- defaults and parsing -----------------------------------------------------------------


def test_empty_environment_gives_the_defaults() -> None:
    assert fields_of(Config.from_env({})) == DEFAULTS


def test_sentinel_mode_needs_its_sentinels_and_master() -> None:
    message = problems({"SIDECAR_REDIS_MODE": "Sentinel"})
    assert "SIDECAR_REDIS_MODE=sentinel needs SIDECAR_REDIS_SENTINELS" in message
    assert "SIDECAR_REDIS_MODE='replica': must be one of" in problems(
        {"SIDECAR_REDIS_MODE": "replica"}
    )
    assert "SIDECAR_REDIS_SENTINELS='a:b'" in problems({"SIDECAR_REDIS_SENTINELS": "a:b"})
    config = Config.from_env(
        {
            "SIDECAR_REDIS_MODE": "sentinel",
            "SIDECAR_REDIS_SENTINELS": "s1:26379, s2:26379",
            "SIDECAR_REDIS_SENTINEL_MASTER": "buffer",
            "SIDECAR_REDIS_SENTINEL_PASSWORD": "hunter2",
        }
    )
    assert config.redis_sentinels == "s1:26379,s2:26379"
    assert "hunter2" not in repr(config)


def test_variables_outside_the_prefix_are_ignored() -> None:
    env = {"PATH": "/usr/bin", "REDIS_URL": "http://not-checked", "SIDECARX": "1"}
    assert fields_of(Config.from_env(env)) == DEFAULTS


def test_every_setting_is_named_after_its_field() -> None:
    # The CLI derives flags from field names; the env names follow them, except the Azure
    # SDK's conventional AZURE_STORAGE_CONNECTION_STRING.
    for f in Config.settings():
        expected = f"SIDECAR_{f.name.upper()}"
        if f.name == "azure_connection_string":
            expected = "AZURE_STORAGE_CONNECTION_STRING"
        assert f.metadata["env"] == expected
        assert f.metadata["help"]


@pytest.mark.parametrize(
    ("var", "raw", "field", "expected"),
    [
        ("SIDECAR_SOCKET_PATH", "/run/spark/cps.sock", "socket_path", "/run/spark/cps.sock"),
        ("SIDECAR_SOCKET_MODE", "660", "socket_mode", 0o660),
        ("SIDECAR_SOCKET_MODE", "0600", "socket_mode", 0o600),
        ("SIDECAR_TCP_PORT", "9401", "tcp_port", 9401),
        ("SIDECAR_TCP_PORT", "auto", "tcp_port", 0),
        ("SIDECAR_TCP_PORT", "0", "tcp_port", 0),
        ("SIDECAR_TCP_PORT", "", "tcp_port", 0),
        ("SIDECAR_TCP_PORT", "off", "tcp_port", None),
        ("SIDECAR_TCP_PORT", "OFF", "tcp_port", None),
        ("SIDECAR_TCP_HOST", "::1", "tcp_host", "::1"),
        ("SIDECAR_TCP_HOST", "127.0.0.2", "tcp_host", "127.0.0.2"),
        ("SIDECAR_REDIS_URL", "rediss://cache:6380/1", "redis_url", "rediss://cache:6380/1"),
        ("SIDECAR_REDIS_URL", "unix:///run/redis.sock", "redis_url", "unix:///run/redis.sock"),
        ("SIDECAR_NAMESPACE", "team-a.prod_1", "namespace", "team-a.prod_1"),
        ("SIDECAR_METRICS_HOST", "127.0.0.1", "metrics_host", "127.0.0.1"),
        ("SIDECAR_METRICS_PORT", "9500", "metrics_port", 9500),
        ("SIDECAR_METRICS_PORT", "0", "metrics_port", 0),
        ("SIDECAR_MAX_FRAME_BYTES", "2097152", "max_frame_bytes", 2097152),
        ("SIDECAR_REDIS_TIMEOUT_S", "0.5", "redis_timeout_s", 0.5),
        ("SIDECAR_REDIS_REQUIRE_AOF", "yes", "redis_require_aof", True),
        ("SIDECAR_SHUTDOWN_GRACE_S", "30", "shutdown_grace_s", 30.0),
        ("SIDECAR_LOG_LEVEL", "debug", "log_level", "DEBUG"),
        ("SIDECAR_LOG_FORMAT", "JSON", "log_format", "json"),
        ("SIDECAR_SNAPSHOT_ROOT", "/mnt/checkpoints", "snapshot_root", "/mnt/checkpoints"),
    ],
)
def test_environment_value_is_parsed(var: str, raw: str, field: str, expected: Any) -> None:
    config = Config.from_env({var: raw})
    value = getattr(config, field)
    assert value == expected
    assert type(value) is type(expected)
    assert fields_of(config) == DEFAULTS | {field: expected}  # nothing else moved


def test_override_wins_over_the_environment() -> None:
    env = {"SIDECAR_METRICS_PORT": "9500", "SIDECAR_NAMESPACE": "from-env"}
    config = Config.from_env(env, {"metrics_port": "9600", "namespace": None})
    assert config.metrics_port == 9600
    assert config.namespace == "from-env"  # an unset flag (None) leaves the env value


def test_invalid_override_is_named_by_its_flag() -> None:
    message = problems({"SIDECAR_METRICS_PORT": "9500"}, {"metrics_port": "abc"})
    assert "--metrics-port='abc'" in message
    assert "SIDECAR_METRICS_PORT" not in message


# --- invalid values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("var", "raw", "fragment"),
    [
        ("SIDECAR_METRICS_PORT", "abc", "invalid literal for int()"),
        ("SIDECAR_METRICS_PORT", "70000", "must be between 0 and 65535"),
        ("SIDECAR_TCP_PORT", "70000", "must be auto, off or a port number 1-65535"),
        ("SIDECAR_TCP_PORT", "http", "must be auto, off or a port number 1-65535"),
        ("SIDECAR_SOCKET_MODE", "999", "base 8"),
        ("SIDECAR_SOCKET_MODE", "1777", "must be a permission mode in octal"),
        ("SIDECAR_NAMESPACE", "team{a}", "must be 1-64 characters"),
        ("SIDECAR_NAMESPACE", "", "must be 1-64 characters"),
        ("SIDECAR_NAMESPACE", "-leading-dash", "starting alphanumeric"),
        ("SIDECAR_NAMESPACE", "n" * 65, "must be 1-64 characters"),
        ("SIDECAR_TCP_HOST", "0.0.0.0", "loopback"),
        ("SIDECAR_TCP_HOST", "10.1.2.3", "loopback"),
        ("SIDECAR_TCP_HOST", "localhost", "must be a loopback IP address"),
        ("SIDECAR_REDIS_URL", "http://x", "must be a redis://, rediss:// or unix:// URL"),
        ("SIDECAR_MAX_FRAME_BYTES", "100", "must be between 1024 and"),
        ("SIDECAR_REDIS_TIMEOUT_S", "nan", "must be between 0.05 and 60"),
        ("SIDECAR_SHUTDOWN_GRACE_S", "soon", "could not convert"),
        ("SIDECAR_LOG_LEVEL", "TRACE", "must be one of DEBUG, INFO, WARNING, ERROR"),
        ("SIDECAR_LOG_FORMAT", "logfmt", "must be one of text, json"),
        ("SIDECAR_SNAPSHOT_ROOT", "abfss://c@a.dfs.core.windows.net/ck", "not read yet"),
        ("SIDECAR_SNAPSHOT_ROOT", "checkpoints", "must be an absolute directory path"),
    ],
)
def test_invalid_value_is_refused_naming_the_variable(var: str, raw: str, fragment: str) -> None:
    message = problems({var: raw})
    shown = "(hidden)" if var == "SIDECAR_REDIS_URL" else repr(raw)
    assert f"{var}={shown}: " in message
    assert fragment in message


def test_several_problems_are_reported_together() -> None:
    message = problems(
        {
            "SIDECAR_METRICS_PORT": "abc",
            "SIDECAR_SOCKET_MODE": "999",
            "SIDECAR_TCP_HOST": "0.0.0.0",
            "SIDECAR_REDIS_ULR": "redis://x",
        }
    )
    lines = message.splitlines()
    assert lines[0] == "invalid configuration:"
    for name in (
        "SIDECAR_METRICS_PORT",
        "SIDECAR_SOCKET_MODE",
        "SIDECAR_TCP_HOST",
        "SIDECAR_REDIS_ULR",
    ):
        assert sum(line.strip().startswith(name) for line in lines[1:]) == 1, name
    assert len(lines) == 5


def test_unknown_variable_is_refused_with_a_hint() -> None:
    message = problems({"SIDECAR_REDIS_ULR": "redis://127.0.0.1:6379/0"})
    assert "SIDECAR_REDIS_ULR: unknown setting (did you mean SIDECAR_REDIS_URL?)" in message


def test_unknown_variable_unlike_any_setting_is_refused_too() -> None:
    message = problems({"SIDECAR_WIDGET_COLOR": "checkpoints"})
    assert "SIDECAR_WIDGET_COLOR: unknown setting" in message


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("SIDECAR_SERVICE_HOST", "10.96.12.7"),
        ("SIDECAR_SERVICE_PORT", "9400"),
        ("SIDECAR_SERVICE_PORT_METRICS", "9400"),
        ("SIDECAR_PORT", "tcp://10.96.12.7:9400"),
        ("SIDECAR_PORT_9400_TCP", "tcp://10.96.12.7:9400"),
        ("SIDECAR_PORT_9400_TCP_ADDR", "10.96.12.7"),
        ("SIDECAR_PORT_9400_TCP_PORT", "9400"),
        ("SIDECAR_PORT_9400_TCP_PROTO", "tcp"),
    ],
)
def test_kubernetes_service_link_variables_are_tolerated(var: str, value: str) -> None:
    assert fields_of(Config.from_env({var: value})) == DEFAULTS


# --- secrets -----------------------------------------------------------------------------------

SECRET_URL = "redis://:s3cret@redis.internal:6379/0"


def test_repr_hides_the_redis_password_but_keeps_where_it_connects() -> None:
    config = Config.from_env({"SIDECAR_REDIS_URL": SECRET_URL})
    for text in (repr(config), str(config), f"{config!r}"):
        assert "s3cret" not in text
        assert "redis_url='redis://:***@redis.internal:6379/0'" in text
    assert config.redis_url == SECRET_URL  # the real value is still there to connect with


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        (SECRET_URL, "redis://:***@redis.internal:6379/0"),
        ("redis://app:s3cret@redis.internal:6379/0", "redis://app:***@redis.internal:6379/0"),
        ("rediss://:s3cret@[::1]:6380/2", "rediss://:***@[::1]:6380/2"),
        ("redis://:s3@cret@redis.internal:6379", "redis://:***@redis.internal:6379"),
        ("redis://redis.internal:6379/0", "redis://redis.internal:6379/0"),
        ("redis://app@redis.internal:6379/0", "redis://app@redis.internal:6379/0"),
    ],
)
def test_redact_url_hides_only_the_password(url: str, redacted: str) -> None:
    assert redact_url(url) == redacted


def test_invalid_secret_value_is_hidden_in_the_error() -> None:
    message = problems({"SIDECAR_REDIS_URL": "http://:s3cret@redis.internal:6379"})
    assert "SIDECAR_REDIS_URL=(hidden): " in message
    assert "s3cret" not in message
    assert "redis.internal" not in message


# --- Redis keys --------------------------------------------------------------------------------


def cluster_hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes: the first non-empty ``{...}``, else all."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def all_keys(keys: Keys, query_id: str = "8a3f7c2e-5b1d-4e6f-9a0b-1c2d3e4f5a6b") -> list[str]:
    return [keys.query(query_id), keys.pending, keys.queries]


def test_every_key_carries_the_namespace_hash_tag_once() -> None:
    for key in all_keys(Keys("ns")):
        assert key.startswith("cps:{ns}:")
        assert key.count("{ns}") == 1


def test_keys_have_distinct_names() -> None:
    keys = Keys("ns")
    assert len({keys.query("a"), keys.query("b"), keys.pending, keys.queries}) == 4


@pytest.mark.parametrize("query_id", ["plain", "{other}", "a}b{c}", "", "}"])
def test_query_id_never_changes_the_cluster_slot(query_id: str) -> None:
    keys = Keys("team-a.prod_1")
    assert {cluster_hash_tag(k) for k in all_keys(keys, query_id)} == {"team-a.prod_1"}


def test_namespaces_do_not_share_keys() -> None:
    assert not set(all_keys(Keys("a"))) & set(all_keys(Keys("b")))


# --- regressions ------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://redis.internal:6379/0?password=s3cret",
        "unix:///run/redis.sock?db=0&password=s3cret",
    ],
)
def test_repr_hides_a_password_given_as_query_parameter(url: str) -> None:
    assert "s3cret" not in repr(Config.from_env({"SIDECAR_REDIS_URL": url}))


def test_unrelated_unknown_variable_gets_no_misleading_hint() -> None:
    with pytest.raises(ConfigError) as excinfo:
        Config.from_env({"SIDECAR_WIDGET_COLOR": "checkpoints"})
    assert "did you mean" not in str(excinfo.value)


def test_connection_string_key_is_redacted_everywhere() -> None:
    conn = (
        "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=c2VjcmV0a2V5;EndpointSuffix=x"
    )
    config = Config.from_env({"AZURE_STORAGE_CONNECTION_STRING": conn})
    assert "c2VjcmV0a2V5" not in repr(config)
    assert "c2VjcmV0a2V5" not in config.redacted("azure_connection_string")
    assert "AccountName=acct" in config.redacted("azure_connection_string")


def test_run_needs_a_blob_store() -> None:
    with pytest.raises(ConfigError, match="AZURE_STORAGE_CONNECTION_STRING"):
        Config.from_env({}).require_blob_store()
    account = {"SIDECAR_ACCOUNT_URL": "https://acct.blob.core.windows.net"}
    Config.from_env(account).require_blob_store()


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("SIDECAR_LEASE_DURATION_S", "10"),
        ("SIDECAR_LEASE_DURATION_S", "61"),
        ("SIDECAR_CONTAINER", "Bad_Name"),
        ("SIDECAR_ACK_MODE", "disk"),
        ("SIDECAR_COUNT_THRESHOLD", "0"),
        ("AZURE_STORAGE_CONNECTION_STRING", "not a connection string"),
    ],
)
def test_blob_settings_are_validated(var: str, value: str) -> None:
    assert var in problems({var: value})


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("SIDECAR_KAFKA_BOOTSTRAP_SERVERS", "no-port-here"),
        ("SIDECAR_KAFKA_GROUP_TEMPLATE", "spark-{queryname}"),
        ("SIDECAR_KAFKA_SECURITY_PROTOCOL", "TLS"),
        ("SIDECAR_KAFKA_LAG_PER_PARTITION", "maybe"),
    ],
)
def test_kafka_settings_are_validated(var: str, value: str) -> None:
    assert var in problems({var: value})


def test_kafka_password_is_redacted() -> None:
    config = Config.from_env({"SIDECAR_KAFKA_SASL_PASSWORD": "pa55word"})
    assert "pa55word" not in repr(config)
    assert config.redacted("kafka_sasl_password") == "***"


# --- msgspec types, validation on construction, groups ------------------------------------


@pytest.mark.parametrize(
    ("var", "raw", "choices"),
    [
        ("SIDECAR_ACK_MODE", "disk", "redis, blob"),
        ("SIDECAR_LOG_LEVEL", "TRACE", "DEBUG, INFO, WARNING, ERROR"),
        ("SIDECAR_KAFKA_SECURITY_PROTOCOL", "TLS", "PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL"),
        ("SIDECAR_KAFKA_SASL_MECHANISM", "MD5", "PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"),
    ],
)
def test_a_wrong_choice_is_told_the_choices(var: str, raw: str, choices: str) -> None:
    assert f"{var}={raw!r}: must be one of {choices}" in problems({var: raw})


@pytest.mark.parametrize(
    ("var", "raw", "field", "expected"),
    [
        ("SIDECAR_ACK_MODE", "BLOB", "ack_mode", "blob"),
        ("SIDECAR_KAFKA_SECURITY_PROTOCOL", " sasl_ssl ", "kafka_security_protocol", "SASL_SSL"),
        ("SIDECAR_KAFKA_SASL_MECHANISM", "scram-sha-512", "kafka_sasl_mechanism", "SCRAM-SHA-512"),
    ],
)
def test_choices_are_read_in_any_case(var: str, raw: str, field: str, expected: str) -> None:
    assert getattr(Config.from_env({var: raw}), field) == expected


def test_a_value_out_of_bounds_from_a_flag_is_named_by_the_flag() -> None:
    message = problems({}, {"metrics_port": "70000", "tcp_host": "10.0.0.1"})
    assert "--metrics-port='70000': must be between 0 and 65535" in message
    assert "--tcp-host='10.0.0.1': must be a loopback IP address" in message


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ConfigError) as excinfo:
        Config(metrics_port=70000, tcp_host="10.0.0.1", container="Bad_Name")
    message = str(excinfo.value)
    assert "SIDECAR_METRICS_PORT: must be between 0 and 65535" in message
    assert "SIDECAR_TCP_HOST: must be a loopback IP address" in message
    assert "SIDECAR_CONTAINER: must be an Azure container name" in message
    assert Config(namespace="ns", metrics_port=0).metrics_port == 0


KAFKA = {"SIDECAR_KAFKA_BOOTSTRAP_SERVERS": "b:9092"}


def test_kafka_settings_that_go_together_are_refused_at_construction_all_at_once() -> None:
    message = problems(
        KAFKA
        | {"SIDECAR_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "SIDECAR_KAFKA_SSL_CERTFILE": "c.pem"}
        | {"SIDECAR_METRICS_PORT": "abc", "SIDECAR_TCP_HOST": "10.0.0.1"}
    )
    assert "SIDECAR_KAFKA_SECURITY_PROTOCOL=SASL_SSL needs SIDECAR_KAFKA_SASL_MECHANISM" in message
    assert "SIDECAR_KAFKA_SSL_CERTFILE and SIDECAR_KAFKA_SSL_KEYFILE go together" in message
    assert "SIDECAR_METRICS_PORT='abc': invalid literal" in message  # text to value
    assert "SIDECAR_TCP_HOST='10.0.0.1': must be a loopback" in message  # validation
    assert len(message.splitlines()) == 5


def test_kafka_combinations_are_not_checked_while_kafka_commits_are_off() -> None:
    config = Config.from_env({"SIDECAR_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"})
    assert config.kafka_security_protocol == "SASL_SSL"
    sasl = {
        "SIDECAR_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "SIDECAR_KAFKA_SASL_MECHANISM": "PLAIN",
        "SIDECAR_KAFKA_SASL_USERNAME": "u",
        "SIDECAR_KAFKA_SASL_PASSWORD": "p",
    }
    assert Config.from_env(KAFKA | sasl).kafka_sasl_mechanism == "PLAIN"


def test_bootstrap_servers_are_normalised_and_each_checked() -> None:
    raw = " a:9092 , b:9093,"
    assert Config.from_env({"SIDECAR_KAFKA_BOOTSTRAP_SERVERS": raw}).kafka_bootstrap_servers == (
        "a:9092,b:9093"
    )
    message = problems({"SIDECAR_KAFKA_BOOTSTRAP_SERVERS": "a:9092,nohost,b"})
    assert "must be host:port[,host:port...]; not nohost, b" in message


def test_socket_mode_is_shown_in_octal() -> None:
    config = Config.from_env({"SIDECAR_SOCKET_MODE": "660"})
    assert config.redacted("socket_mode") == "660"
    assert "socket_mode=660," in repr(config)


def test_a_config_without_a_blob_store_is_valid_until_the_blobs_are_used() -> None:
    config = Config.from_env({})  # what `checkpoint-sidecar config` shows
    assert config.redacted("azure_connection_string") == ""
    with pytest.raises(ConfigError, match="SIDECAR_ACCOUNT_URL"):
        config.require_blob_store()


def test_settings_are_grouped_by_component_in_the_order_data_flows() -> None:
    groups: dict[str, list[str]] = {}
    for s in Config.settings():
        groups.setdefault(s.group, []).append(s.name)
    # Each group is one run of fields (one --help section): declaration order keeps them together.
    assert [n for names in groups.values() for n in names] == [s.name for s in Config.settings()]
    assert [names[0] for names in groups.values()] == [
        "socket_path",
        "redis_url",
        "azure_connection_string",
        "count_threshold",
        "kafka_bootstrap_servers",
        "eventhubs_namespace",
        "snapshot_root",
        "metrics_host",
    ]
    kafka = next(names for title, names in groups.items() if title.startswith("Kafka"))
    assert kafka == [s.name for s in Config.settings() if s.name.startswith("kafka_")]
