"""The OpenAI gateway (zmq_rollout/gateway): request translation and response shapes with no
socket, then HTTP through a real uvicorn on loopback against a broker with echo worker doubles
(test doubles: they echo the prompt's first tokens, with no text)."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import openai
import pytest
from helpers import metric_name_problems, parse_samples, poll_until

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.gateway import responses as out
from zmq_rollout.gateway.openai_protocol import OpenAIError, parse_chat, parse_completion
from zmq_rollout.gateway.streaming import ChunkBuilder, StreamBroken
from zmq_rollout.rollouts import Rollout, TokenDelta
from zmq_rollout.testing import EchoWorkerDouble


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def rollout(prompt_index: int = 0, index: int = 0, **fields: Any) -> Rollout:
    values: dict[str, Any] = {
        "job_id": "j",
        "prompt_index": prompt_index,
        "index": index,
        "prompt_token_ids": [1, 2, 3],
        "token_ids": [7, 8, 9],
        "logprobs": [-0.5, -float("inf"), -1.5],
        "finish_reason": "length",
        "weight_version": 4,
        "worker_id": "w",
        "text": "abc",
    }
    values.update(fields)
    return Rollout(**values)


# -- requests into jobs (pure) ---------------------------------------------------------------
def test_completion_prompts_and_sampling() -> None:
    _, jobs = parse_completion(body(prompt="hi"))
    assert jobs.prompts == ["hi"]
    assert jobs.sampling == p.SamplingParams(max_tokens=16)  # vLLM's defaults are ours
    assert jobs.top is None
    _, jobs = parse_completion(body(prompt=["a", "b"], n=3, temperature=0.5, top_k=0, stop="\n", logprobs=2, seed=7))
    assert jobs.prompts == ["a", "b"]
    assert jobs.sampling == p.SamplingParams(
        n=3, temperature=0.5, top_k=0, stop=["\n"], logprobs=2, seed=7, max_tokens=16
    )
    assert jobs.top == 2
    assert parse_completion(body(prompt=[5, 6]))[1].prompts == [[5, 6]]
    assert parse_completion(body(prompt=[[5, 6], [7]]))[1].prompts == [[5, 6], [7]]
    _, jobs = parse_completion(
        body(prompt="x", ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False, max_tokens=None)
    )
    assert (jobs.sampling.ignore_eos, jobs.sampling.include_stop_str_in_output) == (True, True)
    assert (jobs.sampling.skip_special_tokens, jobs.sampling.max_tokens) == (False, 16)


def test_chat_messages_and_sampling() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    _, jobs = parse_chat(body(messages=[{"role": "user", "content": parts}], max_tokens=5), 1024)
    assert jobs.prompts == [[p.ChatMessage("user", "a\nb")]]
    assert jobs.sampling.max_tokens == 5
    assert jobs.top is None
    _, jobs = parse_chat(body(messages=[{"role": "user", "content": "x"}], max_tokens=5, max_completion_tokens=9), 1)
    assert jobs.sampling.max_tokens == 9
    _, jobs = parse_chat(body(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=3), 77)
    assert (jobs.sampling.max_tokens, jobs.sampling.logprobs, jobs.top) == (77, 3, 3)
    _, jobs = parse_chat(body(messages=[{"role": "user", "content": "x"}], logprobs=True), 77)
    assert (jobs.sampling.logprobs, jobs.top) == (0, 0)


TRL_COMPLETION = {  # what TRL 1.16's VLLMClient.generate sends, beside the prompt
    "model": "m",
    "n": 2,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "max_tokens": 16,
    "logprobs": 0,
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
}


def test_neutral_values_of_unsupported_fields_are_accepted() -> None:
    parse_completion(body(prompt=[1, 2], **TRL_COMPLETION))
    neutral = {"presence_penalty": 0.0, "frequency_penalty": 0, "stop_token_ids": [], "logit_bias": None,
               "min_tokens": 0, "use_beam_search": False, "response_format": {"type": "text"}, "user": "me",
               "request_id": "r", "some_field_vllm_ignores": 1}  # fmt: skip
    parse_completion(body(prompt="x", **neutral))
    parse_chat(body(messages=[{"role": "user", "content": "x"}], tool_choice="none", chat_template_kwargs={}), 8)


@pytest.mark.parametrize(("field", "value"), [("use_beam_search", True), ("echo", True), ("bad_words", ["x"])])
def test_other_values_of_unsupported_fields_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_completion(body(prompt="x", **{field: value}))
    assert info.value.status == 400
    assert info.value.param == field
    assert "not supported yet" in info.value.message
    with pytest.raises(OpenAIError):
        parse_chat(body(messages=[{"role": "user", "content": "x"}], **{field: value}), 8)


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"repetition_penalty": 1.1, "min_p": 0.05}, {"repetition_penalty": 1.1, "min_p": 0.05}),
        ({"presence_penalty": 0.5, "frequency_penalty": -0.5}, {"presence_penalty": 0.5, "frequency_penalty": -0.5}),
        ({"stop_token_ids": [3], "min_tokens": 2}, {"stop_token_ids": [3], "min_tokens": 2}),
        ({"logit_bias": {"5": 1}}, {"logit_bias": {5: 1.0}}),
        ({"truncate_prompt_tokens": 4}, {"truncate_prompt_tokens": 4}),
        ({"structured_outputs": {"regex": "a+"}}, {"structured": p.StructuredOutput(regex="a+")}),
        ({"guided_choice": ["x", "y"]}, {"structured": p.StructuredOutput(choice=["x", "y"])}),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}},
            {"structured": p.StructuredOutput(json_schema='{"type": "object"}')},
        ),
        (
            {"response_format": {"type": "json_object"}},
            {"structured": p.StructuredOutput(json_schema='{"type": "object"}')},
        ),
    ],
)
def test_the_rest_of_vllms_sampling_surface_maps_onto_ours(fields: dict[str, Any], want: dict[str, Any]) -> None:
    _, jobs = parse_completion(body(prompt="x", max_tokens=8, **fields))
    assert {k: getattr(jobs.sampling, k) for k in want} == want
    _, chat = parse_chat(body(messages=[{"role": "user", "content": "x"}], max_tokens=8, **fields), 8)
    assert {k: getattr(chat.sampling, k) for k in want} == want


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 99, "max_tokens": 8}, "min_tokens"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "grammar"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ],
)
def test_bad_values_of_the_sampling_surface_are_400s_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_completion(body(prompt="x", **fields))
    assert info.value.status == 400 and info.value.param == param, info.value.message


@pytest.mark.parametrize(
    ("raw", "param"),
    [(b"not json", None), (body(prompt="x", n="many"), "body.n"), (body(prompt="x", n=0), "n"),
     (body(prompt=""), "prompt"), (body(prompt=["a", ""]), "prompt"), (body(prompt=[-1]), "body.prompt.0"),
     (body(prompt="x", temperature=-1), "temperature"), (body(prompt="x", seed=-5), "seed"),
     (body(prompt="x", logprobs=-2), "logprobs"), (body(prompt="x", logprobs=21), "logprobs"),
     (body(prompt="x", stream_options={"include_usage": True}), "stream_options")],
)  # fmt: skip
def test_bad_completion_requests_are_400s_in_vllms_shape(raw: bytes, param: str | None) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_completion(raw)
    error = info.value.body()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 400
    assert error["type"] in ("BadRequestError", "Bad Request")  # vLLM's two spellings (own check, pydantic's)
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    "fields",
    [{"messages": []}, {"messages": [{"content": "x"}]}, {"messages": [{"role": "user", "content": 3}]},
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}],
)  # fmt: skip
def test_bad_chat_requests_are_400s(fields: dict[str, Any]) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_chat(body(**fields), 8)
    assert info.value.status == 400


# -- rollouts into responses (pure) ----------------------------------------------------------
def test_completion_response_parses_with_the_openai_sdk() -> None:
    tops = [{7: -0.5, 1: -1.0}, {2: -0.1, 3: -0.2}, {9: -1.5}]
    rollouts = [rollout(0, 0, top_logprobs=tops), rollout(0, 1, weight_versions=[3, 4, 4]), rollout(1, 0)]
    answer = out.completion_response(rollouts, "m", n=2, top=1, token_ids=True)
    parsed = openai.types.Completion.model_validate(answer)
    assert [c.index for c in parsed.choices] == [0, 1, 2]
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == [1, 2, 3] and choice["token_ids"] == [7, 8, 9]
    assert choice["logprobs"]["tokens"] == ["token_id:7", "token_id:8", "token_id:9"]
    assert choice["logprobs"]["token_logprobs"] == [-0.5, -9999.0, -1.5]  # -inf clamped as vLLM does
    assert choice["logprobs"]["text_offset"] == [0, 10, 20]
    # the sampled token first, then the top 1: up to top + 1 entries
    assert choice["logprobs"]["top_logprobs"][0] == {"token_id:7": -0.5, "token_id:1": -1.0}
    assert choice["logprobs"]["top_logprobs"][1] == {"token_id:8": -9999.0, "token_id:2": -0.1}
    assert choice["weight_version"] == 4 and "weight_versions" not in choice
    assert answer["choices"][1]["weight_versions"] == [3, 4, 4]
    assert answer["usage"] == {"prompt_tokens": 6, "completion_tokens": 9, "total_tokens": 15,
                               "prompt_tokens_details": None}  # fmt: skip
    plain = out.completion_response(rollouts, "m", n=2, top=None, token_ids=False)["choices"][0]
    assert plain["logprobs"] is None and plain["token_ids"] is None and plain["prompt_token_ids"] is None


def test_chat_response_parses_with_the_openai_sdk() -> None:
    answer = out.chat_response([rollout(top_logprobs=[{7: -0.5, 1: -1.0}] * 3)], "m", top=2, token_ids=True)
    parsed = openai.types.chat.ChatCompletion.model_validate(answer)
    assert parsed.choices[0].message.content == "abc"
    assert answer["prompt_token_ids"] == [1, 2, 3]
    content = answer["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["token_id:7", "token_id:8", "token_id:9"]
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["token_id:8", "token_id:7"]  # vLLM: sampled first


def test_chunks_add_up_to_the_response() -> None:
    builder = ChunkBuilder(chat=False, model="m", n=1, top=0, token_ids=True, include_usage=True, prompt_ids=[None])
    chunks = builder.start()
    chunks += builder.delta(0, TokenDelta("j", 0, [7], [-0.5], "a"))
    chunks += builder.delta(0, TokenDelta("j", 0, [8], [-1.0], ""))  # vLLM may hold text back a while
    chunks += builder.final(0, rollout())
    chunks += builder.end()
    openai.types.Completion.model_validate(chunks[-2])  # the SDK reads chunks as Completions (unvalidated)
    choices = [c["choices"][0] for c in chunks[:-1]]
    vllm_keys = {"index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"}
    assert [set(c) - vllm_keys for c in choices] == [set(), set(), {"weight_version"}]
    assert [t for c in choices for t in c["token_ids"]] == [7, 8, 9]
    assert [c["text"] for c in choices] == ["a", "", "bc"]  # as streamed, then what is left
    assert [c["finish_reason"] for c in choices] == [None, None, "length"]
    assert [c["prompt_token_ids"] for c in choices] == [None, None, [1, 2, 3]]  # known once the worker answers
    assert [c["logprobs"]["text_offset"] for c in choices] == [[0], [10], [20]]
    assert choices[-1]["weight_version"] == 4
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 6


def test_chat_chunks_open_with_the_role_and_hold_for_top_logprobs() -> None:
    builder = ChunkBuilder(chat=True, model="m", n=2, top=1, token_ids=False, include_usage=False, prompt_ids=[None])
    opening = builder.start()
    assert [c["choices"][0]["delta"] for c in opening] == [{"role": "assistant", "content": ""}] * 2
    assert builder.delta(0, TokenDelta("j", 1, [7], [-0.5])) == []  # top logprobs come with the final rollout
    (last,) = builder.final(0, rollout(0, 1, top_logprobs=[{1: -0.1}] * 3))
    openai.types.chat.ChatCompletionChunk.model_validate(last)
    choice = last["choices"][0]
    assert choice["index"] == 1 and choice["delta"] == {"content": "abc"} and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["content"]) == 3


def test_a_restart_after_streamed_tokens_breaks_the_stream() -> None:
    builder = ChunkBuilder(chat=False, model="m", n=1, top=None, token_ids=True, include_usage=False,
                           prompt_ids=[[1, 2, 3]])  # fmt: skip
    builder.restarted(0)  # nothing sent yet: the job just runs again
    (chunk,) = builder.delta(0, TokenDelta("j", 0, [7], [-0.5]))
    assert chunk["choices"][0]["prompt_token_ids"] == [1, 2, 3]  # token-id prompts: in the first chunk
    with pytest.raises(StreamBroken):
        builder.restarted(0)
    with pytest.raises(StreamBroken):
        builder.final(0, rollout(token_ids=[5, 6]))


def test_streamed_text_that_is_not_the_final_texts_start_breaks_the_stream() -> None:
    builder = ChunkBuilder(chat=True, model="m", n=1, top=None, token_ids=False, include_usage=False,
                           prompt_ids=[None])  # fmt: skip
    (chunk,) = builder.delta(0, TokenDelta("j", 0, [7], [-0.5], "x"))
    assert chunk["choices"][0]["delta"]["content"] == "x"
    with pytest.raises(StreamBroken, match="text streamed so far"):
        builder.final(0, rollout())  # its text is "abc"


# -- over HTTP, against echo worker doubles ---------------------------------------------------
def requests_total(url: str) -> dict[str, float]:
    samples = parse_samples(httpx.get(f"{url}/metrics").text)
    return {k: v for k, v in samples.items() if k.startswith("zmq_rollout_gateway_requests_total")}


def test_http_completions_chat_and_models(start_broker: Any, start_double: Any, start_gateway: Any) -> None:
    broker = start_broker()
    start_double(broker)
    url = start_gateway(broker.frontend)
    assert httpx.get(f"{url}/health").status_code == 200
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    assert [m.id for m in sdk.models.list().data] == ["echo-double"]
    completion = sdk.completions.create(
        model="echo-double", prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=4, logprobs=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert [c.model_extra["token_ids"] for c in completion.choices] == [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    assert completion.choices[2].model_extra["prompt_token_ids"] == [8, 9]
    assert completion.choices[0].logprobs.tokens == ["token_id:5", "token_id:6", "token_id:7"]
    assert completion.choices[0].model_extra["weight_version"] == 0
    assert completion.usage.prompt_tokens == 5 and completion.usage.completion_tokens == 10
    chat = sdk.chat.completions.create(model="echo-double", messages=[{"role": "user", "content": "hi"}], n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.choices[0].message.role == "assistant"
    assert metric_name_problems(httpx.get(f"{url}/metrics").text) == []
    assert requests_total(url) == {
        "zmq_rollout_gateway_requests_total{code=200,endpoint=/health}": 1,
        "zmq_rollout_gateway_requests_total{code=200,endpoint=/v1/models}": 1,
        "zmq_rollout_gateway_requests_total{code=200,endpoint=/v1/completions}": 1,
        "zmq_rollout_gateway_requests_total{code=200,endpoint=/v1/chat/completions}": 1,
    }


def sse_data(response: httpx.Response) -> list[Any]:
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_http_streams_are_server_sent_events(start_broker: Any, start_double: Any, start_gateway: Any) -> None:
    broker = start_broker()
    start_double(broker)
    url = start_gateway(broker.frontend)
    response = httpx.post(f"{url}/v1/completions", json={"prompt": [[5, 6], [7]], "n": 2, "stream": True,
                          "return_token_ids": True, "stream_options": {"include_usage": True}})  # fmt: skip
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_data(response)
    ends = {c["choices"][0]["index"]: c["choices"][0] for c in chunks if c["choices"]}
    assert sorted(ends) == [0, 1, 2, 3]
    assert ends[2]["token_ids"] == [7] and ends[2]["prompt_token_ids"] == [7]
    assert all(e["finish_reason"] == "length" for e in ends.values())
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                                   "prompt_tokens_details": None}  # fmt: skip
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    stream = sdk.chat.completions.create(
        model="echo-double", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=3
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error  # type: ignore[no-any-return]


def test_http_errors(start_broker: Any, start_double: Any, start_gateway: Any) -> None:
    broker = start_broker(max_queue_per_client=2)
    url = start_gateway(broker.frontend)
    # no worker yet: the jobs queue, and a third is one too many for the client's queue
    busy = httpx.post(f"{url}/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
    assert error_of(busy, 429)["type"] == "Too Many Requests"
    assert busy.headers["retry-after"] == "1"
    poll_until(lambda: broker.status().queued == 0, what="the refused request's other jobs to be cancelled")
    start_double(broker)
    assert error_of(httpx.post(f"{url}/v1/completions", json={"prompt": "a", "min_p": 1.1}), 400)["param"] == "min_p"
    assert error_of(httpx.post(f"{url}/v1/completions", content=b"{"), 400)["type"] == "Bad Request"
    assert error_of(httpx.post(f"{url}/v1/completions", json={"prompt": "a", "model": "nope"}), 404)["param"] == "model"
    stream = {"prompt": "a", "stream": True, "model": "echo-double", "top_p": 0.0}
    assert error_of(httpx.post(f"{url}/v1/completions", json=stream), 400)["param"] == "top_p"
    # a prompt the broker refuses (too long for a job) is a 400 before any event, also when streamed
    long = {"prompt": "x" * (p.MAX_PROMPT_CHARS + 1), "stream": True}
    error_of(httpx.post(f"{url}/v1/completions", json=long), 400)
    counts = requests_total(url)
    assert counts["zmq_rollout_gateway_requests_total{code=400,endpoint=/v1/completions}"] == 4
    assert counts["zmq_rollout_gateway_requests_total{code=429,endpoint=/v1/completions}"] == 1


def test_http_broker_unavailable_is_503(start_gateway: Any) -> None:
    with socket.socket() as s:  # a port where no broker listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = start_gateway(f"tcp://127.0.0.1:{port}", request_timeout_s=0.3, broker_timeout_s=0.5)
    assert error_of(httpx.get(f"{url}/health", timeout=10), 503)["type"] == "Service Unavailable"
    error_of(httpx.post(f"{url}/v1/completions", json={"prompt": "a"}, timeout=10), 503)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_cancels_its_jobs(
    start_broker: Any, start_double: Any, start_gateway: Any, stream: bool
) -> None:
    broker = start_broker()
    double = start_double(broker, hold=True)
    url = start_gateway(broker.frontend)
    port = int(url.rsplit(":", 1)[1])
    payload = json.dumps({"prompt": "hello", "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        poll_until(lambda: double.received, what="the job to reach the worker")
    poll_until(lambda: double.cancelled, what="the job to be cancelled on the worker")
    assert double.cancelled == [double.received[0].ticket]
    poll_until(lambda: broker.jobs("cancelled") == 1, what="the broker to count the cancel")
    counts = requests_total(url)
    assert counts == {"zmq_rollout_gateway_requests_total{code=499,endpoint=/v1/completions}": 1}


def test_the_gateway_is_light() -> None:
    """Neither torch nor vLLM nor transformers: a gateway runs anywhere, starts at once."""
    import subprocess
    import sys

    code = (
        "import sys, zmq_rollout.gateway.app, zmq_rollout.cli;"
        "bad = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class StreamingDouble(EchoWorkerDouble):
    """Sends the first two tokens of every job, then holds it (until cancelled)."""

    def _handle(self, ctx: Any, sock: Any, msg: Any) -> Any:
        if msg.command == p.JOBS:
            self.received.extend(msg.body)
            self.held.extend(msg.body)
            deltas = [p.Delta(a.ticket, 0, [11, 12], [-0.25, -0.5]) for a in msg.body]
            sock.send_multipart(codec.encode(p.PARTIAL, deltas))
            return sock
        return super()._handle(ctx, sock, msg)


def test_a_client_that_goes_away_mid_stream_cancels_its_jobs(start_broker: Any, start_gateway: Any) -> None:
    broker = start_broker()
    double = StreamingDouble(broker.backend, heartbeat=0.05).start()
    try:
        poll_until(lambda: broker.has_worker(double.name), what="the double to register")
        url = start_gateway(broker.frontend)
        payload = {"prompt": "hello", "stream": True, "return_token_ids": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=payload) as response:
            first = next(response.iter_lines())
            assert json.loads(first.removeprefix("data: "))["choices"][0]["token_ids"] == [11, 12]
        poll_until(lambda: double.cancelled, what="the job to be cancelled on the worker")
        assert double.cancelled == [double.received[0].ticket]
        poll_until(lambda: broker.jobs("cancelled") == 1, what="the broker to count the cancel")
    finally:
        double.stop()
