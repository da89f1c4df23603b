"""docs/protocol.md's examples and weight-sync tables are generated from the code and current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "protocol_examples.py"


def test_protocol_doc_matches_the_code() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr + out.stdout
