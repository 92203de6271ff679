"""Positions the sidecar writes for other tools — Kafka groups' committed offsets, Event Hubs
checkpoints — and when one may move back. Pure: the Kafka committer
(``sidecar.kafka.committer``) and the Event Hubs checkpointer (``sidecar.eventhubs``) ask
:func:`decide` what to write of a durable checkpoint, given what the store holds as far as they
know.

Rules, per partition:

- **Forward only, by default.** A position lower than the stored one is not written
  (``regressed``: a query reset under the same name, a checkpoint older than what another
  writer stored).
- **Back on purpose.** A deliberate rewind — a reset performed by the daemon (``reset``,
  ``import-spark-checkpoint``, ``restore``), passed as ``rewind`` — writes its positions
  whatever the store holds, and the lowered ones are named (``rewound``) so that the writer
  says so. Nothing else lowers a position.
- **Not raised over another writer's rewind.** A partition another writer moved since this
  writer last knew it (``held``: seen when it read the store again — a rewind by another
  daemon, an operator's ``kafka-consumer-groups --reset-offsets``) is left as that writer set
  it by the checkpoint that was current when it was seen: that checkpoint may predate the
  move. The query's next durable checkpoint moves it again (the writer then holds the lease:
  a later flush is never stale).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import NamedTuple

#: (topic or event hub, partition) → a position (a Kafka offset, an Event Hubs sequence number).
Positions = dict[tuple[str, int], int]


class Move(NamedTuple):
    """One partition's position: what the store holds (None: nothing), and the new one."""

    key: tuple[str, int]
    have: int | None
    number: int

    def __str__(self) -> str:
        """For a log line: ``"events-0: 41 -> 7"``."""
        have = "none" if self.have is None else self.have
        return f"{self.key[0]}-{self.key[1]}: {have} -> {self.number}"


def described(moves: Iterable[Move], most: int = 5) -> str:
    """The first ``most`` moves for a log line, and how many more."""
    listed = list(moves)
    more = f" (and {len(listed) - most} more)" if len(listed) > most else ""
    return ", ".join(str(m) for m in listed[:most]) + more


@dataclass(frozen=True, eq=False)
class Rewind:
    """A deliberate rewind not yet written, and why (the reset's, for the log line). Told
    apart by identity: a writer clears the one it wrote, never a newer one given meanwhile."""

    why: str


@dataclass(frozen=True)
class Moves:
    """What to write of one checkpoint, and what was not."""

    #: Partition → the position to write.
    write: Positions
    #: Lower than stored, not written (not a rewind).
    regressed: list[Move] = field(default_factory=list)
    #: Lower than stored, written on purpose (a rewind): in ``write`` too.
    rewound: list[Move] = field(default_factory=list)
    #: Moved by another writer since this one last knew it, left as that writer set it.
    held: list[Move] = field(default_factory=list)


def decide(
    wanted: Mapping[tuple[str, int], int],
    stored: Mapping[tuple[str, int], int],
    *,
    rewind: bool = False,
    held: Set[tuple[str, int]] = frozenset(),
    rewrite_equal: bool = False,
) -> Moves:
    """What to write for ``wanted`` given ``stored`` (as far as the writer knows): every
    partition whose stored position is lower or unknown, the equal ones too with
    ``rewrite_equal`` (Kafka re-commits them to keep the group alive), the lower ones only for
    a ``rewind``; partitions in ``held`` are left alone, unless for a ``rewind`` (the newest
    decision of all)."""
    moves = Moves({})
    for key, number in sorted(wanted.items()):
        have = stored.get(key)
        if key in held and not rewind:
            moves.held.append(Move(key, have, number))
        elif have is None or number > have or (number == have and rewrite_equal):
            moves.write[key] = number
        elif number < have:
            if rewind:
                moves.write[key] = number
                moves.rewound.append(Move(key, have, number))
            else:
                moves.regressed.append(Move(key, have, number))
    return moves


def moved_since(
    known: Mapping[tuple[str, int], int],
    now: Mapping[tuple[str, int], int],
    *,
    raised_too: bool = False,
) -> set[tuple[str, int]]:
    """The partitions whose position ``now`` (read from the store again) is lower than the
    writer ``known`` it (its own last write, or an earlier read) — or, ``raised_too``, differs
    from it either way: another writer moved them since."""
    return {
        key
        for key, number in now.items()
        if key in known and (number < known[key] or (raised_too and number != known[key]))
    }
