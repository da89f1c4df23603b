"""The process's garbage-collection clock (``zmq_rollout/gc_pauses.py``) and its worker metrics."""

from __future__ import annotations

import gc

from helpers import parse_samples
from prometheus_client import generate_latest

from zmq_rollout.gc_pauses import GcClock, process_clock, settle_heap
from zmq_rollout.workers.metrics import WorkerMetrics


def test_the_clock_times_each_collection_by_generation_while_installed() -> None:
    clock = GcClock().install()
    try:
        gc.collect(2)
        gc.collect(0)
        assert clock.collections[2] >= 1 and clock.collections[0] >= 1
        assert clock.seconds[2] > 0.0
        full = clock.collections[2]
    finally:
        clock.uninstall()
    gc.collect(2)
    assert clock.collections[2] == full  # not counted once uninstalled
    assert clock.on_gc not in gc.callbacks


def test_a_stop_without_its_start_is_ignored_and_installing_twice_counts_once() -> None:
    clock = GcClock()
    clock.on_gc("stop", {"generation": 2})  # installed in the middle of a collection
    assert clock.collections == [0, 0, 0] and clock.seconds == [0.0, 0.0, 0.0]
    clock.install().install()
    try:
        assert gc.callbacks.count(clock.on_gc) == 1
        before = clock.collections[1]
        gc.collect(1)
        assert clock.collections[1] == before + 1
    finally:
        clock.uninstall()
    assert process_clock() is process_clock()
    assert gc.callbacks.count(process_clock().on_gc) == 1


def test_the_worker_exports_its_process_collections() -> None:
    registry = WorkerMetrics().registry
    name = "zmq_rollout_worker_gc_collections_total{generation=2}"
    before = parse_samples(generate_latest(registry).decode())
    gc.collect(2)
    after = parse_samples(generate_latest(registry).decode())
    assert after[name] >= before[name] + 1
    assert after["zmq_rollout_worker_gc_seconds_total{generation=2}"] > 0.0
    assert set(after) >= {f"zmq_rollout_worker_gc_seconds_total{{generation={g}}}" for g in "012"}


def test_settling_the_heap_freezes_it_and_sets_the_young_threshold_only_when_asked() -> None:
    before = gc.get_threshold()
    try:
        settle_heap()
        assert gc.get_freeze_count() > 0 and gc.get_threshold() == before
        settle_heap(12_345)
        assert gc.get_threshold() == (12_345, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_broker_settles_its_heap_in_a_process_of_its_own_and_never_on_a_thread_of_another() -> None:
    """On the main thread (``zmq-rollout broker``) the loop freezes the heap and collects young
    objects every ``GC_YOUNG_THRESHOLD``; a ``BrokerThread`` leaves its host process's collector
    alone."""
    import threading

    from zmq_rollout.broker.server import GC_YOUNG_THRESHOLD, Broker
    from zmq_rollout.config import BrokerConfig

    before = gc.get_threshold()
    gc.unfreeze()
    try:
        other = Broker(BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*"))
        other.stop()  # run() sets up, then leaves its loop at once
        thread = threading.Thread(target=other.run)
        thread.start()
        thread.join(10)
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
        own = Broker(BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*"))
        own.stop()
        own.run()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
