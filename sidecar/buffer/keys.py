"""Every Redis key the daemon uses, in one place.

All keys of one namespace share the hash tag ``{<namespace>}``, so they live in one Redis
Cluster slot and every Lua script can touch all of them atomically. One namespace is one
Spark application (one sidecar), so a slot per namespace spreads well across a cluster.

    cps:{<ns>}:q:<query_id>   hash   latest checkpoint and flush bookkeeping of one query
                                     batch_id          canonical decimal batch id
                                     checkpoint        checkpoint JSON (sidecar.model.checkpoint)
                                     version           +1 on every applied update
                                     pending           applied updates since the last flush
                                     first_pending_ms  Redis time of the oldest unflushed one
                                     updated_ms        Redis time of the newest applied one
                                     flushed_batch_id  last batch durable in the blob
                                     flushed_ms        Redis time of the last flush
                                     flushed_reset     reset record (reset_at, "": none) of
                                                       the document flushed_batch_id is in
                                     flushed_version   the blob's ETag that flush left
                                                       ("": not known; the audit's reference)
    cps:{<ns>}:pending        zset   query ids with pending updates, scored by first_pending_ms
    cps:{<ns>}:queries        set    every query id ever seen in the namespace
    cps:{<ns>}:names          hash   query name -> id of the newest query with that name
    cps:{<ns>}:restores       hash   query id -> its last restore's figures (JSON,
                                     sidecar.model.restored; the daemon exports them)
    cps:{<ns>}:marker         string set once, shared by its daemons (sidecar.daemon.durability)
    cps:{<ns>}:probe          string written by readiness checks and before WAIT (expires)
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "cps"


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names for one namespace (validated by ``sidecar.config.settings``: no braces inside)."""

    namespace: str

    @property
    def _base(self) -> str:
        return f"{PREFIX}:{{{self.namespace}}}"

    def query(self, query_id: str) -> str:
        """Hash holding one query's latest checkpoint and its flush bookkeeping."""
        return f"{self.query_prefix}{query_id}"

    @property
    def query_prefix(self) -> str:
        """Prefix of every query hash (scripts append the query id)."""
        return f"{self._base}:q:"

    @property
    def pending(self) -> str:
        """Sorted set of query ids with unflushed updates, scored by first_pending_ms."""
        return f"{self._base}:pending"

    @property
    def names(self) -> str:
        """Hash: query name -> id of the query that most recently reported under that name."""
        return f"{self._base}:names"

    @property
    def marker(self) -> str:
        """A token written at start: its loss means Redis lost the namespace's data."""
        return f"{self._base}:marker"

    @property
    def probe(self) -> str:
        """Written to check that the namespace's node takes writes, and to order a WAIT."""
        return f"{self._base}:probe"

    @property
    def queries(self) -> str:
        """Set of every query id seen in the namespace."""
        return f"{self._base}:queries"

    @property
    def restores(self) -> str:
        """Hash: query id -> what its last restore wrote (``sidecar.model.restored``)."""
        return f"{self._base}:restores"
