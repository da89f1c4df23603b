"""Raw ZeroMQ peers of a broker under test: a client socket's inbox and a worker socket that
speaks the protocol by hand (a module, not tests)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import zmq

from tests.helpers import poll_until
from zmq_rollout import codec
from zmq_rollout import protocol as p

FROM_BROKER_TO_CLIENT = codec.Decoder(codec.TO_CLIENT)


def send(sock: zmq.Socket[Any], command: bytes, body: Any = None) -> None:
    sock.send_multipart(codec.encode(command, body))


class Inbox:
    """What a raw client got from the broker (messages of other commands than the one asked
    for are kept for a later ``items``)."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock
        self.got: list[codec.Message] = []

    def items(self, command: bytes, count: int) -> list[Any]:
        """The items of the ``command`` messages got so far, once there are ``count`` of them."""

        def found() -> list[Any]:
            bodies = [m.body for m in self.got if m.command == command]
            return bodies if command == p.HEARTBEAT else [item for body in bodies for item in body]

        def enough() -> bool:
            while self.sock.poll(0):
                self.got.append(FROM_BROKER_TO_CLIENT.decode(self.sock.recv_multipart()))
            return len(found()) >= count

        poll_until(enough, what=f"{count} {p.COMMAND_NAMES[command]}")
        return found()


def raw_worker(raw_socket: Any, broker: Any, capabilities: list[str]) -> zmq.Socket[Any]:
    worker = raw_socket(zmq.DEALER)
    worker.connect(broker.backend)
    send(worker, p.READY, p.WorkerInfo("raw", "m", 4, 0, capabilities))
    return worker


def jobs_raw(worker: zmq.Socket[Any]) -> list[Any]:
    """The next JOBS message's assignments as plain msgpack (bins stay bytes)."""
    for _ in range(50):
        assert worker.poll(5000)
        frames = worker.recv_multipart()
        parts = codec.parts(frames)
        if parts.command == p.JOBS:
            return msgpack.unpackb(bytes(parts.header))
    pytest.fail("no JOBS")
