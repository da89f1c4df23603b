"""Who is in the fleet: a worker's READY, and the broker's STATUS_REPLY."""

from __future__ import annotations

import msgspec

from .base import MAX_VERSION, Struct, check_int


class WorkerInfo(Struct):
    """worker -> broker READY: who I am and how many credits (sequences at once) I take."""

    name: str
    model: str
    credits: int
    weight_version: int = 0
    capabilities: list[str] = []
    max_model_len: int = 0
    num_ranks: int = 1
    """Ranks this worker brings to a weight-sync collective (its tensor-parallel size)."""

    def __post_init__(self) -> None:
        if not 0 < len(self.name) <= 256:
            raise ValueError("worker name must be 1..256 characters")
        check_int("credits", self.credits, 0, 1 << 20)
        check_int("weight_version", self.weight_version, 0, MAX_VERSION)


class Liveness(Struct):
    """broker -> client HEARTBEAT (and broker -> worker, in answer to READY): who answers, so
    that a client can tell a restart, and what the broker reads."""

    epoch: str
    """This broker process's id, new at every start."""
    new_session: bool = False
    """The broker did not know this client before this heartbeat (it restarted, or the client
    was silent past client_expiry_s): nothing the client had in flight is there any more."""
    packed: bool = False
    """The broker reads messages in the packed form (docs/protocol.md section 2); a broker older
    than this field leaves it out, and its peers send the split form."""
    sealed: bool = False
    """The broker reads SEALED_FINAL (results sealed in a bin, docs/protocol.md section 5.3); a
    broker older than this field leaves it out, and its workers send FINAL."""
    token_bins: bool = False
    """The broker reads a job's ``prompt_token_ids`` as a token bin (docs/protocol.md section 5.8,
    ``token_bins.py``); a broker older than this field leaves it out, and its clients send arrays."""
    sealed_jobs: bool = False
    """The broker reads SEALED_SUBMIT (each job sealed beside the fields the broker reads,
    docs/protocol.md section 5.9); a broker older than this field leaves it out, and its clients
    send SUBMIT."""


class WorkerStatus(Struct):
    name: str
    state: str
    """``ready``; ``syncing`` (a member of the running sync round); ``stale`` (below the fleet version)."""
    model: str
    credits: int
    running: int
    """Jobs running on it."""
    weight_version: int
    idle_s: float
    """Seconds since the broker last heard from it."""
    capabilities: list[str] = []
    """What it said it can do in its READY (``generate``, ``lora``, ``weight_sync:shm`` ...)."""
    max_model_len: int = 0
    """Its engine's longest prompt + completion, in tokens."""
    num_ranks: int = 1
    """Ranks it brings to a weight-sync collective (its tensor-parallel size), as its READY said."""


class ClientStatus(Struct):
    name: str
    queued: int
    running: int


class JobTotals(Struct):
    """Jobs counted since the broker started."""

    submitted: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    requeued: int = 0


class StatusReply(Struct):
    workers: list[WorkerStatus]
    clients: list[ClientStatus]
    queued: int
    running: int
    fleet_version: int = 0
    totals: JobTotals = msgspec.field(default_factory=JobTotals)
    environments: list[str] = []
    """The multi-turn environments the *asking client's* process can build (its entry points
    and registrations: docs/multi_turn.md). The broker sends it empty; the client fills it."""
