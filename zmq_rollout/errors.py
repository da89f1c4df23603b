"""The one error tree of zmq-rollout.

::

    RolloutError
    ├── ProtocolError            a frame or message broke the wire contract
    ├── InvalidRequestError      the request itself is wrong (bad sampling, unknown model, too long)
    ├── BusyError                the broker's queue for this client is full; retry later
    ├── JobFailedError           a worker accepted the job and it failed there
    ├── JobCancelledError        the job was cancelled before it finished
    ├── StaleRolloutError        a job finished more weight versions behind the fleet than its max_staleness
    ├── RolloutTimeoutError      nothing came back in time (the message names the setting)
    ├── SyncError                a weight-sync round or one of its steps failed
    ├── BrokerUnavailableError   the broker has not answered for ClientConfig.broker_timeout_s
    ├── AuthenticationError      the broker refused this peer's CurveZMQ handshake (key not allowed, wrong key)
    ├── ConfigError              a setting is wrong (a missing or unreadable key file, keys half set)
    │   └── ChatTemplateError    a chat template cannot be split into turns (docs/multi_turn.md)
    ├── EnvironmentFailedError   an episode's environment raised, hung past its timeout, or died
    └── ClientClosedError        the client was closed (or its socket failed) while the call was pending

Errors that cross the wire carry a ``code`` (a short string, see ``ErrorCode``); the
client turns each code into exactly one class here, in ``error_from_code``. ZeroMQ
errors are translated in exactly one place too: ``Connection._try`` (the client's sends) and
``zmq_rollout.weight_sync.update`` (the data plane).
"""

from __future__ import annotations


class RolloutError(Exception):
    """Base class of every error raised by zmq-rollout."""

    code = "internal"

    def __init__(self, message: str, *, job_id: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id


class ProtocolError(RolloutError):
    code = "protocol"


class InvalidRequestError(RolloutError):
    code = "invalid_request"


class BusyError(RolloutError):
    code = "busy"


class JobFailedError(RolloutError):
    code = "job_failed"


class JobCancelledError(RolloutError):
    code = "cancelled"


class StaleRolloutError(RolloutError):
    """The job's oldest token was more than its ``max_staleness`` versions behind the fleet
    when it finished (``on_stale="abort"``, or ``"restart"`` past ``max_stale_restarts``)."""

    code = "stale"


class RolloutTimeoutError(RolloutError, TimeoutError):
    code = "timeout"


class ClientClosedError(RolloutError):
    code = "closed"


class SyncError(RolloutError):
    code = "sync"


class BrokerUnavailableError(RolloutError):
    code = "broker_unavailable"


class AuthenticationError(RolloutError):
    code = "auth"


class ConfigError(RolloutError, ValueError):
    code = "config"


_BY_CODE: dict[str, type[RolloutError]] = {
    cls.code: cls
    for cls in (
        ProtocolError,
        InvalidRequestError,
        BusyError,
        JobFailedError,
        JobCancelledError,
        StaleRolloutError,
        RolloutTimeoutError,
        ClientClosedError,
        SyncError,
        BrokerUnavailableError,
        AuthenticationError,
        ConfigError,
    )
}


def error_from_code(code: str, message: str, job_id: str | None = None) -> RolloutError:
    """Build the error class that a wire ``code`` stands for (unknown codes → RolloutError)."""
    return _BY_CODE.get(code, RolloutError)(message, job_id=job_id)


class ChatTemplateError(ConfigError):
    """The tokenizer's chat template cannot be rendered turn by turn (see docs/multi_turn.md)."""


class EnvironmentFailedError(RolloutError):
    """An environment raised, hung past ``step_timeout_s``, or its process died."""

    code = "environment"
