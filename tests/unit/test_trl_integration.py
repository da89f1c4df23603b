"""``zmq_rollout.integrations.trl`` against echo worker doubles: TRL's shapes, one round per step, ``use()``.

The real ``GRPOTrainer`` run is tests/integration/test_trl_grpo.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from zmq_rollout import protocol as p
from zmq_rollout.errors import ConfigError
from zmq_rollout.integrations import trl as ours
from zmq_rollout.integrations.trl_shapes import chat_messages, sampling_params, trl_output
from zmq_rollout.rollouts import Rollout

DEFAULTS: dict[str, Any] = {
    "n": 1,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "max_tokens": 16,
    "logprobs": 0,
    "structured_outputs_regex": None,
    "generation_kwargs": None,
}


def rollout(prompt: list[int], index: int, tokens: list[int], logprobs: list[float], **kw: Any) -> Rollout:
    return Rollout("j", 0, index, prompt, tokens, logprobs, "length", 3, "w", **kw)


@pytest.fixture
def client_for(start_broker: Any, start_double: Any) -> Iterator[Any]:
    """``client_for(num_doubles)``: a broker, that many echo doubles, and our VLLMClient on it."""
    made: list[ours.VLLMClient] = []

    def make(num_doubles: int = 2, **kwargs: Any) -> tuple[ours.VLLMClient, list[Any]]:
        broker = start_broker()
        doubles = [start_double(broker) for _ in range(num_doubles)]
        client = ours.VLLMClient(base_url=broker.frontend, **kwargs)
        made.append(client)
        return client, doubles

    yield make
    for client in made:
        client.close()
    ours.restore()


# -- pure ----------------------------------------------------------------------------------


def test_output_is_prompt_major_with_one_logprob_per_token_as_trl() -> None:
    rollouts = [
        rollout([1, 2], 0, [5, 6], [-0.5, -1.0]),
        rollout([1, 2], 1, [7], [float("nan")]),
        rollout([3], 0, [8], [-0.1]),
        rollout([3], 1, [9, 9], [-0.2, -0.3]),
    ]
    out = trl_output(rollouts, n=2, logprobs=0)
    assert out == {
        "prompt_ids": [[1, 2], [3]],
        "completion_ids": [[5, 6], [7], [8], [9, 9]],
        "logprobs": [[[-0.5], [-1.0]], [[None]], [[-0.1]], [[-0.2], [-0.3]]],
        "logprob_token_ids": [[[5], [6]], [[7]], [[8]], [[9], [9]]],
    }
    assert trl_output(rollouts, n=2, logprobs=None)["logprobs"] is None


def test_top_logprobs_are_sorted_with_the_sampled_token_included() -> None:
    r = rollout([1], 0, [5, 6], [-2.0, -0.1], top_logprobs=[{4: -0.3, 5: -2.0}, {6: -0.1, 2: -1.5}])
    out = trl_output([r], n=1, logprobs=1)
    assert out["logprobs"] == [[[-0.3, -2.0], [-0.1, -1.5]]]
    assert out["logprob_token_ids"] == [[[4, 5], [6, 2]]]


def test_sampling_params_map_trl_arguments() -> None:
    params = sampling_params(**{**DEFAULTS, "n": 4, "top_k": 0, "max_tokens": 8, "generation_kwargs": {"seed": 7}})
    assert (params.n, params.top_k, params.max_tokens, params.seed, params.logprobs) == (4, -1, 8, 7, 0)
    assert sampling_params(**{**DEFAULTS, "generation_kwargs": {"top_k": 5}}).top_k == 5
    with pytest.raises(ValueError, match="best_of"):
        sampling_params(**{**DEFAULTS, "generation_kwargs": {"best_of": 2}})
    with pytest.raises(ValueError, match="top_p"):
        sampling_params(**{**DEFAULTS, "top_p": 0.0})


def test_chat_messages_take_strings_and_text_parts_only() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert chat_messages([{"role": "user", "content": parts}]) == [p.ChatMessage("user", "a\nb")]
    with pytest.raises(ValueError, match="text content only"):
        chat_messages([{"role": "user", "content": [{"type": "image", "image": None}]}])


def test_without_a_broker_address_it_says_how_to_give_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ours.BROKER_ENV, raising=False)
    with pytest.raises(ConfigError, match="ZMQ_ROLLOUT_BROKER"):
        ours.VLLMClient(base_url="http://0.0.0.0:8000")


# -- against echo doubles ------------------------------------------------------------------


def test_generate_returns_trls_shapes(client_for: Any) -> None:
    client, _ = client_for(2)
    assert client.get_world_size() == 2
    assert client.get_server_info()["model_config"]["logprobs_mode"] == "processed_logprobs"
    out = client.generate([[1, 2, 3], [4, 5]], n=3, max_tokens=4)
    assert out["prompt_ids"] == [[1, 2, 3], [4, 5]]
    assert out["completion_ids"] == [[1, 2, 3]] * 3 + [[4, 5]] * 3  # the doubles echo the prompt
    assert out["logprobs"] == [[[0.0]] * 3] * 3 + [[[0.0]] * 2] * 3
    assert out["logprob_token_ids"] == [[[1], [2], [3]]] * 3 + [[[4], [5]]] * 3
    chat = client.chat([[{"role": "user", "content": "hi"}]], n=2)
    assert len(chat["prompt_ids"]) == 1 and len(chat["completion_ids"]) == 2


def test_a_step_of_per_tensor_updates_is_one_round_at_reset_prefix_cache(client_for: Any) -> None:
    client, doubles = client_for(2)
    model = torch.nn.Linear(4, 3)
    client.init_communicator(device="cpu")
    for step in (1, 2):
        for name, param in model.named_parameters():
            client.update_named_param(name, param.data)
        assert len(client.syncs) == step - 1  # held, not sent per tensor
        client.reset_prefix_cache()
        assert [s.version for s in client.syncs] == list(range(1, step + 1))
        report = client.syncs[-1]
        assert report.transport == "shm" and sorted(report.workers_updated) == sorted(d.name for d in doubles)
        assert report.bytes >= (4 * 3 + 3) * 4
        client.generate([[1, 2]], n=2)
        assert client.generations[-1] == ours.Generation(step, [step], 2)
    client.reset_prefix_cache()  # nothing held: no round
    assert len(client.syncs) == 2


def test_trls_whole_model_call_and_weight_update_block_are_one_round_each(client_for: Any) -> None:
    client, _ = client_for(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    metadata = [(n, "float32", list(t.shape)) for n, t in model.named_parameters()]
    client.update_named_params(metadata, ((n, t.data) for n, t in model.named_parameters()))
    assert not client.syncs
    client.reset_prefix_cache()
    with client.weight_update():
        for name, param in model.named_parameters():
            client.update_named_param(name, param.data)
        client.reset_prefix_cache()  # inside the block: still held
        assert len(client.syncs) == 1
    client.update_model_params(model)
    assert [s.version for s in client.syncs] == [1, 2, 3]


def test_held_weights_go_before_the_next_generation(client_for: Any) -> None:
    client, _ = client_for(1)
    client.update_named_param("w", torch.ones(2))
    client.generate(["x"])
    assert [s.version for s in client.syncs] == [1]
    assert client.generations[-1].weight_versions == [1]


def test_use_has_trl_build_ours_with_the_broker_given(start_broker: Any, start_double: Any) -> None:
    from trl.generation import vllm_client, vllm_generation

    theirs = vllm_generation.VLLMClient
    broker = start_broker()
    start_double(broker)
    try:
        assert ours.use(broker=broker.frontend) is ours.VLLMClient
        assert vllm_generation.VLLMClient is ours.VLLMClient is vllm_client.VLLMClient
        # as TRL's VLLMGeneration builds it in server mode
        client = vllm_generation.VLLMClient(base_url="http://0.0.0.0:8000", group_port=51216, connection_timeout=5.0)
        try:
            assert client.broker == broker.frontend
            assert client.generate(["abc"])["prompt_ids"] == [[3]]
        finally:
            client.close()
    finally:
        ours.restore()
    assert vllm_generation.VLLMClient is theirs is vllm_client.VLLMClient


def test_check_server_fails_with_connection_error_when_no_worker_joins(start_broker: Any) -> None:
    broker = start_broker()
    with pytest.raises(ConnectionError, match="no worker yet"):
        ours.VLLMClient(broker=broker.frontend, connection_timeout=0.0)


class _OnCuda:
    """Stands in for a CUDA tensor (this tier has no GPU): only what the client looks at."""

    is_cuda = True

    def detach(self) -> _OnCuda:
        return self


def test_the_transport_follows_the_tensors_device_unless_given(client_for: Any) -> None:
    client, _ = client_for(1)
    asked: list[str] = []
    real = client._client.update_weights

    def recording(source: Any, **kwargs: Any) -> Any:
        asked.append(kwargs["transport"])
        if kwargs["transport"] != "shm":  # no GPU, no peer to join a group here: stop first
            raise RuntimeError("stop")
        return real(source, **kwargs)

    client._client.update_weights = recording
    client.update_named_param("w", torch.ones(2))
    client.reset_prefix_cache()
    client.update_named_param("w", _OnCuda())
    with pytest.raises(RuntimeError, match="stop"):
        client.reset_prefix_cache()
    client.transport = "gloo"
    client.update_named_param("w", torch.ones(2))
    with pytest.raises(RuntimeError, match="stop"):
        client.reset_prefix_cache()
    assert asked == ["shm", "cuda_ipc", "gloo"]
    assert [s.transport for s in client.syncs] == ["shm"]
