"""Hostile input for the broker's two ports and the worker's port. A TEST TOOL, not the product.

Like ``zmq_rollout.testing``, this module exists to test the product: ``benchmarks/fuzz.py``
(the long run), ``tests/unit/test_fuzz.py`` (the broker's ports) and
``tests/integration/test_fuzz_worker.py`` (a real worker's port) all use it, and so do
the focused tests of what it found (``tests/unit/test_hostile_input.py``).

``Fuzzer(port, seed)`` makes one message at a time (a list of frames, without the ROUTER
identity) for one port, from a seeded ``random.Random`` so that a seed replays a run:

- ``frontend``: what clients send the broker (valid bodies: ``codec.FROM_CLIENT``);
- ``backend``: what workers send the broker (``codec.FROM_WORKER``);
- ``worker``: what the broker sends a worker (``codec.TO_WORKER``).

Strategies (``Fuzzer.counts`` tallies them): ``valid`` messages of the port; ``mutate``,
schema-aware mutations of a valid message of every command (walked with the msgspec type of
its body: a value of another type in a field, boundary values such as negative and 2**64-1
ints, NaN, empty and long strings and lists, missing and extra fields, invalid UTF-8, msgpack
headers that declare 4 GB (bin32, str32, array32, map32, ext32) over a few bytes, nesting
thousands deep); ``bitflip`` and ``truncate`` of a valid message; ``random`` frames;
``direction``, a valid message of another direction (worker commands to the frontend, client
commands to the backend, ...); ``signature``, ``frames`` (wrong frame counts, empty and extra
frames), ``command`` (unknown or multi-byte command frames), ``swap`` (one command's body
under another), and ``oversize`` frames when ``oversize_bytes`` is given.

Some valid messages are not hostile input but privileged commands of a trusted peer; the
fuzzer keeps them out (``Fuzzer.tamed`` counts them) so that a good client's jobs can be
checked meanwhile: a SYNC ``begin`` from a client opens a weight-sync round that pauses every
worker; a READY or CREDIT from a worker that gives it credits makes it take jobs it never
answers (a hung worker, not malformed input: a client's timeout and CANCEL handle that); a
CONTROL step to a worker pauses it or overwrites its weights (only ``check_names`` and
``abort``, harmless to a worker outside a round, get through). Authenticating peers
(CurveZMQ) is the guard against those.

The valid messages it starts from, and the walk of their fields by type, are in
``zmq_rollout.fuzz_templates``; the sockets that deliver its messages, in ``zmq_rollout.fuzz_peers``.
"""

from __future__ import annotations

import collections
import copy
import math
import random
from typing import Any

import msgspec
import msgspec.inspect as mi

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.fuzz_templates import PORTS, RECEIVERS, TABLES, kind_of, node_at, nodes, templates, with_node

