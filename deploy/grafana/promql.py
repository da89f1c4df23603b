"""Grafana dashboards' PromQL, runnable without Grafana.

What Grafana does before it sends a panel's query to Prometheus, done here: walk a
dashboard JSON's panels (rows' nested panels too) and their targets, resolve the template
variables (``label_values(...)`` asked of Prometheus, or given), and substitute them and
Grafana's macros (``$__rate_interval``, ``$__interval``, ``$__range``, ...) into each
``expr``. A ``$name`` that is neither fails with ``UnknownVariable``: a dashboard that uses
one would show "no data" in Grafana. ``render.py`` draws the results;
``tests/integration/test_dashboard_queries.py`` checks every target returns data.

Standard library only (``render.py`` adds matplotlib).
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Grafana's variable syntaxes: $name, ${name}, ${name:format}, [[name]], [[name:format]].
VARIABLE = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\[\[(\w+)(?::(\w+))?\]\]|\$(\w+)")
REGEX_SPECIALS = re.compile(r"([\\^$*+?.()|{}\[\]])")  # what Grafana escapes in a Prometheus regex value
DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)")
UNITS_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


class UnknownVariable(ValueError):
    """A ``$name`` in a query that is neither a dashboard variable nor a Grafana macro."""


class PrometheusError(RuntimeError):
    """Prometheus refused a query (the message says why)."""


class PrometheusUnreachable(PrometheusError):
    """No answer from Prometheus at all."""


def seconds(text: str) -> float:
    """``"1m30s"`` -> 90.0 (Prometheus and Grafana durations)."""
    parts = DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * UNITS_S[u] for n, u in parts)


def duration(s: float) -> str:
    """90.0 -> ``"90s"``; a whole number of ms below a second (PromQL takes either)."""
    return f"{round(s)}s" if s >= 1 and s == round(s) else f"{max(1, round(s * 1000))}ms"


@dataclass(frozen=True)
class Window:
    """The time range of a dashboard as Grafana would query it (epoch seconds)."""

    start: float
    end: float
    step: float = 1.0
    scrape_interval: float = 15.0

    @property
    def rate_interval(self) -> float:
        """Grafana's ``$__rate_interval``: max(interval + scrape interval, 4 x scrape interval)."""
        return max(self.step + self.scrape_interval, 4 * self.scrape_interval)

    def macros(self) -> dict[str, str]:
        span = self.end - self.start
        return {
            "__interval": duration(self.step),
            "__interval_ms": str(round(self.step * 1000)),
            "__rate_interval": duration(self.rate_interval),
            "__rate_interval_ms": str(round(self.rate_interval * 1000)),
            "__range": f"{round(span)}s",  # Grafana rounds it to seconds
            "__range_s": str(round(span)),
            "__range_ms": str(round(span * 1000)),
            "__from": str(round(self.start * 1000)),
            "__to": str(round(self.end * 1000)),
        }


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, in order; a collapsed row's panels follow it."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", []) if panel.get("type") == "row" else ()


def targets(panel: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The panel's Prometheus queries (targets with an ``expr``)."""
    return [t for t in panel.get("targets", []) if t.get("expr")]


def regex_of(values: Sequence[str]) -> str:
    """Values as Grafana writes a multi-value variable into a Prometheus query: ``(a|b)``."""
    escaped = [REGEX_SPECIALS.sub(r"\\\1", v) for v in values]
    if len(escaped) <= 1:  # no values: empty, as Grafana writes a variable whose query found none
        return "".join(escaped)
    return "(" + "|".join(escaped) + ")"


def format_value(value: str | Sequence[str], fmt: str | None) -> str:
    """A variable's value as text: a ``str`` is a regex or literal given as is; a list of values
    is formatted like Grafana (default and ``regex``: ``(a|b)``; ``pipe``, ``csv``, ``raw``, ``glob``)."""
    if isinstance(value, str):
        return value
    if fmt in (None, "regex"):
        return regex_of(value)
    joined = {"pipe": "|".join, "csv": ",".join, "raw": ",".join, "glob": lambda v: "{" + ",".join(v) + "}"}
    if fmt not in joined:
        raise UnknownVariable(f"unknown variable format {fmt!r}")
    return joined[fmt](value)


def substitute(expr: str, variables: Mapping[str, str | Sequence[str]], window: Window) -> str:
    """``expr`` with ``variables`` and ``window``'s macros written in. ``$1`` (a
    ``label_replace`` group) is left alone; any other unknown name raises ``UnknownVariable``."""
    known: dict[str, str | Sequence[str]] = {**window.macros(), **variables}

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3) or m.group(5)
        fmt = m.group(2) or m.group(4)
        if name.isdigit():
            return m.group(0)
        if name not in known:
            raise UnknownVariable(f"${name} is neither a dashboard variable nor a Grafana macro")
        return format_value(known[name], fmt)

    return VARIABLE.sub(one, expr)


