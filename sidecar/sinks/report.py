"""What a position sink says of each commit of a group, in one voice for every sink: the lines
an operator greps (``kafka group=%s query=%s batch=%d: ...``) and the result counts
(``ok``, ``regressed``, ``rewound``, ``error``), each sink with its own words, logger and
metric families (:class:`Reporter`). Pure: no event loop, no SDK (metrics reached through
protocols)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sidecar.model import positions
from sidecar.model.checkpoint import Checkpoint


class Count(Protocol):
    """A counter (``prometheus_client.Counter``, as ``sidecar.telemetry.metrics`` builds it)."""

    def inc(self, amount: float = 1) -> None: ...


class Counts(Protocol):
    """A counter by one label (the result)."""

    def labels(self, *values: str) -> Count: ...


class Level(Protocol):
    """A gauge."""

    def set(self, value: float) -> None: ...


@dataclass(frozen=True)
class Words:
    """How one sink's log lines name it and a commit of a group."""

    #: The lines' first word: ``kafka``, ``eventhubs``.
    kind: str
    #: In a failure's line: ``commit``, ``write``.
    verb: str
    #: In a skip's line: ``committing``, ``checkpointing``.
    present: str
    #: In a success's line: ``committed``, ``checkpointed``.
    past: str


@dataclass(frozen=True)
class Reporter:
    """How one sink says what its commits did: its logger, words and metric families."""

    log: logging.Logger
    words: Words
    #: Commits of a group by result: ``ok``, ``regressed``, ``rewound``, ``error``.
    results: Counts
    #: Partitions not written because they would move backwards.
    skipped: Count
    #: 1 when the last commit succeeded, 0 when one failed.
    up: Level

    def failed(self, group: str, checkpoint: Checkpoint) -> str:
        """Count a failed commit (the sink down); what the retry's line calls it."""
        self.results.labels("error").inc()
        self.up.set(0)
        return f"{self.words.kind} group={group} query={checkpoint.label} {self.words.verb}"

    def backwards(
        self, group: str, checkpoint: Checkpoint, regressed: Sequence[positions.Move]
    ) -> None:
        """Partitions not written because they would move backwards (not a rewind)."""
        if not regressed:
            return
        self.results.labels("regressed").inc()
        self.skipped.inc(len(regressed))
        self.log.warning(
            "%s group=%s query=%s batch=%d: not %s %d partition(s) backwards (query reset?): %s",
            self.words.kind,
            group,
            checkpoint.label,
            checkpoint.batch_id,
            self.words.present,
            len(regressed),
            positions.described(regressed),
        )

    def held(
        self,
        group: str,
        checkpoint: Checkpoint,
        held: Sequence[positions.Move],
        *,
        why: str,
        level: int = logging.INFO,
    ) -> None:
        """Partitions another writer moved since this one knew them (``why``: how, who),
        left as it set them."""
        if not held:
            return
        self.log.log(
            level,
            "%s group=%s query=%s batch=%d: %d partition(s) %s, left as it set them until "
            "this query's next durable batch: %s",
            self.words.kind,
            group,
            checkpoint.label,
            checkpoint.batch_id,
            len(held),
            why,
            positions.described(held),
        )

    def rewound(
        self,
        group: str,
        checkpoint: Checkpoint,
        rewind: positions.Rewind,
        lowered: Sequence[positions.Move],
        kept: str = "",
    ) -> None:
        """What a rewind's commit lowered on purpose (one WARNING line, counted), and what it
        could not (``kept``: the sink's words, the end of the line)."""
        if not lowered and not kept:
            return
        if lowered:
            self.results.labels("rewound").inc()
        self.log.warning(
            "%s group=%s query=%s batch=%d: %d partition(s) lowered on purpose, a deliberate "
            "rewind (%s): %s%s",
            self.words.kind,
            group,
            checkpoint.label,
            checkpoint.batch_id,
            len(lowered),
            rewind.why,
            positions.described(lowered) or "none",
            kept,
        )

    def succeeded(self, group: str, checkpoint: Checkpoint, written: int) -> None:
        """A commit that succeeded (the sink up), and wrote ``written`` partitions."""
        self.up.set(1)
        if not written:
            return
        self.results.labels("ok").inc()
        self.log.debug(
            "%s group=%s query=%s batch=%d: %s %d partition(s)",
            self.words.kind,
            group,
            checkpoint.label,
            checkpoint.batch_id,
            self.words.past,
            written,
        )
