"""The broker's busy polling: the learnt window (pure), the machine's idle cores, the loop's poll."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import zmq

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.broker.busy_poll import (
    BUSY_POLL_US,
    GROW_START_S,
    SHRINK_AFTER,
    SPIN_BELOW_JOBS_PER_MESSAGE,
    BusyPoll,
    IdleCores,
    JobsPerMessage,
    busy_poll_s,
    cpu_times,
    idle_cores,
)
from zmq_rollout.broker.metrics import SchedulerCollector
from zmq_rollout.broker.server import Broker
from zmq_rollout.config import BrokerConfig

MAX = 250e-6


def test_the_window_stays_whole_while_replies_come_within_it() -> None:
    spin = BusyPoll(MAX)
    assert spin.window_s() == MAX
    for _ in range(10):
        spin.hit()
        spin.slept(MAX / 2)  # a miss that a wider window... is the whole window already
    assert spin.window_s() == MAX


def test_the_window_halves_to_nothing_while_messages_come_far_apart_and_grows_back() -> None:
    spin = BusyPoll(MAX)
    windows = []
    for _ in range(6):
        spin.slept(SHRINK_AFTER * MAX * 1.01)
        windows.append(spin.window_s())
    assert windows[:3] == [MAX / 2, MAX / 4, MAX / 8]
    assert windows[-1] == 0.0 and min(w for w in windows if w) >= GROW_START_S
    spin.slept(MAX)  # a wider window would have caught it: grow from the start value
    assert spin.window_s() == GROW_START_S
    for _ in range(10):
        spin.hit()
    assert spin.window_s() == MAX


def test_a_late_reply_within_a_few_windows_leaves_the_window_as_it_is() -> None:
    spin = BusyPoll(MAX)
    spin.slept(SHRINK_AFTER * MAX * 0.9)
    assert spin.window_s() == MAX


def test_no_polling_without_a_spare_core_nor_with_a_zero_maximum() -> None:
    spin = BusyPoll(MAX)
    spin.spare(0.6)
    assert spin.window_s() == 0.0
    spin.spare(None)  # unknown: as learnt
    assert spin.window_s() == MAX
    spin.spare(1.4)
    assert spin.window_s() == MAX
    zero = BusyPoll(0.0)
    zero.hit()
    zero.slept(0.0)
    assert zero.window_s() == 0.0
    with pytest.raises(ValueError, match="window"):
        BusyPoll(-1.0)


def test_no_polling_while_messages_carry_many_jobs_each() -> None:
    spin = BusyPoll(MAX)
    spin.spare(1.5, 1.9)  # one-job SUBMITs and their FINALs: polling pays
    assert spin.window_s() == MAX
    spin.spare(1.5, SPIN_BELOW_JOBS_PER_MESSAGE)  # batched: a wake-up is little per job
    assert spin.window_s() == 0.0
    spin.spare(1.5, None)  # no message came: as learnt
    assert spin.window_s() == MAX
    spin.spare(0.5, 1.0)  # few jobs a message, but no spare core
    assert spin.window_s() == 0.0


def test_jobs_per_message_between_samples() -> None:
    carried = JobsPerMessage()
    assert carried.sample(0, 0) is None  # nothing to compare with yet
    assert carried.sample(128, 4) == 32.0  # 2 SUBMITs of 64 jobs in, 2 FINALs of 64 back
    assert carried.sample(128, 4) is None  # no message since
    assert carried.sample(138, 14) == 1.0  # 5 one-job SUBMITs and 5 FINALs
    assert carried.sample(138, 16) == 0.0  # heartbeats only


def test_idle_cores_from_proc_stat(tmp_path: Path) -> None:
    line = "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n"
    assert cpu_times(line) == (850.0, 1000.0)
    with pytest.raises(ValueError, match="proc/stat"):
        cpu_times("intr 1 2 3")
    # 2 cores, 40% idle over 1 s, and the broker polled 0.5 s of it: 0.8 + 0.5 idle cores
    assert idle_cores(400, 1000, 0.5, 1.0, 2) == pytest.approx(1.3)
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 0 100 0 0 0 0\n")
    cores = IdleCores(str(stat), cores=2)
    assert cores.sample(10.0, 0.0) is None  # nothing to compare with yet
    stat.write_text("cpu  200 0 0 300 0 0 0 0\n")  # 100 busy + 200 idle jiffies since
    assert cores.sample(11.0, 0.0) == pytest.approx(2 * 200 / 300)
    assert IdleCores(str(tmp_path / "absent")).sample(1.0, 0.0) is None


def test_the_default_spins_in_a_brokers_own_process_only() -> None:
    assert busy_poll_s(None) == BUSY_POLL_US / 1e6  # this test runs on the main thread
    seen: list[float] = []
    thread = threading.Thread(target=lambda: seen.append(busy_poll_s(None)))
    thread.start()
    thread.join()
    assert seen == [0.0]  # a BrokerThread shares its process's GIL
    assert busy_poll_s(40) == 40e-6
    with pytest.raises(ValueError, match="busy_poll_us"):
        BrokerConfig(busy_poll_us=-5)


def test_each_tick_decides_the_polling_from_idle_cores_and_jobs_per_message() -> None:
    broker = Broker(BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*"))
    try:
        spin = broker._spin = BusyPoll(MAX)
        broker._idle.sample = lambda now, spun: 1.5  # type: ignore[method-assign]  # a core to spare
        stats = broker.scheduler.stats
        broker.tick(1.0)  # the first sample: nothing to compare with, poll as learnt
        assert spin.window_s() == MAX
        stats.submitted, stats.completed, stats.messages_received = 640, 640, 20  # 64 jobs a message
        broker.tick(2.0)
        assert spin.window_s() == 0.0
        stats.submitted, stats.completed, stats.messages_received = 650, 650, 40  # one-job messages
        broker.tick(3.0)
        assert spin.window_s() == MAX
    finally:
        broker._release()


def test_the_loop_polls_then_sleeps_and_counts_the_polling() -> None:
    broker = Broker(BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*"))
    ctx = zmq.Context.instance()
    client = ctx.socket(zmq.DEALER)
    try:
        poller = zmq.Poller()
        poller.register(broker.frontend, zmq.POLLIN)
        spin = BusyPoll(0.003)
        assert broker._poll(poller, 50, spin) == {}  # nothing comes: 3 ms polled, then asleep
        spun = broker.scheduler.stats.busy_poll_s
        assert spun >= 0.003
        assert spin.window_s() == 0.0015  # 50 ms without a message: more than SHRINK_AFTER windows
        families = {m.name: m for m in SchedulerCollector(broker.scheduler).collect()}
        assert families["zmq_rollout_broker_busy_poll_seconds"].samples[0].value == spun
        client.connect(broker.frontend_address)
        client.send_multipart(codec.encode(p.HEARTBEAT))
        assert broker._poll(poller, 5000, spin) == {broker.frontend: zmq.POLLIN}
        assert broker._poll(poller, 5000, None) == {broker.frontend: zmq.POLLIN}  # not read yet
    finally:
        client.close(linger=0)
        broker._release()
