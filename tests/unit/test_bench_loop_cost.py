"""``benchmarks/loop_cost.py``: what a one-job round trip costs a server's loop thread, the
broker's beside a bare Python forwarder's and ``zmq.proxy``'s (issue 12, goal 3)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # as when run from there
loop_cost = importlib.import_module("loop_cost")

ROUND_TRIPS = 60
WARM_UP = ROUND_TRIPS // 5


@pytest.mark.parametrize("server", loop_cost.SERVERS)
def test_each_server_carries_every_round_trip_and_its_loop_thread_is_timed(server: str) -> None:
    run = loop_cost.measure(server, ROUND_TRIPS)
    assert run["sent"] == WARM_UP + ROUND_TRIPS
    # The broker and the forwarder count what they carried: each round trip went through them.
    assert run["forwarded"] == (None if server == "proxy" else WARM_UP + ROUND_TRIPS)
    assert run["cpu_us"] > 0 and run["p50_us"] > 0
    assert run["user_us"] >= 0 and run["sys_us"] >= 0


def test_an_unknown_server_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown server 'nginx'"):
        loop_cost.measure("nginx", 1)


def run(cpu: float) -> dict[str, float]:
    return {"cpu_us": cpu, "user_us": cpu / 2, "sys_us": cpu / 4, "p50_us": 10 * cpu}


def test_the_summary_takes_medians_and_its_ratios_to_the_proxy(capsys: pytest.CaptureFixture[str]) -> None:
    runs = {
        "broker": [run(170), run(150), run(190)],
        "forwarder": [run(110), run(100), run(130)],
        "proxy": [run(50), run(40), run(60)],
    }
    result = loop_cost.report(runs, 5000)
    assert result["broker"] == {"cpu_us": 170, "user_us": 85, "sys_us": 42.5, "p50_us": 1700}
    assert result["cpu_over_proxy"] == {"broker": 3.4, "forwarder": 2.2}
    assert result["broker_own_work_us"] == 60
    out = capsys.readouterr().out
    assert json.loads(out.splitlines()[-1].removeprefix("RESULT ")) == json.loads(json.dumps(result))
    assert "broker / zmq.proxy, CPU per round trip: 3.40x" in out


def test_without_the_proxy_or_the_forwarder_no_ratio_is_made_up() -> None:
    result = loop_cost.summarize({"broker": [run(170)]})
    assert "cpu_over_proxy" not in result and "broker_own_work_us" not in result
