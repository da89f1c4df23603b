"""The broker's socket loop over loopback TCP: echo worker doubles, real clients, raw peers."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import zmq

from zmq_rollout import BusyError, SamplingParams, codec
from zmq_rollout import protocol as p
from zmq_rollout.errors import ProtocolError
from zmq_rollout.testing import echo_result

FROM_BROKER_TO_CLIENT = codec.Decoder(codec.TO_CLIENT)
FROM_BROKER_TO_WORKER = codec.Decoder(codec.TO_WORKER)


def send(sock: zmq.Socket[Any], command: bytes, body: Any = None) -> None:
    sock.send_multipart(codec.encode(command, body))


def receive(sock: zmq.Socket[Any], decoder: codec.Decoder, command: bytes, timeout: float = 5.0) -> Any:
    """The body of the next message with ``command`` (others, e.g. heartbeats, are skipped)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            msg = decoder.decode(sock.recv_multipart())
            if msg.command == command:
                return msg.body
    pytest.fail(f"no {p.COMMAND_NAMES[command]} message within {timeout} s")


def collect(
    sock: zmq.Socket[Any],
    done: Callable[[list[codec.Message]], bool],
    timeout: float = 5.0,
    settle: float = 0.2,
) -> list[codec.Message]:
    """Messages to a raw client until ``done(messages)``, then those within ``settle`` s more."""
    messages: list[codec.Message] = []
    deadline = time.monotonic() + timeout
    while not done(messages):
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"timed out; got {[(p.COMMAND_NAMES[m.command], m.body) for m in messages]}")
        if sock.poll(int(left * 1000) + 1):
            messages.append(FROM_BROKER_TO_CLIENT.decode(sock.recv_multipart()))
    while sock.poll(int(settle * 1000)):
        messages.append(FROM_BROKER_TO_CLIENT.decode(sock.recv_multipart()))
    return messages


def items(messages: list[codec.Message], command: bytes) -> list[Any]:
    return [item for m in messages if m.command == command for item in m.body]


def raw_job(job_id: Any, sampling: list[Any], prompt: str = "hi") -> list[Any]:
    return [job_id, sampling, prompt]


# -- the happy path -----------------------------------------------------------------------
def test_generate_through_two_doubles(start_broker: Any, start_double: Any, start_client: Any) -> None:
    broker = start_broker()
    doubles = [start_double(broker, credits=4), start_double(broker, credits=4)]
    client = start_client(broker.frontend)
    prompts = [[i + 1, i + 2, i + 3, i + 4, i + 5] for i in range(20)]
    rollouts = client.generate(prompts, SamplingParams(n=2, max_tokens=4))
    assert [(r.prompt_index, r.index) for r in rollouts] == [(i, s) for i in range(20) for s in range(2)]
    for r in rollouts:
        assert r.prompt_token_ids == prompts[r.prompt_index]
        assert r.token_ids == prompts[r.prompt_index][:4]
        assert r.finish_reason == "length"
    assert {r.worker_id for r in rollouts} == {d.name for d in doubles}
    assert all(d.received for d in doubles)  # least loaded first spreads the work
    assert sum(len(d.received) for d in doubles) == 20
    assert broker.jobs("completed") == 20
    assert broker.jobs("requeued") == 0


def test_client_heartbeat_is_answered(start_broker: Any, raw_socket: Any) -> None:
    broker = start_broker()
    client = raw_socket(zmq.DEALER)
    client.connect(broker.frontend)
    send(client, p.HEARTBEAT)
    first = receive(client, FROM_BROKER_TO_CLIENT, p.HEARTBEAT)
    assert isinstance(first, p.Liveness) and first.new_session  # it did not know this client before
    send(client, p.HEARTBEAT)
    second = receive(client, FROM_BROKER_TO_CLIENT, p.HEARTBEAT)
    assert second == p.Liveness(first.epoch, new_session=False, packed=True, token_bins=True, sealed_jobs=True)
    assert len(first.epoch) >= 8


