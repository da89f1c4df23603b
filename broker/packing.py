"""How the broker spreads jobs: least loaded first, or packed while the broker is the bottleneck.

Least loaded first gives each job to the worker with the smallest share of its credits in
use. That is right for engines while the broker has time to spare: every engine gets work as
soon as any waits. But with few jobs in flight per worker (a large fleet, or clients that
keep short windows) it sends each job in its own JOBS and gets each back in its own FINAL: a
job costs three messages instead of about one (``benchmarks/README.md``, goal 4), and the
broker's CPU, not the engines, sets the pace.

So the socket loop measures how much of each review interval (``server.REVIEW_S``, 0.25 s)
the broker spent on its own work (reading, scheduling, sending; not waiting or busy
polling). Once that share reaches ``PACK_ABOVE``, dispatch **packs**: a worker takes up to
``pack_step`` more credits of work before the next one gets any (the workers with the fewest
steps of load first; between equals, the one picked last). Jobs then travel to a worker and
back in blocks. Once the share falls below ``SPREAD_BELOW``, dispatch spreads again. The gap
between the two keeps it from switching with every interval: packing itself lowers the
broker's load.

While packing, it also keeps blocks whole (``blocks``) while the clients' SUBMITs carried at
least ``BLOCKS_FROM`` of a step on average in the last interval: a pass's block of jobs then
goes to a worker at the start of a step, not first to top up one that an earlier pass left
part-filled, the rest spilling onto another (``dispatch_heap.py``). With workers that answer
a JOBS in parts, that made JOBS of about 10 jobs, not 64 (``benchmarks/dispatch_blocks.py``).
One-job SUBMITs keep topping up: a pass's few jobs are what fills a part-filled worker.

Pure: the loop reports seconds of work and asks at each review (tests/unit/test_packing.py).
"""

from __future__ import annotations

import logging

from .own_process import owns_process

log = logging.getLogger(__name__)

PACK_ABOVE = 0.5
"""Share of an interval the broker spent working from which it packs."""
SPREAD_BELOW = 0.25
"""Share of an interval below which a packing broker spreads again."""
SPREAD = 1
"""The step of least loaded first: every credit of load counts."""
BLOCKS_FROM = 0.5
"""Share of the pack step the last interval's SUBMITs carried on average (jobs per SUBMIT) from
which a packing broker keeps blocks whole (``Packing.blocks``)."""
PACK_STEP = 64
"""``BrokerConfig.pack_step`` of a broker in its own process: a worker's default credits
(vLLM's ``max_num_seqs``), so that a busy broker fills a default worker before the next gets
any and a client's block of 64 jobs goes out in one JOBS. A step of 16 (until 2026-12-04)
sent JOBS of 13-15 jobs at 1,024 workers and cost the broker about a fifth more CPU per job
there (benchmarks/README.md, "The pack step"). The price, more sequences on one engine while
others idle, is paid only while the broker, not the engines, sets the pace."""


class Packing:
    """The dispatch step for the next interval, from the broker's work in the last.

    ``pack_step``: credits a worker takes before the next gets any while packing
    (``BrokerConfig.pack_step``; 1 never packs)."""

    def __init__(self, pack_step: int) -> None:
        self.pack_step = pack_step
        self.packing = False
        self.blocks = False
        """While packing: a pass's block of jobs to a worker at the start of a step
        (``DispatchHeap.blocks``), for clients that submit blocks (``BLOCKS_FROM``)."""
        self.busy = 0.0
        """The share of the last reviewed interval the broker spent on its work (0..1)."""
        self._work_s = 0.0
        self._since: float | None = None
        self._blocks_submitted = False

    def worked(self, seconds: float) -> None:
        """The broker spent ``seconds`` on one pass's work."""
        self._work_s += seconds

    def review(self, now: float, jobs_per_submit: float | None = None) -> int:
        """End the interval that started at the last review: the step to dispatch with now
        (``SPREAD``, or ``pack_step`` while packing), and whether to keep blocks whole
        (``blocks``) from the jobs the interval's SUBMITs carried on average (None: no SUBMIT
        came; as before)."""
        since, self._since = self._since, now
        work, self._work_s = self._work_s, 0.0
        if jobs_per_submit is not None:
            self._blocks_submitted = jobs_per_submit >= BLOCKS_FROM * self.pack_step
        if since is None or now <= since:
            return self.step
        self.busy = min(1.0, work / (now - since))
        if self.pack_step > SPREAD:
            if not self.packing and self.busy >= PACK_ABOVE:
                self.packing = True
                log.info(
                    "broker busy %.0f%% of the last %.1f s: packing jobs, up to %d credits a worker before the next",
                    100 * self.busy,
                    now - since,
                    self.pack_step,
                )
            elif self.packing and self.busy < SPREAD_BELOW:
                self.packing = False
                log.info("broker busy %.0f%%: least loaded first again", 100 * self.busy)
        blocks = self.packing and self._blocks_submitted
        if blocks != self.blocks:
            self.blocks = blocks
            if blocks:
                log.info("SUBMITs of half a step or more: packing keeps each block of jobs whole")
            else:
                log.info("packing tops up part-filled workers first again (or spreads)")
        return self.step

    @property
    def step(self) -> int:
        return self.pack_step if self.packing else SPREAD


def pack_step(configured: int | None) -> int:
    """The pack step of a broker whose ``BrokerConfig.pack_step`` is ``configured``, on this
    thread: by default ``PACK_STEP`` on the main thread, which a broker's own process runs it
    on, and never packing (``SPREAD``) on any other: a pass's time there includes waiting for
    that process's other threads (the GIL), not only work."""
    if configured is not None:
        return configured
    return PACK_STEP if owns_process() else SPREAD