STRATEGIES = {  # strategy: weight
    "valid": 6,
    "mutate": 40,
    "bitflip": 12,
    "truncate": 7,
    "random": 9,
    "direction": 8,
    "signature": 4,
    "frames": 6,
    "command": 4,
    "swap": 4,
}
# msgpack prefixes that lie: each declares far more than follows (up to 4 GiB).
LYING_HEADERS = (
    b"\xdd\xff\xff\xff\xff",  # array32 of 4G items
    b"\xdc\xff\xff",  # array16
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xde\xff\xff",  # map16
    b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GB
    b"\xdb\xff\xff\xff\xff",  # str32
    b"\xc9\xff\xff\xff\xff\x05",  # ext32
    b"\xdd\x00\x01\x00\x00\xc0\xc0",  # array32 of 65536 items, 2 present
)
ODD_BYTES = (
    b"\xa2\xff\xfe",  # a str that is not UTF-8
    b"\xc1",  # the byte msgpack never uses
    b"\xd4\x01\x00",  # fixext1
    b"\xd7\xff" + b"\xff" * 8,  # timestamp64 with nanoseconds out of range
    b"\xc7\x0c\xff" + b"\x7f" + b"\xff" * 11,  # timestamp96 out of range
    b"\xd6\xff\xff\xff\xff\xff",  # timestamp32
)
WRONG = {  # a value of each msgpack kind
    "int": (0, 7, -1, (1 << 63) - 1, -(1 << 63), (1 << 64) - 1),
    "float": (0.5, -1e308, math.nan, math.inf, -0.0),
    "str": ("", "x", "héllo", "a" * 200),
    "bool": (True, False),
    "nil": (None,),
    "bytes": (b"", b"\x00\xff"),
    "list": ([], [1], ["a"], [[]]),
    "dict": ({}, {"k": 1}, {1: 2}),
}
BOUNDARY = {
    "int": (-1, 0, 1, -(1 << 63), (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -(1 << 31), 1 << 31, (1 << 20) + 1, 257, 4097),
    "float": (math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e308, -1.0, 100.0001, 0.0),
    "str": ("", " ", "\x00", "é", "a" * 129, "a" * 257, "\U0001f600" * 70),
}
LONG_LENGTHS = (17, 129, 1025, 4097)


class Fuzzer:
    """One hostile message at a time for ``port`` (``PORTS``), reproducible from ``seed``."""

    def __init__(
        self,
        port: str,
        seed: int,
        *,
        oversize_bytes: tuple[int, ...] = (),
        max_depth: int = 20_000,
        max_list_bytes: int = 200_000,
    ) -> None:
        self.port = port
        self.seed = seed
        self.rng = random.Random(f"{port}-{seed}")
        self.oversize_bytes = oversize_bytes
        """Sizes of ``oversize`` messages to choose from (none: no such messages)."""
        self.max_depth = max_depth
        self.max_list_bytes = max_list_bytes
        """A long list made by a mutation holds at most about this many bytes (so that the
        messages stay under ~1 MB, except ``oversize`` ones)."""
        own = PORTS[port]
        table = TABLES[own]
        self._own = [
            (cmd, body, mi.type_info(table[cmd]) if table[cmd] is not None else mi.NoneType())
            for cmd, body in templates(own)
        ]
        self._others = [(cmd, body) for t in TABLES if t != own for cmd, body in templates(t)]
        self.decoder = codec.Decoder(RECEIVERS[own])
        """Decodes this port's messages as their receiver does."""
        weights = dict(STRATEGIES, oversize=1 if oversize_bytes else 0)
        self._strategies, self._weights = list(weights), list(weights.values())
        self.counts: collections.Counter[str] = collections.Counter()
        self.tamed = 0
        self.packed = 0
        """Messages sent in the packed form."""

    def message(self) -> list[bytes]:
        """The next message: frames without an identity."""
        while True:
            strategy = self.rng.choices(self._strategies, self._weights)[0]
            frames = getattr(self, f"_{strategy}")()
            frames = self._tame(frames)
            if frames is not None:
                self.counts[strategy] += 1
                return self._maybe_pack(frames)

    def _maybe_pack(self, frames: list[bytes]) -> list[bytes]:
        """Half the messages whose first frame is signature-sized go in the packed form (their
        first three frames joined): both forms' parsing is fuzzed alike."""
        if len(frames) >= 3 and len(frames[0]) == len(p.SIGNATURE) and self.rng.random() < 0.5:
            self.packed += 1
            return [frames[0] + frames[1] + frames[2], *frames[3:]]
        return frames

    # -- privileged commands (module docstring) --------------------------------------------
    def _tame(self, frames: list[bytes]) -> list[bytes] | None:
        """``frames``, or the same without the credits it would give, or None to make another."""
        if len(frames) < 3 or frames[0] != p.SIGNATURE:
            return frames
        command = frames[1]
        risky = {"frontend": (p.SYNC,), "backend": (p.READY, p.CREDIT), "worker": (p.CONTROL,)}[self.port]
        if command not in risky:
            return frames
        try:
            body = self.decoder.decode(frames).body
        except Exception:  # ProtocolError: input, not a command (anything else: the codec's bug)
            return frames
        if command == p.SYNC and not isinstance(body.op, p.Begin):
            return frames  # refused: no round of this client runs
        if command == p.CONTROL and isinstance(body.op, (p.CheckNames, p.Abort)):
            return frames
        self.tamed += 1
        if command in (p.SYNC, p.CONTROL):
            return None
        if command == p.CREDIT:
            return [*frames[:2], codec.encode_body(min(body, 0)), *frames[3:]]
        body.credits = 0
        return [*frames[:2], codec.encode_body(body), *frames[3:]]

    # -- strategies ------------------------------------------------------------------------
    def _template(self) -> tuple[bytes, Any, Any]:
        return self.rng.choice(self._own)

    def _valid(self) -> list[bytes]:
        command, body, _ = self._template()
        return codec.encode(command, body)

    def _mutate(self) -> list[bytes]:
        command, body, info = self._template()
        root = msgspec.msgpack.decode(codec.encode_body(body))
        for _ in range(self.rng.choice((1, 1, 1, 2, 3))):
            root = self._mutate_once(root, info)
        try:
            header = msgspec.msgpack.encode(root)[: 4 * self.max_list_bytes]  # cut: truncated, still hostile
        except (TypeError, ValueError, OverflowError):
            header = self.rng.randbytes(16)
        if self.rng.random() < 0.05:
            header += self.rng.randbytes(self.rng.randint(1, 8))  # trailing bytes after the object
        return [p.SIGNATURE, command, header]

    def _mutate_once(self, root: Any, info: Any) -> Any:
        rng = self.rng
        path, node_info = rng.choice(nodes(root, info))
        node = node_at(root, path)
        kind = kind_of(node_info)
        op = rng.choice(("type", "type", "boundary", "boundary", "shape", "raw", "lying", "deep"))
        if op == "type":  # a copy: a later mutation may change it in place
            value = copy.deepcopy(rng.choice(WRONG[rng.choice([k for k in WRONG if k != kind])]))
        elif op == "boundary" and kind in BOUNDARY:
            value = rng.choice(BOUNDARY[kind])
        elif op in ("boundary", "shape") and isinstance(node, list):
            value = self._reshape(node)
        elif op in ("boundary", "shape") and isinstance(node, dict):
            value = dict(node)
            value[rng.choice(("k" * rng.randint(1, 300), 1, None, b"b", 1.5))] = rng.choice(WRONG["int"])
        elif op == "lying":
            value = msgspec.Raw(rng.choice(LYING_HEADERS))
        elif op == "deep":
            depth = rng.choice((200, 1_000, self.max_depth))
            unit = rng.choice((b"\x91", b"\x81\xa1k", b"\x92\x00"))
            value = msgspec.Raw(unit * depth + b"\xc0")
        else:  # "raw", or a boundary of a kind without its own (bool, nil, any)
            value = msgspec.Raw(rng.choice(ODD_BYTES))
        return with_node(root, path, value)

    def _reshape(self, node: list[Any]) -> list[Any]:
        """A Struct (array) with missing, extra or swapped fields; a list emptied or long."""
        rng = self.rng
        choice = rng.randrange(4)
        if choice == 0:
            return node[: rng.randrange(len(node))] if node else [None]  # missing fields / items
        if choice == 1:
            return node + [rng.choice(WRONG[k]) for k in rng.choices(list(WRONG), k=rng.randint(1, 3))]  # extra
        if choice == 2 and len(node) > 1:
            i, j = rng.sample(range(len(node)), 2)
            node = list(node)
            node[i], node[j] = node[j], node[i]
            return node
        item = node[0] if node else rng.choice(WRONG["int"])
        n = min(rng.choice(LONG_LENGTHS), max(1, self.max_list_bytes // len(msgspec.msgpack.encode(item))))
        # Past 16 items ``nodes`` does not look inside, so one shared item is safe (and cheap).
        return [item] * n if n > 16 else [copy.deepcopy(item) for _ in range(n)]

    def _bitflip(self) -> list[bytes]:
        frames = self._valid()
        which = self.rng.choice((0, 1, 2, 2, 2, 2))
        data = bytearray(frames[which])
        if not data:
            data = bytearray(b"\x00")
        for _ in range(self.rng.randint(1, 8)):
            i = self.rng.randrange(len(data))
            data[i] ^= 1 << self.rng.randrange(8)
        frames[which] = bytes(data)
        return frames

    def _truncate(self) -> list[bytes]:
        frames = self._valid()
        header = frames[2]
        frames[2] = header[: self.rng.randrange(len(header))] if len(header) > 1 else b""
        return frames

    def _random(self) -> list[bytes]:
        rng = self.rng
        sizes = [rng.choice((0, 1, 3, rng.randint(0, 64), rng.randint(0, 4096))) for _ in range(rng.randint(1, 5))]
        frames = [rng.randbytes(n) for n in sizes]
        if len(frames) >= 3 and rng.random() < 0.5:
            frames[0] = p.SIGNATURE  # get past the signature check
        return frames

    def _direction(self) -> list[bytes]:
        command, body = self.rng.choice(self._others)
        return codec.encode(command, body)

    def _signature(self) -> list[bytes]:
        frames = self._valid()
        frames[0] = self.rng.choice((b"", b"ZR", b"ZR2", b"zr1", b"ZR1\x00", b"\x00" * 3, self.rng.randbytes(3)))
        return frames

    def _frames(self) -> list[bytes]:
        rng, frames = self.rng, self._valid()
        choice = rng.randrange(5)
        if choice == 0:
            return frames[: rng.randint(1, 2)]  # too few
        if choice == 1:
            return frames + [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 8))]  # blobs
        if choice == 2:
            return [b""] * rng.randint(1, 6)
        if choice == 3:
            return [b"" if rng.random() < 0.5 else f for f in frames]
        return [p.SIGNATURE] + [rng.randbytes(1) for _ in range(rng.randint(50, 300))]  # many frames

    def _command(self) -> list[bytes]:
        frames = self._valid()
        frames[1] = self.rng.choice((b"", b"\x00", b"\xff", b"\x07", b"\x01\x01", frames[1] * 2, self.rng.randbytes(1)))
        return frames

    def _swap(self) -> list[bytes]:
        frames = self._valid()
        frames[2] = self._valid()[2]  # the body of another command of this port
        return frames

    def _oversize(self) -> list[bytes]:
        """A message of one of ``oversize_bytes``: a header or a blob of that size."""
        frames = self._valid()
        n = self.rng.choice(self.oversize_bytes)
        if self.rng.random() < 0.5:
            frames[2] = self.rng.randbytes(8) + bytes(n)
        else:
            frames.append(bytes(n))  # a blob
        return frames
