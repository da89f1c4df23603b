"""``benchmarks/sealed_jobs.py``, a design probe: what it measures is a job the broker could
forward unread. Its sealed SUBMIT must carry every job whole (the bin decodes, as a worker
would, to the job the client made) beside the fields the broker reads, or its figures mean
nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from zmq_rollout import protocol as p
from zmq_rollout.protocol.jobs import sampling_n

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_PATH = _BENCHMARKS / "sealed_jobs.py"


def _probe() -> Any:
    if str(_BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(_BENCHMARKS))  # as when run from there: it imports ``roles``
    spec = importlib.util.spec_from_file_location("sealed_jobs", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sealed_jobs"] = module  # msgspec resolves the probe's annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("token_bins", [False, True])
def test_a_sealed_submit_carries_each_job_whole_beside_what_the_broker_reads(token_bins: bool) -> None:
    probe = _probe()
    sampling = p.SamplingParams(max_tokens=16, temperature=0.5, n=2)
    jobs = [p.JobSpec(f"j{i}", sampling, prompt_token_ids=[i + 1, 7, 9], ack=False) for i in range(3)]
    today, sealed = probe.submit_bodies(jobs, token_bins)
    relays = msgspec.msgpack.decode(today, type=list[p.JobRelay])
    envelopes = msgspec.msgpack.decode(sealed, type=list[probe.SealedJobProbe])
    assert [e.job_id for e in envelopes] == [r.job_id for r in relays] == ["j0", "j1", "j2"]
    assert [sampling_n(e.sampling) for e in envelopes] == [2, 2, 2]  # the broker's cost, outside the bin
    assert [msgspec.msgpack.decode(e.job, type=p.JobSpec) for e in envelopes] == jobs


def test_the_probe_prints_both_ways_and_their_ratio() -> None:
    result = _probe().measure(rounds=2, samples=1, prompt_tokens=8, token_bins=True)
    assert result["sealed_bytes"] > 0 and result["today_bytes"] > 0
    assert all(result[f"{way}_{part}_us"] > 0 for way in ("today", "sealed") for part in ("decode", "encode"))
