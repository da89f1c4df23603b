"""ms-swift's rollout contract on the gateway in front of a REAL vLLM CPU worker (one, the tiny
model): ``/infer/`` bodies shaped as ms-swift 4.6.0's ``VLLMClient`` posts them give, for the
same seeded request, the token ids, text and logprobs the Python client gets."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import local_cluster, running_gateway

from zmq_rollout import RolloutClient, SamplingParams
from zmq_rollout.local import LocalCluster

SEED = 4321
CHATS: list[list[dict[str, str]]] = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Name a colour."}],
]
# every field of ms-swift 4.6.0's RequestConfig (swift/infer_engine/protocol.py:183-219), as
# dataclasses.asdict writes it for VLLMClient.infer (swift/rlhf_trainers/vllm_client.py:158-159)
REQUEST_CONFIG: dict[str, Any] = {
    "max_tokens": 12, "temperature": 1.0, "top_k": None, "top_p": None, "min_p": None, "repetition_penalty": None,
    "num_beams": 1, "stop": [], "seed": SEED, "stream": False, "logprobs": True, "top_logprobs": 2,
    "prompt_logprobs": None, "n": 2, "best_of": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "length_penalty": 1.0, "return_details": True, "structured_outputs_regex": None,
}  # fmt: skip


def infer_body(chats: list[list[dict[str, str]]], **config: Any) -> dict[str, Any]:
    """VLLMClient.infer's JSON (swift/rlhf_trainers/vllm_client.py:166-175) with asdict of a
    RolloutInferRequest per chat (swift/infer_engine/protocol.py:44-160)."""
    requests = [
        {"messages": chat, "images": [], "audios": [], "videos": [], "tools": None, "objects": {},
         "chat_template_kwargs": {}, "data_dict": {}, "uuid": f"req-{i}", "add_eos": None}
        for i, chat in enumerate(chats)
    ]  # fmt: skip
    return {"infer_requests": requests, "request_config": {**REQUEST_CONFIG, **config}, "metrics": None,
            "use_tqdm": False, "adapter_request": None}  # fmt: skip


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


def infer(gateway: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gateway}/infer/", json=body, timeout=300)


def test_seeded_infer_equals_the_python_clients(gateway: str, client: RolloutClient, cluster: LocalCluster) -> None:
    response = infer(gateway, infer_body(CHATS))
    assert response.status_code == 200, response.text
    outputs = response.json()
    rollouts = client.generate(CHATS, SamplingParams(n=2, max_tokens=12, seed=SEED, logprobs=2))
    assert [o["response"]["id"] for o in outputs] == ["req-0", "req-1"]
    for i, output in enumerate(outputs):
        answer = output["response"]
        mine = [r for r in rollouts if r.prompt_index == i]
        assert answer["model"] == cluster.model
        assert answer["prompt_token_ids"] == mine[0].prompt_token_ids
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        assert [c["token_ids"] for c in answer["choices"]] == [r.token_ids for r in mine]
        assert [c["message"]["content"] for c in answer["choices"]] == [r.text for r in mine]
        assert [c["finish_reason"] for c in answer["choices"]] == [r.finish_reason for r in mine]
        assert [c["weight_version"] for c in answer["choices"]] == [r.weight_version for r in mine]
        for choice, r in zip(answer["choices"], mine, strict=True):
            content = choice["logprobs"]["content"]
            assert [e["token"] for e in content] == [f"token_id:{t}" for t in r.token_ids]
            assert [e["logprob"] for e in content] == pytest.approx(r.logprobs, abs=1e-3)
            assert all(1 <= len(e["top_logprobs"]) <= 2 for e in content)  # best 2 of sampled + top 2
        assert answer["usage"]["completion_tokens"] == sum(len(r.token_ids) for r in mine)


def test_the_grpo_trainers_request_and_a_regex(gateway: str) -> None:
    # GRPO's RequestConfig (swift/rlhf_trainers/rollout_mixin.py:357-368): n=1, no seed, no top list
    body = infer_body(CHATS, n=1, seed=None, top_logprobs=None, temperature=0.9, top_k=-1, top_p=1.0, min_p=0.0,
                      repetition_penalty=1.0)  # fmt: skip
    outputs = infer(gateway, body).json()
    for output in outputs:
        (choice,) = output["response"]["choices"]
        assert 1 <= len(choice["token_ids"]) <= 12 and choice["finish_reason"] in ("stop", "length")
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
        assert "top_logprobs" not in choice["logprobs"]["content"][0]
    constrained = infer(gateway, infer_body(CHATS[:1], n=1, structured_outputs_regex="[0-9]{3}")).json()
    assert re.fullmatch("[0-9]{3}", constrained[0]["response"]["choices"][0]["message"]["content"])


def test_a_request_the_worker_refuses_is_a_400(gateway: str) -> None:
    refused = infer(gateway, infer_body(CHATS[:1], max_tokens=2000))  # beyond max_model_len (1024)
    assert refused.status_code == 400
    assert "max_model_len" in refused.json()["error"]["message"]
