"""The consistent cut of batch N: exactly the files a restart of the query from N reads. Pure.

Given a listing of one query's checkpoint directory (relative ``/``-separated paths with
sizes) and ``read(path) -> bytes`` for the few small files it must parse, :func:`cut_of`
returns the :class:`Cut` of a committed batch N, or refuses with a :class:`CutError` whose
``reason`` is one of :data:`CUT_REASONS`. It makes no filesystem call of its own.

**The invariant.** A directory holding exactly the cut's files (same bytes) is a checkpoint
that Spark restarts from as if batch N had just been committed: it runs batch N+1 next, from
``offsets/N``'s end offsets, with every stateful operator's state as of the end of batch N.
Nothing of a later batch is in it, so Spark cannot mistake it for a later point.

What Spark reads on restart, and so what a cut holds (Spark 3.5 and 4.x; read from their
sources: ``MicroBatchExecution.populateStartOffsets``, ``HDFSBackedStateStoreProvider``,
``RocksDB`` / ``RocksDBFileManager``, ``CommitLog``, ``FileStreamSourceLog``):

``metadata``
    the query id.
``offsets/<b>``, ``commits/<b>`` for b ≤ N
    Spark restarts from the newest commit (N) and ``offsets/N``, and also reads
    ``offsets/N-1`` (its committed offsets); both are required, the older ones kept.
``sources/<i>/…``
    a source's own log. A file source's log has its own counter (``offsets/N`` holds
    ``{"logOffset": K}``): its entries ``0..K`` are kept (``<k>`` or ``<k>.compact``), and the
    newest compaction ≤ K plus every entry after it up to K are required. Entries after K
    belong to a later batch. Another source's directory (Kafka's initial offsets, the rate
    source's start) is kept whole, unless ``offsets/N`` has no offset for that source yet.
``state/<op>/_metadata/…``, ``state/<op>/_stateSchema/…``, ``<store>/_metadata/schema``
    each operator's metadata (``_metadata/metadata``; Spark 4's ``_metadata/v2/<b>`` and
    ``_stateSchema/<store>/<b>_<uuid>`` for b ≤ N) and each store's schema file.
``state/<op>/<partition>[/<store>]/…``
    every store of every operator and partition (a stream-stream join keeps four under its
    partition: ``left-keyToNumValues``, ``left-keyWithIndexToValue``, ``right-…``), and of each
    exactly what the provider reads to load state version V = N+1 (batch N loaded version N
    and committed N+1):

    - HDFS provider: the newest ``<s>.snapshot`` with s ≤ V and the ``<v>.delta`` files
      s < v ≤ V (all of ``1..V`` when there is no snapshot).
    - RocksDB provider: the newest ``<s>.zip`` with s ≤ V, the SST and log files its
      ``metadata`` entry names (``SSTs/<name>``, ``logs/<name>``, sizes checked), and the
      ``<v>.changelog`` files s < v ≤ V (changelog checkpointing; there is often no
      ``V.zip`` then, and none at all in the first versions: ``1..V`` replayed on empty).
    - Checkpoint format v2 (RocksDB, Spark 4): files are ``<v>_<id>.zip`` and
      ``<v>_<id>.changelog``; ``commits/N``'s ``stateUniqueIds`` names V's id per operator,
      partition and store, and ``commits/v-1`` names version v's, so the chain back to the
      snapshot is read from the commit log (it is the lineage Spark wrote into each changelog:
      each batch loads the id the previous commit names and commits a new one). Files of
      attempts no commit names are not in the cut.

    Which provider wrote a store comes from ``offsets/N``'s recorded settings (Spark restores
    them on restart), else from the files. When the newest snapshot's SSTs are not all in
    the listing (Spark was writing or deleting them while it was taken), an older snapshot
    with the changelogs after it is taken instead: Spark, restarted from the cut, loads the
    newest snapshot *in the cut*, which is that one.

**Left out, on purpose.** Checksum files (``.<name>.crc``, Hadoop's local file system's, and
``<name>.crc``, Spark's own checkpoint file checksums) are optional to Spark — it reads a file
without one and writes new ones — and one copied at another moment than its file could
disagree with it and fail the load; the snapshot keeps its own checksum of every file.
(Spark 4.1+ writes ``<name>.crc`` beside state files under checkpoint format v2 only; on
load a missing one is a warning, a mismatching one a failure: ``ChecksumCheckpointFileManager``.)
Hidden files and ``.tmp`` files are writes in progress (Spark writes to a temporary name and
renames). Spark's later batches' files. Anything the rules do not recognise is listed in
:attr:`Cut.ignored`, not copied.

**Refusals** (``CutError.reason``): ``not_committed`` (``commits/N`` not written yet — take
the cut when Spark's progress for N arrives), ``missing_file`` (a file the restart needs is
not in the listing or went away: deleted by Spark's retention, or mid-write; a later batch's
cut will do), ``unreadable`` (a file is damaged or not Spark's), ``unsupported`` (a custom
state store provider, or a layout this version does not know).
"""

