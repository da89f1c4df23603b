"""Profiles of the broker process for ``broker_throughput.py --profile``.

py-spy (``pip install py-spy``) samples the running broker from outside, at no cost to it,
and only while it is on a CPU: the best view on a shared machine. Without py-spy the broker
runs under cProfile, timed by its thread's CPU time; that adds a cost per Python call, so
call-heavy code looks bigger than it is. Both print own ("self") time per function, the
place to optimise, and py-spy also inclusive time.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from collections import Counter

PY_SPY_RATE = 250  # samples per second


def find_py_spy() -> str | None:
    return shutil.which("py-spy")


def start_py_spy(pid: int, seconds: float, path: str) -> subprocess.Popen[bytes]:
    exe = find_py_spy()
    if exe is None:
        raise RuntimeError("py-spy is not on PATH (pip install py-spy), or use --profiler cprofile")
    command = [exe, "record", "--pid", str(pid), "--duration", str(math.ceil(seconds)),
               "--rate", str(PY_SPY_RATE), "--format", "raw", "--output", path, "--nonblocking"]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _frame(frame: str) -> str:
    """'dispatch (/x/broker/scheduler.py:301)' -> 'dispatch (scheduler.py)'."""
    match = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not match:
        return frame
    return f"{match.group(1)} ({os.path.basename(match.group(2))})"


def print_py_spy(path: str, top: int) -> None:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            frames = [_frame(fr) for fr in stack.split(";")]
            total += n
            own[frames[-1]] += n
            for name in set(frames):
                inclusive[name] += n
    print(f"\nbroker py-spy profile: {total} samples at {PY_SPY_RATE}/s while on a CPU (raw stacks: {path})")
    for title, counter in (("own time", own), ("inclusive time", inclusive)):
        print(f"  top {top} by {title}:")
        for name, n in counter.most_common(top):
            print(f"    {100 * n / max(total, 1):5.1f}%  {name}")


def print_cprofile(path: str, top: int) -> None:
    import pstats

    print(f"\nbroker cProfile (thread CPU time), top {top} by own time (`python -m pstats {path}`):")
    pstats.Stats(path).strip_dirs().sort_stats("tottime").print_stats(top)