def test_the_broker_counts_the_messages_it_reads_and_sends(start_broker: Any, raw_socket: Any) -> None:
    """``zmq_rollout_broker_messages_total``: one SUBMIT of 8 jobs to one worker is one JOBS, and
    its 8 FINALs in one message go to the client as one FINAL (a hand-driven worker that sends
    no heartbeat, so every message is known)."""
    broker = start_broker(heartbeat_interval_s=30.0)  # no tick, so no HEARTBEAT to the worker
    worker = raw_socket(zmq.DEALER)
    worker.connect(broker.backend)
    send(worker, p.READY, p.WorkerInfo("raw-worker", "m", 8))
    receive(worker, FROM_BROKER_TO_WORKER, p.HEARTBEAT)  # the broker's answer to READY
    client = raw_socket(zmq.DEALER)
    client.connect(broker.frontend)
    send(client, p.SUBMIT, [p.JobSpec(f"j{i}", prompt="x", ack=False) for i in range(8)])
    jobs = receive(worker, FROM_BROKER_TO_WORKER, p.JOBS)
    assert len(jobs) == 8
    send(worker, p.FINAL, [echo_result(a, "raw-worker", 0) for a in jobs])
    assert [r.key for r in receive(client, FROM_BROKER_TO_CLIENT, p.FINAL)] == [f"j{i}" for i in range(8)]
    counted = {
        side: broker.metrics()[f"zmq_rollout_broker_messages_total{{direction={side}}}"]
        for side in ("received", "sent")
    }
    assert counted == {"received": 3, "sent": 3}  # READY, SUBMIT, FINAL; HEARTBEAT, JOBS, FINAL


# -- malformed input from clients ---------------------------------------------------------
@pytest.mark.parametrize(
    ("frames", "message"),
    [
        pytest.param([b"ZR0", p.STATUS, b"\xc0"], "bad protocol signature", id="bad-signature"),
        pytest.param([p.SIGNATURE, b"\x7f", b"\xc0"], "unknown command", id="unknown-command"),
        pytest.param([p.SIGNATURE, p.SUBMIT, b"\xc1\xc1"], "invalid submit message", id="garbage-submit"),
        pytest.param([p.SIGNATURE, p.CANCEL, b"\xc1"], "invalid cancel message", id="garbage-cancel"),
        pytest.param([p.SIGNATURE, p.STATUS], "expected at least 3 frames", id="too-few-frames"),
    ],
)
def test_malformed_client_message_gets_an_error_and_others_go_on(
    frames: list[bytes],
    message: str,
    start_broker: Any,
    start_double: Any,
    start_client: Any,
    raw_socket: Any,
) -> None:
    broker = start_broker()
    start_double(broker)
    bad = raw_socket(zmq.DEALER)
    bad.connect(broker.frontend)
    bad.send_multipart(frames)
    (err,) = receive(bad, FROM_BROKER_TO_CLIENT, p.ERROR)
    assert (err.key, err.code) == (None, "protocol")
    assert message in err.message
    assert broker.malformed() == {"invalid": 1}
    # The broker is unharmed: another client's jobs complete.
    rollouts = start_client(broker.frontend).generate(["hello", "world"])
    assert len(rollouts) == 2
    assert broker.jobs("completed") == 2


