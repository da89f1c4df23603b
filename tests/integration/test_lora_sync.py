"""LoRA sync end to end: ``update_lora`` into a real vLLM CPU worker's LoRA slot.

The proof: after a push, jobs naming the adapter sample what the trainer's model with the
adapter merged in (``W + alpha/r * B @ A``, in transformers) samples; a second push into
the same name replaces it in place; the base model (jobs naming no adapter) never changes.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import hf_greedy, hf_logprobs

from zmq_rollout import RolloutClient, SamplingParams
from zmq_rollout.config import BrokerConfig
from zmq_rollout.errors import RolloutError
from zmq_rollout.local import LocalCluster

RANK, ALPHA = 8, 16
PROMPTS = [[(13 * i + 7 * j) % 250 + 3 for j in range(5 + i % 4)] for i in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
TARGETS = {"q_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn", "down_proj": "mlp"}


@pytest.fixture(scope="module")
def client(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    config = BrokerConfig(
        frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", heartbeat_interval_s=0.5, worker_liveness=10
    )
    overrides = {"enable_lora": True, "max_lora_rank": RANK}
    logs = str(tmp_path_factory.mktemp("lora-logs"))
    with LocalCluster(tiny_model, broker_config=config, worker_overrides=overrides, log_dir=logs) as c:  # noqa: SIM117
        with RolloutClient(c.address, timeout_s=300) as rc:
            yield rc


def make_adapter(tiny_model: str, seed: int) -> dict[str, torch.Tensor]:
    """PEFT-named random LoRA tensors for every layer's TARGETS (lora_B non-zero)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_model)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    shapes = {"q_proj": (h, h), "v_proj": (h, kv), "o_proj": (h, h), "down_proj": (inter, h)}  # (in, out)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for target, sub in TARGETS.items():
            fan_in, fan_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{sub}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=g) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=g) * 0.3
    return tensors


PEFT_CONFIG = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
               "bias": "none", "target_modules": sorted(TARGETS)}  # fmt: skip


def merged_model(tiny_model: str, adapter: dict[str, torch.Tensor] | None) -> torch.nn.Module:
    """The base model with ``adapter`` merged in (PEFT's semantics), as a trainer holds it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    if adapter:
        weights = dict(model.named_parameters())
        with torch.no_grad():
            for name, a in adapter.items():
                if ".lora_A." in name:
                    b = adapter[name.replace(".lora_A.", ".lora_B.")]
                    target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
                    weights[target] += (ALPHA / RANK) * (b @ a)
    return model.to(torch.bfloat16)


def agreement(client: RolloutClient, model: torch.nn.Module, lora: str | None) -> tuple[int, int, float]:
    """(prompts whose greedy tokens equal the trainer's, of the others those split by a near
    tie, max |logprob diff| on sampled tokens).

    A near tie: where the tokens first differ, the trainer's logprobs of its token and of
    vLLM's are within 0.05 (bf16 noise can flip the argmax there; these are reported).
    """
    greedy = client.generate(PROMPTS, GREEDY, lora=lora)
    equal = ties = 0
    for r in greedy:
        prompt = PROMPTS[r.prompt_index]
        want = hf_greedy(model, prompt, 10)
        if r.token_ids == want:
            equal += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(r.token_ids, want, strict=True)) if a != b)
        (mine,) = hf_logprobs(model, prompt + want[:at], [r.token_ids[at]])
        (theirs,) = hf_logprobs(model, prompt + want[:at], [want[at]])
        ties += theirs - mine < 0.05
    sampled = client.generate(
        PROMPTS[:4], SamplingParams(temperature=1.0, max_tokens=8, seed=3, ignore_eos=True), lora=lora
    )
    diff = max(
        abs(a - b)
        for r in sampled
        for a, b in zip(r.logprobs, hf_logprobs(model, PROMPTS[r.prompt_index], r.token_ids), strict=True)
    )
    return equal, ties, diff


def test_lora_push_changes_adapter_outputs_in_place_and_leaves_the_base(client: RolloutClient, tiny_model: str) -> None:
    base = merged_model(tiny_model, None)
    base_outputs = client.generate(PROMPTS, GREEDY)

    with pytest.raises(RolloutError, match="not loaded on this worker"):
        client.generate(PROMPTS[:1], GREEDY, lora="policy")

    adapter_a = make_adapter(tiny_model, 1)
    model_a = merged_model(tiny_model, adapter_a)
    assert agreement(client, model_a, None)[2] > 0.5  # the adapter matters: the base is far from it
    report = client.update_lora(adapter_a, PEFT_CONFIG, name="policy")
    assert report.workers_updated == ["worker-0"] and report.num_buckets == 1 and report.transport == "inline"
    equal_a, ties_a, diff_a = agreement(client, model_a, "policy")
    print(f"adapter A: greedy equal {equal_a}/{len(PROMPTS)} (+{ties_a} near ties), "
          f"max logprob diff {diff_a:.4f}, push {report.seconds:.2f} s")  # fmt: skip
    assert equal_a + ties_a == len(PROMPTS) and ties_a <= 2 and diff_a < 0.1
    results = client.generate(PROMPTS[:2], GREEDY, lora="policy")
    assert {r.weight_version for r in results} == {report.version}

    # A second push into the same slot replaces it (bucketed in several steps this time).
    adapter_b = make_adapter(tiny_model, 2)
    model_b = merged_model(tiny_model, adapter_b)
    report_b = client.update_lora(adapter_b, PEFT_CONFIG, name="policy", bucket_bytes=20_000)
    assert report_b.num_buckets > 1 and report_b.version == report.version + 1
    equal_b, ties_b, diff_b = agreement(client, model_b, "policy")
    print(f"adapter B: greedy equal {equal_b}/{len(PROMPTS)} (+{ties_b} near ties), max logprob diff {diff_b:.4f}")
    assert equal_b + ties_b == len(PROMPTS) and ties_b <= 2 and diff_b < 0.1
    assert agreement(client, model_a, "policy")[2] > 0.5  # A is gone

    # The base model is untouched.
    assert [r.token_ids for r in client.generate(PROMPTS, GREEDY)] == [r.token_ids for r in base_outputs]
    equal, ties, diff = agreement(client, base, None)
    assert equal + ties == len(PROMPTS) and diff < 0.1


def test_bad_lora_pushes_fail_clearly_and_the_worker_keeps_serving(client: RolloutClient, tiny_model: str) -> None:
    from zmq_rollout.errors import InvalidRequestError, SyncError

    with pytest.raises(InvalidRequestError, match="peft_config"):
        client.update_lora(make_adapter(tiny_model, 3), {"target_modules": ["q_proj"]})
    too_high = {**PEFT_CONFIG, "r": 4 * RANK}
    wide = {k: torch.cat([v] * 4, dim=0 if ".lora_A." in k else 1) for k, v in make_adapter(tiny_model, 3).items()}
    with pytest.raises(SyncError, match="rank"):
        client.update_lora(wide, too_high, name="wide")
    status = client.status()
    assert all(w.state == "ready" for w in status.workers)
    assert len(client.generate(PROMPTS[:2], GREEDY)) == 2
