"""JSON text kept undecoded (``msgspec.Raw``): its value on demand, and the checks a decode
would have made. Pure, no I/O.

Source offsets travel as the text the client sent (``sidecar.model.checkpoint``). Decoding text into
Python values checks more than reading it as ``msgspec.Raw`` does (syntax only): that strings
are UTF-8 and that numbers fit. :func:`first_error` makes those checks without decoding text
that cannot fail them, which is what Kafka and rate offsets are.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def value(text: msgspec.Raw) -> Any:
    """The JSON value of ``text`` (None for null); for text :func:`first_error` passed, this
    does not raise."""
    return _decoder.decode(text)


def raw_of(obj: Any) -> msgspec.Raw:
    """The JSON text of a decoded value ``obj`` (None: ``null``), compact, as msgspec encodes it:
    for values built or decoded here (an admin's offsets, Spark's offsets log), never for text
    a client sent, which is kept as sent."""
    return msgspec.Raw(_encoder.encode(obj))


# What msgspec checks when it decodes a JSON value into Python values but not when it keeps
# the value's text (msgspec.Raw: syntax only): that strings are UTF-8, and that numbers fit
# (a float within a double's range, an integer of at most 4,300 digits). Only text that could
# fail those checks is decoded to check it: non-ASCII text, a number with a fraction or an
# exponent, a digit run that long. Kafka and rate offsets (ASCII names, integers) are none
# of those, so checking them costs a few scans of their bytes, not a decode.
_EXPONENT = re.compile(rb"e[-+0-9]")  # separate patterns: a literal first byte scans fastest
_EXPONENT_UPPER = re.compile(rb"E[-+0-9]")
_MAX_INT_DIGITS = 4300
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"0" * 9)


def _plain(text: bytes) -> bool:
    """True when ``text`` (JSON) surely passes a decode into values: see above."""
    return (
        text.isascii()
        and b"." not in text
        and _EXPONENT.search(text) is None
        and (b"E" not in text or _EXPONENT_UPPER.search(text) is None)
        and (
            len(text) <= _MAX_INT_DIGITS
            or b"0" * (_MAX_INT_DIGITS + 1) not in text.translate(_DIGITS_TO_ZERO)
        )
    )


def first_error(
    groups: Iterable[Sequence[msgspec.Raw]],
) -> msgspec.DecodeError | UnicodeDecodeError | None:
    """The error decoding these texts into values would raise (invalid UTF-8 in a string, a
    number out of range), or None when they decode: their JSON syntax was checked when they
    were read, this checks the rest, decoding only text that could fail. ``groups``: e.g. each
    source's (start, end, latest) offsets, checked together."""
    for texts in groups:
        if _plain(b"".join(texts)):
            continue
        for text in texts:
            try:
                _decoder.decode(text)
            except (msgspec.DecodeError, UnicodeDecodeError) as exc:
                return exc
    return None
