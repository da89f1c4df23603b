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

_job_decoder = msgspec.msgpack.Decoder(p.JobRelay)
_raw_list = msgspec.msgpack.Decoder(list[msgspec.Raw])
_str = msgspec.msgpack.Decoder(str)


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


def split_submit(header: Any) -> tuple[list[p.JobRelay], list[p.ErrorItem]]:
    """Salvage a SUBMIT that failed to decode as a whole: valid jobs go on, each invalid one
    gets an error naming its job id (when one can be read). Raises ProtocolError if the
    header is not even a list."""
    try:
        raws = _raw_list.decode(header)
    except codec.DECODE_ERRORS as exc:
        raise ProtocolError(f"invalid submit message: {exc}") from None
    jobs, errors = [], []
    for raw in raws:
        try:
            jobs.append(_job_decoder.decode(raw))
        except codec.DECODE_ERRORS as exc:
            errors.append(p.ErrorItem(job_id_of(raw), "invalid_request", f"invalid job: {exc}"))
    return jobs, errors
