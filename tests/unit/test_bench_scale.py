"""The pure parts of ``benchmarks/broker_scale.py`` (``broker_throughput.py --scale``): the
shapes it runs, /proc parsing, memory per peer, ratios to 8 x 8, the 1.5x goal, the tables."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # as when run from there

import broker_scale as bs
import roles


def row(workers: int, clients: int, mode: str, us: float, jobs: int = 1000) -> dict[str, Any]:
    return {
        "workers": workers,
        "clients": clients,
        "mode": mode,
        "jobs": jobs,
        "jobs_per_s": jobs,
        "broker_us_per_job": us,
        "jobs_per_jobs_message": 4.0,
        "broker_io_us_per_job": us / 4,
        "broker_messages_per_job": 2.0,
        "broker_us_per_message": us / 2,
        "cpu_cores": {"server": 0.9, "other": 0.1},
    }


def test_every_shape_runs_the_reference_and_the_goal_case_clients_largest_first() -> None:
    for quick in (True, False):
        shapes = bs.shapes(quick)
        for workers, clients in (bs.REFERENCE, bs.GOAL_SHAPE):
            assert clients in shapes[workers]
        assert all(list(c) == sorted(c, reverse=True) for c in shapes.values())
    full = bs.shapes(False)
    assert sorted(full) == [1, 8, 64, 256, 1024]
    assert all(set(c) == {1, 8, 64} for c in full.values())


def test_vm_status_reads_kilobytes_as_bytes() -> None:
    text = "Name:\tpython\nVmPeak:\t  200 kB\nVmHWM:\t   120 kB\nVmRSS:\t   100 kB\nThreads:\t3\n"
    assert bs.vm_status(text) == {"VmPeak": 204800, "VmHWM": 122880, "VmRSS": 102400}


def test_per_peer() -> None:
    assert bs.per_peer(1000, 5096, 4) == 1024
    assert bs.per_peer(1000, 1000, 8) == 0
    assert bs.per_peer(1000, 2000, 0) is None


def test_ratios_are_to_the_8x8_case_of_the_same_mode() -> None:
    rows = [
        row(8, 8, "batched", 10.0),
        row(8, 8, "unbatched", 40.0),
        row(1024, 64, "batched", 14.0),
        row(1024, 64, "unbatched", 100.0),
        row(1, 1, "batched", 5.0, jobs=0),
    ]
    bs.ratios(rows)
    assert [r["ratio"] for r in rows] == [1.0, 1.0, 1.4, 2.5, None]
    result = bs.goal(rows)
    assert result["ratios"] == {"batched": 1.4, "unbatched": 2.5}
    assert result["met_per_mode"] == {"batched": True, "unbatched": False}
    assert result["met"] is False


def test_the_goal_is_met_only_in_both_modes_and_unmeasured_without_8x8() -> None:
    rows = [row(8, 8, "batched", 10.0), row(1024, 64, "batched", 15.0)]
    bs.ratios(rows)
    assert bs.goal(rows)["met"] is True  # exactly 1.5x: within
    rows = [row(1024, 64, "batched", 15.0)]
    bs.ratios(rows)
    assert bs.goal(rows) == {"ratio_limit": 1.5, "ratios": {"batched": None}, "met_per_mode": {"batched": None},
                             "met": None}  # fmt: skip
    assert bs.goal([])["met"] is None


def test_tables_have_a_line_per_shape_and_per_broker() -> None:
    rows = [row(8, 8, "batched", 10.0), row(8, 8, "unbatched", 40.0), row(1024, 64, "batched", 30.0)]
    bs.ratios(rows)
    lines = bs.table(rows)
    assert len(lines) == 4
    assert "3.00" in lines[3]
    assert lines[3].count(" - ") >= 3  # the unbatched window of 1,024 x 64 did not run
    fleet = {
        "workers": 1024,
        "rss_no_peer": 32 << 20,
        "rss_workers": 64 << 20,
        "bytes_per_worker": 32768,
        "clients": 64,
        "rss_clients": 66 << 20,
        "bytes_per_client": None,
        "rss_after_load": 100 << 20,
        "hwm": 110 << 20,
        "idle_broker_cores": 0.05,
    }
    lines = bs.memory_table([fleet])
    assert len(lines) == 3
    assert "32,768" in lines[2]
    assert "n/a" in lines[2]


def test_scale_shapes_are_clients_x_workers() -> None:
    assert bs.shapes(False, "8x8, 64x1024,1x1024") == {8: (8,), 1024: (64, 1)}
    for bad in ("8", "8x", "ax8", "0x8", "8x8x8"):
        with pytest.raises(ValueError, match="shape"):
            bs.shapes(False, bad)


def test_broker_messages_per_job_counts_every_message_it_reads_or_sends() -> None:
    args = argparse.Namespace(duration=4.0)
    # 6,400 batched jobs: 100 SUBMITs, 800 JOBS and 800 FINALs, 40 HEARTBEATs sent, 200 answers,
    # 8 workers x 4 s of their heartbeats
    case = bs.Case(8, 8, batched=True)
    assert bs.broker_messages(case, 6400, 800, 40, 200, args) == pytest.approx((100 + 1600 + 40 + 200 + 32) / 6400)
    unbatched = bs.Case(8, 8, batched=False)  # a SUBMIT per job
    assert bs.broker_messages(unbatched, 100, 100, 0, 100, args) == pytest.approx((100 + 200 + 100 + 32) / 100)
    assert bs.broker_messages(case, 0, 0, 0, 0, args) == 0.0


def test_fleet_counts_sum_each_counter_over_threads_and_processes() -> None:
    n = roles.FLEET_COUNTS
    assert n == 4
    one = [5, 1, 0, 7, 3, 1, 2, 9]  # two threads: jobs, JOBS messages, purges, heartbeats each
    other = [10, 2, 0, 1]
    assert bs.fleet_counts([one, other]) == (18, 4, 2, 17)


def test_thread_cpu_splits_libzmq_io_threads_from_the_rest() -> None:
    cpu = bs.thread_cpu(os.getpid())
    assert set(cpu) == {"io", "loop"}
    assert cpu["loop"] > 0.0


def test_the_doubles_ceiling_is_the_cores_over_the_clients_and_workers_cpu_per_job() -> None:
    import report

    case = {"kind": "broker", "jobs_per_s": 80_000, "cpu_cores": {"server": 0.6, "workers": 0.56, "clients": 0.56}}
    doubles_us, ceiling = report.harness_ceiling(case, cores=2) or (0.0, 0.0)
    assert doubles_us == pytest.approx(14.0)  # 1.12 cores / 80,000 jobs/s
    assert ceiling == pytest.approx(2e6 / 14.0)
    assert report.harness_ceiling({**case, "jobs_per_s": 0}, cores=2) is None
    http = {"kind": "http", "jobs_per_s": 60_000, "cpu_cores": {"server": 0.96, "clients": 0.8}}
    assert report.harness_ceiling(http, cores=2) is None
