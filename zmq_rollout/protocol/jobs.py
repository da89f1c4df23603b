"""Jobs and their answers: what a trainer submits, what a worker runs, what comes back.

``JobSpec`` travels client -> broker (SUBMIT) and broker -> worker (JOBS, in an
``Assignment``); ``Delta`` and ``Result`` travel worker -> broker -> client (PARTIAL,
FINAL), keyed by ticket from the worker and by job id to the client; ``ErrorItem`` ends a
job with an error (ERROR, BUSY).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import msgspec

from .base import (
    DECODE_ERRORS,
    MAX_JOB_ID,
    MAX_LORA_NAME,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_STOP,
    MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    MAX_VERSION,
    Struct,
    check_finite,
    check_int,
)
from .raw_lists import check_raw_list
from .token_bins import from_bin

MAX_SESSION_ID = MAX_JOB_ID
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
MAX_TOKEN_ID = (1 << 31) - 1
MAX_STRUCTURED_CHARS = 1 << 16
MAX_CHOICES = 256
ON_STALE = ("abort", "restart")  # JobRelay.on_stale's Literal too
OnStale = Literal["abort", "restart"]


class StructuredOutput(Struct):
    """Exactly one constraint on what a sample may be, as vLLM's structured outputs: a JSON
    schema (as JSON text), a regular expression, or one of a list of strings."""

    json_schema: str | None = None
    regex: str | None = None
    choice: list[str] | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("json_schema", "regex", "choice") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"structured takes exactly one of json_schema, regex, choice; got {given or 'none'}")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str) or len(self.json_schema) > MAX_STRUCTURED_CHARS:
                raise ValueError(f"structured.json_schema is JSON text of at most {MAX_STRUCTURED_CHARS} characters")
            try:
                schema = json.loads(self.json_schema)
            except ValueError as exc:
                raise ValueError(f"structured.json_schema is not JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured.json_schema must be a JSON object (a schema)")
        if self.regex is not None:
            if not isinstance(self.regex, str) or not 0 < len(self.regex) <= MAX_STRUCTURED_CHARS:
                raise ValueError(f"structured.regex is a pattern of 1..{MAX_STRUCTURED_CHARS} characters")
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"structured.regex does not compile: {exc}") from None
        if self.choice is not None:
            choice = self.choice
            if not (isinstance(choice, list) and 0 < len(choice) <= MAX_CHOICES):
                raise ValueError(f"structured.choice is a list of 1..{MAX_CHOICES} strings")
            if not all(isinstance(c, str) and 0 < len(c) <= MAX_STRUCTURED_CHARS for c in choice):
                raise ValueError("structured.choice holds non-empty strings")


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
    include_stop_str_in_output: bool = False
    """As in vLLM: keep a matched ``stop`` string at the end of ``text``. The token ids always
    hold the tokens that made it (they are what the model sampled)."""
    skip_special_tokens: bool = True
    """As in vLLM: leave special tokens (``<|im_end|>``...) out of ``text``."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] = []
    """Token ids that end a sample like EOS (the id stays in ``token_ids``)."""
    min_tokens: int = 0
    """Tokens to generate before EOS or a stop may end a sample."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last this many prompt tokens (as vLLM's option of that name)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> bias added to its logit, as OpenAI's (-100..100)."""
    structured: StructuredOutput | None = None
    """Constrain the samples to a JSON schema, a regular expression or a choice."""

    def __post_init__(self) -> None:
        check_int("n", self.n, 1, MAX_N)
        check_finite("temperature", self.temperature, 0.0, 100.0)
        check_finite("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_int("top_k", self.top_k, -1, 1 << 20)
        check_int("max_tokens", self.max_tokens, 1, MAX_TOKENS)
        stop = self.stop
        if stop:
            if not isinstance(stop, list) or len(stop) > MAX_STOP:
                raise ValueError(f"stop takes at most {MAX_STOP} strings, as a list")
            if not all(isinstance(s, str) and s for s in stop):
                raise ValueError("stop strings must be non-empty strings")
        if self.seed is not None:
            check_int("seed", self.seed, 0, MAX_VERSION)
        check_int("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be a bool")
        check_finite("min_p", self.min_p, 0.0, 1.0)
        check_finite("repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True)
        check_finite("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_finite("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        ids = self.stop_token_ids
        if ids and not (isinstance(ids, list) and len(ids) <= MAX_STOP_TOKEN_IDS):
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, as a list")
        for tid in ids:
            check_int("stop_token_ids", tid, 0, MAX_TOKEN_ID)
        check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.truncate_prompt_tokens is not None:
            check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, MAX_PROMPT_TOKENS)
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias maps at most {MAX_LOGIT_BIAS} token ids to a bias")
            for tid, value in bias.items():
                check_int("logit_bias token id", tid, 0, MAX_TOKEN_ID)
                check_finite(f"logit_bias[{tid}]", value, -100.0, 100.0)


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
    prompt_token_ids: list[int] | bytes | None = None
    """The prompt as token ids. On the wire, a msgpack array, or a token bin (``token_bins.py``:
    4-byte little-endian ids, between peers that read it); a bin given or decoded here is opened
    into the list at once."""
    stream: bool = False
    min_weight_version: int = 0
    lora: str | None = None
    """The LoRA adapter to sample with (a name given to ``update_lora``); None: the base model."""
    resubmitted: bool = False
    """Sent again after the broker restarted or forgot the client: a job of this id that the
    broker already has is acknowledged, not refused as a duplicate, and runs once."""
    session_id: str | None = None
    """The episode this job is a turn of (scoped to the client, like job ids): the broker sends
    it to the worker that served the session's last turn, whose prefix cache holds its prompt."""
    session_end: bool = False
    """This is the session's last turn: the broker forgets the session once it is dispatched."""
    max_staleness: int | None = None
    """At most this many weight versions between the job's oldest token and the fleet when it
    finishes (a sync committed while it ran); else ``on_stale``. None: no limit. The broker
    counts a result that crossed a sync without per-token versions as made by the version its
    worker had at dispatch (never younger than it was)."""
    on_stale: str = "abort"
    """With ``max_staleness``: ``"abort"`` answers the job with a ``stale`` error (the client
    raises ``StaleRolloutError``); ``"restart"`` runs it again from the start on the fleet's
    weights, at most ``BrokerConfig.max_stale_restarts`` times, then ``stale``."""
    ack: bool = True
    """The broker answers ACCEPTED when it queues the job; false: it does not (one message
    less per SUBMIT; the reference client asks for none). A streamed job that starts over is
    announced with ACCEPTED either way."""

    def __post_init__(self) -> None:
        _check_job(self)

    def cost(self) -> int:
        """Credits this job occupies on a worker: one per sequence."""
        return self.sampling.n


_sampling_decoder = msgspec.msgpack.Decoder(SamplingParams)
_sampling_checked: dict[bytes, int | str] = {}
_SAMPLING_CHECKED_MAX = 4096


def sampling_n(raw: msgspec.Raw) -> int:
    """The ``n`` of an encoded SamplingParams, checked as a SamplingParams is on decode; raises
    ValueError if it is not one. Each distinct encoding is decoded once and remembered (a
    trainer's jobs share a few): this was a fifth of the broker's time per job."""
    key = bytes(raw)
    known = _sampling_checked.get(key)
    if known is None:
        try:
            known = _sampling_decoder.decode(key).n
        except DECODE_ERRORS as exc:
            known = f"sampling: {exc}"
        if len(_sampling_checked) >= _SAMPLING_CHECKED_MAX:
            _sampling_checked.clear()
        _sampling_checked[key] = known
    if type(known) is str:
        raise ValueError(known)
    return known  # type: ignore[return-value]


_DEFAULT_SAMPLING = msgspec.Raw(msgspec.msgpack.encode(SamplingParams()))
NIL = msgspec.Raw(b"\xc0")
"""msgpack's nil, raw: a ``JobRelay`` input that is absent."""


_last_sampling: list[tuple[msgspec.Raw | None, int]] = [(None, 0)]
"""The sampling the last ``JobRelay`` decoded had, checked, and its ``n``: a SUBMIT's jobs mostly
share one, and comparing it costs a third of copying it for ``_sampling_checked``. One tuple,
replaced whole: brokers on two threads read a pair that belongs together."""


IdText = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_JOB_ID)]
"""A job or session id as the broker's views of a job check it while decoding (``JobRelay``,
``SealedJob``)."""
VersionInt = Annotated[int, msgspec.Meta(ge=0, le=MAX_VERSION)]
"""A weight version (or a count of them) as those views check it."""