from __future__ import annotations

import io
import re
import zipfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from typing import Any, Literal

import msgspec

from sidecar.errors import SidecarError
from sidecar.model import spark_dir
from sidecar.model.spark_dir import SparkCheckpointError, SparkOffsets

#: Reads one file of the listing, whole. Raises ``FileNotFoundError`` when the file is gone.
Reader = Callable[[str], bytes]
#: The size and stamp of one file of a listing of names, asked only of the files a cut keeps
#: or reads (on a network volume each is a round trip). Raises ``FileNotFoundError`` when the
#: file is gone.
Stat = Callable[[str], "ListedFile"]

CutReason = Literal["not_committed", "missing_file", "unreadable", "unsupported"]
#: Every reason a cut is refused, as metrics label it.
CUT_REASONS: tuple[CutReason, ...] = ("not_committed", "missing_file", "unreadable", "unsupported")

#: Spark's setting naming the state store provider, recorded in each ``offsets/<N>``.
PROVIDER_CONF = "spark.sql.streaming.stateStore.providerClass"
HDFS_PROVIDER = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
#: The store of an operator that has one (a join's are named).
DEFAULT_STORE = "default"
#: Directories inside a store's directory that are not stores: its schema, RocksDB's shared
#: files.
_STORE_SUBDIRS = frozenset({"_metadata", "SSTs", "logs"})

_VERSIONED = re.compile(r"(\d+)\.(delta|snapshot|zip|changelog)")
_VERSIONED_V2 = re.compile(r"(\d+)_([0-9A-Za-z-]+)\.(zip|changelog)")
_SOURCE_ENTRY = re.compile(r"(\d+)(\.compact)?")
_BATCH_PREFIXED = re.compile(r"(\d+)(_.*)?")


class Role(StrEnum):
    """What a file of a cut is to Spark."""

    METADATA = "metadata"  #: the query's ``metadata`` (its id)
    OFFSETS = "offsets"  #: ``offsets/<b>``
    COMMITS = "commits"  #: ``commits/<b>``
    SOURCE_LOG = "source_log"  #: ``sources/<i>/…``
    OPERATOR_METADATA = "operator_metadata"  #: ``state/<op>/_metadata/…``
    STATE_SCHEMA = "state_schema"  #: ``_stateSchema/…``, ``<store>/_metadata/schema``
    SNAPSHOT = "snapshot"  #: HDFS ``<v>.snapshot``
    DELTA = "delta"  #: HDFS ``<v>.delta``
    ZIP = "zip"  #: RocksDB ``<v>.zip`` / ``<v>_<id>.zip``
    CHANGELOG = "changelog"  #: RocksDB ``<v>.changelog`` / ``<v>_<id>.changelog``
    SST = "sst"  #: RocksDB ``SSTs/<name>.sst``
    ROCKSDB_LOG = "rocksdb_log"  #: RocksDB ``logs/<name>.log``


class ListedFile(msgspec.Struct, frozen=True):
    """One file of a checkpoint directory's listing."""

    #: Relative to the checkpoint location, ``/``-separated.
    path: str
    size: int
    #: The source's token for this version of the file (local: inode and mtime; Azure: the
    #: ETag); the copy checks it is unchanged. Opaque here.
    stamp: str = ""


class CutFile(msgspec.Struct, frozen=True):
    """One file of a cut, as listed, with what it is to Spark."""

    path: str
    size: int
    role: Role
    stamp: str = ""

    @property
    def listed(self) -> ListedFile:
        """The file as it was listed (what a source opens and checks it against)."""
        return ListedFile(self.path, self.size, self.stamp)