def test_submit_with_one_invalid_job_among_valid_ones(start_broker: Any, start_double: Any, raw_socket: Any) -> None:
    broker = start_broker()
    start_double(broker)
    client = raw_socket(zmq.DEALER)
    client.connect(broker.frontend)
    header = [
        raw_job("ok-1", []),
        raw_job("bad-n", [0]),  # n=0
        raw_job(12345, []),  # not even a readable job id
        raw_job("ok-2", [2]),
    ]
    client.send_multipart([p.SIGNATURE, p.SUBMIT, msgpack.packb(header)])
    messages = collect(client, lambda ms: len(items(ms, p.FINAL)) == 2 and len(items(ms, p.ERROR)) == 2)
    assert sorted(r.key for r in items(messages, p.FINAL)) == ["ok-1", "ok-2"]
    assert items(messages, p.ACCEPTED) == ["ok-1", "ok-2"]
    errors = {e.key: e for e in items(messages, p.ERROR)}
    assert set(errors) == {"bad-n", None}
    assert "n=0 is outside" in errors["bad-n"].message
    assert broker.malformed() == {"invalid_job": 2}
    assert broker.jobs("completed") == 2
    # A bad job is a bad request (InvalidRequestError on the client), not a broken wire:
    # split_submit() says so, and the broker should forward that code.
    assert errors["bad-n"].code == "invalid_request"


def test_a_job_whose_token_ids_only_the_worker_can_refuse_fails_alone(
    start_broker: Any, start_double: Any, raw_socket: Any
) -> None:
    """The broker checks a prompt's token ids by their count only (``JobRelay``, raw): a
    negative id reaches the worker, which answers that job alone with ``invalid_request``;
    the jobs beside it in the same SUBMIT and the same JOBS message complete."""
    broker = start_broker()
    start_double(broker)
    client = raw_socket(zmq.DEALER)
    client.connect(broker.frontend)
    header = [
        ["ok-1", [], None, None, [1, 2, 3]],
        ["neg", [], None, None, [4, -5]],
        ["ok-2", [], None, [["user", "hi"]]],
    ]
    client.send_multipart([p.SIGNATURE, p.SUBMIT, msgpack.packb(header)])
    messages = collect(client, lambda ms: len(items(ms, p.FINAL)) == 2 and len(items(ms, p.ERROR)) == 1)
    assert sorted(r.key for r in items(messages, p.FINAL)) == ["ok-1", "ok-2"]
    (err,) = items(messages, p.ERROR)
    assert (err.key, err.code) == ("neg", "invalid_request")
    assert err.message == "invalid job: prompt_token_ids must hold 1..1M non-negative ids"
    assert broker.jobs("completed") == 2
    assert broker.jobs("failed") == 1
    assert broker.malformed() == {}  # well-formed for the broker: the worker refused it


def test_oversize_message_is_refused(start_broker: Any, raw_socket: Any) -> None:
    broker = start_broker(max_message_bytes=4096)
    client = raw_socket(zmq.DEALER)
    client.connect(broker.frontend)
    send(client, p.SUBMIT, [p.JobSpec("big", prompt="x" * 5000)])
    (err,) = receive(client, FROM_BROKER_TO_CLIENT, p.ERROR)
    assert (err.key, err.code) == ("big", "protocol")  # the job is named: its id could be read
    assert "exceeds max_message_bytes=4096" in err.message
    assert broker.malformed() == {"oversize": 1}
    assert broker.jobs("submitted") == 0
    # The same client can go on with messages under the limit.
    send(client, p.SUBMIT, [p.JobSpec("small", prompt="x")])
    assert receive(client, FROM_BROKER_TO_CLIENT, p.ACCEPTED) == ["small"]


def test_a_client_that_asks_for_no_accepted_knows_which_message_was_too_big(
    start_broker: Any, start_client: Any, wait_until: Any
) -> None:
    """The reference client asks for no ACCEPTED: an oversize SUBMIT (the client allowed bigger
    messages than this broker) fails its own job, not the older one still queued."""
    broker = start_broker(max_message_bytes=4096)  # and no worker: the first job stays queued
    client = start_client(broker.frontend, max_message_bytes=1 << 20)
    first = client.submit("x")
    wait_until(lambda: broker.status().queued == 1, what="the first job to be queued")
    with pytest.raises(ProtocolError, match="exceeds max_message_bytes=4096"):
        client.generate("y" * 5000, timeout_s=10)
    assert not first.done() and broker.status().queued == 1
    assert broker.malformed() == {"oversize": 1}


