"""OpenAI requests as vLLM's server takes them, and their translation into our jobs. Pure.

Field names, defaults and error bodies follow vLLM's OpenAI server (0.32:
``vllm/entrypoints/openai/completion/protocol.py``, ``chat_completion/protocol.py``,
``serve/engine/protocol.py`` ``ErrorResponse``). A sampling field our ``SamplingParams``
does not have yet is accepted at its neutral value and refused with a 400 that names it
otherwise; fields vLLM ignores, or that
change nothing here (``user``, ``request_id``, ``stream_interval``...), and unknown fields
are ignored, as vLLM ignores unknown fields.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Annotated, Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from zmq_rollout import protocol as p

NonNegativeInt = Annotated[int, Field(ge=0)]


class OpenAIError(Exception):
    """An error answered as vLLM's ``ErrorResponse``: ``{"error": {message, type, param, code}}``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.err_type = err_type or {400: "BadRequestError", 404: "NotFoundError"}.get(
            status, HTTPStatus(status).phrase
        )

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}


def _neutral(*values: Any) -> tuple[Any, ...]:
    return (None, *values)


UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    # vLLM sampling fields our SamplingParams does not have (yet), each with its neutral values.
    # (min_p, the penalties, stop_token_ids, min_tokens, logit_bias, truncate_prompt_tokens and
    # structured outputs are ours: see ``_surface``.)
    "use_beam_search": _neutral(False),
    "length_penalty": _neutral(1, 1.0),
    "bad_words": _neutral([]),
    "allowed_token_ids": _neutral(),
    "prompt_logprobs": _neutral(),
    "logprob_token_ids": _neutral(),
    "guided_grammar": _neutral(),
    "spaces_between_special_tokens": _neutral(True),
    "priority": _neutral(0),
    "watermarking": _neutral(False),
    "repetition_detection": _neutral(),
    "thinking_token_budget": _neutral(-1),
    "vllm_xargs": _neutral({}),
    "kv_transfer_params": _neutral({}),
    "cache_salt": _neutral(),
    "echo": _neutral(False),
    "suffix": _neutral(""),
    "best_of": _neutral(1),
    "prompt_embeds": _neutral([]),
}
UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    "tools": _neutral([]),
    "tool_choice": _neutral("none", "auto"),
    "functions": _neutral([]),
    "add_generation_prompt": _neutral(True),
    "continue_final_message": _neutral(False),
    "chat_template": _neutral(),
    "chat_template_kwargs": _neutral({}),
    "documents": _neutral([]),
    "reasoning_effort": _neutral(),
    "mm_processor_kwargs": _neutral({}),
    "add_special_tokens": _neutral(False),
}
UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {
    "add_special_tokens": _neutral(True),
}


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


def _refuse_unsupported(extra: dict[str, Any], table: dict[str, tuple[Any, ...]]) -> None:
    for name, neutral in table.items():
        if name in extra and not _is_neutral(extra[name], neutral):
            raise OpenAIError(
                f"{name}={extra[name]!r} is not supported yet by zmq-rollout (only its neutral value)", param=name
            )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class OpenAIRequest(BaseModel):
    """Fields both endpoints share (names and defaults as vLLM's)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    n: int | None = 1
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(OpenAIRequest):
    prompt: list[NonNegativeInt] | list[list[NonNegativeInt]] | str | list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None


class ChatCompletionRequest(OpenAIRequest):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0


@dataclass
class Jobs:
    """What a request asks the broker for: one job per prompt, all with ``sampling``."""

    prompts: list[Any]
    sampling: p.SamplingParams
    top: int | None
    """Top logprobs per token in the response: None for no logprobs at all, 0 for the sampled
    token's only."""


def validation_error(exc: pydantic.ValidationError) -> OpenAIError:
    """vLLM's answer to a request its pydantic model refuses (a 400, type ``Bad Request``)."""
    errors = exc.errors(include_url=False, include_input=False)
    loc = [str(x) for x in (errors[0]["loc"] if errors else ()) if not any(c in str(x) for c in "[]()")]
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {e}\n" for e in errors[:10])
    return OpenAIError(message.rstrip(), param=".".join(["body", *loc]) if loc else None, err_type="Bad Request")


