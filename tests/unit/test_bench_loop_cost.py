"""``benchmarks/loop_cost.py``: what a one-job round trip costs a server's loop thread, the
broker's beside a minimal protocol loop's, a bare Python forwarder's and ``zmq.proxy``'s, and
the broker of another commit beside this one's (issue 12, goal 3)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    # The servers in Python count what they carried (or, with no worker, answered): each round trip went through them.
    assert run["forwarded"] == (None if server == "proxy" else WARM_UP + ROUND_TRIPS)
    assert run["cpu_us"] > 0 and run["p50_us"] > 0
    assert run["user_us"] >= 0 and run["sys_us"] >= 0
    if server in ("proxy", "direct", "echo"):
        assert run["inside"] is None  # libzmq's loop, and the paths without a server: not stamped
    else:  # a SUBMIT (or its raw message) and a FINAL per round trip, each read and then sent on
        inside = run["inside"]
        assert 2 * ROUND_TRIPS - 2 <= inside["messages"] <= 2 * ROUND_TRIPS, inside  # less a heartbeat's
        assert inside["to_send_us"] > 0 and inside["send_us"] > 0


def test_an_unknown_server_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown server 'nginx'"):
        loop_cost.measure("nginx", 1)


def test_a_message_counts_from_its_read_to_the_send_it_caused() -> None:
    read, sent, client, worker = loop_cost.READ, loop_cost.SEND, loop_cost.CLIENT, loop_cost.WORKER
    events = [
        (sent, 5, 9),  # the server's own heartbeat: no read before it
        (read, 100, client),
        (sent, 140, 175),  # the SUBMIT's JOBS: 40 ns to the send, 35 ns of send
        (read, 300, worker),  # a heartbeat that needs no answer
        (read, 400, worker),
        (sent, 410, 430),  # the FINAL sent on
        (sent, 440, 450),  # a second message for one read
    ]
    assert loop_cost.residences(events) == [(client, 40, 35), (worker, 10, 20)]


def test_the_stamps_summarize_only_the_marked_round_trips_per_side() -> None:
    stamps = loop_cost.Stamps()
    stamps.read(0, loop_cost.CLIENT)
    stamps.sent(9_000, 10_000)  # the warm-up's, before the first mark
    assert stamps.summary() is None
    stamps.mark()
    for start, side, to_send in ((100_000, loop_cost.CLIENT, 5_000), (200_000, loop_cost.WORKER, 3_000)) * 2:
        stamps.read(start, side)
        stamps.sent(start + to_send, start + to_send + 2_000)
    stamps.read(300_000, loop_cost.CLIENT)
    stamps.sent(301_000, 303_000)
    stamps.mark()
    stamps.read(400_000, loop_cost.WORKER)
    stamps.sent(500_000, 600_000)  # after the second mark
    summary = stamps.summary()
    assert summary == {
        "messages": 5,
        "to_send_us": 3.0,  # of 1, 3, 3, 5, 5
        "send_us": 2.0,
        "client_to_send_us": 5.0,  # of 1, 5, 5
        "worker_to_send_us": 3.0,
    }


def run(cpu: float, inside: dict[str, float] | None = None) -> dict[str, Any]:
    return {"cpu_us": cpu, "user_us": cpu / 2, "sys_us": cpu / 4, "p50_us": 10 * cpu, "inside": inside}


def inside(to_send: float, send: float) -> dict[str, float]:
    """A run's ``Stamps.summary``: a client's message 5 us slower to its send than a worker's."""
    sides = {"client_to_send_us": to_send + 5, "worker_to_send_us": to_send - 5}
    return {"messages": 100, "to_send_us": to_send, "send_us": send, **sides}


def test_the_summary_takes_medians_and_its_ratios_to_the_proxy(capsys: pytest.CaptureFixture[str]) -> None:
    runs = {
        "broker": [run(170, inside(40, 30)), run(150, inside(50, 35)), run(190, inside(45, 40))],
        "forwarder": [run(110, inside(6, 10)), run(100, inside(5, 20)), run(130, inside(7, 30))],
        "proxy": [run(50), run(40), run(60)],
    }
    result = loop_cost.report(runs, 5000)
    broker = {"cpu_us": 170, "user_us": 85, "sys_us": 42.5, "p50_us": 1700, "to_send_us": 45, "send_us": 35}
    assert result["broker"] == {**broker, "client_to_send_us": 50, "worker_to_send_us": 40}
    assert result["proxy"] == {"cpu_us": 50, "user_us": 25, "sys_us": 12.5, "p50_us": 500}
    assert result["cpu_over_proxy"] == {"broker": 3.4, "forwarder": 2.2}
    assert result["broker_own_work_us"] == 60
    assert result["to_send_beyond_forwarder_us"] == {"broker": 39}  # the proxy is not stamped
    out = capsys.readouterr().out
    assert json.loads(out.splitlines()[-1].removeprefix("RESULT ")) == json.loads(json.dumps(result))
    assert "broker / zmq.proxy, CPU per round trip: 3.40x" in out
    assert "a message's read to send, the broker's less the forwarder's (twice a round trip): 39.0 us" in out


def test_without_the_proxy_or_the_forwarder_no_ratio_is_made_up() -> None:
    result = loop_cost.summarize({"broker": [run(170, inside(40, 30))], "minimal": [run(150, inside(25, 30))]})
    assert "cpu_over_proxy" not in result and "broker_own_work_us" not in result
    assert "to_send_beyond_forwarder_us" not in result


