"""``benchmarks/broker_throughput.py --batch-window``: the SUBMITs each client keeps in flight
in the batched cases (the HTTP baseline's in-flight POSTs stay as they are); ``--http-window``:
the POSTs the HTTP baseline keeps in flight."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # as when run from there

import broker_throughput as bt  # noqa: E402
from report import BATCH, BATCH_WINDOW, HTTP_WINDOW, SINGLE_WINDOW  # noqa: E402


def test_the_window_reaches_every_batched_case_but_http() -> None:
    for setups in (bt.matrix_setups(8), bt.comparison_setups(8)):
        batched = [s for s in setups if s.batch == BATCH and s.kind != "http"]
        assert batched and {s.window for s in batched} == {8}
        assert {s.window for s in setups if s.batch == 1 and s.kind != "http"} == {SINGLE_WINDOW}
    assert {s.window for s in bt.matrix_setups(8) if s.kind == "http"} == {64}
    assert {s.window for s in bt.matrix_setups() if s.batch == BATCH and s.kind != "http"} == {BATCH_WINDOW}


def test_the_http_window_reaches_both_http_cases_only() -> None:
    assert HTTP_WINDOW == 64
    setups = bt.matrix_setups(BATCH_WINDOW, 32)
    http = [s for s in setups if s.kind == "http"]
    assert sorted(s.batch for s in http) == [1, BATCH] and {s.window for s in http} == {32}
    others = [s for s in setups if s.kind != "http"]
    assert others == [s for s in bt.matrix_setups() if s.kind != "http"]
    assert {s.window for s in bt.matrix_setups() if s.kind == "http"} == {HTTP_WINDOW}


def test_a_window_below_one_is_refused_before_anything_starts() -> None:
    for flag, error in (
        ("--batch-window", "--batch-window 0: at least 1 SUBMIT in flight per client"),
        ("--http-window", "--http-window 0: at least 1 POST in flight"),
    ):
        run = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "broker_throughput.py"), flag, "0"],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2
        assert error in run.stderr


def test_the_3x_line_names_the_jobs_in_flight_of_both_cases_when_they_differ() -> None:
    from report import in_flight_note, jobs_in_flight

    def row(case: str, clients: int, window: int, batch: int) -> dict[str, object]:
        return {"case": case, "clients": clients, "messages_in_flight_per_client": window, "jobs_per_message": batch}

    best, http = row("broker 8c x 64w batched", 8, BATCH_WINDOW, BATCH), row("HTTP 1c x server batched", 1, 64, BATCH)
    assert jobs_in_flight(best) == 8 * BATCH_WINDOW * BATCH and jobs_in_flight(http) == 64 * BATCH
    note = in_flight_note(best, http)
    assert f"{8 * BATCH_WINDOW * BATCH:,} in broker 8c x 64w batched" in note and f"{64 * BATCH:,} over HTTP" in note
    assert "--http-window HTTP's" in note
    assert in_flight_note(row("broker 8c x 64w batched", 8, 8, BATCH), http) == ""  # equal: nothing to say
    assert in_flight_note(None, http) == ""


def _row(setup: bt.Setup, jobs_per_s: int, us_per_job: float) -> dict[str, object]:
    return {
        "case": setup.name,
        "kind": setup.kind,
        "jobs_per_message": setup.batch,
        "jobs_per_s": jobs_per_s,
        "server_cpu_us_per_job": us_per_job,
    }


def test_goal_pairs_rerun_the_best_broker_batched_case_and_http_batched_alternating_first(monkeypatch) -> None:
    setups = {s.name: s for s in bt.matrix_setups() if s.kind in ("broker", "http")}
    rows = [
        _row(setups["broker 8c x 8w batched"], 200_000, 4.0),
        _row(setups["broker 8c x 64w batched"], 300_000, 3.0),  # the best: the one paired
        _row(setups["broker 8c x 64w unbatched"], 90_000, 9.0),
        _row(setups["HTTP 1c x server batched"], 100_000, 9.0),
    ]
    answers = iter([310_000, 100_000, 95_000, 290_000, 330_000, 100_000])  # in the order the runs go
    ran: list[str] = []

    def run_throughput(setup: bt.Setup, args: object) -> dict[str, object]:
        ran.append(setup.name)
        return _row(setup, next(answers), 3.0 if setup.kind == "broker" else 9.0)

    monkeypatch.setattr(bt, "run_throughput", run_throughput)

    class Args:
        goal_pairs = 3

    pairs = bt.goal_pairs(rows, setups, Args())  # type: ignore[arg-type]
    broker, http = "broker 8c x 64w batched", "HTTP 1c x server batched"
    assert ran == [broker, http, http, broker, broker, http]
    assert [p["ratio"] for p in pairs] == [3.1, round(290_000 / 95_000, 3), 3.3]
    assert [p["first"] for p in pairs] == [broker, http, broker]


def test_goal_pairs_verdict_is_the_median_ratio(capsys) -> None:
    from report import goal_pairs_line

    def pairs(*ratios: float) -> list[dict[str, object]]:
        return [
            {"ratio": r, "broker_case": "broker 8c x 64w batched", "broker_us_per_job": 3.0, "http_us_per_job": 9.3}
            for r in ratios
        ]

    assert goal_pairs_line(pairs(3.2, 2.9, 3.1)) is True
    out = capsys.readouterr().out
    assert "MET (median 3.10x; pairs 3.20x, 2.90x, 3.10x" in out and "3.10x, 3.10x, 3.10x)" in out
    assert goal_pairs_line(pairs(2.5, 3.5, 2.9)) is False
    assert "NOT MET (median 2.90x" in capsys.readouterr().out
    assert goal_pairs_line([]) is None
    assert capsys.readouterr().out == ""


def test_goal_pairs_that_cannot_run_are_refused_before_anything_starts() -> None:
    for flags, error in (
        (["--goal-pairs", "-1"], "--goal-pairs must be 0 or more"),
        (["--goal-pairs", "3", "--scale"], "--goal-pairs pairs the full run's cases: not with --scale"),
        (["--goal-pairs", "3", "--baseline-ref", "HEAD"], "not with --scale, --baseline-ref or --profile"),
    ):
        run = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "broker_throughput.py"), *flags],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2 and error in run.stderr, flags
