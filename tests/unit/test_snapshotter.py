"""The snapshot loop's bookkeeping on the ingest path (``Snapshotter.committed``): the wanted
batch, the lag in seconds, and memory bounded while snapshots fail or the query's checkpoint
is elsewhere. The loop's snapshots themselves run against a real daemon, Azurite and
checkpoint directories: tests/integration/test_snapshot_daemon.py."""

from __future__ import annotations

from typing import Any, cast

import anyio
import anyio.lowlevel
import msgspec
import pytest

from sidecar.daemon import snapshots
from sidecar.daemon.queries import Queries, SnapshotPart
from sidecar.daemon.snapshots import REPORTED_MAX, Snapshotter
from sidecar.snapshot.source import Location
from sidecar.telemetry.metrics import Metrics
from tests.helpers import checkpoint_of, eventually

QUERY = "5ea90000-0000-4000-8000-000000000001"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def snapshotter(clock: Clock) -> Snapshotter:
    async def owns(query_id: str, label: str) -> None:
        return None

    return Snapshotter(
        cast(Any, None),  # the source and the store: not used on the ingest path
        cast(Any, None),
        "ns",
        Metrics(),
        owns=owns,
        taken=lambda query_id, ref: None,
        marker=lambda query_id: (True, None),
        retain=3,
        queries=Queries(clock),
    )


def part(s: Snapshotter, query_id: str) -> SnapshotPart:
    """The snapshot loop's part of the query's entry in the daemon's record."""
    entry = s._queries.get(query_id)
    assert entry is not None and entry.snapshot is not None
    return entry.snapshot


async def test_the_lag_is_the_oldest_batch_no_snapshot_holds() -> None:
    clock = Clock()
    s = snapshotter(clock)
    assert s.lag_seconds(QUERY) == 0.0
    s.committed(checkpoint_of(QUERY, 3))
    clock.now += 5
    s.committed(checkpoint_of(QUERY, 4))
    s.committed(checkpoint_of(QUERY, 2))  # older: nothing changes
    clock.now += 2
    assert s.lag_seconds(QUERY) == 7.0
    q = part(s, QUERY)
    assert (q.wanted, sorted(q.reported)) == (4, [3, 4])


async def test_while_snapshots_fail_the_times_kept_are_bounded_and_the_oldest_stays() -> None:
    clock = Clock()
    s = snapshotter(clock)
    for batch in range(10 * REPORTED_MAX):
        s.committed(checkpoint_of(QUERY, batch))
        clock.now += 1
    q = part(s, QUERY)
    assert len(q.reported) == REPORTED_MAX
    assert min(q.reported) == 0 and max(q.reported) == 10 * REPORTED_MAX - 1
    assert s.lag_seconds(QUERY) == 10 * REPORTED_MAX


async def test_a_query_whose_checkpoint_is_elsewhere_keeps_no_times() -> None:
    clock = Clock()
    s = snapshotter(clock)
    s.committed(checkpoint_of(QUERY, 0))
    part(s, QUERY).elsewhere = True  # as a snapshot finds it: not under the root
    part(s, QUERY).reported.clear()
    for batch in range(1, 500):
        s.committed(checkpoint_of(QUERY, batch))
    q = part(s, QUERY)
    assert q.reported == {} and q.wanted == 499  # still wanted: found later, snapshotted
    assert s.lag_seconds(QUERY) == 0.0
    assert snapshots.REPORTED_MAX < 500


async def test_progress_wakes_the_loop_only_for_a_snapshot_it_can_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every progress of every query woke the loop once: with 100 updates/s of queries whose
    checkpoints are elsewhere, a pass per update (found by bench/snapshots.py's CPU)."""
    monkeypatch.setattr(snapshots, "TICK_S", 60.0)  # every pass below is a wake's
    s = snapshotter(Clock())
    other = "5ea90000-0000-4000-8000-000000000002"
    s.committed(checkpoint_of(other, 0))
    part(s, other).elsewhere = True  # as a snapshot finds it: not under the root
    async with anyio.create_task_group() as tg:
        await tg.start(s.run)
        await eventually(lambda: s.passes == 1)  # the pass its first progress asked for
        for batch in range(1, 101):
            s.committed(checkpoint_of(other, batch))
            await anyio.lowlevel.checkpoint()
        assert s.passes == 1  # never one per progress
        part(s, other).in_flight = True  # a snapshot under way: its end wakes the loop
        part(s, other).elsewhere = False
        s.committed(checkpoint_of(other, 101))
        await anyio.sleep(0.05)
        assert s.passes == 1
        part(s, other).in_flight = False
        passes = s.passes
        s.committed(checkpoint_of(QUERY, 0))  # one it can start: at once
        await eventually(lambda: s.passes > passes)
        s.stop()


async def test_a_rewound_run_is_followed_at_once_and_a_restart_is_not_a_rewind() -> None:
    clock = Clock()
    s = snapshotter(clock)
    for batch in range(95, 101):
        s.committed(checkpoint_of(QUERY, batch))
    q = part(s, QUERY)
    q.done = 100  # snapshotted up to 100
    # A restart on an intact volume: a new run, later batches: nothing forgotten.
    restarted = msgspec.structs.replace(checkpoint_of(QUERY, 101), run_id="run-2")
    s.committed(restarted)
    assert (q.wanted, q.done, q.rewinds) == (101, 100, 0)
    # A restore of batch 50, run on: the new run starts below what was wanted. Its batches
    # are snapshotted from there (they were not until it passed 101 again), and the lag is
    # measured on its timeline.
    s.committed(msgspec.structs.replace(checkpoint_of(QUERY, 51), run_id="run-3"))
    assert (q.wanted, q.done, q.rewinds) == (51, 50, 1)
    assert sorted(q.reported) == [51]
    s.committed(msgspec.structs.replace(checkpoint_of(QUERY, 52), run_id="run-3"))
    assert (q.wanted, q.rewinds) == (52, 1)


class ListedRoot:
    """A checkpoint root as its listings show it: the locations there now, and how many
    listings were asked for."""

    def __init__(self) -> None:
        self.found: list[Location] = []
        self.listings = 0

    async def locations(self) -> list[Location]:
        self.listings += 1
        return list(self.found)


async def test_a_new_query_lists_the_root_at_once_and_one_not_found_waits_for_the_relist() -> None:
    clock, root = Clock(), ListedRoot()
    s = snapshotter(clock)
    s._source = cast(Any, root)
    other = "5ea90000-0000-4000-8000-000000000002"
    root.found = [Location("a", QUERY)]
    s.committed(checkpoint_of(QUERY, 1))
    assert await s._location(part(s, QUERY)) == "a" and root.listings == 1
    # A query whose directory appeared since that listing: listed again at once, not after
    # RELIST_S (each listing fills in every live query's location).
    root.found = [Location("a", QUERY), Location("b", other)]
    s.committed(checkpoint_of(other, 1))
    assert await s._location(part(s, other)) == "b" and root.listings == 2
    assert await s._location(part(s, QUERY)) == "a" and root.listings == 2  # known: no listing
    # One looked for and not found waits RELIST_S for the next listing.
    third = "5ea90000-0000-4000-8000-000000000003"
    s.committed(checkpoint_of(third, 1))
    assert await s._location(part(s, third)) is None and root.listings == 3
    root.found.append(Location("c", third))
    clock.now += snapshots.RELIST_S - 1
    assert await s._location(part(s, third)) is None and root.listings == 3
    clock.now += 1
    assert await s._location(part(s, third)) == "c" and root.listings == 4
