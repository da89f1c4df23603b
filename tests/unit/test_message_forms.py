"""The two forms of a message (docs/protocol.md section 2): split and packed.

The broker reads both and answers each peer in the form of that peer's last message; the
reference client and worker send packed only once the broker's ``Liveness`` says it reads it.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import msgspec
import pytest
import zmq
from helpers import poll_until

from zmq_rollout import SamplingParams, codec
from zmq_rollout import protocol as p
from zmq_rollout.errors import ProtocolError

TO_CLIENT = codec.Decoder(codec.TO_CLIENT)
TO_WORKER = codec.Decoder(codec.TO_WORKER)
SAMPLING = p.SamplingParams(max_tokens=4)


def receive(sock: zmq.Socket[Any], decoder: codec.Decoder, timeout: float = 5.0) -> tuple[list[bytes], codec.Message]:
    """The next message's frames and its decoding."""
    if not sock.poll(int(timeout * 1000)):
        pytest.fail(f"no message within {timeout} s")
    frames = sock.recv_multipart()
    return frames, decoder.decode(frames)


def receive_command(
    sock: zmq.Socket[Any], decoder: codec.Decoder, command: bytes, timeout: float = 5.0
) -> tuple[list[bytes], codec.Message]:
    """The next message with ``command`` (heartbeats and the like skipped)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        frames, msg = receive(sock, decoder, left)
        if msg.command == command:
            return frames, msg
    pytest.fail(f"no {p.COMMAND_NAMES[command]} within {timeout} s")


# -- the codec ------------------------------------------------------------------------------
def test_packed_is_the_split_frames_joined() -> None:
    body = [p.JobSpec("j1", SAMPLING, "hi")]
    split = codec.encode(p.SUBMIT, body)
    (packed,) = codec.encode(p.SUBMIT, body, packed=True)
    assert packed == b"".join(split) and packed[:4] == b"ZR1\x01"
    assert codec.is_packed([packed]) and not codec.is_packed(split) and not codec.is_packed([])


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_both_forms_decode_alike_with_blobs_from_zero_copy_buffers(packed: bool) -> None:
    body = [p.Assignment(7, p.JobRelay("j", msgspec.Raw(codec.encode_body(SAMPLING)), "hi"))]
    frames = codec.encode(p.JOBS, body, blobs=[b"\x00" * 8], packed=packed)
    assert len(frames) == (2 if packed else 4)
    msg = TO_WORKER.decode([memoryview(f) for f in frames])
    assert msg.command == p.JOBS and [a.ticket for a in msg.body] == [7]
    assert [bytes(b) for b in msg.blobs] == [b"\x00" * 8]
    assert codec.parts(frames).packed is packed


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        pytest.param([b"ZR9\x03\xc0"], r"bad protocol signature b'ZR9\\x03\\xc0'", id="signature"),
        pytest.param([b"ZR1\x7f\xc0"], r"unknown command b'\\x7f'", id="unknown-command"),
        pytest.param([b"ZR1\x31\x90"], r"unknown command b'1'", id="wrong-direction"),
        pytest.param([b"ZR1\x01"], r"invalid submit message", id="empty-header"),
        pytest.param([b"ZR1\x01\xc1garbage"], r"invalid submit message", id="garbage-header"),
        pytest.param([b"ZR"], r"expected at least 3 frames .* or 1 packed frame, got 1", id="short-first-frame"),
        pytest.param([p.SIGNATURE], r"got 1", id="signature-alone"),
    ],
)
def test_packed_framing_errors_are_protocol_errors(frames: list[bytes], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        codec.Decoder(codec.FROM_CLIENT).decode(frames)


def test_a_nil_body_command_packed_without_a_header_decodes() -> None:
    """As the split form's header frame is ignored for nil-body commands, so is a packed one's."""
    assert codec.Decoder(codec.FROM_CLIENT).decode([b"ZR1\x04"]).command == p.HEARTBEAT


def test_header_of_reads_either_form_and_only_its_command() -> None:
    header = msgpack.packb([["j", [1], "x"]])
    assert bytes(codec.header_of([p.SIGNATURE, p.SUBMIT, header], p.SUBMIT)) == header
    assert bytes(codec.header_of([p.SIGNATURE + p.SUBMIT + header], p.SUBMIT)) == header
    assert codec.header_of([p.SIGNATURE + p.STATUS + header], p.SUBMIT) is None
    assert codec.header_of([b"ZR9" + p.SUBMIT + header], p.SUBMIT) is None


# -- the broker -----------------------------------------------------------------------------
def _worker(raw_socket: Any, broker: Any, name: str, packed: bool, credits: int = 4) -> zmq.Socket[Any]:
    sock = raw_socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.connect(broker.backend)
    sock.send_multipart(codec.encode(p.READY, p.WorkerInfo(name, "m", credits), packed=packed))
    return sock


def _client(raw_socket: Any, broker: Any, name: str) -> zmq.Socket[Any]:
    sock = raw_socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.connect(broker.frontend)
    return sock


def _echo(worker: zmq.Socket[Any], packed: bool) -> list[bytes]:
    """Answer the next JOBS with FINALs; the JOBS message's frames."""
    frames, jobs = receive_command(worker, TO_WORKER, p.JOBS)
    results = [p.Result(a.ticket, [1], [p.Sample(0, [2], [0.0], "length")], 0, "w") for a in jobs.body]
    worker.send_multipart(codec.encode(p.FINAL, results, packed=packed))
    return frames


