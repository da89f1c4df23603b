"""``LocalCluster``'s workers run nicer than the broker and the clients beside them (the engines
busy-spin on every core; at equal priority a heartbeat or a streamed token waits seconds), and a
worker that dies before it registers is reported with what its log says."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from zmq_rollout.local import LocalCluster, log_excerpt, start_nicer


@contextlib.contextmanager
def sleeper(niceness: int) -> Iterator[subprocess.Popen[bytes]]:
    """A process started by ``start_nicer`` that sleeps until the test is done with it."""
    proc = start_nicer([sys.executable, "-c", "import time; time.sleep(30)"], niceness)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_runs_nicer_in_a_group_of_its_own_inside_the_callers_session() -> None:
    with sleeper(10) as proc:
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
        assert os.getpgid(proc.pid) == proc.pid  # os.killpg(proc.pid, ...) ends it and what it starts
        assert os.getpgid(0) != proc.pid
        assert os.getsid(proc.pid) == os.getsid(0)  # no session of its own ...
        group = Path(f"/proc/{proc.pid}/autogroup")
        if group.exists():  # ... so, on kernels with autogroups, one scheduling group with the caller
            assert group.read_text() == Path("/proc/self/autogroup").read_text()


def test_a_worker_at_niceness_0_keeps_the_callers_priority() -> None:
    with sleeper(0) as proc:
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpgid(proc.pid) == proc.pid


def test_on_python_3_10_the_group_is_made_in_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "version_info", (3, 10, 14))  # Popen has no process_group before 3.11
    with sleeper(10) as proc:
        assert os.getpgid(proc.pid) == proc.pid
        assert os.getsid(proc.pid) == os.getsid(0)


# -- a worker that dies before it registers: the error says why ------------------------------
def test_the_excerpt_of_a_dead_workers_log_has_the_cause_and_the_end(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    noise = [f"INFO loading {i}" for i in range(40)]
    log.write_text(
        "\n".join(
            [
                *noise[:20],
                "(EngineCore pid=1) ERROR Worker proc VllmWorker-0 died unexpectedly (exit code: -4)",
                *noise[20:],
                "",
                "EngineDeadError: EngineCore encountered an issue.",
            ]
        )
    )
    lines = log_excerpt(str(log), tail=3).splitlines()
    assert lines[0].endswith("died unexpectedly (exit code: -4)")
    assert lines[1] == "..."
    assert lines[2:] == ["INFO loading 38", "INFO loading 39", "EngineDeadError: EngineCore encountered an issue."]
    assert log_excerpt(str(tmp_path / "missing.log")) == "(no log: No such file or directory)"


def test_a_worker_that_exits_before_registering_is_reported_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = LocalCluster("/no/model", log_dir=str(tmp_path))
    monkeypatch.setattr(cluster, "registered", list)
    (tmp_path / "worker-0.log").write_text("Fatal Python error: Illegal instruction\nthe end\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    cluster.workers["worker-0"] = proc
    with pytest.raises(RuntimeError) as err:
        cluster.wait_for_workers(1, 30)
    text = str(err.value)
    assert "exited before registering: {'worker-0': 3}" in text
    assert f"--- worker-0: {tmp_path / 'worker-0.log'} ---" in text
    assert text.endswith("Fatal Python error: Illegal instruction\nthe end")
    cluster.log_dir = None
    with pytest.raises(RuntimeError, match=r"start the cluster with log_dir=\.\.\. to keep the workers' output"):
        cluster.wait_for_workers(1, 30)
