"""The pure parts of bench/compare.py (bench/tools.py), on made-up numbers and log lines:
percentiles, the open-loop schedule and its lateness, paired ratios, request lines by
template, and the count of requests in Azurite's debug log. No timing is asserted."""

from __future__ import annotations

import json
from collections import Counter
from statistics import quantiles

import pytest

from bench.tools import (
    TEMPLATE_BATCH,
    AzuriteLogCounter,
    LineTemplate,
    OpenLoop,
    due_count,
    paired_ratios,
    per_10k,
    percentile,
    rotated,
    schedule,
)


def test_percentile_interpolates_like_statistics_inclusive() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 7.0]
    pct = quantiles(values, n=100, method="inclusive")
    assert percentile(values, 50) == pytest.approx(pct[49])
    assert percentile(values, 99) == pytest.approx(pct[98])
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile([3.0], 99.9) == 3.0
    # p99.9 of 1,000 values lies between the two largest
    assert percentile([float(i) for i in range(1000)], 99.9) == pytest.approx(998.001)


@pytest.mark.parametrize("values,q", [([], 50), ([1.0], 101), ([1.0], -1)])
def test_percentile_refuses_nothing_or_out_of_range(values: list[float], q: float) -> None:
    with pytest.raises(ValueError):
        percentile(values, q)


def test_schedule_is_absolute_and_due_count_catches_up() -> None:
    times = schedule(100.0, 1000, 0.01)
    assert len(times) == 10 and times[0] == 100.0 and times[-1] == pytest.approx(100.009)
    assert due_count(times, 99.0, 0) == 0  # nothing due yet
    assert due_count(times, 100.0045, 0) == 5  # woke up late: five due at once
    assert due_count(times, 100.0045, 5) == 5
    assert due_count(times, 200.0, 5) == 10


def test_open_loop_latency_is_from_the_schedule_and_late_sends_are_counted() -> None:
    scheduled = schedule(0.0, 10, 2.0)  # 20 requests, 0.1 s apart
    sent = list(scheduled)
    sent[3] += 0.5  # the client stalled: this one and the next two went out late
    sent[4] += 0.4
    sent[5] += 0.3
    done: list[float | None] = [t + 0.01 for t in scheduled]
    done[3] = sent[3] + 0.01  # answered 10 ms after its late send: 510 ms after schedule
    done[-1] = None  # never answered
    s = OpenLoop(10, 2.0, scheduled, sent, done).summary()
    assert s["scheduled"] == 20 and s["completed"] == 19 and s["not_completed"] == 1
    assert s["sent_late"] == 3
    assert s["max_send_lateness_ms"] == pytest.approx(500.0)
    lat = s["latency_from_schedule"]
    assert isinstance(lat, dict)
    assert lat["max_ms"] == pytest.approx(510.0) and lat["p50_ms"] == pytest.approx(10.0)
    # second half (1.0-2.0 s): 9 of the 10 scheduled were answered: 9/s < 95% of 10/s
    assert s["achieved_rate_per_s"] == pytest.approx(9.0) and s["sustained"] is False


def test_open_loop_that_keeps_up_is_sustained() -> None:
    scheduled = schedule(0.0, 100, 1.0)
    done: list[float | None] = [t + 0.002 for t in scheduled]
    s = OpenLoop(100, 1.0, scheduled, list(scheduled), done).summary()
    assert s["sustained"] is True and s["sent_late"] == 0
    assert s["achieved_rate_per_s"] == pytest.approx(100.0)


def test_paired_ratios_pair_rounds_and_skip_a_zero_reference() -> None:
    r = paired_ratios([10.0, 30.0, 8.0], [5.0, 10.0, 0.0])
    assert r["ratio_median"] == 2.5 and r["ratio_min"] == 2.0 and r["ratio_max"] == 3.0
    assert r["median"] == 10.0 and r["reference_median"] == 5.0
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_line_template_substitutes_every_number_derived_from_the_batch() -> None:
    def line(batch: int) -> bytes:
        offsets = {"t": {str(p): batch * 100 + p for p in range(3)}}
        ends = {"t": {str(p): (batch + 1) * 100 + p for p in range(3)}}
        doc = {"op": "progress", "id": batch, "progress": {
            "batchId": batch, "numInputRows": 300, "sources": [
                {"startOffset": offsets, "endOffset": ends}]}}  # fmt: skip
        return json.dumps(doc).encode() + b"\n"

    template = LineTemplate(line(TEMPLATE_BATCH))
    for batch in (1, 9, 10, 99_999, 123_456_789):
        assert template.line(batch) == line(batch)
    with pytest.raises(ValueError):
        template.line(0)


