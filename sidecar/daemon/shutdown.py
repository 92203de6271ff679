"""The stop's time budget: how ``SIDECAR_SHUTDOWN_GRACE_S`` (G) is shared by its phases.

The phases run in order, each until its own deadline, a fixed share of G counted from the
stop request::

    0 ── drain ──▶ 0.4 G ── final flush ──▶ 0.8 G ── final commit ──▶ 0.9 G ── release ──▶ G

- *drain*: stop accepting and reading, answer the requests already read;
- *final flush*: stop the flush loop, the Kafka commit loop and the Event Hubs checkpoint
  loop (and wait for them), then write every pending update to its blob;
- *final commit*: commit each consumer group's last durable offsets (one consumer per group:
  the commit loop no longer runs), and write the Event Hubs checkpoints not yet written;
- *release*: release every blob lease, so a successor need not wait for it to expire.

A phase that ends early leaves its time to the next; one that overruns is cut at its
deadline. So however long the drain takes (a client that never reads its replies can hold
it up indefinitely), the final flush keeps at least 40 % of G, the final commit and the
release 10 % each: with the default 20 s, 8 s, 2 s and 2 s. Closing the clients (Redis, the
blob store, Kafka) then takes at most :data:`CLOSE_BUDGET_S` more.

The last three are finalizers: they run shielded from outside cancellation (a crashing
component cancelling the daemon's task group cannot cut them short), limited only by their
own deadline, or by :meth:`StopBudget.force` (a second signal). The caller logs what a cut
phase left undone; :meth:`StopBudget.summary` is the stop's one closing line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio

#: Where each phase must have ended, as a share of the grace period, in order.
PHASES: dict[str, float] = {
    "drain": 0.4,
    "final flush": 0.8,
    "final commit": 0.9,
    "release": 1.0,
}
#: Closing the clients after the last phase: local work, so a small fixed time.
CLOSE_BUDGET_S = 1.0


@dataclass(frozen=True)
class PhaseTime:
    name: str
    seconds: float
    cut: bool


class StopBudget:
    """The deadlines of one stop, counted from its start; each phase in its own cancel scope."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.started = anyio.current_time()
        self.phases: list[PhaseTime] = []
        self._running: set[anyio.CancelScope] = set()
        self._forced = False

    def until(self, phase: str) -> float:
        """Seconds from the stop's start to the phase's deadline."""
        return PHASES[phase] * self.grace_s

    def deadline(self, phase: str) -> float:
        return self.started + self.until(phase)

    def plan(self) -> str:
        """The deadlines, for the log: ``drain until 8.0s, final flush until 16.0s, …``."""
        return ", ".join(f"{name} until {self.until(name):.1f}s" for name in PHASES)

    @contextmanager
    def phase(self, name: str) -> Iterator[anyio.CancelScope]:
        """Run the ``with`` body until the phase's deadline; the scope's ``cancelled_caught``
        says it was cut (by its deadline or :meth:`force`)."""
        began = anyio.current_time()
        scope = anyio.CancelScope()
        try:
            with self._scope(deadline=self.deadline(name)) as scope:
                yield scope
        finally:  # also when a forced stop's cancellation passes through
            cut = scope.cancelled_caught or scope.cancel_called
            self.phases.append(PhaseTime(name, anyio.current_time() - began, cut))

    @contextmanager
    def finalizers(self) -> Iterator[None]:
        """Shield the phases run in the ``with`` body from outside cancellation (only their
        deadlines and :meth:`force` cut them), including the code between them."""
        with self._scope(shield=True):
            yield

    @contextmanager
    def closing(self) -> Iterator[None]:
        """Closing the clients: shielded, at most :data:`CLOSE_BUDGET_S`, even when forced."""
        deadline = anyio.current_time() + CLOSE_BUDGET_S
        with anyio.CancelScope(deadline=deadline, shield=True) as scope:
            began = anyio.current_time()
            try:
                yield
            finally:
                took = anyio.current_time() - began
        self.phases.append(PhaseTime("close", took, scope.cancelled_caught))

    @contextmanager
    def _scope(self, **kwargs: Any) -> Iterator[anyio.CancelScope]:
        scope = anyio.CancelScope(**kwargs)
        if self._forced:
            scope.cancel()
        self._running.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._running.discard(scope)

    def force(self) -> None:
        """Cut the running phase and every later one, now (a forced stop)."""
        self._forced = True
        for scope in list(self._running):
            scope.cancel()

    def summary(self) -> str:
        """``stopped in 1.23s (grace 20.0s): drain 0.01s, final flush 1.10s (cut), …``."""
        took = anyio.current_time() - self.started
        phases = ", ".join(
            f"{p.name} {p.seconds:.2f}s{' (cut)' if p.cut else ''}" for p in self.phases
        )
        return f"stopped in {took:.2f}s (grace {self.grace_s:.1f}s): {phases}"
