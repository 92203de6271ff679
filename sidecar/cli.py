"""Command line: ``checkpoint-sidecar run`` (the daemon) and helpers.

Exit codes: 0 clean stop, 1 runtime failure, 2 bad configuration or usage, 130 forced stop.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

import anyio
import msgspec

from sidecar import __version__, report
from sidecar.app import Daemon
from sidecar.config import Config
from sidecar.errors import ConfigError, SidecarError
from sidecar.offsets import kafka_starting_offsets
from spark_bridge.handle import BridgeError
from spark_bridge.jvm import listener_jar

log = logging.getLogger("sidecar")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_FORCED = 0, 1, 2, 130


def _add_settings(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "settings", "each flag overrides its environment variable; validated at start"
    )
    for f in Config.settings():
        default = f.default
        if f.name == "socket_mode":
            default = f"{default:o}"
        group.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            metavar=f.metadata["env"],
            help=f"{f.metadata['help']} (default: {default})",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="checkpoint-sidecar",
        description="Sidecar daemon beside a Spark driver: receives each finished micro-batch's "
        "offsets on a local socket, buffers them in Redis and flushes them to Azure blobs "
        "under leases.",
        epilog="Configuration comes from SIDECAR_* environment variables; "
        "'checkpoint-sidecar run --help' lists them.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="run the daemon until SIGTERM/SIGINT",
        description="Run the daemon. SIGTERM or SIGINT stops it gracefully (stop accepting, "
        "answer what was read, flush everything pending to the blobs, release leases), "
        "within SIDECAR_SHUTDOWN_GRACE_S; a second signal forces exit.",
    )
    _add_settings(run)
    sub.add_parser(
        "listener-jar",
        help="print the path of the bundled Spark listener jar",
        description="Print the path of the JVM listener jar shipped with this package, for "
        'spark-submit --jars "$(checkpoint-sidecar listener-jar)" --conf '
        "spark.sql.streaming.streamingQueryListeners="
        "io.checkpointsidecar.SidecarStreamingListener. Exit code 1 when it was not built "
        "(a source checkout without `make setup`).",
    )
    show = sub.add_parser("config", help="print the effective configuration (secrets redacted)")
    _add_settings(show)
    lister = sub.add_parser(
        "list",
        help="list the namespace's checkpoints, read from the blobs",
        description="List every query checkpoint of the namespace, read directly from the "
        "blob store (the daemon need not run).",
    )
    lister.add_argument("--json", action="store_true", help="machine-readable output")
    _add_settings(lister)
    shower = sub.add_parser(
        "show",
        help="show one query's checkpoint, read from its blob",
        description="Show the saved checkpoint of one query (by name or id), read directly "
        "from the blob store.",
    )
    shower.add_argument("query", metavar="QUERY", help="query name or query id")
    shower.add_argument("--json", action="store_true", help="machine-readable output")
    _add_settings(shower)
    resume = sub.add_parser(
        "starting-offsets",
        help="print the Kafka startingOffsets JSON to resume a query from its saved position",
        description="Print the startingOffsets JSON for a query's Kafka source, built from "
        "the saved end offsets (the next offsets to read: no gap, no overlap). Reads the "
        "blobs directly.",
    )
    resume.add_argument("query", metavar="QUERY", help="query name or query id")
    resume.add_argument(
        "--source",
        type=int,
        default=None,
        help="index of the Kafka source when the query has several",
    )
    resume.add_argument(
        "--partitions",
        action="append",
        default=[],
        metavar="TOPIC=N",
        help="current partition count of a topic, so partitions absent from "
        "the checkpoint are named too (repeatable)",
    )
    resume.add_argument(
        "--missing",
        choices=("earliest", "latest", "error"),
        default="earliest",
        help="where absent partitions start (default: earliest)",
    )
    _add_settings(resume)
    return parser


def _config_from(args: argparse.Namespace) -> Config:
    overrides = {f.name: getattr(args, f.name) for f in Config.settings()}
    return Config.from_env(os.environ, overrides)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "listener-jar":
        return _listener_jar()
    try:
        config = _config_from(args)
    except ConfigError as exc:
        print(f"checkpoint-sidecar: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The Azure SDK logs every HTTP request at INFO; keep the daemon's own lines readable.
    logging.getLogger("azure").setLevel(
        max(logging.WARNING, logging.getLevelName(config.log_level))
    )
    if args.command in ("list", "show", "starting-offsets"):
        return _inspect(args, config)
    if args.command == "config":
        for f in Config.settings():
            print(f"{f.metadata['env']}={config.redacted(f.name)}")
        return EXIT_OK
    if "SIDECAR_NAMESPACE" not in os.environ and args.namespace is None:
        log.warning(
            "SIDECAR_NAMESPACE is not set; using %r. Set one per Spark application "
            "when several share a Redis",
            config.namespace,
        )
    try:
        config.check_runnable()
        return anyio.run(_run, config)
    except ConfigError as exc:
        print(f"checkpoint-sidecar: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SidecarError as exc:
        log.error("%s", exc)
        return EXIT_FAILURE


def _listener_jar() -> int:
    try:
        print(listener_jar())
    except BridgeError as exc:
        print(f"checkpoint-sidecar: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _inspect(args: argparse.Namespace, config: Config) -> int:
    try:
        config.check_runnable()
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
            assert info.document is not None
            print(
                kafka_starting_offsets(
                    msgspec.to_builtins(info.document.checkpoint()),
                    source=args.source,
                    partitions=partitions,
                    missing=args.missing,
                )
            )
        else:
            info = anyio.run(report.find_checkpoint, config, args.query)
            report.print_show(info, as_json=args.json)
    except SidecarError as exc:
        print(f"checkpoint-sidecar: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILURE
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
                    scope.cancel()
                    return

    daemon_stopping = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_signals, tg.cancel_scope)
        await daemon.run()
        tg.cancel_scope.cancel()
    return EXIT_FORCED if forced else EXIT_OK
