"""Trainer-side models for the weight-sync tests (a module of helpers, not tests)."""

from __future__ import annotations

from typing import Any

import torch

from zmq_rollout.weights import named_tensors


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