RID1, RID2, RID3 = (f"{c * 8}-{c * 4}-{c * 4}-{c * 4}-{c * 12}" for c in "abc")
LOG = f"""2026-11-21T22:10:47.622Z \t info: Azurite Blob service is starting on 127.0.0.1:59505
2026-11-21T22:10:47.821Z {RID1} info: BlobStorageContextMiddleware: RequestMethod=PUT RequestURL=http://127.0.0.1/devstoreaccount1/c1/q/x.json RequestHeaders:{{}}
2026-11-21T22:10:47.821Z {RID1} info: BlobStorageContextMiddleware: Account=devstoreaccount1 Container=c1 Blob=q/x.json
2026-11-21T22:10:47.821Z {RID2} info: BlobStorageContextMiddleware: Account=devstoreaccount1 Container=c1 Blob=q/x.json
2026-11-21T22:10:47.822Z {RID1} info: DispatchMiddleware: Operation=BlockBlob_Upload
2026-11-21T22:10:47.822Z {RID2} info: DispatchMiddleware: Operation=Blob_RenewLease
2026-11-21T22:10:47.823Z {RID1} info: BlobSharedKeyAuthenticator:validate() Signature 1 matched.
2026-11-21T22:10:47.830Z {RID1} info: EndMiddleware: End response. TotalTimeInMS=9 StatusCode=201 StatusMessage=undefined
2026-11-21T22:10:47.831Z {RID2} info: EndMiddleware: End response. TotalTimeInMS=9 StatusCode=412 StatusMessage=undefined
2026-11-21T22:10:47.832Z {RID3} info: BlobStorageContextMiddleware: Account=devstoreaccount1 Container=c2 Blob=p/0
2026-11-21T22:10:47.833Z {RID3} info: DispatchMiddleware: Operation=Blob_SetMetadata
2026-11-21T22:10:47.834Z {RID3} info: EndMiddleware: End response. TotalTimeInMS=2 StatusCode=200 StatusMessage=undefined
"""  # noqa: E501


def test_azurite_log_counter_counts_finished_requests_per_container_and_operation() -> None:
    whole = AzuriteLogCounter()
    whole.feed(LOG)
    assert whole.of(["c1"]) == {"Put Blob": 1, "Lease Blob (renew)": 1}
    assert whole.failed[("c1", "Lease Blob (renew)")] == 1
    assert whole.of(["c2"]) == {"Set Blob Metadata": 1}
    assert whole.of(["c1", "c2"]).total() == 3 and whole.of(["other"]).total() == 0
    # fed in pieces cut anywhere (mid-line included): the same counts
    pieces = AzuriteLogCounter()
    for i in range(0, len(LOG), 37):
        pieces.feed(LOG[i : i + 37])
    assert pieces.counts == whole.counts


def test_a_request_not_finished_is_not_counted_yet() -> None:
    counter = AzuriteLogCounter()
    counter.feed(LOG.split("EndMiddleware")[0])  # cut before the first end line
    assert counter.counts.total() == 0
    assert per_10k(whole_counts(), 200) == {"total": 150.0, "Put Blob": 100.0,
                                            "Set Blob Metadata": 50.0}  # fmt: skip
    assert per_10k(whole_counts(), 0) == {}


def whole_counts() -> Counter[str]:
    return Counter({"Put Blob": 2, "Set Blob Metadata": 1})


# --- bench/fleetmodel.py: the fleet bench's classifier, MONITOR parser, model, extrapolation ---

import hashlib  # noqa: E402 - this part's imports stay with its tests
import math  # noqa: E402

from bench.fleetmodel import (  # noqa: E402
    SINGLE_BLOB,
    STORAGE_ACCOUNT,
    Cadence,
    CheckpointGrowth,
    Limit,
    MiB,
    Settings,
    behind_s,
    by_kind,
    checks_with_a_write,
    classify_request,
    extrapolate,
    markdown_table,
    model_rates,
    pack_requests,
    per_second,
    script_shas,
    sent_key,
    snapshot_fleet,
    snapshot_traffic,
)

BLOB = "/devstoreaccount1/fleet/ns/5ca1e000-0000-4000-8000-000000000001.json"


