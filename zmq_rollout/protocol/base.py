"""What every wire body shares: the Struct base, the limits, and the range checks.

Bodies are msgspec Structs with ``array_like=True``: a Struct is a msgpack *array* of its
fields in declaration order; trailing fields equal to their default may be omitted (msgspec
writes every field; ``encode_trimmed`` leaves them off), extra trailing items are ignored
(forward compatible). Validation is part of decoding: types by
msgspec, ranges and cross-field rules in ``__post_init__`` (which also runs when a Struct
is built in Python), so a message that decodes is a message the receiver can act on.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import msgspec

MAX_JOB_ID = 128
MAX_JOBS_PER_MESSAGE = 4096
MAX_PROMPT_CHARS = 1 << 20
MAX_PROMPT_TOKENS = 1 << 20
MAX_N = 256
MAX_TOKENS = 1 << 20
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_MESSAGES = 1024
MAX_LORA_NAME = 128
MAX_VERSION = (1 << 63) - 1


DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)
"""What decoding untrusted msgpack raises. msgspec raises ``RecursionError`` for nesting deeper
than Python's recursion limit: a header of a thousand ``0x91`` bytes (array of one) does it."""


class Struct(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of every wire body. Extra trailing array items are ignored (forward compatible)."""


_encode = msgspec.msgpack.Encoder().encode


@functools.cache
def _defaults(cls: type[Struct]) -> tuple[Any, ...]:
    """Each field's default, in field order (``msgspec.NODEFAULT`` for a required one)."""
    fields = msgspec.structs.fields(cls)
    return tuple(f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory() for f in fields)


def encode_trimmed(struct: Struct) -> bytes:
    """``struct`` as its wire array without the trailing fields that equal their defaults (of the
    default's own type: ``1`` for a ``1.0`` default stays). A receiver decodes it to an equal
    Struct (a missing trailing field takes its default). msgspec writes every field of an
    ``array_like`` Struct: a ``SamplingParams`` that sets only ``temperature`` and ``top_p`` is 71
    bytes in full, 20 trimmed. Nested Structs are written in full."""
    values = msgspec.structs.astuple(struct)
    defaults = _defaults(type(struct))
    end = len(values)
    while end:
        value, default = values[end - 1], defaults[end - 1]
        if type(value) is not type(default) or value != default:
            break
        end -= 1
    return _encode(values[:end])


# The checks run for every job on the broker's hot path: each tests first and builds its
# message only on failure (formatting on every call was a quarter of the broker's time).


def check_finite(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    """``value`` is a number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); NaN, infinities and
    bools fail. Raises ValueError naming ``name``."""
    if type(value) in (float, int) and (lo < value if lo_open else lo <= value) and value <= hi:
        return
    if type(value) not in (float, int) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    raise ValueError(f"{name}={value} is outside {'(' if lo_open else '['}{lo}, {hi}]")


def check_int(name: str, value: int, lo: int, hi: int) -> None:
    """``value`` is an int (not a bool) in ``[lo, hi]``. Raises ValueError naming ``name``."""
    if type(value) is int and lo <= value <= hi:
        return
    if type(value) is not int:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    raise ValueError(f"{name}={value} is outside [{lo}, {hi}]")


def check_name(what: str, value: str, limit: int) -> None:
    """``value`` is a string of 1..``limit`` characters."""
    if not (isinstance(value, str) and 0 < len(value) <= limit):
        raise ValueError(f"{what} must be a string of 1..{limit} characters")
