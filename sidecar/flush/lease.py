"""The lease on one query's blob, as a state machine. Pure: the calls to the store are
``sidecar.flush.lease_manager``'s, which tells each outcome to the flush core as an event
(``LeaseAcquired``, ``LeaseRenewed``, ``LeaseLapsed``, ``LeaseLetGo``, …:
``sidecar.flush.events``); the core's ``step`` moves the lease here and, in the same step,
what the record knows of the blob (a lease lost forgets it; one acquired checks it). Each
lease hangs off its query's record in ``sidecar.flush.core`` (retiring a query removes both
at once).

Invariant: **a checkpoint blob is written only while its lease is HELD.** A writer gets a
:class:`Held` (the query and its term) only in HELD and only while the lease is known to be
valid (renewed in time); right before it writes, the manager checks that the same term is
still HELD and valid. Every write also carries the lease id, so the store itself refuses a
stale owner, and names the blob's version (``If-Match``), so the store refuses a write of
any owner that did not see the blob's latest state (``sidecar.flush.core``).

States and transitions (anything else raises :class:`IllegalTransition`)::

    ACQUIRING ──acquired──────────▶ HELD ──renewed──▶ HELD
        │                            │
        │ another owner / store down │ renewal or write refused, or its validity ran out
        ▼                            ▼
       LOST ◀────────────────────────┘
        │ backoff elapsed
        └──────────▶ ACQUIRING
    ACQUIRING | HELD | LOST ──release (shutdown, retired)──▶ RELEASED (final)

A retired query's lease is released and dropped with its record: if the query writes again,
a new lease starts in ACQUIRING.

Each acquisition starts a new **term**. A write planned under one term is not made under
another (someone else may have held the lease between them).

LOST is "not owned": nothing is written, updates stay buffered in Redis. It is *contested*
when the store said so (another lease holds the blob, or ours was broken) rather than
because the store did not answer: ``/readyz`` and ``checkpoint_sidecar_lease_held_elsewhere``
report contested leases, and blob-mode acks of such a query are answered ``not_owner`` at
once (``sidecar.flush.blob_state``).

Validity is a timer: a lease whose last successful acquire or renew started more than its
duration minus :data:`EXPIRY_MARGIN_S` ago is LOST within :data:`CHECK_EVERY_S`, also while its
renewal hangs.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("sidecar.flush.lease")

#: A lease is treated as lost this long before it would expire without a renewal, so a
#: write never starts on a lease that may lapse while the request is in flight.
EXPIRY_MARGIN_S = 3.0
#: How often the manager's loop looks at its leases: a lease whose validity ran out is LOST
#: (metrics, ``/readyz``) within this long, and due renewals and retries start within it.
CHECK_EVERY_S = 0.25
#: A renewal that failed without being refused (store unreachable, timed out) is tried again
#: this soon, while the lease may still be valid.
RENEW_RETRY_S = 1.0
#: Each renewal comes after the renewal interval (a third of the duration) times a random
#: factor within ±this share: 1,000 leases acquired together (queries started at once) then
#: renew spread over half the interval the first time, and drift further apart each round,
#: instead of 1,000 blob calls in the same instant every interval. The mean stays one
#: interval (no extra blob transactions); the latest renewal, at 5/12 of the duration,
#: leaves a 15 s lease (the shortest) 5.75 s of validity for retries of a failed one.
RENEW_JITTER = 0.25


def renew_delay(interval_s: float, rand: float) -> float:
    """Seconds from a successful acquire or renewal to the next renewal: ``interval_s``
    scaled by a factor in [1 - RENEW_JITTER, 1 + RENEW_JITTER), ``rand`` in [0, 1)."""
    return interval_s * (1 - RENEW_JITTER + 2 * RENEW_JITTER * rand)


class LeaseState(enum.Enum):
    ACQUIRING = "acquiring"
    HELD = "held"
    LOST = "lost"
    RELEASED = "released"


_ALLOWED: dict[LeaseState, frozenset[LeaseState]] = {
    LeaseState.ACQUIRING: frozenset({LeaseState.HELD, LeaseState.LOST, LeaseState.RELEASED}),
    LeaseState.HELD: frozenset({LeaseState.HELD, LeaseState.LOST, LeaseState.RELEASED}),
    LeaseState.LOST: frozenset({LeaseState.ACQUIRING, LeaseState.RELEASED}),
    LeaseState.RELEASED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A lease was asked to make a move the state table does not allow (a bug)."""


@dataclass(frozen=True, slots=True)
class Held:
    """A lease as the manager's ``ensure_held`` returned it: a write planned under it is made
    only while the manager's ``holds`` says the same term is still held."""

    query_id: str
    term: int


