"""Unreadable records the flusher leaves alone: each counted and logged once, until readable.

A record (a query's Redis hash or its blob) written by another version, cut short or edited
by hand raises :class:`~sidecar.errors.CorruptRecord`; it is left as it is and not flushed,
counted once in ``checkpoint_sidecar_bad_records_total{where}`` and logged once by the
flusher, until a read finds it readable again (replaced by a newer batch, or deleted).
"""

from __future__ import annotations

import logging

from sidecar.errors import CorruptRecord
from sidecar.telemetry.metrics import Metrics

log = logging.getLogger(__name__)


class Quarantine:
    """Unreadable records by query id: {where: Redis key or blob name}."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._records: dict[str, dict[str, str]] = {}

    def __contains__(self, query_id: object) -> bool:
        return query_id in self._records

    def add(self, query_id: str, exc: CorruptRecord) -> bool:
        """Count an unreadable record once; True the first time (the caller logs it)."""
        records = self._records.setdefault(query_id, {})
        if records.get(exc.where) == exc.key:
            return False
        records[exc.where] = exc.key
        self._metrics.bad_records.labels(exc.where).inc()
        return True

    def readable(self, query_id: str, where: str) -> None:
        """The query's record in ``where`` was read fine: out of quarantine, if it was in."""
        records = self._records.get(query_id)
        if records is None:
            return
        key = records.pop(where, None)
        if key is not None:
            log.info("query=%s: %s %s is no longer unreadable", query_id, where, key)
        if not records:
            del self._records[query_id]

    def in_redis(self) -> list[str]:
        """Queries whose Redis record is quarantined."""
        return [query_id for query_id, records in self._records.items() if "redis" in records]
