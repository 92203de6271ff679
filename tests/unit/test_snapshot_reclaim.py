"""Which gone queries' snapshots are reclaimed (sidecar/snapshot/reclaim.py's ``decide`` and
``group``, pure); a daemon reclaiming a reused location's old query against Azurite:
tests/integration/test_snapshot_daemon.py."""

from __future__ import annotations

from datetime import UTC, datetime

from sidecar.snapshot.reclaim import QueryBlobs, decide, group

DAY = 86400.0
NOW = 1_800_000_000.0
KEEP = 7 * DAY


def at(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def test_the_listing_is_grouped_by_query_with_its_newest_index_and_gone_record() -> None:
    top = "ns/snapshots/"
    listed = [
        (f"{top}q1/index/{5:020d}-{'a' * 32}", at(NOW - 3 * DAY)),
        (f"{top}q1/index/{9:020d}-{'b' * 32}", at(NOW - 2 * DAY)),
        (f"{top}q1/packs/{'c' * 32}", at(NOW - 9 * DAY)),
        (f"{top}q1/gone", at(NOW - DAY)),
        (f"{top}q2/unreferenced", at(NOW)),
    ]
    q1, q2 = sorted(group(listed, "ns"), key=lambda q: q.query_id)
    assert (q1.query_id, len(q1.names), q1.newest_at, q1.gone_at) == (
        "q1",
        4,
        NOW - 2 * DAY,  # the newest blob but the gone record
        NOW - DAY,
    )
    assert (q2.newest_at, q2.gone_at) == (NOW, None)


def test_a_query_gone_from_its_location_is_reclaimed_after_the_time_unless_snapshotted_since(
) -> None:  # fmt: skip
    gone = QueryBlobs("q", ["x"], newest_at=NOW - 9 * DAY, gone_at=NOW - 8 * DAY)
    assert decide(gone, has_checkpoint=True, now=NOW, keep_s=KEEP)
    recent = QueryBlobs("q", ["x"], newest_at=NOW - 9 * DAY, gone_at=NOW - DAY)
    assert decide(recent, has_checkpoint=True, now=NOW, keep_s=KEEP) is None
    # snapshotted again after the record (it runs at another location now): kept
    back = QueryBlobs("q", ["x"], newest_at=NOW - 7.5 * DAY, gone_at=NOW - 8 * DAY)
    assert decide(back, has_checkpoint=True, now=NOW, keep_s=KEEP) is None


def test_a_retired_query_is_reclaimed_once_no_snapshot_was_written_for_the_time() -> None:
    old = QueryBlobs("q", ["x"], newest_at=NOW - 8 * DAY)
    assert "retired" in (decide(old, has_checkpoint=False, now=NOW, keep_s=KEEP) or "")
    assert decide(old, has_checkpoint=True, now=NOW, keep_s=KEEP) is None  # stopped, not gone
    young = QueryBlobs("q", ["x"], newest_at=NOW - DAY)
    assert decide(young, has_checkpoint=False, now=NOW, keep_s=KEEP) is None
    # a first snapshot's packs being written, before any checkpoint blob: kept
    starting = QueryBlobs("q", ["packs/x"], newest_at=NOW - 60)
    assert decide(starting, has_checkpoint=False, now=NOW, keep_s=KEEP) is None
