"""``restore``'s progress (``sidecar.cli.progress``): a log line every few seconds when
standard error is no terminal, with files, bytes, rate and time left; one as each restore
ends; a bar on a terminal; the summary line of ``restore --all``. The clock is injected."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import anyio
import pytest

from sidecar.cli.progress import BarProgress, LogProgress, duration, renderer, size, summary
from sidecar.ops.restore import Restored
from sidecar.snapshot.index import FileEntry, SnapshotIndex


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def index(files: int, each: int) -> SnapshotIndex:
    entries = tuple(
        FileEntry(f"state/0/{i}.delta", each, b"\0" * 32, "p", i * each) for i in range(files)
    )
    return SnapshotIndex(
        query_id="q-1", batch=7, id="s1", created_at="2026-01-01T00:00:00Z", location="app/q",
        files=entries, packs={"p": files * each},
    )  # fmt: skip


def progress_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "restore progress" in r.getMessage()]


def test_a_line_every_interval_with_files_bytes_rate_and_time_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "sidecar.restore")
    clock = Clock()
    shown = LogProgress(every_s=5.0, clock=clock)
    sink = shown("orders", index(12, 100))
    sink.begin(12, 1200)
    for _ in range(12):  # one file of 100 bytes a second
        clock.now += 1
        sink.advance(1, 100)
    assert progress_lines(caplog) == [
        "restore progress: query=orders batch=7 files=5/12 bytes=500/1200 (500 B of 1.2 KiB, "
        "42%) rate=100 B/s left=7s",
        "restore progress: query=orders batch=7 files=10/12 bytes=1000/1200 (1000 B of 1.2 "
        "KiB, 83%) rate=100 B/s left=2s",
    ]
    sink.end(True)
    assert caplog.records[-1].getMessage() == (
        "restore finished: query=orders batch=7 files=12/12 bytes=1200/1200 (1.2 KiB) "
        "seconds=12.0 rate=100 B/s"
    )


def test_a_stalled_restore_still_gets_its_lines_from_the_ticker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "sidecar.restore")
    clock = Clock()
    shown = LogProgress(every_s=5.0, clock=clock)
    sink = shown("orders", index(4, 10))
    sink.begin(4, 40)
    clock.now += 3
    sink.advance(1, 10)
    assert progress_lines(caplog) == []
    clock.now += 30  # nothing arrives
    shown.tick()
    shown.tick()  # not due again yet
    (line,) = progress_lines(caplog)
    # the rate since the last line (none yet: since the start) shows the stall; the time
    # left is at the average rate since the start (10 bytes in 33 s)
    assert "files=1/4 bytes=10/40" in line and "rate=0 B/s left=1m39s" in line
    sink.end(False)
    assert caplog.records[-1].levelno == logging.WARNING
    assert caplog.records[-1].getMessage().startswith("restore failed: query=orders batch=7 ")
    clock.now += 60
    shown.tick()  # no restore under way: no line
    assert len(progress_lines(caplog)) == 1


async def test_the_ticker_runs_while_shown(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sidecar.restore")
    shown = LogProgress(every_s=0.01)
    sink = shown("orders", index(2, 10))
    async with shown.showing():
        sink.begin(2, 20)
        with anyio.fail_after(5):  # nothing advances: only the ticker can write them
            while len(progress_lines(caplog)) < 2:  # noqa: ASYNC110  (log records, no event)
                await anyio.sleep(0.01)
        sink.end(True)
    assert "files=0/2 bytes=0/20" in progress_lines(caplog)[0]


async def test_a_terminal_gets_a_bar_with_files_and_bytes() -> None:
    out = io.StringIO()
    shown = BarProgress(out)
    async with shown.showing():
        sink = shown("orders", index(3, 1000))
        sink.begin(3, 3000)
        sink.advance(3, 3000)
        sink.end(True)
    text = out.getvalue()
    last = text.replace("\r", "\n").strip().splitlines()[-1]
    assert "orders batch 7" in last and "3/3 files" in last and "2.93k/2.93k" in last


def test_the_renderer_follows_the_stream() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(renderer(Tty()), BarProgress)
    assert isinstance(renderer(io.StringIO(), every_s=2.0), LogProgress)
    assert renderer(Tty(), enabled=False) is None


def test_the_summary_says_what_each_query_came_to() -> None:
    ix = index(3, 100)
    done = [
        Restored.of("q-1", "orders", ix, Path("/v/a"), seconds=1.5),
        Restored.of("q-2", None, ix, Path("/v/b"), outcome="newer"),
    ]
    assert summary(done, 2.0) == (
        "restore --all: 2 queries: 1 restored, 1 kept; 3 files, 300 bytes (300 B) written in 2.00s"
    )
    assert summary([], 0.1).startswith("restore --all: 0 queries: nothing to restore; 0 files")


def test_sizes_and_durations_for_a_person() -> None:
    assert [size(n) for n in (0, 1023, 1024, 5 * 1024**2, 3 * 1024**3)] == [
        "0 B", "1023 B", "1.0 KiB", "5.0 MiB", "3.0 GiB",
    ]  # fmt: skip
    assert [duration(s) for s in (0.4, 59, 65, 3725)] == ["0s", "59s", "1m05s", "1h02m"]
