"""The snapshot's worker process: where a local volume's cut and reads run, and from where a
snapshot's packs and index are sent, off the daemon's interpreter and behind every other task.

One process, one job at a time (:class:`Worker`). The source (``sidecar.snapshot.source``)
runs its listings, cuts and reads here: listing thousands of files and parsing the cut is a
snapshot's main CPU cost, and in a thread of the daemon it would hold the interpreter lock the
acks need. The uploader (``sidecar.snapshot.upload``) sends from here what it reads here:
:meth:`Worker.pack` reads a group of small files with the source's reader and sends their new
contents in packs (``sidecar.snapshot.packer``), :meth:`Worker.create` the index, both through
the store's picklable target (``sidecar.snapshot.stored.RemoteBlobs``). So the daemon's event
loop receives sums and places, neither the bytes nor the store's requests. The source reads;
the writes are the store's, made from this process.

The process lowers its own priority at its first job (:func:`_lower_priority`). A failure
other than ours arrives in the daemon with the worker's traceback as a note; a worker that
dies fails that job cleanly (:class:`WorkerDied`, reason ``worker``; the source's own calls
answer it as its ``SourceError``), and the next job starts a new one.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from contextlib import suppress
from functools import partial
from typing import TypeVar

import anyio
import anyio.to_process

from sidecar.errors import SidecarError
from sidecar.snapshot.packer import Packed, PackJob, Reader, pack_files
from sidecar.snapshot.stored import Created, CreateJob, create_answered

#: The niceness the worker process adds to its own: under a busy Spark driver, the daemon's
#: acks and Spark's tasks come first, a snapshot's listing, reads and sends after them (+10
#: since the worker also sends the packs and the index; the backup lag has room: p99 0.24 s
#: against a 10 s trigger in ``bench/snapshots.py``). Where the kernel allows it the worker
#: also takes ``SCHED_IDLE`` (:func:`_lower_priority`).
NICE = 10

R = TypeVar("R")


class WorkerDied(SidecarError):
    """The worker process failed or died before it answered (``reason`` ``worker``)."""

    def __init__(self, doing: str, exc: BaseException) -> None:
        why = f"{exc!r}: {exc.__cause__!r}" if exc.__cause__ else repr(exc)
        super().__init__(
            f"the worker process {doing} failed or died ({why}): this snapshot fails, the "
            "next one starts a new worker; if it keeps dying, look for the kernel's OOM "
            "killer in the pod's events"
        )
        self.reason = "worker"


class Worker:
    """One process at the lowest priority, one job at a time, made at the first job."""

    def __init__(self) -> None:
        #: Made in the event loop, at the first job.
        self._limiter: anyio.CapacityLimiter | None = None

    async def run(self, doing: str, job: Callable[[], R]) -> R:
        """``job()`` in the worker process (picklable: a module's function, or a ``partial``
        of one); ``doing``: what, for its error.

        Raises:
            WorkerDied: the process died before it answered.
        """
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        try:
            return await anyio.to_process.run_sync(
                _in_this_worker, job, cancellable=True, limiter=self._limiter
            )
        except (anyio.BrokenWorkerProcess, ProcessLookupError) as exc:
            # ProcessLookupError: anyio kills a worker that died while it started, and that
            # kill finds it gone (anyio 4.16).
            raise WorkerDied(doing, exc) from exc

    async def pack(self, read: Reader, job: PackJob) -> Packed:
        """``job``'s files read with ``read`` (the source's reader of their location) and
        their new contents sent in packs, here; the store's errors after retries and a file
        gone or changed are answered in :attr:`~sidecar.snapshot.packer.Packed.error`.

        Raises:
            WorkerDied: see :meth:`run`.
        """
        return await self.run(f"packing {len(job.files)} files", partial(pack_files, read, job))

    async def create(self, job: CreateJob) -> Created:
        """``job``'s blob created from here (the index, after the packs it names); the
        store's errors after retries are answered in
        :attr:`~sidecar.snapshot.stored.Created.error`.

        Raises:
            WorkerDied: see :meth:`run`.
        """
        return await self.run(f"writing {job.name}", partial(create_answered, job))


#: Whether this process lowered its priority: done once, in the worker process.
_niced = False


def _lower_priority() -> None:
    """This process (the worker, before it starts a thread) behind every other on its CPU.

    Nice alone is not enough: Linux's scheduler (EEVDF) lets a running task finish its slice
    (a few ms) before a task it woke takes the CPU, so each hop of an ack (client, daemon,
    Redis) could wait a slice of the worker's. A ``SCHED_IDLE`` task is preempted at once by
    any other task that wakes, and runs on what they leave (a small share when the CPU is
    never idle: the backup lag pays, which the snapshot lag metric shows). Lowering a
    policy needs no privilege; where it is refused (a seccomp profile) nice stays."""
    os.nice(NICE)
    if hasattr(os, "SCHED_IDLE"):  # Linux
        with suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _in_this_worker(job: Callable[[], R]) -> R:
    """``job()``, in the worker process, which lowers its own priority at its first job.
    A failure other than ours arrives in the daemon with this process's traceback as a
    note."""
    global _niced
    if not _niced:
        _niced = True
        _lower_priority()
    try:
        return job()
    except SidecarError:
        raise
    except Exception as exc:  # a bug: its traceback travels with it
        exc.add_note("in the snapshot's worker process:\n" + traceback.format_exc())
        raise
