"""The flush core alone (``sidecar.flush.core``), driven directly against a model of the blob
store, this daemon's Redis and another writer: no event loop, no fakes of the SDK, thousands
of interleavings a second.

``tests/unit/test_flush_simulation.py`` drives the whole daemon (handler, coalescer, flusher,
lease manager) with fakes at the SDK edges; it is the one that finds what the wiring does
wrong, at ~8 examples a second. This one drives the decisions only — every input the shell
gives the core (a read with the stamp and lease term it began under, Redis' word read at a
stamp, a write's answer, the lease lost or acquired, acks: each an event told through the
core's one door, ``FlushCore.step``) in any order the shell allows, including a read or a
Redis read that began before other news and ends after it — against a model of what each
party really holds. The shell's part is played here in a few lines per
step, as ``blob_state`` and ``lease_manager`` play it.

Checked after every step:

- **an ack is answered only when its batch was in the blob** at some moment since the ack was
  made (the model's blob, not anyone's memory of it);
- **this daemon's writes never move the blob backwards**, and **never land over another
  writer's reset that this daemon's Redis never recorded** (the detectable case: the reset
  below Redis' flushed batch, docs/flush-owner.md).

Four defects are kept as mutants of the core (:data:`MUTANTS`), each with the steps that
expose it (typed, as Hypothesis prints them): each replay passes on the core and fails on its
mutant, with the violation named. Three are defects the project had and fixed; the fourth
this simulation found (an ack answered by a read begun before it, the store having lost the
batch in between: fixed in ``FlushCore``, each ack with its own stamp). In ``make simulate``
the random search is also shown to find, by itself, the two it can within 2,000 examples
(:data:`SEARCHED`); the other two need a read overtaken by other news and then an ack, in
that order.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sidecar.backoff import Backoff
from sidecar.buffer.lua import NO_BLOB
from sidecar.buffer.rows import PendingQuery
from sidecar.flush.blob import Seen, Writing
from sidecar.flush.core import FlushCore, Plan, QueryState, Step
from sidecar.flush.events import (
    AckGone,
    AckWanted,
    Action,
    Answer,
    BlobCreated,
    BlobRead,
    BlobWritten,
    Event,
    Flushed,
    FlushMarked,
    LeaseAcquired,
    LeaseAcquiring,
    LeaseLapsed,
    LeaseRenewed,
    NotOwner,
    RedisSaid,
    RowsApplied,
    Skipped,
    WriteBegun,
    WriteRefused,
    WriteUnsure,
)
from sidecar.flush.flusher import WRITE_TRIES
from sidecar.flush.lease import LeaseState
from sidecar.model.document import CheckpointDocument, Stored, Writer, reset_document
from tests.helpers import checkpoint_of

Q = "5f1c0000-0000-4000-8000-0000000000c1"
OURS = Writer(host="ours", pid=1, instance_id="ours")
OTHER = Writer(host="other", pid=2, instance_id="other")


@dataclass
class Waiter:
    """An ack waiting for ``batch``; ``best``: the highest batch the blob held since it was
    made (what an answer may rely on)."""

    batch: int
    best: int


@dataclass
class Blob:
    """The blob as the store holds it: an ETag that changes with every write, a document."""

    version: int
    doc: CheckpointDocument | None

    @property
    def batch(self) -> int:
        return self.doc.batch_id if self.doc is not None else NO_BLOB

    @property
    def etag(self) -> str:
        return f"v{self.version}"

    def stored(self) -> Stored:
        return Stored(self.etag, self.doc)


@dataclass
class Model:
    """What each party really holds."""

    blob: Blob | None = None
    #: Every state the blob took, for a store that loses its last writes.
    history: list[Blob] = field(default_factory=list)
    versions: int = 0
    #: Who holds the lease: "ours" (under ``term``), "other", or nobody.
    holder: str | None = None
    term: int = 0
    #: This daemon's Redis: the newest batch applied, the batch it recorded as flushed and
    #: the reset record of that flush's document ("": none), its count of resets.
    applied: int = NO_BLOB
    flushed: int | None = None
    flushed_reset: str | None = None
    resets: int = 0
    #: Resets another writer made that this Redis never recorded.
    foreign_resets: set[str] = field(default_factory=set)

    def put(self, doc: CheckpointDocument | None) -> Blob:
        self.versions += 1
        self.blob = Blob(self.versions, doc)
        self.history.append(self.blob)
        return self.blob


def document(batch: int, base: CheckpointDocument | None, writer: Writer) -> CheckpointDocument:
    return CheckpointDocument.of(checkpoint_of(Q, batch), writer, reset_of=base)


class CoreSimulation(RuleBasedStateMachine):
    """The core, its query's lease, and the model (module docstring)."""

    #: The core under test (a mutant's class in :func:`test_the_search_finds_each_mutant`).
    core_class: type[FlushCore[Waiter, None]] = FlushCore

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.core = self.core_class(
            Backoff(0.1, 5.0, clock=lambda: self.now, jitter=lambda: 0.5),
            clock=lambda: self.now,
            shell=lambda: None,
        )
        self.model = Model()
        self.waiting: list[Waiter] = []
        self.violations: list[str] = []
        #: A read and a Redis read in flight: what they saw when they began, and the stamp
        #: and lease term they began under.
        self.read_in_flight: tuple[int, int | None, Stored] | None = None
        self.redis_in_flight: tuple[int, int | None, int, str | None] | None = None
        self.tell(LeaseAcquired(self.q.query_id, 1, self.now, 60, 20), "the lease acquired")
        self.model.holder, self.model.term = "ours", 1

    @property
    def q(self) -> QueryState[Waiter, None]:
        return self.core.record(Q, "q")

    def tell(self, event: Event[Waiter], how: str) -> list[Action[Waiter]]:
        """Tell the core ``event`` through its one door, as the shell does; the acks its
        actions answer are held against the model."""
        actions = self.core.step(event)
        for action in actions:
            if isinstance(action, Answer):
                self.settle(action.waiters, how)
        return actions

    def settle(self, answered: tuple[Waiter, ...], how: str) -> None:
        for w in answered:
            if w.best < w.batch:
                self.violations.append(
                    f"ack of {w.batch} answered ({how}); the blob held at most {w.best} since"
                )
            if w in self.waiting:
                self.waiting.remove(w)

    def _land(self, doc: CheckpointDocument) -> Blob:
        before = self.model.blob
        if before is not None and doc.batch_id < before.batch:
            self.violations.append(
                f"our write moved the blob back {before.batch} -> {doc.batch_id}"
            )
        held = before.doc.reset_at if before is not None and before.doc is not None else None
        flushed = self.model.flushed
        # The case the daemon can tell (module docstring): the reset below Redis' flushed
        # batch. Above it (the other writer went on past it) it is a known limit.
        below = before is not None and flushed is not None and before.batch < flushed
        if held in self.model.foreign_resets and below:
            self.violations.append(f"batch {doc.batch_id} written over another writer's reset")
        return self.put(doc)

    def put(self, doc: CheckpointDocument | None) -> Blob:
        """The store's blob now holds ``doc``: every waiting ack may rely on it from now."""
        blob = self.model.put(doc)
        for w in self.waiting:
            w.best = max(w.best, blob.batch)
        return blob

    def _ours(self) -> bool:
        return self.model.holder == "ours" and self.q.lease.term == self.model.term

    # --- ingest ------------------------------------------------------------------------------

    @rule()
    def apply(self) -> None:
        """Spark's next batch, applied in this daemon's Redis; the row it leaves, told."""
        m = self.model
        m.applied += 1
        row = PendingQuery(
            Q, 1, 0, "v", m.applied, checkpoint_of(Q, m.applied), m.flushed, int(self.now * 1000),
            m.resets, m.flushed_reset,
        )  # fmt: skip
        self.tell(RowsApplied((row,), self.core.stamp), "an apply's row")

    @precondition(lambda self: self.model.applied >= 0)
    @rule(back=st.integers(0, 2))
    def ack(self, back: int) -> None:
        """A client waits until batch (applied - back) is in the blob (a resend when back > 0)."""
        batch = max(0, self.model.applied - back)
        blob = self.model.blob
        w = Waiter(batch, blob.batch if blob is not None else NO_BLOB)
        self.waiting.append(w)
        for action in self.tell(AckWanted(Q, batch, w), "at once"):
            if isinstance(action, NotOwner):
                self.waiting.remove(w)

    @precondition(lambda self: bool(self.waiting))
    @rule()
    def an_ack_times_out(self) -> None:
        self.tell(AckGone(Q, self.waiting.pop(0)), "never")

    # --- reads: the blob, and Redis' word, each possibly overtaken by other news ----------------

    @rule()
    def read(self) -> None:
        """A read begun and ended with nothing in between (one in flight stays in flight)."""
        self._read_ends(self._read_begins())

    @precondition(lambda self: self.read_in_flight is None)
    @rule()
    def read_begins(self) -> None:
        self.read_in_flight = self._read_begins()

    @precondition(lambda self: self.read_in_flight is not None)
    @rule()
    def read_ends(self) -> None:
        assert self.read_in_flight is not None
        read, self.read_in_flight = self.read_in_flight, None
        self._read_ends(read)

    def _read_begins(self) -> tuple[int, int | None, Stored]:
        """What a read begun now saw: the stamp and lease term it began under, the blob."""
        blob = self.model.blob
        stored = blob.stored() if blob is not None else Stored(None, None)
        return self.core.stamp, self.core.held_term(Q), stored

    def _read_ends(self, read: tuple[int, int | None, Stored]) -> None:
        since, term, stored = read
        self.tell(BlobRead(Q, stored, since, term), "a read")

    @precondition(lambda self: self.redis_in_flight is None)
    @rule()
    def redis_read_begins(self) -> None:
        m = self.model
        self.redis_in_flight = (self.core.stamp, m.flushed, m.resets, m.flushed_reset)

    @precondition(lambda self: self.redis_in_flight is not None)
    @rule(judge=st.booleans())
    def redis_read_ends(self, judge: bool) -> None:
        assert self.redis_in_flight is not None
        since, flushed, resets, recorded = self.redis_in_flight
        self.redis_in_flight = None
        self.tell(RedisSaid(Q, flushed, resets, since, recorded, judge), "Redis' word")

    # --- one flush, as the flusher runs it (one try) --------------------------------------------

    @precondition(lambda self: self.model.applied >= 0)
    @rule(unsure=st.booleans())
    def flush(self, unsure: bool) -> None:
        """One flush of the newest applied batch, as ``Flusher._land`` runs it: plan; read the
        blob (then Redis' word, judged) or compare, and plan again; then skip, refuse, or write
        under the lease with the version read (of unknown outcome with ``unsure``); at most
        ``WRITE_TRIES`` plans."""
        m, core = self.model, self.core
        if core.held_term(Q) is None:
            return  # the flusher writes only under a HELD lease
        batch = m.applied
        for _ in range(WRITE_TRIES):
            plan = core.plan(Q, batch)
            if plan.step in (Step.READ, Step.COMPARE):
                if plan.step is Step.READ:
                    self.read()
                said = RedisSaid(Q, m.flushed, m.resets, core.stamp, m.flushed_reset, judge=True)
                self.tell(said, "the flush's Redis read")
                plan = core.plan(Q, batch)
            if plan.step is Step.READ or plan.step is Step.COMPARE:
                continue
            if plan.step is Step.SKIP:
                self.tell(Skipped(Q), "a skip")
                self.tell(Flushed(Q), "a flush's end")
                return
            if plan.step is Step.REFUSE:
                return
            base = plan.base
            assert plan.step is Step.WRITE and base is not None
            if not self.tell(WriteBegun(Q, base), "a write begun"):
                continue
            self._write(batch, base, unsure)
            return

    def _write(self, batch: int, base: Seen, unsure: bool) -> None:
        m = self.model
        blob = m.blob
        if not self._ours():  # the store refuses the lease: lost
            self.tell(WriteRefused(Q), "a write refused")
            self.tell(LeaseLapsed(Q, "refused on a write", self.now, contested=True), "lost")
            return
        if blob is None or blob.etag != base.stored.version:
            self.tell(WriteRefused(Q), "a write refused")
            return
        landed = self._land(document(batch, blob.doc, OURS))
        if unsure:
            self.tell(WriteUnsure(Q), "a write of unknown outcome")
            return
        self.tell(BlobWritten(Q, landed.stored()), "our write")
        assert landed.doc is not None
        m.flushed, m.flushed_reset = batch, landed.doc.reset_at or ""
        self.tell(FlushMarked(Q), "the flush marked")
        self.tell(Flushed(Q), "a flush's end")

    # --- the lease, and the other writer --------------------------------------------------------

    @precondition(lambda self: self.model.holder == "ours")
    @rule()
    def another_breaks_the_lease(self) -> None:
        """Another daemon breaks our lease and takes it (this daemon learns at its next
        renewal or write)."""
        self.model.holder = "other"

    @precondition(lambda self: self.model.holder is None)
    @rule()
    def another_takes_the_free_lease(self) -> None:
        self.model.holder = "other"

    @precondition(lambda self: self.model.holder == "other" and self.model.blob is not None)
    @rule(back=st.integers(0, 3))
    def another_writes(self, back: int) -> None:
        """The other writer writes the query's blob: forward (its own Redis holds Spark's batches
        too), or a reset ``back`` batches below ours' flushed one (one our Redis never records)."""
        m = self.model
        assert m.blob is not None
        if back == 0:
            batch = max(m.blob.batch, m.applied)
            if batch >= 0:
                self.put(document(batch, m.blob.doc, OTHER))
        elif m.flushed is not None and m.flushed - back >= 0:
            doc = reset_document(
                m.blob.doc, checkpoint_of(Q, m.flushed - back), OTHER, reason="other",
                history_size=0,
            )  # fmt: skip
            assert doc.reset_at is not None
            m.foreign_resets.add(doc.reset_at)
            self.put(doc)

    @precondition(lambda self: self.model.holder != "other" and self.model.blob is not None)
    @rule(back=st.integers(0, 3))
    def another_takes_over(self, back: int) -> None:
        """Another daemon breaks (or takes the free) lease, writes the blob as
        :meth:`another_writes` does, and lets go; this daemon is told nothing."""
        self.model.holder = "other"
        self.another_writes(back)
        self.model.holder = None

    @precondition(lambda self: self.model.holder == "other")
    @rule()
    def another_lets_go(self) -> None:
        self.model.holder = None

    @precondition(lambda self: self.q.lease.state is LeaseState.HELD and not self._ours())
    @rule(refused=st.booleans())
    def ours_learns_the_lease_is_lost(self, refused: bool) -> None:
        """A renewal refused (another lease holds the blob: acks are answered ``not_owner``),
        or the lease expired unrenewed (the store did not answer): the core is told."""
        reason = "renewal refused" if refused else "expired"
        self.tell(LeaseLapsed(Q, reason, self.now, contested=refused), "the lease lost")

    @precondition(lambda self: self.model.holder is None and not self._ours())
    @rule()
    def ours_acquires(self) -> None:
        """The lease is free: ours acquires it under a new term; the store's answer names the
        blob's version, the lease manager tells it."""
        m, lease = self.model, self.q.lease
        if lease.state is LeaseState.HELD:
            self.tell(LeaseLapsed(Q, "expired", self.now), "the lease lost")
        if lease.state is LeaseState.LOST:
            self.tell(LeaseAcquiring(Q, "retry"), "the lease tried again")
        m.holder, m.term = "ours", m.term + 1
        version = m.blob.etag if m.blob is not None else None
        self.tell(LeaseAcquired(Q, m.term, self.now, 60, 20, version), "a lease call")

    @precondition(lambda self: self._ours())
    @rule()
    def ours_renews(self) -> None:
        m = self.model
        version = m.blob.etag if m.blob is not None else None
        self.tell(LeaseRenewed(Q, self.now, 60, 20, version), "a lease call")

    @precondition(lambda self: self.model.holder == "ours" and self.model.blob is None)
    @rule()
    def the_lease_creates_the_blob(self) -> None:
        blob = self.put(None)
        self.tell(BlobCreated(Q, blob.etag), "the lease's creation")

    @precondition(lambda self: len(self.model.history) >= 2)
    @rule(back=st.integers(1, 2))
    def the_store_loses_writes(self, back: int) -> None:
        """The store goes back ``back`` writes (a crash, a restore), with a new ETag."""
        m = self.model
        kept = m.history[max(0, len(m.history) - 1 - back)]
        self.put(kept.doc)

    @rule(seconds=st.sampled_from([0.1, 1.0, 10.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def every_answer_was_true(self) -> None:
        assert not self.violations, self.violations

    @invariant()
    def the_blob_table_holds_no_write_when_none_is_in_flight(self) -> None:
        assert not isinstance(self.q.blob, Writing)


Move = Callable[[CoreSimulation], Any]


def replay(steps: list[Move], core_class: type[FlushCore[Waiter, None]] = FlushCore) -> None:
    """Run ``steps`` (rule calls, typed) with the invariants after each, on ``core_class``."""
    sim = make(core_class)()
    for step in steps:
        step(sim)
        sim.every_answer_was_true()


def make(core_class: type[FlushCore[Waiter, None]]) -> type[CoreSimulation]:
    return type(f"On{core_class.__name__}", (CoreSimulation,), {"core_class": core_class})


# --- four defects the project had, put back ------------------------------------------------------


class AnsweredFromMemory(FlushCore[Waiter, None]):
    """An ack of a batch the blob held as last known here answered at once (fixed: confirmed
    by a read made after it: another writer, or the store, may have lowered the blob since)."""

    def step(self, event: Event[Waiter]) -> list[Action[Waiter]]:
        if isinstance(event, AckWanted):
            q = self.record(event.query_id)
            if not q.lease.held_elsewhere() and q.blob.durable >= event.batch:
                return [Answer((event.waiter,))]
        return super().step(event)


class ReadKeptAfterNewerNews(FlushCore[Waiter, None]):
    """A read begun before newer evidence (the lease lost, a write's answer) kept when it
    ends (fixed: evidence stamps)."""

    def step(self, event: Event[Waiter]) -> list[Action[Waiter]]:
        if isinstance(event, BlobRead):
            return super().step(event._replace(since=self.stamp))
        return super().step(event)


class ForeignResetWrittenOver(FlushCore[Waiter, None]):
    """A blob holding a reset this daemon's Redis never recorded written over like any other
    (fixed: found below Redis' flushed batch, read under the lease, it is refused)."""

    def plan(self, query_id: str, batch: int) -> Plan:
        plan = super().plan(query_id, batch)
        return Plan(Step.WRITE, plan.base) if plan.step is Step.REFUSE else plan


class ConfirmedByAnEarlierRead(FlushCore[Waiter, None]):
    """An ack answered by a read (or a write) that began before it, the store having lost
    the batch in between (fixed here, found by this simulation: each ack has its stamp, and
    only evidence begun at or after it answers it)."""

    def step(self, event: Event[Waiter]) -> list[Action[Waiter]]:
        actions = super().step(event)
        if isinstance(event, AckWanted):
            q, waiter = self.record(event.query_id), event.waiter  # as if made before any evidence
            q.acks = [a._replace(made=0) if a.waiter is waiter else a for a in q.acks]
            q.confirming = [a._replace(made=0) if a.waiter is waiter else a for a in q.confirming]
        return actions


#: Another daemon broke the lease ours still thinks it holds and wrote batch 0.
ANOTHER_WROTE_BATCH_0: list[Move] = [
    lambda s: s.the_lease_creates_the_blob(),
    lambda s: s.another_breaks_the_lease(),
    lambda s: s.apply(),
    lambda s: s.another_writes(back=0),
]

#: Batch 2 flushed, and a read of it begun (it ends in a later step).
A_READ_OF_BATCH_2_IN_FLIGHT: list[Move] = [
    lambda s: s.the_lease_creates_the_blob(),
    *[lambda s: s.apply()] * 3,
    lambda s: s.flush(unsure=False),
    lambda s: s.read_begins(),
]

MUTANTS: dict[str, tuple[type[FlushCore[Waiter, None]], str, list[Move]]] = {
    # Another writer wrote the blob while ours still thought its lease held; ours read it;
    # the store then lost that write: the resend's ack must wait for a new read.
    "an ack answered from memory": (
        AnsweredFromMemory,
        "ack of 0 answered (at once)",
        [
            *ANOTHER_WROTE_BATCH_0,
            lambda s: s.read(),
            lambda s: s.the_store_loses_writes(back=1),
            lambda s: s.ack(back=0),
        ],
    ),
    # A read of batch 2 in flight; another daemon takes the lease over and resets the query
    # to 1; ours learns its lease expired, and a resend of 2 waits: the read, ending now,
    # must not answer it.
    "a read kept after newer news": (
        ReadKeptAfterNewerNews,
        "ack of 2 answered (a read)",
        [
            *A_READ_OF_BATCH_2_IN_FLIGHT,
            lambda s: s.another_takes_over(back=1),
            lambda s: s.ours_learns_the_lease_is_lost(refused=False),
            lambda s: s.ack(back=0),
            lambda s: s.read_ends(),
        ],
    ),
    # Ours flushed batch 2; another daemon, on its own Redis, reset the query to 1 and let go;
    # ours takes the lease back and flushes batch 3: refused, never written over the reset.
    "another writer's reset written over": (
        ForeignResetWrittenOver,
        "batch 3 written over another writer's reset",
        [
            *[lambda s: s.apply()] * 3,
            lambda s: s.the_lease_creates_the_blob(),
            lambda s: s.flush(unsure=False),
            lambda s: s.another_takes_over(back=1),
            lambda s: s.ours_learns_the_lease_is_lost(refused=False),
            lambda s: s.ours_acquires(),
            lambda s: s.apply(),
            lambda s: s.flush(unsure=False),
        ],
    ),
    # The same for a new batch: another daemon wrote batch 0 (ours not told), a read of it is
    # in flight, the store loses it, ours acks batch 0: the read must not answer it. Found by
    # make simulate at 5,000 examples once the resend's case above was fixed.
    "an ack answered by a read begun before it": (
        ConfirmedByAnEarlierRead,
        "ack of 0 answered (a read)",
        [
            *ANOTHER_WROTE_BATCH_0,
            lambda s: s.read_begins(),
            lambda s: s.the_store_loses_writes(back=1),
            lambda s: s.ack(back=0),
            lambda s: s.read_ends(),
        ],
    ),
    # A read of batch 2 in flight; the store loses that write; a resend of batch 2 is acked
    # in blob mode: the read, begun before the ack, must not answer it.
    "a resend's ack answered by a read begun before it": (
        ConfirmedByAnEarlierRead,
        "ack of 2 answered (a read)",
        [
            *A_READ_OF_BATCH_2_IN_FLIGHT,
            lambda s: s.the_store_loses_writes(back=1),
            lambda s: s.ack(back=0),
            lambda s: s.read_ends(),
        ],
    ),
}

#: Examples of the random search (``make simulate`` sets more).
EXAMPLES = int(os.environ.get("SIMULATION_EXAMPLES", "300"))
#: Whether this is ``make simulate``'s deep run, where the search is also shown to find the
#: defects put back that it can find within its examples.
DEEP = "SIMULATION_EXAMPLES" in os.environ


def test_the_core_keeps_every_answer_true() -> None:
    settings_ = settings(
        max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )  # fmt: skip
    run_state_machine_as_test(CoreSimulation, settings=settings_)


@pytest.mark.parametrize("name", list(MUTANTS))
def test_each_defect_put_back_fails_its_kept_steps(name: str) -> None:
    core_class, said, steps = MUTANTS[name]
    replay(steps)  # the core: every answer true
    with pytest.raises(AssertionError) as caught:
        replay(steps, core_class)
    assert said in str(caught.value)


#: The defects put back that the random search finds by itself within 2,000 examples (the
#: other two need a read overtaken by a takeover or a loss and then an ack, in that order:
#: their steps are kept above).
SEARCHED = ["an ack answered from memory", "another writer's reset written over"]


@pytest.mark.skipif(not DEEP, reason="the search for defects put back runs in make simulate")
@pytest.mark.parametrize("name", SEARCHED)
def test_the_search_finds_the_defects_put_back(name: str) -> None:
    core_class, _, _ = MUTANTS[name]
    settings_ = settings(
        max_examples=2000, stateful_step_count=40, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow], phases=[Phase.generate],
    )  # fmt: skip
    with pytest.raises(AssertionError):
        run_state_machine_as_test(make(core_class), settings=settings_)
