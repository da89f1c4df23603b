"""A job's sampling goes on the wire without its trailing defaults (``p.encode_trimmed``,
``submissions.sampling_wire``), and every reader decodes it to the same SamplingParams."""

from __future__ import annotations

import msgspec
import pytest

from zmq_rollout import protocol as p
from zmq_rollout.protocol.jobs import sampling_n
from zmq_rollout.submissions import encode_job, sampling_wire

SAMPLINGS = [
    p.SamplingParams(),
    p.SamplingParams(n=8),
    p.SamplingParams(temperature=0.9, top_p=0.95),
    p.SamplingParams(max_tokens=1024, logprobs=5, seed=7),
    p.SamplingParams(stop=["</s>"], stop_token_ids=[2]),
    p.SamplingParams(temperature=0.0, repetition_penalty=1.1, min_tokens=3, max_tokens=64),
    p.SamplingParams(logit_bias={5: -100.0}, structured=p.StructuredOutput(regex="a+")),
    p.SamplingParams(skip_special_tokens=False),
]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_a_trimmed_sampling_decodes_to_the_same_one_and_is_never_longer(sampling: p.SamplingParams) -> None:
    trimmed, full = p.encode_trimmed(sampling), msgspec.msgpack.encode(sampling)
    assert msgspec.msgpack.decode(trimmed, type=p.SamplingParams) == sampling
    assert len(trimmed) <= len(full)
    assert sampling_n(msgspec.Raw(trimmed)) == sampling.n  # what the broker reads of it


def test_trimming_leaves_off_exactly_the_trailing_defaults() -> None:
    assert p.encode_trimmed(p.SamplingParams()) == b"\x90"  # 71 bytes in full
    assert msgspec.msgpack.decode(p.encode_trimmed(p.SamplingParams(temperature=0.9, top_p=0.95))) == [1, 0.9, 0.95]
    assert len(p.encode_trimmed(p.SamplingParams(temperature=0.9, top_p=0.95))) == 20
    # a default in the middle stays (arrays are positional); a value equal to the default but of
    # another type stays too (the receiver gets what was sent)
    assert msgspec.msgpack.decode(p.encode_trimmed(p.SamplingParams(top_p=0.5))) == [1, 1.0, 0.5]
    assert msgspec.msgpack.decode(p.encode_trimmed(p.SamplingParams(temperature=1))) == [1, 1]


def test_a_job_on_the_wire_is_the_same_job_with_its_sampling_trimmed() -> None:
    sampling = p.SamplingParams(n=4, temperature=0.7, max_tokens=256)
    job = p.JobSpec("j", sampling, "hello", ack=False)
    encoded = encode_job(job, token_bins=False)
    assert msgspec.msgpack.decode(encoded, type=p.JobSpec) == job  # as a worker reads it
    relay = msgspec.msgpack.decode(encoded, type=p.JobRelay)  # as the broker reads it
    assert bytes(relay.sampling) == p.encode_trimmed(sampling) and relay.cost() == 4
    saved = len(msgspec.msgpack.encode(sampling)) - len(p.encode_trimmed(sampling))
    assert len(encoded) == len(msgspec.msgpack.encode(job)) - saved and saved == 49
    assert job.sampling is sampling  # the caller's job keeps its SamplingParams


def test_a_sampling_changed_in_place_between_jobs_is_sent_as_it_is_now() -> None:
    sampling = p.SamplingParams(stop=["a"])
    first = bytes(sampling_wire(sampling))
    sampling.stop.append("b")
    sampling.temperature = 0.5
    second = bytes(sampling_wire(sampling))
    assert msgspec.msgpack.decode(first, type=p.SamplingParams).stop == ["a"]
    assert msgspec.msgpack.decode(second, type=p.SamplingParams) == sampling
    other = p.SamplingParams(n=2)
    for _ in range(2):  # alternating samplings: each keeps its own encoding
        assert msgspec.msgpack.decode(sampling_wire(other), type=p.SamplingParams) == other
        assert msgspec.msgpack.decode(sampling_wire(sampling), type=p.SamplingParams) == sampling


def test_a_sampling_that_is_not_a_sampling_params_is_refused_when_the_job_is_made() -> None:
    with pytest.raises(ValueError, match="sampling must be a SamplingParams, got dict"):
        p.JobSpec("j", {"n": 1}, "hello")  # type: ignore[arg-type]
