"""Log lines as text or JSON (``sidecar.telemetry.logs``): the fields lifted from a message's
``key=%s``, the error fields, the JSON line, and text staying what it was. A daemon process
logging JSON through a store fault: tests/faults/test_json_logs.py."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.config import Config
from sidecar.errors import BufferUnavailable, StoreUnavailable
from sidecar.telemetry.logs import (
    EXTRA_FIELDS,
    FIXED_FIELDS,
    JsonFormatter,
    error_fields,
    formatter,
    message_fields,
)
from tests.services import REPO_ROOT

#: The text line, as operators and tests/integration grep it: ``2026-11-21 10:00:00,123
#: WARNING sidecar.flush.lease: lease query=orders ...``.
TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: .*$")
ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def record(
    msg: object,
    *args: object,
    level: int = logging.INFO,
    name: str = "sidecar.flush.flusher",
    exc_info: Any = None,
    **extra: object,
) -> logging.LogRecord:
    """A record as ``logging.getLogger(name).log(level, msg, *args, extra=extra)`` makes it."""
    logger = logging.getLogger(name)
    return logger.makeRecord(name, level, __file__, 1, msg, args, exc_info, extra=extra or None)


def as_json(rec: logging.LogRecord) -> dict[str, Any]:
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    parsed: dict[str, Any] = json.loads(line)
    return parsed


# --- the fields a message names ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "args", "fields"),
    [
        # The call sites' own messages (sidecar/flush, kafka, daemon, ingest).
        (
            "flush query=%s batch=%d failed (retry %d in %.1fs): %s",
            ("orders", 41, 3, 2.73, "store down"),
            {"query": "orders", "batch": 41},
        ),
        ("lease query=%s %s -> %s: %s", ("orders", "HELD", "LOST", "why"), {"query": "orders"}),
        (
            "kafka group=%s query=%s batch=%d: committed %d partition(s)",
            ("spark-orders", "orders", 7, 12),
            {"group": "spark-orders", "query": "orders", "batch": 7},
        ),
        (
            "ready: namespace=%s socket=%s container=%s ack_mode=%s event_loop=%s",
            ("team-a", "/run/s.sock", "acct/ckpt", "redis", "uvloop"),
            {
                "namespace": "team-a",
                "socket": "/run/s.sock",
                "container": "acct/ckpt",
                "ack_mode": "redis",
                "event_loop": "uvloop",
            },
        ),
        # id=%r is a request id; a string shown quoted is lifted without its quotes.
        ("connection %d: request id=%r failed", (3, "r-1"), {"request_id": "r-1"}),
        ("connection %d: request id=%r failed", (3, 17), {"request_id": "17"}),
        ("id=%r", ("a\nb",), {"request_id": "'a\\nb'"}),  # escaped: as the text shows it
        # Widths, precision and flags: the value as the text shows it.
        ("took=%.2f left=%05d", (1.23456, 42), {"took": 1.23, "left": 42}),
        ("n=%x", (255,), {"n": "ff"}),
        # A mapping of arguments.
        ("query=%(q)s batch=%(b)d", ({"q": "orders", "b": 5},), {"query": "orders", "batch": 5}),
        # %% takes no argument; keys only as words of their own.
        ("100%% query=%s x.batch=%d xbatch=%d", ("q", 1, 2), {"query": "q", "xbatch": 2}),
        # The first of a repeated key wins.
        ("query=%s then query=%s", ("a", "b"), {"query": "a"}),
        # Text inside a value lifts nothing: only the format string names fields.
        ("flush query=%s: %s", ("evil batch=9", "detail group=x"), {"query": "evil batch=9"}),
        # No arguments: logging does not format the message, so no field either.
        ("flush query=%s batch=%d", (), {}),
        # Arguments that do not fit (a call site's bug): none rather than wrong ones.
        ("query=%s batch=%d", ("q",), {}),
        ("batch=%d", ("seven",), {}),
        ("width=%*d", (3, 4), {}),
        # Not finite: the text, not an invalid JSON number.
        ("delay=%.1f", (float("nan"),), {"delay": "nan"}),
    ],
)
def test_message_fields_are_the_key_value_pairs_the_text_shows(
    template: str, args: tuple[object, ...], fields: dict[str, object]
) -> None:
    # logging hands a lone mapping over as the arguments themselves
    args_in = args[0] if len(args) == 1 and isinstance(args[0], dict) else args
    assert message_fields(template, args_in) == fields


def test_a_message_that_is_not_a_string_has_no_fields() -> None:
    assert message_fields(ValueError("query=x"), ("a",)) == {}


KEYS = st.sampled_from(["query", "batch", "group", "a_b", "x"])
VALUES = st.one_of(
    st.text(max_size=12),
    st.integers(),
    st.floats(),
    st.sampled_from([None, True]),
)


@given(st.lists(st.tuples(KEYS, st.sampled_from(["%s", "%r", "%d", "%.1f"]), VALUES), max_size=6))
def test_every_lifted_value_is_text_of_the_formatted_message(
    parts: list[tuple[str, str, object]],
) -> None:
    """What keeps JSON from saying more than text: a lifted value is always a piece of the
    message the text line shows (whatever the arguments, fitting or not)."""
    template = " ".join(f"{key}={conv}" for key, conv, _ in parts)
    args = tuple(value for _, _, value in parts)
    try:
        message = template % args
    except (TypeError, ValueError, OverflowError):
        message = None
    fields = message_fields(template, args)
    if message is None:
        return  # the text line is the template: nothing is lifted from arguments that misfit
    numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", message)]
    for name, value in fields.items():
        if isinstance(value, str):
            assert value in message, (name, value, message)
        elif isinstance(value, int):  # %d
            assert str(value) in message, (name, value, message)
        else:  # %.1f: the number the text shows, perhaps spelt 1e+16
            assert value in numbers, (name, value, message)


# --- the error fields ------------------------------------------------------------------------


def test_error_fields_of_the_daemons_own_errors_and_others() -> None:
    store = StoreUnavailable("blob store down", reason="503 ServerBusy")
    assert error_fields(("orders", 3, store), None) == {
        "error": "StoreUnavailable",
        "error_code": "unavailable",
        "retriable": True,
        "reason": "503 ServerBusy",
    }
    assert error_fields((BufferUnavailable("Redis down"),), None) == {
        "error": "BufferUnavailable",
        "error_code": "unavailable",
        "retriable": True,
    }
    try:
        raise KeyError("k")
    except KeyError:
        info = sys.exc_info()
    assert error_fields(("q",), info) == {"error": "KeyError"}
    assert error_fields((store,), info)["error"] == "StoreUnavailable"  # the one in the text
    assert error_fields(("q", 1), None) == {}
    assert error_fields({"q": store}, None) == {}


# --- the JSON line ---------------------------------------------------------------------------


def test_a_json_line_has_the_fixed_fields_the_lifted_ones_and_the_error() -> None:
    exc = StoreUnavailable("blob store http://127.0.0.1/acct: 503", reason="503 ServerBusy")
    rec = record(
        "flush query=%s batch=%d failed (retry %d in %.1fs): %s",
        "orders",
        41,
        3,
        2.73,
        exc,
        level=logging.WARNING,
        retry_in_s=2.7,
        query_id="0f6c",
    )
    line = as_json(rec)
    assert list(line)[:4] == list(FIXED_FIELDS)
    assert ISO_UTC.match(line["timestamp"]), line["timestamp"]
    assert {k: v for k, v in line.items() if k != "timestamp"} == {
        "level": "WARNING",
        "logger": "sidecar.flush.flusher",
        "message": "flush query=orders batch=41 failed (retry 3 in 2.7s): "
        "blob store http://127.0.0.1/acct: 503",
        "query": "orders",
        "batch": 41,
        "error": "StoreUnavailable",
        "error_code": "unavailable",
        "retriable": True,
        "reason": "503 ServerBusy",
        "retry_in_s": 2.7,
        "query_id": "0f6c",
    }
    assert "exception" not in line


def test_a_lease_line_carries_the_lease_state() -> None:
    rec = record(
        "lease query=%s %s -> %s: %s",
        "orders",
        "HELD",
        "LOST",
        "renewal refused",
        level=logging.WARNING,
        name="sidecar.flush.lease",
        lease_state="LOST",
        query_id="0f6c",
    )
    line = as_json(rec)
    assert (line["query"], line["lease_state"], line["query_id"]) == ("orders", "LOST", "0f6c")


def test_the_exception_text_is_in_the_line() -> None:
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        rec = record("storing update query=%s batch=%d failed", "q", 2, exc_info=sys.exc_info())
    line = as_json(rec)
    assert line["error"] == "RuntimeError"
    assert line["exception"].startswith("Traceback (most recent call last):")
    assert line["exception"].endswith("RuntimeError: boom\nsecond line")


def test_only_named_extras_reach_the_line_and_no_field_replaces_a_fixed_one() -> None:
    rec = record(
        "level=%s message=%s query=%s",
        "DEBUG",
        "forged",
        "q",
        password="hunter2",  # another library's extra: not ours to publish
        lease_state="HELD",
    )
    line = as_json(rec)
    assert (line["level"], line["message"]) == ("INFO", "level=DEBUG message=forged query=q")
    assert line["query"] == "q" and line["lease_state"] == "HELD"
    assert "password" not in line and "hunter2" not in json.dumps(line)
    assert set(EXTRA_FIELDS) == {"lease_state", "query_id", "retry_in_s"}


def test_a_config_logged_whole_shows_only_its_redacted_text() -> None:
    config = Config.from_env(
        {
            "SIDECAR_REDIS_URL": "redis://user:hunter2@redis:6379/0",
            "AZURE_STORAGE_CONNECTION_STRING": "AccountName=a;AccountKey=c2VjcmV0S2V5;"
            "BlobEndpoint=http://127.0.0.1:1/a",
        }
    )
    rec = record("checkpoint-sidecar %s starting: %r", "0.1.0", config, name="sidecar.daemon.app")
    text = JsonFormatter().format(rec)
    assert "hunter2" not in text and "c2VjcmV0S2V5" not in text
    assert "redis://user:***@redis:6379/0" in json.loads(text)["message"]


def test_a_call_with_bad_arguments_still_makes_one_json_line() -> None:
    line = as_json(record("flush query=%s batch=%d %d", "q", 1, "not a number"))
    assert line["message"] == "flush query=%s batch=%d %d"  # its format string, not its arguments
    assert line["format_error"].startswith("TypeError")
    assert "query" not in line and "batch" not in line


# --- text stays the default, and what it was ---------------------------------------------------


def test_text_is_the_default_and_its_line_is_unchanged() -> None:
    assert Config.from_env({}).log_format == "text"
    text = formatter("text")
    assert text._fmt == "%(asctime)s %(levelname)s %(name)s: %(message)s"
    line = text.format(
        record("lease query=%s %s -> %s: %s", "orders", "HELD", "LOST", "x", lease_state="LOST")
    )
    assert TEXT_LINE.match(line), line
    assert line.endswith(" INFO sidecar.flush.flusher: lease query=orders HELD -> LOST: x")
    assert isinstance(formatter("json"), JsonFormatter)
    with pytest.raises(ValueError, match="logfmt"):
        formatter("logfmt")


# --- every logger, warnings and an uncaught exception: one process's stderr -----------------

PROBE = """
import logging, sys, warnings
from sidecar.telemetry import logs
logs.configure("INFO", sys.argv[1])
logging.getLogger("azure.core.pipeline.policies").info("Request URL: ...")  # below WARNING
logging.getLogger("azure.storage.blob").warning("azure %s", "said")
logging.getLogger("aiohttp.server").error("aiohttp said")
logging.getLogger("asyncio").warning("asyncio said")
logging.getLogger("sidecar.flush.flusher").debug("below INFO")
warnings.warn("a warning", UserWarning)
raise RuntimeError("uncaught")
"""


def probe(log_format: str) -> subprocess.CompletedProcess[str]:
    """``PROBE`` in a process of its own: logging is set up once per process, and pytest's
    own handlers sit on this one's root logger."""
    return subprocess.run(
        [sys.executable, "-c", PROBE, log_format],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_every_logger_goes_through_the_json_handler_and_so_do_warnings_and_crashes() -> None:
    done = probe("json")
    assert done.returncode == 1
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # each line one object
    assert [(line["logger"], line["level"]) for line in lines] == [
        ("azure.storage.blob", "WARNING"),
        ("aiohttp.server", "ERROR"),
        ("asyncio", "WARNING"),
        ("py.warnings", "WARNING"),
        ("sidecar", "CRITICAL"),
    ]
    assert lines[0]["message"] == "azure said"
    assert "UserWarning: a warning" in lines[3]["message"]
    assert lines[4]["error"] == "RuntimeError"
    assert lines[4]["exception"].endswith("RuntimeError: uncaught")


def test_text_goes_on_as_before_for_every_logger() -> None:
    done = probe("text")
    assert done.returncode == 1
    stderr = done.stderr.splitlines()
    assert all(TEXT_LINE.match(line) for line in stderr[:3]), done.stderr
    assert stderr[0].endswith(" WARNING azure.storage.blob: azure said")
    assert "UserWarning: a warning" in done.stderr  # Python's own warning and traceback lines
    assert stderr[-1] == "RuntimeError: uncaught"