@pytest.mark.parametrize(
    ("client_packed", "worker_packed"), [(False, False), (True, True), (True, False), (False, True)]
)
def test_the_broker_answers_each_peer_in_its_own_form(
    start_broker: Any, raw_socket: Any, client_packed: bool, worker_packed: bool
) -> None:
    broker = start_broker()
    worker = _worker(raw_socket, broker, "w-form", worker_packed)
    _, hello = receive_command(worker, TO_WORKER, p.HEARTBEAT)
    assert isinstance(hello.body, p.Liveness) and hello.body.packed  # READY's answer: this broker reads packed
    client = _client(raw_socket, broker, "c-form")
    client.send_multipart(codec.encode(p.SUBMIT, [p.JobSpec("j1", SAMPLING, "hi")], packed=client_packed))
    jobs_frames = _echo(worker, worker_packed)
    final_frames, final = receive_command(client, TO_CLIENT, p.FINAL)
    assert [r.key for r in final.body] == ["j1"] and final.body[0].samples[0].token_ids == [2]
    assert len(jobs_frames) == (1 if worker_packed else 3)
    assert len(final_frames) == (1 if client_packed else 3)
    split = broker.thread.broker.split_peers
    assert (b"c-form" in split) is not client_packed and (b"w-form" in split) is not worker_packed


def test_a_peer_that_changes_form_is_answered_in_its_latest(start_broker: Any, raw_socket: Any) -> None:
    broker = start_broker()
    client = _client(raw_socket, broker, "c-switch")
    for packed in (False, True, False, True):
        client.send_multipart(codec.encode(p.STATUS, packed=packed))
        frames, _ = receive_command(client, TO_CLIENT, p.STATUS_REPLY)
        assert len(frames) == (1 if packed else 3)


def test_bad_packed_submits_are_answered_per_job_like_split_ones(start_broker: Any, raw_socket: Any) -> None:
    """The salvage of a SUBMIT whose body fails to decode, and the refusal of one over the job
    limit, read the packed form too: each job id named, the valid jobs run."""
    broker = start_broker()
    worker = _worker(raw_socket, broker, "w-salvage", True)
    client = _client(raw_socket, broker, "c-salvage")
    sampling = msgpack.unpackb(codec.encode_body(SAMPLING))
    header = msgpack.packb([["good", sampling, "hi"], ["bad", [0, *sampling[1:]], "hi"]])  # n=0 is invalid
    client.send_multipart([p.SIGNATURE + p.SUBMIT + header])
    frames, error = receive_command(client, TO_CLIENT, p.ERROR)
    assert len(frames) == 1 and [(e.key, e.code) for e in error.body] == [("bad", "invalid_request")]
    _echo(worker, True)
    _, final = receive_command(client, TO_CLIENT, p.FINAL)
    assert [r.key for r in final.body] == ["good"]
    too_many = msgpack.packb([[f"x{i}", sampling, "hi"] for i in range(p.MAX_JOBS_PER_MESSAGE + 1)])
    client.send_multipart([p.SIGNATURE + p.SUBMIT + too_many])
    _, refused = receive_command(client, TO_CLIENT, p.ERROR)
    assert len(refused.body) == p.MAX_JOBS_PER_MESSAGE + 1 and all(e.code == "protocol" for e in refused.body)


