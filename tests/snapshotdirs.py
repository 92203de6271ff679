"""Spark-shaped checkpoint directories on disk, written batch by batch as Spark's HDFS state
store provider writes them, for the snapshot store's tests and benchmark (no PySpark: the
real-Spark restores are tests/integration/test_snapshot_restore.py).

Per committed batch N: ``offsets/N`` (the provider recorded, a file source's ``logOffset``),
``sources/0/N``, one ``<N+1>.delta`` per partition of operator 0 (random bytes: compressed
state does not compress further; a partition without updates writes the same tiny delta as
every other such partition, as Spark's empty deltas are alike), every ``snapshot_every``
versions a ``<v>.snapshot`` per partition (maintenance), then ``commits/N``. Each file is
written to a temporary name and renamed, as Spark does (so a rewrite is a new inode).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

QUERY_ID = "0c6b7a52-54f4-4d7e-9a53-3f1e8f6b2c11"
HDFS = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
#: What a partition without updates writes in a batch (alike across partitions and batches).
EMPTY_DELTA = b"\x00\x00\x00\x00\xff\xff\xff\xff"


def put(path: Path, data: bytes) -> None:
    """Write ``data`` at ``path`` as Spark does: a temporary name, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / f".{path.name}.{random.getrandbits(32):08x}.tmp"
    temp.write_bytes(data)
    os.replace(temp, path)


class HdfsCheckpoint:
    """A stateful query's checkpoint directory at ``root``, one :meth:`batch` at a time."""

    def __init__(
        self,
        root: Path,
        *,
        partitions: int = 20,
        delta_bytes: int = 30_000,
        snapshot_every: int = 10,
        snapshot_bytes: int | None = None,
        idle_every: int = 7,
        seed: int = 0,
        query_id: str = QUERY_ID,
    ) -> None:
        self.root = root
        self.partitions = partitions
        self.delta_bytes = delta_bytes
        self.snapshot_every = snapshot_every
        #: A ``.snapshot`` file's size (default: four deltas).
        self.snapshot_bytes = snapshot_bytes if snapshot_bytes is not None else 4 * delta_bytes
        self.idle_every = idle_every
        self.random = random.Random(seed)
        self.query_id = query_id
        self.next_batch = 0
        put(root / "metadata", json.dumps({"id": query_id}).encode())
        meta = {
            "operatorInfo": {"operatorId": 0, "operatorName": "stateStoreSave"},
            "stateStoreInfo": [
                {"storeName": "default", "numColsPrefixKey": 0, "numPartitions": partitions}
            ],
        }
        put(root / "state/0/_metadata/metadata", f"v1\n{json.dumps(meta)}".encode())

    def noise(self, size: int) -> bytes:
        return self.random.randbytes(size)

    def batch(self) -> int:
        """Write and commit the next batch; its id."""
        n = self.next_batch
        conf = {"spark.sql.streaming.stateStore.providerClass": HDFS}
        conf["spark.sql.shuffle.partitions"] = str(self.partitions)
        head = {"batchWatermarkMs": 0, "batchTimestampMs": 1_700_000_000_000 + n, "conf": conf}
        put(
            self.root / f"offsets/{n}",
            f"v1\n{json.dumps(head)}\n{json.dumps({'logOffset': n})}".encode(),
        )
        entry = {"path": f"file:///in/part-{n:05d}.json", "timestamp": n, "batchId": n}
        put(self.root / f"sources/0/{n}", f"v1\n{json.dumps(entry)}".encode())
        version = n + 1
        for p in range(self.partitions):
            idle = self.idle_every and (n + p) % self.idle_every == 0
            data = EMPTY_DELTA if idle else self.noise(self.delta_bytes)
            put(self.root / f"state/0/{p}/{version}.delta", data)
            if self.snapshot_every and version % self.snapshot_every == 0:
                put(
                    self.root / f"state/0/{p}/{version}.snapshot",
                    self.noise(self.snapshot_bytes),
                )
        put(self.root / f"commits/{n}", b'v1\n{"nextBatchWatermarkMs":0}')
        self.next_batch += 1
        return n

    def rewrite(self, relative: str) -> None:
        """Rewrite one file under the same name with other bytes (a re-run batch, v1)."""
        path = self.root / relative
        put(path, self.noise(path.stat().st_size))

    def copy_to(self, dest: Path) -> None:
        shutil.copytree(self.root, dest)


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative ``/`` paths) → its bytes; hidden files left out."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }
