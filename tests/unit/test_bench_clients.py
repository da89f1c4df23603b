"""``benchmarks/broker_throughput.py --batched-client-procs``: where a case's clients run. The
batched broker and Curve cases (lean doubles) share their clients' processes, as the HTTP
baseline's client is one process; every other case keeps a process per client."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # as when run from there

import broker_throughput as bt  # noqa: E402
from report import clients_line  # noqa: E402


def _args(procs: int = 1, doubles: str = "lean") -> argparse.Namespace:
    return argparse.Namespace(batched_client_procs=procs, doubles=doubles)


def test_batched_broker_and_curve_cases_share_their_clients_processes() -> None:
    setups = {s.name: s for s in bt.matrix_setups()}
    assert bt.client_fleets(setups["broker 8c x 64w batched"], _args()) == [8]
    assert bt.client_fleets(setups["broker 8c x 64w batched"], _args(3)) == [3, 3, 2]
    assert bt.client_fleets(setups["broker 1c x 1w batched"], _args(2)) == [1]
    curve = [s for s in setups.values() if s.kind == "curve" and s.batch > 1]
    assert curve and all(bt.client_fleets(s, _args()) == [s.clients] for s in curve)


def test_every_other_case_keeps_a_process_per_client() -> None:
    for setup in bt.matrix_setups():
        shared = setup.kind in ("broker", "curve") and setup.batch > 1
        assert bool(bt.client_fleets(setup, _args())) == shared, setup.name
        assert bt.client_fleets(setup, _args(0)) == [], setup.name  # 0: as before
        assert bt.client_fleets(setup, _args(doubles="echo")) == [], setup.name  # the codec-built doubles


def test_the_report_says_how_the_clients_ran() -> None:
    assert clients_line(_args(0)) == "one process each"
    assert clients_line(_args(doubles="echo")) == "one process each"
    assert "in 1 process of one thread" in clients_line(_args())
    assert "in 2 processes of one thread" in clients_line(_args(2))


def test_a_negative_process_count_is_refused_before_anything_starts() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "broker_throughput.py"), "--batched-client-procs", "-1"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "--batched-client-procs -1: 0 (a process per client) or more" in run.stderr
