"""The benchmark's lean test doubles (``benchmarks/lean_doubles.py``) make, by splicing ids into
byte templates, exactly the messages the codec makes of the same objects: the broker does the
same work for them as for the ``echo`` doubles' (``broker_throughput.py --doubles``)."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # as when run from there

import lean_doubles as lean
import roles

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.batching import append
from zmq_rollout.submissions import encode_job, pack_submits, submit_command

SIZES = [0, 1, 15, 16, 64, 65_535, 65_536]


@pytest.mark.parametrize("n", SIZES)
def test_array_headers_are_msgpacks_own(n: int) -> None:
    encoded = msgspec.msgpack.encode([None] * n)
    header = lean.array_header(n)
    assert encoded.startswith(header) and len(encoded) == len(header) + n
    assert lean.array_length(encoded) == n
    assert lean.array_length(memoryview(encoded)) == n


def test_a_body_that_is_not_an_array_is_refused() -> None:
    with pytest.raises(ValueError, match="not a msgpack array: first byte 0xc0"):
        lean.array_length(b"\xc0")


JOBS = [
    roles.bench_job("x"),
    p.JobSpec("x", p.SamplingParams(n=4, max_tokens=512, seed=3), prompt_token_ids=list(range(0, 150_000, 293))),
    p.JobSpec("x", messages=[p.ChatMessage("user", "x-marks x")], session_id="x"),  # the id's text elsewhere too
]


@pytest.mark.parametrize("job", JOBS, ids=["toy", "token-ids", "chat"])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("sealed", [False, True])
def test_a_submit_template_makes_the_codecs_bytes(job: p.JobSpec, packed: bool, sealed: bool) -> None:
    ids = [f"client-{i:x}" for i in range(70)] + ["é" * 40, "é" * 128]  # str8 and str16 headers too
    made = lean.SubmitTemplate(job, sealed=sealed).frames(ids, packed)
    jobs = [msgspec.structs.replace(job, job_id=i) for i in ids]
    ((_, encoded),) = pack_submits(jobs, 128, 1 << 30, sealed=sealed)  # as the client sends them
    assert made == codec.encode(submit_command(sealed), encoded, packed=packed)
    decoded = codec.Decoder(codec.BROKER_FROM_CLIENT).decode(made).body
    assert [j.job_id for j in decoded] == ids


def test_a_submit_template_sends_token_bins_where_the_broker_reads_them() -> None:
    job = JOBS[1]
    ids = [f"client-{i:x}" for i in range(3)]
    made = lean.SubmitTemplate(job, token_bins=True).frames(ids, packed=True)
    jobs = [msgspec.Raw(encode_job(msgspec.structs.replace(job, job_id=i), True)) for i in ids]
    assert made == codec.encode(p.SUBMIT, jobs, packed=True)
    relays = codec.Decoder(codec.BROKER_FROM_CLIENT).decode(made).body
    assert [bytes(r.prompt_token_ids)[:1] for r in relays] == [b"\xc5"] * 3  # bin 16: 4 x 512 bytes
    assert lean.SubmitTemplate(JOBS[0], token_bins=True).frames(ids, True) == lean.SubmitTemplate(JOBS[0]).frames(
        ids, True
    )  # no token ids: nothing changes


def _worker_answers(result: p.Result, tickets: list[int], sealed: bool) -> list[list[bytes]]:
    """What the echo doubles send for ``result`` under each ticket (``p.final_item``, coalesced)."""
    segments: list[list[object]] = []
    for t in tickets:
        append(segments, *p.final_item(msgspec.structs.replace(result, key=t), sealed))
    return [codec.encode(command, items, packed=True) for command, items in segments]


TICKETS = [0, 1, 127, 128, 255, 256, 65_535, 65_536, 2**32, 2**63 - 1]


@pytest.mark.parametrize("sample_tokens", [0, 512])
@pytest.mark.parametrize("sealed", [False, True])
def test_an_answer_template_makes_the_codecs_bytes(
    sample_tokens: int, sealed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(roles, "SAMPLE_TOKENS", sample_tokens)
    result = roles.bench_result(p.Assignment(9, roles.bench_job("j")), "double-3", 7)
    template = lean.AnswerTemplate(result, sealed)
    made = template.frames(TICKETS, packed=True)
    assert [made] == _worker_answers(result, TICKETS, sealed)
    # a toy result goes as FINAL even where the broker reads SEALED_FINAL (p.worth_sealing)
    assert template.command == (p.SEALED_FINAL if sealed and sample_tokens else p.FINAL)
    body = codec.Decoder(codec.FROM_WORKER).decode(made).body
    assert [r.key for r in body] == TICKETS


def test_answers_are_counted_from_their_headers() -> None:
    final = codec.encode(p.FINAL, [p.Result("j", [1], [], 0, "w")] * 70, packed=True)
    errors = codec.encode(p.ERROR, [p.ErrorItem("j", "invalid_request", "no")] * 3)
    busy = codec.encode(p.BUSY, [p.ErrorItem("j", "busy", "later")], packed=True)
    accepted = codec.encode(p.ACCEPTED, ["j"], packed=True)
    assert lean.count_answer(final) == (70, 0)
    assert lean.count_answer(errors) == (0, 3)
    assert lean.count_answer(busy) == (0, 1)
    assert lean.count_answer(accepted) == (0, 0)


def test_the_http_baselines_lean_body_is_the_same_json_and_its_answers_are_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import json

    import http_baseline as http

    ids = [f"client-0-{i:x}" for i in range(64)]
    monkeypatch.setattr(roles, "LEAN", False)
    built = http.post_body(ids)["json"]
    monkeypatch.setattr(roles, "LEAN", True)
    lean_post = http.post_body(ids)
    assert json.loads(lean_post["data"]) == built
    assert lean_post["headers"] == {"Content-Type": "application/json"}
    answer = json.dumps([{"job_id": i, "prompt_token_ids": [100], "worker_id": "http-echo"} for i in ids]).encode()
    assert http.count_results(answer) == 64
    monkeypatch.setattr(roles, "LEAN", False)
    assert http.count_results(answer) == 64