class StoreCut(msgspec.Struct, frozen=True):
    """What the cut holds of one state store: where its version ``version`` starts from."""

    operator: int
    partition: int
    store: str
    provider: Literal["hdfs", "rocksdb"]
    #: The state version a restart loads: N + 1.
    version: int
    #: The snapshot (HDFS ``.snapshot``, RocksDB ``.zip``) it starts from; 0: empty state.
    base: int
    #: The changelog or delta files replayed on the base (``version - base``).
    replayed: int
    #: Format v2: the id ``commits/N`` names for this store's version; empty under v1.
    unique_id: str = ""


class Cut(msgspec.Struct, frozen=True):
    """The files of a query's checkpoint that form a consistent cut of batch ``batch``."""

    query_id: str
    batch: int
    #: Sorted by path.
    files: tuple[CutFile, ...]
    stores: tuple[StoreCut, ...]
    #: 1, or 2 when ``commits/N`` names state store ids.
    checkpoint_format: int
    #: Files of the listing no rule recognised (not copied): ``/``-separated paths.
    ignored: tuple[str, ...] = ()
    #: Format v2: a version's id was taken from the hints (an earlier snapshot's files)
    #: because Spark's retention had deleted the commit that names it.
    hinted: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class CutError(SidecarError):
    """No consistent cut of that batch can be taken; ``reason`` (one of :data:`CUT_REASONS`)
    classifies it, the message says which file and what to do."""

    def __init__(self, message: str, *, reason: CutReason) -> None:
        super().__init__(message)
        self.reason: CutReason = reason


#: Format v2: per store directory, version → the id an earlier snapshot of the same timeline
#: holds that version's file under (:func:`v2_ids`).
Hints = Mapping[str, Mapping[int, str]]

_V2_STEM = re.compile(r"(\d+)_([^._/]+)\.(?:zip|changelog)")


def v2_ids(paths: Iterable[str]) -> dict[str, dict[int, str]]:
    """The ids of format v2 state files among ``paths`` (a snapshot's files): per store
    directory, version → id."""
    out: dict[str, dict[int, str]] = {}
    for path in paths:
        directory, _, name = path.rpartition("/")
        if directory.startswith("state/") and (m := _V2_STEM.fullmatch(name)):
            out.setdefault(directory, {})[int(m.group(1))] = m.group(2)
    return out


def cut_of(
    listing: Iterable[ListedFile], read: Reader, batch: int, hints: Hints | None = None
) -> Cut:
    """The cut of committed batch ``batch`` of the checkpoint ``listing`` describes.

    Under format v2 each state version's id is read from the commit log (``commits/v-1``);
    where Spark's retention deleted that commit, ``hints`` (the ids an earlier snapshot of
    the same timeline holds, :func:`v2_ids`) stand in, and the cut says so (``hinted``): the
    caller must then check that the snapshot does follow that earlier one (its commit of
    that batch identical), as Spark's own changelogs carry that lineage.

    ``read`` is called only for files of the listing, and only for small ones: ``metadata``,
    ``offsets/N``, ``commits/N`` (format v2: the commits back to each store's snapshot), the
    operators' metadata, and the RocksDB ``.zip`` files chosen (for their ``metadata`` entry).

    Raises:
        CutError: the batch is not committed, a file the restart needs is missing or
            unreadable, or the layout is not supported (see :data:`CUT_REASONS`).
        ValueError: ``batch`` is negative.
    """
    files = {f.path: f for f in listing}
    return cut_of_names(files, read, files.__getitem__, batch, hints)


def cut_of_names(
    paths: Iterable[str], read: Reader, stat: Stat, batch: int, hints: Hints | None = None
) -> Cut:
    """:func:`cut_of` from a listing of names alone: ``stat`` is asked only of the files the
    cut keeps or reads, each once, a file read stat-ed before it is read (its stamp then
    describes what the cut parsed, or a later version, which the copy's check refuses).

    Raises:
        CutError: as :func:`cut_of`; also ``missing_file`` when a file kept went away
            between the listing and its stat.
        ValueError: ``batch`` is negative.
    """
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    return _Cutter(paths, read, stat, batch, hints or {}).cut()