@pytest.mark.parametrize(
    "method,target,headers,expected",
    [
        ("PUT", BLOB, {"x-ms-blob-type": "BlockBlob", "x-ms-lease-id": "l"}, ("write", "Put Blob")),
        ("PUT", BLOB, {"x-ms-blob-type": "BlockBlob", "if-none-match": "*"},
         ("write", "Put Blob (create if absent)")),
        ("PUT", BLOB + "?comp=blocklist", {}, ("write", "Put Block List")),
        ("PUT", BLOB + "?comp=block&blockid=AA", {}, ("write", "Put Block")),
        ("PUT", BLOB + "?comp=metadata", {}, ("write", "Set Blob Metadata")),
        ("PUT", BLOB + "?comp=lease", {"x-ms-lease-action": "acquire"},
         ("lease", "Lease Blob (acquire)")),
        ("PUT", BLOB + "?comp=lease", {"x-ms-lease-action": "Renew"},
         ("lease", "Lease Blob (renew)")),
        ("PUT", BLOB + "?comp=lease", {"x-ms-lease-action": "release"},
         ("lease", "Lease Blob (release)")),
        ("GET", BLOB, {}, ("read", "Get Blob")),
        ("HEAD", BLOB, {}, ("read", "Get Blob Properties")),
        ("GET", "/devstoreaccount1/fleet?restype=container&comp=list&prefix=ns/", {},
         ("read", "List Blobs")),
        ("GET", "/devstoreaccount1/fleet?restype=container", {},
         ("other", "Get Container Properties")),
        ("PUT", "/devstoreaccount1/fleet?restype=container", {}, ("other", "Create Container")),
        ("DELETE", BLOB, {}, ("other", "Delete Blob")),
        ("GET", "/devstoreaccount1?comp=list", {}, ("other", "List Containers")),
        ("GET", "/devstoreaccount1/?restype=service&comp=properties", {},
         ("other", "GET service comp=properties")),
    ],
)  # fmt: skip
def test_storage_requests_are_classified_by_method_query_and_lease_action(
    method: str, target: str, headers: dict[str, str], expected: tuple[str, str]
) -> None:
    assert classify_request(method, target, headers) == expected


SHAS = script_shas({"apply": "return 1", "pending": "return 2"})
APPLY_SHA = next(sha for sha, name in SHAS.items() if name == "apply")


def test_commands_sent_are_named_by_script_and_subcommand() -> None:
    assert sha_of("return 1") == APPLY_SHA  # what redis-py's register_script sends
    assert sent_key(f"EVALSHA {APPLY_SHA} 4 cps:{{ns}}:pending k2".encode(), SHAS) == (
        "evalsha apply"
    )
    assert sent_key(f"evalsha {APPLY_SHA.upper()} 1 k", SHAS) == "evalsha apply"
    assert sent_key(b"EVALSHA 0123abcd 0", SHAS) == "evalsha unknown script"
    assert sent_key(b"GET cps:{ns}:marker", SHAS) == "get"
    assert sent_key(b"CONFIG SET slowlog-log-slower-than 0", SHAS) == "config|set"
    assert sent_key(b"PING", SHAS) == "ping"


