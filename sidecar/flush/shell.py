"""What the I/O shell (``blob_state``, ``lease_manager``) keeps of each query: its locks and
the flags of calls under way, on the query's record (``sidecar.flush.core.QueryState.shell``),
so that they go with it when the query is retired — no map of their own to keep in step."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio


@dataclass(slots=True)
class QueryShell:
    """One query's part of the shell. The core never reads it."""

    #: Held by each flush and by each admin op (never both at once).
    flush: anyio.Lock = field(default_factory=anyio.Lock)
    #: One floor read at a time; concurrent updates share it.
    floor: anyio.Lock = field(default_factory=anyio.Lock)
    #: The lease's (``sidecar.flush.lease_manager``): its calls, one at a time.
    lease: anyio.Lock = field(default_factory=anyio.Lock)
    #: A renewal, re-acquisition or release of the lease under way in the lease loop.
    renewing: bool = False
    #: The ``checkpoint_sidecar_lease_held_elsewhere`` series shown for the query (label,
    #: who last wrote its blob) while another daemon holds its lease.
    elsewhere: tuple[str, str] | None = None