@pytest.mark.parametrize("with_invalid_job", [False, True], ids=["all-valid", "one-invalid"])
def test_too_many_jobs_in_one_submit_are_refused(with_invalid_job: bool, start_broker: Any, raw_socket: Any) -> None:
    """The MAX_JOBS_PER_MESSAGE limit holds whether or not the message also needs salvaging."""
    broker = start_broker()
    client = raw_socket(zmq.DEALER)
    client.connect(broker.frontend)
    header = [raw_job(f"j{i}", []) for i in range(p.MAX_JOBS_PER_MESSAGE + 1)]
    if with_invalid_job:
        header[0] = raw_job("j0", [0])
    client.send_multipart([p.SIGNATURE, p.SUBMIT, msgpack.packb(header)])
    errors = receive(client, FROM_BROKER_TO_CLIENT, p.ERROR)  # one per job: each is named
    assert [e.key for e in errors] == [f"j{i}" for i in range(p.MAX_JOBS_PER_MESSAGE + 1)]
    assert {e.code for e in errors} == {"protocol"}
    assert all(f"the limit is {p.MAX_JOBS_PER_MESSAGE}" in e.message for e in errors)
    assert broker.malformed() == {"oversize": 1}
    assert broker.jobs("submitted") == 0


def test_busy_is_raised_by_the_client(start_broker: Any, start_client: Any, wait_until: Any) -> None:
    broker = start_broker(max_queue_per_client=2)  # and no worker: nothing leaves the queue
    client = start_client(broker.frontend)
    with pytest.raises(BusyError, match="max_queue_per_client") as info:
        client.generate(["a", "b", "c", "d"], timeout_s=5)
    assert info.value.job_id is not None
    assert broker.jobs("rejected_busy") == 2
    # The call failed as a whole, so the client cancelled the two that were accepted.
    wait_until(lambda: broker.jobs("cancelled") == 2, what="the accepted jobs to be cancelled")
    assert broker.status().queued == 0


# -- workers that die, go silent or talk nonsense -----------------------------------------
def test_jobs_of_a_dead_worker_complete_elsewhere_exactly_once(
    start_broker: Any, start_double: Any, start_client: Any, wait_until: Any
) -> None:
    broker = start_broker()
    holder = start_double(broker, credits=8, hold=True)
    client = start_client(broker.frontend)
    futures = [client.submit([i + 1, i + 2]) for i in range(4)]
    wait_until(lambda: len(holder.held) == 4, what="the holding double to take the jobs")
    rescuer = start_double(broker, credits=8)
    assert rescuer.received == []
    holder.die()
    results = [f.result(timeout=10) for f in futures]
    assert [len(r) for r in results] == [1, 1, 1, 1]
    assert {r[0].worker_id for r in results} == {rescuer.name}
    assert [r[0].prompt_token_ids for r in results] == [[i + 1, i + 2] for i in range(4)]
    assert Counter(a.job.job_id for a in rescuer.received) == Counter(a.job.job_id for a in holder.received)
    assert set(Counter(a.job.job_id for a in rescuer.received).values()) == {1}
    assert broker.jobs("requeued") == 4
    assert broker.jobs("completed") == 4


