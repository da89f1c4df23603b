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
