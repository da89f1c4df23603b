"""One pass of the broker's socket loop (``Broker._serve``), driven by hand over inproc sockets:
a message sent over inproc waits at its peer as soon as ``send`` returns, so what a peer holds
at a given moment of the pass is exact, not a race."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.broker import server
from zmq_rollout.broker.server import Broker
from zmq_rollout.config import BrokerConfig
from zmq_rollout.testing import echo_result

TO_CLIENT, TO_WORKER = codec.Decoder(codec.TO_CLIENT), codec.Decoder(codec.TO_WORKER)
SAMPLING = p.SamplingParams(max_tokens=4)


class Pass:
    """A broker whose loop this test runs one pass at a time, with a raw client and worker."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        name = uuid.uuid4().hex
        config = BrokerConfig(frontend=f"inproc://{name}-f", backend=f"inproc://{name}-b", metrics_port=None)
        self.broker = Broker(config, context=ctx)
        self.poller = zmq.Poller()
        self.poller.register(self.broker.frontend, zmq.POLLIN)
        self.poller.register(self.broker.backend, zmq.POLLIN)
        self.client, self.worker = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        self.client.setsockopt(zmq.IDENTITY, b"client")
        self.worker.setsockopt(zmq.IDENTITY, b"worker")
        self.client.connect(config.frontend)
        self.worker.connect(config.backend)
        self.now = 0.0

    def run(self) -> None:
        """One pass, as ``Broker.run`` makes it: read what waits, then dispatch and send."""
        self.now += 0.001
        self.broker._serve(dict(self.poller.poll(0)), self.now)
        self.broker._flush(self.now)

    def close(self) -> None:
        self.client.close(linger=0)
        self.worker.close(linger=0)
        self.broker._release()


@pytest.fixture
def one_pass() -> Iterator[Pass]:
    ctx: zmq.Context[Any] = zmq.Context()
    drive = Pass(ctx)
    yield drive
    drive.close()
    ctx.term()


def next_body(sock: zmq.Socket[Any], decoder: codec.Decoder, command: bytes) -> Any:
    """The body of the first waiting message with ``command`` (heartbeats skipped); none: fail."""
    while sock.poll(0):
        msg = decoder.decode(sock.recv_multipart())
        if msg.command == command:
            return msg.body
    pytest.fail(f"no {p.COMMAND_NAMES[command]} waiting")


def test_results_reach_their_client_before_the_clients_messages_of_the_same_pass_are_read(one_pass: Pass) -> None:
    drive = one_pass
    drive.worker.send_multipart(codec.encode(p.READY, p.WorkerInfo("worker", "m", 8)))
    drive.client.send_multipart(codec.encode(p.SUBMIT, [p.JobSpec("first", SAMPLING, "x", ack=False)]))
    drive.run()
    (assignment,) = next_body(drive.worker, TO_WORKER, p.JOBS)
    assert assignment.job.job_id == "first"
    # Both sides have a message waiting at the start of the next pass: the worker's result, and
    # the client's next SUBMIT (as a client at its window's end sends one for each result).
    drive.worker.send_multipart(codec.encode(p.FINAL, [echo_result(assignment, "worker", 0)]))
    drive.client.send_multipart(codec.encode(p.SUBMIT, [p.JobSpec("second", SAMPLING, "x", ack=False)]))
    read_client, held_then = drive.broker._on_client, []

    def on_client(identity: bytes, frames: list[Any], now: float) -> None:
        held_then.append(bool(drive.client.poll(0)))  # the result already there?
        read_client(identity, frames, now)

    drive.broker._on_client = on_client  # type: ignore[method-assign]
    drive.run()
    assert held_then == [True], "the client's SUBMIT was read before its result was sent"
    (result,) = next_body(drive.client, TO_CLIENT, p.FINAL)
    assert result.key == "first"
    (assignment,) = next_body(drive.worker, TO_WORKER, p.JOBS)
    assert assignment.job.job_id == "second"


def test_a_message_is_read_as_its_senders_identity_and_the_frames_it_sent() -> None:
    """``recv_frames``: the ROUTER's identity frame as bytes, the sender's frames uncopied, every
    one of them (the last one's ``more`` unset), and ``zmq.Again`` once none waits."""
    from zmq_rollout.broker.server import recv_frames

    ctx: zmq.Context[Any] = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        address = f"inproc://{uuid.uuid4().hex}"
        router.bind(address)
        dealer.setsockopt(zmq.IDENTITY, b"peer-1")
        dealer.connect(address)
        dealer.send_multipart([b"ZR1", b"", b"x" * 70_000])
        dealer.send(b"one frame")
        identity, frames = recv_frames(router)
        assert type(identity) is bytes and identity == b"peer-1"
        assert [f.bytes for f in frames] == [b"ZR1", b"", b"x" * 70_000] and not frames[-1].more
        identity, frames = recv_frames(router)
        assert identity == b"peer-1" and [f.bytes for f in frames] == [b"one frame"]
        with pytest.raises(zmq.Again):
            recv_frames(router)
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def counted_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each read the loop tries from now on: ``message``, or ``none`` (it raised ``zmq.Again``)."""
    reads: list[str] = []
    read = server.recv_frames

    def recv_frames(sock: zmq.Socket[Any]) -> Any:
        try:
            got = read(sock)
        except zmq.Again:
            reads.append("none")
            raise
        reads.append("message")
        return got

    monkeypatch.setattr(server, "recv_frames", recv_frames)
    return reads


def test_while_messages_come_one_a_pass_no_read_that_finds_none_is_tried(
    one_pass: Pass, monkeypatch: pytest.MonkeyPatch
) -> None:
    drive = one_pass
    reads = counted_reads(monkeypatch)

    def beats(n: int) -> list[str]:
        """The reads of one pass that finds ``n`` heartbeats waiting (answered by one: a second
        heartbeat in a row says nothing new, ``batching.append``)."""
        reads.clear()
        for _ in range(n):
            drive.client.send_multipart(codec.encode(p.HEARTBEAT))
        drive.run()
        assert next_body(drive.client, TO_CLIENT, p.HEARTBEAT).epoch == drive.broker.epoch
        assert not drive.client.poll(0)
        return list(reads)

    assert beats(1) == ["message", "none"]  # a socket's first read: until none is left
    assert beats(1) == ["message"]  # its last read found one: it asks instead, and none waits
    assert beats(3) == ["message", "message", "message", "none"]  # it asks, more wait: read on
    assert beats(1) == ["message", "none"]  # its last read found three: until none is left
    assert drive.broker.scheduler.stats.messages_received == 6


def test_messages_waiting_together_are_all_read_in_one_pass(one_pass: Pass, monkeypatch: pytest.MonkeyPatch) -> None:
    drive = one_pass
    reads = counted_reads(monkeypatch)
    drive.worker.send_multipart(codec.encode(p.READY, p.WorkerInfo("worker", "m", 8)))
    for i in range(3):
        drive.client.send_multipart(codec.encode(p.SUBMIT, [p.JobSpec(f"j{i}", SAMPLING, "x", ack=False)]))
    drive.run()
    assert reads == ["message", "none", "message", "message", "message", "none"]  # the READY; the SUBMITs
    assert drive.broker.scheduler.stats.messages_received == 4
    jobs = next_body(drive.worker, TO_WORKER, p.JOBS)
    assert [a.job.job_id for a in jobs] == ["j0", "j1", "j2"]
