"""How a client cuts its jobs into SUBMIT messages, and which message a whole-message error is about.

Pure: no sockets. ``pack_submits`` keeps every message under the broker's size limit (above
it the broker refuses the message; above twice it, ZeroMQ drops the connection without a
word) and under the jobs-per-message limit. ``Unanswered`` remembers the SUBMIT messages of
which no job has had any answer yet: the broker answers one peer's messages in order, so an
ERROR about a whole message (key nil) is about the oldest of them. ``settle`` marks the
futures of jobs a caller gave up on as seen (their later cancellation is expected).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec

from zmq_rollout import protocol as p
from zmq_rollout.errors import InvalidRequestError

_encoder = msgspec.msgpack.Encoder()
FRAME_OVERHEAD = 64  # signature, command, the list's header: what a SUBMIT adds to its jobs


def encode_job(job: p.JobSpec, token_bins: bool) -> bytes:
    """``job`` as a SUBMIT carries it: its sampling trimmed (``sampling_wire``) and, with
    ``token_bins`` (the broker reads them), its prompt's token ids as a token bin (``p.to_bin``;
    an id that does not fit one keeps the array)."""
    job = job.__copy__()  # type: ignore[attr-defined]  # msgspec's copy: not checked again, only forms change
    job.sampling = sampling_wire(job.sampling)  # type: ignore[assignment]  # the same value, encoded
    ids = job.prompt_token_ids
    if token_bins and ids is not None:
        data = p.to_bin(ids)  # type: ignore[arg-type]  # a JobSpec holds a list (its bytes are opened)
        if data is not None:
            job.prompt_token_ids = data
    return _encoder.encode(job)


_sampling_decoder = msgspec.msgpack.Decoder(p.SamplingParams)
_last_sampling: list[tuple[p.SamplingParams, msgspec.Raw]] = [
    (p.SamplingParams(), msgspec.Raw(p.encode_trimmed(p.SamplingParams())))
]
_trimmed: dict[bytes, msgspec.Raw] = {}
_TRIMMED_MAX = 1024


def sampling_wire(sampling: p.SamplingParams) -> msgspec.Raw:
    """``sampling`` without its trailing defaults (``p.encode_trimmed``): 1 to 20 bytes where
    msgspec writes 71, in every job the broker reads and forwards. The last one is remembered
    as a copy, compared by value (a trainer's jobs share one; a SamplingParams may change
    between calls, in place too), and others by their full encoding."""
    last = _last_sampling[0]
    if sampling == last[0]:
        return last[1]
    full = _encoder.encode(sampling)
    raw = _trimmed.get(full)
    if raw is None:
        if len(_trimmed) >= _TRIMMED_MAX:
            _trimmed.clear()
        raw = _trimmed[full] = msgspec.Raw(p.encode_trimmed(sampling))
    _last_sampling[0] = (_sampling_decoder.decode(full), raw)  # a copy that shares no list with ``sampling``
    return raw


def pack_submits(
    jobs: list[p.JobSpec], batch_size: int, max_bytes: int, *, token_bins: bool = False, sealed: bool = False
) -> list[tuple[list[str], list[msgspec.Raw]]]:
    """The jobs, encoded (``encode_job``; with ``sealed``, each sealed with the copies a
    SEALED_SUBMIT carries, ``p.SealedJob``), in messages of at most ``batch_size`` jobs and
    ``max_bytes`` bytes: ``(job ids, encoded jobs)`` per message (``submit_command`` says which
    command carries them)."""
    messages: list[tuple[list[str], list[msgspec.Raw]]] = []
    current: list[msgspec.Raw] = []
    ids: list[str] = []
    size = FRAME_OVERHEAD
    limit = min(batch_size, p.MAX_JOBS_PER_MESSAGE)
    for job in jobs:
        raw = encode_job(job, token_bins)
        if sealed:
            raw = p.sealed_job(job, raw)
        if len(raw) + FRAME_OVERHEAD > max_bytes:
            raise InvalidRequestError(
                f"job {job.job_id!r} is {len(raw)} bytes encoded, more than a message may carry "
                f"(ClientConfig.max_message_bytes={max_bytes}, which must not exceed the broker's max_message_bytes)",
                job_id=job.job_id,
            )
        if current and (len(current) >= limit or size + len(raw) > max_bytes):
            messages.append((ids, current))
            current, ids, size = [], [], FRAME_OVERHEAD
        current.append(msgspec.Raw(raw))
        ids.append(job.job_id)
        size += len(raw)
    if current:
        messages.append((ids, current))
    return messages


def submit_command(sealed: bool) -> bytes:
    """The command that carries what ``pack_submits`` made with ``sealed``."""
    return p.SEALED_SUBMIT if sealed else p.SUBMIT


class Unanswered:
    """SUBMIT messages (their job ids) of which no job has been answered yet, oldest first."""

    def __init__(self) -> None:
        self._messages: deque[tuple[int, list[str]]] = deque()
        self._message_of: dict[str, int] = {}
        self._answered: set[int] = set()
        self._seq = 0

    def __len__(self) -> int:
        return len(self._messages)

    def sent(self, job_ids: list[str]) -> None:
        self._seq += 1
        self._messages.append((self._seq, job_ids))
        for jid in job_ids:
            self._message_of[jid] = self._seq

    def answered(self, job_id: str) -> None:
        """Any answer about ``job_id`` (ACCEPTED, BUSY, ERROR, FINAL): its message was read."""
        seq = self._message_of.get(job_id)
        if seq is None:
            return
        self._answered.add(seq)
        while self._messages and self._messages[0][0] in self._answered:
            done, ids = self._messages.popleft()
            self._answered.discard(done)
            for jid in ids:
                self._message_of.pop(jid, None)

    def refused(self) -> list[str]:
        """A whole-message ERROR arrived: the job ids of the message it is about (the oldest
        unanswered), now forgotten; [] if none is waiting."""
        if not self._messages:
            return []
        _, ids = self._messages.popleft()
        for jid in ids:
            self._message_of.pop(jid, None)
        return ids


def settle(futures: Sequence[asyncio.Future[Any]]) -> None:
    """Mark what ``futures`` will end with as seen: the caller gave up on them (a sibling job
    failed, a stream was closed, a call timed out), so their later ``JobCancelledError`` is
    expected, not asyncio's "Future exception was never retrieved"."""
    for future in futures:
        future.add_done_callback(_retrieve)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
