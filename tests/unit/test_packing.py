"""The broker packs jobs while it is the bottleneck and spreads them otherwise (broker/packing.py)."""

from __future__ import annotations

import itertools
import logging

import pytest

from tests.helpers import poll_until
from zmq_rollout.broker.packing import BLOCKS_FROM, PACK_ABOVE, PACK_STEP, SPREAD, SPREAD_BELOW, Packing, pack_step
from zmq_rollout.broker.server import REVIEW_S, Broker, BrokerThread
from zmq_rollout.config import BrokerConfig


def interval(packing: Packing, start: float, busy: float) -> int:
    """One second in which the broker worked ``busy`` of the time, in two passes; the step after it."""
    packing.worked(busy / 2)
    packing.worked(busy / 2)
    return packing.review(start + 1.0)


def test_packs_from_half_busy_and_spreads_again_below_a_quarter(caplog: pytest.LogCaptureFixture) -> None:
    packing = Packing(16)
    assert packing.review(0.0) == SPREAD  # the first review only starts an interval
    assert interval(packing, 0.0, PACK_ABOVE - 0.125) == SPREAD
    with caplog.at_level(logging.INFO, "zmq_rollout.broker.packing"):
        assert interval(packing, 1.0, PACK_ABOVE) == 16
    assert "packing jobs, up to 16 credits" in caplog.text
    assert packing.busy == pytest.approx(PACK_ABOVE)
    # Packing lowers the broker's load: between the thresholds it keeps packing, no flapping.
    assert interval(packing, 2.0, (PACK_ABOVE + SPREAD_BELOW) / 2) == 16
    assert interval(packing, 3.0, SPREAD_BELOW) == 16
    assert interval(packing, 4.0, SPREAD_BELOW - 0.125) == SPREAD
    assert not packing.packing


def test_busy_is_the_share_of_the_elapsed_interval() -> None:
    packing = Packing(16)
    packing.review(10.0)
    packing.worked(1.5)
    assert packing.review(14.0) == SPREAD  # 1.5 s of work in a 4 s interval (a late tick)
    assert packing.busy == 0.375
    packing.worked(2.0)
    assert packing.review(18.0) == 16 and packing.busy == 0.5


def test_pack_step_1_never_packs() -> None:
    packing = Packing(1)
    packing.review(0.0)
    assert interval(packing, 0.0, 1.0) == SPREAD
    assert packing.busy == 1.0 and not packing.packing


def test_blocks_are_kept_whole_while_packing_submits_of_half_a_step_or_more() -> None:
    packing = Packing(64)
    packing.review(0.0, 64.0)
    assert not packing.blocks  # not packing yet: least loaded first, no blocks
    packing.worked(PACK_ABOVE)
    assert packing.review(1.0, 64.0) == 64 and packing.blocks
    packing.worked(PACK_ABOVE)
    packing.review(2.0, None)  # no SUBMIT in the interval: as before
    assert packing.blocks
    packing.worked(PACK_ABOVE)
    packing.review(3.0, BLOCKS_FROM * 64 - 1)  # one-job SUBMITs, mostly: top up part-filled workers
    assert packing.packing and not packing.blocks
    packing.worked(PACK_ABOVE)
    packing.review(4.0, BLOCKS_FROM * 64)
    assert packing.blocks
    packing.review(5.0, 64.0)  # a second without work: spreading, blocks or not
    assert not packing.packing and not packing.blocks


def test_pack_step_is_checked() -> None:
    with pytest.raises(ValueError, match="pack_step"):
        BrokerConfig(pack_step=0)


def test_the_broker_review_sets_the_schedulers_step_and_its_gauges() -> None:
    broker = Broker(BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", pack_step=8))
    try:
        broker.review(100.0)
        broker._packing.worked(0.9 * REVIEW_S)
        broker.review(100.0 + REVIEW_S)
        assert broker.scheduler.dispatch_step == 8
        assert broker.scheduler.stats.packing and broker.scheduler.stats.busy == pytest.approx(0.9)
        broker.review(100.0 + 2 * REVIEW_S)  # an interval without work
        assert broker.scheduler.dispatch_step == 1 and not broker.scheduler.stats.packing
        assert not broker.scheduler._heap.blocks
        broker.scheduler.stats.submitted += 80  # ten SUBMITs of 8 jobs: blocks of a whole step
        broker.scheduler.stats.submits += 10
        broker._packing.worked(0.9 * REVIEW_S)
        broker.review(100.0 + 3 * REVIEW_S)
        assert broker.scheduler.dispatch_step == 8 and broker.scheduler._heap.blocks
        broker.scheduler.stats.submitted += 10  # ten one-job SUBMITs
        broker.scheduler.stats.submits += 10
        broker._packing.worked(0.9 * REVIEW_S)
        broker.review(100.0 + 4 * REVIEW_S)
        assert broker.scheduler.dispatch_step == 8 and not broker.scheduler._heap.blocks
    finally:
        broker._release()


def test_the_loop_reviews_packing_every_review_interval_not_every_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst makes a broker pack within two reviews (0.5 s), not two heartbeats (2 s)."""
    reviews: list[float] = []
    real = Broker.review
    monkeypatch.setattr(Broker, "review", lambda self, now: (reviews.append(now), real(self, now)))
    config = BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", heartbeat_interval_s=5.0)
    with BrokerThread(config):
        poll_until(lambda: len(reviews) >= 4, timeout=10.0, what="four reviews")
    gaps = [b - a for a, b in itertools.pairwise(reviews[:4])]
    assert all(REVIEW_S <= gap < 8 * REVIEW_S for gap in gaps), gaps  # not once a heartbeat (5 s here)


def test_a_broker_packs_by_default_on_its_own_main_thread_and_never_on_another() -> None:
    """On a thread of another process (``BrokerThread``) a pass's wall time includes waiting
    for that process's threads (the GIL), so it would read as work: no packing there."""
    import threading

    assert pack_step(None) == PACK_STEP  # this test runs on the main thread
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(pack_step(None)))
    thread.start()
    thread.join()
    assert seen == [SPREAD]
    assert pack_step(4) == 4
    broker = Broker(BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*"))
    try:
        assert broker._packing.pack_step == PACK_STEP  # built on the main thread
    finally:
        broker._release()
