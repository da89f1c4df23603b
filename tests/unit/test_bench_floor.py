"""``benchmarks/broker_throughput.py``'s in-process floor: the goal's case's scheduler and codec
alone (``broker_phases.py``), measured at a full run's start and end, so that a run's absolute
figures can be read against the machine's speed at the time (issue 12, goal 1)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # as when run from there

import broker_throughput as bt  # noqa: E402
from broker_phases import PHASES  # noqa: E402
from report import floor_line  # noqa: E402


def test_broker_phases_json_gives_each_phase_and_their_total() -> None:
    script = str(ROOT / "benchmarks" / "broker_phases.py")
    run = subprocess.run(
        [sys.executable, script, *bt.FLOOR_CASE, "--rounds", "3", "--samples", "1", "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads(run.stdout.splitlines()[-1])
    assert list(result) == ["final"]  # FLOOR_CASE names one form
    phases = result["final"]
    assert set(phases) == {*PHASES, "total"}
    assert all(v > 0 for v in phases.values()), phases
    assert abs(phases["total"] - sum(phases[p] for p in PHASES)) < 1e-9


def test_the_floor_is_the_goal_case_measured_in_a_fresh_process() -> None:
    floor = bt.in_process_floor(argparse.Namespace(quick=True))
    assert 0 < floor < 1000, floor  # us/job: a real measurement, not a placeholder
    assert bt.FLOOR_CASE[bt.FLOOR_CASE.index("--clients") + 1] == "8"  # the goal's case: 8c x 64w
    assert bt.FLOOR_CASE[bt.FLOOR_CASE.index("--workers") + 1] == "64"


def test_the_floor_is_what_broker_phases_printed_last(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.append(command)
        out = "the table\n" + json.dumps({"final": {"dispatch": 1.0, "total": 4.25}}) + "\n"
        return subprocess.CompletedProcess(command, 0, out, "")

    monkeypatch.setattr(bt.subprocess, "run", fake_run)
    assert bt.in_process_floor(argparse.Namespace(quick=False)) == 4.25
    (command,) = seen
    assert command[1].endswith("broker_phases.py") and command[2 : 2 + len(bt.FLOOR_CASE)] == bt.FLOOR_CASE
    assert command[-5:] == ["--rounds", "300", "--samples", "3", "--json"]


def test_the_floor_line_reads_the_run_against_the_budget() -> None:
    quiet = floor_line([1.9, 2.1], 3.5)
    assert "1.90, 2.10 us/job" in quiet
    assert "0.70x the budget" in quiet  # the worse of the two, over 3 us
    assert "took 1.84x that" in quiet  # through sockets over the better one
    assert "out of reach" not in quiet
    slow = floor_line([3.7, 5.4], None)
    assert "1.80x the budget" in slow and "out of reach before any socket" in slow
    assert "through sockets" not in slow