def test_the_broker_forgets_the_form_of_peers_it_forgot(start_broker: Any, raw_socket: Any) -> None:
    """Memory stays bounded: a split client that left is dropped from the split peers."""
    broker = start_broker()
    client = _client(raw_socket, broker, "c-leaves")
    client.send_multipart(codec.encode(p.STATUS))
    receive_command(client, TO_CLIENT, p.STATUS_REPLY)
    assert b"c-leaves" in broker.thread.broker.split_peers
    gauge = "zmq_rollout_broker_split_form_peers"
    poll_until(lambda: broker.metrics()[gauge] == 1, what="the gauge to count the split client")  # set per tick
    client.send_multipart(codec.encode(p.DISCONNECT))
    poll_until(lambda: b"c-leaves" not in broker.thread.broker.split_peers, what="the split form to be forgotten")
    poll_until(lambda: broker.metrics()[gauge] == 0, what="the gauge to drop it")


def test_the_reference_client_sends_packed_once_the_broker_says_it_reads_it(
    start_broker: Any, start_double: Any, start_client: Any
) -> None:
    broker = start_broker()
    start_double(broker, credits=4, name="old-double", split_only=True)  # a worker older than the packed form
    client = start_client(broker.frontend, name="ref-client", heartbeat_interval_s=0.05)
    rollouts = client.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=2))
    assert [r.prompt_token_ids for r in rollouts] == [[1, 2, 3]] * 4
    # Its first SUBMIT may leave before the first heartbeat's answer; its next message is packed.
    poll_until(
        lambda: not [i for i in broker.thread.broker.split_peers if i.startswith(b"ref-client")],
        what="the client's messages to come packed",
    )
    rollouts = client.generate([[4, 5]], SamplingParams(max_tokens=2))
    assert [r.prompt_token_ids for r in rollouts] == [[4, 5]]
    split = broker.thread.broker.split_peers
    assert not [i for i in split if i.startswith(b"ref-client")]
    assert [i for i in split if i.startswith(b"old-double")]  # served split all along


def test_the_echo_double_sends_packed_once_told_as_the_real_worker_does(start_broker: Any, start_double: Any) -> None:
    broker = start_broker()
    double = start_double(broker, credits=4, name="new-double")
    poll_until(
        lambda: not [i for i in broker.thread.broker.split_peers if i.startswith(b"new-double")],
        what="the double's heartbeats to come packed",
    )
    assert double.disconnects == 0


def test_the_reference_client_follows_what_each_heartbeat_reply_says(raw_socket: Any) -> None:
    """Split to a broker older than ``Liveness.packed`` (or that answers nil), packed once a
    reply says the broker reads it, split again if a restarted broker does not say so."""
    from zmq_rollout import RolloutClient

    broker = raw_socket(zmq.ROUTER)
    port = broker.bind_to_random_port("tcp://127.0.0.1")
    client = RolloutClient(f"tcp://127.0.0.1:{port}", name="forms", heartbeat_interval_s=0.05)

    def next_heartbeat() -> tuple[bytes, bool]:
        """The client's next HEARTBEAT: its identity and whether it was packed."""
        while broker.poll(5000):
            identity, *frames = broker.recv_multipart()
            if codec.parts(frames).command == p.HEARTBEAT:
                return identity, codec.is_packed(frames)
        pytest.fail("no heartbeat from the client within 5 s")

    def answer(identity: bytes, body: Any) -> bool:
        """Send ``body`` as the HEARTBEAT reply; whether the client's first heartbeat after it
        that was sent after the reply arrived was packed."""
        broker.send_multipart([identity, *codec.encode(p.HEARTBEAT, body)])
        next_heartbeat()  # may have left before the reply arrived
        return next_heartbeat()[1]

    try:
        identity, packed = next_heartbeat()
        assert not packed  # nothing said yet
        assert answer(identity, None) is False  # a broker before epochs
        assert answer(identity, p.Liveness("old")) is False  # a broker before the field
        assert answer(identity, p.Liveness("old", packed=True)) is True
        assert answer(identity, p.Liveness("new")) is False  # a restart onto an older broker
    finally:
        client.close()
