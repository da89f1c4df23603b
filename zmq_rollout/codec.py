"""Framing and msgpack (de)coding of protocol messages.

``encode`` turns a command and a body into frames; ``decode`` checks the signature, demuxes
on the command byte and decodes the header with that command's typed decoder. Both sides
use the same table, so a message one side can encode is a message the other can decode.

A message has two forms (docs/protocol.md section 2): *split*, ``[signature, command,
header, *blobs]``, and *packed*, ``[signature + command + header, *blobs]``. They carry the
same bytes; packed is one frame where split is three, and every frame costs its sender and
receiver about a microsecond. ``decode`` reads both. A peer sends packed only to a broker
that said it reads it (``Liveness.packed``), and the broker answers each peer in the form
of that peer's last message.

Why msgspec (measured by ``benchmarks/codec.py``): decoding a 64-job SUBMIT into validated
typed Structs is several times faster than ``msgpack.unpackb`` into dicts *followed by* the
same validation in Python, and the bytes are plain msgpack either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from zmq_rollout import protocol as p
from zmq_rollout.errors import ProtocolError
from zmq_rollout.protocol.base import DECODE_ERRORS  # what decoding untrusted msgpack raises

_encoder = msgspec.msgpack.Encoder()


# The body type of each command, per direction. Commands shared by two directions with a
# different body (CANCEL: job ids from clients, tickets to workers) are listed per table.
FROM_CLIENT: dict[bytes, Any] = {
    p.SUBMIT: list[p.JobSpec],
    p.SEALED_SUBMIT: list[p.SealedJob],  # to a broker that said ``Liveness.sealed_jobs``
    p.CANCEL: list[str],
    p.STATUS: None,
    p.HEARTBEAT: None,
    p.DISCONNECT: None,
    p.SYNC: p.SyncStep,
}
BROKER_FROM_CLIENT: dict[bytes, Any] = {**FROM_CLIENT, p.SUBMIT: list[p.JobRelay]}
"""What the broker decodes from clients: the same, but jobs as ``JobRelay`` (sampling raw)."""
TO_CLIENT: dict[bytes, Any] = {
    p.ACCEPTED: list[str],
    p.PARTIAL: list[p.Delta],
    p.FINAL: list[p.Result],
    p.ERROR: list[p.ErrorItem],
    p.BUSY: list[p.ErrorItem],
    p.STATUS_REPLY: p.StatusReply,
    p.SYNC_REPLY: p.SyncReply,
    p.HEARTBEAT: p.Liveness | None,  # nil from brokers before epochs
}
FROM_WORKER: dict[bytes, Any] = {
    p.READY: p.WorkerInfo,
    p.CREDIT: int,
    # Token payloads stay raw msgpack in the broker: it routes on the key and forwards.
    p.PARTIAL: list[p.DeltaRelay],
    p.FINAL: list[p.ResultRelay],
    p.SEALED_FINAL: list[p.SealedResult],  # the same, each result a bin the broker steps over
    p.ERROR: list[p.ErrorItem],
    p.HEARTBEAT: None,
    p.CONTROL_ACK: p.ControlAck,
    p.DISCONNECT: None,
}
TO_WORKER: dict[bytes, Any] = {
    p.JOBS: list[p.Assignment],
    p.CANCEL: list[int],
    p.CONTROL: p.Control,
    p.HEARTBEAT: p.Liveness | None,  # Liveness answers READY; nil otherwise
    p.DISCONNECT: None,
}
WORKER_FROM_BROKER: dict[bytes, Any] = {**TO_WORKER, p.JOBS: list[p.SealedAssignment]}
"""What a worker decodes from the broker: the same, but each job raw, opened one by one
(``p.unseal``): the broker checks only part of a job (``JobRelay``)."""


class Message(NamedTuple):
    command: bytes
    body: Any
    blobs: Sequence[Any] = ()


SPLIT_PREFIX = len(p.SIGNATURE)
"""The length of a split message's first frame (the signature alone); a longer one is packed."""
PACKED_PREFIX = SPLIT_PREFIX + 1
"""Where a packed message's header starts in its first frame (after signature and command)."""


_PREFIXES = {command: p.SIGNATURE + command for command in p.COMMAND_NAMES}
"""A packed message's first bytes, per command."""
_PACKED_COMMANDS = {prefix: command for command, prefix in _PREFIXES.items()}


class Parts(NamedTuple):
    """A message's framing taken apart, its header not yet decoded."""

    command: bytes
    header: Any
    blobs: Sequence[Any]
    packed: bool


