"""Whether the worker's event loop woke late, and why.

The heartbeat task sleeps one interval at a time. Waking well past its time means the loop
did not run meanwhile, and so sent the broker nothing: a stall longer than the broker's
``worker_expiry_s`` costs the worker its connection and its jobs (requeued elsewhere). What
the loop's thread did in that time tells the cause:

- **starved**: it was ready to run but waited for a core (other processes held them): the
  kernel's run-queue wait for the thread (``/proc/thread-self/schedstat``) is most of the stall;
- **busy**: this process ran (a blocking computation, a long garbage collection): its CPU
  time (all threads) is most of the stall;
- **blocked**: neither: the thread slept in a call that blocks (a lock, a syscall holding
  the GIL in another thread).

Where the kernel keeps no schedstat, starved and blocked cannot be told apart. The
integration tier's workers log stalls of 2-4.6 s on a 2-core machine; one cost a test its
worker (CI stop 44). ``Stall`` is what the worker logs and counts
(``zmq_rollout_worker_loop_stalls_total``, docs/metrics.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from zmq_rollout.gc_pauses import process_clock

SHARE = 0.5
"""A cause must account for this share of a stall: run-queue wait (starved), else CPU (busy)."""

SCHEDSTAT = "/proc/thread-self/schedstat"
"""The calling thread's CPU time, run-queue wait (both ns) and time slices (Linux)."""


def gc_seconds() -> float:
    """Seconds this process has spent in garbage collection, all generations (``gc_pauses.py``)."""
    return sum(process_clock().seconds)


def runqueue_seconds() -> float | None:
    """Seconds the calling thread has waited for a core since it started; None if unknown."""
    try:
        with open(SCHEDSTAT) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Stall:
    seconds: float
    """How much later than its interval the loop woke."""
    cpu_s: float
    """CPU seconds this process (all its threads) used from the last wake to this one."""
    gc_s: float
    """Of that time, seconds spent collecting garbage."""
    runqueue_s: float | None = None
    """Of that time, seconds the loop's thread waited for a core (None: unknown here)."""

    @property
    def cause(self) -> str:
        """``starved``, ``busy``, ``blocked``, or ``starved or blocked`` (no schedstat)."""
        if self.runqueue_s is not None and self.runqueue_s >= SHARE * self.seconds:
            return "starved"
        if self.cpu_s >= SHARE * self.seconds:
            return "busy"
        return "blocked" if self.runqueue_s is not None else "starved or blocked"

    def __str__(self) -> str:
        cause = {
            "starved": "starved: it waited for a core while other processes held them",
            "busy": "busy: this process ran",
            "blocked": "blocked: it neither ran nor waited for a core",
            "starved or blocked": "starved or blocked: it did not run",
        }[self.cause]
        waited = "" if self.runqueue_s is None else f", waited {self.runqueue_s:.1f} s for a core"
        return (
            f"event loop stalled for {self.seconds:.1f} s ({cause}; meanwhile the process used "
            f"{self.cpu_s:.1f} s of CPU, {self.gc_s:.1f} s in garbage collection{waited})"
        )


class LoopWatch:
    """Told each time the heartbeat task wakes (on the loop's thread); says whether it woke
    over a second late."""

    def __init__(
        self,
        interval_s: float,
        now: float,
        *,
        cpu: Callable[[], float] = time.process_time,
        gc: Callable[[], float] = gc_seconds,
        runqueue: Callable[[], float | None] = runqueue_seconds,
    ) -> None:
        self.interval_s = interval_s
        self._cpu, self._gc, self._runqueue = cpu, gc, runqueue
        self._at, self._cpu_at, self._gc_at, self._rq_at = now, cpu(), gc(), runqueue()

    def woke(self, now: float) -> Stall | None:
        """The stall since the last wake (or since start), if the loop woke more than one
        interval plus a second past its time; None if it was about on time."""
        cpu, gc, rq = self._cpu(), self._gc(), self._runqueue()
        late = now - self._at - self.interval_s
        stall = None
        if late > self.interval_s + 1:
            waited = None if rq is None or self._rq_at is None else rq - self._rq_at
            stall = Stall(late, cpu - self._cpu_at, gc - self._gc_at, waited)
        self._at, self._cpu_at, self._gc_at, self._rq_at = now, cpu, gc, rq
        return stall
