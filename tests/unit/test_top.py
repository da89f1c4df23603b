"""``zmq-rollout top``: the view drawn from a live broker with echo worker doubles, rates from
two metric samples, missing or broken metric families, and the command's exits."""

from __future__ import annotations

import io
from typing import Any

import pytest
from helpers import poll_until
from prometheus_client import CollectorRegistry, Counter, Gauge
from rich.console import Console
from typer.testing import CliRunner

from zmq_rollout import SamplingParams
from zmq_rollout import protocol as p
from zmq_rollout.cli import app
from zmq_rollout.config import ClientConfig
from zmq_rollout.metrics import start_metrics_server
from zmq_rollout.scrape import parse_metrics
from zmq_rollout.top import Metrics, plain_text, read_metrics, render, run_top


def metrics_url(broker: Any) -> str:
    return f"http://127.0.0.1:{broker.metrics_port}/metrics"


def rows(text: str, first: str) -> list[list[str]]:
    """The whitespace-split lines of ``text`` whose first cell starts with ``first``."""
    return [line.split() for line in text.splitlines() if line.startswith(first)]


def status(workers: list[p.WorkerStatus] | None = None, **kwargs: Any) -> p.StatusReply:
    return p.StatusReply(workers=workers or [], clients=kwargs.pop("clients", []), queued=0, running=0, **kwargs)


def worker(name: str, **kwargs: Any) -> p.WorkerStatus:
    fields = {"state": "ready", "model": "m", "credits": 8, "running": 0, "weight_version": 0, "idle_s": 0.1}
    return p.WorkerStatus(name=name, **{**fields, **kwargs})


# -- against a live broker ------------------------------------------------------------------
def test_the_one_shot_view_lists_each_worker_and_the_client_queues(
    start_broker: Any, start_double: Any, start_client: Any
) -> None:
    broker = start_broker()
    fast = start_double(broker, name="echo-fast", credits=16)
    slow = start_double(broker, name="echo-slow", credits=4)
    start_client(broker.frontend, name="trainer").generate(["hi"] * 5, SamplingParams(n=2, max_tokens=4))
    held = start_double(broker, name="echo-held", credits=1, hold=True)
    fast.stop()  # only the held double is left to take the next jobs
    slow.stop()
    poll_until(lambda: len(broker.status().workers) == 1, what="the echo doubles to leave")
    backlog = start_client(broker.frontend, name="backlog")
    for _ in range(3):
        backlog.submit("wait", SamplingParams(max_tokens=1))
    poll_until(lambda: broker.status().queued == 2, what="one job running and two queued")

    text = plain_text(render(broker.status(), read_metrics(metrics_url(broker), [], 5), title=broker.frontend))

    assert text.splitlines()[0].startswith(f"broker {broker.frontend}: 1 workers, 2 queued, 1 running, jobs/s -")
    (row,) = rows(text, held.name)
    assert row == [held.name, "ready", "0", "1/1", "1", "-", "-", "-", row[8], "echo-double"]
    assert [r[1:] for r in rows(text, "trainer-")] == [["0", "0"]]
    assert [r[1:] for r in rows(text, "backlog-")] == [["2", "1"]]
    assert "jobs since start: 8 submitted, 5 completed, 0 failed, 0 cancelled, 0 requeued" in text
    assert "sync: fleet version 0, no round running, rounds 0" in text
    held.release()


def test_the_command_prints_one_table_when_not_a_terminal_and_exits_0(
    start_broker: Any, start_double: Any, start_client: Any
) -> None:
    broker = start_broker()
    doubles = [start_double(broker, credits=c, weight_version=v) for c, v in ((8, 0), (32, 3))]
    start_client(broker.frontend, name="trainer").generate(["a", "b"], SamplingParams(max_tokens=2))
    kv = serve_engine_metrics(worker_label=doubles[1].name, kv=0.25)
    args = ["top", "--address", broker.frontend, "--metrics-url", metrics_url(broker), "--interval", "0.1",
            "--worker-metrics", kv, "--worker-metrics", "http://127.0.0.1:9/metrics"]  # fmt: skip

    result = CliRunner().invoke(app, args)

    assert result.exit_code == 0, result.output
    out = result.output
    for double, credits, version, kv_use in ((doubles[0], "0/8", "0", "-"), (doubles[1], "0/32", "3", "25%")):
        (row,) = rows(out, double.name)
        assert row[1:6] == ["ready", version, credits, "0", "0.0"] and row[7] == kv_use, out
    assert len(rows(out, "trainer-")) == 1 and not rows(out, "top-"), out  # not its own connection
    assert "jobs/s 0.0" in out  # two samples, no job in between
    assert rows(out, kv) == [[kv, doubles[1].name, "0.0", "25%", "3", "-"]], out
    dead = rows(out, "http://127.0.0.1:9/metrics")
    assert dead[0][1:] == ["error", "(below)", "-", "-", "-", "-"] and dead[1][1:3] == ["[Errno", "111]"], out
    assert "\x1b[" not in out  # plain text, no colour codes


