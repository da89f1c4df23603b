"""The vocabulary the dashboards are written in: a query, percentiles of a histogram, a time
series panel, a stat panel, and a dashboard with the shared variables and a menu."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
RARE = "10m"
"""The window for rare events: sync rounds and steps, evictions, lost workers."""
WORKER = 'worker=~"$worker"'
CLIENT = 'client=~"$client"'
QUANTILES = (0.5, 0.9, 0.99)


# -- panels -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


def quantiles(
    histogram: str, *, by: str = "", selector: str = "", window: str = RATE, qs: Sequence[float] = QUANTILES
) -> list[Query]:
    """``histogram_quantile`` at each of ``qs`` over the rate of ``histogram``'s ``_bucket`` series."""
    labels = ", ".join(["le", *([by] if by else [])])
    series = f"{histogram}_bucket{{{selector}}}" if selector else f"{histogram}_bucket"
    prefix = f"{{{{{by}}}}} " if by else ""
    return [
        Query(f"histogram_quantile({q}, sum by ({labels}) (rate({series}[{window}])))", f"{prefix}p{q * 100:g}")
        for q in qs
    ]


def targets(queries: Sequence[Query]) -> list[prometheus.Dataquery]:
    return [
        prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i))
        for i, q in enumerate(queries)
    ]


def graph(
    title: str,
    description: str,
    unit: str,
    queries: Sequence[Query],
    *,
    span: int = 12,
    stack: bool = False,
    bars: bool = False,
    max_value: float | None = None,
) -> timeseries.Panel:
    """A time series panel."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(span)
        .height(8)
        .min(0)
        .fill_opacity(30 if stack or bars else 10)
        .legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST).placement(cm.LegendPlacement.BOTTOM))
        .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
        .targets(targets(queries))
    )
    if stack:
        panel.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
    if bars:
        panel.draw_style(cm.GraphDrawStyle.BARS)
    if max_value is not None:
        panel.max(max_value)
    return panel


def single(title: str, description: str, unit: str, query: Query, *, red_above: float | None = None) -> stat.Panel:
    """A stat panel: the last value, with its history as a sparkline."""
    steps = [dm.Threshold(value=None, color="green")]
    if red_above is not None:
        steps.append(dm.Threshold(value=red_above, color="red"))
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(6)
        .height(4)
        .graph_mode(cm.BigValueGraphMode.AREA)
        .color_mode(cm.BigValueColorMode.VALUE)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]))
        .thresholds(db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(steps))
        .targets(targets([query]))
    )


def label_variable(name: str, label: str, query: str, description: str) -> db.QueryVariable:
    return (
        db.QueryVariable(name)
        .label(label)
        .description(description)
        .query(query)
        .datasource(DATASOURCE)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
    )


def dashboard(name: str, title: str, description: str, panels: Sequence[timeseries.Panel | stat.Panel]) -> db.Dashboard:
    """A dashboard with the three variables, a menu of the other zmq-rollout dashboards, and ``panels``."""
    board = (
        db.Dashboard(f"zmq-rollout: {title}")
        .uid(f"zmq-rollout-{name}")
        .description(description)
        .tags(["zmq-rollout"])
        .time("now-1h", "now")
        .refresh("10s")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .link(
            db.DashboardLink("zmq-rollout")
            .type(dm.DashboardLinkType.DASHBOARDS)
            .tags(["zmq-rollout"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            label_variable(
                "worker",
                "Worker",
                "label_values(zmq_rollout_worker_credits, worker)",
                "Workers by name (--name; NAME-gpuN per engine), as the broker knows them",
            )
        )
        .with_variable(
            label_variable(
                "client", "Client", "label_values(zmq_rollout_queue_depth, client)", "Clients (trainers) with a queue"
            )
        )
    )
    for number, panel in enumerate(panels, start=1):
        board.with_panel(panel.id(number))
    return board
