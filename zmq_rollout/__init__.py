"""zmq-rollout: the rollout tier for RL post-training of LLMs.

The public API is ``__all__`` (pinned by tests/unit/test_client.py, test_public_api_is_pinned).
"""

from zmq_rollout.blocking import RolloutClient
from zmq_rollout.client import AsyncRolloutClient
from zmq_rollout.errors import (
    AuthenticationError,
    BrokerUnavailableError,
    BusyError,
    ClientClosedError,
    ConfigError,
    InvalidRequestError,
    JobCancelledError,
    JobFailedError,
    ProtocolError,
    RolloutError,
    RolloutTimeoutError,
    StaleRolloutError,
    SyncError,
)
from zmq_rollout.protocol import ChatMessage, SamplingParams, StructuredOutput
from zmq_rollout.rollouts import Rollout, StreamRestarted, TokenDelta
from zmq_rollout.weight_sync import SyncReport

__version__ = "0.1.0"

__all__ = [
    "AsyncRolloutClient",
    "AuthenticationError",
    "BrokerUnavailableError",
    "BusyError",
    "ChatMessage",
    "ClientClosedError",
    "ConfigError",
    "InvalidRequestError",
    "JobCancelledError",
    "JobFailedError",
    "ProtocolError",
    "Rollout",
    "RolloutClient",
    "RolloutError",
    "RolloutTimeoutError",
    "SamplingParams",
    "StaleRolloutError",
    "StreamRestarted",
    "StructuredOutput",
    "SyncError",
    "SyncReport",
    "TokenDelta",
    "__version__",
]