@dataclass(frozen=True, slots=True)
class Ownership:
    """This daemon's hold on a query's lease under one ``term``, as a check to make right
    before a write that must be the owner's: calling it says whether that term is still held.
    What was learnt of the query's blobs under another term may be stale (another owner may
    have written or deleted them in between)."""

    term: int
    holds: Callable[[], bool]

    def __call__(self) -> bool:
        return self.holds()


class QueryLease:
    """The lease on one query's blob, as this daemon sees it. Its fields change only through
    its methods, each a move of the state table."""

    __slots__ = (
        "contested",
        "failures",
        "label",
        "query_id",
        "renew_at",
        "retry_at",
        "state",
        "term",
        "valid_until",
    )

    def __init__(self, query_id: str, label: str) -> None:
        self.query_id = query_id
        self.label = label
        self.state = LeaseState.ACQUIRING
        #: Monotonic time after which the lease may have lapsed (valid while HELD).
        self.valid_until = 0.0
        #: Monotonic time of the next renewal (while HELD).
        self.renew_at = 0.0
        #: Monotonic time of the next acquisition attempt (while LOST).
        self.retry_at = 0.0
        #: Failed acquisitions (or losses) in a row.
        self.failures = 0
        #: The current acquisition (0: never acquired).
        self.term = 0
        #: Not owned because the store said so (another lease holds the blob, or ours was
        #: broken), rather than because the store did not answer.
        self.contested = False

    def __repr__(self) -> str:
        return f"QueryLease({self.label}, {self.state.name}, term {self.term})"

    def _to(self, new: LeaseState, reason: str) -> None:
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(f"lease of {self.label}: {self.state.name} -> {new.name}")
        if new is not self.state:
            level = logging.WARNING if new is LeaseState.LOST else logging.INFO
            log.log(
                level,
                "lease query=%s %s -> %s: %s",
                self.label,
                self.state.name,
                new.name,
                reason,
                extra={"lease_state": new.name, "query_id": self.query_id},  # JSON logs
            )
        self.state = new

    # --- questions --------------------------------------------------------------------------

    def valid(self, now: float) -> bool:
        """HELD and within its validity."""
        return self.state is LeaseState.HELD and now < self.valid_until

    def not_owned(self) -> bool:
        """Wanted but not held: LOST, or being re-acquired after a loss (a first acquisition
        is not a failure)."""
        return self.state is LeaseState.LOST or (
            self.state is LeaseState.ACQUIRING and self.failures > 0
        )

    def held_elsewhere(self) -> bool:
        """Not owned, and the store said so: another lease holds the blob, or ours was broken."""
        return self.contested and self.not_owned()

    # --- moves --------------------------------------------------------------------------------

    def acquiring(self, reason: str) -> None:
        """LOST → ACQUIRING: try again (its backoff elapsed, or at once)."""
        self._to(LeaseState.ACQUIRING, reason)

    def acquired(self, term: int, started: float, duration_s: float, renew_in_s: float) -> None:
        """The store granted it: HELD under a new ``term``, valid from ``started`` (when the
        call began) for the duration minus :data:`EXPIRY_MARGIN_S`."""
        self.valid_until = started + duration_s - EXPIRY_MARGIN_S
        self.renew_at = started + renew_in_s
        self.failures, self.contested = 0, False
        self.term = term
        self._to(LeaseState.HELD, f"acquired for {duration_s:g}s")

    def renewed(self, started: float, duration_s: float, renew_in_s: float) -> bool:
        """A renewal begun at ``started`` succeeded: the validity is extended, only while
        still HELD (one that expired meanwhile must go through ACQUIRING: no LOST → HELD).
        Whether it was."""
        if self.state is not LeaseState.HELD:
            return False
        self.valid_until = max(self.valid_until, started + duration_s - EXPIRY_MARGIN_S)
        self.renew_at = started + renew_in_s
        return True

    def renew_again_at(self, when: float) -> None:
        """A renewal failed without being refused: try again at ``when`` (still HELD while
        valid)."""
        self.renew_at = when

    def lost(
        self,
        reason: str,
        now: float,
        backoff: Callable[[int], float] | None = None,
        *,
        contested: bool = False,
    ) -> bool:
        """Not owned any more (refused, expired, or never granted): LOST, retried after
        ``backoff(failures in a row)`` seconds (None: at once). Whether this was a change (a
        LOST lease stays as it was, but for ``contested``)."""
        self.contested = contested
        if self.state is LeaseState.LOST:
            return False
        self.failures += 1
        self.retry_at = now if backoff is None else now + backoff(self.failures)
        self._to(LeaseState.LOST, reason)
        return True

    def released(self, reason: str) -> None:
        """Let go (shutdown, retired): RELEASED, final."""
        if self.state is not LeaseState.RELEASED:
            self._to(LeaseState.RELEASED, reason)
