"""The snapshot blobs as this package reaches them: the protocol of their I/O edge, one
storage call retried, an index read, and the errors of a task group unwrapped.

The edge itself is ``sidecar.store.snapshots.SnapshotBlobs`` (create-only streamed puts,
conditional replaces, listings, ranged reads, idempotent deletes); the daemon and the CLI hand
it in, so this package depends on the store only through :class:`SnapshotStore`, as ``flush``
does.

**Retries.** A storage call that fails retriably (``StoreUnavailable``: a timeout, a dropped
connection, 408, 429, 5xx) is tried again, :data:`ATTEMPTS` times at most, after a jittered
backoff that honours the store's ``Retry-After``; anything else fails the operation at once.
A create-only write sent again after a send whose outcome was unknown (the connection
dropped after the store wrote it) finds the blob there: blob ids are random, so that is the
earlier send's, complete (a Put Blob or a Put Block List lands whole or not at all), and
counts as written (:func:`create`; :func:`create_blocking` in a worker process, through the
store's :class:`RemoteBlobs`, with the same policy).
"""

from __future__ import annotations

import logging
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import aclosing, contextmanager
from typing import NamedTuple, Protocol, TypeVar

import anyio

from sidecar.backoff import Backoff
from sidecar.errors import CorruptRecord, SidecarError, StoreUnavailable, VersionConflict
from sidecar.snapshot.index import SnapshotIndex, decode_index
from sidecar.snapshot.retention import ListedLike

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Tries of one storage call that fails retriably, the first included.
ATTEMPTS = 4
#: The retry backoff: first delay and cap, seconds (jittered; a ``Retry-After`` is honoured
#: up to the cap).
RETRY_BASE_S = 0.2
RETRY_CAP_S = 5.0
_schedule = Backoff(RETRY_BASE_S, RETRY_CAP_S)


class RemoteBlobs(Protocol):
    """Where another process writes a store's blobs (``sidecar.store.remote.BlobTarget``):
    picklable, its client made in the process that writes."""

    def put(self, name: str, body: bytes, count: Callable[[str], None]) -> str:
        """Create ``name`` holding ``body`` (never overwrites: ``VersionConflict``); its
        version. ``count`` is told each request's kind as it is sent."""
        ...


class SnapshotStore(Protocol):
    """What the snapshot package needs of its blobs (``sidecar.store.snapshots.SnapshotBlobs``;
    its docstrings say what each call raises)."""

    @property
    def block_bytes(self) -> int:
        """A body smaller than this goes up in one request; a larger one in blocks of it."""
        ...

    @property
    def requests(self) -> dict[str, int]:
        """Requests sent through this object, by kind (put, block, commit, list, read, delete)."""
        ...

    def counted(self) -> SnapshotStore:
        """A view counting only its own calls in :attr:`requests` (and still in this one's)."""
        ...

    def target(self) -> RemoteBlobs | None:
        """Where another process can write this store's blobs; None: only through this
        object (then a snapshot's packs and index go up from the daemon)."""
        ...

    def sent_elsewhere(
        self, requests: Mapping[str, int], failures: Sequence[tuple[str, str]]
    ) -> None:
        """Count the requests another process sent to :meth:`target` as this object's, and
        tell the store each (call, reason) that failed there."""
        ...

    async def put(self, name: str, chunks: AsyncIterable[bytes]) -> tuple[int, str]:
        """Create ``name`` from ``chunks`` (never overwrites: ``VersionConflict``)."""
        ...

    async def replace(self, name: str, body: bytes, version: str) -> str:
        """Overwrite ``name`` if still at ``version`` (else ``VersionConflict``)."""
        ...

    async def list(self, prefix: str) -> Sequence[ListedLike]: ...

    async def read(self, name: str) -> tuple[bytes, str] | None: ...

    async def read_range(self, name: str, offset: int, length: int) -> bytes: ...

    async def delete(self, name: str, version: str | None = None) -> bool: ...


async def retried(what: str, call: Callable[[], Awaitable[T]], *, attempts: int | None = None) -> T:
    """``call()``, tried again after a retriable store failure (see the module docstring);
    ``attempts`` tries at most (default :data:`ATTEMPTS`).

    Raises:
        StoreUnavailable: still failing after ``attempts`` tries.
        SidecarError: any other failure, at once.
    """
    attempts = ATTEMPTS if attempts is None else attempts
    attempt = 1
    while True:
        try:
            return await call()
        except StoreUnavailable as exc:
            retry = _retry(what, attempt, attempts, exc)
            if retry is None:
                raise
            log.warning("%s", retry.said)
            await anyio.sleep(retry.delay_s)
            attempt += 1


class _Retry(NamedTuple):
    delay_s: float
    #: The log line that says so.
    said: str


def _retry(what: str, attempt: int, attempts: int, exc: StoreUnavailable) -> _Retry | None:
    """When try ``attempt`` of ``what`` failed with ``exc``, the wait before the next one
    (jittered, at least the store's ``Retry-After``); None when it was the last."""
    if attempt >= attempts:
        return None
    delay = _schedule.after(attempt, at_least_s=exc.retry_after_s or 0.0)
    return _Retry(
        delay,
        f"snapshot store call failed, retrying: call={what} attempt={attempt} of={attempts} "
        f"delay_s={delay:.2f} error={exc}",
    )


