"""``BrokerConfig.heap_keep_mib``: freed memory the broker's process keeps for its next messages.

A broker relays messages of hundreds of kilobytes (64 results of a 512-token rollout are
567 kB; a SUBMIT of 64 prompts of 512 token ids, 160 kB). glibc's malloc serves a block that
large from a fresh ``mmap`` (above ``M_MMAP_THRESHOLD``, which it raises as such blocks are
freed) and gives freed memory at the top of its heap back to the kernel (above
``M_TRIM_THRESHOLD``, twice the former). A broker that frees a pass's messages and allocates
the next pass's as large then touches fresh pages each pass: each costs a page fault,
several microseconds on a VM. In ``benchmarks/broker_phases.py --prompt-tokens 512
--sample-tokens 512`` encoding the client's FINAL took 2.8-5.0 us a job, 1.6-2.0 with the
memory kept (benchmarks/README.md, ninth session).

So a broker in its own process sets both thresholds once, at start (``mallopt``): blocks
below ``heap_keep_mib`` come from the heap, and up to that much freed memory stays with the
process. It is memory the process has used at its peak anyway, kept rather than returned
(its resident size shows it). Not on a thread of another program
(``BrokerThread``: tests, the demo, embedding), whose allocator is that program's, and not
where the C library is not glibc (nothing to set; the broker runs as before).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from .own_process import owns_process

log = logging.getLogger(__name__)

DEFAULT_KEEP_MIB = 64
"""In its own process: 64 MiB, the default ``max_message_bytes`` (a message the broker takes
whole is below it)."""
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameters (``malloc.h``)."""
MAX_MMAP_THRESHOLD = 32 << 20
"""glibc's ceiling for ``M_MMAP_THRESHOLD`` on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``)."""


def heap_keep_mib(configured: int | None) -> int:
    """What ``BrokerConfig.heap_keep_mib`` comes to on this thread: as configured, else
    ``DEFAULT_KEEP_MIB`` in a process of the broker's own and 0 (the allocator as it is) on a
    thread of another's."""
    if configured is not None:
        return configured
    return DEFAULT_KEEP_MIB if owns_process() else 0


def keep_freed_memory(mib: int) -> bool:
    """Set glibc's trim and mmap thresholds to ``mib`` MiB for this process (0: leave them).
    False where there is nothing to set (another C library)."""
    if mib <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        log.info("heap_keep_mib: no glibc mallopt here; the allocator keeps its own thresholds")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    size = mib << 20
    return bool(mallopt(M_MMAP_THRESHOLD, min(size, MAX_MMAP_THRESHOLD))) and bool(mallopt(M_TRIM_THRESHOLD, size))
