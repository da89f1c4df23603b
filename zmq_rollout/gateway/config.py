"""The gateway's settings (``zmq-rollout gateway --help`` lists them from these docstrings)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from zmq_rollout.config import ClientConfig

WEIGHT_TRANSFER_BACKENDS = ("", "gloo")


@dataclass
class GatewayConfig:
    broker: str = "tcp://127.0.0.1:5555"
    """The broker's frontend."""
    host: str = "127.0.0.1"
    """Address to serve HTTP on (0.0.0.0: every interface)."""
    port: int = 8000
    """Port to serve HTTP on (0: a free one)."""
    chat_max_tokens: int = 1024
    """max_tokens of a chat request that gives neither max_tokens nor max_completion_tokens (vLLM
    fills the model's context; the gateway has no tokenizer to count the prompt)."""
    timeout_s: float = 600.0
    """Seconds a request waits for its completions (then 504, and its jobs are cancelled)."""
    models_ttl_s: float = 2.0
    """Seconds the model names (from the broker's status) are reused before asking again."""
    broker_timeout_s: float = 30.0
    """Seconds the broker may be silent before the requests waiting on it fail with 503."""
    request_timeout_s: float = 10.0
    """Seconds a status call (model names, /health) waits for the broker (then 503)."""
    name: str = "gateway"
    """This gateway's client name in the broker's status and metrics."""
    curve_server_key: str = ""
    """The broker's public key file, for a broker that requires CurveZMQ (with curve_secret_key)."""
    curve_secret_key: str = ""
    """This gateway's keypair file (NAME.key_secret)."""
    weight_transfer_backend: str = ""
    """vLLM's weight-update endpoints (/init_weight_transfer_engine ...): 'gloo' serves them over a
    gloo group with the trainer (zmq_rollout.integrations.vllm_weights); '' reports no
    weight-transfer engine, as vLLM without --weight-transfer-config."""
    weight_transfer_timeout_s: float = 120.0
    """Seconds each step of a weight update may take on a worker (then it is evicted), the
    trainer group's timeout, and how long a round begun through those endpoints may wait for the
    next call before it is aborted."""

    def __post_init__(self) -> None:
        if not (isinstance(self.port, int) and 0 <= self.port < 65536):
            raise ValueError(f"GatewayConfig.port must be in 0..65535, got {self.port!r}")
        if not (isinstance(self.chat_max_tokens, int) and self.chat_max_tokens >= 1):
            raise ValueError(f"GatewayConfig.chat_max_tokens must be at least 1, got {self.chat_max_tokens!r}")
        if self.weight_transfer_backend not in WEIGHT_TRANSFER_BACKENDS:
            raise ValueError(
                f"GatewayConfig.weight_transfer_backend must be one of {list(WEIGHT_TRANSFER_BACKENDS)}, "
                f"got {self.weight_transfer_backend!r} (nccl is not served yet)"
            )
        for name in ("timeout_s", "models_ttl_s", "broker_timeout_s", "request_timeout_s", "weight_transfer_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and not math.isnan(value)):
                raise ValueError(f"GatewayConfig.{name} must be a positive number of seconds, got {value!r}")

    def client_config(self) -> ClientConfig:
        return ClientConfig(
            address=self.broker,
            timeout_s=self.timeout_s,
            broker_timeout_s=self.broker_timeout_s,
            request_timeout_s=self.request_timeout_s,
            name=self.name,
            curve_server_key=self.curve_server_key,
            curve_secret_key=self.curve_secret_key,
        )
