"""How long this process's Python garbage collector ran, by generation (``gc.callbacks``).

A collection stops every thread of the process: in a worker, its event loop, which also
runs vLLM's output processing, waits meanwhile. A full collection walks every object not
frozen (``gc.freeze``); in a process that imported torch and vLLM that can take a
noticeable share of a batch. Exported as ``zmq_rollout_worker_gc_seconds_total`` and
``zmq_rollout_worker_gc_collections_total`` (docs/metrics.md).

One clock per process (``process_clock``), installed once: a second install would count
each collection twice. ``settle_heap`` is what a service process does about it once started.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

GENERATIONS = (0, 1, 2)


class GcClock:
    """Seconds and collections per generation since ``install``."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._started: float | None = None

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """A ``gc.callbacks`` entry: ``start`` and ``stop`` of one collection (on one thread,
        under the GIL, never nested)."""
        if phase == "start":
            self._started = time.perf_counter()
            return
        started, self._started = self._started, None
        if started is None:  # installed during a collection: its start was not seen
            return
        generation = info["generation"]
        self.seconds[generation] += time.perf_counter() - started
        self.collections[generation] += 1

    def install(self) -> GcClock:
        if self.on_gc not in gc.callbacks:
            gc.callbacks.append(self.on_gc)
        return self

    def uninstall(self) -> None:
        if self.on_gc in gc.callbacks:
            gc.callbacks.remove(self.on_gc)


_CLOCK = GcClock()
_lock = threading.Lock()


def process_clock() -> GcClock:
    """This process's clock, installed on first use."""
    with _lock:
        return _CLOCK.install()


def settle_heap(young_threshold: int | None = None) -> None:
    """Once a service process has started: collect, then freeze what start-up made (it lives as
    long as the process, and a full collection no longer walks it); with ``young_threshold``,
    collect the youngest generation only after that many new objects instead of Python's 700
    (each collection walks the young objects still alive, such as jobs in flight, so fewer
    collections walk them fewer times). Process-wide: only for a process of the service's own."""
    gc.collect()
    gc.freeze()
    if young_threshold is not None:
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(young_threshold, older, oldest)
