"""The zmq-rollout wire protocol, version 1 (``ZR1``): commands and message bodies.

Every message is a list of ZeroMQ frames::

    [identity]  only on a ROUTER socket (added/removed by ZeroMQ)
    b"ZR1"      protocol signature and version
    command     one byte, see the constants below; the receiver demuxes on it first
    header      one msgpack object, the command's body (schemas below)
    blobs...    optional raw frames, referenced by index from a header (weight sync)

Bodies are msgspec Structs with ``array_like=True``: a Struct is a msgpack *array* of its
fields in declaration order; trailing fields equal to their default may be omitted.
docs/protocol.md documents each one for implementers in other languages.

Validation is part of decoding: types by msgspec, ranges and cross-field rules in
``__post_init__`` (which also runs when a Struct is built in Python), so a message that
decodes is a message the receiver can act on.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

SIGNATURE = b"ZR1"

# -- commands ------------------------------------------------------------------------------
# client -> broker
SUBMIT = b"\x01"  # list[JobSpec]; one or many jobs
CANCEL = b"\x02"  # list[str] job ids (client) / list[int] tickets (broker -> worker)
STATUS = b"\x03"  # nil
HEARTBEAT = b"\x04"  # nil; both ways, client<->broker and worker<->broker
DISCONNECT = b"\x05"  # nil; client->broker "I am leaving"; broker->worker "reconnect fresh"
SYNC = b"\x06"  # SyncStep: one step of a weight-sync round (trainer -> broker)
# broker -> client
ACCEPTED = b"\x11"  # list[str] job ids now queued
PARTIAL = b"\x12"  # list[Delta]; also worker -> broker (keyed by ticket)
FINAL = b"\x13"  # list[Result]; also worker -> broker (keyed by ticket)
ERROR = b"\x14"  # list[ErrorItem]; also worker -> broker (keyed by ticket)
BUSY = b"\x15"  # list[ErrorItem]: the client's queue is full, retry later
STATUS_REPLY = b"\x16"  # StatusReply
SYNC_REPLY = b"\x17"  # SyncReply: the outcome of a SyncStep
# worker -> broker
READY = b"\x21"  # WorkerInfo: register (or re-register) with credits
CREDIT = b"\x22"  # int: the worker's capacity changed (absolute number of credits)
CONTROL_ACK = b"\x23"  # ControlAck: answer to a CONTROL step (weight sync)
# broker -> worker
JOBS = b"\x31"  # list[Assignment]
CONTROL = b"\x32"  # Control: a step of a weight-sync round, for this worker

COMMAND_NAMES = {
    SUBMIT: "submit",
    CANCEL: "cancel",
    STATUS: "status",
    SYNC: "sync",
    SYNC_REPLY: "sync_reply",
    HEARTBEAT: "heartbeat",
    DISCONNECT: "disconnect",
    ACCEPTED: "accepted",
    PARTIAL: "partial",
    FINAL: "final",
    ERROR: "error",
    BUSY: "busy",
    STATUS_REPLY: "status_reply",
    READY: "ready",
    CREDIT: "credit",
    CONTROL_ACK: "control_ack",
    JOBS: "jobs",
    CONTROL: "control",
}

# -- limits (checked on decode) --------------------------------------------------------------
MAX_JOB_ID = 128
MAX_JOBS_PER_MESSAGE = 4096
MAX_PROMPT_CHARS = 1 << 20
MAX_PROMPT_TOKENS = 1 << 20
MAX_N = 256
MAX_TOKENS = 1 << 20
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_MESSAGES = 1024


class Struct(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of every wire body. Extra trailing array items are ignored (forward compatible)."""


# The checks run for every job on the broker's hot path: each tests first and builds its
# message only on failure (formatting on every call was a quarter of the broker's time).


