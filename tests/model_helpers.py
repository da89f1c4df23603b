"""Trainer-side models for the weight-sync tests (a module of helpers, not tests)."""

from __future__ import annotations

from typing import Any

import torch

from zmq_rollout import SamplingParams
from zmq_rollout.weight_sync.buckets import named_tensors

#: Prompts and greedy sampling the weight-sync tests compare workers and trainer on.
SYNC_PROMPTS = [[(11 * i + 5 * j) % 250 + 3 for j in range(6 + i % 5)] for i in range(10)]
SYNC_GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def trained_model(path: str, seed: int) -> Any:
    """The tiny model with every tensor changed, seeded: what a trainer would push.

    Besides noise (half of each tensor's spread, so norm gains change too), the attention
    and MLP output projections are scaled up (with the tiny random init the tied embeddings
    dominate and the model just echoes its last token) and the embeddings too (sharper
    logits: fewer bf16 near ties between the top two tokens).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None  # like ignore_eos in vLLM
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in named_tensors(model):
            x = t.float()
            spread = x.std() if x.numel() > 1 and x.std() > 0 else x.abs().mean()
            x += 0.5 * spread * torch.randn(x.shape, generator=g)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                x *= 8
            elif name.endswith("embed_tokens.weight"):
                x *= 3
            t.copy_(x.to(t.dtype))
    return model


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """The trainer model's greedy continuation of ``prompt`` (on the model's device)."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    for _ in range(steps):
        nxt = model(ids).logits[0, -1].float().argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer model's logprob of each of ``tokens`` after ``prompt``."""
    ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
    logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]
