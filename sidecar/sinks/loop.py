"""The commit loop every position sink runs (Kafka groups: ``sidecar.kafka.committer``; Event
Hubs checkpoints: ``sidecar.eventhubs.checkpointer``): told of each durable checkpoint, it
writes each consumer group's positions from a loop of its own, and once more at the stop. A
sink subclasses :class:`SinkLoop` with its edge: which group and positions a checkpoint gives
(then :meth:`SinkLoop._take`) and one commit of a group (:meth:`SinkLoop._write`).

Invariants (each sink's module says what they mean at its edge):
- only positions **durable in the blob** are written: a sink's ``durable`` is called after a
  blob write, never before (a reset by the daemon, after its own);
- a group's commits run **one at a time**: a pass waits for them all, and the final commit
  runs after the loop stopped (:meth:`SinkLoop.stop_loop`). ``durable`` only replaces what the
  next commit writes: a commit writes what its group held when it began (:class:`Attempt`),
  and leaves the group dirty (for the next pass, and the final commit) when ``durable``
  replaced it meanwhile;
- a deliberate rewind stays pending until a commit made with it has succeeded: a commit that
  began before it never clears it, a newer durable checkpoint of the same query keeps it, a
  checkpoint of another query under the same name drops it. A rewind makes the next commit
  read the store's view again, so it lowers what is there now (and says so);
- partitions another writer moved since this one knew them (``held``) are left as that
  writer set them until the query's next durable checkpoint (``sidecar.model.positions``); a
  checkpoint told again (the same query and batch: a flush that found the blob holding what
  it wrote, maybe from memory while a twin had just reset it) is nothing newer;
- a retired query's groups are dropped between passes (never under a commit in flight), once
  what is durable is written, unless another query id has used them since;
- a sink never blocks flushing and never raises for its edge's sake: a failed commit is
  counted, logged and retried with backoff per group (0.5 s doubling to the sink's cap; an
  error that is not ``retriable`` waits the cap at once), anything unexpected contained and
  logged once with its traceback per failure streak (``sidecar.backoff.Retries``); the store's
  view is read again before the next commit.
"""

from __future__ import annotations

import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import anyio
from anyio.abc import TaskStatus

from sidecar.backoff import Retries, next_tick
from sidecar.model import positions
from sidecar.model.checkpoint import Checkpoint
from sidecar.sinks.report import Reporter

#: The first retry of a failed commit, doubling to the sink's cap.
RETRY_BASE_S = 0.5

K = TypeVar("K", bound=Hashable)


@dataclass
class SinkGroup(Generic[K]):
    """One query's consumer group as every sink keeps it; a sink adds what it knows of the
    store's view. ``K``: what the sink reads of that view at a time (``fetched``)."""

    name: str
    checkpoint: Checkpoint
    #: (topic or event hub, partition) → the position durable in the blob, to be written.
    wanted: positions.Positions
    #: ``wanted`` not written yet, as far as a commit that succeeded says.
    dirty: bool = True
    #: A deliberate rewind not yet written (it lowers what the store holds).
    rewind: positions.Rewind | None = None
    #: Partitions another writer moved since we knew them: not moved again by ``wanted``.
    held: set[tuple[str, int]] = field(default_factory=set)
    #: What of the store's view was read since the last failure or rewind (Kafka: partitions;
    #: Event Hubs: event hubs); the rest is read before the next write.
    fetched: set[K] = field(default_factory=set)


G = TypeVar("G", bound=SinkGroup[Any])


class PositionSink(Protocol):
    """Where Spark's durable positions are held for lag and autoscaling tools, beside the
    checkpoint: Kafka consumer groups (``kafka.committer``), Event Hubs checkpoints
    (``eventhubs.checkpointer``); the daemon holds a list of them. Told of each durable
    checkpoint; a loop of its own; a final commit at the stop (:class:`SinkLoop` is each)."""

    FINAL: str
    NOT_DONE: str

    def durable(self, checkpoint: Checkpoint, *, rewind: str | None = None) -> None: ...
    def forget(self, query_id: str) -> None: ...
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None: ...
    async def stop_loop(self) -> None: ...
    async def final_commit(self) -> None: ...
    def behind(self) -> list[str]: ...
    async def aclose(self) -> None: ...


