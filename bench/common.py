"""What every benchmark's ``main()`` does the same way: record the machine, the versions and
the load around the run, write ``bench/results/<name>.json``, print, and exit 0 or 1.

A benchmark gives :func:`bench_main` a ``run`` that measures and returns its report (a
dict), a ``show`` that prints it, and optionally ``ok`` (exit code 1 when it says False).
``run`` raising :class:`BenchError` (the system under test misbehaved),
``tests.services.ServiceError`` (a service did not start) or ``TimeoutError`` fails the run:
exit code 1, nothing written. Also what several benchmarks share: CPU time and resident
memory from ``/proc`` (Linux), a temp dir with redis-server and Azurite started, and the
pipelined ``drive`` loop over a daemon's socket.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from anyio.abc import ByteStream

from sidecar.wire.protocol import ClientConnection, Reply

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from tests.services import REPO_ROOT, Azurite, RedisServer, ServiceError

RESULTS_DIR = REPO_ROOT / "bench" / "results"
Report = dict[str, Any]
Pids = dict[str, int | None]  # process name -> pid; None stands for the whole machine
#: Python packages whose versions every report records (when installed).
PACKAGES = ("checkpoint-sidecar", "anyio", "redis", "hiredis", "msgspec", "azure-storage-blob")


class BenchError(Exception):
    """The system under test misbehaved (wrong reply, wrong stored state, exited)."""


def cpu_seconds(pid: int | None, *, tree: bool = False) -> float:
    """CPU time (user + system, all threads) so far of a process, or of the whole machine
    for None (every process: all but idle and iowait). ``tree``: with its descendants' —
    the live ones (a worker process: the daemon's snapshot cut) and those it waited for."""
    if pid is None:
        ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = sum(ticks) - ticks[3] - ticks[4]
        return busy / os.sysconf("SC_CLK_TCK")
    stats = _proc_stats() if tree else {pid: _proc_stat(pid)}
    if pid not in stats:
        raise BenchError(f"no /proc/{pid}/stat: the process exited")
    children: dict[int, list[int]] = {}
    for child, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(child)
    busy, pending = 0, [pid]
    while pending:
        node = pending.pop()
        fields = stats[node]
        busy += int(fields[11]) + int(fields[12])
        if tree:
            busy += int(fields[13]) + int(fields[14])
            pending.extend(children.get(node, []))
    return busy / os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int) -> list[str]:
    """``/proc/<pid>/stat``'s fields after the command (state first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _proc_stats() -> dict[int, list[str]]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = _proc_stat(int(entry.name))
            except OSError:  # exited meanwhile
                continue
    return out


def pin(pid: int | None, cpus: Collection[int]) -> None:
    """Run process ``pid``, every thread of it and of its live descendants, on ``cpus`` only
    (threads and processes they start later inherit it); no CPUs or no process: nothing.
    Affinity is per thread: a process's pid sets its main thread's alone."""
    if pid is None or not cpus:
        return
    mask = set(cpus)
    stats = _proc_stats()
    children: dict[int, list[int]] = {}
    for child, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(child)
    pending = [pid]
    while pending:
        node = pending.pop()
        try:
            for task in Path(f"/proc/{node}/task").iterdir():
                os.sched_setaffinity(int(task.name), mask)
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        pending.extend(children.get(node, []))


@dataclass(frozen=True)
class Cpus:
    """The CPUs each side of a run is pinned to (:func:`pin`; bench/snapshots.py's
    ``--placement``): the sidecar's (daemon, Redis, the ack client), Spark's (with the store),
    and all of them; empty: not pinned."""

    sidecar: frozenset[int] = frozenset()
    spark: frozenset[int] = frozenset()
    every: frozenset[int] = frozenset()

    @classmethod
    def of(cls, placement: str) -> Cpus:
        if placement == "shared":
            return cls()
        cpus = sorted(os.sched_getaffinity(0))
        if placement != "pod" or len(cpus) < 2:
            raise BenchError(f"--placement {placement!r}: 'shared', or 'pod' on 2 CPUs or more "
                             f"(this process may run on {len(cpus)})")  # fmt: skip
        return cls(frozenset(cpus[:1]), frozenset(cpus[1:]), frozenset(cpus))


def cpu_times(pids: Pids) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def rss_kib(pid: int) -> int:
    """A process's resident memory (``VmRSS``), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise BenchError(f"no VmRSS for pid {pid}: the process exited")


