"""ms-swift's rollout contract on the gateway (zmq_rollout/gateway/swift*.py): ``/infer/`` bodies
shaped exactly as ms-swift 4.6.0's ``VLLMClient`` posts them, translated with no socket; then
over HTTP (a real uvicorn on loopback) against a broker with echo worker doubles.

The swift files cited are those of the ms-swift 4.6.0 wheel (``pip download ms-swift==4.6.0``).
"""

from __future__ import annotations

import copy
import json
import socket
from typing import Any

import httpx
import pytest
from helpers import parse_samples, poll_until

from zmq_rollout import protocol as p
from zmq_rollout.gateway.openai_protocol import OpenAIError
from zmq_rollout.gateway.swift_protocol import infer_response, parse_infer
from zmq_rollout.rollouts import Rollout

# swift/rlhf_trainers/rollout_mixin.py:357-368 builds this RequestConfig for GRPO (here with the
# defaults of swift/rlhf_trainers/args_mixin.py:162-166 and swift/arguments/rlhf_args.py:258, and
# max_completion_length 64); swift/rlhf_trainers/rollout_mixin.py:1367-1369 posts
# dataclasses.asdict of it, which is every field of swift/infer_engine/protocol.py:183-219:
GRPO_REQUEST_CONFIG: dict[str, Any] = {
    "max_tokens": 64, "temperature": 0.9, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
    "num_beams": 1, "stop": [], "seed": None, "stream": False, "logprobs": True, "top_logprobs": None,
    "prompt_logprobs": None, "n": 1, "best_of": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "length_penalty": 1.0, "return_details": True, "structured_outputs_regex": None,
}  # fmt: skip


def infer_request(uuid: str, *messages: dict[str, Any]) -> dict[str, Any]:
    """dataclasses.asdict of a RolloutInferRequest (swift/infer_engine/protocol.py:44-160) as
    swift/rl_core/data.py:275-301 (to_infer_request) fills it for the server (include_extra:
    the dataset's other columns in data_dict)."""
    return {
        "messages": list(messages), "images": [], "audios": [], "videos": [], "tools": None, "objects": {},
        "chat_template_kwargs": {}, "data_dict": {"solution": "4"}, "uuid": uuid, "add_eos": None,
    }  # fmt: skip


SYSTEM = {"role": "system", "content": "Answer briefly."}
USER = {"role": "user", "content": "What is 2+2?"}