def test_an_unreachable_broker_is_one_line_and_exit_1() -> None:
    args = ["top", "--address", "tcp://127.0.0.1:9", "--request-timeout-s", "0.2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and result.output.startswith("error: "), result.output
    assert "ClientConfig.request_timeout_s" in result.output


def test_on_a_terminal_it_refreshes_until_ctrl_c_and_returns(start_broker: Any, start_double: Any) -> None:
    broker = start_broker()
    double = start_double(broker)
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 2:
            raise KeyboardInterrupt

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    config = ClientConfig(address=broker.frontend, request_timeout_s=5)
    run_top(config, interval_s=0.5, metrics_url=metrics_url(broker), console=console, sleep=sleep)
    assert pauses == [0.5, 0.5]  # drew, refreshed once, then Ctrl-C ended it cleanly
    assert double.name in out.getvalue() and "jobs/s" in out.getvalue()


# -- pure rendering ---------------------------------------------------------------------------
BROKER_TEXT = """\
# TYPE zmq_rollout_jobs counter
zmq_rollout_jobs_total{{outcome="completed"}} {completed}
zmq_rollout_jobs_total{{outcome="failed"}} 7
# TYPE zmq_rollout_worker_credits_used gauge
zmq_rollout_worker_credits_used{{worker="w1"}} 6
# TYPE zmq_rollout_worker_completed_jobs counter
zmq_rollout_worker_completed_jobs_total{{worker="w1"}} {completed}
# TYPE zmq_rollout_sync_rounds counter
zmq_rollout_sync_rounds_total{{outcome="committed"}} {rounds}
zmq_rollout_sync_rounds_total{{outcome="aborted"}} 1
# TYPE zmq_rollout_sync_rounds_in_progress gauge
zmq_rollout_sync_rounds_in_progress 0
# TYPE zmq_rollout_sync_round_duration_seconds histogram
zmq_rollout_sync_round_duration_seconds_bucket{{le="+Inf"}} {rounds}
zmq_rollout_sync_round_duration_seconds_sum {round_seconds}
zmq_rollout_sync_round_duration_seconds_count {rounds}
# TYPE zmq_rollout_fleet_weight_version gauge
zmq_rollout_fleet_weight_version {rounds}
"""
ENGINE_TEXT = """\
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",model_name="m",worker="w1"}} {tokens}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m",worker="w1"}} 0.375
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m",worker="w1"}} 12
"""
ENGINE = "http://e1/metrics"


def sample(at: float, completed: float, rounds: int, tokens: float, round_seconds: float = 0.0) -> Metrics:
    text = BROKER_TEXT.format(completed=completed, rounds=rounds, round_seconds=round_seconds)
    broker = parse_metrics("http://b/metrics", text, at)
    return Metrics(broker, (parse_metrics(ENGINE, ENGINE_TEXT.format(tokens=tokens), at),))


def test_rates_come_from_two_samples() -> None:
    st = status([worker("w1"), worker("w2")])
    before, now = sample(10.0, 100, 2, 1_000, 3.0), sample(12.0, 160, 3, 5_000, 4.5)
    text = plain_text(render(st, now, before))
    assert "jobs/s 30.0" in text and "fleet version 3" in text
    # credits used/announced, jobs/s, tokens/s and KV use, each found by its worker label
    assert rows(text, "w1")[0][3:8] == ["6/8", "0", "30.0", "2,000.0", "38%"]
    assert rows(text, "w2")[0][3:8] == ["8", "0", "-", "-", "-"]  # no endpoint names it
    assert rows(text, ENGINE) == [[ENGINE, "w1", "2,000.0", "38%", "12", "-"]]
    sync = "sync: fleet version 3, no round running, rounds 1 aborted 3 committed, just ended 1 committed"
    assert sync + ", last took 1.50 s, mean 1.50 s" in text
    first = plain_text(render(st, before))  # one sample: no rates yet
    assert "jobs/s -" in first and rows(first, "w1")[0][5:8] == ["-", "-", "38%"]
    assert "rounds 1 aborted 2 committed, mean 1.50 s" in first


def test_a_counter_reset_is_no_rate() -> None:
    text = plain_text(render(status(), sample(12.0, 5, 0, 0), sample(10.0, 100, 2, 1_000)))
    assert "jobs/s -" in text


@pytest.mark.parametrize(
    "text",
    ["", "# TYPE zmq_rollout_something_else gauge\nzmq_rollout_something_else 1\n", "not {the format", "\x00\xff"],
)
def test_missing_or_broken_families_show_a_dash(text: str) -> None:
    metrics = Metrics(parse_metrics("http://b/metrics", text, 1.0), (parse_metrics(ENGINE, text, 1.0),))
    previous = Metrics(parse_metrics("http://b/metrics", text, 0.0), (parse_metrics(ENGINE, text, 0.0),))
    out = plain_text(render(status([worker("w1")], fleet_version=4), metrics, previous))
    assert "jobs/s -" in out and "sync: fleet version 4, rounds -" in out
    assert rows(out, "w1")[0][3:8] == ["8", "0", "-", "-", "-"]
    assert rows(out, ENGINE)[0][-4:] == ["-", "-", "-", "-"]
    broken = text.startswith(("not", "\x00"))
    assert ("cannot parse it" in out) == broken, out


def serve_engine_metrics(worker_label: str, kv: float) -> str:
    """A stand-in for a worker's /metrics with vLLM's families, labelled with the worker's name."""
    registry = CollectorRegistry()
    labels = {"engine": "0", "model_name": "m", "worker": worker_label}
    Gauge("vllm:kv_cache_usage_perc", "KV use", list(labels), registry=registry).labels(**labels).set(kv)
    Gauge("vllm:num_requests_running", "running", list(labels), registry=registry).labels(**labels).set(3)
    Counter("vllm:generation_tokens", "tokens", list(labels), registry=registry).labels(**labels).inc(10)
    server = start_metrics_server(registry, 0)
    _servers.append(server)
    return f"http://127.0.0.1:{server.port}/metrics"


_servers: list[Any] = []


@pytest.fixture(autouse=True)
def _stop_servers() -> Any:
    yield
    while _servers:
        _servers.pop().shutdown()