def services(cleanup: ExitStack, prefix: str) -> tuple[Path, RedisServer, Azurite]:
    """A temp dir under /tmp (short: sun_path limit), a redis-server and Azurite, started;
    ``cleanup`` stops them and removes the dir (in reverse: Azurite, Redis, the dir)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    cleanup.callback(shutil.rmtree, tmp, ignore_errors=True)
    redis_server = cleanup.enter_context(RedisServer())
    azurite = cleanup.enter_context(Azurite())
    return tmp, redis_server, azurite


def outcome(reply: Reply) -> str:
    """``acked`` (ok and applied), else the error's code, else ``stale``."""
    if reply.ok and reply.applied:
        return "acked"
    return reply.error.code if reply.error else "stale"


async def drive(stream: ByteStream, lines: list[bytes], counts: Counter[str], window: int) -> None:
    """Send ``lines`` keeping ``window`` in flight; count replies by :func:`outcome`."""
    conn = ClientConnection()
    sent = min(window, len(lines))
    await stream.send(b"".join(lines[:sent]))
    received = 0
    while received < len(lines):
        replies = conn.receive_data(await stream.receive())
        counts.update(outcome(reply) for reply in replies)
        received += len(replies)
        if more := lines[sent : sent + len(replies)]:
            await stream.send(b"".join(more))
            sent += len(more)


def tool_version(cmd: list[str]) -> str | None:
    """The first line ``cmd`` prints (e.g. ``[binary, "--version"]``), None if it fails."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return None
    return (out.stdout or out.stderr).strip().split("\n", 1)[0] or None


def redis_version(binary: str) -> str | None:
    """redis-server's version from ``redis-server --version`` (``… v=7.0.15 …``)."""
    line = tool_version([binary, "--version"]) or ""
    return next((w[2:] for w in line.split() if w.startswith("v=")), None)


def package_versions(extra: Iterable[str] = ()) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in (*PACKAGES, *extra):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str | None:
    """This checkout's commit, with ``-dirty`` when tracked files differ from it."""
    rev = tool_version(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"])
    if rev is None:
        return None
    dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "diff", "--quiet", "HEAD"], check=False)
    return rev + ("-dirty" if dirty.returncode else "")


def machine() -> Report:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), None)  # fmt: skip
    return {"cpu_count": os.cpu_count(), "cpu": cpu, "platform": platform.platform()}


def environment(extra_packages: Iterable[str] = ()) -> Report:
    """Machine, Python and package versions, git commit: what a report is comparable by."""
    return {
        "machine": machine(),
        "python": platform.python_version(),
        "packages": package_versions(extra_packages),
        "git_commit": git_commit(),
    }


def rounded(values: Iterable[float]) -> list[float]:
    return [round(v, 2) for v in values]


def bench_main(
    name: str,
    run: Callable[[], Report],
    show: Callable[[Report], None],
    ok: Callable[[Report], bool] = lambda _: True,
    *,
    out: Path | None = None,
    save: bool = True,
    label: str | None = None,
) -> int:
    """Run a benchmark, write its report to ``out`` (default ``bench/results/<name>.json``;
    not written when ``save`` is False), print it; the process's exit code. With ``label``
    the file maps labels to reports: this one is stored under ``label``, the others kept.
    Adds ``date_utc``, ``cpu_count``, ``loadavg_1min_before`` and ``loadavg`` (1/5/15-minute,
    before and after) unless ``run`` set them."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so cleanups run on SIGTERM too
    before = os.getloadavg()
    try:
        report = run()
    except (BenchError, ServiceError, TimeoutError) as exc:
        print(f"bench/{name}.py: FAILED: {exc!r}", file=sys.stderr)
        return 1
    header = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "loadavg_1min_before": round(before[0], 2),
        "loadavg": {"before": rounded(before), "after": rounded(os.getloadavg())},
    }
    report = {**header, **report}
    path = out or RESULTS_DIR / f"{name}.json"
    if save:
        content: Report = report
        if label is not None:
            content = json.loads(path.read_text()) if path.exists() else {}
            content[label] = report
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content, indent=2) + "\n")
    show(report)
    if save:
        shown = path.resolve()
        shown = shown.relative_to(REPO_ROOT) if shown.is_relative_to(REPO_ROOT) else shown
        print(f"  -> {shown}" + (f" [{label}]" if label is not None else ""))
    return 0 if ok(report) else 1
