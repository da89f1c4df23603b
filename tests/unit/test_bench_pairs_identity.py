"""``benchmarks/e2e_pairs.py``: identical sequences per pair, the service's against direct and
the control's (direct against direct_frozen: one engine, batches scheduled apart)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # as when run from there

import e2e_pairs  # noqa: E402


def test_identical_counts_sequences_that_match_exactly_in_order() -> None:
    direct = [[1, 2, 3], [4, 5], [6]]
    assert e2e_pairs.identical(direct, [[1, 2, 3], [4, 5], [6]]) == 3
    assert e2e_pairs.identical(direct, [[1, 2, 4], [4, 5], [6, 7]]) == 1
    assert e2e_pairs.identical(direct, [[4, 5], [1, 2, 3], [6]]) == 1  # order matters
    with pytest.raises(ValueError):
        e2e_pairs.identical(direct, [[1, 2, 3]])  # batches of different sizes are a bug


def test_the_control_is_printed_only_where_every_pair_ran_direct_frozen() -> None:
    pairs = [
        {"identical_sequences": 488, "identical_direct_frozen": 470},
        {"identical_sequences": 79, "identical_direct_frozen": 81},
    ]
    line = e2e_pairs.identity_line(pairs, 512)
    assert line == "identical sequences of 512: service vs direct 488, 79; direct vs direct_frozen (control) 470, 81"
    line = e2e_pairs.identity_line([{"identical_sequences": 500}, pairs[1]], 512)
    assert line == "identical sequences of 512: service vs direct 500, 79"
