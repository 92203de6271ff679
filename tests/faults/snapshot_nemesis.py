"""A seeded snapshot nemesis (issue #39 item 11): one real stateful PySpark query (RocksDB with
changelog checkpointing, a count by key over a file source whose every output is known in
advance: ``tests/integration/test_snapshot_restore.py``) snapshotted by a real daemon process,
through rounds of faults drawn from a seed alone (:func:`schedule`), with a checker throughout.

Real parts only: the daemon as a process (``DaemonProcess``: kill -9 of its whole process
group, its snapshot worker too), redis-server, Azurite behind the HTTP fault proxy
(``tests/faults/store_proxy.py``; the checker and the CLI reach Azurite directly), the JVM
listener, the ``restore`` commands as processes. Each round is one of :data:`KINDS`; every
:data:`KINDS`-long block of rounds holds each kind once, in a seeded order, so any run of that
many rounds strikes with every kind:

- ``kill -9 mid-snapshot``: a seeded moment (0 to 0.5 s) after Spark commits a batch: the cut, or
  the packs after it;
- ``kill -9 in a pack write`` / ``… an index write``: the daemon's first such request is held
  by the proxy (never answered), the daemon killed with it in flight, restarted in its pod
  (same lease id); the held write then lands late, after its writer died, or never (seeded);
- ``kill -9 in a prune``: the daemon restarted (a prune follows its first snapshot), its
  prune's marks write or first index delete held (seeded), the daemon killed; the held
  request lands late or never;
- ``lease moves mid-prune``: the same, but the lease is then broken and a **second daemon** (a
  state directory of its own: another lease id, as another pod) takes the query over; the
  first one's held prune request lands under the second one's lease (or never);
- ``store 503`` / ``store resets`` / ``store stalls``: half the requests on the snapshot blobs
  (packs, indexes, marks) answered 503 ServerBusy, reset after running upstream, or held 3 s
  (past the 2 s write timeout) while Spark runs 1 or 2 batches;
- ``rewind``: the query stopped, ``restore QUERY DIR --batch M --force`` of a seeded earlier
  snapshot of the current timeline (through the daemon), the query started on it; or (seeded)
  first a pod restart on the volume as the rewind left it, or lost, while the abandoned
  timeline's snapshots of later batches are the newest stored;
- ``pod restart``: the query and the daemon (SIGTERM, exit 0) stopped, ``restore --all ROOT``
  run as an init container would on an **intact** volume, a **lost** one (deleted), or a
  **half-restored** one (a ``restore --all`` killed -9 after a seeded delay, then a restore
  into a mount point cut short: some files, no ``metadata``), then both started again.

Every round ends with a batch run without faults and waits for its snapshot (liveness).

The checker:

- every snapshot listed restores, every file's CRC-32C verified (``sidecar.snapshot.restore``
  into a scratch directory): each new one after every round, all of them at the end with
  ``checkpoint-sidecar snapshots QUERY --check --read-data``, before and after cleanup;
- the query, from every start (a rewind, a pod restart), runs exactly the batches after the
  one restored, each output equal to the one computed here (counts continue from the state);
- ``restore --all`` restores (or keeps) only this query's directory, with this query's
  ``metadata``, and never a snapshot of an abandoned timeline — judged by a model kept here,
  not by the sidecar's lineage code: after a restore of batch M, every snapshot of a batch
  after M written before the query started again is abandoned;
- after cleanup (a prune pass with no grace period, twice: the first one's repacks leave
  packs for the second), every blob under the query's snapshots is an index that restores,
  a pack such an index names, or prune's marks: none leaked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from signal import SIGKILL
from typing import Any, TypeVar

import anyio
from azure.storage.blob.aio import BlobLeaseClient, BlobServiceClient
from pyspark.sql import SparkSession

import spark_bridge
from sidecar.config import Config
from sidecar.model.document import SnapshotRef
from sidecar.ops.restore import marker_of
from sidecar.snapshot.index import SnapshotIndex, all_prefix, prefix
from sidecar.snapshot.prune import prune
from sidecar.snapshot.restore import list_snapshots, restore
from sidecar.snapshot.retention import classify
from sidecar.store.blobs import BlobStore
from sidecar.store.snapshots import SnapshotBlobs
from tests.faults.store_proxy import Fault, StoreFaultProxy
from tests.helpers import cli, spark_conf
from tests.integration.test_snapshot_restore import (
    COMMON,
    STORES,
    Run,
    expected,
    feed,
    remove_stopped,
)
from tests.services import REPO_ROOT, DaemonProcess

log = logging.getLogger("tests.snapshot_soak")

KINDS = (
    "kill -9 mid-snapshot",
    "kill -9 in a pack write",
    "kill -9 in an index write",
    "kill -9 in a prune",
    "lease moves mid-prune",
    "store 503",
    "store resets",
    "store stalls",
    "rewind",
    "pod restart: intact volume",
    "pod restart: lost volume",
    "pod restart: half-restored volume",
)
#: Snapshots kept of the current timeline (``SIDECAR_SNAPSHOT_RETAIN``): few, so that every
#: restart's prune has indexes to delete.
RETAIN = 2
#: How long the newest batch's snapshot may take once faults are healed (liveness).
SNAPSHOT_WAIT_S = 30.0
#: How long a held request is waited for before the kill comes anyway.
HOLD_WAIT_S = 10.0
#: The store faults: on the snapshot blobs only (packs, indexes, marks).
SNAPSHOT_BLOBS = "/snapshots/"
STORE_FAULTS = {
    "store 503": Fault("status", share=0.5, status=503, path_has=SNAPSHOT_BLOBS),
    "store resets": Fault("reset", share=0.5, path_has=SNAPSHOT_BLOBS),
    "store stalls": Fault("delay_headers", share=0.5, delay_s=3.0, path_has=SNAPSHOT_BLOBS),
}
WRITES = frozenset({"create", "upload"})

T = TypeVar("T")


@dataclass(frozen=True)
class Round:
    """One round: its fault, the batches Spark runs under a store fault, a delay (a kill's,
    seconds) and a seeded number in [0, 1) for the round's choices."""

    kind: str
    batches: int
    delay_s: float
    choice: float


