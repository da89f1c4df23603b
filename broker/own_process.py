"""Whether the broker's loop owns its process: it runs on the process's main thread, as in
``zmq-rollout broker`` and the benchmarks' broker, and not on a thread of another program
(``BrokerThread``: tests, the demo, embedding).

Three defaults follow from it, each where it is used: packing (``packing.pack_step``) and
polling without sleeping (``busy_poll.busy_poll_s``) only in a process of its own, where a
pass's time is the broker's work and its polling takes no other thread's GIL; and the
collector's settings (``Broker.run``), which are a process's, not a thread's, to set.
"""

from __future__ import annotations

import threading


def owns_process() -> bool:
    """True on the main thread (where a broker in its own process runs its loop)."""
    return threading.current_thread() is threading.main_thread()
