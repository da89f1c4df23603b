"""``owns_process``: the main thread owns the process, any other thread does not. What follows
from it is tested where it is used (test_packing.py, test_busy_poll.py, test_gc_pauses.py)."""

from __future__ import annotations

import threading

from zmq_rollout.broker.own_process import owns_process


def test_the_main_thread_owns_the_process_and_another_thread_does_not() -> None:
    assert owns_process()  # pytest runs tests on the main thread
    seen: list[bool] = []
    thread = threading.Thread(target=lambda: seen.append(owns_process()))
    thread.start()
    thread.join()
    assert seen == [False]
