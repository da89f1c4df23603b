"""The Grafana dashboards (deploy/grafana): the committed JSON and ConfigMaps are exactly what
``dashboards.py`` generates; every dashboard has the data source, worker and client
variables; every panel has a title, a unit, a description and targets; every metric an
expression names is documented in docs/metrics.md (and a ``vllm:`` one is registered by the
installed vLLM's ``PrometheusStatLogger``); percentiles come from ``_bucket`` series only;
selectors honour ``$worker`` and ``$client``; every expression parses (``promtool``).

The checks are functions returning problems, each shown to find a planted one."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_alerts import promtool_binary

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
METRICS_DOC = ROOT / "docs" / "metrics.md"
sys.path.insert(0, str(GRAFANA))  # dashboards.py imports its sibling package ``boards``, as when run

import dashboards  # noqa: E402

NAMED = {"fleet": "Fleet", "latency": "Latency", "weight-sync": "Weight sync", "engines": "Engines"}
VARIABLES = {"worker", "client", "__rate_interval", "__range"}
"""The variables an expression may use (dashboards.py's docstring promises no others)."""
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
KEYWORDS |= {"inf", "nan", "Inf", "NaN"}
KEYWORDS |= {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk"}
KEYWORDS |= {"quantile", "limitk", "limit_ratio"}  # aggregations: `sum by (x) (...)` has no "(" right after sum
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def boards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((GRAFANA / "dashboards").glob("*.json"))}


def panels() -> list[tuple[str, dict[str, Any]]]:
    return [(name, panel) for name, board in boards().items() for panel in board["panels"]]


def exprs() -> list[tuple[str, str]]:
    """(where, expr) for every target of every panel."""
    return [
        (f"{name}: {panel['title']} [{target['refId']}]", target["expr"])
        for name, panel in panels()
        for target in panel["targets"]
    ]


# -- PromQL, as far as these checks need it -------------------------------------------------
LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
TOKENS = re.compile(
    r'"(?:[^"\\]|\\.)*"'  # a string
    r"|\[[^\]]*\]"  # a range
    r"|(?<![\w.:$])([a-zA-Z_:][\w:]*)\s*(\{[^}]*\})?"  # a name, and its label matchers if any
)


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, label matchers) of every vector selector in ``expr``."""
    text = LABEL_LISTS.sub(r"\1 ()", expr)
    found = []
    for m in TOKENS.finditer(text):
        name, matchers = m.group(1), m.group(2) or ""
        if name is None or name in KEYWORDS or (text[m.end() :].startswith("(") and not matchers):
            continue  # a string, a range, a keyword, a function or aggregation
        found.append((name, matchers))
    return found


def call_arguments(expr: str, function: str) -> list[str]:
    """The argument text of every call of ``function`` in ``expr``."""
    found = []
    for m in re.finditer(rf"\b{function}\s*\(", expr):
        depth, start = 1, m.end()
        for i in range(start, len(expr)):
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            if depth == 0:
                found.append(expr[start:i])
                break
    return found


def test_the_promql_reader_finds_selectors_and_nothing_else() -> None:
    expr = (
        'sum by (worker, le) (rate(vllm:ttft_bucket{worker=~"$worker", le="0.5"}[$__rate_interval])) '
        "/ on(job) group_left(instance) scalar(up) - 1e3 * foo_total offset 5m > bool 0.5"
    )
    assert selectors(expr) == [("vllm:ttft_bucket", '{worker=~"$worker", le="0.5"}'), ("up", ""), ("foo_total", "")]
    assert call_arguments("histogram_quantile(0.9, sum(rate(a[1m])) by (le)) + b", "histogram_quantile") == [
        "0.9, sum(rate(a[1m])) by (le)"
    ]


# -- what the metrics are: docs/metrics.md's tables, vLLM's registrations ---------------------
@cache
def documented() -> dict[str, tuple[str, frozenset[str]]]:
    """Every metric family docs/metrics.md's tables list: name -> (type, labels). vLLM's
    families all carry ``worker`` (workers/vllm_metrics.py adds it) besides their own."""
    metrics: dict[str, tuple[str, frozenset[str]]] = {}
    header: list[str] = []
    for line in METRICS_DOC.read_text().splitlines():
        if not line.startswith("|"):
            header = []
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not header:
            header = cells
            continue
        if header[:2] != ["name", "type"] or set(cells[0]) <= {"-", " "}:
            continue
        labels = set(re.findall(r"`(\w+)`", cells[2])) if header[2] == "labels" else set()
        for name in re.findall(r"`((?:zmq_rollout_|vllm:)[\w:]+)`", cells[0]):
            metrics[name] = (cells[1], frozenset(labels | ({"worker"} if name.startswith("vllm:") else set())))
    return metrics


def series_of(name: str, kind: str) -> set[str]:
    """The series names a family exposes (prometheus_client: a counter's ends in ``_total``)."""
    if kind == "histogram":
        return {name + suffix for suffix in HISTOGRAM_SERIES}
    if kind == "counter":
        return {name.removesuffix("_total") + "_total"}
    return {name}


@cache
def documented_series() -> dict[str, frozenset[str]]:
    """Series name -> the labels of its family (``le`` for a ``_bucket``)."""
    out = {}
    for name, (kind, labels) in documented().items():
        for series in series_of(name, kind):
            out[series] = labels | ({"le"} if series.endswith("_bucket") else set())
    return out


@cache
def vllm_registered_series() -> frozenset[str]:
    """The series the installed vLLM's ``PrometheusStatLogger`` can expose, read from its source
    (``vllm/v1/metrics/loggers.py``: every ``_gauge_cls`` / ``_counter_cls`` / ``_histogram_cls``
    call with a literal ``name="vllm:..."``) without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed (scripts/install.sh)"
    source = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"
    found = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        kind = next((k for k in ("gauge", "counter", "histogram") if k in func.lower()), None)
        for keyword in node.keywords:
            value = keyword.value.value if isinstance(keyword.value, ast.Constant) else None
            if kind and keyword.arg == "name" and str(value).startswith("vllm:"):
                found |= series_of(str(value), kind)
    return frozenset(found)


def test_the_metric_lists_are_read() -> None:
    series = documented_series()
    assert series["zmq_rollout_jobs_total"] == {"outcome"}
    assert series["zmq_rollout_sync_step_duration_seconds_bucket"] == {"step", "le"}
    assert series["zmq_rollout_worker_credits_used"] == {"worker"}
    assert series["zmq_rollout_queue_depth"] == {"client"}
    assert series["zmq_rollout_worker_job_latency_seconds_count"] == set()  # a worker's own: no worker label
    assert "vllm:prefix_cache_hits_total" in series and "vllm:inter_token_latency_seconds_bucket" in series
    assert len([s for s in series if s.startswith("zmq_rollout_")]) > 40
    registered = vllm_registered_series()
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:prompt_tokens_total", "vllm:kv_cache_usage_perc"} <= (
        registered
    )
    assert len(registered) > 50


def metric_problems(expr: str) -> list[str]:
    """Names in ``expr`` that docs/metrics.md does not list (or, ``vllm:``, vLLM does not register)."""
    problems = []
    for name, _ in selectors(expr):
        if name not in documented_series():
            problems.append(f"{name}: not in docs/metrics.md")
        elif name.startswith("vllm:") and name not in vllm_registered_series():
            problems.append(f"{name}: not registered by the installed vLLM's PrometheusStatLogger")
    return problems


def variable_problems(expr: str) -> list[str]:
    """A selector of a family with a ``worker`` or ``client`` label that ignores the variable;
    a variable the dashboards do not define."""
    problems = [
        f'{name}: selected without {label}=~"${label}"'
        for name, matchers in selectors(expr)
        for label in sorted({"worker", "client"} & documented_series().get(name, frozenset()))
        if f'{label}=~"${label}"' not in matchers
    ]
    unknown = [v for v in re.findall(r"\$\{?(\w+)", expr) if v not in VARIABLES]
    return problems + [f"${v}: not a variable of the dashboards" for v in unknown]


def quantile_problems(expr: str) -> list[str]:
    """``histogram_quantile`` over anything but ``_bucket`` series, or without ``le`` kept."""
    problems = []
    for argument in call_arguments(expr, "histogram_quantile"):
        names = [name for name, _ in selectors(argument)]
        if not names or not all(n.endswith("_bucket") for n in names):
            problems.append(f"histogram_quantile over {names}: only _bucket series have the buckets")
        if not re.search(r"\bby\s*\((?:[^)]*,\s*)?le\b", argument):
            problems.append("histogram_quantile without `sum by (le, ...)`: the buckets are summed away")
    return problems


@pytest.mark.parametrize(
    ("check", "expr", "problem"),
    [
        (metric_problems, "rate(zmq_rollout_jobs_totl[1m])", "zmq_rollout_jobs_totl: not in docs"),
        (metric_problems, "zmq_rollout_job_latency_seconds", "zmq_rollout_job_latency_seconds: not in docs"),
        (metric_problems, 'sum(vllm:num_requests_runing{worker=~"$worker"})', "vllm:num_requests_runing"),
        (variable_problems, "sum(zmq_rollout_worker_credits_used)", 'without worker=~"$worker"'),
        (variable_problems, 'zmq_rollout_queue_depth{client="a"}', 'without client=~"$client"'),
        (variable_problems, "rate(zmq_rollout_jobs_total[$window])", "$window: not a variable"),
        (quantile_problems, "histogram_quantile(0.9, rate(zmq_rollout_job_latency_seconds_sum[1m]))", "_bucket"),
        (quantile_problems, "histogram_quantile(0.9, sum(rate(zmq_rollout_job_latency_seconds_bucket[1m])))", "le"),
    ],
)
def test_each_check_finds_what_it_is_for(check: Any, expr: str, problem: str) -> None:
    assert any(problem in p for p in check(expr)), check(expr)


def test_a_vllm_name_vllm_does_not_register_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Documented but gone from vLLM (renamed in an upgrade): the dashboards would show nothing."""
    monkeypatch.setattr(sys.modules[__name__], "vllm_registered_series", frozenset)
    assert metric_problems("vllm:kv_cache_usage_perc") == [
        "vllm:kv_cache_usage_perc: not registered by the installed vLLM's PrometheusStatLogger"
    ]


# -- the generated files --------------------------------------------------------------------
def test_the_committed_files_are_exactly_what_dashboards_py_generates() -> None:
    stale = []
    for path, text in dashboards.generated_files().items():
        committed = (ROOT / path).read_text() if (ROOT / path).is_file() else None
        if committed != text:
            stale.append(str(path))
    assert not stale, f"stale: {stale}; run `python deploy/grafana/dashboards.py` and commit the result"
    generated = {p for p in dashboards.generated_files() if p.suffix == ".json"}
    extra = {p.relative_to(ROOT) for p in (GRAFANA / "dashboards").glob("*.json")} - generated
    assert not extra, f"dashboards that dashboards.py does not generate: {sorted(map(str, extra))}"


def test_generating_twice_gives_the_same_bytes() -> None:
    assert dashboards.generated_files() == dashboards.generated_files()


def copy_of_the_tree(tmp_path: Path) -> Path:
    for part in ("deploy/grafana/dashboards", "deploy/grafana/provisioning"):
        shutil.copytree(ROOT / part, tmp_path / part)
    (tmp_path / "deploy" / "k8s").mkdir()
    shutil.copy(ROOT / dashboards.K8S_FILE, tmp_path / dashboards.K8S_FILE)
    return tmp_path


def test_check_names_each_stale_file_and_writing_fixes_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = copy_of_the_tree(tmp_path)
    assert dashboards.main(["--check", "--root", str(root)]) == 0
    fleet = root / "deploy/grafana/dashboards/fleet.json"
    fleet.write_text(fleet.read_text().replace("Ready workers", "Ready wrokers"))
    (root / "deploy/grafana/dashboards/old.json").write_text("{}\n")
    provider = root / "deploy/grafana/provisioning/dashboards/zmq-rollout.yml"
    provider.write_text(provider.read_text() + "# changed\n")  # its ConfigMap is now stale
    capsys.readouterr()
    assert dashboards.main(["--check", "--root", str(root)]) == 1
    named = re.findall(r"stale: (\S+)", capsys.readouterr().err)
    stale = ["deploy/grafana/dashboards/fleet.json", "deploy/grafana/dashboards/old.json", "deploy/k8s/grafana.yaml"]
    assert sorted(named) == stale
    assert dashboards.main(["--root", str(root)]) == 0
    assert dashboards.main(["--check", "--root", str(root)]) == 0
    assert not (root / "deploy/grafana/dashboards/old.json").exists()


def test_the_config_maps_hold_the_files_byte_for_byte() -> None:
    docs = [d for d in yaml.safe_load_all((ROOT / dashboards.K8S_FILE).read_text()) if d["kind"] == "ConfigMap"]
    held = {key: text for doc in docs for key, text in doc["data"].items()}
    files = {p.name: p.read_text() for p in (GRAFANA / "dashboards").glob("*.json")}
    files |= {p.name: p.read_text() for p in (GRAFANA / "provisioning").glob("*/*.yml")}
    assert held == files


# -- the dashboards -------------------------------------------------------------------------
def test_the_four_dashboards_exist_with_stable_uids() -> None:
    found = {name: (b["uid"], b["title"]) for name, b in boards().items()}
    for name, title in NAMED.items():
        assert found.get(name) == (f"zmq-rollout-{name}", f"zmq-rollout: {title}"), name
    assert len({uid for uid, _ in found.values()}) == len(found)


def test_every_dashboard_has_the_datasource_worker_and_client_variables() -> None:
    for name, board in boards().items():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        worker, client = variables["worker"], variables["client"]
        assert client["query"] == "label_values(zmq_rollout_queue_depth, client)", name
        metric = re.fullmatch(r"label_values\((\w+), worker\)", worker["query"])
        assert metric and "worker" in documented_series()[metric.group(1)], (name, worker["query"])
        for variable in (worker, client):
            assert variable["type"] == "query" and variable["multi"] and variable["includeAll"], name
            assert variable["datasource"]["uid"] == "${datasource}", name


def test_every_panel_has_a_title_unit_description_and_targets_with_exprs() -> None:
    assert len(panels()) >= 40
    for name, board in boards().items():
        ids = [p["id"] for p in board["panels"]]
        assert len(set(ids)) == len(ids), name
    for name, panel in panels():
        where = f"{name}: {panel.get('title')}"
        assert panel["type"] in ("timeseries", "stat"), f"{where}: panels are flat, no rows ({panel['type']})"
        assert panel["title"] and panel["description"], where
        assert panel["fieldConfig"]["defaults"]["unit"], where
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert panel["targets"], where
        for target in panel["targets"]:
            assert target["expr"].strip() and target["legendFormat"], where
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), where


