"""The commands that need the daemon's dependencies: ``run``, ``list``, ``show``,
``history``, ``starting-offsets``, ``doctor``, ``reset``, ``retire``,
``import-spark-checkpoint`` (imported by
``sidecar.cli.main`` when one of them is asked for)."""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import anyio
import msgspec

from sidecar.config import Config
from sidecar.daemon.app import Daemon
from sidecar.errors import (
    EXIT_FAILURE,
    EXIT_FORCED,
    EXIT_OK,
    EXIT_USAGE,
    AdminForbidden,
    AdminRefused,
    ConfigError,
    InvalidRequest,
    SidecarError,
)
from sidecar.model import checkpoint as ckpt
from sidecar.model.offsets import ResumeError, rewind, starting_offsets
from sidecar.model.stateful import rewind_refusal
from sidecar.ops import admin_tool, diagnosis, inspection, spark_import
from sidecar.wire.protocol import Reset, Retire, SourceSpec

if TYPE_CHECKING:
    from sidecar.cli.progress import Renderer

log = logging.getLogger("sidecar")
T = TypeVar("T")


def run_daemon(config: Config) -> int:
    """Run the daemon until SIGTERM/SIGINT; the process's exit code."""
    try:
        uvloop = use_uvloop(config.event_loop)
        return anyio.run(_run, config, backend="asyncio", backend_options={"use_uvloop": uvloop})
    except (SidecarError, BaseExceptionGroup) as exc:
        errors = _own_errors(exc)
        if errors is None:
            raise  # a bug: let the traceback show
    # Start-up refusals (socket in use, TCP port taken, bad configuration) arrive from
    # inside the daemon's task group, wrapped in exception groups: one clear line each.
    for error in errors:
        if isinstance(error, ConfigError) and config.log_format == "text":  # json: a log line
            print(f"checkpoint-sidecar: {error}", file=sys.stderr)
        else:
            log.error("%s", error)
    return EXIT_USAGE if any(isinstance(e, ConfigError) for e in errors) else EXIT_FAILURE


def use_uvloop(choice: str) -> bool:
    """Whether the daemon runs on uvloop (``SIDECAR_EVENT_LOOP``): ``auto`` when it is
    installed, ``uvloop`` always, ``asyncio`` never. Either way anyio's asyncio backend runs
    the daemon: uvloop is an asyncio event loop (``docs/decisions.md``, event loop).

    Raises:
        ConfigError: ``uvloop`` asked for, and the package is not installed.
    """
    if choice == "asyncio":
        return False
    try:
        import uvloop  # noqa: F401  # only whether it imports
    except ImportError:
        if choice == "uvloop":
            raise ConfigError(
                "SIDECAR_EVENT_LOOP=uvloop but the uvloop package is not installed: "
                "pip install 'checkpoint-sidecar[uvloop]', or set SIDECAR_EVENT_LOOP=auto "
                "(uvloop when installed) or asyncio"
            ) from None
        return False
    return True


def _own_errors(exc: BaseException) -> list[SidecarError] | None:
    """The SidecarErrors inside ``exc`` (nested groups flattened); None if anything else."""
    if isinstance(exc, SidecarError):
        return [exc]
    if isinstance(exc, BaseExceptionGroup):
        found: list[SidecarError] = []
        for inner in exc.exceptions:
            errors = _own_errors(inner)
            if errors is None:
                return None
            found += errors
        return found
    return None