@dataclass
class Prometheus:
    """The few calls of Prometheus' HTTP API that a dashboard needs."""

    url: str
    timeout_s: float = 10.0

    def get(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url.rstrip('/')}{path}?{query}", timeout=self.timeout_s) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as exc:  # a bad query: Prometheus says why in the body
            try:
                reply = json.loads(exc.read())
            except ValueError:
                raise PrometheusError(f"{self.url}{path}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise PrometheusUnreachable(f"Prometheus unreachable at {self.url}: {reason}") from None
        if reply.get("status") != "success":
            raise PrometheusError(f"{reply.get('errorType', 'error')}: {reply.get('error', reply)}")
        return reply["data"]

    def query_range(self, expr: str, window: Window) -> list[dict[str, Any]]:
        """The matrix of ``expr`` over ``window`` (``[{"metric": {...}, "values": [[t, "v"], ...]}]``)."""
        data = self.get("/api/v1/query_range", query=expr, start=window.start, end=window.end, step=window.step)
        return data["result"]  # type: ignore[no-any-return]

    def label_values(self, label: str, match: str | None, window: Window) -> list[str]:
        params: dict[str, Any] = {"start": window.start, "end": window.end}
        if match:
            params["match[]"] = match
        return sorted(self.get(f"/api/v1/label/{urllib.parse.quote(label)}/values", **params))

    def scrape_interval(self, default: float = 15.0) -> float:
        """The global ``scrape_interval`` of the server's configuration (Grafana's default: 15 s)."""
        found = re.search(r"^\s*scrape_interval:\s*(\S+)", self.get("/api/v1/status/config")["yaml"], re.MULTILINE)
        return seconds(found.group(1)) if found else default


LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.*),\s*)?(\w+)\s*\)\s*$", re.DOTALL)


@dataclass
class Variables:
    """A dashboard's template variables, resolved for one window.

    ``given`` (name -> a regex, or a list of values) wins; a ``query`` variable of the
    ``label_values([selector,] label)`` form asks Prometheus (every value, as "All" selects,
    or the first of a single-value variable); custom, constant, interval and textbox
    variables take their current value; a datasource variable is its own name (it never
    appears in an ``expr`` that Prometheus runs). Other queries raise ``UnknownVariable``."""

    values: dict[str, str | list[str]] = field(default_factory=dict)

    @classmethod
    def resolve(
        cls,
        dashboard: Mapping[str, Any],
        api: Prometheus,
        window: Window,
        given: Mapping[str, str | list[str]] | None = None,
    ) -> Variables:
        out = cls(dict(given or {}))
        for var in dashboard.get("templating", {}).get("list", []):
            name, kind = var["name"], var.get("type", "query")
            if name in out.values:
                continue
            if kind == "datasource":
                out.values[name] = name
            elif kind == "query":
                values = out._query(var, api, window)
                # One value of a single-value variable, written as is; else every value ("All").
                multi = var.get("multi") or var.get("includeAll")
                out.values[name] = values if multi or not values else values[0]
            else:
                current = var.get("current", {}).get("value") or var.get("query", "")
                if kind == "interval" and current in ("auto", "$__auto_interval", ""):
                    current = duration(window.rate_interval)
                out.values[name] = current if isinstance(current, str) else list(current)
        return out

    def _query(self, var: Mapping[str, Any], api: Prometheus, window: Window) -> list[str]:
        query = var.get("query") or var.get("definition") or ""
        query = query.get("query", "") if isinstance(query, dict) else query
        found = LABEL_VALUES.match(substitute(query, self.values, window))
        if not found:
            raise UnknownVariable(f"variable {var['name']}: only label_values(...) queries are resolved, not {query!r}")
        values = api.label_values(found.group(2), found.group(1), window)
        pattern = (var.get("regex") or "").strip()
        if pattern:  # Grafana's /regex/: keep matches; a capture group picks the value
            compiled = re.compile(pattern[1:-1] if pattern.startswith("/") and pattern.endswith("/") else pattern)
            picked = [m.group(1) if m.groups() else m.group(0) for v in values if (m := compiled.search(v))]
            values = sorted(dict.fromkeys(picked))
        return values


@dataclass
class Result:
    """One target of one panel, evaluated."""

    dashboard: str
    panel: dict[str, Any]
    target: dict[str, Any]
    expr: str
    series: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""

    @property
    def where(self) -> str:
        return f"{self.dashboard} / {self.panel.get('title', '?')!r} / {self.target.get('expr')!r}"

    @property
    def finite(self) -> bool:
        """Some point of some series is a number (not NaN, not +-Inf)."""
        return any(math.isfinite(float(v)) for s in self.series for _, v in s["values"])


def evaluate(dashboard: Mapping[str, Any], api: Prometheus, window: Window, variables: Variables) -> list[Result]:
    """Every target of every panel of ``dashboard``, queried over ``window``."""
    title = dashboard.get("title", "?")
    results = []
    for panel in panels(dashboard):
        for target in targets(panel):
            result = Result(title, panel, target, target["expr"])
            try:
                result.expr = substitute(target["expr"], variables.values, window)
                result.series = api.query_range(result.expr, window)
            except PrometheusUnreachable:
                raise
            except (UnknownVariable, PrometheusError) as exc:
                result.error = str(exc)
            results.append(result)
    return results


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    """A series' name from a target's ``legendFormat`` (``{{worker}} {{step}}``), as Grafana
    writes it; without one, the labels."""
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)
    shown = {k: v for k, v in labels.items() if k != "__name__"}
    return labels.get("__name__", "") + ("{" + ", ".join(f'{k}="{v}"' for k, v in shown.items()) + "}" if shown else "")