class JobRelay(Struct):
    """The broker's view of a ``JobSpec`` (SUBMIT in, JOBS out): the same fields, in the same wire
    shape, but what the broker need not look inside stays the raw msgpack it came in and goes
    to the worker as it came: ``sampling`` (checked once per distinct encoding, through
    ``sampling_n``: the broker needs its ``n``), ``messages`` and ``prompt_token_ids`` (only
    their item counts are checked here; the worker decodes each job on its own, ``unseal``,
    and answers one it cannot run with an error). Token ids cost the broker no object per id:
    decoding and re-encoding a 512-id prompt was 3-4x its whole work for a job. The rules on
    one field are msgspec constraints, checked in C while decoding; ``__post_init__`` keeps
    those across fields. Never built in Python."""

    job_id: IdText
    sampling: msgspec.Raw = _DEFAULT_SAMPLING
    prompt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PROMPT_CHARS)] | None = None
    messages: msgspec.Raw = NIL
    """Raw: the worker decodes and checks the messages; here only that they are a list of 1..MAX_MESSAGES."""
    prompt_token_ids: msgspec.Raw = NIL
    """Raw: the worker checks each id; here only that they are a list, or a token bin, of
    1..MAX_PROMPT_TOKENS (a bin costs no walk: ``token_bins.py``)."""
    stream: bool = False
    min_weight_version: VersionInt = 0
    lora: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_LORA_NAME)] | None = None
    resubmitted: bool = False
    session_id: IdText | None = None
    session_end: bool = False
    max_staleness: VersionInt | None = None
    on_stale: Literal["abort", "restart"] = "abort"
    ack: bool = True

    def __post_init__(self) -> None:
        # Runs in Python for every job the broker decodes: written for speed (a third of decoding).
        if self.prompt is None:
            if self.messages == NIL:
                if self.prompt_token_ids == NIL:
                    raise ValueError("give exactly one of prompt, messages, prompt_token_ids")
                check_raw_list("prompt_token_ids", self.prompt_token_ids, MAX_PROMPT_TOKENS, token_bin=True)
            elif self.prompt_token_ids == NIL:
                check_raw_list("messages", self.messages, MAX_MESSAGES)
            else:
                raise ValueError("give exactly one of prompt, messages, prompt_token_ids")
        elif self.messages != NIL or self.prompt_token_ids != NIL:
            raise ValueError("give exactly one of prompt, messages, prompt_token_ids")
        if self.session_end and self.session_id is None:
            raise ValueError("session_end must be a bool, and true only with a session_id")
        sampling = self.sampling
        if sampling != _last_sampling[0][0]:  # not the last job's: check it (raises ValueError)
            _last_sampling[0] = (sampling.copy(), sampling_n(sampling))  # a copy: not a view of the message

    def cost(self) -> int:
        """Credits this job occupies on a worker: one per sequence."""
        last = _last_sampling[0]
        return last[1] if self.sampling == last[0] else sampling_n(self.sampling)


