"""The chaos soak (``benchmarks/chaos.py``), short: faults while clients submit, then every job
of every surviving client has exactly one answer, its own.

The script runs as a process of its own (it starts a broker process, worker processes and
client processes, and stops them all); its last line is ``RESULT {json}``. The long runs and
their figures are in benchmarks/README.md.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"


def chaos(*args: str, timeout_s: float) -> dict[str, Any]:
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(1 << 30))
    print(f"chaos seed {seed} (CHAOS_SEED={seed} repeats it)")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args, "--seed", str(seed)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # it stops what it started (which also dies with it)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    print(out[-6000:])
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"chaos.py ended with {proc.returncode} and no RESULT line"
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


def test_echo_workers_killed_broker_restarted_nothing_lost_nothing_doubled() -> None:
    r = chaos(
        "--workers", "echo", "--duration-s", "40", "--num-workers", "6", "--worker-kills", "20",
        "--stops", "5", "--broker-restarts", "2", "--client-kills", "1", "--sync-every-s", "2",
        timeout_s=240,
    )  # fmt: skip
    faults = {k: r[k] for k in ("worker_kills", "stops", "broker_restarts", "client_kills")}
    assert faults == {"worker_kills": 20, "stops": 5, "broker_restarts": 2, "client_kills": 1}
    assert r["jobs"] > 1000 and r["clients_without_summary"] == []
    assert (r["lost"], r["duplicated"], r["wrong"], r["foreign"]) == (0, 0, 0, 0), r["errors"]
    assert r["syncs_ok"] > 0 and r["syncs_failed_unexpectedly"] == 0, r["sync_failures"]
    assert r["recovery_goal_met"], r["restarts"]
    assert (r["final_queued"], r["final_running"]) == (0, 0)