def schedule(seed: int, rounds: int) -> list[Round]:
    """The first ``rounds`` rounds of ``seed``: a function of both alone, and a prefix of any
    longer run's. Each block of ``len(KINDS)`` rounds holds every kind once."""
    rng = random.Random(seed)
    out: list[Round] = []
    while len(out) < rounds:
        block = list(KINDS)
        rng.shuffle(block)
        for kind in block:
            out.append(Round(kind, rng.randint(1, 2), round(rng.uniform(0, 0.5), 3), rng.random()))
    return out[:rounds]


def _created(index: SnapshotIndex) -> float:
    return datetime.fromisoformat(index.created_at).timestamp()


@dataclass
class SnapshotSoak:
    spark: SparkSession
    #: The daemon's settings with Azurite reached directly (the CLI's and the checker's).
    env: dict[str, str]
    azurite_port: int
    #: A short directory (sockets) and a roomy one (the volume, inputs, logs).
    short: Path
    work: Path
    seed: int
    #: Rounds at least (whole blocks of KINDS by default), then more until ``seconds`` passed.
    rounds: int
    seconds: float = 0.0
    #: The checker's findings: a restore (or a run from one) that is wrong.
    wrong: list[str] = field(default_factory=list)
    #: Liveness findings: a snapshot that did not come once faults were healed.
    stuck: list[str] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    restores: Counter[str] = field(default_factory=Counter)
    variants: Counter[str] = field(default_factory=Counter)
    checked: set[str] = field(default_factory=set)
    snapshot_reads: int = 0
    restarts: int = 0
    holds_missed: int = 0
    late_writes: list[int] = field(default_factory=list)
    sigterm_exits: list[int] = field(default_factory=list)
    abandoned: set[str] = field(default_factory=set)
    leaked: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root = self.work / "volume"
        self.inputs = self.work / "inputs"
        self.checkpoint = self.root / "app" / "counts"
        self.scratch = self.work / "scratch"
        self.env = self.env | {
            "SIDECAR_SNAPSHOT_ROOT": str(self.root),
            "SIDECAR_SNAPSHOT_RETAIN": str(RETAIN),
            "SIDECAR_COUNT_THRESHOLD": "1",
            "SIDECAR_TIME_THRESHOLD_S": "0.5",
            "SIDECAR_ADMIN_OPS": "true",
            "SIDECAR_ADMIN_QUIET_S": "0",
            "SIDECAR_WRITE_TIMEOUT_S": "2",
            "SIDECAR_SHUTDOWN_GRACE_S": "10",
        }
        self.config = Config.from_env(self.env)
        self.daemon: DaemonProcess | None = None
        self.identity = "a"
        self.run_: Run | None = None
        self.query_id = ""
        self.fed = -1  # the newest input file (batch) fed
        self.start = 0  # the first batch of the query's current run
        self.tag = 0

    # --- the run ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Run the rounds and the final checks; the report (``wrong_restores`` 0 when the
        checker found nothing)."""
        plan = schedule(self.seed, self.rounds)
        print(f"snapshot soak: seed {self.seed}, {self.rounds} rounds at least, "
              f"{self.seconds:.0f} s (SNAPSHOT_SOAK_SEED={self.seed} replays it)",
              flush=True)  # fmt: skip
        began = time.monotonic()
        with StoreFaultProxy(self.azurite_port, seed=self.seed) as proxy:
            self.proxy = proxy
            handle = spark_bridge.attach(self.spark, self.env["SIDECAR_SOCKET_PATH"],
                                         listener="jvm")  # fmt: skip
            try:
                conf = COMMON | STORES["rocksdb-changelog"]
                with spark_conf(self.spark, conf):
                    try:
                        self._start_daemon()
                        self._start_query(0)
                        for _ in range(RETAIN + 1):  # snapshots to prune, to rewind to
                            self._batch()
                            self._wait_snapshot()
                        done = 0
                        while done < self.rounds or time.monotonic() - began < self.seconds:
                            if done == len(plan):
                                plan = schedule(self.seed, len(plan) + len(KINDS))
                            r = plan[done]
                            log.info("snapshot soak: round %d %s %r", done, r.kind, r)
                            print(f"snapshot soak: round {done} t={time.monotonic() - began:.1f}s "
                                  f"{r.kind}", flush=True)  # fmt: skip
                            self._round(r)
                            self.faults[r.kind] += 1
                            done += 1
                            self._end_round()
                        self._finish()
                    finally:
                        self._teardown()
            finally:
                # Not asserted: the last batch ran with no daemon (its progress undelivered).
                handle.close()
        return self._report(done, time.monotonic() - began)

    def _round(self, r: Round) -> None:
        kind = r.kind
        if kind == "kill -9 mid-snapshot":
            self._batch()
            time.sleep(r.delay_s)
            self._kill()
            self._start_daemon()
        elif kind in ("kill -9 in a pack write", "kill -9 in an index write"):
            if "pack" in kind:
                fault = Fault("hold", kinds=WRITES | {"other"}, path_has="/packs/", times=1)
            else:
                fault = Fault("hold", kinds=WRITES, path_has="/index/", times=1)
            self._killed_holding([fault], r)
            self._start_daemon()
            self._late(r)
        elif kind in ("kill -9 in a prune", "lease moves mid-prune"):
            self._sigterm()
            self._start_daemon()  # its first snapshot is followed by a prune pass
            holds = [Fault("hold", kinds=frozenset({"other"}), path_has="/index/", times=1)]
            if r.choice < 0.5:  # its marks write, else its first index delete
                holds.insert(0, Fault("hold", kinds=WRITES, path_has="/unreferenced", times=1))
            self._killed_holding(holds, r)
            if kind == "lease moves mid-prune":
                self._break_lease()
                self.identity = "b" if self.identity == "a" else "a"
            self._start_daemon()
            self._late(r)
        elif kind in STORE_FAULTS:
            self.proxy.faults = [STORE_FAULTS[kind]]
            try:
                for _ in range(r.batches):
                    self._batch()
                self._wait_snapshot(timeout_s=6.0, required=False)
            finally:
                self.proxy.faults = []
        elif kind == "rewind":
            self._rewind(r)
        else:
            self._pod_restart(kind.split(": ")[1], r)

    def _end_round(self) -> None:
        """A batch without faults, its snapshot waited for; every new snapshot restored."""
        self._batch()
        self._wait_snapshot()
        self._check_new()

    # --- the daemon ---------------------------------------------------------------------------

    def _settings(self) -> dict[str, str]:
        settings = self.env | {
            "AZURE_STORAGE_CONNECTION_STRING": self.proxy.connection_string(),
            "SIDECAR_INSTANCE_ID": f"snapshot-soak-{self.identity}",
            # Each identity its own state directory: its own lease id (another pod's); a
            # restart keeps it (the same container restarted in its pod takes it over).
            "SIDECAR_STATE_DIR": str(self.short / f"state-{self.identity}"),
        }
        return settings

    def _start_daemon(self) -> None:
        old = self.daemon
        same = old is not None and old.settings["SIDECAR_INSTANCE_ID"].endswith(self.identity)
        if old is not None and same:
            new = DaemonProcess(old.settings, old.log_path)
        else:
            new = DaemonProcess(self._settings(), self.work / f"daemon-{self.identity}.log")
        if old is not None:
            self.restarts += 1
        new.start(timeout_s=60)
        self.daemon = new
        log.info("snapshot soak: daemon %s started", self.identity)

    def _kill(self) -> None:
        """kill -9 of the daemon's process group: the daemon and its snapshot worker."""
        assert self.daemon is not None and self.daemon.running
        os.killpg(self.daemon.pid, SIGKILL)
        self.daemon.wait()

    def _sigterm(self) -> None:
        assert self.daemon is not None
        code = self.daemon.stop()
        self.sigterm_exits.append(code)

    def _killed_holding(self, holds: list[Fault], r: Round) -> None:
        """Hold the daemon's first request ``holds`` match while Spark commits a batch, then
        kill it with that request in flight."""
        # The proxy counts each fault's uses by its value: a round's own, by a tag its
        # action does not read, so that the same hold in a later round applies again.
        self.tag += 1
        self.proxy.faults = [dataclasses.replace(h, delay_s=float(self.tag)) for h in holds]
        try:
            self._batch()
            deadline = time.monotonic() + HOLD_WAIT_S
            while not self.proxy.held and time.monotonic() < deadline:
                time.sleep(0.02)
            if not self.proxy.held:
                self.holds_missed += 1
                log.info("snapshot soak: nothing held for %s: killed anyway", r.kind)
            self._kill()
        finally:
            self.proxy.faults = []

    def _late(self, r: Round) -> None:
        """The held request of a dead daemon: delivered now (it lands late) or never."""
        if r.delay_s < 0.25 and self.proxy.held:
            self.late_writes.extend(self.proxy.deliver_held())
        else:
            self.proxy.held = []

    def _break_lease(self) -> None:
        async def go() -> None:
            conn = self.env["AZURE_STORAGE_CONNECTION_STRING"]
            async with BlobServiceClient.from_connection_string(conn) as service:
                blob = service.get_blob_client(
                    self.config.container, f"{self.config.namespace}/{self.query_id}.json"
                )
                try:
                    await BlobLeaseClient(blob).break_lease(lease_break_period=0)
                except Exception as exc:  # no lease right now: nothing to break
                    log.info("snapshot soak: lease not broken: %s", exc)

        anyio.run(go)

    # --- the query ----------------------------------------------------------------------------

    def _start_query(self, first: int) -> None:
        """Start the query on the checkpoint; its first batch must be ``first``."""
        out = self.checkpoint.with_name(f"out-{self.checkpoint.name}")
        shutil.rmtree(out, ignore_errors=True)
        self.start = first
        self.run_ = Run(self.spark, "count", self.inputs, self.checkpoint)
        self.query_id = str(self.run_.query.id)
        self._drain()

    def _stop_query(self) -> None:
        assert self.run_ is not None
        self.run_.stop()
        self.run_ = None

    def _batch(self) -> None:
        """Spark runs the next batch (one new input file)."""
        feed(self.inputs, "count", self.fed + 1)
        self.fed += 1
        self._drain()

    def _drain(self) -> None:
        """Every input read; the outputs of this run must be exactly the batches from its
        first, each as computed here."""
        assert self.run_ is not None
        self.run_.drain()
        log.info("snapshot soak: drained to batch %d", self.fed)
        got = self.run_.outputs
        want = {b: expected("count", b) for b in range(self.start, self.fed + 1)}
        if got != want:
            self.wrong.append(
                f"the run from batch {self.start} output batches {sorted(got)}, wanted "
                f"{sorted(want)}; differing: "
                f"{ {b: got.get(b) for b in set(got) | set(want) if got.get(b) != want.get(b)} }"
            )

    # --- the store, as the checker reads it ---------------------------------------------------

    def _store(self, work: Callable[[BlobStore, SnapshotBlobs], Awaitable[T]]) -> T:
        async def go() -> T:
            store = BlobStore(self.config)
            try:
                return await work(store, SnapshotBlobs(store.account))
            finally:
                await store.aclose()

        return anyio.run(go)

    def _listing(self) -> tuple[list[SnapshotIndex], SnapshotRef | None]:
        async def read(
            store: BlobStore, blobs: SnapshotBlobs
        ) -> tuple[list[SnapshotIndex], SnapshotRef | None]:
            found = await list_snapshots(blobs, self.config.namespace, self.query_id)
            return found, await marker_of(store, self.query_id)

        return self._store(read)

    def _wait_snapshot(self, timeout_s: float = SNAPSHOT_WAIT_S, *, required: bool = True) -> None:
        """Wait for a snapshot of the newest batch, not of an abandoned timeline."""
        deadline = time.monotonic() + timeout_s
        while True:
            found, _ = self._listing()
            if any(i.batch == self.fed and i.id not in self.abandoned for i in found):
                log.info("snapshot soak: snapshot of batch %d listed", self.fed)
                return
            if time.monotonic() > deadline:
                if required:
                    self.stuck.append(f"no snapshot of batch {self.fed} after {timeout_s}s")
                return
            time.sleep(0.1)

    def _check_new(self) -> None:
        """Restore every snapshot not checked yet, each file's checksum verified."""
        found, _ = self._listing()
        self.scratch.mkdir(parents=True, exist_ok=True)

        async def check(store: BlobStore, blobs: SnapshotBlobs) -> list[str]:
            problems = []
            for index in found:
                if index.id in self.checked:
                    continue
                dest = self.scratch / index.id
                try:
                    await restore(index, blobs, self.config.namespace, dest)
                except Exception as exc:
                    problems.append(f"snapshot {index.id} of batch {index.batch}: {exc}")
                finally:
                    shutil.rmtree(dest, ignore_errors=True)  # a sync test's loop: may block
                self.checked.add(index.id)
                self.snapshot_reads += 1
            return problems

        self.wrong.extend(f"a listed snapshot does not restore: {p}" for p in self._store(check))

    def _check_all(self, when: str) -> None:
        """``snapshots QUERY --check --read-data``: every snapshot restored and verified."""
        done = cli(self.env, "snapshots", self.query_id, "--check", "--read-data", "--json")
        found = json.loads(done.stdout)["checked"] if done.stdout.strip() else []
        self.snapshot_reads += len(found)
        bad = [c for c in found if c.get("problem")]
        if done.returncode != 0 or bad or not found:
            self.wrong.append(f"snapshots --check --read-data {when}: exit {done.returncode}, "
                              f"{bad or found}, {done.stderr[-2000:]}")  # fmt: skip

    # --- restores -----------------------------------------------------------------------------

    def _abandon_after(self, found: list[SnapshotIndex], batch: int, before: float) -> None:
        """Restored at ``batch``: the snapshots of later batches written before the query
        starts again belong to a timeline it leaves (this checker's model of timelines)."""
        self.abandoned.update(i.id for i in found if i.batch > batch and _created(i) < before)

    def _head(self, found: list[SnapshotIndex]) -> SnapshotIndex | None:
        """What a restore of the current timeline must take: its newest snapshot."""
        on = [i for i in found if i.id not in self.abandoned]
        return max(on, key=lambda i: (i.batch, i.created_at)) if on else None

    def _rewind(self, r: Round) -> None:
        found, _ = self._listing()
        earlier = sorted({i.batch for i in found if i.id not in self.abandoned} - {self.fed})
        if not earlier:
            self._batch()
            return
        target = earlier[int(r.choice * len(earlier))]
        self._stop_query()
        done = cli(self.env, "restore", self.query_id, str(self.checkpoint), "--batch",
                   str(target), "--force", "--json")  # fmt: skip
        self.restores["rewind"] += 1
        if done.returncode != 0:
            self.wrong.append(f"rewind to batch {target} failed: {done.stderr[-2000:]}")
            self._start_query(self.fed + 1)
            return
        row = json.loads(done.stdout)
        if row["batch_id"] != target or row["snapshot"] in self.abandoned:
            self.wrong.append(f"rewind to batch {target} restored {row}")
        self._abandon_after(self._listing()[0], target, time.time())
        if r.batches == 2:  # the pod restarts before the query runs again: the volume holds
            # batch M, the abandoned timeline's snapshots of later batches are newer
            volume = "intact volume" if r.delay_s < 0.25 else "lost volume"
            self.variants[f"rewind, then a pod restart: {volume}"] += 1
            self._pod_restart(volume, r, running=False)
            return
        self._start_query(target + 1)

    def _pod_restart(self, volume: str, r: Round, *, running: bool = True) -> None:
        """The driver pod restarted: ``restore --all`` before the query and the daemon."""
        if running:
            self._stop_query()
        self._sigterm()
        found, _ = self._listing()
        head = self._head(found)
        if volume != "intact volume":
            remove_stopped(self.checkpoint, quiet_s=0.5)
        if volume == "half-restored volume":
            self._restore_all_killed(0.6 + 2 * r.delay_s)
            if not (self.checkpoint / "metadata").exists():
                self._restore_all()  # complete: then cut short below
            self._cut_short(r)
        row = self._restore_all()
        if row is not None:
            self._judge(volume, row, head)
        restored = row is not None and row["outcome"] == "restored"
        batch = row["batch_id"] if restored and row is not None else self._committed()
        if restored:
            self._abandon_after(self._listing()[0], batch, time.time())
        self._start_daemon()
        self._start_query(batch + 1)

    def _committed(self) -> int:
        """The newest batch the checkpoint directory holds a commit of (-1: none)."""
        commits = self.checkpoint / "commits"
        found = (
            [int(p.name) for p in commits.iterdir() if p.name.isdigit()] if commits.is_dir() else []
        )
        return max(found, default=-1)

    def _restore_all(self) -> dict[str, Any] | None:
        """``restore --all ROOT`` (the daemon stopped): this query's row."""
        done = cli(self.env, "restore", "--all", str(self.root), "--json")
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        mine = [row for row in rows if row["query_id"] == self.query_id]
        others = [row for row in rows if row["query_id"] != self.query_id]
        if done.returncode != 0 or len(mine) != 1 or others:
            self.wrong.append(f"restore --all: exit {done.returncode}, rows {rows}, "
                              f"{done.stderr[-2000:]}")  # fmt: skip
        if mine and mine[0]["outcome"] == "restored":
            self.restores["restore --all"] += 1
        return mine[0] if mine else None

    def _restore_all_killed(self, after_s: float) -> None:
        """A ``restore --all`` killed -9 after ``after_s`` (an init container's node gone)."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "restore", "--all", str(self.root), "--json"],
            env={"PATH": "/usr/bin:/bin", **self.env, "PYTHONPATH": str(REPO_ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            proc.wait(after_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, SIGKILL)
            proc.wait()

    def _cut_short(self, r: Round) -> None:
        """What a restore into a mount point cut short leaves (it moves ``metadata`` in
        last): a seeded part of the files, no ``metadata``."""
        files = sorted(p for p in self.checkpoint.rglob("*") if p.is_file())
        rng = random.Random(r.choice)
        for path in files:
            if (path.name == "metadata" and path.parent == self.checkpoint) or rng.random() < 0.5:
                path.unlink()

    def _judge(self, volume: str, row: dict[str, Any], head: SnapshotIndex | None) -> None:
        """``restore --all``'s row for this query, against this checker's model."""
        wanted = "newer" if volume == "intact volume" else "restored"
        problems = []
        if row["outcome"] != wanted:
            problems.append(f"outcome {row['outcome']}, wanted {wanted}")
        if row["snapshot"] in self.abandoned:
            problems.append("a snapshot of an abandoned timeline")
        if wanted == "restored" and (head is None or row["snapshot"] != head.id):
            problems.append(f"not the current timeline's newest ({head and head.id})")
        if row["directory"] != str(self.checkpoint):
            problems.append(f"into {row['directory']}")
        if row.get("broken"):
            problems.append(f"broken snapshots skipped: {row['broken']}")
        try:
            held = json.loads((self.checkpoint / "metadata").read_text())["id"]
        except (OSError, ValueError, KeyError) as exc:
            held = f"unreadable ({exc})"
        if held != self.query_id:
            problems.append(f"the directory holds query {held}'s metadata")
        if problems:
            self.wrong.append(f"restore --all on a {volume}: {'; '.join(problems)}: {row}")

    # --- the end ------------------------------------------------------------------------------

    def _finish(self) -> None:
        """Stop; every snapshot restores; cleanup; nothing leaked; the marker still restores
        and the query resumes from it."""
        self._stop_query()
        self._sigterm()
        self._check_all("before cleanup")
        self._cleanup()
        self._check_all("after cleanup")
        self.leaked = self._leaks()
        # A lost volume restored from what cleanup kept; the query resumes from it.
        found, _ = self._listing()
        head = self._head(found)
        remove_stopped(self.checkpoint, quiet_s=0.5)
        row = self._restore_all()
        if row is not None:
            self._judge("lost volume", row, head)
            self._start_query(row["batch_id"] + 1)
            self._batch()
            self._stop_query()

    def _cleanup(self) -> None:
        async def go(store: BlobStore, blobs: SnapshotBlobs) -> None:
            marker = await marker_of(store, self.query_id)
            for _ in range(2):
                await prune(blobs, self.config.namespace, self.query_id, retain=RETAIN,
                            named=marker, grace_s=0.0)  # fmt: skip

        self._store(go)

    def _leaks(self) -> list[str]:
        """Blobs under the namespace's snapshots that no kept (listed, readable) index names:
        packs, indexes that cannot be read, anything else but prune's marks."""

        async def go(store: BlobStore, blobs: SnapshotBlobs) -> list[str]:
            ns = self.config.namespace
            everything = [b.name for b in await blobs.list(all_prefix(ns))]
            mine = prefix(ns, self.query_id)
            leaked = [n for n in everything if not n.startswith(mine)]
            listing = classify(await blobs.list(mine), ns, self.query_id)
            found = await list_snapshots(blobs, ns, self.query_id)
            readable = {i.id for i in found}
            named = {f.pack for i in found for f in i.files if f.size}
            leaked += [s.name for s in listing.indexes if s.id not in readable]
            leaked += [p.name for p in listing.packs.values() if p.id not in named]
            leaked += list(listing.other)
            return leaked

        return self._store(go)

    def _teardown(self) -> None:
        if self.run_ is not None:
            try:
                self.run_.query.stop()
            finally:
                self.run_ = None
        if self.daemon is not None and self.daemon.running:
            os.killpg(self.daemon.pid, SIGKILL)
            self.daemon.wait()
        for name in ("a", "b"):
            path = self.work / f"daemon-{name}.log"
            if path.exists():
                log.info("snapshot soak: daemon log tail %s:\n%s", path, path.read_text()[-3000:])

    def _report(self, rounds: int, seconds: float) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "rounds": rounds,
            "seconds": round(seconds, 1),
            "batches": self.fed + 1,
            "faults": dict(sorted(self.faults.items())),
            "variants": dict(sorted(self.variants.items())),
            "store_requests_struck": sum(self.proxy.injected.values()),
            "held_requests_missed": self.holds_missed,
            "late_writes_landed": self.late_writes,
            "daemon_restarts": self.restarts,
            "restores": dict(self.restores),
            "snapshots_restored_and_verified": self.snapshot_reads,
            "distinct_snapshots_checked": len(self.checked),
            "abandoned_snapshots": len(self.abandoned),
            "wrong_restores": len(self.wrong),
            "wrong": self.wrong,
            "stuck": self.stuck,
            "leaked_blobs": len(self.leaked),
            "leaked": self.leaked,
            "sigterm_exit_codes": self.sigterm_exits,
        }
