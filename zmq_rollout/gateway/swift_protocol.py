"""ms-swift's rollout contract (``swift rollout``, read from ms-swift 4.6.0): ``/infer/`` bodies
into our jobs, and ``Rollout``s into its ``RolloutOutput`` list. Pure.

What swift's ``VLLMClient.infer`` posts (``swift/rlhf_trainers/vllm_client.py``)::

    {"infer_requests": [RolloutInferRequest as a dict, ...], "request_config": RequestConfig as a dict,
     "metrics": null, "use_tqdm": bool | null, "adapter_request": null}

and what it reads back: a JSON list, one ``RolloutOutput`` per request, in order
(``swift/infer_engine/protocol.py``): ``response`` (a ``ChatCompletionResponse`` whose choices
carry ``message.content``, ``finish_reason``, ``logprobs = {"content": [...]}`` and, with
``return_details``, ``token_ids``), and the multi-turn fields, left empty as swift's own
single-turn server leaves them (its trainer then reads ``choices[0]``).

A request's messages go to the workers as a chat job: the worker renders them with the
model's chat template, where swift renders them with its own template (which can differ, e.g.
in the default system prompt). Fields that would change the samples and that we cannot honour
(images, tools, beam search, prompt logprobs, a final assistant message to continue, a LoRA
adapter...) are 400s naming the field, in vLLM's error shape like the rest of the gateway;
fields that change nothing here (``use_tqdm``, ``metrics``, ``data_dict``, ``uuid``...) are
ignored, and so are unknown fields at an empty value (null, false, 0, "", [], {}).
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict

from zmq_rollout import protocol as p
from zmq_rollout.gateway import responses as out
from zmq_rollout.gateway.openai_protocol import OpenAIError, validation_error
from zmq_rollout.rollouts import Rollout

ENGINE_TYPE = "AsyncLLMEngine"
"""What ``/get_engine_type/`` reports: every worker runs vLLM's ``AsyncLLM``."""


class RequestConfig(BaseModel):
    """swift's ``RequestConfig`` (4.6.0): its names and defaults. None leaves a field to the
    server; here that is vLLM's neutral value (swift's server takes the model's
    generation_config instead; the gateway has no model files)."""

    model_config = ConfigDict(extra="allow")
    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    num_beams: int = 1
    stop: list[str] | str | None = []
    seed: int | None = None
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    length_penalty: float = 1.0
    return_details: bool = False
    structured_outputs_regex: str | None = None


class InferRequest(BaseModel):
    """swift's ``RolloutInferRequest`` (4.6.0), as ``dataclasses.asdict`` writes it."""

    model_config = ConfigDict(extra="allow")
    messages: list[dict[str, Any]]
    images: Any = None
    audios: Any = None
    videos: Any = None
    tools: Any = None
    objects: Any = None
    chat_template_kwargs: Any = None
    data_dict: Any = None
    """Dataset columns for a server-side multi-turn scheduler: not used by one-turn sampling."""
    uuid: str | None = None
    add_eos: Any = None
    """Only acts on a final assistant message (refused here)."""


class InferBody(BaseModel):
    """The body of ``POST /infer/``."""

    model_config = ConfigDict(extra="allow")
    infer_requests: list[InferRequest]
    request_config: RequestConfig | None = None
    metrics: Any = None
    use_tqdm: bool | None = None
    adapter_request: Any = None


@dataclass
class InferJobs:
    """What an ``/infer/`` body asks the broker for: one chat job per infer request."""

    prompts: list[list[p.ChatMessage]]
    sampling: p.SamplingParams
    ids: list[str]
    """Each request's response id: its ``uuid`` when it has one (as swift's async engine)."""
    logprobs: bool
    top_logprobs: int | None
    """Entries per token's ``top_logprobs`` list; None: no such list (swift's own rule)."""
    return_details: bool


def _is_empty(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (int, float, str, list, dict)) and not value)


def _refuse_unknown(model: BaseModel, where: str) -> None:
    for name, value in (model.model_extra or {}).items():
        if not _is_empty(value):
            raise OpenAIError(
                f"{where}{name}={value!r} is not part of ms-swift 4.6's contract as zmq-rollout serves it "
                "(unknown fields are ignored only at an empty value)",
                param=f"{where}{name}",
            )


