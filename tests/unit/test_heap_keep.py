"""``BrokerConfig.heap_keep_mib`` (broker/heap_keep.py): a broker in its own process keeps freed
memory for its next large messages instead of faulting fresh pages in each pass."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest

from zmq_rollout.broker.heap_keep import DEFAULT_KEEP_MIB, heap_keep_mib, keep_freed_memory
from zmq_rollout.config import BrokerConfig

# A broker's pass, over and over: a 600 kB message comes in (allocated, every page written),
# a 600 kB answer goes out, both are freed. Prints the minor page faults it took.
PASSES = """
import resource, sys
from zmq_rollout.broker.heap_keep import keep_freed_memory
assert keep_freed_memory(int(sys.argv[1])) == (int(sys.argv[1]) > 0)
size = 600 << 10
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(300):
    message = bytearray(size)
    answer = bytes(message)
    del message, answer
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(keep_mib: int) -> int:
    out = subprocess.run([sys.executable, "-c", PASSES, str(keep_mib)], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_a_process_that_keeps_freed_memory_does_not_fault_in_each_large_message() -> None:
    pages_per_pass = 2 * (600 << 10) // 4096
    assert page_faults(0) > 100 * pages_per_pass  # the allocator as it is: fresh pages, pass after pass
    assert page_faults(DEFAULT_KEEP_MIB) < 10 * pages_per_pass  # the first passes' pages, then none


def test_the_default_is_kept_in_a_process_of_its_own_and_not_on_a_thread_of_another() -> None:
    assert heap_keep_mib(None) == DEFAULT_KEEP_MIB  # pytest runs tests on the main thread
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(heap_keep_mib(None)))
    thread.start()
    thread.join()
    assert seen == [0]
    assert heap_keep_mib(0) == 0 and heap_keep_mib(8) == 8  # configured: as it is, anywhere


def test_zero_leaves_the_allocator_as_it_is() -> None:
    assert keep_freed_memory(0) is False


@pytest.mark.parametrize("value", [-1, 1.5, "64", (1 << 20) + 1])
def test_bad_values_are_refused_naming_the_setting(value: Any) -> None:
    with pytest.raises(ValueError, match=r"BrokerConfig\.heap_keep_mib must be an int in 0\.\.1048576"):
        BrokerConfig(heap_keep_mib=value)
