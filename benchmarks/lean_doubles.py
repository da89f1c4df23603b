"""Byte templates for the benchmark's test doubles: SUBMITs and answers made by splicing.

Every job a benchmark client sends is the same but for its id, and every answer a worker double
gives is the same but for its ticket. So the lean doubles encode one ``JobSpec`` and one
``Result`` (or ``SealedResult``) once, and make each message by splicing ids into those bytes;
a client counts what it gets back from the body's array header. The bytes are exactly what
``codec.encode`` makes of the same objects (``tests/unit/test_lean_doubles.py``), so the broker
does the same work for them; the doubles spend a fraction of the CPU (the ``echo`` doubles,
which build and read every object, took two thirds of the 2 cores and capped the benchmark below
its goal whatever the broker cost).

TEST DOUBLES: none of this is the product's client or worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.codec import array_header  # msgpack's header of an array of n items
from zmq_rollout.submissions import encode_job

_encode = msgspec.msgpack.Encoder().encode
_MARK = "\x00job-id\x00"


def array_length(body: Any) -> int:
    """The item count of the msgpack array that ``body`` starts with (ValueError if it does not)."""
    first = body[0]
    if 0x90 <= first <= 0x9F:
        return int(first & 0x0F)
    if first == 0xDC:
        return int.from_bytes(body[1:3], "big")
    if first == 0xDD:
        return int.from_bytes(body[1:5], "big")
    raise ValueError(f"not a msgpack array: first byte {first:#x}")


class SubmitTemplate:
    """SUBMIT messages of copies of ``job``, each under its own id; its token ids as a token bin
    with ``token_bins`` (``zmq_rollout.submissions.encode_job``); SEALED_SUBMIT with ``sealed``
    (``p.SealedJob``: the id twice, in the job and in its copy)."""

    def __init__(self, job: p.JobSpec, token_bins: bool = False, sealed: bool = False) -> None:
        marked = msgspec.structs.replace(job, job_id=_MARK)
        raw = encode_job(marked, token_bins)
        if sealed:
            raw = p.sealed_job(marked, raw)
        self._pieces = raw.split(_encode(_MARK))
        if len(self._pieces) != 2 + sealed:
            raise ValueError("the job's bytes hold its id's marker more often than its id")
        self.command = p.SEALED_SUBMIT if sealed else p.SUBMIT

    def frames(self, job_ids: Sequence[str], packed: bool) -> list[bytes]:
        """A SUBMIT of the template's job under each of ``job_ids``, in either form."""
        pieces = self._pieces
        body = b"".join([array_header(len(job_ids)), *(_encode(j).join(pieces) for j in job_ids)])
        return _frames(self.command, body, packed)


class AnswerTemplate:
    """A worker double's answers: ``result`` for every ticket, as FINAL or, where ``sealed`` and
    the result is worth it (``p.final_item``), as SEALED_FINAL."""

    def __init__(self, result: p.Result, sealed: bool) -> None:
        self.command, item = p.final_item(result, sealed)
        if self.command == p.SEALED_FINAL:
            first = _encode(p.SealedResult(0, item.weight_version, item.result))  # type: ignore[union-attr]
            prefix = b"\x93\x00"
        else:
            first = _encode(msgspec.structs.replace(result, key=0))
            prefix = b"\x95\x00"
        if not first.startswith(prefix):
            raise ValueError(f"unexpected encoding of an answer: {first[:8]!r}")
        self._head, self._tail = prefix[:1], first[2:]

    def frames(self, tickets: Iterable[int], packed: bool) -> list[bytes]:
        """One message answering each of ``tickets``."""
        head, tail = self._head, self._tail
        items = [b"".join((head, _encode(t), tail)) for t in tickets]
        return _frames(self.command, b"".join([array_header(len(items)), *items]), packed)


def _frames(command: bytes, body: bytes, packed: bool) -> list[bytes]:
    if packed:
        return [p.SIGNATURE + command + body]
    return [p.SIGNATURE, command, body]


def count_answer(frames: Sequence[Any]) -> tuple[int, int]:
    """(jobs finished, jobs failed) in one broker message to a client, from its body's array
    header (FINAL; ERROR and BUSY); (0, 0) for any other command."""
    command, header, _, _ = codec.parts(frames)
    if command == p.FINAL:
        return array_length(header), 0
    if command in (p.ERROR, p.BUSY):
        return 0, array_length(header)
    return 0, 0
