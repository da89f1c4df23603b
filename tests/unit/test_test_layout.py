"""The test tree's own rules: pytest imports test files by their base name (no packages), so
two files of one name in different tiers fail the whole run's collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_has_a_name_of_its_own() -> None:
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert not [name for name, count in names.items() if count > 1], "rename one of each pair (e.g. *_vllm.py)"
