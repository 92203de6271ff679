"""The lease manager acquires, writes under and releases a lease only while this daemon is
the live daemon of its lease id (``live``: ``sidecar.daemon.instance``'s lock and its
epoch). The same gate end to end, against redis-server and Azurite:
tests/faults/test_instance.py."""

from __future__ import annotations

from sidecar.flush.lease import LeaseManager, LeaseState
from sidecar.telemetry.metrics import Metrics
from tests.helpers import Clock
from tests.unit.fakes import FakeBlobStore

QID = "9a7e0000-0000-4000-8000-000000000001"


async def test_no_lease_is_taken_written_under_or_released_while_not_the_live_instance() -> None:
    store, clock = FakeBlobStore(), Clock(0.0)
    epoch: list[int | None] = [None]
    leases = LeaseManager(store, "pod-0", 15, Metrics(), clock=clock, live=lambda: epoch[0])
    assert await leases.ensure_held(QID, "q") is None
    assert QID not in store.leases  # nothing was asked of the store

    epoch[0] = 1
    held = await leases.ensure_held(QID, "q")
    assert held is not None and leases.holds(held) and store.leases[QID].lease_id == "pod-0"

    epoch[0] = None  # a twin with the same identity took the instance over
    assert not leases.holds(held)  # no write under it
    await leases.release_all()
    assert store.leases[QID].lease_id == "pod-0"  # the lease is the twin's now: kept
    assert leases.state(QID) is LeaseState.RELEASED


async def test_a_lease_held_through_a_lapse_of_the_instance_lock_is_acquired_again() -> None:
    # While this daemon was not live, a twin with its lease id may have written the blob (or
    # reset it): what was learnt under the old term must not be trusted.
    store, clock = FakeBlobStore(), Clock(0.0)
    epoch: list[int | None] = [1]
    leases = LeaseManager(store, "pod-0", 15, Metrics(), clock=clock, live=lambda: epoch[0])
    before = await leases.ensure_held(QID, "q")
    assert before is not None
    epoch[0] = None
    epoch[0] = 2  # live again: a new epoch
    assert not leases.holds(before)
    after = await leases.ensure_held(QID, "q")
    assert after is not None and after.term != before.term and leases.holds(after)