def _check_job(job: JobSpec) -> None:
    """The rules a job's own fields follow (its sampling is checked as a SamplingParams)."""
    if not (isinstance(job.job_id, str) and 0 < len(job.job_id) <= MAX_JOB_ID):
        raise ValueError(f"job_id must be a string of 1..{MAX_JOB_ID} characters")
    if type(job.sampling) is not SamplingParams:
        raise ValueError(f"sampling must be a SamplingParams, got {type(job.sampling).__name__}")
    prompt, messages, ids = job.prompt, job.messages, job.prompt_token_ids
    if type(ids) is bytes:  # a token bin: the ids as a list from here on
        job.prompt_token_ids = ids = from_bin(ids)
    if (prompt is not None) + (messages is not None) + (ids is not None) != 1:
        raise ValueError("give exactly one of prompt, messages, prompt_token_ids")
    if prompt is not None and not 0 < len(prompt) <= MAX_PROMPT_CHARS:
        raise ValueError("prompt must be 1..1 MiB characters")
    if messages is not None and not 0 < len(messages) <= MAX_MESSAGES:
        raise ValueError(f"messages must hold 1..{MAX_MESSAGES} items")
    if ids is not None and not (0 < len(ids) <= MAX_PROMPT_TOKENS and min(ids) >= 0):
        raise ValueError("prompt_token_ids must hold 1..1M non-negative ids")
    if job.min_weight_version:
        check_int("min_weight_version", job.min_weight_version, 0, MAX_VERSION)
    if job.lora is not None and not (isinstance(job.lora, str) and 0 < len(job.lora) <= MAX_LORA_NAME):
        raise ValueError(f"lora must be an adapter name of 1..{MAX_LORA_NAME} characters")
    sid = job.session_id
    if sid is not None and not (isinstance(sid, str) and 0 < len(sid) <= MAX_SESSION_ID):
        raise ValueError(f"session_id must be a string of 1..{MAX_SESSION_ID} characters")
    if job.session_end and (job.session_end is not True or sid is None):
        raise ValueError("session_end must be a bool, and true only with a session_id")
    if job.max_staleness is not None:
        check_int("max_staleness", job.max_staleness, 0, MAX_VERSION)
    if job.on_stale not in ON_STALE:
        raise ValueError(f"on_stale must be one of {', '.join(ON_STALE)}")
    if type(job.ack) is not bool:
        raise ValueError("ack must be a bool")


