"""TRL's arguments into our jobs, our rollouts into TRL's answers: pure, no sockets, no TRL.

The shapes are those of TRL 1.16's ``VLLMClient.generate`` / ``chat``
(``trl/generation/vllm_client.py``, ``parse_logprobs``):

- ``prompt_ids``: one list of token ids per prompt (per conversation for ``chat``);
- ``completion_ids``: one per sample, prompt-major (prompt *i*'s ``n`` samples are ``i*n .. i*n+n-1``);
- ``logprobs``: per sample, per token, a list of logprobs sorted by descending probability: the
  sampled token's alone (``[[lp], ...]``) when ``logprobs=0``, the sampled one plus the top *N*
  when ``logprobs=N``; ``None`` when ``logprobs=None``. A NaN is ``None``, as TRL's.
- ``logprob_token_ids``: the token id of each of those logprobs, same shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from zmq_rollout import protocol as p
from zmq_rollout.rollouts import Rollout

# generation_kwargs TRL passes through to vLLM that are SamplingParams fields of the same name here.
PASSED_THROUGH = (
    "seed",
    "stop",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "stop_token_ids",
    "min_tokens",
    "logit_bias",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
)


NEUTRAL: dict[str, Any] = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
"""Arguments TRL always sends that change nothing at these values: left out of the job."""


def sampling_params(
    *,
    n: int,
    repetition_penalty: float,
    temperature: float,
    top_p: float,
    top_k: int | None,
    min_p: float | None,
    max_tokens: int,
    logprobs: int | None,
    structured_outputs_regex: str | None,
    generation_kwargs: dict[str, Any] | None,
) -> p.SamplingParams:
    """TRL's sampling arguments as our ``SamplingParams`` (ValueError names a field we do not take).

    TRL's ``top_k=0`` (no truncation) is vLLM's and ours ``-1``. A field at its neutral value
    is left out; one that ``SamplingParams`` does not have is refused by name.
    """
    fields: dict[str, Any] = {
        "n": n,
        "repetition_penalty": repetition_penalty,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k or -1,
        "min_p": min_p or 0.0,
        "max_tokens": max_tokens,
        "logprobs": logprobs or 0,
    }
    structured: dict[str, Any] | None = {"regex": structured_outputs_regex} if structured_outputs_regex else None
    for key, value in (generation_kwargs or {}).items():
        if key == "top_k":
            fields[key] = value or -1
        elif key in ("min_p", "logprobs"):
            fields[key] = value or 0
        elif key in fields or key in PASSED_THROUGH:
            fields[key] = value
        elif key == "structured_outputs":
            structured = structured or (dict(value) if value else None)
        else:
            raise ValueError(f"generation_kwargs[{key!r}] is not supported by zmq-rollout's TRL client")
    fields = {k: v for k, v in fields.items() if k not in NEUTRAL or v != NEUTRAL[k]}
    if structured:
        fields["structured"] = structured
    known = set(p.SamplingParams.__struct_fields__)
    for key in fields:
        if key not in known:
            raise ValueError(f"{key}={fields[key]!r} is not supported by this zmq-rollout's SamplingParams")
    if structured:
        fields["structured"] = p.StructuredOutput(**structured)  # type: ignore[attr-defined,unused-ignore]
    return p.SamplingParams(**fields)


def _per_token(r: Rollout, with_top: bool) -> tuple[list[list[float | None]], list[list[int]]]:
    values: list[list[float | None]] = []
    ids: list[list[int]] = []
    for k, (token, lp) in enumerate(zip(r.token_ids, r.logprobs, strict=True)):
        ranked: dict[int, float] = {token: lp}
        if with_top and r.top_logprobs is not None and k < len(r.top_logprobs):
            ranked = {token: lp, **{t: v for t, v in r.top_logprobs[k].items() if t != token}}
        items = sorted(ranked.items(), key=lambda item: -item[1])
        ids.append([t for t, _ in items])
        values.append([None if math.isnan(v) else v for _, v in items])
    return values, ids


def trl_output(rollouts: Sequence[Rollout], n: int, logprobs: int | None) -> dict[str, Any]:
    """Rollouts (prompt-major, ``n`` per prompt) as TRL's ``generate`` / ``chat`` dict."""
    out: dict[str, Any] = {
        "prompt_ids": [list(r.prompt_token_ids) for r in rollouts[::n]],
        "completion_ids": [list(r.token_ids) for r in rollouts],
        "logprobs": None,
        "logprob_token_ids": None,
    }
    if logprobs is not None:
        per_sample = [_per_token(r, logprobs > 0) for r in rollouts]
        out["logprobs"] = [values for values, _ in per_sample]
        out["logprob_token_ids"] = [ids for _, ids in per_sample]
    return out


def chat_messages(conversation: Sequence[dict[str, Any]]) -> list[p.ChatMessage]:
    """A TRL/OpenAI conversation as our chat messages: string content, or ``text`` parts joined
    with a newline (as the gateway); images and tool calls are refused (ValueError)."""
    messages = []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
                raise ValueError("zmq-rollout's TRL client takes text content only (no images)")
            content = "\n".join(str(part.get("text", "")) for part in content)
        if not isinstance(content, str):
            raise ValueError(f"a chat message's content is a string or text parts; got {type(content).__name__}")
        messages.append(p.ChatMessage(role=str(message["role"]), content=content))
    return messages