def is_noise(name: str) -> bool:
    """A file name Spark never reads back: hidden (Hadoop's ``.<name>.crc``, temporary
    ``.<name>.<uuid>.tmp``), a checksum (``<name>.crc``) or a temporary file."""
    return name.startswith(".") or name.endswith((".crc", ".tmp"))


class _Unusable(Exception):
    """A snapshot that cannot be the base (a file it names is missing, or it is damaged)."""

    def __init__(self, message: str, reason: CutReason) -> None:
        super().__init__(message)
        self.reason: CutReason = reason


class _StoreInfo(msgspec.Struct, rename="camel"):
    store_name: str
    num_partitions: int


class _OperatorMetadata(msgspec.Struct, rename="camel"):
    state_store_info: list[_StoreInfo]


class _RocksFile(msgspec.Struct, rename="camel"):
    size_bytes: int
    dfs_sst_file_name: str | None = None
    dfs_log_file_name: str | None = None


class _RocksMetadata(msgspec.Struct, rename="camel"):
    sst_files: list[_RocksFile] | None = None
    log_files: list[_RocksFile] | None = None


def _file_source_offset(offset: Any) -> int | None:
    """K of a file source's ``{"logOffset": K}``; None for any other source's offset."""
    if isinstance(offset, dict) and set(offset) == {"logOffset"}:
        value = offset["logOffset"]
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class _Cutter:
    """One cut being taken: the listing as a tree, what is kept, what is understood."""

    def __init__(
        self, paths: Iterable[str], read: Reader, stat: Stat, batch: int, hints: Hints
    ) -> None:
        self.hints = hints
        self.hinted = False
        self.files = dict.fromkeys(paths)  # path -> None (membership, in listing order)
        self.read_file = read
        self.stat_file = stat
        #: The files stat-ed so far, each once.
        self.stats: dict[str, ListedFile] = {}
        self.batch = batch
        self.version = batch + 1
        self.names: dict[str, list[str]] = defaultdict(list)  # dir -> file names in it
        self.dirs: dict[str, set[str]] = defaultdict(set)  # dir -> subdirectory names
        for path in self.files:
            parent, _, name = path.rpartition("/")
            self.names[parent].append(name)
            while parent:
                up, _, sub = parent.rpartition("/")
                if sub in self.dirs[up]:
                    break
                self.dirs[up].add(sub)
                parent = up
        self.kept: dict[str, Role] = {}
        self.understood: set[str] = set()
        self.commit_ids: dict[int, dict[int, tuple[tuple[str, ...], ...]]] = {}

    # -- reading --------------------------------------------------------------------------

    def listed(self, path: str) -> ListedFile:
        """``path``'s size and stamp (stat-ed once, when first needed)."""
        found = self.stats.get(path)
        if found is None:
            try:
                found = self.stats[path] = self.stat_file(path)
            except FileNotFoundError as exc:
                raise self.gone(path) from exc
        return found

    def read(self, path: str) -> bytes:
        self.listed(path)  # its stamp first: the copy then checks what the cut parsed
        try:
            return self.read_file(path)
        except FileNotFoundError as exc:
            raise self.gone(path) from exc

    def gone(self, path: str) -> CutError:
        return CutError(
            f"{path} went away while the cut of batch {self.batch} was taken (Spark deleted "
            "or replaced it): take the cut again, or a newer batch's",
            reason="missing_file",
        )

    def keep(self, path: str, role: Role) -> None:
        self.kept[path] = role
        self.understood.add(path)

    def files_under(self, directory: str) -> list[str]:
        """Every file below ``directory`` (recursively), as paths."""
        out = [f"{directory}/{n}" for n in self.names.get(directory, ())]
        for sub in self.dirs.get(directory, ()):
            out.extend(self.files_under(f"{directory}/{sub}"))
        return out

    def batches_in(self, directory: str) -> dict[int, str]:
        found = {}
        for name in self.names.get(directory, ()):
            if name.isascii() and name.isdigit():
                found[int(name)] = f"{directory}/{name}"
        return found

    # -- the cut --------------------------------------------------------------------------

    def cut(self) -> Cut:
        if "metadata" not in self.files:
            raise CutError(
                "the listing has no metadata file: it is not a Spark checkpoint location "
                "(a query's checkpointLocation holds metadata, offsets/ and commits/)",
                reason="missing_file",
            )
        try:
            query_id = spark_dir.parse_query_metadata(self.read("metadata"), "checkpoint")
        except SparkCheckpointError as exc:
            raise CutError(str(exc), reason="unreadable") from exc
        self.keep("metadata", Role.METADATA)
        offsets = self.logs()
        self.sources(offsets)
        ids = self.commit_state_ids(self.batch)
        stores = self.state(offsets, ids)
        files = tuple(
            CutFile(path, (listed := self.listed(path)).size, role, listed.stamp)
            for path, role in sorted(self.kept.items())
        )
        ignored = tuple(
            sorted(
                p
                for p in self.files
                if p not in self.understood and not is_noise(p.rpartition("/")[2])
            )
        )
        return Cut(
            query_id=query_id,
            batch=self.batch,
            files=files,
            stores=tuple(stores),
            checkpoint_format=2 if ids else 1,
            ignored=ignored,
            hinted=self.hinted,
        )

    def logs(self) -> SparkOffsets:
        n = self.batch
        commits, offsets = self.batches_in("commits"), self.batches_in("offsets")
        if n not in commits:
            newest = max(commits, default=None)
            if newest is None or n > newest:
                raise CutError(
                    f"batch {n} is not committed (commits/{n} is not written; the newest "
                    f"committed batch is {newest if newest is not None else 'none'}): take "
                    "the cut once Spark has committed it (its progress for the batch is the "
                    "signal)",
                    reason="not_committed",
                )
            raise CutError(
                f"commits/{n} is gone while newer batches are committed (up to {newest}): "
                "Spark's retention (spark.sql.streaming.minBatchesToRetain) deleted it; a "
                "cut of a batch that old cannot be taken, take a newer one",
                reason="missing_file",
            )
        needed = [n, n - 1] if n > 0 else [n]
        for b in needed:
            if b not in offsets:
                raise CutError(
                    f"offsets/{b} is missing (Spark's restart from batch {n} reads offsets/{n} "
                    f"and offsets/{n - 1}): deleted by Spark's retention, or the checkpoint "
                    "is damaged; take a newer batch's cut",
                    reason="missing_file",
                )
        for b, path in offsets.items():
            self.understood.add(path)
            if b <= n:
                self.keep(path, Role.OFFSETS)
        for b, path in commits.items():
            self.understood.add(path)
            if b <= n:
                self.keep(path, Role.COMMITS)
        try:
            return spark_dir.parse_offsets(self.read(offsets[n]), offsets[n])
        except SparkCheckpointError as exc:
            raise CutError(str(exc), reason="unreadable") from exc

    def commit_state_ids(self, batch: int) -> dict[int, tuple[tuple[str, ...], ...]]:
        """``commits/<batch>``'s state store ids (format v2), read once."""
        if batch not in self.commit_ids:
            path = f"commits/{batch}"
            if path not in self.files:
                raise CutError(
                    f"{path} is missing: under checkpoint format v2 the commit log names "
                    "each state version's id, and the cut needs it back to each store's "
                    "snapshot; deleted by Spark's retention, take a newer batch's cut",
                    reason="missing_file",
                )
            try:
                self.commit_ids[batch] = spark_dir.parse_commit_state_ids(self.read(path), path)
            except SparkCheckpointError as exc:
                raise CutError(str(exc), reason="unreadable") from exc
        return self.commit_ids[batch]

    # -- sources --------------------------------------------------------------------------

    def sources(self, offsets: SparkOffsets) -> None:
        for i, offset in enumerate(offsets.end_offsets):
            source = offsets.source_ids[i] if offsets.source_ids else str(i)
            directory = f"sources/{source}"
            paths = self.files_under(directory)
            if offset is None:  # nothing read yet: any entry is a later batch's
                self.understood.update(paths)
                continue
            last = _file_source_offset(offset)
            if last is None:
                for path in paths:
                    if not is_noise(path.rpartition("/")[2]):
                        self.keep(path, Role.SOURCE_LOG)
                continue
            entries: dict[int, str] = {}
            compactions = []
            for name in self.names.get(directory, ()):
                match = _SOURCE_ENTRY.fullmatch(name)
                if match is None:
                    continue
                entry = int(match[1])
                self.understood.add(f"{directory}/{name}")
                if entry <= last:
                    entries[entry] = name
                    self.keep(f"{directory}/{name}", Role.SOURCE_LOG)
                    if match[2]:
                        compactions.append(entry)
            start = max(compactions, default=-1) + 1
            gaps = [e for e in range(start, last + 1) if e not in entries]
            if gaps:
                raise CutError(
                    f"{directory}/{gaps[0]} is missing: offsets/{self.batch} reads source "
                    f"{source}'s log up to entry {last} and Spark needs every entry after its "
                    f"last compaction ({start - 1 if start else 'none'}); deleted or damaged, "
                    "take a newer batch's cut",
                    reason="missing_file",
                )

    # -- state ----------------------------------------------------------------------------

    def provider(self, offsets: SparkOffsets) -> Literal["hdfs", "rocksdb"] | None:
        cls = offsets.conf.get(PROVIDER_CONF)
        if cls is None:
            return None
        if cls == HDFS_PROVIDER or cls.endswith(".HDFSBackedStateStoreProvider"):
            return "hdfs"
        if cls == ROCKSDB_PROVIDER or cls.endswith(".RocksDBStateStoreProvider"):
            return "rocksdb"
        raise CutError(
            f"offsets/{self.batch} names state store provider {cls}: its files are unknown "
            "to checkpoint-sidecar (it reads those of Spark's HDFS and RocksDB providers); "
            "snapshots of this query cannot be taken",
            reason="unsupported",
        )

    def state(
        self, offsets: SparkOffsets, ids: dict[int, tuple[tuple[str, ...], ...]]
    ) -> list[StoreCut]:
        provider = self.provider(offsets)
        operators = sorted(int(d) for d in self.dirs.get("state", ()) if d.isdigit())
        missing = sorted(set(ids) - set(operators))
        if missing:
            raise CutError(
                f"commits/{self.batch} names state of operator {missing[0]} but state/"
                f"{missing[0]} is not in the listing: the checkpoint is incomplete",
                reason="missing_file",
            )
        stores: list[StoreCut] = []
        for op in operators:
            stores.extend(self.operator(op, provider, op in ids))
        return stores

    def operator(
        self, op: int, provider: Literal["hdfs", "rocksdb"] | None, v2: bool
    ) -> list[StoreCut]:
        base = f"state/{op}"
        layout = self.operator_metadata(base)
        self.schemas(base)
        partitions = sorted(int(d) for d in self.dirs.get(base, ()) if d.isdigit())
        expected: list[tuple[int, str]]
        if layout is not None:
            expected = [(p, s.store_name) for s in layout for p in range(s.num_partitions)]
        else:
            names: set[str] = set()
            for p in partitions:
                names.update(self.stores_in(f"{base}/{p}"))
            expected = [(p, s) for p in partitions for s in sorted(names)]
        if not expected:
            raise CutError(
                f"{base} holds no state store files: the checkpoint is incomplete (a committed "
                "batch has committed every store of its operators)",
                reason="missing_file",
            )
        out = []
        for p, store in sorted(expected):
            directory = f"{base}/{p}" if store == DEFAULT_STORE else f"{base}/{p}/{store}"
            out.append(self.store(op, p, store, directory, provider, v2))
        return out

    def stores_in(self, partition_dir: str) -> list[str]:
        """The stores of one partition directory: ``default`` when it holds store files itself,
        and each subdirectory that is not a store's own (``_metadata``, ``SSTs``, ``logs``)."""
        found = sorted(d for d in self.dirs.get(partition_dir, ()) if d not in _STORE_SUBDIRS)
        own = any(
            _VERSIONED.fullmatch(n) or _VERSIONED_V2.fullmatch(n)
            for n in self.names.get(partition_dir, ())
        )
        if own or "SSTs" in self.dirs.get(partition_dir, ()):
            found.append(DEFAULT_STORE)
        return found

    def operator_metadata(self, base: str) -> list[_StoreInfo] | None:
        """Keep ``_metadata/`` (v1 ``metadata``, Spark 4's ``v2/<b>`` for b ≤ N); the stores
        of the operator as its newest metadata ≤ N lists them, None without metadata."""
        directory = f"{base}/_metadata"
        newest: str | None = None
        for name in self.names.get(directory, ()):
            if not is_noise(name):
                self.keep(f"{directory}/{name}", Role.OPERATOR_METADATA)
        if "metadata" in self.names.get(directory, ()):
            newest = f"{directory}/metadata"
        v2 = self.batches_in(f"{directory}/v2")
        self.understood.update(v2.values())
        for b, path in v2.items():
            if b <= self.batch:
                self.keep(path, Role.OPERATOR_METADATA)
        if older := [b for b in v2 if b <= self.batch]:
            newest = v2[max(older)]
        if newest is None:
            return None
        data = self.read(newest)
        head, _, body = data.partition(b"\n")
        try:
            if not re.fullmatch(rb"v\d+", head.strip()):
                raise msgspec.DecodeError("no version line")
            return msgspec.json.decode(body, type=_OperatorMetadata).state_store_info
        except msgspec.DecodeError as exc:
            raise CutError(
                f"{newest} is not Spark's operator state metadata ('v<n>' then JSON with "
                f"stateStoreInfo): {exc}; the checkpoint is damaged",
                reason="unreadable",
            ) from exc

    def schemas(self, base: str) -> None:
        """Keep Spark 4's ``_stateSchema/<store>/<b>_<uuid>`` for b ≤ N."""
        for path in self.files_under(f"{base}/_stateSchema"):
            name = path.rpartition("/")[2]
            match = _BATCH_PREFIXED.fullmatch(name)
            if match is None or is_noise(name):
                continue
            self.understood.add(path)
            if int(match[1]) <= self.batch:
                self.keep(path, Role.STATE_SCHEMA)

    def store(
        self,
        op: int,
        partition: int,
        store: str,
        directory: str,
        provider: Literal["hdfs", "rocksdb"] | None,
        v2: bool,
    ) -> StoreCut:
        where = f"operator {op} partition {partition} store {store} ({directory})"
        for path in self.files_under(f"{directory}/_metadata"):
            if not is_noise(path.rpartition("/")[2]):
                self.keep(path, Role.STATE_SCHEMA)
        names = self.names.get(directory, [])
        kinds = set()
        for name in names:
            match = _VERSIONED.fullmatch(name) or _VERSIONED_V2.fullmatch(name)
            if match:
                self.understood.add(f"{directory}/{name}")
                kinds.add(match[match.re.groups])
        kind = provider
        if kind is None:
            kind = "hdfs" if kinds & {"delta", "snapshot"} else "rocksdb"
        if kind == "hdfs" and v2:
            raise CutError(
                f"commits/{self.batch} names state store ids for {where}, which the HDFS "
                "provider does not write (checkpoint format v2 is RocksDB's): the checkpoint "
                "is not one this version reads",
                reason="unsupported",
            )
        self.understood.update(self.files_under(f"{directory}/SSTs"))
        self.understood.update(self.files_under(f"{directory}/logs"))
        uid = ""
        if v2:
            uid = self.unique_id(op, partition, self.version, directory, where)
        base, replayed, files = self.walk(op, partition, directory, kind, v2, uid, where)
        for path, role in files:
            self.keep(path, role)
        return StoreCut(op, partition, store, kind, self.version, base, replayed, uid)

    def unique_id(self, op: int, partition: int, version: int, directory: str, where: str) -> str:
        """The id of ``version`` of this store: the one of ``commits/<version-1>``'s ids for
        the operator and partition that names a file of this store (that commit gone: the
        id the hints hold for it, when its file is there)."""
        names = set(self.names.get(directory, ()))
        hint = self.hints.get(directory, {}).get(version)
        gone = f"commits/{version - 1}" not in self.files
        if (
            gone
            and hint is not None
            and {f"{version}_{hint}.zip", f"{version}_{hint}.changelog"} & names
        ):
            self.hinted = True
            return hint
        by_operator = self.commit_state_ids(version - 1)
        partitions = by_operator.get(op)
        if partitions is None or partition >= len(partitions):
            raise CutError(
                f"commits/{version - 1} names no state store id for {where}: under checkpoint "
                "format v2 every committed batch names each store's; the checkpoint is damaged",
                reason="missing_file",
            )
        for uid in partitions[partition]:
            if f"{version}_{uid}.zip" in names or f"{version}_{uid}.changelog" in names:
                return uid
        raise CutError(
            f"{where}: no {version}_<id>.zip or .changelog for the ids commits/{version - 1} "
            f"names ({', '.join(partitions[partition])}): deleted by Spark's retention, or not "
            "written; take a newer batch's cut",
            reason="missing_file",
        )

    def walk(
        self,
        op: int,
        partition: int,
        directory: str,
        kind: Literal["hdfs", "rocksdb"],
        v2: bool,
        uid: str,
        where: str,
    ) -> tuple[int, int, list[tuple[str, Role]]]:
        """From version V down: the first (newest) usable snapshot, with every delta or
        changelog after it. Returns (base version, files replayed, files with roles)."""
        names = set(self.names.get(directory, ()))
        base_role, step_role = (
            (Role.SNAPSHOT, Role.DELTA) if kind == "hdfs" else (Role.ZIP, Role.CHANGELOG)
        )
        steps: list[tuple[str, Role]] = []
        first_problem: _Unusable | None = None
        version = self.version
        while version >= 1:
            if v2 and version != self.version:
                try:
                    uid = self.unique_id(op, partition, version, directory, where)
                except CutError:
                    if first_problem is not None:
                        raise CutError(str(first_problem), reason=first_problem.reason) from None
                    raise
            stem = f"{version}_{uid}" if v2 else str(version)
            base_name = f"{stem}.{'snapshot' if kind == 'hdfs' else 'zip'}"
            if base_name in names:
                try:
                    extra = [] if kind == "hdfs" else self.rocksdb_files(directory, base_name)
                    base = [(f"{directory}/{base_name}", base_role)]
                    return version, len(steps), base + extra + steps
                except _Unusable as problem:
                    first_problem = first_problem or problem
            step_name = f"{stem}.{'delta' if kind == 'hdfs' else 'changelog'}"
            if step_name not in names:
                if first_problem is not None:
                    raise CutError(str(first_problem), reason=first_problem.reason)
                raise CutError(
                    f"{where}: {directory}/{step_name} is missing, and no snapshot at or after "
                    f"version {version} can stand in for it: Spark loads state version "
                    f"{self.version} from the newest snapshot at or below it and the "
                    f"{'deltas' if kind == 'hdfs' else 'changelogs'} after it. Deleted by "
                    "Spark's retention, or not written; take a newer batch's cut",
                    reason="missing_file",
                )
            steps.append((f"{directory}/{step_name}", step_role))
            version -= 1
        return 0, len(steps), steps  # replayed on empty state, as Spark does from version 0

    def rocksdb_files(self, directory: str, zip_name: str) -> list[tuple[str, Role]]:
        """The SST and log files ``zip_name``'s ``metadata`` names, each in the listing with
        its size."""
        path = f"{directory}/{zip_name}"
        try:
            data = self.read(path)
        except CutError as exc:
            raise _Unusable(str(exc), "missing_file") from exc
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                text = archive.read("metadata")
            head, _, body = text.partition(b"\n")
            if not re.fullmatch(rb"v\d+", head.strip()):
                raise ValueError(f"first line {head[:20]!r} is not a version")
            meta = msgspec.json.decode(body, type=_RocksMetadata)
        except (zipfile.BadZipFile, KeyError, ValueError, msgspec.DecodeError) as exc:
            raise _Unusable(
                f"{path} is not a RocksDB checkpoint Spark can load (a zip whose 'metadata' "
                f"entry is 'v<n>' then JSON): {exc}; the file is damaged",
                "unreadable",
            ) from exc
        out = []
        named = [(f, "SSTs", f.dfs_sst_file_name, Role.SST) for f in meta.sst_files or ()]
        named += [(f, "logs", f.dfs_log_file_name, Role.ROCKSDB_LOG) for f in meta.log_files or ()]
        for entry, sub, name, role in named:
            if not name or "/" in name:
                raise _Unusable(f"{path} names a file {name!r}: the zip is damaged", "unreadable")
            needed = f"{directory}/{sub}/{name}"
            try:
                listed = self.listed(needed) if needed in self.files else None
            except CutError:
                listed = None  # gone since the listing
            if listed is None or listed.size != entry.size_bytes:
                found = "is not in the listing" if listed is None else f"has {listed.size} bytes"
                raise _Unusable(
                    f"{needed}, named by {path} with {entry.size_bytes} bytes, {found}: "
                    "Spark was writing or deleting it; take the cut again, or a newer batch's",
                    "missing_file",
                )
            out.append((needed, role))
        return out