def infer_body(*requests: dict[str, Any], request_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON of swift/rlhf_trainers/vllm_client.py:166-175 (VLLMInferClient.infer)."""
    return {
        "infer_requests": list(requests),
        "request_config": dict(GRPO_REQUEST_CONFIG) if request_config is None else request_config,
        "metrics": None,
        "use_tqdm": False,
        "adapter_request": None,
    }


def grpo_body(**config: Any) -> dict[str, Any]:
    rc = {**GRPO_REQUEST_CONFIG, **config}
    return infer_body(infer_request("u0", SYSTEM, USER), infer_request("u1", USER), request_config=rc)


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


# -- /infer/ bodies into jobs (pure) --------------------------------------------------------
def test_the_grpo_trainers_body_becomes_one_chat_job_per_request() -> None:
    jobs = parse_infer(encode(grpo_body()), 1024)
    assert jobs.prompts == [
        [p.ChatMessage("system", "Answer briefly."), p.ChatMessage("user", "What is 2+2?")],
        [p.ChatMessage("user", "What is 2+2?")],
    ]
    assert jobs.sampling == p.SamplingParams(n=1, max_tokens=64, temperature=0.9, top_k=-1, top_p=1.0, min_p=0.0)
    assert jobs.ids == ["u0", "u1"]  # each response carries its request's uuid, as swift's server does
    assert (jobs.logprobs, jobs.top_logprobs, jobs.return_details) == (True, None, True)


def test_sampling_fields_map_onto_ours() -> None:
    rc = {**GRPO_REQUEST_CONFIG, "n": 3, "seed": 7, "stop": ["\n\n"], "top_k": 20, "repetition_penalty": 1.1,
          "presence_penalty": 0.5, "frequency_penalty": -0.5, "max_tokens": None, "temperature": None,
          "top_p": 0.8, "min_p": None, "logprobs": True, "top_logprobs": 3,
          "structured_outputs_regex": "[0-9]+"}  # fmt: skip
    jobs = parse_infer(encode(infer_body(infer_request("a", USER), request_config=rc)), 77)
    assert jobs.sampling == p.SamplingParams(
        n=3, seed=7, stop=["\n\n"], top_k=20, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5,
        max_tokens=77, temperature=1.0, top_p=0.8, min_p=0.0, logprobs=3,
        structured=p.StructuredOutput(regex="[0-9]+"),
    )  # fmt: skip
    assert jobs.top_logprobs == 3
    # top_logprobs without logprobs asks for nothing (swift: no logprobs at all)
    quiet = parse_infer(encode(grpo_body(logprobs=False, top_logprobs=3, return_details=False)), 8)
    assert (quiet.sampling.logprobs, quiet.logprobs, quiet.top_logprobs, quiet.return_details) == (
        0,
        False,
        None,
        False,
    )


def test_a_null_request_config_is_swifts_defaults() -> None:
    jobs = parse_infer(encode(infer_body(infer_request("a", USER), request_config={})), 99)
    assert jobs.sampling == p.SamplingParams(max_tokens=99)
    nulled = infer_body(infer_request("a", USER))
    nulled["request_config"] = None
    jobs = parse_infer(encode(nulled), 99)
    assert jobs.sampling == p.SamplingParams(max_tokens=99)
    assert (jobs.logprobs, jobs.return_details) == (False, False)


def test_messages_as_swift_reads_them() -> None:
    parts = {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}
    open_turn = {"role": "assistant", "content": None}  # swift's mark for "answer here"
    jobs = parse_infer(encode(infer_body(infer_request("a", parts, open_turn))), 8)
    assert jobs.prompts == [[p.ChatMessage("user", "What is 2+2?")]]  # text parts joined with no separator
    history = [USER, {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
    assert [m.role for m in parse_infer(encode(infer_body(infer_request("a", *history))), 8).prompts[0]] == [
        "user", "assistant", "user"
    ]  # fmt: skip
    assert parse_infer(encode(infer_body()), 8).prompts == []


def test_fields_that_change_nothing_here_are_ignored() -> None:
    body = grpo_body()
    body["use_tqdm"] = True
    body["metrics"] = []
    body["some_future_flag"] = False
    body["request_config"]["future_option"] = None
    body["infer_requests"][0].update(add_eos=True, data_dict={"x": 1}, future_field={})
    assert len(parse_infer(encode(body), 8).prompts) == 2


def refused(body: dict[str, Any]) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse_infer(encode(body), 8)
    assert info.value.status == 400
    error = info.value.body()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    return info.value


def with_request(**fields: Any) -> dict[str, Any]:
    body = grpo_body()
    body["infer_requests"][1].update(fields)
    return body


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (grpo_body(num_beams=4), "request_config.num_beams"),
        (grpo_body(best_of=3), "request_config.best_of"),
        (grpo_body(length_penalty=0.5), "request_config.length_penalty"),
        (grpo_body(stream=True), "request_config.stream"),
        (grpo_body(prompt_logprobs=5), "request_config.prompt_logprobs"),  # swift's GKD teacher asks this
        (grpo_body(top_logprobs=-1), "request_config.top_logprobs"),
        (grpo_body(top_logprobs=21), "request_config.top_logprobs"),
        (grpo_body(temperature=-1.0), "request_config.temperature"),
        (grpo_body(n=0), "request_config.n"),
        (grpo_body(max_tokens=0), "request_config.max_tokens"),
        (grpo_body(structured_outputs_regex="("), "request_config.structured_outputs_regex"),
        (grpo_body(future_option=2), "request_config.future_option"),
        (with_request(images=["data:image/png;base64,AAAA"]), "infer_requests.1.images"),
        (with_request(videos=["v.mp4"]), "infer_requests.1.videos"),
        (with_request(tools=[{"type": "function", "function": {"name": "f"}}]), "infer_requests.1.tools"),
        (with_request(chat_template_kwargs={"enable_thinking": False}), "infer_requests.1.chat_template_kwargs"),
        (with_request(future_field=1), "infer_requests.1.future_field"),
        (with_request(messages=[]), "infer_requests.1.messages"),
        (with_request(messages=[USER, {"role": "assistant", "content": "The answer is"}]),
         "infer_requests.1.messages.1"),
        (with_request(messages=[USER, {"role": "tool", "content": "4"}]), "infer_requests.1.messages.1"),
        (with_request(messages=[{"role": "user", "content": [3, 4, 5]}]), "infer_requests.1.messages.0"),
        (with_request(messages=[{"role": "user", "content": [{"type": "image", "image": "x.png"}]}]),
         "infer_requests.1.messages.0"),
        (with_request(messages=[{"content": "no role"}]), "infer_requests.1.messages.0"),
        ({**grpo_body(), "adapter_request": {"name": "a", "path": "/a"}}, "adapter_request"),
    ],
)  # fmt: skip
def test_what_would_change_the_samples_and_is_not_served_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    assert refused(body).param == param


def test_malformed_bodies_are_400s_in_vllms_shape() -> None:
    with pytest.raises(OpenAIError) as info:
        parse_infer(b"{", 8)
    assert (info.value.status, info.value.err_type) == (400, "Bad Request")
    assert refused(grpo_body(n="many")).param == "body.request_config.n"
    assert refused({"request_config": GRPO_REQUEST_CONFIG}).param == "body.infer_requests"


# -- rollouts into RolloutOutputs (pure) ------------------------------------------------------
def rollout(prompt_index: int, index: int, **fields: Any) -> Rollout:
    values: dict[str, Any] = {
        "job_id": f"j{prompt_index}", "prompt_index": prompt_index, "index": index, "prompt_token_ids": [1, 2, 3],
        "token_ids": [7, 8], "logprobs": [-0.5, -float("inf")], "finish_reason": "stop", "weight_version": 4,
        "worker_id": "w", "text": f"answer {prompt_index}.{index}",
    }  # fmt: skip
    values.update(fields)
    return Rollout(**values)


# Field names of swift/infer_engine/protocol.py: ChatCompletionResponse (468-477), its choices
# (428-434), ChatMessage (420-424), RolloutOutput (494-530). swift's VLLMClient validates each item
# as a RolloutOutput (swift/rlhf_trainers/vllm_client.py:184-188); pydantic drops unknown keys.
RESPONSE_FIELDS = {"model", "choices", "usage", "id", "object", "created", "prompt_token_ids", "prompt_logprobs",
                   "images_size"}  # fmt: skip
CHOICE_FIELDS = {"index", "message", "finish_reason", "logprobs", "token_ids", "routed_experts"}
OUTPUT_FIELDS = {"response", "messages", "response_token_ids", "response_loss_mask", "rollout_infos",
                 "rollout_logprobs", "prompt_logprobs"}  # fmt: skip


def test_outputs_have_swifts_shape_one_per_request_in_order() -> None:
    jobs = parse_infer(encode(grpo_body(n=2)), 8)
    tops = [{9: -0.1, 7: -0.5, 5: -float("inf")}, {9: -0.2}]
    rollouts = [rollout(0, 0), rollout(0, 1, top_logprobs=tops, weight_versions=[3, 4]), rollout(1, 0),
                rollout(1, 1)]  # fmt: skip
    answer = infer_response(list(reversed(rollouts)), "tiny", jobs)
    assert [set(o) for o in answer] == [OUTPUT_FIELDS] * 2
    assert [o["response"]["id"] for o in answer] == ["u0", "u1"]
    response = answer[0]["response"]
    assert set(response) == RESPONSE_FIELDS
    assert (response["model"], response["object"], response["prompt_token_ids"]) == (
        "tiny",
        "chat.completion",
        [1, 2, 3],
    )
    assert response["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    first, second = response["choices"]
    assert set(first) == CHOICE_FIELDS | {"weight_version"}  # our extension
    assert second["weight_versions"] == [3, 4] and second["weight_version"] == 4
    assert [c["index"] for c in response["choices"]] == [0, 1]
    assert first["message"] == {"role": "assistant", "content": "answer 0.0", "tool_calls": None,
                                "reasoning_content": None}  # fmt: skip
    assert (first["finish_reason"], first["token_ids"], first["routed_experts"]) == ("stop", [7, 8], None)
    content = first["logprobs"]["content"]
    assert content[0] == {"token": "token_id:7", "logprob": -0.5, "bytes": list(b"token_id:7")}
    assert content[1]["logprob"] == -9999.0  # -inf clamped (JSON has none), as the rest of the gateway
    # the multi-turn fields stay empty, as swift's single-turn server leaves them: its trainer
    # then reads choices[0].token_ids and .logprobs (swift/rl_core/data.py:223-234)
    assert (answer[0]["messages"], answer[0]["response_token_ids"], answer[0]["rollout_logprobs"]) == (None, [], [])


def test_top_logprobs_ranked_as_swift_ranks_them() -> None:
    jobs = parse_infer(encode(grpo_body(top_logprobs=2)), 8)
    tops = [{9: -0.1, 5: -2.0}, {9: -0.2, 6: -float("inf")}]
    (output,) = infer_response([rollout(0, 0, top_logprobs=tops)], "m", jobs)[:1]
    content = output["response"]["choices"][0]["logprobs"]["content"]
    # the sampled token among the top ones, best first, cut at top_logprobs, -inf left out
    assert [(t["token"], t["logprob"]) for t in content[0]["top_logprobs"]] == [("token_id:9", -0.1),
                                                                               ("token_id:7", -0.5)]  # fmt: skip
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["token_id:9"]
    no_tops = parse_infer(encode(grpo_body()), 8)  # top_logprobs null: no list at all
    choice = infer_response([rollout(0, 0)], "m", no_tops)[0]["response"]["choices"][0]
    assert "top_logprobs" not in choice["logprobs"]["content"][0]


def test_without_details_or_logprobs_the_response_has_neither() -> None:
    jobs = parse_infer(encode(grpo_body(return_details=False, logprobs=False)), 8)
    response = infer_response([rollout(0, 0), rollout(1, 0)], "m", jobs)[0]["response"]
    assert response["prompt_token_ids"] is None
    assert (response["choices"][0]["token_ids"], response["choices"][0]["logprobs"]) == (None, None)
    empty = infer_response([rollout(0, 0, token_ids=[], logprobs=[])], "m", parse_infer(encode(grpo_body()), 8))
    assert empty[0]["response"]["choices"][0]["logprobs"] is None  # swift: no tokens, no logprobs


# -- over HTTP, against echo worker doubles ---------------------------------------------------
def requests_total(url: str) -> dict[str, float]:
    samples = parse_samples(httpx.get(f"{url}/metrics").text)
    prefix = "zmq_rollout_gateway_requests_total"
    return {k[len(prefix) :]: v for k, v in samples.items() if k.startswith(prefix)}


def test_http_infer_against_echo_doubles(start_broker: Any, start_double: Any, start_gateway: Any) -> None:
    broker = start_broker()
    double = start_double(broker)
    url = start_gateway(broker.frontend)
    body = grpo_body(n=2, seed=5)
    response = httpx.post(f"{url}/infer/", json=body)
    assert response.status_code == 200, response.text
    outputs = response.json()
    assert [o["response"]["id"] for o in outputs] == ["u0", "u1"]
    assert [len(o["response"]["choices"]) for o in outputs] == [2, 2]
    choice = outputs[0]["response"]["choices"][1]
    assert (choice["index"], choice["token_ids"], choice["finish_reason"], choice["weight_version"]) == (
        1,
        [0],
        "length",
        0,
    )  # fmt: skip  (the double echoes a messages job's prompt as [0])
    assert choice["logprobs"]["content"] == [{"token": "token_id:0", "logprob": 0.0, "bytes": list(b"token_id:0")}]
    assert outputs[0]["response"]["model"] == "echo-double"
    # what reached the worker: the chat, and the sampling the request_config asked for
    jobs = sorted((a.job for a in double.received), key=lambda j: len(j.messages or []))
    assert [j.messages for j in jobs] == [[p.ChatMessage("user", "What is 2+2?")],
                                          [p.ChatMessage("system", "Answer briefly."),
                                           p.ChatMessage("user", "What is 2+2?")]]  # fmt: skip
    assert [j.sampling for j in jobs] == [p.SamplingParams(n=2, seed=5, max_tokens=64, temperature=0.9)] * 2
    assert httpx.post(f"{url}/infer/", json=infer_body()).json() == []


def test_http_info_endpoints_and_what_swifts_client_calls_first(
    start_broker: Any, start_double: Any, start_gateway: Any
) -> None:
    broker = start_broker()
    start_double(broker)
    url = start_gateway(broker.frontend)
    # VLLMClient.__init__ polls /health (swift/rlhf_trainers/vllm_client.py:112); swift's server
    # also serves /health/ (swift/pipelines/infer/rollout.py:764-765)
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/health/").json() == {"status": "ok"}
    assert httpx.get(f"{url}/get_world_size/").json() == {"world_size": 1}
    # POST, as swift/rlhf_trainers/vllm_client.py:524 calls it
    assert httpx.post(f"{url}/get_engine_type/").json() == {
        "engine_type": "AsyncLLMEngine", "enable_multi_turn": False, "use_gym_env": False, "enable_lora": False,
    }  # fmt: skip
    for path in ("/reset_prefix_cache/", "/reset_encoder_cache/", "/reset_mm_cache/", "/close_communicator/"):
        answer = httpx.post(f"{url}{path}")
        assert answer.status_code == 200 and answer.json()["message"].startswith("Request received"), path
    # the NCCL weight sync: 501, saying what to use instead (the body init_communicator posts,
    # swift/rlhf_trainers/vllm_client.py:240-246)
    init = httpx.post(f"{url}/init_communicator/", json={"host": "0.0.0.0", "port": 51216, "world_size": 2})
    error = init.json()["error"]
    assert (init.status_code, error["code"], error["type"]) == (501, 501, "Not Implemented")
    assert "update_weights" in error["message"] and "docs/integrations.md" in error["message"]
    for method, path in [("POST", "/update_named_param/"), ("POST", "/update_flattened_params/"),
                         ("POST", "/update_adapter_param/"), ("POST", "/update_adapter_flattened_param/"),
                         ("POST", "/process_weights_after_loading/"), ("GET", "/get_model_state_keys/")]:  # fmt: skip
        assert httpx.request(method, f"{url}{path}", json={}).status_code == 501, path
    counts = requests_total(url)
    assert counts["{code=501,endpoint=/init_communicator/}"] == 1
    assert counts["{code=200,endpoint=/get_engine_type/}"] == 1
    assert counts["{code=200,endpoint=/health/}"] == 1


def test_http_errors_are_vllm_shaped(start_broker: Any, start_double: Any, start_gateway: Any) -> None:
    broker = start_broker()
    start_double(broker)
    url = start_gateway(broker.frontend)
    body = grpo_body()
    body["infer_requests"][0]["images"] = ["x.png"]
    response = httpx.post(f"{url}/infer/", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "infer_requests.0.images"
    assert httpx.post(f"{url}/infer/", content=b"{").status_code == 400
    too_many_messages = infer_body(infer_request("a", *[USER] * (p.MAX_MESSAGES + 1)))
    too_many = httpx.post(f"{url}/infer/", json=too_many_messages)  # a job the client refuses (InvalidRequestError)
    assert too_many.status_code == 400 and "messages" in too_many.json()["error"]["message"]
    assert requests_total(url)["{code=400,endpoint=/infer/}"] == 3


def test_http_broker_unavailable_is_503(start_gateway: Any) -> None:
    with socket.socket() as s:  # a port where no broker listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = start_gateway(f"tcp://127.0.0.1:{port}", request_timeout_s=0.3, broker_timeout_s=0.5)
    assert httpx.get(f"{url}/health/", timeout=10).status_code == 503
    assert httpx.get(f"{url}/get_world_size/", timeout=10).status_code == 503


def test_a_trainer_that_goes_away_cancels_its_jobs(start_broker: Any, start_double: Any, start_gateway: Any) -> None:
    broker = start_broker()
    double = start_double(broker, hold=True)
    url = start_gateway(broker.frontend)
    port = int(url.rsplit(":", 1)[1])
    payload = json.dumps(copy.deepcopy(grpo_body())).encode()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(
            b"POST /infer/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        poll_until(lambda: len(double.received) == 2, what="both jobs to reach the worker")
    poll_until(lambda: len(double.cancelled) == 2, what="both jobs to be cancelled on the worker")
    assert sorted(double.cancelled) == sorted(a.ticket for a in double.received)
    poll_until(lambda: requests_total(url).get("{code=499,endpoint=/infer/}") == 1, what="the 499 to be counted")
