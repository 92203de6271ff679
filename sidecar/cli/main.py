"""Command line: ``checkpoint-sidecar run`` (the daemon) and helpers.

Parsing, ``config`` and ``listener-jar`` need only the base install (what a Spark driver has);
the commands that run the daemon or read the blobs live in ``sidecar.cli.commands`` and are
imported when used, so a driver without the ``daemon`` extra still gets a working
``checkpoint-sidecar listener-jar`` and a clear message for the rest.

Exit codes: 0 clean stop, 1 runtime failure, 2 bad configuration or usage, 130 forced stop.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, TypeAlias

from sidecar import __version__
from sidecar.config import Config
from sidecar.errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, ConfigError
from sidecar.telemetry import logs
from spark_bridge.handle import BridgeError
from spark_bridge.jvm import listener_jar

log = logging.getLogger("sidecar")


#: What ``add_subparsers`` returns; argparse names the type only in its stubs.
_Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _commands() -> ModuleType | None:
    """``sidecar.cli.commands``, or None (with a message) when the daemon extra is missing."""
    try:
        from sidecar.cli import commands
    except ModuleNotFoundError as exc:
        print(
            f"checkpoint-sidecar: this command needs the daemon's dependencies ({exc.name} is "
            "not installed): pip install 'checkpoint-sidecar[daemon]'",
            file=sys.stderr,
        )
        return None
    return commands


def _add_settings(parser: argparse.ArgumentParser) -> None:
    """One argument group per component, in declaration order (``Config.settings()``)."""
    groups: dict[str, Any] = {}
    for f in Config.settings():
        if f.group not in groups:
            note = None if groups else "each flag overrides its environment variable"
            groups[f.group] = parser.add_argument_group(f"settings: {f.group}", note)
        groups[f.group].add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            metavar=f.metadata["env"],
            help=f"{f.metadata['help']} (default: {f.show(f.default) or 'unset'})",
        )


def build_parser() -> argparse.ArgumentParser:
    """The ``checkpoint-sidecar`` parser: its subcommands in the order ``--help`` lists them."""
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
    for add in (
        _add_run,
        _add_listener_jar,
        _add_config,
        _add_list,
        _add_show,
        _add_history,
        _add_starting_offsets,
        _add_doctor,
        _add_import_spark_checkpoint,
        _add_reset,
        _add_retire,
        _add_snapshots,
        _add_restore,
    ):
        add(sub)
    return parser


def _add_run(sub: _Subcommands) -> None:
    parser = sub.add_parser(
        "run",
        help="run the daemon until SIGTERM/SIGINT",
        description="Run the daemon. SIGTERM or SIGINT stops it gracefully (stop accepting, "
        "answer what was read, flush everything pending to the blobs, release leases), "
        "within SIDECAR_SHUTDOWN_GRACE_S; a second signal forces exit.",
    )
    _add_settings(parser)


def _add_listener_jar(sub: _Subcommands) -> None:
    sub.add_parser(
        "listener-jar",
        help="print the path of the bundled Spark listener jar",
        description="Print the path of the JVM listener jar shipped with this package, for "
        'spark-submit --jars "$(checkpoint-sidecar listener-jar)" --conf '
        "spark.sql.streaming.streamingQueryListeners="
        "io.checkpointsidecar.SidecarStreamingListener. Exit code 1 when it was not built "
        "(a source checkout without `make setup`).",
    )


def _add_config(sub: _Subcommands) -> None:
    parser = sub.add_parser("config", help="print the effective configuration (secrets redacted)")
    _add_settings(parser)


def _add_list(sub: _Subcommands) -> None:
    parser = sub.add_parser(
        "list",
        help="list the namespace's checkpoints, read from the blobs",
        description="List every query checkpoint of the namespace, read directly from the "
        "blob store (the daemon need not run).",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    _add_settings(parser)


def _add_show(sub: _Subcommands) -> None:
    parser = sub.add_parser(
        "show",
        help="show one query's checkpoint, read from its blob",
        description="Show the saved checkpoint of one query (by name or id), read directly "
        "from the blob store.",
    )
    parser.add_argument("query", metavar="QUERY", help="query name or query id")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--checkpoint",
        action="store_true",
        help="print only the checkpoint, as the daemon's `get` answers it (JSON): what "
        "spark_bridge.load_checkpoint reads when no daemon answers",
    )
    _add_settings(parser)


def _add_history(sub: _Subcommands) -> None:
    parser = sub.add_parser(
        "history",
        help="list the checkpoints a query's blob retains, to rewind to one of them",
        description="List the checkpoints one query's blob retains (by name or id), newest "
        "first: the current one, then up to SIDECAR_HISTORY_SIZE earlier flushed ones (batch "
        "id, Spark timestamp, when written, each source's end offset). `starting-offsets "
        "QUERY --batch N` or `--before TIME` resumes from one of them. Reads the blobs "
        "directly.",
    )
    parser.add_argument("query", metavar="QUERY", help="query name or query id")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    _add_settings(parser)


def _add_starting_offsets(sub: _Subcommands) -> None:
    parser = sub.add_parser(
        "starting-offsets",
        help="print the Kafka startingOffsets (or Event Hubs startingPositions) JSON to resume "
        "a query from its saved position",
        description="Print the startingOffsets JSON for a query's Kafka source (for an Event "
        "Hubs source, the connector's eventhubs.startingPositions), built from "
        "the saved end offsets (the next offsets to read: no gap, no overlap); with --batch "
        "or --before, those of an earlier checkpoint the blob retains (see `history`). Reads "
        "the blobs directly. A stateful query (its progress lists state operators, or an "
        "import could not tell) is not rewound unless --state-rewound: its state store must "
        "be rewound to the same batch.",
    )
    parser.add_argument("query", metavar="QUERY", help="query name or query id")
    _add_state_rewound(parser)
    when = parser.add_mutually_exclusive_group()
    when.add_argument(
        "--batch",
        type=int,
        default=None,
        metavar="N",
        help="rewind: the retained checkpoint of batch N",
    )
    when.add_argument(
        "--before",
        default=None,
        metavar="TIME",
        help="rewind: the newest retained checkpoint whose Spark timestamp is before TIME "
        "(ISO 8601, e.g. 2026-11-21T10:00:00Z; no zone means UTC)",
    )
    parser.add_argument(
        "--source",
        type=int,
        default=None,
        help="index of the Kafka source when the query has several",
    )
    parser.add_argument(
        "--partitions",
        action="append",
        default=[],
        metavar="TOPIC=N",
        help="current partition count of a topic, so partitions absent from "
        "the checkpoint are named too (repeatable)",
    )
    parser.add_argument(
        "--missing",
        choices=("earliest", "latest", "error"),
        default="earliest",
        help="where absent partitions start (default: earliest)",
    )
    _add_settings(parser)


def _add_doctor(sub: _Subcommands) -> None:
    parser = sub.add_parser(
        "doctor",
        help="check that Redis, the storage account and Kafka can keep checkpoints",
        description="Check the setup the daemon would run with, one line per check (ok, warn "
        "or fail, with what to do). Redis: reachable, writable (not a replica), appendonly, "
        "maxmemory-policy noeviction (any eviction policy can drop buffered checkpoints: "
        "fail), maxmemory headroom, version. Storage: the container exists and can be listed; "
        "a probe blob under the namespace is created, leased, written, read and deleted (a "
        "SAS without w or d fails here); blob soft delete and versioning as far as the account "
        "reports them. Kafka (when SIDECAR_KAFKA_BOOTSTRAP_SERVERS is set): brokers reachable, "
        "the groups of the queries Redis knows describable, READ on them where the broker "
        "reports authorized operations (nothing is committed). The daemon runs the same "
        "checks at start. Exit code: 0 all ok, 1 a warning, 2 a failure (or bad settings).",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    _add_settings(parser)


def _add_import_spark_checkpoint(sub: _Subcommands) -> None:
    parser = sub.add_parser(
        "import-spark-checkpoint",
        help="adopt a running query: write its Spark checkpoint's last committed batch",
        description="Read a Spark checkpoint directory (the query's checkpointLocation, a "
        "local copy: metadata, offsets/, commits/) and write its last committed batch — the "
        "highest batch in commits/, with the end offsets of offsets/<that batch>, where "
        "Spark's own restart resumes — as the sidecar checkpoint of that query id, named "
        "NAME. Spark's log names no source: descriptions come from the query's existing "
        "sidecar checkpoint when it has as many sources, else placeholders (source[i], or "
        "KafkaV2[topics] for a Kafka-shaped offset). Written as a reset, like `reset`: "
        "through the daemon on SIDECAR_SOCKET_PATH when one runs (it needs "
        "SIDECAR_ADMIN_OPS=true), else under a lease of its own (Redis, then the blob; "
        "refused while another owner holds the lease). Refused unless --force when the blob "
        "holds a newer batch, or when the query was heard from within SIDECAR_ADMIN_QUIET_S "
        "(the sidecar already tracks it); moving a stateful query (or one whose state is "
        "unknown) back needs --state-rewound too. The import records the query stateful when "
        "the directory has state/ or state ids, else its state as unknown (never stateless) "
        "until its next progress. Exit code 0 written (or --dry-run), 1 refused, 2 bad "
        "settings (admin ops off on the daemon).",
    )
    parser.add_argument("path", metavar="PATH", help="the Spark checkpoint directory (local)")
    parser.add_argument(
        "--query-name", required=True, metavar="NAME", help="the query's name (queryName)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print what would be written")
    parser.add_argument(
        "--force",
        action="store_true",
        help="write even if the blob holds a newer batch or the sidecar heard from the query",
    )
    _add_state_rewound(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    _add_settings(parser)


#: How ``reset`` and ``retire`` act, the end of both descriptions.
_ADMIN_HOW = (
    "Through the daemon running on SIDECAR_SOCKET_PATH when there is one (it needs "
    "SIDECAR_ADMIN_OPS=true; the lease owner performs it), else under a lease this command "
    "takes on the query's blob and releases (refused while another owner holds it). Refused "
    "for a query heard from or updated within SIDECAR_ADMIN_QUIET_S (it may still run: "
    "stop it first) unless --force. Logged at WARNING; exit code 0 done, 1 refused or "
    "failed (nothing changed unless the message says so), 2 bad usage or admin ops off."
)


def _add_reset(sub: _Subcommands) -> None:
    parser = sub.add_parser(
        "reset",
        help="set a query's checkpoint to an earlier retained batch or to explicit offsets",
        description="Make a retained checkpoint (--to-batch N, see `history`) or explicit end "
        "offsets (--offsets) the query's position: Redis and the blob are set to it, the blob "
        "records reset_from / reset_at / reset_reason, and later batches must exceed the new "
        "batch id. Restart the query from it with `starting-offsets` (a new Spark checkpoint "
        "directory). " + _ADMIN_HOW,
    )
    parser.add_argument("query", metavar="QUERY", help="query name or query id")
    to = parser.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-batch", type=int, metavar="N", help="the retained checkpoint of batch N")
    to.add_argument(
        "--offsets",
        metavar="JSON",
        help="each source's end offset, a JSON array in the order of the query's sources, e.g. "
        '\'[{"events":{"0":4200,"1":4100}}]\' (as `history --json` shows end_offsets)',
    )
    parser.add_argument(
        "--batch-id",
        type=int,
        metavar="N",
        help="with --offsets: the batch id to record them as (default: the blob's batch)",
    )
    parser.add_argument("--reason", metavar="TEXT", help="why (logged and kept in the blob)")
    parser.add_argument("--force", action="store_true", help="even if the query may be running")
    _add_state_rewound(parser)
    _add_settings(parser)


def _add_retire(sub: _Subcommands) -> None:
    parser = sub.add_parser(
        "retire",
        help="stop tracking a query: its Redis keys removed, its blob kept or archived",
        description="Remove the query's Redis record (its hash, its entries in the pending and "
        "queries sets, the names pointing at it) and drop it from the daemon's memory, lease "
        "released. The blob stays, or with --archive moves to <namespace>/archive/ (copied, "
        "then deleted under the lease). " + _ADMIN_HOW,
    )
    parser.add_argument("query", metavar="QUERY", help="query name or query id")
    parser.add_argument("--archive", action="store_true", help="move the blob to archive/")
    parser.add_argument("--reason", metavar="TEXT", help="why (logged)")
    parser.add_argument("--force", action="store_true", help="even if the query may be running")
    _add_settings(parser)


def _add_snapshots(sub: _Subcommands) -> None:
    parser = sub.add_parser(
        "snapshots",
        help="list a query's checkpoint snapshots (SIDECAR_SNAPSHOT_ROOT)",
        description="List the snapshots of one query's Spark checkpoint (by name or id), newest "
        "first: batch, id, when, files, bytes, bytes first uploaded by it, and the location it "
        "was taken from. Reads the blobs directly.",
    )
    parser.add_argument("query", metavar="QUERY", help="query name or query id")
    parser.add_argument(
        "--check",
        action="store_true",
        help="check that each snapshot can be restored: its index readable and every pack it "
        "names stored (one listing; exit code 1 if any cannot)",
    )
    parser.add_argument(
        "--read-data",
        action="store_true",
        help="with --check: also read every file back and verify its checksum (restores each "
        "snapshot into a temporary directory: its size on disk, one at a time)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    _add_settings(parser)


def _add_restore(sub: _Subcommands) -> None:
    parser = sub.add_parser(
        "restore",
        help="write a snapshot back as the query's Spark checkpoint directory",
        description="Write snapshot N of QUERY (default: the newest; see `snapshots`) into DIR "
        "as a Spark checkpoint directory — every file's checksum verified, downloaded in "
        "parallel, put in place only once whole — and move the sidecar's checkpoint of the "
        "query to that batch as a reset does (through the daemon when one runs, else under a "
        "lease of its own, waited for while an old pod's daemon holds it); the Kafka groups "
        "and Event Hubs checkpoints are set back with it on purpose, each move logged. The "
        "state moves with the offsets, so a stateful query may move back. Refuses a non-empty "
        "DIR unless --force. `restore --all ROOT` is an init container's form: every query "
        "with a snapshot back to where it was taken from under ROOT, keeping a directory "
        "that holds the query's checkpoint at least as new and never writing over another "
        "query's (docs/snapshots.md has the table); one line per query, each failure its "
        "own. A sink that skips batch ids it already "
        "committed (Delta, the file sink) skips the batches replayed after the restored one: "
        "docs/snapshots.md. Exit code 0 done, 1 refused or failed, 2 bad usage.",
    )
    parser.add_argument("query", metavar="QUERY", nargs="?", help="query name or query id")
    parser.add_argument("dir", metavar="DIR", nargs="?", help="the checkpoint directory to write")
    parser.add_argument("--batch", type=int, metavar="N", help="the snapshot of batch N")
    parser.add_argument("--force", action="store_true", help="replace what DIR holds")
    parser.add_argument(
        "--all",
        metavar="ROOT",
        dest="all_root",
        help="every query with a snapshot, each back to its location under ROOT",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="show no progress (by default, on standard error: a bar per restore on a "
        "terminal, else a log line every --progress-every seconds with files, bytes, rate and "
        "time left, and one as each restore ends)",
    )
    parser.add_argument(
        "--progress-every",
        type=float,
        metavar="SECONDS",
        help="when standard error is not a terminal (a pod's log): a progress line this often "
        "(default: 5)",
    )
    _add_settings(parser)


def _add_state_rewound(parser: argparse.ArgumentParser) -> None:
    """``--state-rewound``, the same on each command that may move a query back."""
    parser.add_argument(
        "--state-rewound",
        action="store_true",
        help="the query's state store moved with it (restored from a snapshot of that batch, or a "
        "fresh checkpointLocation): lets a stateful query, or one that may be, move back",
    )


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
    logs.configure(config.log_level, config.log_format, sys.stderr)
    if args.command == "config":
        for f in Config.settings():
            print(f"{f.metadata['env']}={config.redacted(f.name)}")
        return EXIT_OK
    commands = _commands()
    if commands is None:
        return EXIT_USAGE
    if args.command == "doctor":
        code: int = commands.doctor(config, as_json=args.json)
        return code
    if args.command == "import-spark-checkpoint":
        imported: int = commands.import_spark(args, config)
        return imported
    if args.command in ("reset", "retire"):
        done: int = commands.admin(args, config)
        return done
    if args.command in ("list", "show", "history", "starting-offsets"):
        result: int = commands.inspect(args, config)
        return result
    if args.command in ("snapshots", "restore"):
        restored: int = commands.snapshot_command(args, config)
        return restored
    if "SIDECAR_NAMESPACE" not in os.environ and args.namespace is None:
        log.warning(
            "SIDECAR_NAMESPACE is not set; using %r. Set one per Spark application "
            "when several share a Redis",
            config.namespace,
        )
    result = commands.run_daemon(config)
    return result


def _listener_jar() -> int:
    try:
        print(listener_jar())
    except BridgeError as exc:
        print(f"checkpoint-sidecar: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK
