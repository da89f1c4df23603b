"""The wire protocol: bodies, validation, framing and the error codes that cross the wire."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import msgspec
import pytest

from zmq_rollout import codec, errors
from zmq_rollout import protocol as p
from zmq_rollout.errors import ProtocolError

TABLES = {
    "FROM_CLIENT": codec.FROM_CLIENT,
    "TO_CLIENT": codec.TO_CLIENT,
    "FROM_WORKER": codec.FROM_WORKER,
    "TO_WORKER": codec.TO_WORKER,
}

FULL_SAMPLING = p.SamplingParams(
    n=4,
    temperature=0.7,
    top_p=0.9,
    top_k=50,
    max_tokens=32,
    stop=["\n", "</s>"],
    seed=1234,
    logprobs=5,
    ignore_eos=True,
)
JOBS = [
    p.JobSpec("job-prompt", FULL_SAMPLING, prompt="2+2=", stream=True, min_weight_version=7),
    p.JobSpec("job-chat", messages=[p.ChatMessage("system", "be brief"), p.ChatMessage("user", "hi")]),
    p.JobSpec("job-ids", p.SamplingParams(temperature=0.0), prompt_token_ids=[0, 1, 2, 50_000], lora="policy"),
]
SAMPLES = [
    p.Sample(0, [5, 6], [-0.5, -1.25], "stop", top_logprobs=[{5: -0.5, 9: -2.0}, {6: -1.25}]),
    p.Sample(1, [7], [-0.125], "length"),
]
ERRORS = [
    p.ErrorItem(None, "protocol", "bad frame"),
    p.ErrorItem("job-1", "busy", "queue full"),
    p.ErrorItem(42, "job_failed", "engine died"),
]
STATUS_REPLY = p.StatusReply(
    [p.WorkerStatus("w0", "ready", "tiny", 64, 3, 2, 0.25)],
    [p.ClientStatus("trainer", 10, 3)],
    10,
    3,
)

# A representative body for every command of every direction table.
BODIES: dict[tuple[str, bytes], Any] = {
    ("FROM_CLIENT", p.SUBMIT): JOBS,
    ("FROM_CLIENT", p.CANCEL): ["job-1", "job-2"],
    ("FROM_CLIENT", p.STATUS): None,
    ("FROM_CLIENT", p.SEALED_SUBMIT): [
        p.SealedJob.of(job, msgspec.msgpack.encode(job)) for job in JOBS
    ],
    ("FROM_CLIENT", p.HEARTBEAT): None,
    ("FROM_CLIENT", p.DISCONNECT): None,
    ("FROM_CLIENT", p.SYNC): p.SyncStep(
        4, p.LoadShm("zr-1-0", p.Bucket(0, 8, [p.TensorMeta("a", "int32", [2], 0, 8)])), 30.0
    ),
    ("TO_CLIENT", p.SYNC_REPLY): p.SyncReply(
        4, "load_shm", [p.WorkerAck("w0", True, 12)], [p.Evicted("w1", "no answer")], 3
    ),
    ("TO_CLIENT", p.ACCEPTED): ["job-1", "job-2"],
    ("TO_CLIENT", p.PARTIAL): [p.Delta("job-1", 0, [1, 2], [-0.5, -0.25])],
    ("TO_CLIENT", p.FINAL): [p.Result("job-1", [1, 2, 3], SAMPLES, 3, "worker-a")],
    ("TO_CLIENT", p.ERROR): ERRORS,
    ("TO_CLIENT", p.BUSY): ERRORS[1:2],
    ("TO_CLIENT", p.STATUS_REPLY): STATUS_REPLY,
    ("TO_CLIENT", p.HEARTBEAT): None,
    ("FROM_WORKER", p.READY): p.WorkerInfo("w0", "tiny", 64, 2, ["echo"], 2048),
    ("FROM_WORKER", p.CREDIT): 17,
    ("FROM_WORKER", p.PARTIAL): [p.Delta(11, 1, [3], [-0.75])],
    ("FROM_WORKER", p.FINAL): [p.Result(11, [1], SAMPLES, 0, "w0")],
    ("FROM_WORKER", p.SEALED_FINAL): [
        p.seal(p.Result(11, [1], SAMPLES, 0, "w0")),
        p.seal(p.Result(12, [2], [], 1, "w0")),
    ],
    ("FROM_WORKER", p.ERROR): [p.ErrorItem(11, "invalid_request", "prompt too long")],
    ("FROM_WORKER", p.HEARTBEAT): None,
    ("FROM_WORKER", p.CONTROL_ACK): p.ControlAck(3, "check_names", True, 4, "", p.NameCheck(["a"], [])),
    ("FROM_WORKER", p.DISCONNECT): None,
    ("TO_WORKER", p.JOBS): [p.Assignment(11, job) for job in JOBS],
    ("TO_WORKER", p.CANCEL): [11, 12],
    ("TO_WORKER", p.CONTROL): p.Control(3, p.Commit(4), rank_offset=1, world_size=3),
    ("TO_WORKER", p.HEARTBEAT): None,
    ("TO_WORKER", p.DISCONNECT): None,
}


def _decode(table: str, frames: list[Any]) -> codec.Message:
    return codec.Decoder(TABLES[table]).decode(frames)


def _submit_frames(*raw_jobs: Any) -> list[bytes]:
    """A SUBMIT whose header is written with the plain ``msgpack`` package."""
    return [p.SIGNATURE, p.SUBMIT, msgpack.packb(list(raw_jobs))]


def _raw_sampling(**changes: Any) -> list[Any]:
    """SamplingParams as the plain msgpack array a client in another language would send."""
    fields = {name: getattr(p.SamplingParams(), name) for name in p.SamplingParams.__struct_fields__}
    fields.update(changes)
    return [fields[name] for name in p.SamplingParams.__struct_fields__]


# -- round trips --------------------------------------------------------------------------
def test_every_command_of_every_table_has_a_sample_body() -> None:
    commands = {(name, cmd) for name, table in TABLES.items() for cmd in table}
    assert set(BODIES) == commands


@pytest.mark.parametrize(
    ("table", "command"),
    list(BODIES),
    ids=lambda v: v if isinstance(v, str) else p.COMMAND_NAMES[v],
)
def test_round_trip(table: str, command: bytes) -> None:
    body = BODIES[(table, command)]
    frames = codec.encode(command, body)
    assert frames[:2] == [p.SIGNATURE, command]
    msg = _decode(table, frames)
    assert msg.command == command
    if table == "FROM_WORKER" and command in (p.PARTIAL, p.FINAL):
        # The broker keeps token payloads raw and forwards them: re-encoding its view gives
        # the very bytes a client decodes into the worker's original body.
        assert [x.key for x in msg.body] == [x.key for x in body]
        kind = list[p.Delta] if command == p.PARTIAL else list[p.Result]
        assert msgspec.msgpack.decode(codec.encode_body(msg.body), type=kind) == body
    elif command == p.SEALED_FINAL:
        # The broker steps over each sealed result and gives the client a plain Result.
        assert [(x.key, x.weight_version) for x in msg.body] == [(11, 0), (12, 1)]
        to_client = [x.to_client(f"job-{x.key}") for x in msg.body]
        expected = [p.Result("job-11", [1], SAMPLES, 0, "w0"), p.Result("job-12", [2], [], 1, "w0")]
        assert msgspec.msgpack.decode(codec.encode_body(to_client), type=list[p.Result]) == expected
        assert msgspec.msgpack.decode(msg.body[0].samples, type=list[p.Sample]) == SAMPLES
    else:
        assert msg.body == body
    assert list(msg.blobs) == []


def test_round_trip_from_zero_copy_buffers_with_blobs() -> None:
    """The broker decodes memoryviews of zmq frames; blobs after the header come back as is."""
    frames = codec.encode(p.JOBS, BODIES[("TO_WORKER", p.JOBS)], blobs=[b"\x00" * 8, b"weights"])
    msg = _decode("TO_WORKER", [memoryview(f) for f in frames])
    assert msg.body == BODIES[("TO_WORKER", p.JOBS)]
    assert [bytes(b) for b in msg.blobs] == [b"\x00" * 8, b"weights"]


def test_body_is_a_plain_msgpack_array() -> None:
    frames = codec.encode(p.SUBMIT, [JOBS[0]])
    (raw_job,) = msgpack.unpackb(frames[2])
    assert isinstance(raw_job, list)
    job_id, sampling, prompt, messages, token_ids, stream, min_version = raw_job[:7]
    assert (job_id, prompt, messages, token_ids, stream, min_version) == (
        "job-prompt",
        "2+2=",
        None,
        None,
        True,
        7,
    )
    assert sampling[:11] == [4, 0.7, 0.9, 50, 32, ["\n", "</s>"], 1234, 5, True, False, True]
    assert sampling[11:] == [0.0, 1.0, 0.0, 0.0, [], 0, None, None, None]  # the rest of vLLM's surface, neutral
    assert codec.encode_body(JOBS[0]) == msgpack.packb(raw_job)


def test_plain_msgpack_with_omitted_trailing_defaults_decodes() -> None:
    msg = _decode("FROM_CLIENT", _submit_frames(["j", [], "hi"], ["k", [3], None, [["user", "yo"]]]))
    first, second = msg.body
    assert first == p.JobSpec("j", p.SamplingParams(), prompt="hi")
    assert second == p.JobSpec("k", p.SamplingParams(n=3), messages=[p.ChatMessage("user", "yo")])


def test_extra_trailing_array_items_are_ignored() -> None:
    raw = [
        "j",
        [*_raw_sampling(n=2), "future-sampling-field"],
        "hi",
        None,
        None,
        False,
        3,
        "adapter",
        True,
        None,
        False,
        2,
        "restart",
        False,
        "future-field",
        99,
    ]
    (job,) = _decode("FROM_CLIENT", _submit_frames(raw)).body
    want = p.JobSpec(
        "j",
        p.SamplingParams(n=2),
        prompt="hi",
        min_weight_version=3,
        lora="adapter",
        resubmitted=True,
        max_staleness=2,
        on_stale="restart",
        ack=False,
    )
    assert job == want
    ready = [p.SIGNATURE, p.READY, msgpack.packb(["w0", "tiny", 8, 1, [], 0, 1, {"future": True}])]
    assert _decode("FROM_WORKER", ready).body == p.WorkerInfo("w0", "tiny", 8, 1)


# -- SamplingParams validation ------------------------------------------------------------
INVALID_SAMPLING = [
    pytest.param({"n": 0}, r"n=0 is outside", id="n=0"),
    pytest.param({"n": True}, r"n must be an integer|Expected `int`, got `bool`", id="n=bool"),
    pytest.param({"temperature": -1.0}, r"temperature=-1.0 is outside", id="temperature=-1"),
    pytest.param({"temperature": math.nan}, r"temperature must be a finite number", id="temperature=nan"),
    pytest.param({"top_p": 0.0}, r"top_p=0.0 is outside \(0.0, 1.0\]", id="top_p=0"),
    pytest.param({"top_p": 1.5}, r"top_p=1.5 is outside", id="top_p=1.5"),
    pytest.param({"max_tokens": 0}, r"max_tokens=0 is outside", id="max_tokens=0"),
    pytest.param({"stop": ["x"] * (p.MAX_STOP + 1)}, r"stop takes at most 16", id="too-many-stop"),
    pytest.param({"stop": [""]}, r"stop strings must be non-empty", id="empty-stop"),
    pytest.param({"logprobs": p.MAX_TOP_LOGPROBS + 1}, r"logprobs=21 is outside", id="logprobs=21"),
    pytest.param({"seed": -1}, r"seed=-1 is outside", id="seed=-1"),
]


@pytest.mark.parametrize(("changes", "message"), INVALID_SAMPLING)
def test_invalid_sampling_is_refused_on_construction(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        p.SamplingParams(**changes)


@pytest.mark.parametrize(("changes", "message"), INVALID_SAMPLING)
def test_invalid_sampling_is_refused_on_decode(changes: dict[str, Any], message: str) -> None:
    frames = _submit_frames(["job-1", _raw_sampling(**changes), "hi"])
    with pytest.raises(ProtocolError, match=message) as info:
        _decode("FROM_CLIENT", frames)
    assert str(info.value).startswith("invalid submit message:")


def test_valid_sampling_edges_are_accepted() -> None:
    p.SamplingParams(
        n=p.MAX_N,
        temperature=0.0,
        top_p=1.0,
        max_tokens=1,
        stop=["x"] * p.MAX_STOP,
        seed=0,
        logprobs=p.MAX_TOP_LOGPROBS,
    )


# -- JobSpec validation -------------------------------------------------------------------
@pytest.mark.parametrize(
    "inputs",
    [
        {},
        {"prompt": "hi", "prompt_token_ids": [1]},
        {"prompt": "hi", "messages": [p.ChatMessage("user", "hi")]},
        {"prompt": "hi", "messages": [p.ChatMessage("user", "hi")], "prompt_token_ids": [1]},
    ],
    ids=["none", "prompt+ids", "prompt+messages", "all-three"],
)
def test_job_needs_exactly_one_input(inputs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="exactly one of prompt, messages, prompt_token_ids"):
        p.JobSpec("job-1", **inputs)
    raw = [
        "job-1",
        [],
        inputs.get("prompt"),
        [["user", "hi"]] if "messages" in inputs else None,
        inputs.get("prompt_token_ids"),
    ]
    with pytest.raises(ProtocolError, match="exactly one of prompt, messages, prompt_token_ids"):
        _decode("FROM_CLIENT", _submit_frames(raw))


@pytest.mark.parametrize("job_id", ["", "x" * (p.MAX_JOB_ID + 1)], ids=["empty", "too-long"])
def test_job_id_length(job_id: str) -> None:
    with pytest.raises(ValueError, match=r"job_id must be a string of 1\.\.128"):
        p.JobSpec(job_id, prompt="hi")
    with pytest.raises(ProtocolError, match=r"job_id must be a string of 1\.\.128"):
        _decode("FROM_CLIENT", _submit_frames([job_id, [], "hi"]))


def test_job_id_of_max_length_is_accepted() -> None:
    (job,) = _decode("FROM_CLIENT", _submit_frames(["x" * p.MAX_JOB_ID, [], "hi"])).body
    assert job.job_id == "x" * p.MAX_JOB_ID


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"prompt": ""}, "prompt must be"),
        ({"messages": []}, "messages must hold"),
        ({"prompt_token_ids": []}, "prompt_token_ids must hold"),
        ({"prompt_token_ids": [1, -1]}, "non-negative"),
        ({"prompt": "hi", "min_weight_version": -1}, "min_weight_version=-1"),
        ({"prompt": "hi", "lora": ""}, "lora must be an adapter name"),
        ({"prompt": "hi", "lora": "x" * 129}, "lora must be an adapter name"),
    ],
)
def test_job_input_contents_are_checked(inputs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        p.JobSpec("job-1", **inputs)


def test_job_cost_is_n() -> None:
    assert p.JobSpec("j", p.SamplingParams(n=7), prompt="x").cost() == 7


# -- framing errors -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("frames", "message"),
    [
        pytest.param(
            [b"ZR9", p.STATUS, msgpack.packb(None)],
            r"bad protocol signature b'ZR9', expected b'ZR1'",
            id="signature",
        ),
        pytest.param(
            [p.SIGNATURE, b"\x7f", msgpack.packb(None)],
            r"unknown command b'\\x7f'",
            id="unknown-command",
        ),
        pytest.param([p.SIGNATURE, p.JOBS, msgpack.packb([])], r"unknown command b'1'", id="wrong-direction"),
        pytest.param([p.SIGNATURE, p.SUBMIT], r"expected at least 3 frames .* got 2", id="two-frames"),
        pytest.param([], r"got 0", id="no-frames"),
        pytest.param([p.SIGNATURE, p.SUBMIT, b"\xc1garbage"], r"invalid submit message", id="garbage-header"),
        pytest.param(
            [p.SIGNATURE, p.SUBMIT, msgpack.packb({"job_id": "j"})],
            r"invalid submit message: Expected `array`",
            id="map-header",
        ),
        pytest.param(
            [p.SIGNATURE, p.CANCEL, msgpack.packb([1, 2])],
            r"invalid cancel message",
            id="cancel-ints-from-client",
        ),
    ],
)
def test_framing_errors_raise_protocol_error(frames: list[bytes], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        _decode("FROM_CLIENT", frames)


def test_protocol_error_is_a_rollout_error_with_its_code() -> None:
    with pytest.raises(errors.RolloutError) as info:
        _decode("FROM_CLIENT", [b"nope", p.STATUS, b""])
    assert isinstance(info.value, ProtocolError)
    assert info.value.code == "protocol"


# -- error codes --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("protocol", errors.ProtocolError),
        ("invalid_request", errors.InvalidRequestError),
        ("busy", errors.BusyError),
        ("job_failed", errors.JobFailedError),
        ("cancelled", errors.JobCancelledError),
        ("stale", errors.StaleRolloutError),
        ("timeout", errors.RolloutTimeoutError),
        ("closed", errors.ClientClosedError),
    ],
)
def test_error_from_code(code: str, cls: type[errors.RolloutError]) -> None:
    err = errors.error_from_code(code, "what happened", "job-9")
    assert type(err) is cls
    assert cls.code == code
    assert str(err) == "what happened"
    assert err.job_id == "job-9"


def test_unknown_error_code_is_the_base_class() -> None:
    err = errors.error_from_code("martian", "??")
    assert type(err) is errors.RolloutError
    assert err.job_id is None


def test_timeout_error_is_also_a_builtin_timeout() -> None:
    assert issubclass(errors.RolloutTimeoutError, TimeoutError)
