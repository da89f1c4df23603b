"""What can be saved of a SUBMIT that fails to decode as a whole.

The broker answers bad input per job where it can: a SUBMIT with one invalid job still runs
the others, and every refusal names the job ids it can read (a client that asked for no
ACCEPTED could not tell otherwise which of its messages an error without a key is about).
Pure functions of the raw header; no sockets.
"""

from __future__ import annotations

from typing import Any

import msgspec

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.errors import ProtocolError

_job_decoders: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
    p.SUBMIT: msgspec.msgpack.Decoder(p.JobRelay),
    p.SEALED_SUBMIT: msgspec.msgpack.Decoder(p.SealedJob),
}
"""How each of the two commands that submit jobs carries one (``codec.BROKER_FROM_CLIENT``)."""
_raw_list = msgspec.msgpack.Decoder(list[msgspec.Raw])
_str = msgspec.msgpack.Decoder(str)


SUBMITS = (p.SUBMIT, p.SEALED_SUBMIT)
"""The commands that submit jobs."""


def submitted(frames: Any) -> tuple[bytes, Any] | None:
    """The command and undecoded header of a message (no identity) that submits jobs, in either
    form; else None: for the answer to one whose body does not decode."""
    try:
        found = codec.parts(frames)
    except ProtocolError:
        return None
    return (found.command, found.header) if found.command in SUBMITS else None


def job_id_of(raw: Any) -> str | None:
    """A raw job's id: its first item, when that is a string (else None)."""
    try:
        items = _raw_list.decode(raw)
        return _str.decode(items[0]) if items else None
    except codec.DECODE_ERRORS:
        return None


def submit_ids(header: Any) -> list[str]:
    """The job ids readable in a SUBMIT's header; [] if the header is not a list."""
    try:
        raws = _raw_list.decode(header)
    except codec.DECODE_ERRORS:
        return []
    return [jid for jid in map(job_id_of, raws) if jid is not None]


def split_submit(header: Any, command: bytes = p.SUBMIT) -> tuple[list[p.JobRelay | p.SealedJob], list[p.ErrorItem]]:
    """Salvage a SUBMIT (or SEALED_SUBMIT, ``command``) that failed to decode as a whole: valid
    jobs go on, each invalid one gets an error naming its job id (when one can be read; both
    forms start a job with it). Raises ProtocolError if the header is not even a list."""
    try:
        raws = _raw_list.decode(header)
    except codec.DECODE_ERRORS as exc:
        raise ProtocolError(f"invalid submit message: {exc}") from None
    jobs: list[p.JobRelay | p.SealedJob] = []
    errors: list[p.ErrorItem] = []
    decode = _job_decoders[command].decode
    for raw in raws:
        try:
            jobs.append(decode(raw))
        except codec.DECODE_ERRORS as exc:
            errors.append(p.ErrorItem(job_id_of(raw), "invalid_request", f"invalid job: {exc}"))
    return jobs, errors
