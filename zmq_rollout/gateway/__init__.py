"""``zmq-rollout gateway``: the subset of ``vllm serve``'s OpenAI API that RL frameworks call,
served over one ``AsyncRolloutClient`` (docs/integrations.md).

A gateway is a broker client like any other: stateless, any number of them, and light (FastAPI
and the client; never torch or vLLM). ``openai_protocol`` turns a request into prompts and
``SamplingParams``; ``responses`` turns ``Rollout``s into vLLM's response and chunk shapes; both
are pure. ``app`` is the HTTP shell around them.
"""

from zmq_rollout.gateway.config import GatewayConfig

__all__ = ["GatewayConfig"]
