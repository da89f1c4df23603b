"""py-spy samples of one process while a batch runs, and where they fall (``gpu_e2e.py --py-spy``).

``sampled(py_spy, pid, path)`` records ``pid`` with py-spy (on-CPU samples, ``--nonblocking``:
the process is never paused) for the duration of a ``with`` block, in py-spy's raw format:
one line per distinct stack, ``frame;frame;...;frame COUNT``, outermost first.
``summarize(path)`` reads such a file: the share of samples each function was on top of the
stack (its own time) and anywhere on it (inclusive), and the share of each thread.

A sampler that cannot attach (no py-spy, no ptrace permission) writes why into the file's
``.err`` beside it and the batch goes on: a profile is an aid, never a reason to lose a run.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RATE_HZ = 200


@contextlib.contextmanager
def sampled(py_spy: str | None, pid: int, path: str) -> Iterator[None]:
    """Record ``pid`` with ``py_spy`` into ``path`` while the block runs (nothing if ``py_spy`` is None)."""
    if not py_spy:
        yield
        return
    err = open(f"{path}.err", "w")  # noqa: SIM115 (closed below, after py-spy exits)
    cmd = [py_spy, "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--format", "raw", "--nonblocking",
           "--threads", "--function", "--output", path]  # fmt: skip
    try:
        proc = subprocess.Popen(cmd, stdout=err, stderr=err)
    except OSError as e:
        err.write(f"py-spy did not start: {e}\n")
        err.close()
        yield
        return
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err.close()


_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
SPINE = 0.9
"""A frame on at least this share of the samples of every thread it is on (``run_forever``,
the entry point) is left out of the inclusive list: it says nothing about where time goes."""


def summarize(path: str | Path, top: int = 15) -> dict[str, Any]:
    """The functions with the most samples in a py-spy raw file: own (on top of the stack) and
    inclusive (anywhere on it, counted once per stack; ``SPINE`` frames left out), as shares of
    all samples, and the share of each thread. Frames are ``function (file:line)`` as py-spy names them (the line a
    function starts on, with ``--function``)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    on_thread: Counter[tuple[str, str]] = Counter()  # (thread, frame): samples
    total = 0
    for line in Path(path).read_text().splitlines():
        m = _LINE.match(line.strip())
        if m is None:
            continue
        count = int(m["count"])
        frames = m["stack"].split(";")
        thread = frames.pop(0) if frames[0].startswith("thread (") else ""  # --threads: "thread (TID): NAME"
        if not frames:
            continue
        threads[thread] += count
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
            on_thread[thread, frame] += count
    telling = {frame for (thread, frame), n in on_thread.items() if n < SPINE * threads[thread]}
    for frame in [f for f in inclusive if f not in telling]:
        del inclusive[frame]
    threads.pop("", None)
    share = (lambda c: [(name, round(n / total, 4)) for name, n in c.most_common(top)]) if total else (lambda c: [])
    return {"samples": total, "own": share(own), "inclusive": share(inclusive), "threads": share(threads)}


def report(title: str, summary: dict[str, Any]) -> list[str]:
    """Lines for a log: the top own and inclusive functions of ``summarize``."""
    lines = [f"{title}: {summary['samples']} samples at {RATE_HZ} Hz (on CPU)"]
    for kind in ("threads", "own", "inclusive"):
        lines.append(f"  {kind}:")
        lines += [f"    {share:6.1%}  {name}" for name, share in summary[kind]]
    return lines