def _refuse(param: str, message: str) -> OpenAIError:
    return OpenAIError(f"{param}: {message}", param=param)


def _text(content: Any, param: str) -> str:
    """A message's content as text: a string, or text parts joined as swift joins them (no
    separator)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(x, dict) for x in content):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _refuse(param, f"content parts of type {part.get('type')!r} are not served (text only)")
            texts.append(part["text"])
        return "".join(texts)
    if (isinstance(content, list) and content and all(isinstance(x, int) for x in content)) or (
        isinstance(content, dict) and "token_ids" in content
    ):
        raise _refuse(param, "token-id content is not served: the gateway has no tokenizer to join it with text")
    raise _refuse(param, "a message's content is a string or a list of text parts")


def _messages(req: InferRequest, i: int) -> list[p.ChatMessage]:
    where = f"infer_requests.{i}"
    for name in ("images", "audios", "videos", "tools", "objects", "chat_template_kwargs"):
        if not _is_empty(getattr(req, name)):
            raise _refuse(f"{where}.{name}", "not served by zmq-rollout's gateway (text chat only, model's template)")
    _refuse_unknown(req, f"{where}.")
    messages = list(req.messages)
    if messages and messages[-1].get("role") == "assistant" and messages[-1].get("content") is None:
        messages.pop()  # swift's mark for "generate the answer here"
    if not messages:
        raise _refuse(f"{where}.messages", "holds no message to answer")
    chat = []
    for j, m in enumerate(messages):
        param = f"{where}.messages.{j}"
        role = m.get("role")
        if not isinstance(role, str):
            raise _refuse(param, "every message has a role")
        if role == "tool" or m.get("tool_calls"):
            raise _refuse(param, "tool messages and tool calls are not served")
        chat.append(p.ChatMessage(role, _text(m.get("content"), param)))
    if chat[-1].role == "assistant":
        raise _refuse(
            f"{where}.messages.{len(chat) - 1}",
            "ms-swift continues a final assistant message; zmq-rollout's workers open a new assistant "
            "turn after it: not served (end the messages with the user's turn)",
        )
    return chat


def _sampling(rc: RequestConfig, default_max_tokens: int) -> p.SamplingParams:
    for name, neutral in (("num_beams", (1,)), ("best_of", (None, 1)), ("length_penalty", (1.0,))):
        if getattr(rc, name) not in neutral:
            raise _refuse(f"request_config.{name}", "beam search is not served (only its neutral value)")
    if rc.stream:
        raise _refuse("request_config.stream", "/infer/ answers whole responses (as swift's rollout server)")
    if rc.prompt_logprobs is not None:
        raise _refuse("request_config.prompt_logprobs", "prompt logprobs are not served yet by zmq-rollout")
    if rc.top_logprobs is not None and rc.top_logprobs < 0:
        raise _refuse("request_config.top_logprobs", "must be at least 0")
    top = rc.top_logprobs if rc.logprobs and rc.top_logprobs else 0
    stop = [rc.stop] if isinstance(rc.stop, str) else list(rc.stop or [])
    try:
        structured = (
            None if rc.structured_outputs_regex is None else p.StructuredOutput(regex=rc.structured_outputs_regex)
        )
        return p.SamplingParams(
            n=rc.n,
            temperature=1.0 if rc.temperature is None else rc.temperature,
            top_p=1.0 if rc.top_p is None else rc.top_p,
            top_k=-1 if rc.top_k is None else rc.top_k,
            min_p=0.0 if rc.min_p is None else rc.min_p,
            repetition_penalty=1.0 if rc.repetition_penalty is None else rc.repetition_penalty,
            presence_penalty=rc.presence_penalty,
            frequency_penalty=rc.frequency_penalty,
            max_tokens=default_max_tokens if rc.max_tokens is None else rc.max_tokens,
            stop=stop,
            seed=rc.seed,
            logprobs=top,
            structured=structured,
        )
    except (ValueError, TypeError) as exc:
        message = str(exc)
        name = re.split(r"[ =.]", message, maxsplit=1)[0]
        name = {"logprobs": "top_logprobs", "structured": "structured_outputs_regex"}.get(name, name)
        param = f"request_config.{name}" if name in RequestConfig.model_fields else "request_config"
        raise OpenAIError(message, param=param) from None


def parse_infer(body: bytes, default_max_tokens: int) -> InferJobs:
    """A ``POST /infer/`` body → its jobs (OpenAIError: a 400 naming the field)."""
    try:
        req = InferBody.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise validation_error(exc) from None
    _refuse_unknown(req, "")
    if req.adapter_request is not None:
        raise _refuse("adapter_request", "LoRA adapters are not served through /infer/ (the base model only)")
    rc = req.request_config or RequestConfig()
    _refuse_unknown(rc, "request_config.")
    sampling = _sampling(rc, default_max_tokens)
    prompts = [_messages(r, i) for i, r in enumerate(req.infer_requests)]
    ids = [r.uuid or uuid.uuid4().hex for r in req.infer_requests]
    top = rc.top_logprobs if rc.logprobs else None
    return InferJobs(prompts, sampling, ids, rc.logprobs, top, rc.return_details)


# -- rollouts into RolloutOutputs ---------------------------------------------------------------
def _lp(value: float) -> float:
    return max(value, out.LOGPROB_FLOOR)


def _entry(token_id: int, logprob: float) -> dict[str, Any]:
    token = out.token(token_id)  # no tokenizer: "token_id:N", as everywhere in the gateway
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode())}


def choice_logprobs(r: Rollout, top_logprobs: int | None) -> dict[str, Any]:
    """swift's ``{"content": [...]}``: per token its entry and, when ``top_logprobs`` is not
    None, the ``top_logprobs`` best of (the sampled token and the top ones) by logprob, without
    -inf (swift's ``_get_logprobs``)."""
    content = []
    for i, (token_id, logprob) in enumerate(zip(r.token_ids, r.logprobs, strict=False)):
        entry = _entry(token_id, logprob)
        if top_logprobs is not None:
            ranked = dict(r.top_logprobs[i]) if r.top_logprobs else {}
            ranked.setdefault(token_id, logprob)
            best = sorted(ranked.items(), key=lambda tv: -tv[1])[:top_logprobs]
            entry["top_logprobs"] = [_entry(t, v) for t, v in best if v != -math.inf]
        content.append(entry)
    return {"content": content}


def _choice(r: Rollout, jobs: InferJobs) -> dict[str, Any]:
    return {
        "index": r.index,
        "message": {"role": "assistant", "content": r.text, "tool_calls": None, "reasoning_content": None},
        "finish_reason": r.finish_reason,
        "logprobs": choice_logprobs(r, jobs.top_logprobs) if jobs.logprobs and r.token_ids else None,
        "token_ids": r.token_ids if jobs.return_details else None,
        "routed_experts": None,
        **out.versions(r),  # our extension; swift's parser drops fields it does not know
    }


def rollout_output(rollouts: Sequence[Rollout], response_id: str, model: str, jobs: InferJobs) -> dict[str, Any]:
    """One request's ``RolloutOutput``: its samples as the choices of one response."""
    rollouts = sorted(rollouts, key=lambda r: r.index)
    prompt_ids = rollouts[0].prompt_token_ids if rollouts else []
    completion = sum(len(r.token_ids) for r in rollouts)
    response = {
        "model": model,
        "choices": [_choice(r, jobs) for r in rollouts],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion,
        },
        "id": response_id,
        "object": "chat.completion",
        "created": out.now(),
        "prompt_token_ids": prompt_ids if jobs.return_details else None,
        "prompt_logprobs": None,
        "images_size": None,
    }
    return {
        "response": response,
        "messages": None,
        "response_token_ids": [],
        "response_loss_mask": [],
        "rollout_infos": {},
        "rollout_logprobs": [],
        "prompt_logprobs": None,
    }


def infer_response(rollouts: Sequence[Rollout], model: str, jobs: InferJobs) -> list[dict[str, Any]]:
    """The ``/infer/`` answer: one ``RolloutOutput`` per infer request, in request order."""
    per_request: list[list[Rollout]] = [[] for _ in jobs.ids]
    for r in rollouts:
        per_request[r.prompt_index].append(r)
    return [rollout_output(rs, jobs.ids[i], model, jobs) for i, rs in enumerate(per_request)]
