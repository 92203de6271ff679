"""The daemon's log lines on stderr: text (the default) or JSON, one object per line
(``SIDECAR_LOG_FORMAT``). Every logger goes through the one root handler set up here — the
daemon's own, asyncio's, aiohttp's, the Azure SDK's (kept at WARNING or above) — so neither
format misses a line another format would show.

Text, as it always was: ``2026-11-21 10:00:00,123 WARNING sidecar.flush.lease: lease
query=orders HELD -> LOST: renewal refused: ...``.

JSON: ``timestamp`` (ISO 8601, UTC, milliseconds), ``level``, ``logger``, ``message`` (the
text line's message, unchanged), then the fields below, then ``exception`` (the traceback, as
the text line would append it) when there is one. A call whose arguments do not fit its
message (a bug) still makes one line: its format string as ``message``, ``format_error``.

* **Lifted from the message** (:func:`message_fields`): each ``key=%s`` of a call's %-style
  message — the convention call sites keep so that operators can grep (``query=%s``,
  ``batch=%d``, ``group=%s``, ``namespace=%s``, ...) — becomes the field ``key`` with the
  value the text shows for it (``%d`` as a number). The message stays the one source of
  truth: a call site names a field by writing it into its message. Only keys written in the
  call's format string count, never text inside a value (a query named ``x batch=9`` lifts
  no ``batch``). ``id=`` (a request id) is lifted as ``request_id``.
* **From the exception** logged or passed as an argument (:func:`error_fields`): ``error``
  (its class), and for the daemon's own errors ``error_code`` (what a client is answered),
  ``retriable`` and, for a store failure, ``reason`` (``timeout``, ``connection``, ``503
  ServerBusy``).
* **Passed as ``extra=``** where the text has a value without a key (a lease's new state, the
  delay before a retry) or names a query without its id: only the names in
  :data:`EXTRA_FIELDS` (``lease_state``, ``query_id``, ``retry_in_s``).

Secrets: a lifted value is the very text the message shows, the error fields are class
attributes and a fixed vocabulary, the extras are ids, states and delays, and no other
attribute of a record (its raw arguments, another library's ``extra``) reaches the line. So a
JSON line shows no secret its text line does not, and the text shows none (connection strings
are never logged; Redis URLs and a logged ``Config`` are redacted by ``sidecar.config``).

Stdlib only: ``sidecar.cli.main`` sets logging up for every command, also in an install
without the daemon's dependencies. Why not python-json-logger: it publishes every attribute a
record carries unless listed as reserved (a deny list, where secrets want an allow list), its
format-string field selection does not reach the message's ``key=`` pairs (this module's job
either way), and it would have to come with the base install; what is left is a dict dumped
per record.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import IO, Any

from sidecar.errors import SidecarError

#: The text format (unchanged since the first release: tests and operators grep it).
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Every JSON line has these, in this order; no lifted or extra field replaces one.
FIXED_FIELDS = ("timestamp", "level", "logger", "message")
#: Values a call site passes with ``extra=`` that its text shows without a ``key=``.
EXTRA_FIELDS = ("lease_state", "query_id", "retry_in_s")
#: A key whose name in the text would be ambiguous in a record of fields.
_RENAMED = {"id": "request_id"}

Scalar = str | int | float | bool

# One %-conversion: mapping key, flags, width, precision, length modifier, conversion.
_SPEC = re.compile(
    r"%(?:\((?P<key>[^)]*)\))?(?P<flags>[#0 +-]*)(?P<width>\*|\d+)?(?:\.(?P<precision>\*|\d+))?"
    r"[hlL]?(?P<conv>[diouxXeEfFgGcrsa%])"
)
# ``key=`` right before a conversion, the key a word of its own (not ``x.key=``, ``xkey=``).
_KEY_BEFORE = re.compile(r"(?<![\w.])(?P<name>[A-Za-z_]\w*)=$")


def message_fields(template: object, args: object) -> dict[str, Scalar]:
    """The ``key=%x`` fields of a %-style message: ``{key: the text shown for %x}``, numbers
    for ``%d``/``%i``/``%u`` and finite ``%f``/``%e``/``%g``. The first of a repeated key
    wins; a message without arguments (logging does not format it) or whose arguments do not
    fit its format has none. Pure."""
    if not isinstance(template, str) or not args:
        return {}
    fields: dict[str, Scalar] = {}
    position = 0
    for spec in _SPEC.finditer(template):
        if spec["conv"] == "%":
            continue
        if "*" in (spec["width"], spec["precision"]):
            return {}  # the width is an argument: positions are not worth guessing
        if isinstance(args, Mapping) and spec["key"] is not None:
            if spec["key"] not in args:
                return {}
            value = args[spec["key"]]
        elif isinstance(args, tuple) and position < len(args):
            value = args[position]
            position += 1
        else:
            return {}
        named = _KEY_BEFORE.search(template, 0, spec.start())
        if named is None:
            continue
        name = _RENAMED.get(named["name"], named["name"])
        bare = "%" + (spec["flags"] or "") + (spec["width"] or "")
        bare += f".{spec['precision']}" if spec["precision"] is not None else ""
        try:
            shown = (bare + spec["conv"]) % (value,)
        except (TypeError, ValueError, OverflowError):
            return {}
        fields.setdefault(name, _typed(shown, spec["conv"], value))
    return fields


def _typed(shown: str, conv: str, value: object) -> Scalar:
    if conv in "diu":
        return int(shown)
    if conv in "eEfFgG":
        number = float(shown)
        return number if math.isfinite(number) else shown
    if conv == "r" and isinstance(value, str) and shown[1:-1] == value:
        return value  # the text shows it quoted (and nothing escaped)
    return shown


def error_fields(args: object, exc_info: object) -> dict[str, Scalar]:
    """``error``, and for the daemon's own errors ``error_code``, ``retriable`` and a store
    failure's ``reason``, of the first exception among ``args``, else of ``exc_info``. Pure."""
    found = [a for a in args if isinstance(a, BaseException)] if isinstance(args, tuple) else []
    if not found and isinstance(exc_info, tuple) and isinstance(exc_info[1], BaseException):
        found = [exc_info[1]]
    if not found:
        return {}
    exc = found[0]
    fields: dict[str, Scalar] = {"error": type(exc).__name__}
    if isinstance(exc, SidecarError):
        fields["error_code"] = exc.code
        fields["retriable"] = exc.retriable
        if isinstance(reason := getattr(exc, "reason", None), str):
            fields["reason"] = reason
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (see the module docstring for the fields)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
        }
        lifted: dict[str, Scalar] = {}
        try:
            line["message"] = record.getMessage()
            lifted = message_fields(record.msg, record.args)
        except Exception as exc:  # a call site's bad arguments: its format string, not them
            line["message"] = str(record.msg)
            line["format_error"] = f"{type(exc).__name__}: {exc}"
        extra = {n: v for n in EXTRA_FIELDS if (v := getattr(record, n, None)) is not None}
        for fields in (lifted, error_fields(record.args, record.exc_info), extra):
            for name, value in fields.items():
                line.setdefault(name, _scalar(value))  # the fixed ones, then the first wins
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


def _scalar(value: object) -> Scalar:
    if isinstance(value, bool | int | str) or (isinstance(value, float) and math.isfinite(value)):
        return value
    return str(value)


def formatter(log_format: str) -> logging.Formatter:
    """The formatter of ``SIDECAR_LOG_FORMAT``: ``text`` or ``json``."""
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"unknown log format {log_format!r}")


def configure(level: str, log_format: str, stream: IO[str] | None = None) -> None:
    """Send every logger's records at ``level`` or above to ``stream`` (stderr) in
    ``log_format``; the Azure SDK's only from WARNING (it logs each HTTP request at INFO).

    In JSON, Python's warnings and an uncaught exception are logged too, so that every line
    on stderr parses (``sidecar.cli.main`` prints a configuration it cannot read as plain
    text: that comes before the format is known).
    """
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(formatter(log_format))
    logging.basicConfig(level=level, handlers=[handler])
    # The Azure SDK logs every HTTP request at INFO; keep the daemon's own lines readable.
    logging.getLogger("azure").setLevel(max(logging.WARNING, logging.getLevelName(level)))
    if log_format == "json":
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("sidecar").critical("uncaught exception; exiting", exc_info=(kind, exc, tb))
