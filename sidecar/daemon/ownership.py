"""This process's lease id: its own, handed over only to the same container restarted in its
pod.

The lease id decides who may write a query's blob: Azure grants a blob's lease to one id at a
time, and accepts an acquire with the id that already holds it. So each daemon process draws
a random lease id, unless the process that ran before it **in the same state directory**
left one there and is provably dead. The state directory (``SIDECAR_STATE_DIR``, by default
the socket's directory: in Kubernetes the emptyDir the driver and the sidecar share, which
outlives a container restart and belongs to one pod) holds ``<socket name>.lease``, written
and then locked (``flock``, exclusive) for the whole life of the process that holds it; the
kernel releases that lock only when the process is gone — exit, crash, ``kill -9``, OOM kill.
So, at start:

- the lock is free and the file names an id: the previous daemon of this directory is dead
  (a container restarted in its pod): take its id over and re-acquire its leases at once,
  without waiting for them to expire;
- the lock is free and there is no readable id: draw a new one and write it;
- the lock is held: a live daemon uses this directory (a second daemon given the same
  ``SIDECAR_STATE_DIR``): refuse to start, naming it.

Any other daemon — another pod, another host, a copy with the same ``SIDECAR_INSTANCE_ID`` or
the same ``HOSTNAME``, a daemon on another Redis or another Redis database — has an id of its
own, and the store refuses it the lease while this one holds it: two daemons that are not the
same container restarted in its pod never both hold, or write under, a query's lease, whatever
their identity settings and whichever Redis each uses. What a predecessor's write still in
flight can do is bounded by the blob's version: every write names the version it read
(``If-Match``), so a late write of a dead process is refused once its successor has written.
``docs/flush-owner.md`` ("Ownership") has the argument for each crash point.

The state directory must be local to the pod (an emptyDir, or the container's own
filesystem outside Kubernetes): ``flock`` is reliable within one kernel; on a network
filesystem shared by hosts it is not, and two hosts could then share an id (still never
lowering a blob: the versions fence every write).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from sidecar.errors import SidecarError

log = logging.getLogger(__name__)

_LEASE_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


class StateDirInUse(SidecarError):
    """Another live daemon holds this daemon's lease file: two daemons were given one state
    directory (and socket name)."""


def identity(configured: str | None) -> str:
    """The daemon's name in logs and in the documents it writes: the setting, else
    ``HOSTNAME`` (the pod's name under Kubernetes), else the host name. It does not decide the
    lease id."""
    return configured or os.environ.get("HOSTNAME") or socket.gethostname()


def lease_file(state_dir: str | None, socket_path: str) -> Path:
    """Where the lease id is kept: ``<state dir>/<socket file name>.lease``."""
    sock = Path(socket_path)
    return Path(state_dir or sock.parent) / f"{sock.name}.lease"


@dataclass
class LeaseId:
    """This process's lease id, and the open, locked file that keeps it (held until exit)."""

    lease_id: str
    #: Taken over from a predecessor that died in this state directory.
    inherited: bool
    path: Path
    _fd: int

    def close(self) -> None:
        """Let go of the file (the id stays in it for the next daemon of this directory)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def claim(path: Path) -> LeaseId:
    """This process's lease id, from ``path`` (see the module docstring).

    Raises:
        StateDirInUse: a live daemon holds the file.
        SidecarError: the directory cannot be written (the message names it).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SidecarError(
            f"cannot keep the lease id in {path} ({exc.strerror}): set SIDECAR_STATE_DIR to a "
            "writable directory local to the pod (by default the socket's directory)"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _read(fd).split("\n")[1:2]
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise SidecarError(f"cannot lock {path}: {exc.strerror}") from exc
        raise StateDirInUse(
            f"another live daemon ({holder[0] if holder else 'pid unknown'}) holds {path}: two "
            "daemons were given one state directory and socket name; give each its own "
            "SIDECAR_SOCKET_PATH or SIDECAR_STATE_DIR"
        ) from None
    previous = _read(fd).split("\n")[0].strip()
    inherited = bool(_LEASE_ID.fullmatch(previous))
    lease_id = previous if inherited else str(uuid.uuid4())
    # The id, then who holds it now (for the refusal above): rewritten in place.
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{lease_id}\npid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    os.fsync(fd)
    return LeaseId(lease_id, inherited, path, fd)


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", "replace")
    except OSError:
        return ""
