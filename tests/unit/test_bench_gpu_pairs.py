"""``benchmarks/gpu_e2e.py --phases pairs`` (``e2e_pairs.py``) without a GPU: identical sequences
per pair, the service's against direct and the control's (direct against direct_frozen: one
engine, batches scheduled apart); the cores each side is pinned to; the options a phase's
process gets back."""

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


def test_core_groups_give_each_hot_process_whole_cores_and_swap_the_sides() -> None:
    cores = [[0, 16], [1, 17], [2, 18], [3, 19], [4, 20], [5, 21], [6, 22], [7, 23]]
    me, direct_core, worker, worker_core = e2e_pairs.core_groups(cores)
    assert (me, direct_core, worker, worker_core) == ([0, 1, 16, 17], [2, 3, 18, 19], [4, 5, 20, 21], [6, 7, 22, 23])
    assert e2e_pairs.core_groups(cores, swap=True) == [worker, worker_core, me, direct_core]
    assert e2e_pairs.core_groups([[0], [1], [2]])[3] == []  # fewer than four cores: pin_all pins nothing


def test_every_option_reaches_a_phase_process_as_it_was_given() -> None:
    import gpu_e2e

    parser = gpu_e2e.parser()
    given = ["--shape", "7b", "--no-eager", "--pin-swap", "--sides", "direct,service,direct_frozen", "--repeats", "3"]
    args = parser.parse_args(given)
    again = parser.parse_args(gpu_e2e.phase_argv(args))  # exits 2 on an option a phase cannot take back
    assert vars(again) == vars(args)
    assert again.pin_swap is True and again.eager is False and again.shape == "7b"
    default = parser.parse_args([])
    assert vars(parser.parse_args(gpu_e2e.phase_argv(default))) == vars(default)


def test_the_warm_up_batch_generates_as_many_tokens_as_the_timed_ones_unless_told() -> None:
    import gpu_e2e

    parser = gpu_e2e.parser()
    args = parser.parse_args(["--max-tokens", "192", "--repeats", "2", "--num-prompts", "4"])
    assert [(label, tokens) for label, _, _, tokens in gpu_e2e.batches(args)] == [
        ("warmup", 192),
        ("run1", 192),
        ("run2", 192),
    ]
    args = parser.parse_args(["--max-tokens", "192", "--warmup-max-tokens", "64", "--repeats", "1"])
    assert [tokens for *_, tokens in gpu_e2e.batches(args)] == [64, 192]
    assert parser.parse_args(gpu_e2e.phase_argv(args)).warmup_max_tokens == 64  # a phase gets it back
