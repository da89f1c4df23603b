"""The broker's view of a job (``JobRelay``): the same wire shape and rules as ``JobSpec``, with
the sampling parameters kept raw and checked once per distinct encoding."""

from __future__ import annotations

import functools
import operator
import types
import typing
from typing import Any

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
        if b.type is msgspec.Raw:  # kept raw: its default is the encoding of JobSpec's
            default = a.default if a.default is not msgspec.NODEFAULT else a.default_factory()
            assert bytes(b.default) == msgspec.msgpack.encode(default), a.name
        else:
            assert (a.type, a.default) == (unconstrained(b.type), b.default), a.name
    assert [f.name for f in relay if f.type is msgspec.Raw] == ["sampling", "messages", "prompt_token_ids"]


def unconstrained(t: Any) -> Any:
    """``t`` without msgspec's constraints (``Annotated[X, Meta(...)]`` is X; a Literal of strings, str)."""
    origin = typing.get_origin(t)
    if origin is typing.Annotated:
        return unconstrained(typing.get_args(t)[0])
    if origin is typing.Literal:
        return str
    if origin in (types.UnionType, typing.Union):
        return functools.reduce(operator.or_, map(unconstrained, typing.get_args(t)))
    if origin is list:
        return list[unconstrained(typing.get_args(t)[0])]  # type: ignore[misc]
    return t


@pytest.mark.parametrize("job", JOBS, ids=lambda j: j.job_id)
def test_a_relayed_job_reaches_the_worker_as_the_client_sent_it(job: p.JobSpec) -> None:
    wire = msgspec.msgpack.encode(job)
    relay = msgspec.msgpack.decode(wire, type=p.JobRelay)
    assert relay.cost() == job.cost() == job.sampling.n
    out = msgspec.msgpack.encode(p.AssignmentRelay(7, relay, relay.cost()))
    assert out == msgspec.msgpack.encode([7, job, job.sampling.n])  # the job as it came, then its cost
    assert msgspec.msgpack.decode(out, type=p.Assignment) == p.Assignment(7, job)
    assert p.unseal(msgspec.msgpack.decode(out, type=p.SealedAssignment)) == p.Assignment(7, job)


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


# Every rule of a job's own fields, broken once (fields after sampling: prompt, messages,
# prompt_token_ids, stream, min_weight_version, lora, resubmitted, session_id, session_end,
# max_staleness, on_stale, ack), and the same fields at their limits.
BAD_JOBS = {
    "no input": ["j", [], None],
    "two inputs": ["j", [], "hi", None, [1]],
    "empty job id": ["", [], "hi"],
    "long job id": ["x" * (p.MAX_JOB_ID + 1), [], "hi"],
    "job id not a string": [5, [], "hi"],
    "empty prompt": ["j", [], ""],
    "long prompt": ["j", [], "x" * (p.MAX_PROMPT_CHARS + 1)],
    "no messages": ["j", [], None, []],
    "too many messages": ["j", [], None, [["user", "a"]] * (p.MAX_MESSAGES + 1)],
    "no token ids": ["j", [], None, None, []],
    "token ids not a list": ["j", [], None, None, "12"],
    "messages not a list": ["j", [], None, {"role": "user"}],
    "token ids and messages": ["j", [], None, [["user", "a"]], [1]],
    "too many token ids": ["j", [], None, None, [1] * (p.MAX_PROMPT_TOKENS + 1)],
    "stream not a bool": ["j", [], "hi", None, None, 1],
    "negative min version": ["j", [], "hi", None, None, False, -1],
    "min version a bool": ["j", [], "hi", None, None, False, True],
    "empty lora": ["j", [], "hi", None, None, False, 0, ""],
    "long lora": ["j", [], "hi", None, None, False, 0, "x" * (p.MAX_LORA_NAME + 1)],
    "empty session": ["j", [], "hi", None, None, False, 0, None, False, ""],
    "long session": ["j", [], "hi", None, None, False, 0, None, False, "x" * (p.MAX_JOB_ID + 1)],
    "end without a session": ["j", [], "hi", None, None, False, 0, None, False, None, True],
    "session end not a bool": ["j", [], "hi", None, None, False, 0, None, False, "s", 1],
    "negative staleness": ["j", [], "hi", None, None, False, 0, None, False, None, False, -1],
    "fractional staleness": ["j", [], "hi", None, None, False, 0, None, False, None, False, 1.5],
    "unknown on_stale": ["j", [], "hi", None, None, False, 0, None, False, None, False, 1, "retry"],
    "ack not a bool": ["j", [], "hi", None, None, False, 0, None, False, None, False, None, "abort", 0],
}
GOOD_JOBS = {
    "longest ids": ["x" * p.MAX_JOB_ID, [], "hi", None, None, False, 0, None, False, "s" * p.MAX_JOB_ID, True],
    "largest numbers": [
        "j",
        [],
        None,
        None,
        [0, 1 << 40],
        True,
        p.MAX_VERSION,
        "l" * p.MAX_LORA_NAME,
        True,
        None,
        False,
        p.MAX_VERSION,
        "restart",
        False,
    ],
    "most messages": ["j", [], None, [["user", ""]] * p.MAX_MESSAGES],
    "token ids past a fixarray": ["j", [], None, None, list(range(70_000))],
}
# What the broker leaves to the worker: what is inside ``messages`` and ``prompt_token_ids``.
WORKER_REFUSES = {
    "a negative token id": ["j", [], None, None, [1, -1]],
    "a token id that is a string": ["j", [], None, None, [1, "2"]],
    "a message that is a number": ["j", [], None, [5]],
    "a message with no content": ["j", [], None, [["user"]]],
    "deeply nested token ids": ["j", [], None, None, [[[[[1]]]]]],
}


