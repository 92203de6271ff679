"""The full paths Spark 4 records in operator metadata v2, pointed at a restore's directory
(sidecar/snapshot/relocate.py). The real thing restarted: test_snapshot_restore.py."""

from __future__ import annotations

import json

import pytest

from sidecar.snapshot.relocate import location_uri, recorded_paths_in, relocate

SCHEMA = "state/0/_stateSchema/default/0_c7fe57f9-e90a-43db-be00-1d80003e16ed"
#: As PySpark 4.3 wrote it for a transformWithState query checkpointed in /tmp/r1/ck.
METADATA = (
    b"v2\n"
    b'{"operatorInfo":{"operatorId":0,"operatorName":"transformWithStateInPySparkExec"},'
    b'"stateStoreInfo":[{"storeName":"default","numColsPrefixKey":0,"numPartitions":2,'
    b'"stateSchemaFilePaths":["file:/tmp/r1/ck/' + SCHEMA.encode() + b'"]}],'
    b'"operatorPropertiesJson":"{\\"timeMode\\":\\"NoTime\\",\\"outputMode\\":\\"Update\\",'
    b'\\"stateVariables\\":[{\\"stateName\\":\\"count\\",\\"stateVariableType\\":'
    b'\\"ValueState\\",\\"ttlEnabled\\":false}]}"}'
)


def parsed(data: bytes) -> dict[str, object]:
    head, _, body = data.partition(b"\n")
    assert head == b"v2"
    value = json.loads(body)
    assert isinstance(value, dict)
    return value


def test_schema_paths_move_under_the_new_location_and_nothing_else_changes() -> None:
    moved = relocate(METADATA, "file:/data/another pod/ck")
    expected = parsed(METADATA)
    stores = expected["stateStoreInfo"]
    assert isinstance(stores, list)
    stores[0]["stateSchemaFilePaths"] = [f"file:/data/another pod/ck/{SCHEMA}"]
    assert parsed(moved) == expected


def test_the_same_location_leaves_the_bytes_as_they_are() -> None:
    assert relocate(METADATA, "file:/tmp/r1/ck") is METADATA
    assert relocate(METADATA, "file:/tmp/r1/ck/") is METADATA


def test_every_path_of_every_store_and_spark_4_0s_single_path() -> None:
    meta = {
        "operatorInfo": {"operatorId": 3, "operatorName": "transformWithStateExec"},
        "stateStoreInfo": [
            {"storeName": "default", "stateSchemaFilePath": f"hdfs://nn/x/state/3/{SCHEMA[8:]}"},
            {
                "storeName": "other",
                "stateSchemaFilePaths": [
                    "file:/old/state/3/_stateSchema/other/0_a",
                    "file:/old/state/3/_stateSchema/other/5_b",
                    "file:/not/a/schema/file",  # not one of the checkpoint's: left alone
                ],
            },
        ],
        "operatorPropertiesJson": "{}",
    }
    data = b"v2\n" + json.dumps(meta).encode()
    stores = parsed(relocate(data, "file:/new"))["stateStoreInfo"]
    assert stores == [
        {"storeName": "default", "stateSchemaFilePath": f"file:/new/state/3/{SCHEMA[8:]}"},
        {
            "storeName": "other",
            "stateSchemaFilePaths": [
                "file:/new/state/3/_stateSchema/other/0_a",
                "file:/new/state/3/_stateSchema/other/5_b",
                "file:/not/a/schema/file",
            ],
        },
    ]


@pytest.mark.parametrize(
    "data", [b"", b"v1\n{}", b"v2", b"v2\n{not json", METADATA.replace(b"v2\n", b"v2 ")]
)
def test_anything_else_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError, match="operator metadata v2"):
        relocate(data, "file:/new")


def test_which_files_hold_recorded_paths() -> None:
    assert recorded_paths_in("state/0/_metadata/v2/0")
    assert recorded_paths_in("state/12/_metadata/v2/140")
    for path in (
        "state/0/_metadata/metadata",  # v1: no paths
        "state/0/_metadata/v2/.0.crc",
        "state/0/_stateSchema/default/0_5d1e",
        "offsets/3",
        "x/state/0/_metadata/v2/0",
    ):
        assert not recorded_paths_in(path), path


def test_a_location_as_spark_qualifies_it() -> None:
    assert location_uri("/data/ck") == "file:/data/ck"
    assert location_uri("/data/ck/") == "file:/data/ck"
    assert location_uri("/data/a b%") == "file:/data/a b%"  # Hadoop's Path: not encoded
    assert location_uri("/") == "file:/"
    with pytest.raises(ValueError, match="absolute"):
        location_uri("ck")