def inspect(args: argparse.Namespace, config: Config) -> int:
    """``list``, ``show``, ``history``, ``starting-offsets``: read the checkpoints from the
    blobs."""
    try:
        if args.command == "list":
            infos = anyio.run(inspection.list_checkpoints, config)
            inspection.print_list(infos, as_json=args.json)
        elif args.command == "starting-offsets":
            partitions = {}
            for item in args.partitions:
                topic, _, count = item.rpartition("=")
                if not topic or not count.isdigit():
                    raise ConfigError(f"--partitions {item!r}: expected TOPIC=N, e.g. events=12")
                partitions[topic] = int(count)
            info = anyio.run(inspection.find_checkpoint, config, args.query)
            doc = info.document
            assert doc is not None
            rewound = args.batch is not None or args.before is not None
            if rewound:
                target = rewind(doc, batch=args.batch, before=args.before)
                refusal = rewind_refusal(doc, to_batch=target["batch_id"], explicit=False)
                if refusal is not None and not args.state_rewound:
                    raise AdminRefused(f"starting-offsets of an earlier batch refused: {refusal}")
            else:
                target = ckpt.as_builtins(doc.checkpoint())
            print(
                # Kafka's startingOffsets, or the Event Hubs connector's startingPositions
                starting_offsets(
                    target,
                    source=args.source,
                    partitions=partitions,
                    missing=args.missing,
                )
            )
        elif args.command == "history":
            info = anyio.run(inspection.find_checkpoint, config, args.query)
            inspection.print_history(info, as_json=args.json)
        else:
            info = anyio.run(inspection.find_checkpoint, config, args.query)
            if args.checkpoint:
                assert info.document is not None
                print(msgspec.json.encode(ckpt.as_builtins(info.document.checkpoint())).decode())
            else:
                inspection.print_show(info, as_json=args.json)
    except (SidecarError, ResumeError) as exc:  # ResumeError: the Spark side's resume rules
        print(f"checkpoint-sidecar: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILURE
    return EXIT_OK


def admin(args: argparse.Namespace, config: Config) -> int:
    """``reset`` / ``retire``: through the daemon, else under a lease of this process's own;
    one line saying what was done. 0 done, 1 refused or failed, 2 bad usage or forbidden."""
    by = admin_tool.who()
    try:
        if args.command == "retire":
            retire = Retire(
                name=args.query, archive=args.archive, force=args.force, reason=args.reason, by=by
            )
            result = anyio.run(admin_tool.retire, config, retire)
        else:
            sources = None
            if args.offsets is not None:
                try:
                    ends = msgspec.json.decode(args.offsets)
                except msgspec.DecodeError as exc:
                    raise InvalidRequest(f"--offsets is not JSON: {exc}") from None
                if not isinstance(ends, list) or not ends:
                    raise InvalidRequest("--offsets: a JSON array, one end offset per source")
                sources = tuple(SourceSpec(end_offset=end) for end in ends)
            elif args.batch_id is not None:
                raise InvalidRequest("--batch-id goes with --offsets")
            reason = args.reason or f"checkpoint-sidecar reset by {by}"
            reset = Reset(
                reason=reason,
                name=args.query,
                to_batch=args.to_batch,
                sources=sources,
                batch_id=args.batch_id,
                force=args.force,
                by=by,
                state_rewound=args.state_rewound,
            )
            result = anyio.run(admin_tool.reset, config, reset)
    except SidecarError as exc:
        print(f"checkpoint-sidecar: {args.command}: {exc}", file=sys.stderr)
        usage = (ConfigError, AdminForbidden, InvalidRequest)
        return EXIT_USAGE if isinstance(exc, usage) else EXIT_FAILURE
    print(result.summary())
    return EXIT_OK


def snapshot_command(args: argparse.Namespace, config: Config) -> int:
    """``snapshots QUERY`` and ``restore``: 0 done, 1 refused or failed, 2 bad usage."""
    from sidecar.cli import progress  # the snapshot modules, only for these commands
    from sidecar.ops import restore

    try:
        if args.command == "snapshots" and args.check:
            return _check(config, args)
        if args.command == "snapshots":
            if args.read_data:
                raise ConfigError("--read-data goes with --check")
            listed = anyio.run(restore.snapshots, config, args.query)
            query_id, name, found = listed.query_id, listed.name, listed.snapshots
            if args.json:
                print(msgspec.json.encode(listed).decode())
                return EXIT_OK
            print(f"query {name or '-'} ({query_id}): {len(found)} snapshot(s), newest first")
            if listed.gone is not None:
                g = listed.gone
                print(f"  gone from its location {g.location or '.'}: it holds query "
                      f"{g.found_query}'s checkpoint (found {g.at}); these snapshots are "
                      f"reclaimed {config.snapshot_abandoned_keep_s:.0f} s after that, unless "
                      "the query is snapshotted again")  # fmt: skip
            for row in found:
                mark = "*" if row.marker else " "
                print(f" {mark}batch {row.batch_id:>8}  {row.id}  {row.created_at}  {row.files} "
                      f"files  {row.bytes} bytes ({row.new_bytes} new)  "
                      f"{row.location or '.'}  {row.line}")  # fmt: skip
            if any(row.marker for row in found):
                print("  * the snapshot the checkpoint names (its marker); abandoned: a rewind "
                      "point of a timeline the query left")  # fmt: skip
            return EXIT_OK
        every_s = progress.LOG_EVERY_S if args.progress_every is None else args.progress_every
        if every_s <= 0:
            raise ConfigError("--progress-every: a number of seconds above 0")
        shown = progress.renderer(enabled=not args.no_progress, every_s=every_s)
        started = time.perf_counter()
        if args.all_root is not None:
            if args.query is not None or args.dir is not None or args.batch is not None:
                raise ConfigError("restore --all ROOT takes no QUERY, DIR or --batch")
            work = functools.partial(restore.restore_all, config, Path(args.all_root),
                                     progress=shown)  # fmt: skip
            done = anyio.run(_shown, shown, work)
        else:
            if args.query is None or args.dir is None:
                raise ConfigError("restore needs QUERY and DIR (or --all ROOT)")
            one = functools.partial(
                restore.restore_query,
                config,
                args.query,
                Path(args.dir),
                batch=args.batch,
                force=args.force,
                progress=shown,
            )
            done = [anyio.run(_shown, shown, one)]
        seconds = time.perf_counter() - started
    except SidecarError as exc:
        print(f"checkpoint-sidecar: {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILURE
    for r in done:
        if not args.json:
            for why in r.broken:  # skipped for an older snapshot of the same timeline
                print(f"broken snapshot of query {r.name or r.query_id}, skipped: {why}",
                      file=sys.stderr)  # fmt: skip
        if args.json:
            print(msgspec.json.encode(r).decode())
        elif r.outcome == "newer":
            print(f"kept {r.directory}: it holds a checkpoint on the timeline of batch "
                  f"{r.batch_id} of query {r.name or r.query_id}, at least as new")  # fmt: skip
        elif r.outcome == "elsewhere":
            print(f"not restored query {r.name or r.query_id}: {r.directory} {r.error}")
        elif r.outcome == "refused":
            print(f"refused query {r.name or r.query_id}: {r.directory} {r.error}",
                  file=sys.stderr)  # fmt: skip
        elif r.outcome == "failed":
            print(f"failed query {r.name or r.query_id}: {r.error}", file=sys.stderr)
        else:
            line = r.timeline or "none"
            print(f"restored batch {r.batch_id} of query {r.name or r.query_id} (snapshot "
                  f"{r.snapshot}, timeline {line}) into {r.directory}: {r.files} files, "
                  f"{r.bytes} bytes, checksums verified, in {r.seconds:.2f}s; "
                  f"{r.checkpoint}")  # fmt: skip
    if args.all_root is not None and not args.json:
        print(progress.summary(done, seconds))
    return EXIT_OK if all(r.ok for r in done) else EXIT_FAILURE


async def _shown(shown: Renderer | None, work: Callable[[], Awaitable[T]]) -> T:
    """``work``, with ``shown``'s progress on show while it runs (None: none). ``work``'s own
    error comes out as itself, not wrapped in the exception group of the renderer's task
    group (the command's one-line message depends on it)."""
    if shown is None:
        return await work()
    try:
        async with shown.showing():
            return await work()
    except BaseExceptionGroup as group:
        cancelled = anyio.get_cancelled_exc_class()
        _, rest = group.split(cancelled)
        if (
            rest is not None
            and len(rest.exceptions) == 1
            and isinstance(rest.exceptions[0], Exception)
        ):
            raise rest.exceptions[0] from None
        raise


def _check(config: Config, args: argparse.Namespace) -> int:
    """``snapshots QUERY --check [--read-data]``: 0 every snapshot can be restored, 1 not."""
    from sidecar.ops import restore

    check = functools.partial(restore.check, config, args.query, read_data=args.read_data)
    query_id, name, found = anyio.run(check)
    broken = [c for c in found if c.problem is not None]
    if args.json:
        print(msgspec.json.encode({"query_id": query_id, "name": name, "checked": found}).decode())
    else:
        how = "every file read back and verified" if args.read_data else "indexes and packs"
        print(f"query {name or '-'} ({query_id}): {len(found)} snapshot(s) checked ({how}), "
              f"{len(broken)} cannot be restored")  # fmt: skip
        for c in found:
            print(f"  batch {c.batch_id:>8}  {c.id}  {'ok' if c.problem is None else c.problem}")
    return EXIT_FAILURE if broken else EXIT_OK


def doctor(config: Config, *, as_json: bool) -> int:
    """``doctor``: run every check, print them; 0 all ok, 1 a warning, 2 a failure."""
    from sidecar.ops import doctor as doctor_checks  # not on the daemon's start path

    checks = anyio.run(doctor_checks.run_checks, config)
    if as_json:
        print(diagnosis.to_json(checks).decode())
    else:
        print(diagnosis.render(checks))
    return diagnosis.exit_code(checks)


def import_spark(args: argparse.Namespace, config: Config) -> int:
    """``import-spark-checkpoint PATH --query-name NAME``: write the last committed batch of
    a Spark checkpoint directory as the query's sidecar checkpoint, as a reset
    (``admin_tool.apply_reset``: through the running daemon, else under a lease of its own;
    ``--dry-run``: print it only). 0 written (or dry run), 1 refused or failed, 2 bad settings
    (the daemon's included: admin ops off)."""
    try:
        batch = spark_import.read_spark_checkpoint(args.path)
        found = anyio.run(spark_import.plan, config, args.path, batch, args.query_name)
        result = None
        if not args.dry_run:
            spark_import.check_write(found, force=args.force, state_rewound=args.state_rewound)
            reason = f"imported from Spark checkpoint {args.path} (last committed batch)"
            write = functools.partial(
                admin_tool.apply_reset,
                config,
                found.checkpoint,
                reason=reason,
                force=args.force,
                from_spark=True,
                state_rewound=args.state_rewound,
            )
            result = anyio.run(write)
    except SidecarError as exc:
        print(f"checkpoint-sidecar: {exc}", file=sys.stderr)
        usage = (ConfigError, AdminForbidden)
        return EXIT_USAGE if isinstance(exc, usage) else EXIT_FAILURE
    via = result.via if result is not None else None
    spark_import.print_adoption(
        found, via=via, as_json=args.json, force=args.force, state_rewound=args.state_rewound
    )
    return EXIT_OK


async def _run(config: Config) -> int:
    daemon = Daemon(config)
    forced = False

    async def watch_signals(scope: anyio.CancelScope) -> None:
        nonlocal forced
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if not daemon_stopping.is_set():
                    log.info(
                        "received %s: stopping gracefully (send it again to force)",
                        signal.Signals(signum).name,
                    )
                    daemon_stopping.set()
                    daemon.request_stop()
                else:
                    log.warning("received %s again: forcing exit", signal.Signals(signum).name)
                    forced = True
                    daemon.force_stop()  # its finalizers are shielded from the cancel below
                    scope.cancel()
                    return

    daemon_stopping = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_signals, tg.cancel_scope)
        await daemon.run()
        tg.cancel_scope.cancel()
    return EXIT_FORCED if forced else EXIT_OK
