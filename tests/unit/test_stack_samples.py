"""``benchmarks/stack_samples.py``: py-spy's raw stacks summarised, and a sampler that cannot
start leaves the batch it wraps alone."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # as when run from there

import stack_samples

RAW = """\
thread (11): MainThread;<module> (w.py:1);run (base_events.py:600);_run_once (base_events.py:1800);encode (c.py:4) 30
thread (11): MainThread;<module> (w.py:1);run (base_events.py:600);_run_once (base_events.py:1800) 50
thread (12): Thread-1 (serve);serve (metrics.py:10) 20
garbage line without a count
"""


def test_own_inclusive_and_thread_shares_of_all_samples(tmp_path: Path) -> None:
    path = tmp_path / "profile.txt"
    path.write_text(RAW)
    summary = stack_samples.summarize(path)
    assert summary["samples"] == 100
    assert summary["own"] == [
        ("_run_once (base_events.py:1800)", 0.5),
        ("encode (c.py:4)", 0.3),
        ("serve (metrics.py:10)", 0.2),
    ]
    # on every sample of each thread it is on: the spine (the entry point, the loop), left out
    assert summary["inclusive"] == [("encode (c.py:4)", 0.3)]
    assert dict(summary["threads"]) == {"thread (11): MainThread": 0.8, "thread (12): Thread-1 (serve)": 0.2}
    lines = stack_samples.report("worker", summary)
    assert lines[0] == "worker: 100 samples at 200 Hz (on CPU)"
    assert "     50.0%  _run_once (base_events.py:1800)" in lines


def test_an_empty_profile_has_no_shares(tmp_path: Path) -> None:
    path = tmp_path / "profile.txt"
    path.write_text("")
    assert stack_samples.summarize(path) == {"samples": 0, "own": [], "inclusive": [], "threads": []}


def test_a_sampler_that_cannot_start_says_why_and_the_block_still_runs(tmp_path: Path) -> None:
    path = tmp_path / "profile.txt"
    ran = []
    with stack_samples.sampled(str(tmp_path / "no-such-py-spy"), 1, str(path)):
        ran.append(True)
    assert ran == [True]
    assert "py-spy did not start" in Path(f"{path}.err").read_text()
    with stack_samples.sampled(None, 1, str(path)):
        ran.append(True)
    assert ran == [True, True]


STAND_IN = """\
import pathlib, signal, sys, time
here = pathlib.Path(sys.argv[0]).parent
def stop(*_):
    (here / "stopped").write_text("stopped\\n")
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
(here / "ready").touch()
while True:
    time.sleep(0.05)
"""
"""A stand-in for ``py-spy record``: it runs until SIGINT, and installs its own SIGINT handler as
py-spy does. (A ``sh`` stand-in with ``trap`` failed once in a full run, its ``stopped`` file
missing, and never alone: a shell's trap follows rules of its own, such as that a
non-interactive shell cannot trap a signal ignored when it started.)"""


def test_a_block_that_raises_still_stops_the_sampler(tmp_path: Path) -> None:
    fake = tmp_path / "py-spy"
    fake.write_text(f"#!{sys.executable}\n{STAND_IN}")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError), stack_samples.sampled(str(fake), 1, str(tmp_path / "p.txt")):
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():  # the stand-in's handler is set
            assert time.monotonic() < deadline, "the stand-in never started"
            time.sleep(0.01)
        raise RuntimeError("the batch failed")
    err = (tmp_path / "p.txt.err").read_text()
    assert (tmp_path / "stopped").exists(), f"SIGINT did not stop the sampler (killed?); its stderr: {err!r}"
    assert (tmp_path / "stopped").read_text() == "stopped\n"


def test_a_frame_on_most_but_not_all_of_a_threads_samples_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "profile.txt"
    path.write_text("main;loop;handle;encode 50\nmain;loop;handle 30\nmain;loop 20\n")
    inclusive = dict(stack_samples.summarize(path)["inclusive"])
    assert inclusive == {"handle": 0.8, "encode": 0.5}  # main and loop: on every sample
    assert stack_samples.summarize(path)["threads"] == []  # no --threads: no thread shares
