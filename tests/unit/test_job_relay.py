"""The broker's view of a job (``JobRelay``): the same wire shape and rules as ``JobSpec``, with
the sampling parameters kept raw and checked once per distinct encoding."""

from __future__ import annotations

import msgspec
import pytest

from zmq_rollout import protocol as p
from zmq_rollout.protocol import jobs

JOBS = [
    p.JobSpec("a", prompt="hi"),
    p.JobSpec("b", p.SamplingParams(n=4, temperature=0.7, max_tokens=9, stop=["x"], seed=3), prompt_token_ids=[1, 2]),
    p.JobSpec(
        "c",
        p.SamplingParams(logit_bias={5: -1.5}, structured=p.StructuredOutput(regex="a+")),
        messages=[p.ChatMessage("user", "yo")],
        stream=True,
        min_weight_version=2,
        lora="ad",
        resubmitted=True,
        session_id="s",
        session_end=True,
        max_staleness=1,
        on_stale="restart",
    ),
]


def test_relay_has_jobspecs_fields_in_order_with_the_same_defaults() -> None:
    """A field added to JobSpec and not to JobRelay would be dropped by the broker."""
    spec = msgspec.structs.fields(p.JobSpec)
    relay = msgspec.structs.fields(p.JobRelay)
    assert [f.name for f in relay] == [f.name for f in spec]
    for a, b in zip(spec, relay, strict=True):
        if a.name != "sampling":
            assert (a.type, a.default) == (b.type, b.default), a.name
    assert msgspec.msgpack.decode(relay[1].default, type=p.SamplingParams) == p.SamplingParams()


@pytest.mark.parametrize("job", JOBS, ids=lambda j: j.job_id)
def test_a_relayed_job_reaches_the_worker_as_the_client_sent_it(job: p.JobSpec) -> None:
    wire = msgspec.msgpack.encode(job)
    relay = msgspec.msgpack.decode(wire, type=p.JobRelay)
    assert relay.cost() == job.cost() == job.sampling.n
    out = msgspec.msgpack.encode(p.AssignmentRelay(7, relay))
    assert out == msgspec.msgpack.encode(p.Assignment(7, job))
    assert msgspec.msgpack.decode(out, type=p.Assignment) == p.Assignment(7, job)


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ([0], "sampling: n=0 is outside [1, 256]"),
        ([1, float("nan")], "sampling: temperature must be a finite number"),
        ("not a list", "sampling: Expected `array`, got `str`"),
        ([1, 1.0, 1.0, -1, 4, [], None, 0, False, False, True, 0.0, 1.0, 0.0, 0.0, [], 5], "sampling: min_tokens=5"),
    ],
)
def test_bad_sampling_fails_the_relay_as_it_fails_a_jobspec_every_time(sampling: object, message: str) -> None:
    wire = msgspec.msgpack.encode(["j", sampling, "hi"])
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(wire, type=p.JobSpec)
    for _ in range(2):  # the second time from the cache of checked encodings
        with pytest.raises(msgspec.ValidationError, match=message.replace("[", r"\[").replace("(", r"\(")):
            msgspec.msgpack.decode(wire, type=p.JobRelay)


def test_the_relays_job_rules_are_jobspecs() -> None:
    for bad in (
        ["j", [], None],
        ["j", [], "hi", None, [1]],
        ["", [], "hi"],
        ["j", [], "hi", None, None, False, 0, None, False, None, True],
    ):
        wire = msgspec.msgpack.encode(bad)
        for kind in (p.JobSpec, p.JobRelay):
            with pytest.raises(msgspec.ValidationError):
                msgspec.msgpack.decode(wire, type=kind)


def test_the_cache_of_checked_samplings_stays_bounded() -> None:
    for seed in range(jobs._SAMPLING_CHECKED_MAX + 10):
        raw = msgspec.Raw(msgspec.msgpack.encode(p.SamplingParams(seed=seed, n=2)))
        assert jobs.sampling_n(raw) == 2
    assert len(jobs._sampling_checked) <= jobs._SAMPLING_CHECKED_MAX
