"""The OpenAI gateway in front of a REAL vLLM CPU worker (one, the tiny model): the official
``openai`` SDK and TRL's ``VLLMClient`` parse its answers unchanged, its responses validate as
vLLM's own response models, and seeded completions through it are token-identical to the
Python client's for the same request."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from helpers import local_cluster, running_gateway

from zmq_rollout import RolloutClient, SamplingParams
from zmq_rollout.local import LocalCluster

PROMPTS = [[3, 17, 42, 99, 120], [5, 6, 7], [200, 100, 50, 25]]
SEED = 1234


@pytest.fixture(scope="module")
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tiny_model, tmp_path_factory.mktemp("logs"), 1, worker_liveness=20) as c:
        yield c


@pytest.fixture(scope="module")
def gateway(cluster: LocalCluster) -> Iterator[str]:
    with running_gateway(cluster.address, timeout_s=300) as url:
        yield url


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[RolloutClient]:
    with RolloutClient(cluster.address, timeout_s=300) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(sdk: openai.OpenAI, cluster: LocalCluster) -> str:
    (card,) = sdk.models.list().data
    assert card.id == cluster.model
    return card.id


def test_seeded_completions_equal_the_python_clients(sdk: openai.OpenAI, model: str, client: RolloutClient) -> None:
    prompts: list[Any] = [*PROMPTS, "The gateway says"]
    for prompt in prompts:  # one request per prompt, and one batch below: both are prompt-major
        answer = sdk.completions.create(model=model, prompt=prompt, n=2, max_tokens=12, seed=SEED, logprobs=2,
                                        extra_body={"return_token_ids": True})  # fmt: skip
        rollouts = client.generate([prompt], SamplingParams(n=2, max_tokens=12, seed=SEED, logprobs=2))
        for choice, r in zip(answer.choices, rollouts, strict=True):
            extra = choice.model_extra or {}
            assert extra["token_ids"] == r.token_ids
            assert extra["prompt_token_ids"] == r.prompt_token_ids
            assert choice.text == r.text
            assert choice.finish_reason == r.finish_reason
            assert choice.logprobs.tokens == [f"token_id:{t}" for t in r.token_ids]
            assert choice.logprobs.token_logprobs == pytest.approx(r.logprobs, abs=1e-3)
            assert all(2 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)  # sampled + top 2
            assert extra["weight_version"] == r.weight_version
    batch = sdk.completions.create(model=model, prompt=PROMPTS, n=2, max_tokens=12, seed=SEED,
                                   extra_body={"return_token_ids": True})  # fmt: skip
    rollouts = client.generate(PROMPTS, SamplingParams(n=2, max_tokens=12, seed=SEED))
    assert [(c.model_extra or {})["token_ids"] for c in batch.choices] == [r.token_ids for r in rollouts]
    assert batch.usage.completion_tokens == sum(len(r.token_ids) for r in rollouts)


def test_chat_through_the_sdk(sdk: openai.OpenAI, model: str, client: RolloutClient) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    chat = sdk.chat.completions.create(model=model, messages=messages, n=2, max_completion_tokens=10, seed=SEED,
                                       logprobs=True, top_logprobs=2,
                                       extra_body={"return_token_ids": True})  # fmt: skip
    rollouts = client.generate([messages], SamplingParams(n=2, max_tokens=10, seed=SEED, logprobs=2))
    assert [c.message.content for c in chat.choices] == [r.text for r in rollouts]
    assert [(c.model_extra or {})["token_ids"] for c in chat.choices] == [r.token_ids for r in rollouts]
    assert (chat.model_extra or {})["prompt_token_ids"] == rollouts[0].prompt_token_ids
    assert [len(c.logprobs.content[0].top_logprobs) for c in chat.choices] == [2, 2]


def test_streams_add_up_to_the_response(sdk: openai.OpenAI, model: str) -> None:
    whole = sdk.completions.create(model=model, prompt=PROMPTS[:2], n=2, max_tokens=12, seed=SEED,
                                   extra_body={"return_token_ids": True})  # fmt: skip
    stream = sdk.completions.create(model=model, prompt=PROMPTS[:2], n=2, max_tokens=12, seed=SEED, stream=True,
                                    logprobs=0, extra_body={"return_token_ids": True})  # fmt: skip
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    num_chunks = early_text = 0
    for chunk in stream:
        num_chunks += 1
        for c in chunk.choices:
            tokens.setdefault(c.index, []).extend((c.model_extra or {})["token_ids"])
            texts[c.index] = texts.get(c.index, "") + c.text
            early_text += bool(c.text) and c.finish_reason is None
    assert num_chunks > 4  # tokens arrived in more than one chunk per choice
    assert early_text > 0  # text comes as the tokens do, not all in the last chunk
    assert [tokens[c.index] for c in whole.choices] == [(c.model_extra or {})["token_ids"] for c in whole.choices]
    assert [texts[c.index] for c in whole.choices] == [c.text for c in whole.choices]
    messages = [{"role": "user", "content": "hello"}]
    chat = sdk.chat.completions.create(model=model, messages=messages, max_tokens=8, seed=SEED)
    content = "".join(
        c.choices[0].delta.content or ""
        for c in sdk.chat.completions.create(model=model, messages=messages, max_tokens=8, seed=SEED, stream=True)
    )
    assert content == chat.choices[0].message.content


def test_responses_validate_as_vllms_models(gateway: str, model: str) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionStreamResponse,
    )
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionStreamResponse
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse, ModelList

    def post(path: str, **fields: Any) -> httpx.Response:
        return httpx.post(f"{gateway}/v1/{path}", json={"model": model, **fields}, timeout=300)

    ModelList.model_validate(httpx.get(f"{gateway}/v1/models").json())
    answer = post("completions", prompt=PROMPTS[0], n=2, max_tokens=6, logprobs=1, return_token_ids=True).json()
    assert CompletionResponse.model_validate(answer).choices[1].token_ids == answer["choices"][1]["token_ids"]
    chat = post("chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=6, logprobs=True,
                top_logprobs=1, return_token_ids=True).json()  # fmt: skip
    ChatCompletionResponse.model_validate(chat)
    for path, shape, fields in [
        ("completions", CompletionStreamResponse, {"prompt": PROMPTS[1]}),
        ("chat/completions", ChatCompletionStreamResponse, {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        lines = post(path, **fields, max_tokens=6, stream=True, return_token_ids=True).text.strip().split("\n\n")
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            shape.model_validate(json.loads(line.removeprefix("data: ")))
    # a prompt too long for the worker's max_model_len (1024): the worker refuses it, a 400
    refused = post("completions", prompt=PROMPTS[0], max_tokens=2000)
    assert refused.status_code == 400
    assert ErrorResponse.model_validate(refused.json()).error.code == 400
    assert "max_model_len" in refused.json()["error"]["message"]


def test_trls_vllm_client(gateway: str, client: RolloutClient) -> None:
    from trl.generation import vllm_client  # TRL is in the dev extra: a missing one fails here, not skips

    trl = vllm_client.VLLMClient(base_url=gateway)
    got = trl.generate(PROMPTS, n=2, max_tokens=8, logprobs=1, generation_kwargs={"seed": SEED})
    rollouts = client.generate(PROMPTS, SamplingParams(n=2, max_tokens=8, seed=SEED, logprobs=1))
    assert got["prompt_ids"] == PROMPTS
    assert got["completion_ids"] == [r.token_ids for r in rollouts]
    for per_token, ids, r in zip(got["logprobs"], got["logprob_token_ids"], rollouts, strict=True):
        assert all(1 <= len(i) <= 2 for i in ids)  # the sampled token and the top 1
        assert [lp[i.index(t)] for lp, i, t in zip(per_token, ids, r.token_ids, strict=True)] == pytest.approx(
            r.logprobs, abs=1e-3
        )
    chat = trl.chat([[{"role": "user", "content": "hi"}]], n=2, max_tokens=6, generation_kwargs={"seed": SEED})
    rollouts = client.generate([[{"role": "user", "content": "hi"}]], SamplingParams(n=2, max_tokens=6, seed=SEED))
    assert chat["completion_ids"] == [r.token_ids for r in rollouts]
    assert chat["prompt_ids"] == [rollouts[0].prompt_token_ids]
