"""The wheel installs everything under ``zmq_rollout``: no top-level ``broker`` or ``workers``."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_has_no_top_level_broker_or_workers(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("zmq_rollout-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"zmq_rollout", next(t for t in tops if t.endswith(".dist-info"))}
    assert "zmq_rollout/broker/scheduler.py" in names
    assert "zmq_rollout/workers/worker.py" in names
    assert "zmq_rollout/client.py" in names
    # every module of the source tree is in the wheel (a subpackage missing from pyproject's
    # `packages` list would be left out, and only an editable install would work)
    wanted = {
        f"zmq_rollout/{f.relative_to(ROOT / 'zmq_rollout').as_posix()}" for f in (ROOT / "zmq_rollout").rglob("*.py")
    }
    wanted |= {
        f"zmq_rollout/{d}/{f.relative_to(ROOT / d).as_posix()}"
        for d in ("broker", "workers")
        for f in (ROOT / d).rglob("*.py")
    }
    assert sorted(wanted - set(names)) == []


def test_light_install_imports_without_torch_or_vllm() -> None:
    code = (
        "import sys, zmq_rollout, zmq_rollout.broker.server, zmq_rollout.cli;"
        "bad = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_help_lists_every_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "zmq_rollout.cli", "--help"], check=True, capture_output=True, text=True
    ).stdout
    for command in ("broker", "worker", "generate", "status", "make-tiny-model", "demo"):
        assert command in out
