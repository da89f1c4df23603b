"""Prompt token ids as a *token bin*: one msgpack bin of 4-byte little-endian ids.

A job's ``prompt_token_ids`` goes on the wire as a msgpack array of ints, or, between peers that
read it, as a bin holding the ids as unsigned 32-bit little-endian integers. A bin says its
length, so the broker steps over it: an array it must walk id by id to find its end (msgspec,
about 9 ns an id: decoding a SUBMIT of 512-id prompts, 5.05 us a job as arrays against
0.99-1.01 as bins, ``benchmarks/broker_phases.py``).

Who may send one (docs/protocol.md section 5.8):

- a client, once the broker's HEARTBEAT answer says ``Liveness.token_bins``;
- the broker, to a worker whose READY lists the capability ``TOKEN_BINS``; to any other worker
  it sends the same ids as an array (``as_array``).

A ``JobSpec`` built or decoded with a bin holds the ids as a list (``JobSpec.__post_init__``
opens it), so nothing past the decoder sees the difference.
"""

from __future__ import annotations

import sys
from array import array

import msgspec

TOKEN_BINS = "token_bins"
"""The capability a worker lists in READY (``WorkerInfo.capabilities``) when it reads token bins."""

_BIG_ENDIAN = sys.byteorder == "big"
_BIN_HEADS = (0xC4, 0xC5, 0xC6)  # bin 8, bin 16, bin 32
_encode = msgspec.msgpack.Encoder().encode


def to_bin(ids: list[int]) -> bytes | None:
    """``ids`` as a token bin's bytes; None if one does not fit 32 unsigned bits (negative, say):
    such a job goes as an array, and whoever checks it refuses it."""
    try:
        packed = array("I", ids)
    except OverflowError:
        return None
    if packed.itemsize != 4:  # pragma: no cover - no platform we run on
        return None
    if _BIG_ENDIAN:  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def from_bin(data: bytes) -> list[int]:
    """The ids of a token bin's bytes. Raises ValueError if its length is not a multiple of 4."""
    if len(data) % 4:
        raise ValueError(f"prompt_token_ids as bytes must be 4 bytes an id (little-endian), not {len(data)} bytes")
    ids = array("I")
    ids.frombytes(data)
    if _BIG_ENDIAN:  # pragma: no cover
        ids.byteswap()
    return ids.tolist()


def is_bin(raw: msgspec.Raw) -> bool:
    """Whether the msgpack item ``raw`` is a bin."""
    return len(raw) > 0 and memoryview(raw)[0] in _BIN_HEADS


def bin_length(raw: msgspec.Raw) -> int:
    """The byte length a bin's header gives (``raw`` must be a bin, ``is_bin``)."""
    view = memoryview(raw)
    head = view[0]
    if head == 0xC4:
        return int(view[1])
    if head == 0xC5:
        return view[1] << 8 | view[2]
    return int.from_bytes(view[1:5], "big")


def as_array(raw: msgspec.Raw) -> msgspec.Raw:
    """A token bin (raw msgpack) as the msgpack array of the same ids, for a worker that does not
    read bins; anything else as it is."""
    if not is_bin(raw):
        return raw
    return msgspec.Raw(_encode(from_bin(msgspec.msgpack.decode(raw, type=bytes))))
