"""``LocalCluster``'s workers run nicer than the broker and the clients beside them (the engines
busy-spin on every core; at equal priority a heartbeat or a streamed token waits seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from zmq_rollout.local import make_nicer


def test_a_worker_process_and_its_session_group_run_nicer() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        make_nicer(proc.pid, 10)
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
        group = Path(f"/proc/{proc.pid}/autogroup")
        if group.exists():  # kernels with autogroups: a nice value counts only inside the session's group
            assert group.read_text().split()[-2:] == ["nice", "10"], group.read_text()
    finally:
        proc.kill()
        proc.wait()
