"""``restore --all`` killed -9 at any point, then run again (issue #39): what the next run ends
with. Shared by ``bench/restore_kill.py`` (1 GiB, 10 kill points: ``make restore-kill``) and
``tests/faults/test_restore_kill.py`` (a few MiB, 3 kill points, in ``make test``).

The scenario (:class:`RestoreKill`): a Spark-shaped HDFS checkpoint (``tests.snapshotdirs``:
large state ``.snapshot`` files and many small deltas) snapshotted at batch
:data:`SNAPSHOT_BATCH` into Azurite from the location :data:`LOCATION`; the query ran on and
the sidecar's checkpoint document names batch :data:`DOCUMENT_BATCH` (the pod died before the
next snapshot), so a restore writes the directory back **and** moves the document to the
snapshot's batch (through Redis and the blob, under a lease of its own: no daemon runs, as
in an init container). Each kill point: the document put back at the later batch, ``restore
--all ROOT`` (a subprocess, as the init container runs it) started into an empty root (a lost
volume) or one holding the restored checkpoint, SIGKILLed at that point; what it left is
recorded, then ``restore --all ROOT`` is run again, not killed, and judged (:meth:`check`):

- **exact**: exit 0; under the root exactly the snapshot's files at the location (every
  file's size and CRC-32C equal to the index's), nothing else (no temporary directory of a
  restore left); the query's sidecar checkpoint at the snapshot's batch, its marker naming
  the snapshot;
- **refused**: exit 1 and one line naming the problem (and what to do);
- **wrong** otherwise: exit 0 with a file missing, extra or different, or the checkpoint not
  moved. Never acceptable.

Equality with the snapshot is the criterion: that Spark resumes from a restored snapshot is
what the real-Spark tests show (``tests/integration/test_snapshot_e2e.py``,
``test_snapshot_restore.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from sidecar.config import Config
from sidecar.model.document import CheckpointDocument
from sidecar.ops import admin_tool, spark_import
from sidecar.snapshot import crc
from sidecar.snapshot.contents import Contents
from sidecar.snapshot.index import SnapshotIndex
from sidecar.snapshot.source import LocalSource
from sidecar.snapshot.upload import upload_snapshot
from sidecar.store.blobs import BlobStore
from sidecar.store.snapshots import SnapshotBlobs
from tests.services import REPO_ROOT, azurite_connection_string
from tests.snapshotdirs import QUERY_ID, HdfsCheckpoint

NAME = "counts"
#: Where the checkpoint was snapshotted from, relative to the root (and restored to).
LOCATION = "app/counts"
#: The snapshot's batch, and the later one the sidecar's checkpoint names when a restore starts.
SNAPSHOT_BATCH = 5
DOCUMENT_BATCH = 7
MiB = 1024 * 1024
#: A restore's temporary directories beside the location (``sidecar.snapshot.restore``:
#: ``.<name>.restore-<id>``, and ``…-old`` for what it replaces).
TEMP_PREFIX = f".{Path(LOCATION).name}.restore-"


@dataclass
class Left:
    """What a killed run left under the root."""

    files: int
    bytes: int
    #: The location's ``metadata`` existed (Spark would take it for a checkpoint).
    metadata: bool
    #: Files at the location itself, and a restore's temporary directories beside it.
    location_files: int
    temp_dirs: list[str]


@dataclass
class Outcome:
    """A ``restore --all`` run that was not killed, judged by :meth:`RestoreKill.check`."""

    exit_code: int
    seconds: float
    #: "exact", "refused" or "wrong" (module docstring).
    verdict: str
    #: Its row's outcome (``restored``, ``newer``, ``refused``, ``failed``).
    outcome: str | None
    #: What is wrong (verdict "wrong"), or the refusal's line.
    problems: list[str] = field(default_factory=list)
    said: str | None = None


@dataclass
class Killed:
    """A run killed at ``at_s`` after its start (``killed`` False: it ended before, with
    ``exit_code``)."""

    at_s: float
    killed: bool
    exit_code: int | None
    left: Left


class RestoreKill:
    """The scenario of the module docstring, against a Redis (``redis_url``) and an Azurite
    (``azurite_port``), its files under ``work`` (short: a socket path goes there)."""

    def __init__(
        self,
        work: Path,
        redis_url: str,
        azurite_port: int,
        *,
        partitions: int,
        snapshot_bytes: int,
        delta_bytes: int = 100_000,
    ) -> None:
        self.work = work
        self.partitions = partitions
        self.snapshot_bytes = snapshot_bytes
        self.delta_bytes = delta_bytes
        self.namespace = f"k{uuid.uuid4().hex[:10]}"
        self.source = work / "source"
        self.env = {
            "SIDECAR_REDIS_URL": redis_url,
            "SIDECAR_NAMESPACE": self.namespace,
            "AZURE_STORAGE_CONNECTION_STRING": azurite_connection_string(azurite_port),
            "SIDECAR_CONTAINER": "restore-kill",
            "SIDECAR_LEASE_DURATION_S": "15",
            # No daemon: the restore moves the checkpoint under a lease of its own.
            "SIDECAR_SOCKET_PATH": str(work / "no-daemon.sock"),
        }
        self.config = Config.from_env(self.env)
        self._index: SnapshotIndex | None = None
        self.runs = 0

    @property
    def index(self) -> SnapshotIndex:
        assert self._index is not None, "prepare() first"
        return self._index

    def prepare(self) -> dict[str, Any]:
        """The checkpoint written, snapshotted at :data:`SNAPSHOT_BATCH`, run on to
        :data:`DOCUMENT_BATCH`, and the sidecar's checkpoint document there; its figures."""
        started = time.monotonic()
        ck = HdfsCheckpoint(
            self.source / LOCATION,
            partitions=self.partitions,
            delta_bytes=self.delta_bytes,
            snapshot_every=4,
            snapshot_bytes=self.snapshot_bytes,
            idle_every=0,
        )
        while ck.next_batch <= SNAPSHOT_BATCH:  # version 6: the 4.snapshot files, two deltas
            ck.batch()
        written_s = time.monotonic() - started
        started = time.monotonic()
        self._index = anyio.run(self._upload)
        uploaded_s = time.monotonic() - started
        while ck.next_batch <= DOCUMENT_BATCH:
            ck.batch()
        self.document_ahead()
        return {
            "files": len(self.index.files),
            "bytes": self.index.total_bytes,
            "packs": len(self.index.packs),
            "snapshot_batch": SNAPSHOT_BATCH,
            "document_batch": DOCUMENT_BATCH,
            "write_s": round(written_s, 2),
            "upload_s": round(uploaded_s, 2),
        }

    async def _upload(self) -> SnapshotIndex:
        store = BlobStore(self.config, creates_container=True)
        try:
            await store.ensure_container()
            result = await upload_snapshot(
                LocalSource(self.source), LOCATION, SNAPSHOT_BATCH, SnapshotBlobs(store.account),
                self.namespace, QUERY_ID, Contents(),
            )  # fmt: skip
            return result.index
        finally:
            await store.aclose()

    def document_ahead(self) -> None:
        """The sidecar's checkpoint at the source's newest batch (:data:`DOCUMENT_BATCH`),
        as an import of it writes it: what the daemon had flushed when the pod died."""

        async def write() -> None:
            batch = spark_import.read_spark_checkpoint(self.source / LOCATION)
            found = await spark_import.plan(self.config, str(self.source / LOCATION), batch, NAME)
            await admin_tool.apply_reset(
                self.config, found.checkpoint, reason="restore-kill: the query ran on",
                force=True, from_spark=True,
            )  # fmt: skip

        anyio.run(write)

    def document(self) -> CheckpointDocument | None:
        async def read() -> CheckpointDocument | None:
            store = BlobStore(self.config)
            try:
                return await store.read(QUERY_ID)
            finally:
                await store.aclose()

        return anyio.run(read)

    @contextmanager
    def lease_held(self) -> Iterator[None]:
        """The query's blob leased by another owner (an old pod's daemon still running) while
        inside: a restore's checkpoint move waits for it, its files already in place."""
        lease_id = str(uuid.uuid4())

        async def acquire() -> None:
            store = BlobStore(self.config)
            try:
                await store.acquire_lease(QUERY_ID, lease_id, 60)
            finally:
                await store.aclose()

        async def release() -> None:
            store = BlobStore(self.config)
            try:
                await store.release_lease(QUERY_ID, lease_id)
            finally:
                await store.aclose()

        anyio.run(acquire)
        try:
            yield
        finally:
            anyio.run(release)

    def _start(self, root: Path) -> tuple[subprocess.Popen[bytes], Path, Path]:
        self.runs += 1
        out, err = self.work / f"run-{self.runs}.out", self.work / f"run-{self.runs}.err"
        cmd = [sys.executable, "-m", "sidecar", "restore", "--all", str(root), "--json",
               "--no-progress"]  # fmt: skip
        env = {"PATH": "/usr/bin:/bin", **self.env, "SIDECAR_SNAPSHOT_ROOT": str(root),
               "PYTHONPATH": str(REPO_ROOT)}  # fmt: skip
        with out.open("wb") as stdout, err.open("wb") as stderr:
            proc = subprocess.Popen(
                cmd, env=env, stdout=stdout, stderr=stderr, start_new_session=True
            )
        return proc, out, err

    def killed(
        self,
        root: Path,
        *,
        at_s: float | None = None,
        when: Callable[[Path], bool] | None = None,
        timeout_s: float = 300,
    ) -> Killed:
        """``restore --all root`` started and SIGKILLed (its whole process group) ``at_s``
        after its start, or as soon as ``when(err)`` (its standard error's file) is true —
        unless it ended first; what it left."""
        proc, _, err = self._start(root)
        started = time.monotonic()
        deadline = started + timeout_s
        killed = False
        while proc.poll() is None:
            now = time.monotonic()
            if (at_s is not None and now - started >= at_s) or (when is not None and when(err)):
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                break
            if now > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise TimeoutError(f"restore --all ran past {timeout_s} s without being killed")
            time.sleep(0.001)
        at = time.monotonic() - started
        code = proc.wait()
        return Killed(round(at, 3), killed, None if killed else code, self.left(root))

    def run(self, root: Path, timeout_s: float = 300) -> Outcome:
        """``restore --all root``, not killed, judged (:meth:`check`)."""
        proc, out, err = self._start(root)
        started = time.monotonic()
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"restore --all ran past {timeout_s} s") from None
        seconds = time.monotonic() - started
        return self.check(root, code, seconds, out.read_text(), err.read_text())

    def left(self, root: Path) -> Left:
        files = size = at_location = 0
        dest = root / LOCATION
        for directory, _, names in os.walk(root):
            for name in names:
                path = Path(directory) / name
                files += 1
                size += path.lstat().st_size
                at_location += path.is_relative_to(dest)
        temps = sorted(p.name for p in dest.parent.glob(f"{TEMP_PREFIX}*"))
        return Left(files, size, (dest / "metadata").exists(), at_location, temps)

    def check(self, root: Path, code: int, seconds: float, stdout: str, stderr: str) -> Outcome:
        """The run's verdict (module docstring)."""
        rows = []
        for line in stdout.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        row = next((r for r in rows if r.get("query_id") == QUERY_ID), None)
        outcome = row["outcome"] if row is not None else None
        took = round(seconds, 3)
        if code != 0:
            said = (row or {}).get("error") or next(
                (ln for ln in reversed(stderr.splitlines()) if ln.strip()), None
            )
            problems = [] if said and "\n" not in said else [f"no one-line reason: {stderr!r}"]
            verdict = "refused" if not problems else "wrong"
            return Outcome(code, took, verdict, outcome, problems, said)
        problems = self.differences(root)
        if outcome not in ("restored", "newer"):
            problems.append(f"exit 0 with the query's row {row}")
        doc = self.document()
        marker = doc.snapshot if doc is not None else None
        if (
            doc is None
            or marker is None
            or (doc.batch_id, marker.id)
            != (
                self.index.batch,
                self.index.id,
            )
        ):
            problems.append(
                f"the sidecar's checkpoint is at batch {doc.batch_id if doc else None}, marker "
                f"{marker.id if marker else None}, not at the snapshot's batch "
                f"{self.index.batch} naming {self.index.id}"
            )
        return Outcome(code, took, "wrong" if problems else "exact", outcome, problems)

    def differences(self, root: Path) -> list[str]:
        """How the tree under ``root`` differs from the snapshot at :data:`LOCATION` (every
        file's size and CRC-32C, or SHA-256 where the index has no CRC); nothing else may be
        there. Empty: equal."""
        wanted = {f"{LOCATION}/{f.path}": f for f in self.index.files}
        parents = {p.as_posix() for path in wanted for p in Path(path).parents}
        problems: list[str] = []
        seen = set()
        for directory, dirs, names in os.walk(root):
            rel = Path(directory).relative_to(root)
            for d in dirs:
                if (rel / d).as_posix() not in parents:
                    problems.append(f"extra directory {(rel / d).as_posix()}")
            dirs[:] = [d for d in dirs if (rel / d).as_posix() in parents]
            for name in names:
                path = (rel / name).as_posix()
                entry = wanted.get(path)
                if entry is None:
                    problems.append(f"extra file {path}")
                    continue
                seen.add(path)
                data = (root / path).read_bytes()
                if len(data) != entry.size:
                    problems.append(f"{path}: {len(data)} bytes, not {entry.size}")
                elif entry.crc32c is not None and crc.AVAILABLE:
                    if crc.crc32c(data) != entry.crc32c:
                        problems.append(f"{path}: its CRC-32C differs from the index's")
                elif hashlib.sha256(data).digest() != entry.sha256:
                    problems.append(f"{path}: its SHA-256 differs from the index's")
        problems.extend(f"missing {p}" for p in sorted(set(wanted) - seen))
        return problems


