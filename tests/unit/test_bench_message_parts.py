"""``benchmarks/message_cost.py --parts``: where a one-job round trip's time goes in the broker's
thread, part by part (issue 12, goals 2 and 3: the libzmq calls against the Python)."""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

import pytest

from zmq_rollout.broker import server

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # as when run from there
message_cost = importlib.import_module("message_cost")

TIMED_PER_ROUND_TRIP = 10
"""Per message the broker reads (SUBMIT, FINAL): a read, the handler, the dispatch pass, one
encoding and one send. No read that finds none: where a socket's last read found one message,
the broker asks its events instead (``Broker._read``)."""


def test_a_part_is_timed_only_while_the_clock_is_on_and_an_error_still_counts() -> None:
    clock = message_cost.PartClock()

    def slow(fail: bool) -> str:
        time.sleep(0.002)  # the work being timed, not a synchronisation
        if fail:
            raise ValueError("boom")
        return "done"

    timed = clock.wrap("encode", slow)
    assert timed(False) == "done"
    assert clock.ns["encode"] == 0 and clock.calls == 0  # off: not timed
    clock.on = True
    assert timed(False) == "done"
    with pytest.raises(ValueError, match="boom"):
        timed(True)
    assert clock.calls == 2
    assert clock.ns["encode"] >= 2 * 2_000_000
    assert all(ns == 0 for part, ns in clock.ns.items() if part != "encode")


def test_every_part_of_a_real_round_trip_is_timed_and_the_broker_module_is_put_back() -> None:
    originals = (server.recv_frames, server.send_frames, server.codec)
    clock = message_cost.PartClock()
    rounds = 30
    cpu_us = message_cost.measure(rounds, packed=True, parts=clock)
    assert (server.recv_frames, server.send_frames, server.codec) == originals
    assert clock.calls == TIMED_PER_ROUND_TRIP * rounds, clock.calls
    assert cpu_us > 0
    none = "read none (ends _read)"
    assert clock.ns[none] == 0, clock.ns
    assert all(clock.ns[part] > 0 for part in message_cost.PARTS if part not in ("other", none)), clock.ns


def test_the_report_adds_its_parts_up_to_the_round_trip(capsys: pytest.CaptureFixture[str]) -> None:
    result = message_cost.report_parts(20, 1)
    out = capsys.readouterr().out
    assert json.loads(out.splitlines()[-1].removeprefix("RESULT ")) == json.loads(json.dumps(result))
    assert list(result["parts_us"]) == list(message_cost.PARTS)
    assert sum(result["parts_us"].values()) == pytest.approx(result["wall_us"], abs=0.05)
    assert "libzmq calls (reads, sends):" in out and result["timers_us"] >= 0
