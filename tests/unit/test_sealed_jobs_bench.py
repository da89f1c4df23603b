"""``benchmarks/sealed_jobs.py``: its two ways must hand a worker the same jobs (what the broker
forwards unread from a SEALED_SUBMIT opens to the job the client made), or its figures mean
nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from zmq_rollout import codec
from zmq_rollout import protocol as p

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_PATH = _BENCHMARKS / "sealed_jobs.py"


def _bench() -> Any:
    if str(_BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(_BENCHMARKS))  # as when run from there: it imports ``roles``
    spec = importlib.util.spec_from_file_location("sealed_jobs", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("token_bins", [False, True])
def test_both_ways_hand_the_worker_the_jobs_the_client_made(token_bins: bool) -> None:
    bench = _bench()
    sampling = p.SamplingParams(max_tokens=16, temperature=0.5, n=2)
    jobs = [p.JobSpec(f"j{i}", sampling, prompt_token_ids=[i + 1, 7, 9], ack=False) for i in range(3)]
    decode = codec.Decoder(codec.BROKER_FROM_CLIENT).decode
    for sealed in (False, True):
        frames = bench.message(jobs, token_bins, sealed)
        made = bench.assignments(decode(frames).body)
        assert [a.cost for a in made] == [2, 2, 2]  # the broker's charge, sent with each job
        jobs_message = msgspec.msgpack.decode(msgspec.msgpack.encode(made), type=list[p.SealedAssignment])
        opened = [p.unseal(a) for a in jobs_message]  # as the worker opens them
        assert opened == [p.Assignment(1000 + i, job) for i, job in enumerate(jobs)]


def test_the_benchmark_measures_both_ways_for_client_and_broker() -> None:
    result = _bench().measure(rounds=2, samples=1, prompt_tokens=8, token_bins=True)
    assert result["sealed_bytes"] > 0 and result["submit_bytes"] > 0
    steps = ("client", "decode", "encode")
    assert all(result[f"{way}_{step}_us"] > 0 for way in ("submit", "sealed") for step in steps)
