"""The workers that may take jobs, in the order dispatch tries them.

Kept between dispatch passes: an entry is pushed when a worker's load changes (``offer``) and
checked when popped (its key must be the worker's current one, ``entry``); the heap is
rebuilt whole (``invalidate``) when workers come, go or change credits or ``accepting``, when
the order's step changes, on every tick, and when stale entries outnumber twice the workers.
Dispatching one job costs O(log workers), not O(workers).

Two orders (``step``): least loaded first (1), and packed in steps of credits while the
broker is busy (``packing.py``). Packed, ``blocks`` (while clients submit jobs in blocks) puts
a worker that an earlier pass left part-way through a step behind the workers at the start of
one: a pass's block of jobs goes to one worker whole instead of topping up the part-filled one
and spilling the rest onto another (two JOBS and two FINALs for one block). Pure, as the
scheduler that owns it (tests/unit/test_scheduler.py, tests/unit/test_dispatch_blocks.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from .state import Job, WorkerId, WorkerState

Entry = tuple[float, int, WorkerId, WorkerState]
Heap = list[Entry]
"""Workers with free credits, in dispatch order (``entry``)."""


def entry(w: WorkerState, step: int, blocks: bool = False) -> Entry:
    """A worker's place on the dispatch heap. Least loaded first (``step`` 1); between equals,
    the one whose last job is oldest (jobs that each finish before the next comes spread over
    the fleet instead of all going to the same worker). Packing (``step`` > 1): fewest whole
    steps of credits in use first (``2 * steps``, so that ``blocks`` can add 1 for a worker
    part-way through its step: behind those at the start of one); between equals, the one
    picked last, so a worker takes a step's worth of jobs before the next gets any. ``pick``
    compares an entry with this to tell a stale one (its steps: the key halved)."""
    if step == 1:
        return (w.credits_used / w.credits if w.credits else 1.0, w.last_pick, w.identity, w)
    used = w.credits_used
    return (2 * (used // step) + (blocks and used % step != 0), -w.last_pick, w.identity, w)


class DispatchHeap:
    def __init__(self) -> None:
        self.entries: Heap = []
        self.step = 1
        """1: least loaded first; more while the broker packs (``set_step``)."""
        self.blocks = False
        """Packed: a worker an earlier pass left part-way through a step comes after those at
        the start of one (``entry``; ``packing.Packing.blocks``)."""
        self._stale = True
        self.kept: Entry | None = None
        """The entry of the worker a dispatch pass gave its last job (``offer_next``), not on
        the heap yet: the next ``pick`` weighs it against the heap's first. A pass goes on while
        the heap or this holds a worker."""

    def invalidate(self) -> None:
        """Which workers may take jobs, or their credits, changed: rebuild before the next pick."""
        self._stale = True

    def set_step(self, step: int, blocks: bool = False) -> None:
        """Order least loaded first (1) or packed in steps of ``step`` credits from now on;
        packed, with ``blocks``, part-filled workers last (``entry``)."""
        blocks = blocks and step > 1
        if step != self.step or blocks != self.blocks:
            self.step, self.blocks = step, blocks
            self._stale = True

    def offer(self, w: WorkerState, num_workers: int) -> None:
        """``w``'s load changed: its new place on the heap, now (outside a dispatch pass)."""
        self.offer_next(w, num_workers)
        self.settle()

    def offer_next(self, w: WorkerState, num_workers: int) -> None:
        """``w``'s load changed: its new place, if it may take a job (the old entry goes stale;
        past twice ``num_workers`` entries the heap is dropped and rebuilt at the next dispatch).
        The entry waits for the next ``pick`` instead of going on the heap, and that pick takes
        it at no cost while it is still first in order (``heapq.heappushpop``): a worker a pass
        gives job after job (the only one, or packing) costs no heap operation per job. The
        pass ends with ``settle``."""
        self.settle()
        if w.accepting and w.credits_used < w.credits:
            if len(self.entries) > 2 * num_workers + 64:
                self.entries.clear()
                self._stale = True
            elif self.step == 1:  # entry(), inline for the usual case
                self.kept = (w.credits_used / w.credits, w.last_pick, w.identity, w)
            else:  # a worker the pass goes on filling: its step's start's place until ``settle``
                self.kept = (2 * (w.credits_used // self.step), -w.last_pick, w.identity, w)

    def settle(self) -> None:
        """Put the entry ``offer_next`` kept aside on the heap: before anything else reads the
        heap. With ``blocks``, a worker left part-way through its step goes behind those at
        the start of one (``entry``)."""
        kept = self.kept
        if kept is not None:
            self.kept = None
            if self.blocks and kept[3].credits_used % self.step:
                kept = (kept[0] + 1, kept[1], kept[2], kept[3])
            heapq.heappush(self.entries, kept)

    def current(self, workers: Iterable[WorkerState]) -> Heap:
        """The heap, rebuilt from ``workers`` first if something rare changed."""
        if self._stale:
            self._stale = False
            self.kept = None
            step, blocks = self.step, self.blocks
            self.entries = [entry(w, step, blocks) for w in workers if w.accepting and w.credits_free > 0]
            heapq.heapify(self.entries)
        return self.entries

    def pick(self, heap: Heap, job: Job) -> WorkerState | None:
        """Pop the first worker in order that can take ``job`` (its entry is used up: the
        caller offers it anew); entries of workers that cannot take it now go back on the heap,
        and stale ones (the worker's load, last job or ``accepting`` changed since) are dropped:
        the worker's current entry is on the heap too, if it may take a job."""
        skipped = []
        found = None
        step = self.step
        kept, self.kept = self.kept, None
        while heap or kept is not None:
            if kept is not None:  # the smaller of it and the heap's first; the other stays on the heap
                item, kept = heapq.heappushpop(heap, kept), None
            else:
                item = heapq.heappop(heap)
            w = item[3]
            used, credits = w.credits_used, w.credits
            if used >= credits or not w.accepting:
                continue
            if step == 1:
                if item[1] != w.last_pick or item[0] != used / credits:
                    continue
            elif item[1] != -w.last_pick or item[0] // 2 != used // step:
                continue
            if (job.cost <= credits - used or used == 0) and w.weight_version >= job.spec.min_weight_version:
                found = w
                break
            skipped.append(item)
        for item in skipped:
            heapq.heappush(heap, item)
        return found
