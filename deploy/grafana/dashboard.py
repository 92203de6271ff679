"""The checkpoint-sidecar Grafana dashboard, as code (grafana-foundation-sdk).

    .venv/bin/python deploy/grafana/dashboard.py          # writes checkpoint-sidecar.json
    .venv/bin/python deploy/grafana/dashboard.py --check  # exit 1 when the file is out of date

The generated file is committed (import it in Grafana, or provision it);
tests/integration/test_deploy_grafana.py checks that it is up to date and evaluates every panel's
expression against a real Prometheus scraping a real daemon.

Variables: ``datasource`` (a Prometheus), ``namespace`` (the Kubernetes namespace target
label: deploy/README.md, "Scrape config") and ``query`` (the streaming query's name, its id
when unnamed). Daemon-wide metrics have no ``query`` label: their panels follow ``namespace``
only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, statetimeline
from grafana_foundation_sdk.builders import timeseries as ts
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BigValueColorMode,
    GraphTresholdsStyleMode,
    LegendDisplayMode,
    VisibilityMode,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    Panel,
    Threshold,
    ThresholdsMode,
    ValueMap,
    ValueMappingResult,
    VariableRefresh,
    VariableSort,
)

OUTPUT = Path(__file__).resolve().parent / "checkpoint-sidecar.json"
UID = "checkpoint-sidecar"

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
#: Selectors: every daemon of the chosen namespaces; their per-query series of chosen queries.
NS = 'namespace=~"$namespace"'
NSQ = 'namespace=~"$namespace", query=~"$query"'
RATE = "$__rate_interval"
#: The bound of the update queue (sidecar/ingest/coalescer.py: max_queued).
QUEUE_BOUND = 4096
#: checkpoint age at which CheckpointSidecarCheckpointStale fires (deploy/prometheus/alerts.yml).
STALE_AFTER_S = 300


def red_above_thresholds(value: float) -> dashboard.ThresholdsConfig:
    """Green, red from ``value`` on."""
    return (
        dashboard.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=None, color="green"), Threshold(value=value, color="red")])
    )


def target(expr: str, legend: str, ref_id: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref_id)


def quantiles(metric: str, by: str = "") -> list[prometheus.Dataquery]:
    """p50 and p99 of a histogram over the chosen namespaces."""
    group = f"le{', ' + by if by else ''}"
    return [
        target(
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{NS}}}[{RATE}])))",
            f"p{round(q * 100)}",
            ref_id,
        )
        for ref_id, q in (("A", 0.5), ("B", 0.99))
    ]


def graph(
    title: str,
    description: str,
    targets: list[prometheus.Dataquery],
    unit: str,
    *,
    width: int = 12,
    red_above: float | None = None,
) -> ts.Panel:
    panel = (
        ts.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(8)
        .fill_opacity(10)
        .legend(common.VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST))
    )
    if unit not in ("s", "percentunit"):
        panel = panel.decimals(0 if unit == "none" else 2)
    if red_above is not None:
        panel = panel.thresholds(red_above_thresholds(red_above)).thresholds_style(
            common.GraphThresholdsStyleConfig().mode(GraphTresholdsStyleMode.LINE)
        )
    for item in targets:
        panel = panel.with_target(item)
    return panel


def single(title: str, description: str, expr: str, unit: str, red_above: float) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(target(expr, title))
        .unit(unit)
        .span(4)
        .height(4)
        .color_mode(BigValueColorMode.BACKGROUND)
        .thresholds(red_above_thresholds(red_above))
    )


def up_down(title: str, description: str, targets: list[prometheus.Dataquery]) -> Builder[Panel]:
    """A state timeline of 0/1 series: red 0, green 1."""
    names = {0: ("down", "red"), 1: ("up", "green")}
    mapping = ValueMap(
        options={
            str(v): ValueMappingResult(text=text, color=color) for v, (text, color) in names.items()
        }
    )
    panel = (
        statetimeline.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .mappings([mapping])
        .show_value(VisibilityMode.NEVER)
        .span(12)
        .height(8)
    )
    for item in targets:
        panel = panel.with_target(item)
    return panel


def variables(board: dashboard.Dashboard) -> dashboard.Dashboard:
    return (
        board.with_variable(
            dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(
            dashboard.QueryVariable("namespace")
            .label("Namespace")
            .datasource(DATASOURCE)
            .query("label_values(checkpoint_sidecar_build_info, namespace)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
        )
        .with_variable(
            dashboard.QueryVariable("query")
            .label("Query")
            .datasource(DATASOURCE)
            .query(f"label_values(checkpoint_sidecar_checkpoint_age_seconds{{{NS}}}, query)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
        )
    )


def build() -> dashboard.Dashboard:
    """The dashboard: an overview, then one row per part of the data flow."""
    board = (
        dashboard.Dashboard("checkpoint-sidecar")
        .uid(UID)
        .description("Spark offsets: acknowledged into Redis, checkpointed to blobs, Kafka lag")
        .tags(["checkpoint-sidecar", "spark"])
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
    )
    board = variables(board)
    board = (
        board.with_row(dashboard.Row("Overview"))
        .with_panel(
            single(
                "Daemons down",
                "Targets that served checkpoint-sidecar metrics within the hour and whose "
                "scrape fails now (any scrape job)",
                f"count(up{{{NS}}} == 0 and on (job, instance) "
                f"max_over_time(checkpoint_sidecar_build_info{{{NS}}}[1h])) or vector(0)",
                "none",
                1,
            )
        )
        .with_panel(
            single(
                "Oldest unflushed update",
                "The oldest update of any chosen query not yet in its blob (0: all up to date)",
                f"max(checkpoint_sidecar_checkpoint_age_seconds{{{NSQ}}})",
                "s",
                STALE_AFTER_S,
            )
        )
        .with_panel(
            single(
                "Leases not held",
                "Chosen queries whose blob lease their daemon does not hold",
                f"count(checkpoint_sidecar_lease_held{{{NSQ}}} == 0) or vector(0)",
                "none",
                1,
            )
        )
        .with_panel(
            single(
                "Redis down",
                "Daemons whose last Redis call failed",
                f"count(checkpoint_sidecar_redis_up{{{NS}}} == 0) or vector(0)",
                "none",
                1,
            )
        )
        .with_panel(
            single(
                "Blob store down",
                "Daemons whose blob store did not answer the last call (pinged when idle)",
                f"count(checkpoint_sidecar_store_up{{{NS}}} == 0) or vector(0)",
                "none",
                1,
            )
        )
        .with_panel(
            single(
                "Unreadable records (1h)",
                "Stored records found unreadable in the last hour (quarantined; see the log)",
                f"sum(increase(checkpoint_sidecar_bad_records_total{{{NS}}}[1h]))",
                "none",
                1,
            )
        )
        .with_panel(
            single(
                "Redis resets (1h)",
                "Times Redis lost a namespace's data in the last hour (see the log)",
                f"sum(increase(checkpoint_sidecar_redis_resets_total{{{NS}}}[1h]))",
                "none",
                1,
            )
        )
    )
    board = (
        board.with_row(dashboard.Row("Checkpoints per query"))
        .with_panel(
            graph(
                "Checkpoint freshness",
                "Age of the query's oldest update not yet in its blob: 0 when the blob is up to "
                f"date; the stale-checkpoint alert fires above {STALE_AFTER_S} s",
                [
                    target(
                        f"checkpoint_sidecar_checkpoint_age_seconds{{{NSQ}}}", "{{query}} ({{pod}})"
                    )
                ],
                "s",
                red_above=STALE_AFTER_S,
            )
        )
        .with_panel(
            graph(
                "Batch id in the blob",
                "The last batch durable in the query's checkpoint blob",
                [target(f"checkpoint_sidecar_checkpoint_batch_id{{{NSQ}}}", "{{query}}")],
                "none",
            )
        )
        .with_panel(
            graph(
                "Updates pending in Redis",
                "Applied updates not yet flushed to the blob",
                [target(f"checkpoint_sidecar_pending_updates{{{NSQ}}}", "{{query}}")],
                "none",
            )
        )
        .with_panel(
            up_down(
                "Lease held",
                "up: this daemon holds the lease on the query's blob; down: not owned, nothing "
                "of the query is written (checkpoint_sidecar_lease_held_elsewhere names who last "
                "wrote the blob when another daemon holds it)",
                [target(f"checkpoint_sidecar_lease_held{{{NSQ}}}", "{{query}} ({{pod}})")],
            )
        )
    )
    board = (
        board.with_row(dashboard.Row("Ingest"))
        .with_panel(
            graph(
                "Updates by result",
                "Progress updates per second: applied, stale (not newer), no_offsets, rejected",
                [
                    target(
                        f"sum by (result) (rate(checkpoint_sidecar_updates_total{{{NS}}}[{RATE}]))",
                        "{{result}}",
                    )
                ],
                "reqps",
            )
        )
        .with_panel(
            graph(
                "Ack latency",
                "Read of a progress request to its reply (one Redis round trip)",
                quantiles("checkpoint_sidecar_ack_seconds"),
                "s",
            )
        )
        .with_panel(
            graph(
                "Update queue fill",
                f"Updates waiting for their Redis round trip, of {QUEUE_BOUND}: full means "
                "backpressure",
                [
                    target(
                        f"checkpoint_sidecar_buffer_queue{{{NS}}} / {QUEUE_BOUND}",
                        "{{namespace}}/{{pod}}",
                    )
                ],
                "percentunit",
                red_above=0.8,
            )
        )
        .with_panel(
            graph(
                "Error replies by code",
                "Requests answered with an error, per second",
                [
                    target(
                        "sum by (code) "
                        f"(rate(checkpoint_sidecar_bad_requests_total{{{NS}}}[{RATE}]))",
                        "{{code}}",
                    )
                ],
                "reqps",
            )
        )
    )
    board = (
        board.with_row(dashboard.Row("Flushes"))
        .with_panel(
            graph(
                "Flushes by result",
                "Checkpoint flush attempts per second: ok, skipped (blob already newer), "
                "not_owned, lease_lost, error",
                [
                    target(
                        f"sum by (result) (rate(checkpoint_sidecar_flushes_total{{{NS}}}[{RATE}]))",
                        "{{result}}",
                    )
                ],
                "ops",
            )
        )
        .with_panel(
            graph(
                "Blob write latency",
                "One checkpoint blob write",
                quantiles("checkpoint_sidecar_flush_seconds"),
                "s",
            )
        )
        .with_panel(
            graph(
                "Flush failures",
                "Failed flushes per second (error: retried with backoff; lease_lost: fenced out)",
                [
                    target(
                        "sum by (namespace, pod, result) (rate(checkpoint_sidecar_flushes_total"
                        f'{{{NS}, result=~"error|lease_lost"}}[{RATE}]))',
                        "{{namespace}}/{{pod}} {{result}}",
                    )
                ],
                "ops",
            )
        )
        .with_panel(
            graph(
                "Lease renewals by result",
                "Renewals per second: ok, lost (refused by the store), error",
                [
                    target(
                        "sum by (result) "
                        f"(rate(checkpoint_sidecar_lease_renewals_total{{{NS}}}[{RATE}]))",
                        "{{result}}",
                    )
                ],
                "ops",
            )
        )
    )
    board = (
        board.with_row(dashboard.Row("Redis and Kafka"))
        .with_panel(
            up_down(
                "Redis, blob store and Kafka up",
                "Redis, blob store: the last call succeeded; AOF: appendonly on; Kafka: the last "
                "commit succeeded (shown only for daemons that have committed)",
                [
                    target(f"checkpoint_sidecar_redis_up{{{NS}}}", "Redis {{pod}}", "A"),
                    target(f"checkpoint_sidecar_store_up{{{NS}}}", "Blob store {{pod}}", "D"),
                    target(f"checkpoint_sidecar_redis_aof_enabled{{{NS}}}", "AOF {{pod}}", "B"),
                    target(
                        f"checkpoint_sidecar_kafka_up{{{NS}}} and on (job, instance) "
                        f"(sum by (job, instance) (checkpoint_sidecar_kafka_commits_total{{{NS}}}) "
                        "> 0)",
                        "Kafka {{pod}}",
                        "C",
                    ),
                ],
            )
        )
        .with_panel(
            graph(
                "Kafka commits by result",
                "Consumer-group commits per second: ok, regressed (partitions skipped), error",
                [
                    target(
                        "sum by (result) "
                        f"(rate(checkpoint_sidecar_kafka_commits_total{{{NS}}}[{RATE}]))",
                        "{{result}}",
                    )
                ],
                "ops",
            )
        )
        .with_panel(
            graph(
                "Kafka lag per partition",
                "Records between the end of the log and the query's position (durable offset "
                "with a broker configured, else Spark's latestOffset - endOffset)",
                [
                    target(
                        f"checkpoint_sidecar_kafka_lag_records{{{NSQ}}}",
                        "{{query}} {{topic}}/{{partition}}",
                    )
                ],
                "none",
            )
        )
        .with_panel(
            graph(
                "Kafka lag in time",
                "Time to consume the query's lag at its rate over the last minute (+Inf: not "
                "consuming)",
                [target(f"checkpoint_sidecar_kafka_lag_seconds{{{NSQ}}}", "{{query}}")],
                "s",
            )
        )
    )
    board = (
        board.with_row(dashboard.Row("Snapshots"))
        .with_panel(
            graph(
                "Snapshot lag",
                "How long the oldest batch Spark committed and no snapshot holds has waited "
                "(SIDECAR_SNAPSHOT_ROOT; queries whose checkpoint is not under it are not shown)",
                [target(f"checkpoint_sidecar_snapshot_lag_seconds{{{NSQ}}}", "{{query}}")],
                "s",
                red_above=600,
            )
        )
        .with_panel(
            graph(
                "Snapshot lag in batches",
                "Batches Spark committed since the query's newest snapshot",
                [target(f"checkpoint_sidecar_snapshot_lag_batches{{{NSQ}}}", "{{query}}")],
                "none",
            )
        )
        .with_panel(
            graph(
                "Snapshot upload",
                "Bytes per second uploaded by snapshots: content (new files' bytes, each once) "
                "and index",
                [
                    target(
                        "sum by (kind) "
                        f"(rate(checkpoint_sidecar_snapshot_bytes_total{{{NS}}}[{RATE}]))",
                        "{{kind}}",
                    )
                ],
                "Bps",
            )
        )
        .with_panel(
            graph(
                "Snapshot failures by reason",
                "Snapshots that failed per second, by reason (file_changed and "
                "cut_not_committed are retried with the next batch; the others need a look)",
                [
                    target(
                        "sum by (reason) "
                        f"(rate(checkpoint_sidecar_snapshot_failures_total{{{NS}}}[{RATE}]))",
                        "{{reason}}",
                    )
                ],
                "ops",
            )
        )
    )
    return board


def render() -> str:
    """The dashboard's JSON text, as committed (panel ids numbered in order)."""
    model = json.loads(json.dumps(build().build(), cls=JSONEncoder))
    for number, panel in enumerate(model["panels"], start=1):
        panel["id"] = number
    return json.dumps(model, indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv == ["--check"]:
        if OUTPUT.exists() and OUTPUT.read_text() == text:
            return 0
        print(f"{OUTPUT} is out of date: run {Path(__file__).name} to regenerate it")
        return 1
    if argv:
        print(__doc__)
        return 2
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
