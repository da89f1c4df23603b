"""TRL's own ``GRPOTrainer`` (``vllm_mode="server"``) trains through our broker and two real vLLM CPU workers.

The only change to a TRL script is ``zmq_rollout.integrations.trl.use(broker=...)``; the rest
is plain TRL 1.16 on CPU (``use_cpu=True``, no bf16, ``report_to="none"``). The client TRL
builds records every sync round and every generation, which the test checks: one round per
step (not one per tensor), each step's samples from the weights synced just before it, on
both workers; the logprobs TRL got have its shape (one ``[logprob]`` per completion token,
with the token's id beside it); the loss is finite.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from zmq_rollout.local import LocalCluster
from zmq_rollout.tiny_model import make_tiny_model

STEPS = 4
PROMPTS_PER_STEP = 2
GROUP = 4  # num_generations
COMPLETION_TOKENS = 8


def ascii_fraction(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """Reward: the fraction of the completion's bytes that are ASCII (token id == byte value).

    About half of a random model's tokens, so the samples of a group differ and every step
    has advantages, gradients and new weights to sync (``examples/grpo_tiny.py``'s ``a``
    is too rare for 8 tokens: every reward would be 0 and nothing would train)."""
    return [sum(t < 128 for t in ids) / max(1, len(ids)) for ids in completion_ids]


@pytest.fixture
def trl_client_class() -> Any:
    from zmq_rollout.integrations import trl as ours

    yield ours
    ours.restore()


def test_grpo_trainer_in_server_mode_trains_through_the_broker(tmp_path: Path, trl_client_class: Any) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation import vllm_generation

    path = str(make_tiny_model(tmp_path / "tiny-qwen2", dtype="float32"))
    dataset = Dataset.from_dict({"prompt": [f"Prompt {i}: say a" for i in range(PROMPTS_PER_STEP * STEPS)]})
    with LocalCluster(path, num_workers=2, log_dir=str(tmp_path)) as cluster:
        trl_client_class.use(broker=cluster.address)  # the one line
        assert vllm_generation.VLLMClient is trl_client_class.VLLMClient

        config = GRPOConfig(
            output_dir=str(tmp_path / "out"),
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            dataloader_pin_memory=False,
            max_steps=STEPS,
            learning_rate=5e-3,
            per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
            num_generations=GROUP,
            max_completion_length=COMPLETION_TOKENS,
            logging_steps=1,
            seed=0,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_timeout=60,
        )
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
        trainer = GRPOTrainer(
            model=model, reward_funcs=ascii_fraction, args=config, train_dataset=dataset, processing_class=tokenizer
        )
        client = trainer.vllm_generation.vllm_client
        assert isinstance(client, trl_client_class.VLLMClient)

        seen: list[dict[str, Any]] = []
        generate = client.generate

        def recording_generate(*args: Any, **kwargs: Any) -> dict[str, Any]:
            out = generate(*args, **kwargs)
            seen.append(out)
            return out

        client.generate = recording_generate
        trainer.train()
        fleet = cluster.status()

    # one round per step, each to the next version, reaching both workers, none lost
    assert [s.version for s in client.syncs] == list(range(1, STEPS + 1))
    for report in client.syncs:
        assert report.transport == "shm"
        assert len(report.workers_updated) == 2 and not report.workers_evicted
        assert report.bytes >= sum(p.numel() * p.element_size() for p in model.parameters())
    assert fleet.fleet_version == STEPS

    # every step sampled from the weights synced just before it
    assert [(g.synced_version, g.weight_versions) for g in client.generations] == [
        (v, [v]) for v in range(1, STEPS + 1)
    ]
    assert all(g.num_samples == PROMPTS_PER_STEP * GROUP for g in client.generations)

    # what TRL received: prompt-major, one [logprob] per completion token, its id beside it
    assert len(seen) == STEPS
    for out in seen:
        assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "logprob_token_ids"}
        assert len(out["prompt_ids"]) == PROMPTS_PER_STEP
        assert len(out["completion_ids"]) == len(out["logprobs"]) == PROMPTS_PER_STEP * GROUP
        for ids, lps, lp_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"], strict=True):
            assert 0 < len(ids) <= COMPLETION_TOKENS
            assert [len(x) for x in lps] == [1] * len(ids)
            assert all(isinstance(x[0], float) and x[0] <= 0.0 for x in lps)
            assert lp_ids == [[t] for t in ids]

    # it trained, and vLLM sampled with the trainer's weights: the logprobs it reported match
    # the trainer's own recomputation (a worker left on older weights would be far off)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == STEPS and all(math.isfinite(h["loss"]) for h in logs)
    assert all(h["grad_norm"] > 0 for h in logs)
    assert all(h["sampling/sampling_logp_difference/max"] < 0.05 for h in logs)
    assert trainer.state.global_step == STEPS
