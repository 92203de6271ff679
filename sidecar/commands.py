"""The commands that need the daemon's dependencies: ``run``, ``list``, ``show``,
``history``, ``starting-offsets``, ``doctor`` (imported by ``sidecar.cli`` when one of them
is asked for)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import anyio
import msgspec

from sidecar import diagnosis, report
from sidecar import doctor as doctor_checks
from sidecar.app import Daemon
from sidecar.config import Config
from sidecar.errors import EXIT_FAILURE, EXIT_FORCED, EXIT_OK, EXIT_USAGE, ConfigError, SidecarError
from sidecar.offsets import kafka_starting_offsets, rewind

log = logging.getLogger("sidecar")


def run_daemon(config: Config) -> int:
    """Run the daemon until SIGTERM/SIGINT; the process's exit code."""
    try:
        return anyio.run(_run, config)
    except (SidecarError, BaseExceptionGroup) as exc:
        errors = _own_errors(exc)
        if errors is None:
            raise  # a bug: let the traceback show
    # Start-up refusals (socket in use, TCP port taken, bad configuration) arrive from
    # inside the daemon's task group, wrapped in exception groups: one clear line each.
    for error in errors:
        if isinstance(error, ConfigError):
            print(f"checkpoint-sidecar: {error}", file=sys.stderr)
        else:
            log.error("%s", error)
    return EXIT_USAGE if any(isinstance(e, ConfigError) for e in errors) else EXIT_FAILURE


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
            infos = anyio.run(report.list_checkpoints, config)
            report.print_list(infos, as_json=args.json)
        elif args.command == "starting-offsets":
            partitions = {}
            for item in args.partitions:
                topic, _, count = item.rpartition("=")
                if not topic or not count.isdigit():
                    raise ConfigError(f"--partitions {item!r}: expected TOPIC=N, e.g. events=12")
                partitions[topic] = int(count)
            info = anyio.run(report.find_checkpoint, config, args.query)
            doc = info.document
            assert doc is not None
            rewound = args.batch is not None or args.before is not None
            print(
                kafka_starting_offsets(
                    rewind(doc, batch=args.batch, before=args.before)
                    if rewound
                    else msgspec.to_builtins(doc.checkpoint()),
                    source=args.source,
                    partitions=partitions,
                    missing=args.missing,
                )
            )
        elif args.command == "history":
            info = anyio.run(report.find_checkpoint, config, args.query)
            report.print_history(info, as_json=args.json)
        else:
            info = anyio.run(report.find_checkpoint, config, args.query)
            report.print_show(info, as_json=args.json)
    except SidecarError as exc:
        print(f"checkpoint-sidecar: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILURE
    return EXIT_OK


def doctor(config: Config, *, as_json: bool) -> int:
    """``doctor``: run every check, print them; 0 all ok, 1 a warning, 2 a failure."""
    checks = anyio.run(doctor_checks.run_checks, config)
    if as_json:
        print(diagnosis.to_json(checks).decode())
    else:
        print(diagnosis.render(checks))
    return diagnosis.exit_code(checks)


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
