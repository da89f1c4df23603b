"""Our sampling parameters as vLLM's, and vLLM's logprobs as ours."""

from __future__ import annotations

from typing import Any

from zmq_rollout import protocol as p


def vllm_sampling(s: p.SamplingParams, *, stream: bool) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    structured = None
    if s.structured is not None:
        from vllm.sampling_params import StructuredOutputsParams

        c = s.structured
        structured = StructuredOutputsParams(json=c.json_schema, regex=c.regex, choice=c.choice)
    return SamplingParams(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k >= 1 else -1,
        max_tokens=s.max_tokens,
        stop=list(s.stop) or None,
        seed=s.seed,
        logprobs=s.logprobs,  # 0: the sampled token's logprob only
        ignore_eos=s.ignore_eos,
        include_stop_str_in_output=s.include_stop_str_in_output,
        skip_special_tokens=s.skip_special_tokens,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        stop_token_ids=list(s.stop_token_ids) or None,
        min_tokens=s.min_tokens,
        logit_bias=dict(s.logit_bias) if s.logit_bias else None,
        structured_outputs=structured,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
    )


def sampled_logprobs(token_ids: Any, logprobs: Any, top: int) -> tuple[list[float], list[dict[int, float]] | None]:
    """The sampled tokens' logprobs, and the top-``top`` logprobs per position if asked."""
    if logprobs is None:
        return [], None
    chosen = [float(pos[tok].logprob) for tok, pos in zip(token_ids, logprobs, strict=False)]
    if not top:
        return chosen, None
    tops = [
        {int(t): float(lp.logprob) for t, lp in pos.items() if lp.rank is not None and lp.rank <= top}
        for pos in logprobs
    ]
    return chosen, tops
