"""The socket ends of fuzzing (``zmq_rollout.fuzzing``). A TEST TOOL, not the product.

``Hammer`` sends a ``Fuzzer``'s messages to one of the broker's ports from a few DEALER
sockets; ``FakeBroker`` is a ROUTER that a real worker connects to, so that the worker's port
can be fuzzed. Used by ``benchmarks/fuzz.py``, ``tests/unit/test_fuzz.py`` and
``tests/integration/test_fuzz_worker.py``.
"""

from __future__ import annotations

import collections
import random
import time
import uuid
from typing import Any

import msgspec
import zmq

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.errors import ProtocolError
from zmq_rollout.fuzzing import Fuzzer


class FuzzError(AssertionError):
    """A peer stopped reading, or did not answer in time (the message says which)."""


def fuzz_identity(rng: random.Random, port: str) -> bytes:
    """A routing identity: printable mostly, sometimes raw bytes (never a leading zero byte)."""
    if rng.random() < 0.8:
        return f"fuzz-{port}-{uuid.UUID(int=rng.getrandbits(128)).hex[:10]}".encode()
    return bytes([rng.randint(1, 255)]) + rng.randbytes(rng.randint(0, 254))


class Hammer:
    """Sends a ``Fuzzer``'s messages to one broker port from ``num_sockets`` DEALERs, replacing
    one every ``rotate_every`` messages (half of them say DISCONNECT first, the others just
    go), and reads what comes back (``replies``: by command name; ``undecodable``: replies
    that failed to decode).

    A send that blocks ``send_timeout_s`` (the broker stopped reading) raises ``FuzzError``.
    """

    def __init__(
        self,
        address: str,
        fuzzer: Fuzzer,
        *,
        num_sockets: int = 4,
        rotate_every: int = 250,
        send_timeout_s: float = 10.0,
        max_message_bytes: int = 0,
    ) -> None:
        self.address = address
        self.fuzzer = fuzzer
        self.rotate_every = rotate_every
        self.send_timeout_s = send_timeout_s
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._rng = random.Random(f"hammer-{fuzzer.port}-{fuzzer.seed}")
        self._replies = codec.Decoder(codec.TO_CLIENT if fuzzer.port == "frontend" else codec.TO_WORKER)
        self._socks = [self._socket() for _ in range(num_sockets)]
        self.sent = self.frames = self.bytes = self.rotated = self.undecodable = 0
        self.max_message_bytes = max_message_bytes
        self.rejected = 0
        """Messages sent that the port's decoder rejects, or larger than ``max_message_bytes``
        (when given): the broker must count each as malformed, unless ZeroMQ drops it first."""
        self.over_hard_limit = 0
        """Messages past twice ``max_message_bytes``, the broker's ZeroMQ ``MAXMSGSIZE``: ZeroMQ
        drops the connection on them (and what followed them in flight); the broker sees none."""
        self.replies: collections.Counter[str] = collections.Counter()

    def _socket(self) -> zmq.Socket[Any]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, int(self.send_timeout_s * 1000))
        sock.setsockopt(zmq.IDENTITY, fuzz_identity(self._rng, self.fuzzer.port))
        sock.connect(self.address)
        return sock

    def run(self, count: int) -> None:
        """Send ``count`` messages."""
        for _ in range(count):
            frames = self.fuzzer.message()
            sock = self._socks[self.sent % len(self._socks)]
            try:
                sock.send_multipart(frames)
            except zmq.Again:
                raise FuzzError(
                    f"{self.fuzzer.port}: a send blocked {self.send_timeout_s} s after {self.sent} messages "
                    f"(seed {self.fuzzer.seed}): the peer stopped reading"
                ) from None
            size = sum(len(f) for f in frames)
            self.sent += 1
            self.frames += len(frames)
            self.bytes += size
            self.over_hard_limit += bool(self.max_message_bytes) and size > 2 * self.max_message_bytes
            try:
                self.fuzzer.decoder.decode(frames)
                self.rejected += bool(self.max_message_bytes) and size > self.max_message_bytes
            except Exception:  # ProtocolError; anything else is the codec's bug, for the peer to show
                self.rejected += 1
            if self.sent % 32 == 0:
                self.drain()
            if self.sent % self.rotate_every == 0:
                self._rotate()

    def _rotate(self) -> None:
        i = self._rng.randrange(len(self._socks))
        old = self._socks[i]
        self._drain(old)
        if self._rng.random() < 0.5:
            old.send_multipart(codec.encode(p.DISCONNECT))
        old.close(linger=1000)  # what it queued still goes out
        self._socks[i] = self._socket()
        self.rotated += 1

    def drain(self) -> None:
        """Read every reply already waiting."""
        for sock in self._socks:
            self._drain(sock)

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._replies.decode(frames)
            except ProtocolError:  # counted: the tests assert there are none
                self.undecodable += 1
                continue
            self.replies[p.COMMAND_NAMES.get(msg.command, "?")] += 1

    def close(self) -> None:
        for sock in self._socks:
            sock.close(linger=1000)  # what it queued still goes out: the tests count every message