def _parse(model: type[OpenAIRequest], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise validation_error(exc) from None


SURFACE_NUMBERS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _structured(extra: dict[str, Any]) -> p.StructuredOutput | None:
    """vLLM's ``structured_outputs`` (and its older ``guided_*`` and OpenAI's ``response_format``)
    as our ``StructuredOutput``; None when the request constrains nothing."""
    given: dict[str, Any] = {}
    so = extra.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise OpenAIError("structured_outputs must be an object", param="structured_outputs")
        unknown = sorted(k for k, v in so.items() if v not in (None, False) and k not in ("json", "regex", "choice"))
        if unknown:
            raise OpenAIError(f"structured_outputs.{unknown[0]} is not supported yet by zmq-rollout", param=unknown[0])
        given = {k: so[k] for k in ("json", "regex", "choice") if so.get(k) is not None}
    for old, new in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
        if extra.get(old) is not None:
            given[new] = extra[old]
    fmt = extra.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        if fmt.get("type") == "json_object":
            given["json"] = {"type": "object"}
        elif fmt.get("type") == "json_schema" and isinstance(fmt.get("json_schema"), dict):
            given["json"] = fmt["json_schema"].get("schema", {})
        else:
            raise OpenAIError(f"response_format {fmt.get('type')!r} is not supported", param="response_format")
    if not given:
        return None
    schema = given.get("json")
    try:
        return p.StructuredOutput(
            json_schema=None if schema is None else (schema if isinstance(schema, str) else json.dumps(schema)),
            regex=given.get("regex"),
            choice=given.get("choice"),
        )
    except (ValueError, TypeError) as exc:
        raise OpenAIError(str(exc), param="structured_outputs") from None


def _surface(extra: dict[str, Any]) -> dict[str, Any]:
    """The rest of vLLM's sampling fields, from the request's extra fields, as ours."""
    out: dict[str, Any] = {name: extra[name] for name in SURFACE_NUMBERS if extra.get(name) is not None}
    for name in ("stop_token_ids", "min_tokens", "truncate_prompt_tokens"):
        if extra.get(name) is not None:
            out[name] = extra[name]
    bias = extra.get("logit_bias")
    if bias:
        if not isinstance(bias, dict):
            raise OpenAIError("logit_bias maps token ids to biases", param="logit_bias")
        try:
            out["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise OpenAIError("logit_bias keys are token ids (integers as strings)", param="logit_bias") from None
    structured = _structured(extra)
    if structured is not None:
        out["structured"] = structured
    return out


def _sampling(req: OpenAIRequest, max_tokens: int | None, logprobs: int) -> p.SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    surface = _surface(req.model_extra or {})
    try:
        return p.SamplingParams(
            n=1 if req.n is None else req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            max_tokens=16 if max_tokens is None else max_tokens,
            stop=stop,
            seed=req.seed,
            logprobs=logprobs,
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            **surface,
        )
    except (ValueError, TypeError) as exc:
        message = str(exc)
        name = re.split(r"[ =]", message, maxsplit=1)[0]
        raise OpenAIError(message, param=name if name in p.SamplingParams.__struct_fields__ else None) from None


def _check_stream_options(req: OpenAIRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("Stream options can only be defined when `stream=True`.", param="stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise OpenAIError(
            "stream_options.continuous_usage_stats is not supported yet by zmq-rollout", param="stream_options"
        )


def parse_completion(body: bytes) -> tuple[CompletionRequest, Jobs]:
    """A ``/v1/completions`` body → the request and its jobs (OpenAIError: a 400)."""
    req: CompletionRequest = _parse(CompletionRequest, body)
    extra = req.model_extra or {}
    _refuse_unsupported(extra, UNSUPPORTED)
    _refuse_unsupported(extra, UNSUPPORTED_COMPLETION)
    _check_stream_options(req)
    prompt = req.prompt
    if not prompt:
        raise OpenAIError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif all(isinstance(x, int) for x in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
        if not all(prompts):
            raise OpenAIError("every prompt of a batch must be non-empty", param="prompt")
    if req.logprobs is not None and req.logprobs < 0:
        raise OpenAIError("`logprobs` must be a positive value or -1.", param="logprobs")
    top = req.logprobs
    return req, Jobs(prompts, _sampling(req, req.max_tokens, top or 0), top)


def _content(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(f"content parts of type {kind!r} are not supported yet", param=f"messages.{i}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise OpenAIError("a message's content must be a string or a list of text parts", param=f"messages.{i}")


def parse_chat(body: bytes, default_max_tokens: int) -> tuple[ChatCompletionRequest, Jobs]:
    """A ``/v1/chat/completions`` body → the request and its one job (OpenAIError: a 400)."""
    req: ChatCompletionRequest = _parse(ChatCompletionRequest, body)
    extra = req.model_extra or {}
    _refuse_unsupported(extra, UNSUPPORTED)
    _refuse_unsupported(extra, UNSUPPORTED_CHAT)
    _check_stream_options(req)
    if not req.messages:
        raise OpenAIError("messages must hold at least one message", param="messages")
    messages = []
    for i, m in enumerate(req.messages):
        if not isinstance(m.get("role"), str):
            raise OpenAIError("every message has a role", param=f"messages.{i}")
        if m.get("tool_calls") or m.get("role") == "tool":
            raise OpenAIError("tool calls are not supported yet", param=f"messages.{i}")
        messages.append(p.ChatMessage(m["role"], _content(m, i)))
    top_logprobs = req.top_logprobs or 0
    if top_logprobs < 0:
        raise OpenAIError("`top_logprobs` must be a positive value or -1.", param="top_logprobs")
    if top_logprobs and not req.logprobs:
        raise OpenAIError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = top_logprobs if req.logprobs else None
    sampling = _sampling(req, default_max_tokens if max_tokens is None else max_tokens, top or 0)
    return req, Jobs([messages], sampling, top)