@dataclass
class Attempt:
    """One commit of a group, from the group as it was when the commit began (``durable`` may
    replace the group's meanwhile, never these), and what the commit decided and wrote."""

    checkpoint: Checkpoint
    wanted: positions.Positions
    rewind: positions.Rewind | None
    #: Of what was decided to be written, the partitions a rewind lowers on purpose.
    rewound: list[positions.Move] = field(default_factory=list)
    #: What a rewind could not lower, in the sink's words (the end of its line), or "".
    kept: str = ""
    #: The partitions written: all decided on success, some after a partial failure.
    done: set[tuple[str, int]] = field(default_factory=set)

    def say_rewound(self, group: str, reporter: Reporter) -> None:
        """Say what this commit lowered on purpose (what landed of a rewind), if a rewind."""
        if self.rewind is not None:
            lowered = [move for move in self.rewound if move.key in self.done]
            reporter.rewound(group, self.checkpoint, self.rewind, lowered, self.kept)


class SinkLoop(ABC, Generic[G]):
    """A sink's groups by name and the loop that commits them (a :class:`PositionSink`)."""

    #: The stop's words for its final commit, and for a group it did not bring to the query's
    #: last durable batch (``sidecar.daemon.app``).
    FINAL: str
    NOT_DONE: str

    def __init__(
        self,
        reporter: Reporter,
        group_type: Callable[[str, Checkpoint, positions.Positions], G],
        *,
        tick_s: float,
        retry_cap_s: float,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        """``group_type``: a new group of the sink's (name, checkpoint, positions); ``tick_s``:
        a pass at least this often; ``retry_cap_s``: the longest backoff; ``clock``,
        ``jitter``: of the retries (a simulation's: virtual time, no randomness)."""
        self._report = reporter
        self._group_type = group_type
        self._tick_s = tick_s
        self._backoff = Retries(RETRY_BASE_S, retry_cap_s, clock=clock, jitter=jitter)
        # By group name: a query restarted under the same name (new id) shares its group, so
        # only the newest checkpoint is written and the backwards check covers both.
        self._groups: dict[str, G] = {}
        self._wake = anyio.Event()
        #: Retired queries whose groups the loop drops.
        self._retiring: set[str] = set()
        self._loop = anyio.CancelScope()
        #: The loop's passes so far (tests and debugging wait on it, not on a fixed time).
        self.passes = 0
        self._loop_done = anyio.Event()

    def forget(self, query_id: str) -> None:
        """A retired query: the loop drops its groups between passes (never under a commit
        in flight) once what is durable is written, unless another id has used them since."""
        self._retiring.add(query_id)
        self._wake.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Write what is durable, every tick or when woken, until cancelled. Never raises for
        the edge's sake: every failure is logged, counted and retried."""
        await self._prepare()
        task_status.started()
        try:
            with self._loop:
                while True:
                    with anyio.CancelScope(deadline=next_tick(anyio.current_time(), self._tick_s)):
                        await self._wake.wait()
                    self._wake = anyio.Event()
                    await self._retire()
                    async with anyio.create_task_group() as tg:
                        for group in self._groups.values():
                            if self._due(group) and self._backoff.ready(group.name):
                                tg.start_soon(self._commit, group)
                    await self._after_pass()
                    self.passes += 1
        finally:
            self._loop_done.set()
            if not self._loop.cancel_called:
                # Cancelled with the daemon rather than stopped for the final commit (whose
                # caller closes the clients after it): close them here, briefly.
                with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                    await self.aclose()

    async def stop_loop(self) -> None:
        """Stop the loop and wait for it (a commit in progress is cancelled), so the final
        commit never races it for a group. What the groups hold of the edge stays open."""
        self._loop.cancel()
        await self._loop_done.wait()

    async def final_commit(self) -> None:
        """Write every group's durable positions not yet written, all groups at once
        (shutdown, after :meth:`stop_loop`). A failure is logged; :meth:`behind` names it."""
        async with anyio.create_task_group() as tg:
            for group in self._groups.values():
                if group.dirty:
                    tg.start_soon(self._commit, group)

    def behind(self) -> list[str]:
        """The groups whose stored positions are not their query's last durable batch."""
        return [group.name for group in self._groups.values() if group.dirty]

    async def aclose(self) -> None:
        """Close what each group holds of the edge (idempotent)."""
        async with anyio.create_task_group() as tg:
            for group in self._groups.values():
                tg.start_soon(self._release, group)

    async def rewind_once(self, checkpoint: Checkpoint, why: str) -> dict[str, bool]:
        """A deliberate rewind written now, without a loop (the CLI's reset under a lease of
        its own): ``checkpoint``'s groups set to its positions, lowered on purpose where lower
        and logged as the daemon does. Each group's name → whether it was written (a failure
        is logged, never raised)."""
        self.durable(checkpoint, rewind=why)
        try:
            await self.final_commit()
        finally:
            with anyio.CancelScope(shield=True):
                await self.aclose()
        behind = set(self.behind())
        return {name: name not in behind for name in self._groups}

    @abstractmethod
    def durable(self, checkpoint: Checkpoint, *, rewind: str | None = None) -> None:
        """A checkpoint is now in the blob: write its positions (non-blocking). ``rewind``:
        why the query was moved back on purpose (a reset by the daemon, whose document is now
        in the blob): its positions are written even where lower."""

    @abstractmethod
    async def _write(self, group: G, attempt: Attempt) -> None:
        """One commit of ``group``: read what of the store's view is not ``fetched``, decide
        (``positions.decide``; the backwards and held partitions said), write, and record in
        ``attempt`` what a rewind lowers and what landed. Raises on failure (contained by
        :meth:`_commit`)."""

    async def _prepare(self) -> None:
        """Before the loop says it started (a TLS context, a line saying where it writes)."""

    def _due(self, group: G) -> bool:
        """Whether the next pass commits ``group`` (when its backoff allows)."""
        return group.dirty

    async def _after_pass(self) -> None:
        """After each pass's commits (e.g. read the brokers' end offsets for lag)."""

    async def _release(self, group: G) -> None:
        """Close what ``group`` holds of the edge (a client): after a failed commit, so the
        next reconnects, and when the group is dropped. Nothing by default."""

    def _take(
        self,
        name: str,
        checkpoint: Checkpoint,
        wanted: positions.Positions,
        rewind: str | None,
    ) -> G:
        """``checkpoint``'s durable ``wanted`` positions, to be written to group ``name`` at
        the next pass (woken now); the group."""
        group = self._groups.get(name)
        self._retiring.discard(checkpoint.query_id)  # active again
        if group is None:
            group = self._groups[name] = self._group_type(name, checkpoint, wanted)
        elif rewind is None and _same_batch(group.checkpoint, checkpoint):
            # Told again (a flush found the blob holding what it had told): nothing newer.
            # What another writer moved since stays as it set it: a twin's reset of the blob,
            # which this daemon's memory of the blob has not seen yet, is not undone.
            return group
        else:
            if group.checkpoint.query_id != checkpoint.query_id:
                group.rewind = None  # another query under the same name: not its rewind
            group.checkpoint, group.wanted, group.dirty = checkpoint, wanted, True
        group.held.clear()  # a newer durable checkpoint moves what another writer moved
        if rewind is not None:
            group.rewind = positions.Rewind(rewind)
            group.fetched.clear()  # lower from what the store holds now (and say it)
        self._wake.set()
        return group

    async def _retire(self) -> None:
        if not self._retiring:
            return
        for name, group in list(self._groups.items()):
            if group.checkpoint.query_id in self._retiring and not group.dirty:
                del self._groups[name]
                self._backoff.forget(name)
                await self._release(group)
        self._retiring = {g.checkpoint.query_id for g in self._groups.values()} & self._retiring

    async def _commit(self, group: G) -> None:
        """One commit of ``group`` (:meth:`_write`), contained: a failure is counted, logged
        and backed off, and the store's view read again before the next; a success clears the
        group unless ``durable`` replaced what it wrote, and the rewind it was made with."""
        attempt = Attempt(group.checkpoint, group.wanted, group.rewind)
        try:
            await self._write(group, attempt)
        except Exception as exc:  # translated at the edge, or a bug: never fatal
            group.fetched.clear()  # read the store's view again (after reconnecting)
            self._failed(group.name, self._report.failed(group.name, attempt.checkpoint), exc)
            await self._release(group)
            attempt.say_rewound(group.name, self._report)  # what did land, said
            return
        if group.wanted is attempt.wanted:
            group.dirty = False
        if attempt.rewind is not None and group.rewind is attempt.rewind:
            group.rewind = None  # written; a newer rewind given meanwhile stays
        self._backoff.succeeded(group.name)
        attempt.say_rewound(group.name, self._report)
        self._report.succeeded(group.name, attempt.checkpoint, len(attempt.done))

    def _failed(self, key: Hashable, what: str, exc: Exception) -> None:
        self._backoff.log_failure(key, what, exc, self._report.log)


def _same_batch(held: Checkpoint, told: Checkpoint) -> bool:
    return held.query_id == told.query_id and held.batch_id == told.batch_id
