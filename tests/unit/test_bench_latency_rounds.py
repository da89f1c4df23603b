"""``broker_throughput.py --latency-rounds N``: the latency goal (issue 12, goal 3) over rounds
of the four paths in a rotated order, its verdict the median of the rounds' ratios."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # as when run from there
bt = importlib.import_module("broker_throughput")
report = importlib.import_module("report")


def round_of(direct: int, broker: int, raw: int, proxy: int) -> dict[str, list[int]]:
    """A round whose paths' round trips (ns) all take the given us: each percentile is that."""
    us = {"direct": direct, "broker": broker, "raw-direct": raw, "proxy": proxy}
    return {path: [v * 1000] * 10 for path, v in us.items()}


def added(*rounds: dict[str, list[int]]) -> list[tuple[dict[str, float], dict[str, float]]]:
    """Rounds as ``report.report`` gives them to ``latency_rounds_line``."""
    return [report.added_latency(report.percentiles(r)) for r in rounds]


def test_each_round_runs_the_four_paths_in_an_order_rotated_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []

    def run_latency(path: str, args: Any) -> list[int]:
        ran.append(path)
        return [len(ran) * 1000]

    monkeypatch.setattr(bt, "run_latency", run_latency)

    rounds = bt.latency_rounds(argparse.Namespace(latency_rounds=3))
    paths = list(bt.LATENCY_PATHS)
    assert ran == paths + paths[1:] + paths[:1] + paths[2:] + paths[:2]
    assert [list(r) for r in rounds] == [paths] * 3  # each round in the table's order
    assert rounds[1]["direct"] == [8000]  # round 2 ran direct last: the 8th run


def test_the_verdict_over_rounds_is_the_median_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    # broker-added / proxy-added per round: 100/80 = 1.25, 300/100 = 3.0, 140/100 = 1.4
    rounds = [round_of(100, 200, 50, 130), round_of(100, 400, 50, 150), round_of(100, 240, 50, 150)]
    assert report.latency_rounds_line(added(*rounds)) is True
    assert "over 3 rounds: MET (median 1.40x; rounds 1.25x, 3.00x, 1.40x)" in capsys.readouterr().out
    rounds[2] = round_of(100, 300, 50, 150)  # 200/100 = 2.0
    assert report.latency_rounds_line(added(*rounds)) is False
    assert "NOT MET (median 2.00x" in capsys.readouterr().out


def test_one_round_or_rounds_without_a_proxy_decide_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert report.latency_rounds_line(added(round_of(100, 200, 50, 130))) is None
    no_proxy = round_of(100, 200, 50, 130)
    del no_proxy["proxy"]
    assert report.latency_rounds_line(added(no_proxy, no_proxy)) is None
    assert capsys.readouterr().out == ""


def test_the_added_latencies_are_each_path_less_its_direct_one() -> None:
    lat = report.percentiles(round_of(100, 250, 50, 130))
    assert report.added_latency(lat) == ({"p50": 150.0, "p99": 150.0}, {"p50": 80.0, "p99": 80.0})
    del lat["raw-direct"]
    assert report.added_latency(lat) == ({"p50": 150.0, "p99": 150.0}, {})


def test_no_rounds_is_refused_before_anything_starts() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "broker_throughput.py"), "--latency-rounds", "0"],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "--latency-rounds must be at least 1" in out.stderr
