"""How ``restore`` shows its progress (``sidecar.snapshot.restore.Progress`` sinks, one per
restore, made by a renderer the command picks for its standard error):

- **a terminal**: a bar per restore (``tqdm``, no dependencies of its own): bytes, files,
  rate, time left;
- **anything else** (a pod's log, a file): one log line every :data:`LOG_EVERY_S` while a
  restore runs (files, bytes, rate, time left), and one when it ends, so an operator tailing
  an init container sees it move and a stalled one stands out (its rate falls);
- **neither** with ``--no-progress``.

Both only count what the restore tells them: they decide nothing, and the restore's own log
lines and its result lines on standard output are the command's, not theirs.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import IO, Never, Protocol

import anyio
from tqdm import tqdm

from sidecar.ops.restore import Restored
from sidecar.snapshot.index import SnapshotIndex
from sidecar.snapshot.restore import Progress

log = logging.getLogger("sidecar.restore")

#: A line this often while a restore runs, when standard error is not a terminal (seconds).
LOG_EVERY_S = 5.0


class Renderer(Protocol):
    """Makes a sink for each restore (``sidecar.ops.restore.Watch``) and shows them while
    :meth:`showing` is entered."""

    def __call__(self, label: str, index: SnapshotIndex) -> Progress: ...

    def showing(self) -> AbstractAsyncContextManager[None]: ...


def renderer(
    stream: IO[str] | None = None, *, enabled: bool = True, every_s: float = LOG_EVERY_S
) -> Renderer | None:
    """The renderer for ``stream`` (default: standard error): a bar on a terminal, log lines
    every ``every_s`` seconds otherwise; None when not ``enabled``."""
    if not enabled:
        return None
    stream = stream if stream is not None else sys.stderr
    if stream.isatty():
        return BarProgress(stream)
    return LogProgress(every_s=every_s)


# --- log lines --------------------------------------------------------------------------


class _Tally:
    """One restore's counts, for :class:`LogProgress`."""

    def __init__(self, owner: LogProgress, label: str, batch: int) -> None:
        self.owner, self.label, self.batch = owner, label, batch
        self.files = self.bytes = self.files_total = self.bytes_total = 0
        self.started = self.last = owner.clock()
        #: Bytes written at the last line (the rate shown is the one since).
        self.bytes_last = 0

    def begin(self, files: int, bytes: int) -> None:
        self.files_total, self.bytes_total = files, bytes
        self.started = self.last = self.owner.clock()
        self.owner.current = self

    def advance(self, files: int, bytes: int) -> None:
        self.files += files
        self.bytes += bytes
        self.owner.tick()

    def end(self, ok: bool) -> None:
        if self.owner.current is self:
            self.owner.current = None
        seconds = self.owner.clock() - self.started
        log.log(
            logging.INFO if ok else logging.WARNING,
            "restore %s: %s (%s) seconds=%.1f rate=%s/s",
            "finished" if ok else "failed",
            self.counts(),
            size(self.bytes),
            seconds,
            size(self.bytes / seconds) if seconds > 0 else "-",
        )

    def counts(self) -> str:
        """What every line of this restore says: which, and how far in files and bytes."""
        return (
            f"query={self.label} batch={self.batch} files={self.files}/{self.files_total} "
            f"bytes={self.bytes}/{self.bytes_total}"
        )

    def line(self, now: float) -> None:
        """The rate since the last line (a stall shows at once), the time left at the
        average rate since the start (steadier)."""
        rate = (self.bytes - self.bytes_last) / (now - self.last) if now > self.last else 0.0
        elapsed = now - self.started
        average = self.bytes / elapsed if elapsed > 0 else 0.0
        left = (self.bytes_total - self.bytes) / average if average > 0 else None
        self.last, self.bytes_last = now, self.bytes
        done = 100.0 * self.bytes / self.bytes_total if self.bytes_total else 100.0
        log.info(
            "restore progress: %s (%s of %s, %.0f%%) rate=%s/s left=%s",
            self.counts(),
            size(self.bytes),
            size(self.bytes_total),
            done,
            size(rate),
            duration(left) if left is not None else "unknown",
        )