def test_every_metric_in_every_expr_is_documented_and_exists() -> None:
    problems = [f"{where}: {p}" for where, expr in exprs() for p in metric_problems(expr)]
    assert not problems, "\n".join(problems)
    used = {name for _, expr in exprs() for name, _ in selectors(expr)}
    assert len([n for n in used if n.startswith("vllm:")]) >= 10
    assert len([n for n in used if n.startswith("zmq_rollout_")]) >= 30


def test_selectors_follow_the_worker_and_client_variables() -> None:
    problems = [f"{where}: {p}" for where, expr in exprs() for p in variable_problems(expr)]
    assert not problems, "\n".join(problems)


def test_percentiles_come_from_bucket_series_only() -> None:
    problems = [f"{where}: {p}" for where, expr in exprs() for p in quantile_problems(expr)]
    assert not problems, "\n".join(problems)
    assert sum("histogram_quantile" in expr for _, expr in exprs()) >= 20


def test_every_expr_parses(tmp_path: Path) -> None:
    """Each expression, variables substituted as Grafana would, as a recording rule for ``promtool``."""
    binary = promtool_binary()
    substitutions = {"$worker": ".*", "$client": ".*", "$__rate_interval": "1m", "$__range": "1h"}
    rules = []
    for i, (where, expr) in enumerate(exprs()):
        grafana_would_send = expr
        for variable, value in substitutions.items():
            grafana_would_send = grafana_would_send.replace(variable, value)
        rules.append({"record": f"dashboard:expr_{i}", "expr": grafana_would_send, "labels": {"where": where}})
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    command = [binary, "check", "rules", "rules.yml"]
    done = subprocess.run(command, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


def test_docs_list_every_panel_of_every_dashboard() -> None:
    text = METRICS_DOC.read_text()
    assert "\n## Dashboards\n" in text
    section = text.split("\n## Dashboards\n", 1)[1].split("\n## ", 1)[0]
    missing = [f"{name}: {panel['title']}" for name, panel in panels() if f"| {panel['title']} |" not in section]
    assert not missing, f"docs/metrics.md, Dashboards, lacks the panels {missing}"
    for name in NAMED:
        assert f"`{name}.json`" in section, name