class Sent(NamedTuple):
    """What :func:`create_blocking` calls sent and met, for the daemon to count and log."""

    #: Requests by kind (put, block, commit).
    requests: dict[str, int]
    #: The reason of each failed try (``StoreUnavailable.reason``).
    failures: list[str]
    #: Log lines, with their levels: a retry's (WARNING), a send found landed (INFO).
    said: list[tuple[int, str]]


def create_blocking(
    blobs: RemoteBlobs, name: str, body: bytes, sent: Sent, *, attempts: int | None = None
) -> str:
    """:func:`create` in a worker process (blocking): ``name`` created from ``body`` through
    ``blobs``, retried with the same policy; its version, or "" when an earlier send landed.
    What it sent and met is added to ``sent``.

    Raises:
        StoreUnavailable: still failing after ``attempts`` tries.
        SidecarError: any other failure, at once.
    """
    attempts = ATTEMPTS if attempts is None else attempts
    attempt = 1

    def count(kind: str) -> None:
        sent.requests[kind] = sent.requests.get(kind, 0) + 1

    while True:
        try:
            return blobs.put(name, body, count)
        except VersionConflict:
            landed = f"snapshot blob landed at an earlier send: blob={name}"
            sent.said.append((logging.INFO, landed))
            return ""
        except StoreUnavailable as exc:
            sent.failures.append(exc.reason)
            retry = _retry(f"create {name}", attempt, attempts, exc)
            if retry is None:
                raise
            sent.said.append((logging.WARNING, retry.said))
            time.sleep(retry.delay_s)
            attempt += 1


class CreateJob(NamedTuple):
    """A blob for a worker process to create (:func:`create_answered`): a snapshot's index."""

    blobs: RemoteBlobs
    name: str
    body: bytes
    #: Tries of the write (:data:`ATTEMPTS`, as the daemon has it).
    attempts: int


class Created(NamedTuple):
    """A :class:`CreateJob` done: the blob's version ("" when an earlier send landed) and what
    its calls sent and met; with :attr:`error`, the store's error after retries (no version)."""

    version: str
    sent: Sent
    error: SidecarError | None = None


def create_answered(job: CreateJob) -> Created:
    """:func:`create_blocking` of ``job`` whose failure is answered beside what it sent, so
    that the daemon counts a failed job's requests too, then raises its error."""
    sent = Sent({}, [], [])
    try:
        version = create_blocking(job.blobs, job.name, job.body, sent, attempts=job.attempts)
    except SidecarError as exc:
        return Created("", sent, exc)
    return Created(version, sent)


async def create(
    blobs: SnapshotStore,
    name: str,
    chunks: Callable[[], AsyncGenerator[bytes, None]],
    *,
    attempts: int | None = None,
) -> str:
    """Create ``name`` — a random name, never reused — from a fresh ``chunks()`` per attempt,
    retried; its version, or "" when the blob was found there already: an earlier send of
    ours landed (a retry here, or the HTTP client's own resend of an idempotent PUT whose
    connection dropped: aiohttp resends once on a pooled connection).

    Raises:
        StoreUnavailable: still failing after ``attempts`` tries.
    """

    async def once() -> str:
        body = chunks()
        async with aclosing(body):
            try:
                return (await blobs.put(name, body))[1]
            except VersionConflict:
                log.info("snapshot blob landed at an earlier send: blob=%s", name)
                return ""

    return await retried(f"create {name}", once, attempts=attempts)


async def chunks_of(data: bytes | bytearray | memoryview, size: int) -> AsyncGenerator[bytes, None]:
    """``data`` in slices of ``size`` bytes, for a put (views: no copy)."""
    view = memoryview(data)
    for start in range(0, len(view), size):
        yield view[start : start + size]  # type: ignore[misc]  # a put takes any buffer
    if not view:
        yield b""


async def read_index(blobs: SnapshotStore, name: str) -> tuple[SnapshotIndex, str] | None:
    """The index blob ``name`` and its version, retried; None when it is gone.

    Raises:
        CorruptRecord: it is not an index this version reads.
    """
    found = await retried(f"read {name}", lambda: blobs.read(name))
    if found is None:
        return None
    body, version = found
    return decode_index(body, name), version


#: Index blobs read at once when many are (a restarted process's contents, a listing).
READ_CONCURRENCY = 8


async def read_indexes(
    blobs: SnapshotStore, names: Iterable[str]
) -> dict[str, tuple[SnapshotIndex, str]]:
    """Each index blob of ``names`` that can be read, with its version, :data:`READ_CONCURRENCY`
    at a time, retried; one that is gone is left out, one this version cannot read skipped
    (logged).

    Raises:
        SidecarError: the store's errors after retries.
    """
    found: dict[str, tuple[SnapshotIndex, str]] = {}
    limiter = anyio.CapacityLimiter(READ_CONCURRENCY)

    async def read(name: str) -> None:
        async with limiter:
            try:
                got = await read_index(blobs, name)
            except CorruptRecord as exc:
                log.warning("snapshot index skipped: blob=%s problem=%s", name, exc.problem)
                return
        if got is not None:
            found[name] = got

    with first_error():
        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(read, name)
    return found


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


@contextmanager
def first_error() -> Iterator[None]:
    """Raise a task group's first error itself, not its group (callers catch typed errors);
    the others, if any, are noted on it."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        first = leaves[0]
        if len(leaves) > 1:
            first.add_note(
                f"and {len(leaves) - 1} more: "
                + "; ".join(f"{type(e).__name__}: {e}" for e in leaves[1:4])
            )
        raise first from None
