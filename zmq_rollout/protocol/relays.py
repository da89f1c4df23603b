"""Answers as the broker relays them, worker -> broker -> client, without decoding their tokens.

``DeltaRelay`` and ``ResultRelay`` are the broker's views of a worker's PARTIAL and FINAL: the
token payload stays raw msgpack, which msgspec still walks item by item to find where it ends.
``SealedResult`` (SEALED_FINAL) carries a result as a bin the broker steps over whole; the
worker sends it where the broker reads it and the result is worth it (``final_item``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from .base import DECODE_ERRORS, Struct
from .commands import FINAL, SEALED_FINAL
from .jobs import NIL, Result


class DeltaRelay(Struct):
    """The broker's view of a worker's ``Delta``: it routes on ``key`` and forwards the token
    payload as the raw msgpack it came in (same wire shape, no decode and re-encode)."""

    key: str | int
    index: int
    token_ids: msgspec.Raw
    logprobs: msgspec.Raw
    text: msgspec.Raw = msgspec.Raw(b"\xc0")


class ResultRelay(Struct):
    """The broker's view of a worker's ``Result`` (see ``DeltaRelay``)."""

    key: str | int
    prompt_token_ids: msgspec.Raw
    samples: msgspec.Raw
    weight_version: int
    worker_id: str

    def to_client(self, job_id: str) -> ResultRelay:
        """What the client's FINAL carries: this result, keyed by its job id."""
        self.key = job_id
        return self


class _SampledPart(Struct):
    """The start of an encoded ``Result``, as far as its samples (raw)."""

    key: msgspec.Raw
    prompt_token_ids: msgspec.Raw
    samples: msgspec.Raw


_sampled_part = msgspec.msgpack.Decoder(_SampledPart)
_encode = msgspec.msgpack.Encoder().encode


class SealedResult(Struct):
    """worker -> broker, SEALED_FINAL: a ``Result`` the broker forwards without reading it.

    ``result`` is a msgpack bin holding the ``Result``'s own encoding with a nil ``key`` (an
    array of 5 or more items whose first byte after the array's is ``c0``). A bin says its
    length, so the broker steps over it whole; a ``ResultRelay`` costs it a walk through every
    token id and logprob to find where each raw field ends (10 us for 512 prompt ids and a
    512-token sample). The broker reads ``key`` (the ticket) and ``weight_version`` (which must
    equal the sealed result's) and gives the client a plain ``Result`` (``to_client``)."""

    key: int
    weight_version: int
    result: memoryview

    def __post_init__(self) -> None:
        sealed = self.result
        if len(sealed) < 2 or not 0x95 <= sealed[0] <= 0x9F or sealed[1] != 0xC0:
            raise ValueError("a sealed result is a Result's msgpack array (5..15 items) whose key is nil")

    def to_client(self, job_id: str) -> msgspec.Raw:
        """The client's ``Result``: the sealed one with ``job_id`` for its nil key, spliced in
        (no decode; ``splice_into``)."""
        return msgspec.Raw(splice_into(bytearray(), job_id, self.result))

    @property
    def samples(self) -> msgspec.Raw:
        """The sealed result's samples, raw: read only for a result that crossed a weight sync
        (``broker/staleness.py``); nil where the sealed result does not decode so far (the
        client finds out)."""
        try:
            return _sampled_part.decode(self.result).samples
        except DECODE_ERRORS:
            return NIL


def splice_into(frame: bytearray, job_id: str, sealed: memoryview) -> bytearray:
    """Append to ``frame`` the client's ``Result`` from a ``SealedResult.result``: its array
    header, ``job_id`` in place of its nil key (``sealed[1]``), the rest as it is."""
    frame.append(sealed[0])
    frame += _encode(job_id)
    frame += sealed[2:]
    return frame


class SplicedFinal(list[Any]):
    """A client's FINAL body as the broker builds it from sealed results: each one a pair
    ``(job_id, sealed)`` (``sealed``: a ``SealedResult.result``), beside results of any other
    kind. ``codec.encode`` writes each pair as ``SealedResult.to_client`` would give it, with the
    job id spliced in as the frame is written: one copy of each result where ``to_client``
    joined it into bytes that the encoder then copied again (0.43 against 0.95 us a result of
    512 prompt ids and a 512-token sample)."""

    __slots__ = ()


SEAL_MIN_TOKENS = 64
"""A result of fewer token ids than this, prompt and samples together, goes as FINAL even to a
broker that reads SEALED_FINAL: walking its few items costs the broker less than splicing a
sealed one (``benchmarks/broker_phases.py``, 4-token samples: 2.65 us a job as FINAL, 2.98-3.13
sealed; 512 prompt ids and a 512-token sample: 20.6-21.7 against 11.5-12.4)."""


def worth_sealing(result: Result) -> bool:
    """Whether ``result`` costs the broker less sealed (``SEAL_MIN_TOKENS``)."""
    tokens = len(result.prompt_token_ids)
    for sample in result.samples:
        tokens += len(sample.token_ids)
    return tokens >= SEAL_MIN_TOKENS


def final_item(result: Result, sealed: bool) -> tuple[bytes, Result | SealedResult]:
    """The command and item that end ``result``'s ticket: SEALED_FINAL and ``result`` sealed
    where the broker reads it (``sealed``, from its ``Liveness``) and ``worth_sealing``; else
    FINAL and ``result``."""
    if sealed and worth_sealing(result):
        return SEALED_FINAL, seal(result)
    return FINAL, result


def seal(result: Result) -> SealedResult:
    """``result`` sealed for SEALED_FINAL: keyed by its ticket outside, nil inside."""
    body = _encode([None, result.prompt_token_ids, result.samples, result.weight_version, result.worker_id])
    return SealedResult(result.key, result.weight_version, memoryview(body))  # type: ignore[arg-type]