def test_each_stamped_server_is_set_beside_the_forwarders_read_to_send() -> None:
    result = loop_cost.summarize(
        {
            "broker": [run(170, inside(44, 40))],
            "minimal": [run(150, inside(25, 40))],
            "forwarder": [run(110, inside(8, 40))],
        }
    )
    assert result["to_send_beyond_forwarder_us"] == {"broker": 36, "minimal": 17}
    assert result["minimal"]["client_to_send_us"] == 30 and result["minimal"]["worker_to_send_us"] == 20


def test_the_broker_of_another_tree_runs_in_its_own_interpreter_and_is_checked() -> None:
    run = loop_cost.measure("broker", ROUND_TRIPS, tree=str(ROOT))  # this tree, mapped by roles.use_tree
    assert run["forwarded"] == WARM_UP + ROUND_TRIPS
    assert 2 * ROUND_TRIPS - 2 <= run["inside"]["messages"] <= 2 * ROUND_TRIPS
    command = loop_cost.serve_command("broker", str(ROOT))
    assert command[1] == "-I" and f"use_tree({str(ROOT.resolve())!r})" in command[-1]
    with pytest.raises(ValueError, match="only the broker comes from another tree"):
        loop_cost.measure("forwarder", 1, tree=str(ROOT))


def test_this_trees_broker_is_set_over_the_baselines_per_round_and_at_the_median() -> None:
    after = [run(200, inside(40, 30)), run(150, inside(50, 30)), run(180, inside(45, 30))]
    before = [run(100, inside(50, 30)), run(150, inside(50, 30)), run(200, inside(90, 30))]
    ratios = loop_cost.over_baseline(after, before)
    assert ratios["cpu_us"] == {"ratio": 1.2, "rounds": [2.0, 1.0, 0.9]}  # 180 / 150
    assert ratios["to_send_us"] == {"ratio": 0.9, "rounds": [0.8, 1.0, 0.5]}  # 45 / 50
    assert ratios["p50_us"]["ratio"] == 1.2
    result = loop_cost.summarize({"broker": after, "baseline": before})
    assert result["broker_over_baseline"] == ratios


def test_a_baseline_ref_adds_the_broker_of_that_commit_to_the_same_rounds() -> None:
    script = str(ROOT / "benchmarks" / "loop_cost.py")
    args = ["--baseline-ref", "HEAD", "--servers", "broker", "--round-trips", "30", "--rounds", "2"]
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout.splitlines()[-1].removeprefix("RESULT "))
    assert result["baseline_ref"].startswith("HEAD = ")
    assert set(result) >= {"broker", "baseline", "broker_over_baseline"}
    assert len(result["broker_over_baseline"]["cpu_us"]["rounds"]) == 2
    refuse = [sys.executable, script, "--baseline-ref", "HEAD", "--servers", "forwarder"]
    refused = subprocess.run(refuse, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2 and "--servers must include broker" in refused.stderr


def timed(p50: float) -> dict[str, Any]:
    return {"cpu_us": 1.0, "user_us": 1.0, "sys_us": 0.0, "p50_us": p50, "inside": None}


def test_goal_3s_ratio_is_each_servers_added_latency_over_the_proxys_per_round(
    capsys: pytest.CaptureFixture[str],
) -> None:
    runs = {
        "broker": [timed(500), timed(420), timed(480)],
        "minimal": [timed(400), timed(380), timed(390)],
        "forwarder": [timed(330), timed(300), timed(310)],
        "proxy": [timed(300), timed(280), timed(260)],
        "direct": [timed(200), timed(220), timed(210)],
        "echo": [timed(150), timed(160), timed(140)],
    }
    result = loop_cost.report(runs, 5000)
    added = result["added_over_proxy"]
    assert set(added) == {"broker", "minimal", "forwarder"}  # the proxy is the reference; the direct paths add nothing
    # The broker adds 300, 200, 270 us to its direct path; the proxy 150, 120, 120 to the echo's.
    assert added["broker"] == {"added_us": 270, "ratio": 2.0, "rounds": [2.0, 1.67, 2.25], "goal_met": False}
    # The forwarder is set beside the echo, as the proxy: it adds 180, 140, 170.
    assert added["forwarder"] == {"added_us": 170, "ratio": 1.2, "rounds": [1.2, 1.17, 1.42], "goal_met": True}
    assert added["minimal"]["rounds"] == [1.33, 1.33, 1.5] and added["minimal"]["goal_met"]
    out = capsys.readouterr().out
    assert "over zmq.proxy's: goal 3 <= 1.5x" in out
    assert "broker       270.0 us   2.00x (NOT met)   rounds: 2.00, 1.67, 2.25" in out


def test_without_a_path_to_set_it_against_no_added_latency_is_made_up() -> None:
    both = {"broker": [timed(500)], "proxy": [timed(300)], "direct": [timed(200)], "echo": [timed(150)]}
    assert loop_cost.summarize({k: v for k, v in both.items() if k != "echo"}).get("added_over_proxy") is None
    assert loop_cost.summarize({k: v for k, v in both.items() if k != "proxy"}).get("added_over_proxy") is None
    no_direct = loop_cost.summarize({k: v for k, v in both.items() if k != "direct"})
    assert "added_over_proxy" not in no_direct  # the broker has no direct path in the run: no server left
    # A round where the proxy added nothing (the noise of a fast echo) has no ratio, and is left out of the median.
    runs = {"broker": [timed(500), timed(500)], "proxy": [timed(150), timed(300)]}
    runs |= {"direct": [timed(200), timed(200)], "echo": [timed(150), timed(150)]}
    assert loop_cost.added_latency(runs)["broker"] == {
        "added_us": 300,
        "ratio": 2.0,
        "rounds": [None, 2.0],
        "goal_met": False,
    }
