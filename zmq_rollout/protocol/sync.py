"""Weight sync on the wire: the messages of a round (SYNC, SYNC_REPLY, CONTROL, CONTROL_ACK).

A trainer drives a round one step at a time (SYNC ``SyncStep``); the broker sends the same
step to every member (CONTROL ``Control``, plus the member's ranks in a collective) and
answers with one SYNC_REPLY once every member has answered (CONTROL_ACK) or been evicted.
The steps themselves are in ``steps.py``.
"""

from __future__ import annotations

from .base import Struct, check_finite
from .steps import AckResult, AnySyncOp


class SyncStep(Struct):
    """trainer -> broker (SYNC): run ``op`` on every member of round ``round_id``.

    A member that has not answered ``timeout_s`` seconds after the step went out is
    evicted (told to DISCONNECT, its jobs requeued); the step completes for the others.
    """

    round_id: int
    """The round, from its ``begin`` reply (for ``begin`` itself: ignored, send 0)."""
    op: AnySyncOp
    """The step (section 8.2)."""
    timeout_s: float = 60.0
    """0.001..86400: seconds each member has to answer before it is evicted."""

    def __post_init__(self) -> None:
        check_finite("timeout_s", self.timeout_s, 0.001, 86_400.0)


class WorkerAck(Struct):
    """A member's answer to a step, under its name."""

    name: str
    """The worker's name (``WorkerInfo.name``)."""
    ok: bool
    """False: the step failed there (``message`` says why); it stays a member."""
    result: AckResult = None
    """What the step answers (section 8.2)."""
    message: str = ""


class Evicted(Struct):
    """A member that left the round during a step: evicted at the step's deadline, expired,
    disconnected or unroutable."""

    name: str
    reason: str
    """For humans, e.g. ``evicted: no answer to 'receive_bucket' within its timeout``."""


class SyncReply(Struct):
    """broker -> trainer (SYNC_REPLY): the outcome of one ``SyncStep``."""

    round_id: int
    """The round (for a refused step: the ``round_id`` it was sent with)."""
    op: str
    """The step's name."""
    acks: list[WorkerAck]
    """One per member that answered, in the order the answers came."""
    evicted: list[Evicted] = []
    """Members lost during this step (or, not yet reported, since the last one)."""
    fleet_version: int = 0
    """The broker's fleet version after the step (section 8.1)."""
    error: str = ""
    """Non-empty: the step was refused as a whole and sent to no worker (no such round, another
    round running, a step still running); ``acks`` and ``evicted`` are then empty."""


class Control(Struct):
    """broker -> worker (CONTROL): a step of round ``round_id`` for this member; its ranks in
    a collective are ``rank_offset`` .. ``rank_offset`` + its ``num_ranks`` - 1 of ``world_size``."""

    round_id: int
    op: AnySyncOp
    """The trainer's step, unchanged."""
    rank_offset: int = 0
    """This member's first rank in a collective (the trainer is rank 0)."""
    world_size: int = 0
    """1 + the ranks of every member still in the round."""


class ControlAck(Struct):
    """worker -> broker (CONTROL_ACK): exactly one per CONTROL."""

    round_id: int
    op: str
    """The step's name (informational: acks are matched on round and sender)."""
    ok: bool
    weight_version: int
    """The worker's version after the step."""
    message: str = ""
    """When not ``ok``: ``"ExceptionType: text"``."""
    result: AckResult = None
    """What the step answers (section 8.2)."""
