"""``Rollout``s as vLLM's OpenAI responses and stream chunks (plain dicts, JSON-ready). Pure.

The gateway has no tokenizer: a token in logprobs is always ``"token_id:N"`` (vLLM's form for
``return_tokens_as_token_ids``), whatever the request says. Each choice carries our extension
``weight_version`` and, when its sample spans a weight sync, ``weight_versions`` (per token).
vLLM's ``stop_reason`` (the stop string or token that matched) is not known here: always null.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from zmq_rollout.rollouts import Rollout

LOGPROB_FLOOR = -9999.0
"""vLLM clamps -inf logprobs to this (JSON has no infinity)."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def token(token_id: int) -> str:
    return f"token_id:{token_id}"


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _ranked(token_id: int, logprob: float, tops: dict[int, float] | None) -> list[tuple[int, float]]:
    """vLLM's per-position logprobs: the sampled token first, then the top ones by rank."""
    ranked = [(token_id, logprob)]
    if tops:
        ranked += sorted(((t, v) for t, v in tops.items() if t != token_id), key=lambda tv: -tv[1])
    return ranked


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[dict[int, float]] | None,
    top: int,
    text_offset: int = 0,
) -> dict[str, Any]:
    """``CompletionLogProbs``: per token its string, logprob, and the sampled token with the top
    ``top`` (so up to top + 1 entries, as vLLM and OpenAI give)."""
    tokens = [token(t) for t in token_ids]
    offsets = []
    for s in tokens:
        offsets.append(text_offset)
        text_offset += len(s)
    top_logprobs = [
        {token(t): _lp(v) for t, v in _ranked(t_id, lp, tops[i] if tops else None)[: top + 1]}
        for i, (t_id, lp) in enumerate(zip(token_ids, logprobs, strict=False))
    ]
    return {
        "text_offset": offsets,
        "token_logprobs": [_lp(v) for v in logprobs],
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[dict[int, float]] | None, top: int
) -> dict[str, Any]:
    """``ChatCompletionLogProbs``: per token its string and logprob, and ``top_logprobs``: the
    first ``top`` of vLLM's ranking (which puts the sampled token first, as vLLM does)."""
    content = []
    for i, (t_id, lp) in enumerate(zip(token_ids, logprobs, strict=False)):
        ranked = _ranked(t_id, lp, tops[i] if tops else None)[:top]
        content.append(
            {
                "token": token(t_id),
                "logprob": _lp(lp),
                "bytes": None,  # the token's text is not known without a tokenizer
                "top_logprobs": [
                    {"token": token(t), "logprob": _lp(v), "bytes": list(token(t).encode())} for t, v in ranked
                ],
            }
        )
    return {"content": content}


def versions(r: Rollout) -> dict[str, Any]:
    """Our extension of a choice: the weight version, and per token versions across a sync."""
    out: dict[str, Any] = {"weight_version": r.weight_version}
    if r.weight_versions is not None:
        out["weight_versions"] = r.weight_versions
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def _usage_of(rollouts: Sequence[Rollout]) -> dict[str, Any]:
    prompts = {r.prompt_index: len(r.prompt_token_ids) for r in rollouts}
    return usage(sum(prompts.values()), sum(len(r.token_ids) for r in rollouts))


def completion_choice(r: Rollout, n: int, top: int | None, token_ids: bool) -> dict[str, Any]:
    return {
        "index": r.prompt_index * n + r.index,
        "text": r.text,
        "logprobs": None if top is None else completion_logprobs(r.token_ids, r.logprobs, r.top_logprobs, top),
        "finish_reason": r.finish_reason,
        "stop_reason": None,
        "token_ids": r.token_ids if token_ids else None,
        "prompt_logprobs": None,
        "prompt_token_ids": r.prompt_token_ids if token_ids else None,
        **versions(r),
    }


def completion_response(
    rollouts: Sequence[Rollout], model: str, n: int, top: int | None, token_ids: bool
) -> dict[str, Any]:
    """``CompletionResponse``: choices prompt-major (prompt i's n samples at i*n ... i*n+n-1)."""
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": [completion_choice(r, n, top, token_ids) for r in rollouts],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage_of(rollouts),
    }


def chat_choice(r: Rollout, top: int | None, token_ids: bool) -> dict[str, Any]:
    return {
        "index": r.index,
        "message": {
            "role": "assistant",
            "content": r.text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        },
        "logprobs": None if top is None else chat_logprobs(r.token_ids, r.logprobs, r.top_logprobs, top),
        "finish_reason": r.finish_reason,
        "stop_reason": None,
        "token_ids": r.token_ids if token_ids else None,
        **versions(r),
    }


def chat_response(rollouts: Sequence[Rollout], model: str, top: int | None, token_ids: bool) -> dict[str, Any]:
    """``ChatCompletionResponse`` (one conversation; its n samples are the choices)."""
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": [chat_choice(r, top, token_ids) for r in rollouts],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage_of(rollouts),
        "prompt_logprobs": None,
        "prompt_token_ids": rollouts[0].prompt_token_ids if token_ids and rollouts else None,
    }
