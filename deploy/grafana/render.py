"""Draw the Grafana dashboards from a live Prometheus, without Grafana.

    python deploy/grafana/render.py --prometheus http://HOST:9090 --out DIR \\
        [--dashboard fleet] [--since 15m] [--worker REGEX] [--client REGEX]

One PNG per dashboard (``DIR/<file stem>.png``), its panels placed by their ``gridPos``
(Grafana's 24 columns): time series as lines named by their ``legendFormat``, stat and
gauge panels as big numbers, rows as headings. The queries are the dashboard's own, with
the variables and macros Grafana would write in (``promql.py``); ``--worker`` and
``--client`` narrow ``$worker`` and ``$client`` (a regex; default: every value Prometheus
has). Exit status 2, with one line, when Prometheus cannot be reached or a dashboard is
missing.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import promql

HERE = Path(__file__).resolve().parent
DASHBOARDS = HERE / "dashboards"
COLUMNS = 24
COLUMN_IN, ROW_IN = 16 / COLUMNS, 0.3  # a 1600 px wide page at 100 dpi; a grid row is 30 px, as in Grafana
PAGE, PANEL, TEXT, DIM, RED = "#111217", "#181b1f", "#ccccdc", "#8e8e8e", "#f2495c"
COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff", "#ffb357", "#96d98d", "#ca95e5"]


# -- units (fieldConfig.defaults.unit) -----------------------------------------------------
def si(value: float, suffix: str = "", base: float = 1000.0, prefixes: str = " kMGTP") -> str:
    scaled, i = abs(value), 0
    while scaled >= base and i < len(prefixes) - 1:
        scaled, i = scaled / base, i + 1
    prefix = (prefixes[i].strip().upper() + "i") if base == 1024 and i else prefixes[i].strip()
    sign = "-" if value < 0 else ""
    return f"{sign}{scaled:.3g} {prefix}{suffix}".rstrip()


def fmt(value: float, unit: str | None) -> str:
    """A value as Grafana shows it in ``unit`` (the common units; others as plain numbers)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    unit = unit or ""
    if unit in ("s", "ms", "us", "ns"):
        secs = value * {"s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[unit]
        if secs == 0:
            return "0 s"
        for limit, scale, name in ((1e-6, 1e9, "ns"), (1e-3, 1e6, "µs"), (1, 1e3, "ms"), (60, 1, "s")):
            if abs(secs) < limit:
                return f"{secs * scale:.3g} {name}"
        return f"{secs / 60:.3g} min" if abs(secs) < 3600 else f"{secs / 3600:.3g} h"
    if unit in ("bytes", "decbytes"):
        return si(value, "B", 1024 if unit == "bytes" else 1000)
    if unit in ("Bps", "binBps", "decBps"):
        return si(value, "B/s", 1024 if unit == "binBps" else 1000)
    if unit == "percentunit":
        return f"{100 * value:.3g}%"
    if unit == "percent":
        return f"{value:.3g}%"
    custom, _, text = unit.partition(":")  # Grafana's custom units: "suffix:jobs", "count:tokens/s"
    if text and custom == "prefix":
        return f"{text}{fmt(value, None)}"
    suffix = text or {"ops": "ops/s", "reqps": "req/s", "rps": "req/s", "wps": "wr/s", "cps": "c/s"}.get(unit, "")
    if value == round(value) and abs(value) < 1e5:
        return f"{int(value)} {suffix}".rstrip()
    return si(value, suffix)


# -- one panel -----------------------------------------------------------------------------
def points(series: Mapping[str, Any]) -> tuple[list[datetime], list[float]]:
    pairs = [(datetime.fromtimestamp(float(t)), float(v)) for t, v in series["values"]]
    return [t for t, _ in pairs], [v for _, v in pairs]


def reduce(values: Sequence[float], calcs: Sequence[str]) -> float:
    """A stat panel's reducer (``reduceOptions.calcs``; default: last not-null)."""
    finite = [v for v in values if math.isfinite(v)] or [math.nan]
    calc = calcs[0] if calcs else "lastNotNull"
    return {
        "mean": lambda: sum(finite) / len(finite),
        "max": lambda: max(finite),
        "min": lambda: min(finite),
        "sum": lambda: sum(finite),
        "first": lambda: values[0] if values else math.nan,
        "firstNotNull": lambda: finite[0],
        "last": lambda: values[-1] if values else math.nan,
    }.get(calc, lambda: finite[-1])()


def named_series(results: Sequence[promql.Result]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (promql.legend(r.target.get("legendFormat", ""), s["metric"]) or r.target.get("refId", ""), s)
        for r in results
        for s in r.series
    ]


def draw_timeseries(ax: Any, panel: Mapping[str, Any], results: Sequence[promql.Result], window: promql.Window) -> None:
    import matplotlib.dates as mdates
    from matplotlib.ticker import FuncFormatter

    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
    named = named_series(results)
    for i, (name, series) in enumerate(named):
        style = ("-", "--", ":")[i // len(COLORS) % 3]  # past ten series, the colours again, dashed
        ax.plot(*points(series), color=COLORS[i % len(COLORS)], linestyle=style, linewidth=1.2, label=name)
    ax.set_xlim(datetime.fromtimestamp(window.start), datetime.fromtimestamp(window.end))  # every panel alike
    values = [v for _, s in named for v in points(s)[1] if math.isfinite(v)]
    if values and min(values) >= 0:  # as Grafana: from 0, and 0 to 1 for a flat zero
        ax.set_ylim(bottom=0, top=None if max(values) > 0 else 1)
    custom, _, suffix = (unit or "").partition(":")
    if suffix and custom in ("count", "suffix"):  # a long custom unit: once beside the axis, not on each tick
        ax.set_ylabel(suffix, color=DIM, fontsize=7, labelpad=2)
        unit = None
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v, unit)))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.tick_params(colors=DIM, labelsize=7)
    ax.grid(color="#2c3235", linewidth=0.6)
    for spine in ax.spines.values():
        spine.set_visible(False)
    if 0 < len(named) <= 12:
        ax.legend(loc="upper left", fontsize=6.5, frameon=False, labelcolor=TEXT, ncol=1 + len(named) // 5)


def draw_stat(ax: Any, panel: Mapping[str, Any], results: Sequence[promql.Result]) -> None:
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
    calcs = panel.get("options", {}).get("reduceOptions", {}).get("calcs", [])
    named = named_series(results)[:8]
    ax.set_axis_off()
    for i, (name, series) in enumerate(named):
        x = (i + 0.5) / len(named)
        value = reduce(points(series)[1], calcs)
        ax.text(x, 0.45, fmt(value, unit), ha="center", va="center", color=COLORS[i % len(COLORS)],
                fontsize=min(28, 60 / len(named)), fontweight="bold", transform=ax.transAxes)  # fmt: skip
        if len(named) > 1:
            ax.text(x, 0.1, name, ha="center", va="center", color=DIM, fontsize=7, transform=ax.transAxes)


def draw_panel(
    fig: Any, box: tuple[float, float, float, float], panel: Mapping[str, Any], results: Any, window: Any
) -> None:
    """One panel in ``box`` (figure fractions: left, bottom, width, height)."""
    left, bottom, width, height = box
    fig_w, fig_h = fig.get_figwidth(), fig.get_figheight()
    frame = fig.add_axes(box)
    frame.set_facecolor(PANEL)
    frame.set_xticks([])
    frame.set_yticks([])
    for spine in frame.spines.values():
        spine.set_color("#2c3235")
    title = 0.28 / fig_h  # the title bar, as a figure fraction
    fig.text(left + 0.08 / fig_w, bottom + height - title / 2, panel.get("title", ""), color=TEXT, fontsize=9,
             fontweight="bold", va="center")  # fmt: skip
    kind = panel.get("type", "timeseries")
    errors = [r.error for r in results if r.error]
    if kind == "text":
        content = panel.get("options", {}).get("content", "")
        frame.text(0.02, 0.8, content[:600], color=TEXT, fontsize=7, va="top", wrap=True, transform=frame.transAxes)
    elif errors or not any(r.series for r in results):
        frame.text(0.5, 0.45, errors[0][:120] if errors else "No data", color=RED if errors else DIM,
                   ha="center", va="center", fontsize=9, transform=frame.transAxes, wrap=True)  # fmt: skip
    elif kind in ("stat", "gauge", "bargauge", "table"):
        draw_stat(fig.add_axes((left, bottom, width, height - title)), panel, results)
    else:  # timeseries, and anything else drawn as lines (heatmap, barchart, ...)
        pad_l, pad_b, pad_r = 0.75 / fig_w, 0.25 / fig_h, 0.1 / fig_w
        ax = fig.add_axes((left + pad_l, bottom + pad_b, width - pad_l - pad_r, height - title - pad_b - 0.04 / fig_h))
        ax.set_facecolor(PANEL)
        draw_timeseries(ax, panel, results, window)


def render(dashboard: Mapping[str, Any], results: Sequence[promql.Result], window: promql.Window, out: Path) -> Path:
    """Draw ``dashboard``'s panels with ``results`` (``promql.evaluate``) into the PNG ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    laid = [p for p in promql.panels(dashboard) if "gridPos" in p]
    rows = max((p["gridPos"]["y"] + p["gridPos"]["h"] for p in laid), default=1)
    header = 0.6
    fig_h = rows * ROW_IN + header
    fig = plt.figure(figsize=(COLUMNS * COLUMN_IN, fig_h), facecolor=PAGE)
    span = f"{datetime.fromtimestamp(window.start):%Y-%m-%d %H:%M:%S} to {datetime.fromtimestamp(window.end):%H:%M:%S}"
    fig.text(0.01, 1 - 0.3 / fig_h, dashboard.get("title", ""), color=TEXT, fontsize=14, fontweight="bold", va="center")
    fig.text(0.99, 1 - 0.3 / fig_h, f"{span}, step {promql.duration(window.step)}", color=DIM, fontsize=8,
             ha="right", va="center")  # fmt: skip
    by_panel: dict[int, list[promql.Result]] = {}
    for r in results:
        by_panel.setdefault(id(r.panel), []).append(r)
    pad = 0.04  # inches between panels
    for panel in laid:
        g = panel["gridPos"]
        left = (g["x"] * COLUMN_IN + pad) / (COLUMNS * COLUMN_IN)
        width = (g["w"] * COLUMN_IN - 2 * pad) / (COLUMNS * COLUMN_IN)
        top = (header + g["y"] * ROW_IN + pad) / fig_h
        height = (g["h"] * ROW_IN - 2 * pad) / fig_h
        if panel.get("type") == "row":
            fig.text(left, 1 - top - height / 2, panel.get("title", ""), color=TEXT, fontsize=11, fontweight="bold",
                     va="center")  # fmt: skip
            continue
        draw_panel(fig, (left, 1 - top - height, width, height), panel, by_panel.get(id(panel), []), window)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, facecolor=PAGE)
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency

    with Image.open(out) as image:  # a palette of 256 colours: a third of the bytes, the same picture
        image.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
    return out


# -- dashboards, variables, the command line ------------------------------------------------
def load(directory: Path, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Dashboards by file stem; ``names`` (a stem or a title, any case) picks some."""
    found = {f.stem: json.loads(f.read_text()) for f in sorted(directory.glob("*.json"))}
    if not names:
        return found

    def plain(text: str) -> str:
        return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")

    picked = {}
    for name in names:
        key = plain(name)
        match = [s for s, d in found.items() if key in (plain(s), plain(d.get("title", "")))]
        match = match or [s for s, d in found.items() if plain(d.get("title", "")).endswith(key)]
        if not match:
            raise FileNotFoundError(f"no dashboard {name!r} in {directory} (there are: {', '.join(found) or 'none'})")
        picked[match[0]] = found[match[0]]
    return picked


def render_all(
    api: promql.Prometheus,
    dashboards: Mapping[str, Mapping[str, Any]],
    out: Path,
    window: promql.Window,
    given: Mapping[str, str | list[str]] | None = None,
) -> dict[str, tuple[Path, list[promql.Result]]]:
    """Each dashboard evaluated over ``window`` and drawn to ``out/<stem>.png``."""
    drawn = {}
    for stem, dashboard in dashboards.items():
        variables = promql.Variables.resolve(dashboard, api, window, given)
        results = promql.evaluate(dashboard, api, window, variables)
        drawn[stem] = (render(dashboard, results, window, out / f"{stem}.png"), results)
    return drawn


def until(text: str) -> float:
    """``--until``: epoch seconds, or an ISO 8601 time (local unless it names its zone); now if empty."""
    if not text:
        return time.time()
    try:
        return float(text)
    except ValueError:
        return datetime.fromisoformat(text).timestamp()  # a ValueError names what it could not read


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prometheus", required=True, help="Prometheus' URL, e.g. http://localhost:9090")
    ap.add_argument("--out", required=True, type=Path, help="folder for the PNGs (one per dashboard)")
    ap.add_argument("--dashboard", action="append", default=[], help="a dashboard's file stem or title (repeatable)")
    ap.add_argument("--dashboards", type=Path, default=DASHBOARDS, help=f"folder of dashboard JSON ({DASHBOARDS})")
    ap.add_argument("--since", default="15m", help="how far back from --until (a duration: 90s, 15m, 2h)")
    ap.add_argument("--until", default="", help="the end: epoch seconds or ISO 8601 (default: now)")
    ap.add_argument("--step", default="", help="query step (default: the scrape interval, or span/300)")
    ap.add_argument("--worker", help="regex for $worker (default: every worker)")
    ap.add_argument("--client", help="regex for $client (default: every client)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    api = promql.Prometheus(args.prometheus)
    try:
        since = promql.seconds(args.since)
        dashboards = load(args.dashboards, args.dashboard)
        if not dashboards:
            raise FileNotFoundError(f"no dashboards (*.json) in {args.dashboards}")
        scrape = api.scrape_interval()
        end = until(args.until)
        step = promql.seconds(args.step) if args.step else max(scrape, since / 300)
        window = promql.Window(end - since, end, step, scrape)
        given = {k: v for k, v in (("worker", args.worker), ("client", args.client)) if v}
        for stem, (path, results) in render_all(api, dashboards, args.out, window, given).items():
            empty = sum(not r.series for r in results)
            print(f"{path}: {stem}, {len(results)} queries, {empty} without data")
    except (promql.PrometheusError, FileNotFoundError, ValueError) as exc:
        print(f"render.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