@pytest.mark.parametrize("bad", BAD_JOBS.values(), ids=BAD_JOBS.keys())
def test_the_relay_refuses_what_a_jobspec_refuses(bad: list[Any]) -> None:
    wire = msgspec.msgpack.encode(bad)
    for kind in (p.JobSpec, p.JobRelay):
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(wire, type=kind)


@pytest.mark.parametrize("good", GOOD_JOBS.values(), ids=GOOD_JOBS.keys())
def test_the_relay_takes_what_a_jobspec_takes(good: list[Any]) -> None:
    wire = msgspec.msgpack.encode(good)
    spec = msgspec.msgpack.decode(wire, type=p.JobSpec)
    relay = msgspec.msgpack.decode(wire, type=p.JobRelay)
    out = msgspec.msgpack.encode(p.AssignmentRelay(1, relay))
    assert msgspec.msgpack.decode(out, type=p.Assignment) == p.Assignment(1, spec)


@pytest.mark.parametrize("bad", WORKER_REFUSES.values(), ids=WORKER_REFUSES.keys())
def test_the_worker_answers_alone_a_job_whose_inputs_the_broker_left_raw(bad: list[Any]) -> None:
    """The relay takes it and forwards it as it came; the worker, opening the JOBS message's
    jobs one by one, answers this one with an error keyed by its ticket and runs the others."""
    wire = msgspec.msgpack.encode(bad)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(wire, type=p.JobSpec)
    relay = msgspec.msgpack.decode(wire, type=p.JobRelay)
    good = msgspec.msgpack.decode(msgspec.msgpack.encode(JOBS[1]), type=p.JobRelay)
    jobs_message = msgspec.msgpack.encode([p.AssignmentRelay(5, good), p.AssignmentRelay(6, relay)])
    sealed = msgspec.msgpack.decode(jobs_message, type=list[p.SealedAssignment])
    opened = [p.unseal(s) for s in sealed]
    assert opened[0] == p.Assignment(5, JOBS[1])
    refused = opened[1]
    assert isinstance(refused, p.ErrorItem)
    assert (refused.key, refused.code) == (6, "invalid_request")
    assert refused.message.startswith("invalid job: ")


@pytest.mark.parametrize(
    ("items", "limit", "error"),
    [
        ([1], 1, None),
        ([1] * 15, 15, None),
        ([1] * 15, 14, "1..14 items, not 15"),
        ([1] * 16, 16, None),  # array 16
        ([1] * 65_535, 65_535, None),
        ([1] * 65_536, 65_536, None),  # array 32
        ([1] * 65_536, 65_535, "1..65535 items, not 65536"),
        ([], 5, "1..5 items, not 0"),
        ("ab", 5, "must be a list"),
        (None, 5, "must be a list"),
        ({"a": 1}, 5, "must be a list"),
    ],
)
def test_a_raw_list_is_checked_from_its_header(items: Any, limit: int, error: str | None) -> None:
    raw = msgspec.Raw(msgspec.msgpack.encode(items))
    if error is None:
        jobs.check_raw_list("ids", raw, limit)
    else:
        with pytest.raises(ValueError, match=error):
            jobs.check_raw_list("ids", raw, limit)


def test_the_relays_errors_name_the_field() -> None:
    wire = msgspec.msgpack.encode([["j", [], "hi"], ["k", [], "hi", None, None, False, 0, ""]])
    with pytest.raises(msgspec.ValidationError, match=r"length >= 1 - at `\$\[1\]\[7\]`"):
        msgspec.msgpack.decode(wire, type=list[p.JobRelay])


def test_the_cache_of_checked_samplings_stays_bounded() -> None:
    for seed in range(jobs._SAMPLING_CHECKED_MAX + 10):
        raw = msgspec.Raw(msgspec.msgpack.encode(p.SamplingParams(seed=seed, n=2)))
        assert jobs.sampling_n(raw) == 2
    assert len(jobs._sampling_checked) <= jobs._SAMPLING_CHECKED_MAX


def test_each_relay_costs_its_own_n_when_jobs_of_a_message_differ() -> None:
    """The last checked sampling is remembered (``jobs._last_sampling``): jobs that share it and
    jobs that do not each cost their own ``n``, and a bad one after good ones still fails."""
    ns = [1, 1, 3, 3, 1, 2, 2, 2]
    wire = msgspec.msgpack.encode([p.JobSpec(f"j{i}", p.SamplingParams(n=n), "hi") for i, n in enumerate(ns)])
    relays = msgspec.msgpack.decode(wire, type=list[p.JobRelay])
    assert [r.cost() for r in relays] == ns
    assert [r.cost() for r in reversed(relays)] == ns[::-1]
    bad = msgspec.msgpack.encode([["a", [2], "hi"], ["b", [0], "hi"]])
    with pytest.raises(msgspec.ValidationError, match="n=0"):
        msgspec.msgpack.decode(bad, type=list[p.JobRelay])


def test_the_remembered_sampling_is_a_copy_not_a_view_of_the_message() -> None:
    buffer = bytearray(msgspec.msgpack.encode(["j", p.SamplingParams(n=7, seed=1234), "hi"]))
    relay = msgspec.msgpack.decode(buffer, type=p.JobRelay)
    kept = bytes(jobs._last_sampling[0][0])  # type: ignore[arg-type]
    buffer[:] = bytes(len(buffer))  # the message's buffer reused for something else
    assert bytes(jobs._last_sampling[0][0]) == kept  # type: ignore[arg-type]
    assert msgspec.msgpack.decode(kept, type=p.SamplingParams).n == 7
    assert relay.job_id == "j"