def stderr_says(text: str) -> Callable[[Path], bool]:
    """A ``when`` for :meth:`RestoreKill.killed`: the run's standard error holds ``text``."""

    def said(err: Path) -> bool:
        try:
            return text in err.read_text(errors="replace")
        except FileNotFoundError:
            return False

    return said


def downloading(root: Path) -> Callable[[Path], bool]:
    """A ``when`` for :meth:`RestoreKill.killed`: a restore's temporary directory beside the
    location under ``root`` holds a file with bytes (its downloads are under way)."""

    def under_way(_: Path) -> bool:
        try:
            for temp in (root / LOCATION).parent.glob(f"{TEMP_PREFIX}*"):
                if any(p.is_file() and p.stat().st_size for p in temp.rglob("*")):
                    return True
        except OSError:  # renamed or removed meanwhile
            return False
        return False

    return under_way


def downloaded(root: Path, total_bytes: int) -> Callable[[Path], bool]:
    """A ``when``: a restore's temporary directory under ``root`` holds ``total_bytes`` (every
    byte downloaded: what is left is the syncs and the rename into place)."""

    def done(_: Path) -> bool:
        try:
            for temp in (root / LOCATION).parent.glob(f"{TEMP_PREFIX}*"):
                size = sum(p.stat().st_size for p in temp.rglob("*") if p.is_file())
                if size >= total_bytes:
                    return True
        except OSError:
            return False
        return False

    return done


def placed(root: Path) -> Callable[[Path], bool]:
    """A ``when``: the location under ``root`` has its ``metadata`` (the files renamed into
    place; the checkpoint's move next)."""
    return lambda _: (root / LOCATION / "metadata").exists()