def _finite(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    # NaN and infinities fail the range comparisons; bool is not a number here.
    if type(value) in (float, int) and (lo < value if lo_open else lo <= value) and value <= hi:
        return
    if type(value) not in (float, int) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    raise ValueError(f"{name}={value} is outside {'(' if lo_open else '['}{lo}, {hi}]")


def _int(name: str, value: int, lo: int, hi: int) -> None:
    if type(value) is int and lo <= value <= hi:
        return
    if type(value) is not int:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    raise ValueError(f"{name}={value} is outside [{lo}, {hi}]")


class SamplingParams(Struct):
    """How to sample. Validated on construction and on decode, before anything reaches vLLM.

    ``logprobs`` is how many *top* logprobs to return per token beside the sampled token's
    own logprob, which every rollout always carries (processed: after temperature/top-k/top-p).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: list[str] = []
    seed: int | None = None
    logprobs: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _int("n", self.n, 1, MAX_N)
        _finite("temperature", self.temperature, 0.0, 100.0)
        _finite("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _int("top_k", self.top_k, -1, 1 << 20)
        _int("max_tokens", self.max_tokens, 1, MAX_TOKENS)
        stop = self.stop
        if stop:
            if not isinstance(stop, list) or len(stop) > MAX_STOP:
                raise ValueError(f"stop takes at most {MAX_STOP} strings, as a list")
            if not all(isinstance(s, str) and s for s in stop):
                raise ValueError("stop strings must be non-empty strings")
        if self.seed is not None:
            _int("seed", self.seed, 0, (1 << 63) - 1)
        _int("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if type(self.ignore_eos) is not bool:
            raise ValueError("ignore_eos must be a bool")


class ChatMessage(Struct):
    role: str
    content: str


class JobSpec(Struct):
    """One inference job. Exactly one of ``prompt``, ``messages``, ``prompt_token_ids``.

    ``min_weight_version``: the broker never dispatches the job to a worker whose weights
    are older (weight sync; 0 accepts any worker).
    """

    job_id: str
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None
    stream: bool = False
    min_weight_version: int = 0
    lora: str | None = None
    """The LoRA adapter to sample with (a name given to ``update_lora``); None: the base model."""

    def __post_init__(self) -> None:
        if not (isinstance(self.job_id, str) and 0 < len(self.job_id) <= MAX_JOB_ID):
            raise ValueError(f"job_id must be a string of 1..{MAX_JOB_ID} characters")
        prompt, messages, ids = self.prompt, self.messages, self.prompt_token_ids
        if (prompt is not None) + (messages is not None) + (ids is not None) != 1:
            raise ValueError("give exactly one of prompt, messages, prompt_token_ids")
        if prompt is not None and not 0 < len(prompt) <= MAX_PROMPT_CHARS:
            raise ValueError("prompt must be 1..1 MiB characters")
        if messages is not None and not 0 < len(messages) <= MAX_MESSAGES:
            raise ValueError(f"messages must hold 1..{MAX_MESSAGES} items")
        if ids is not None and not (0 < len(ids) <= MAX_PROMPT_TOKENS and min(ids) >= 0):
            raise ValueError("prompt_token_ids must hold 1..1M non-negative ids")
        if self.min_weight_version:
            _int("min_weight_version", self.min_weight_version, 0, (1 << 63) - 1)
        if self.lora is not None and not (isinstance(self.lora, str) and 0 < len(self.lora) <= MAX_LORA_NAME):
            raise ValueError(f"lora must be an adapter name of 1..{MAX_LORA_NAME} characters")

    def cost(self) -> int:
        """Credits this job occupies on a worker: one per sequence."""
        return self.sampling.n


class Assignment(Struct):
    """broker -> worker: run ``job`` under ``ticket`` (the broker's id for this attempt)."""

    ticket: int
    job: JobSpec


class Delta(Struct):
    """Streamed tokens of one sample. ``key`` is the job id (to clients) or ticket (from workers)."""

    key: str | int
    index: int
    token_ids: list[int]
    logprobs: list[float]


class Sample(Struct):
    """One completion. ``weight_versions`` is set only when the sample spans a weight sync:
    then it holds the version that produced each token (else all are the Result's)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    top_logprobs: list[dict[int, float]] | None = None
    weight_versions: list[int] | None = None


class Result(Struct):
    """The final answer of a job. ``key`` is the job id (to clients) or ticket (from workers)."""

    key: str | int
    prompt_token_ids: list[int]
    samples: list[Sample]
    weight_version: int
    worker_id: str


class DeltaRelay(Struct):
    """The broker's view of a worker's ``Delta``: it routes on ``key`` and forwards the token
    payload as the raw msgpack it came in (same wire shape, no decode and re-encode)."""

    key: str | int
    index: int
    token_ids: msgspec.Raw
    logprobs: msgspec.Raw


class ResultRelay(Struct):
    """The broker's view of a worker's ``Result`` (see ``DeltaRelay``)."""

    key: str | int
    prompt_token_ids: msgspec.Raw
    samples: msgspec.Raw
    weight_version: int
    worker_id: str


class ErrorItem(Struct):
    """An error about one job (``key``) or about the whole message (``key`` is None)."""

    key: str | int | None
    code: str
    message: str


class WorkerInfo(Struct):
    """worker -> broker READY: who I am and how much I can take."""

    name: str
    model: str
    credits: int
    weight_version: int = 0
    capabilities: list[str] = []
    max_model_len: int = 0
    num_ranks: int = 1  # ranks this worker brings to a collective (its tensor-parallel size)

    def __post_init__(self) -> None:
        if not 0 < len(self.name) <= 256:
            raise ValueError("worker name must be 1..256 characters")
        _int("credits", self.credits, 0, 1 << 20)
        _int("weight_version", self.weight_version, 0, (1 << 63) - 1)


MAX_LORA_NAME = 128

SYNC_OPS = frozenset(
    {"begin", "check_names", "begin_update", "load_shm", "load_ipc", "join_group", "receive_bucket", "leave_group",
     "finish_update", "lora_bucket", "load_lora", "commit", "abort"}
)  # fmt: skip
PAUSE_MODES = frozenset({"abort", "wait", "keep"})


class SyncStep(Struct):
    """trainer -> broker: run ``op`` on every worker of round ``round_id`` and report.

    ``begin`` opens a round (the broker numbers it; ``round_id`` is ignored) and pauses every
    worker per ``args["pause"]``; ``commit`` sets ``args["version"]`` and resumes them;
    ``abort`` resumes them with their old weights. Workers that do not answer within
    ``timeout`` seconds are evicted (told to DISCONNECT, their jobs requeued).
    """

    round_id: int
    op: str
    args: dict[str, Any] = {}
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.op not in SYNC_OPS:
            raise ValueError(f"unknown sync op {self.op!r}; expected one of {sorted(SYNC_OPS)}")
        _finite("timeout", self.timeout, 0.001, 86_400.0)


class WorkerAck(Struct):
    name: str
    ok: bool
    result: Any = None
    message: str = ""


class Evicted(Struct):
    name: str
    reason: str


class SyncReply(Struct):
    round_id: int
    op: str
    acks: list[WorkerAck]
    evicted: list[Evicted] = []
    fleet_version: int = 0
    error: str = ""  # set when the step was refused as a whole (no round, another round running)


class Control(Struct):
    """broker -> worker: a step of a weight-sync round. ``args`` carries the step's
    arguments plus, for collectives, this worker's ``rank_offset``."""

    round_id: int
    op: str
    args: dict[str, Any] = {}


class ControlAck(Struct):
    round_id: int
    op: str
    ok: bool
    weight_version: int
    message: str = ""
    result: Any = None


class WorkerStatus(Struct):
    name: str
    state: str
    model: str
    credits: int
    in_flight: int
    weight_version: int
    idle_seconds: float


class ClientStatus(Struct):
    name: str
    queued: int
    running: int


class StatusReply(Struct):
    workers: list[WorkerStatus]
    clients: list[ClientStatus]
    queued: int
    running: int
    fleet_version: int = 0