class FakeBroker:
    """A ROUTER that one real worker connects to: it follows the worker's identity (a fresh
    one after every reconnect, announced by READY), sends it messages, and keeps what the
    worker answers: ``replies`` by command name, ``results`` and ``errors`` by ticket,
    ``answers`` (how many FINAL, SEALED_FINAL and ERROR items came for each ticket).

    ``sealed``: answer each READY with a ``Liveness`` that says this broker reads SEALED_FINAL
    (read at each READY: set it between two connections of the worker); else READY goes
    unanswered, as from a broker older than that."""

    def __init__(
        self, address: str = "tcp://127.0.0.1:*", send_timeout_s: float = 10.0, *, sealed: bool = False
    ) -> None:
        self._sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(address)
        self.send_timeout_s = send_timeout_s
        self.sealed = sealed
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = codec.Decoder(codec.FROM_WORKER)
        self._full = msgspec.msgpack.Decoder(list[p.Result])
        self._one = msgspec.msgpack.Decoder(p.Result)
        self.identity: bytes | None = None
        self.info: p.WorkerInfo | None = None
        self.readies = self.unroutable = self.undecodable = 0
        self.replies: collections.Counter[str] = collections.Counter()
        self.results: dict[int, p.Result] = {}
        self.errors: dict[int, p.ErrorItem] = {}
        self.answers: collections.Counter[int] = collections.Counter()
        self.sealed_tickets: set[int] = set()
        """The tickets whose result came sealed (SEALED_FINAL)."""
        self.acked_rounds: set[int] = set()
        self.probes = 0
        self.sent = self.frames = self.bytes = self.rejected = 0

    def pump(self, timeout_s: float = 0.0) -> None:
        """Read everything the worker sent (waiting up to ``timeout_s`` for the first)."""
        if not self._sock.poll(int(timeout_s * 1000)):
            return
        while True:
            try:
                identity, *frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._decoder.decode(frames)
                body: Any = msg.body
                if msg.command == p.FINAL:  # whole, as a client decodes it
                    body = self._full.decode(codec.parts(frames).header)
                elif msg.command == p.SEALED_FINAL:  # opened as the broker gives it a client
                    body = [self._one.decode(sealed.to_client(str(sealed.key))) for sealed in body]
            except (ProtocolError, msgspec.DecodeError, msgspec.ValidationError):  # the tests assert none
                self.undecodable += 1
                continue
            self.replies[p.COMMAND_NAMES.get(msg.command, "?")] += 1
            if msg.command == p.READY:
                self.identity, self.info = identity, body
                self.readies += 1
                if self.sealed:
                    self._sock.send_multipart([identity, *codec.encode(p.HEARTBEAT, p.Liveness("fake", sealed=True))])
            elif msg.command in (p.FINAL, p.SEALED_FINAL):
                for result in body:
                    self.results[int(result.key)] = result
                    self.answers[int(result.key)] += 1
                    if msg.command == p.SEALED_FINAL:
                        self.sealed_tickets.add(int(result.key))
            elif msg.command == p.ERROR:
                for err in body:
                    if isinstance(err.key, int):
                        self.errors[err.key] = err
                        self.answers[err.key] += 1
            elif msg.command == p.CONTROL_ACK:
                self.acked_rounds.add(body.round_id)

    def wait_ready(self, timeout_s: float) -> p.WorkerInfo:
        deadline = time.monotonic() + timeout_s
        while self.info is None:
            if time.monotonic() > deadline:
                raise FuzzError(f"no READY within {timeout_s} s")
            self.pump(0.5)
        return self.info

    def send(self, frames: list[bytes]) -> bool:
        """Send ``frames`` to the worker; False if it cannot be routed (it is reconnecting).

        Never a blocking send: a ROUTER blocked on the full queue of a peer that has gone
        (the worker reconnects after a DISCONNECT) stays blocked for the whole timeout."""
        deadline = time.monotonic() + self.send_timeout_s
        while self.identity is not None:
            try:
                self._sock.send_multipart([self.identity, *frames], zmq.NOBLOCK)
                return True
            except zmq.Again:
                if time.monotonic() > deadline:
                    raise FuzzError(f"the worker read nothing for {self.send_timeout_s} s") from None
                self.pump(0.01)  # a READY under a new identity, maybe
            except zmq.ZMQError:  # EHOSTUNREACH: gone; its READY may be on its way
                self.unroutable += 1
                return False
        return False

    def fuzz(self, fuzzer: Fuzzer, count: int) -> None:
        """Send ``count`` fuzz messages, none lost: after a well-formed DISCONNECT, wait for
        the worker's READY under its new identity before the next; cancel a well-formed JOBS
        right after it (its jobs would take the engine's time). Counts into ``sent``,
        ``frames``, ``bytes`` and ``rejected`` (the messages the worker must count as malformed)."""
        for i in range(count):
            frames = fuzzer.message()
            readies = self.readies
            if not self.send(frames):
                raise FuzzError(f"message {self.sent} could not be routed to the worker (seed {fuzzer.seed})")
            self.sent += 1
            self.frames += len(frames)
            self.bytes += sum(len(f) for f in frames)
            try:
                msg = fuzzer.decoder.decode(frames)
            except Exception:  # ProtocolError; anything else is the codec's bug, for the worker to show
                self.rejected += 1
                continue
            if msg.command == p.JOBS:
                self.send(codec.encode(p.CANCEL, [a.ticket for a in msg.body]))
            elif msg.command == p.DISCONNECT:
                deadline = time.monotonic() + self.send_timeout_s
                while self.readies == readies:
                    if time.monotonic() > deadline:
                        raise FuzzError(f"no READY within {self.send_timeout_s} s of a DISCONNECT")
                    self.pump(0.05)
            if i % 16 == 0:
                self.pump()

    def _until(self, done: Any, message: list[bytes], timeout_s: float, what: str) -> None:
        """Send ``message`` (again after each reconnect of the worker) until ``done()``."""
        deadline, sent_to = time.monotonic() + timeout_s, None
        while not done():
            if time.monotonic() > deadline:
                raise FuzzError(f"no {what} within {timeout_s} s")
            if sent_to != self.identity and self.send(message):
                sent_to = self.identity
            self.send(codec.encode(p.HEARTBEAT))
            self.pump(0.1)

    def settle(self, timeout_s: float = 30.0) -> None:
        """Return once the worker has read everything sent before: it answers a CONTROL that
        does not decode with a refusal for its round, after reading what came first."""
        self.probes += 1
        probe = (1 << 62) + self.probes
        frames = [p.SIGNATURE, p.CONTROL, codec.encode_body([probe, ["no such step"]])]
        self._until(lambda: probe in self.acked_rounds, frames, timeout_s, "answer to a probe")

    def run_job(self, assignment: p.Assignment, timeout_s: float) -> p.Result | p.ErrorItem:
        """Assign one job and wait for its answer, heartbeating meanwhile; the assignment goes
        again to a worker that reconnected meanwhile (it aborted what it had)."""
        ticket = assignment.ticket
        frames = codec.encode(p.JOBS, [assignment])
        self._until(lambda: ticket in self.answers, frames, timeout_s, f"answer to ticket {ticket}")
        return self.results.get(ticket) or self.errors[ticket]

    def close(self) -> None:
        self._sock.close(linger=0)


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident memory now, from ``/proc`` (Linux)."""
    import os

    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
