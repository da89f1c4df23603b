"""What the client hands a trainer (``Rollout``, ``TokenDelta``) and how prompts become jobs.

Pure conversions between the caller's Python values and the wire Structs: no sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import msgspec

from zmq_rollout import protocol as p
from zmq_rollout.errors import InvalidRequestError

Prompt = Union[str, Sequence[int], Sequence[dict[str, str]], Sequence[p.ChatMessage]]  # noqa: UP007 (runtime alias)


@dataclass
class Rollout:
    """One sampled completion, ready for a trainer's loss."""

    job_id: str
    prompt_index: int  # position of its prompt in the call's input
    index: int  # sample index within the prompt (0..n-1)
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # the sampled tokens' processed logprobs
    finish_reason: str
    weight_version: int
    worker_id: str
    top_logprobs: list[dict[int, float]] | None = None
    weight_versions: list[int] | None = None  # per token, only if the sample spans a weight sync
    text: str = ""  # the completion as vLLM detokenized it, for reward functions; token_ids rule


@dataclass
class TokenDelta:
    """Tokens streamed for one sample of a job."""

    job_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str = ""
    """The text these tokens add (vLLM's streaming detokenization); the deltas' texts of a
    sample join to its ``Rollout.text``."""


def make_job(
    job_id: str,
    prompt: Prompt,
    sampling: p.SamplingParams,
    *,
    stream: bool = False,
    min_weight_version: int = 0,
    lora: str | None = None,
    max_staleness: int | None = None,
    on_stale: str = "abort",
    sampling_checked: bool = False,
) -> p.JobSpec:
    """Build and validate a job from a prompt string, chat messages or token ids.
    ``sampling_checked``: ``sampling`` was validated since it last changed (by the call that
    made the first of a batch's jobs): not again (about 1 us a job)."""
    kwargs: dict[str, Any] = {}
    ids: list[int] | None
    if isinstance(prompt, str):
        kwargs["prompt"] = prompt
    elif isinstance(prompt, (bytes, bytearray)):
        raise InvalidRequestError("a prompt is a str, not bytes: decode it first", job_id=job_id)
    elif isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], int) and (ids := _ints(prompt)) is not None:
        kwargs["prompt_token_ids"] = ids
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, (dict, p.ChatMessage)) for m in prompt):
        try:
            kwargs["messages"] = [m if isinstance(m, p.ChatMessage) else p.ChatMessage(**m) for m in prompt]  # type: ignore[arg-type]
        except TypeError as exc:
            raise InvalidRequestError(f"a chat message has a role and a content: {exc}", job_id=job_id) from None
    else:
        raise InvalidRequestError(
            "a prompt is a string, a non-empty list of token ids, or a list of chat messages; "
            f"got {type(prompt).__name__}"
        )
    if type(sampling) is not p.SamplingParams:
        raise InvalidRequestError(
            f"sampling must be a zmq_rollout.SamplingParams, got {type(sampling).__name__}", job_id=job_id
        )
    try:
        if not sampling_checked:
            sampling.__post_init__()  # again: a Struct's fields can be reassigned after construction
        return p.JobSpec(
            job_id,
            sampling,
            stream=stream,
            min_weight_version=min_weight_version,
            lora=lora,
            max_staleness=max_staleness,
            on_stale=on_stale,
            ack=False,  # this client needs no ACCEPTED (submissions.Unanswered: any answer will do)
            **kwargs,
        )
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(str(exc), job_id=job_id) from None


def _ints(prompt: Sequence[Any]) -> list[int] | None:
    """``prompt`` as a new list if every item is an int (not a bool, not beyond 64 bits), else
    None: checked and copied in C (``msgspec.convert``, 2 us for 512 ids, where a generator
    over ``isinstance`` and a copy took 13)."""
    try:
        return msgspec.convert(prompt, list[int])
    except msgspec.ValidationError:
        if isinstance(prompt, (list, tuple)):
            return None
    items = list(prompt)  # another Sequence (a range, say): item by item
    return items if all(type(t) is int for t in items) else None


def to_rollouts(result: p.Result, prompt_index: int = 0) -> list[Rollout]:
    return [
        Rollout(
            str(result.key),
            prompt_index,
            s.index,
            result.prompt_token_ids,
            s.token_ids,
            s.logprobs,
            s.finish_reason,
            result.weight_version,
            result.worker_id,
            s.top_logprobs,
            s.weight_versions,
            s.text or "",
        )
        for s in sorted(result.samples, key=lambda s: s.index)
    ]


@dataclass
class StreamRestarted:
    """In a stream: the broker restarted, and the job runs again from its first token under
    the same job id. Drop this job's ``TokenDelta``s so far; the final ``Rollout`` is the run
    that finished."""

    job_id: str