class Assignment(Struct):
    """broker -> worker: run ``job`` under ``ticket`` (the broker's id for this attempt)."""

    ticket: int
    job: JobSpec


class AssignmentRelay(Struct):
    """What the broker encodes for an ``Assignment`` (never decoded): its job is a ``JobRelay``,
    a sealed job's bytes (``SealedJob.job``), or a ``JobSpec`` where one was given in Python
    (tests, embedding). Same wire shape; ``cost``, the credits the broker charged, after it."""

    ticket: int
    job: JobRelay | JobSpec | msgspec.Raw
    cost: int = 0


class Delta(Struct):
    """Streamed tokens of one sample. ``key`` is the job id (to clients) or ticket (from workers)."""

    key: str | int
    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str | None = None
    """The text these tokens add, as vLLM detokenizes it while streaming (it may hold back a
    partial character or a possible stop string until a later delta); the deltas' texts join
    to the sample's ``text``. None from a worker that does not send it."""


class Sample(Struct):
    """One completion. ``weight_versions`` is set only when the sample spans a weight sync:
    then it holds the version that produced each token (else all are the Result's)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    top_logprobs: list[dict[int, float]] | None = None
    weight_versions: list[int] | None = None
    text: str | None = None
    """The completion as vLLM detokenized it (``stop`` strings cut as vLLM cuts them); the
    token ids stay the source of truth."""


class Result(Struct):
    """The final answer of a job. ``key`` is the job id (to clients) or ticket (from workers)."""

    key: str | int
    prompt_token_ids: list[int]
    samples: list[Sample]
    weight_version: int
    worker_id: str

    def to_client(self, job_id: str) -> Result:
        """What the client's FINAL carries: this result, keyed by its job id (the broker relays
        a ``Result`` given in Python, in tests and embedding, as a ``ResultRelay``)."""
        self.key = job_id
        return self


class ErrorItem(Struct):
    """An error about one job (``key``) or about the whole message (``key`` is None)."""

    key: str | int | None
    code: str
    message: str