def is_packed(frames: Sequence[Any]) -> bool:
    """Whether ``frames`` (no identity) are in the packed form: a first frame longer than the
    signature. Says nothing of whether they are valid."""
    return bool(frames) and len(frames[0]) > SPLIT_PREFIX


def parts(frames: Sequence[Any]) -> Parts:
    """Take either form apart (no identity), checking the signature. Raises ProtocolError."""
    if not frames:
        raise ProtocolError("expected at least 1 frame, got 0")
    first = frames[0]
    if len(first) > SPLIT_PREFIX:
        view = memoryview(first)
        if view[:SPLIT_PREFIX] != p.SIGNATURE:
            raise ProtocolError(f"bad protocol signature {bytes(view[:8])!r}, expected {p.SIGNATURE!r}")
        return Parts(bytes(view[SPLIT_PREFIX:PACKED_PREFIX]), view[PACKED_PREFIX:], frames[1:], True)
    if len(frames) < 3:
        raise ProtocolError(
            f"expected at least 3 frames (signature, command, header) or 1 packed frame, got {len(frames)}"
        )
    if bytes(first) != p.SIGNATURE:
        raise ProtocolError(f"bad protocol signature {bytes(first)!r}, expected {p.SIGNATURE!r}")
    return Parts(bytes(frames[1]), frames[2], frames[3:], False)


def header_of(frames: Sequence[Any], command: bytes) -> Any:
    """The undecoded header of a message of ``command`` (either form), else None: for the
    answer to a message whose body does not decode."""
    try:
        found = parts(frames)
    except ProtocolError:
        return None
    return found.header if found.command == command else None


class Decoder:
    """Decodes the messages of one direction (one of the tables above)."""

    def __init__(self, table: dict[bytes, Any]) -> None:
        self._decoders = {cmd: msgspec.msgpack.Decoder(t) for cmd, t in table.items() if t is not None}
        self._commands = frozenset(table)

    def decode(self, frames: Sequence[Any]) -> Message:
        """Decode a message of either form (no identity). Raises ProtocolError."""
        if frames and len(frames[0]) > SPLIT_PREFIX:  # packed: ``parts`` inlined, for the broker's hot path
            view = memoryview(frames[0])
            command = _PACKED_COMMANDS.get(view[:PACKED_PREFIX].tobytes())
            if command is None:  # another signature, or an unknown command: parts says which
                command, header, blobs, _ = parts(frames)
            else:
                header, blobs = view[PACKED_PREFIX:], frames[1:]
        else:
            command, header, blobs, _ = parts(frames)
        if command not in self._commands:
            raise ProtocolError(f"unknown command {command!r}")
        decoder = self._decoders.get(command)
        try:
            body = decoder.decode(header) if decoder is not None else None
        except DECODE_ERRORS as exc:
            name = p.COMMAND_NAMES.get(command, "?")
            raise ProtocolError(f"invalid {name} message: {exc}") from None
        return Message(command, body, blobs)


def array_header(n: int) -> bytes:
    """msgpack's shortest header of an array of ``n`` items (as the encoder writes it)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _write_spliced(frame: bytearray, items: list[Any]) -> bytearray:
    """Append the msgpack array of ``items`` (a ``p.SplicedFinal``) to ``frame``: each
    ``(job_id, sealed)`` pair as the client's ``Result`` (``p.splice_into``, written once), every
    other item as the encoder writes it. The same bytes as encoding the list ``to_client`` builds."""
    frame += array_header(len(items))
    splice = p.splice_into
    for item in items:
        if type(item) is tuple:
            splice(frame, *item)
        else:
            _encoder.encode_into(item, frame, len(frame))
    return frame


def encode_body(body: Any) -> bytes:
    return _encoder.encode(body)


def encode(command: bytes, body: Any = None, blobs: Sequence[Any] = (), *, packed: bool = False) -> list[Any]:
    """Frames for ``command`` with ``body`` (no identity), split or ``packed``. A packed message's
    frame is a ``bytearray``, its body encoded after the prefix in place: joining the prefix to
    the encoded body copied the body once more (577 kB of 64 sealed results: 29.6 us against
    12.8; a toy message: the same). A ``p.SplicedFinal`` body is written item by item
    (``_write_spliced``)."""
    if type(body) is p.SplicedFinal:
        frame = _write_spliced(bytearray(_PREFIXES[command]) if packed else bytearray(), body)
        return [frame, *blobs] if packed else [p.SIGNATURE, command, frame, *blobs]
    if packed:
        prefix = _PREFIXES[command]
        frame = bytearray(prefix)
        _encoder.encode_into(body, frame, len(prefix))
        return [frame, *blobs]
    return [p.SIGNATURE, command, _encoder.encode(body), *blobs]