def test_silent_worker_expires_and_its_late_final_is_dropped(
    start_broker: Any, start_double: Any, raw_socket: Any, wait_until: Any
) -> None:
    broker = start_broker(worker_liveness=5)  # expiry after 0.5 s of silence
    silent = raw_socket(zmq.DEALER)
    silent.connect(broker.backend)
    send(silent, p.READY, p.WorkerInfo("silent", "tiny", 4))
    wait_until(lambda: broker.has_worker("silent"), what="the silent worker to register")
    client = raw_socket(zmq.DEALER)
    client.connect(broker.frontend)
    send(client, p.SUBMIT, [p.JobSpec(f"j{i}", prompt_token_ids=[i + 1]) for i in range(3)])
    assignments = receive(silent, FROM_BROKER_TO_WORKER, p.JOBS)
    assert sorted(a.job.job_id for a in assignments) == ["j0", "j1", "j2"]
    rescuer = start_double(broker)

    assert receive(silent, FROM_BROKER_TO_WORKER, p.DISCONNECT, timeout=5) is None
    assert broker.jobs("workers_expired") == 1
    assert not broker.has_worker("silent")
    # It wakes up and answers under the old tickets: too late, the jobs went elsewhere, and
    # the broker, which no longer knows it, tells it to reconnect fresh.
    send(silent, p.FINAL, [echo_result(a, "silent", 0) for a in assignments])
    assert receive(silent, FROM_BROKER_TO_WORKER, p.DISCONNECT) is None

    messages = collect(client, lambda ms: len(items(ms, p.FINAL)) >= 3)
    finals = items(messages, p.FINAL)
    assert sorted(r.key for r in finals) == ["j0", "j1", "j2"]  # exactly one each
    assert {r.worker_id for r in finals} == {rescuer.name}
    assert broker.jobs("completed") == 3
    assert broker.jobs("requeued") == 3


def test_broker_survives_a_worker_sending_garbage(
    start_broker: Any, start_double: Any, start_client: Any, raw_socket: Any, wait_until: Any
) -> None:
    broker = start_broker()
    stranger = raw_socket(zmq.DEALER)
    stranger.connect(broker.backend)
    stranger.send_multipart([b"junk"])
    # An unknown peer talking nonsense is told to reconnect fresh.
    assert receive(stranger, FROM_BROKER_TO_WORKER, p.DISCONNECT) is None

    registered = raw_socket(zmq.DEALER)
    registered.connect(broker.backend)
    send(registered, p.READY, p.WorkerInfo("garbler", "tiny", 0))
    wait_until(lambda: broker.has_worker("garbler"), what="the worker to register")
    registered.send_multipart([p.SIGNATURE, p.READY, b"\xc1"])
    registered.send_multipart([p.SIGNATURE, b"\x7f", b"\xc0"])
    registered.send_multipart([p.SIGNATURE, p.SUBMIT, b"\xc0"])  # a client command, on the backend
    wait_until(lambda: broker.malformed().get("worker") == 4, what="the garbage to be counted")
    assert broker.has_worker("garbler")  # a registered worker is not thrown out for one bad message

    start_double(broker)
    assert len(start_client(broker.frontend).generate(["still", "alive"])) == 2


# -- clients that leave -------------------------------------------------------------------
def test_client_disconnect_drops_its_queued_jobs(start_broker: Any, start_client: Any, wait_until: Any) -> None:
    broker = start_broker()  # no worker: the jobs stay queued
    client = start_client(broker.frontend, name="leaver")
    for i in range(5):
        client.submit(f"prompt {i}")
    wait_until(lambda: broker.status().queued == 5, what="the jobs to be queued")
    assert [c.queued for c in broker.status().clients if c.name.startswith("leaver-")] == [5]
    client.close()
    wait_until(lambda: broker.jobs("dropped_client_gone") == 5, what="the broker to drop the jobs")
    status = broker.status()
    assert status.queued == 0
    assert not [c for c in status.clients if c.name.startswith("leaver-")]  # forgotten


def test_client_disconnect_cancels_its_running_jobs(
    start_broker: Any, start_double: Any, start_client: Any, wait_until: Any
) -> None:
    broker = start_broker()
    holder = start_double(broker, hold=True)
    client = start_client(broker.frontend)
    client.submit("prompt")
    wait_until(lambda: len(holder.held) == 1, what="the job to reach the worker")
    ticket = holder.held[0].ticket
    client.close()
    wait_until(lambda: holder.cancelled == [ticket], what="the worker to be told to cancel")
    assert broker.jobs("dropped_client_gone") == 1