def sha_of(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


CADENCE = Cadence(durability_check_s=1.0, threshold_jitter=0.25)
QUERIES = [f"5ca1e000-0000-4000-8000-{i:012d}" for i in range(10)]


def test_the_model_at_the_defaults_ten_queries_one_batch_a_second() -> None:
    rates = model_rates(QUERIES, 1.0, Settings(), CADENCE, readyz_every_s=10)
    store, redis_ = rates["storage"], rates["redis"]
    # each query flushed every 7.5-10 s of threshold + half a check + half a batch interval
    assert 10 / 11 <= store["write"] <= 10 / 8.5
    assert store["lease"] == pytest.approx(1.0)  # 10 leases, each renewed every 10 s
    assert store["read"] == 0 and store["other"] == 0  # busy: no idle ping
    assert redis_["evalsha apply"] == 10 and redis_["evalsha pending"] == 1
    assert redis_["evalsha mark_flushed"] == store["write"]
    # a snapshot per check that finds a query due: 1 - e^-1 of the checks at ~1 write a check
    assert redis_["evalsha snapshot"] == checks_with_a_write(store["write"], 1.0)
    assert checks_with_a_write(1.0, 1.0) == pytest.approx(1 - math.exp(-1))
    assert checks_with_a_write(0.0, 1.0) == 0
    assert "evalsha claim_instance" not in redis_ and redis_["get"] == 1
    assert redis_["set"] == pytest.approx(0.1)
    assert behind_s(Settings(), 1.0) == 11.0


def test_the_model_moves_with_the_settings() -> None:
    idle = model_rates([], 1.0, Settings(), CADENCE)
    assert idle["storage"] == {"write": 0.0, "lease": 0.0, "read": 0.0, "other": 0.1}
    assert idle["redis"]["evalsha apply"] == 0 and idle["redis"]["set"] == 0
    slow = model_rates(QUERIES, 1.0, Settings(time_threshold_s=60, lease_duration_s=60), CADENCE)
    fast = model_rates(QUERIES, 1.0, Settings(), CADENCE)
    assert slow["storage"]["write"] < fast["storage"]["write"] / 5
    assert slow["storage"]["lease"] == pytest.approx(0.5)
    # the count threshold comes first: 5 updates at one a second
    counted = model_rates(QUERIES, 1.0, Settings(count_threshold=5), CADENCE)
    assert counted["storage"]["write"] == pytest.approx(10 / 5.0)
    assert behind_s(Settings(count_threshold=5, flush_interval_s=0.5), 1.0) == 4.5


def test_extrapolation_to_many_drivers_against_one_unit() -> None:
    unit = Limit("a unit", 20_000, "a page")
    e = extrapolate(2.5, 1000, unit)
    assert e == {"fleet_per_s": 2500.0, "share_of_limit": 0.125, "sidecars_per_unit": 8000,
                 "units_needed": 1}  # fmt: skip
    assert extrapolate(30.0, 1000, unit)["units_needed"] == 2
    assert extrapolate(0.0, 1000, unit)["sidecars_per_unit"] == 0
    assert STORAGE_ACCOUNT.per_s == 20_000 and SINGLE_BLOB.per_s == 500


def test_counts_per_sidecar_per_second_and_by_kind() -> None:
    rates = per_second({"Put Blob": 60.0, "Lease Blob (renew)": 120.0, "none": 0.0}, 60, 2)
    assert rates == {"Lease Blob (renew)": 1.0, "Put Blob": 0.5}
    assert list(rates) == ["Lease Blob (renew)", "Put Blob"]  # largest first
    kinds = {"Put Blob": "write", "Lease Blob (renew)": "lease"}
    assert by_kind(rates, kinds) == {"write": 0.5, "lease": 1.0, "read": 0.0, "other": 0.0,
                                     "total": 1.5}  # fmt: skip
    with pytest.raises(ValueError):
        per_second({"x": 1.0}, 0, 1)
    assert markdown_table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"


@pytest.mark.parametrize(
    ("new_bytes", "requests"),
    [
        (0, 0),
        (1, 1),  # one pack, one Put Blob
        (4 * MiB, 1),  # a block's worth still goes in one Put Blob
        (4 * MiB + 1, 3),  # two blocks and the block list
        (8 * MiB, 3),
        (8 * MiB + 1, 4),  # a full pack in blocks, then a small one
        (20 * MiB, 3 + 3 + 1),  # 8 + 8 + 4
    ],
)
def test_pack_requests_grow_with_bytes_not_files(new_bytes: int, requests: int) -> None:
    assert pack_requests(new_bytes) == requests


def test_snapshot_traffic_against_a_file_by_file_and_a_full_copy() -> None:
    growth = CheckpointGrowth("test", new_files=80, new_bytes=2e6, dir_files=3000,
                              dir_bytes=80e6, index_bytes=10_000)  # fmt: skip
    out = snapshot_traffic(growth, queries=10, batches_per_s=1, prune_every_s=300)
    sidecar, files, full = out["sidecar"], out["file by file"], out["full copy"]
    assert sidecar["requests_per_snapshot"] == 2  # a pack and the index
    # writes, and in time one delete of each (a pack, the index), plus 10 prune passes of 3
    # requests every 300 s
    assert sidecar["requests_per_s"] == 10 * (2 + 2) + 0.1
    assert sidecar["bytes_per_s"] == 10 * (2e6 + 10_000)
    assert files == {"requests_per_snapshot": 81, "requests_per_s": 810, "bytes_per_s": 20e6}
    assert full == {"requests_per_snapshot": 3000, "requests_per_s": 30_000, "bytes_per_s": 800e6}


def test_snapshot_fleet_puts_each_way_of_copying_against_one_account() -> None:
    growth = CheckpointGrowth("test", new_files=80, new_bytes=2e6, dir_files=3000,
                              dir_bytes=80e6, index_bytes=10_000)  # fmt: skip
    out = snapshot_fleet(growth, queries=10, batches_per_s=1, drivers=1000)
    # requests: 40.1/s per sidecar, 40,100/s for 1,000 against 20,000/s: 3 accounts
    assert out["requests"]["sidecar"]["fleet_per_s"] == 40_100
    assert out["requests"]["sidecar"]["units_needed"] == 3
    assert out["requests"]["sidecar"]["sidecars_per_unit"] == 498
    # a full copy per batch: 30,000 Put Blob/s per sidecar, 24 Gbit/s each
    assert out["requests"]["full copy"]["sidecars_per_unit"] == 0
    assert out["ingress"]["full copy"]["sidecars_per_unit"] == 3  # 800 MB/s of 3.125 GB/s
    assert out["ingress"]["sidecar"]["sidecars_per_unit"] == 155  # 20.1 MB/s each
    assert out["per_sidecar"]["file by file"]["requests_per_s"] == 810
