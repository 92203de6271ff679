"""A counting HTTP proxy in front of Azurite: every Blob REST request, by kind and operation
(:func:`bench.fleetmodel.classify_request`), and how many were answered with status >= 400.

It is the fault proxy of the tests (``tests/faults/store_proxy.py``) with no fault set: each
request forwarded on an upstream connection of its own, on the proxy's own event loop in a
thread; this class only tallies what it answered. :meth:`counts` copies the tallies under a
lock at any time.
"""

from __future__ import annotations

import threading
from collections import Counter

from bench.fleetmodel import classify_request
from tests.faults.store_proxy import StoreFaultProxy


class CountingProxy(StoreFaultProxy):
    """``with CountingProxy(azurite.port) as proxy:`` — requests are counted as they are
    answered."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()
        self._failed: Counter[tuple[str, str]] = Counter()

    def counts(self) -> tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]]:
        """Copies of (answered, answered with status >= 400), by (kind, operation)."""
        with self._lock:
            return Counter(self._counts), Counter(self._failed)

    def answered(self, method: str, target: str, headers: dict[str, str], response: bytes) -> None:
        key = classify_request(method, target, headers)
        failed = _status(response) >= 400
        with self._lock:
            self._counts[key] += 1
            if failed:
                self._failed[key] += 1


def _status(response: bytes) -> int:
    """The status code of a response (``HTTP/1.1 201 Created``); 599 when unreadable."""
    parts = response.split(b"\r\n", 1)[0].split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 599