class LogProgress:
    """A log line every ``every_s`` seconds while a restore runs (from its ticker, and on the
    restore's own news when one is due), and one as it ends. ``clock``: monotonic seconds
    (tests inject one)."""

    def __init__(
        self, *, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_s = every_s
        self.clock = clock
        #: The restore under way (restores run one after the other).
        self.current: _Tally | None = None

    def __call__(self, label: str, index: SnapshotIndex) -> Progress:
        return _Tally(self, label, index.batch)

    def tick(self) -> None:
        """A line for the restore under way if one is due."""
        now = self.clock()
        if self.current is not None and now - self.current.last >= self.every_s:
            self.current.line(now)

    @asynccontextmanager
    async def showing(self) -> AsyncIterator[None]:
        """A ticker while entered: a stalled restore still gets its lines."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._ticker)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()

    async def _ticker(self) -> None:
        while True:
            await anyio.sleep(max(self.every_s, 0.1) / 2)
            self.tick()


# --- a terminal ---------------------------------------------------------------------------


class _Bar:
    """One restore's bar in :class:`BarProgress`, drawn from :meth:`begin` on (a restore that
    fails before it starts leaves no bar behind)."""

    def __init__(self, stream: IO[str], description: str, files_total: int) -> None:
        self.stream, self.description = stream, description
        self.files, self.files_total = 0, files_total
        self.bar: tqdm[Never] | None = None

    def begin(self, files: int, bytes: int) -> None:
        self.files_total = files
        self.bar = tqdm(
            total=bytes,
            desc=self.description,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=self.stream,
            dynamic_ncols=True,
            mininterval=0.2,
        )
        self._files()

    def advance(self, files: int, bytes: int) -> None:
        self.files += files
        if self.bar is not None:
            self._files()
            self.bar.update(bytes)

    def end(self, ok: bool) -> None:
        if self.bar is None:
            return
        if not ok:
            self.bar.set_description(f"{self.description} not written", refresh=False)
        self.bar.close()

    def _files(self) -> None:
        assert self.bar is not None
        self.bar.set_postfix_str(f"{self.files}/{self.files_total} files", refresh=False)


class BarProgress:
    """A ``tqdm`` bar per restore on a terminal: bytes, files, rate, time left."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        # tqdm's default lock is also a multiprocessing one, made (a semaphore file) on the
        # first bar, on the event loop; the bars here share only this process's threads.
        tqdm.set_lock(threading.RLock())

    def __call__(self, label: str, index: SnapshotIndex) -> Progress:
        return _Bar(self.stream, f"{label} batch {index.batch}", len(index.files))

    @asynccontextmanager
    async def showing(self) -> AsyncIterator[None]:
        yield  # each bar draws itself, and is closed when its restore ends


# --- the end ------------------------------------------------------------------------------


def summary(done: list[Restored], seconds: float) -> str:
    """``restore --all``'s last line: how many queries had each outcome, and what was
    written in how long."""
    outcomes = ("restored", "newer", "elsewhere", "refused", "failed")
    words = {"newer": "kept"}
    counts = [(words.get(o, o), sum(r.outcome == o for r in done)) for o in outcomes]
    said = ", ".join(f"{n} {word}" for word, n in counts if n) or "nothing to restore"
    files = sum(r.files for r in done)
    written = sum(r.bytes for r in done)
    return (
        f"restore --all: {len(done)} quer{'y' if len(done) == 1 else 'ies'}: {said}; "
        f"{files} files, {written} bytes ({size(written)}) written in {seconds:.2f}s"
    )


def size(n: float) -> str:
    """Bytes for a person: 512 B, 3.1 KiB, 4.0 MiB, 1.2 GiB."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def duration(seconds: float) -> str:
    """Seconds for a person: 42s, 3m05s, 1h02m."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
