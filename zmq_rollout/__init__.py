"""zmq-rollout: the rollout tier for RL post-training of LLMs.

The public API is ``__all__`` (pinned by tests/test_public_api.py).
"""

from zmq_rollout.client import AsyncRolloutClient, Rollout, RolloutClient
from zmq_rollout.errors import (
    BusyError,
    ClientClosedError,
    InvalidRequestError,
    JobCancelledError,
    JobFailedError,
    ProtocolError,
    RolloutError,
    RolloutTimeoutError,
    SyncError,
)
from zmq_rollout.protocol import ChatMessage, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "AsyncRolloutClient",
    "BusyError",
    "ChatMessage",
    "ClientClosedError",
    "InvalidRequestError",
    "JobCancelledError",
    "JobFailedError",
    "ProtocolError",
    "Rollout",
    "RolloutClient",
    "RolloutError",
    "RolloutTimeoutError",
    "SamplingParams",
    "SyncError",
    "__version__",
]
