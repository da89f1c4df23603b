"""SEALED_SUBMIT: jobs sealed by the client, read by the broker only where it must, and forwarded
to the worker as the client encoded them (docs/protocol.md section 5.9)."""

from __future__ import annotations

import threading
from typing import Any

import msgpack
import msgspec
import pytest
import zmq

from tests.helpers import poll_until
from tests.raw_peers import Inbox, jobs_raw, raw_worker, send
from zmq_rollout import SamplingParams, codec
from zmq_rollout import protocol as p
from zmq_rollout.broker.older_workers import fit_jobs
from zmq_rollout.broker.scheduler import Scheduler
from zmq_rollout.config import BrokerConfig
from zmq_rollout.errors import ProtocolError
from zmq_rollout.submissions import encode_job, pack_submits, submit_command

JOB = p.JobSpec(
    "s1",
    SamplingParams(n=2, max_tokens=3),
    prompt_token_ids=[5, 6, 7],
    stream=True,
    min_weight_version=0,
    session_id="episode-1",
    max_staleness=4,
    on_stale="restart",
    ack=False,
)


def _sealed_body(jobs: list[p.JobSpec]) -> list[msgspec.Raw]:
    ((_, encoded),) = pack_submits(jobs, 64, 1 << 20, token_bins=True, sealed=True)
    return encoded


# -- the client's side and the broker's decoding ------------------------------------------------
def test_a_sealed_job_carries_the_job_as_a_submit_would_and_copies_of_what_the_broker_reads() -> None:
    (raw,) = _sealed_body([JOB])
    sealed = msgspec.msgpack.decode(raw, type=p.SealedJob)
    assert bytes(sealed.job) == encode_job(JOB, token_bins=True)
    copies = (sealed.job_id, sealed.cost(), sealed.ack, sealed.stream, sealed.session_id, sealed.session_end)
    assert copies == ("s1", 2, False, True, "episode-1", False)
    assert (sealed.min_weight_version, sealed.max_staleness, sealed.on_stale, sealed.resubmitted) == (
        0,
        4,
        "restart",
        False,
    )
    assert submit_command(True) == p.SEALED_SUBMIT and submit_command(False) == p.SUBMIT
    ((_, plain),) = pack_submits([JOB], 64, 1 << 20, token_bins=True)
    assert bytes(plain[0]) == encode_job(JOB, token_bins=True)  # unsealed: as before


PLAIN = p.JobSpec("p1", SamplingParams(max_tokens=3), prompt="hi")
ONE_FIELD_EACH = {  # each copy the broker reads, away from its default
    "ack": {"ack": False},
    "stream": {"stream": True},
    "session_id": {"session_id": "e"},
    "session_end": {"session_id": "e", "session_end": True},
    "min_weight_version": {"min_weight_version": 3},
    "max_staleness": {"max_staleness": 0},
    "on_stale": {"max_staleness": 1, "on_stale": "restart"},
    "resubmitted": {"resubmitted": True},
    "n": {"sampling": SamplingParams(n=3)},
}


@pytest.mark.parametrize("changes", [{}, *ONE_FIELD_EACH.values()], ids=["defaults", *ONE_FIELD_EACH])
def test_a_sealed_job_leaves_off_only_trailing_defaults(changes: dict[str, Any]) -> None:
    job = msgspec.structs.replace(PLAIN, **changes)
    encoded = encode_job(job, token_bins=True)
    short = p.sealed_job(job, encoded)
    full = msgspec.msgpack.encode(p.SealedJob.of(job, encoded))
    assert msgspec.msgpack.decode(short, type=p.SealedJob) == msgspec.msgpack.decode(full, type=p.SealedJob)
    if not changes or changes == {"ack": False} or "sampling" in changes:
        assert len(msgpack.unpackb(short)) == (4 if changes == {"ack": False} else 3)  # [job_id, n, job(, ack)]


def test_the_broker_decodes_a_sealed_submit_and_refuses_a_bad_copy() -> None:
    decoder = codec.Decoder(codec.BROKER_FROM_CLIENT)
    msg = decoder.decode(codec.encode(p.SEALED_SUBMIT, _sealed_body([JOB])))
    assert msg.command == p.SEALED_SUBMIT and [j.job_id for j in msg.body] == ["s1"]
    bad = msgspec.msgpack.encode([["s2", 0, msgspec.Raw(encode_job(JOB, True))]])  # n below 1
    with pytest.raises(ProtocolError, match="invalid sealed_submit message"):
        decoder.decode([p.SIGNATURE, p.SEALED_SUBMIT, bad])


@pytest.mark.parametrize(("charged", "refused"), [(2, False), (1, True), (0, False)])
def test_the_worker_refuses_a_job_whose_n_is_not_its_cost(charged: int, refused: bool) -> None:
    jobs = msgspec.msgpack.encode([p.AssignmentRelay(9, msgspec.Raw(encode_job(JOB, True)), charged)])
    (opened,) = [p.unseal(s) for s in msgspec.msgpack.decode(jobs, type=list[p.SealedAssignment])]
    if refused:
        assert isinstance(opened, p.ErrorItem)
        assert (opened.key, opened.code) == (9, "invalid_request")
        assert opened.message == "invalid job: its sampling.n is 2, but it was submitted (SEALED_SUBMIT) with n=1"
    else:  # the charged n, or none said (0: an older broker)
        assert opened == p.Assignment(9, JOB)


# -- through a broker ------------------------------------------------------------------------
def _client(raw_socket: Any, broker: Any) -> tuple[zmq.Socket[Any], Inbox]:
    client = raw_socket(zmq.DEALER)
    client.connect(broker.frontend)
    inbox = Inbox(client)
    send(client, p.HEARTBEAT)
    assert inbox.items(p.HEARTBEAT, 1)[0].sealed_jobs  # what clients are told
    return client, inbox


@pytest.mark.parametrize("checks_cost", [True, False])
def test_the_broker_forwards_a_sealed_job_as_the_client_encoded_it(
    start_broker: Any, raw_socket: Any, checks_cost: bool
) -> None:
    """To a worker that checks the cost, the client's bytes themselves; to an older one, the job
    opened by the broker (the same job)."""
    broker = start_broker()
    worker = raw_worker(raw_socket, broker, [p.TOKEN_BINS, p.SEALED_JOBS] if checks_cost else [p.TOKEN_BINS])
    poll_until(lambda: broker.has_worker("raw"), what="the raw worker to register")
    client, inbox = _client(raw_socket, broker)
    job = msgspec.structs.replace(JOB, session_id=None, stream=False)
    send(client, p.SEALED_SUBMIT, _sealed_body([job]))
    ((ticket, forwarded, cost),) = jobs_raw(worker)
    assert cost == 2
    assert msgpack.packb(forwarded) == encode_job(job, token_bins=True)
    send(worker, p.FINAL, [p.Result(ticket, [5, 6, 7], [], 0, "raw")])
    (result,) = inbox.items(p.FINAL, 1)
    assert result.key == "s1"
    assert broker.malformed() == {}


def test_the_broker_refuses_for_an_older_worker_a_sealed_job_whose_n_differs(
    start_broker: Any, raw_socket: Any
) -> None:
    """An older worker would run the job's own n on the credits its copy charged: the broker
    opens the job, and answers the client as that worker would have; the next job runs."""
    broker = start_broker()
    worker = raw_worker(raw_socket, broker, [p.TOKEN_BINS])
    poll_until(lambda: broker.has_worker("raw"), what="the raw worker to register")
    client, inbox = _client(raw_socket, broker)
    lying = msgspec.structs.replace(p.SealedJob.of(JOB, encode_job(JOB, True)), n=1)  # its job says n=2
    good = p.JobSpec("s2", SamplingParams(max_tokens=3), prompt="hi", ack=False)
    send(client, p.SEALED_SUBMIT, [lying, *_sealed_body([good])])
    (err,) = inbox.items(p.ERROR, 1)
    assert (err.key, err.code) == ("s1", "invalid_request")
    assert "sampling.n is 2, but it was submitted (SEALED_SUBMIT) with n=1" in err.message
    ((ticket, forwarded, cost),) = jobs_raw(worker)
    assert (forwarded[0], cost) == ("s2", 1)
    send(worker, p.FINAL, [p.Result(ticket, [1], [], 0, "raw")])
    assert [r.key for r in inbox.items(p.FINAL, 1)] == ["s2"]
    assert broker.status().queued == 0 and broker.status().running == 0


def test_a_bad_sealed_job_is_refused_to_its_sender_alone(start_broker: Any, start_double: Any, raw_socket: Any) -> None:
    broker = start_broker()
    start_double(broker)
    client, inbox = _client(raw_socket, broker)
    good = p.JobSpec("good", SamplingParams(max_tokens=2), prompt="hi", ack=False)
    bad = ["bad", 0, msgspec.Raw(encode_job(good, True))]  # n below 1
    client.send_multipart([p.SIGNATURE, p.SEALED_SUBMIT, msgspec.msgpack.encode([bad, *_sealed_body([good])])])
    (err,) = inbox.items(p.ERROR, 1)
    assert (err.key, err.code) == ("bad", "invalid_request")
    assert "n" in err.message and ">= 1" in err.message
    (final,) = inbox.items(p.FINAL, 1)
    assert final.key == "good"


def test_the_client_seals_jobs_for_a_broker_that_reads_them(
    start_broker: Any, start_double: Any, start_client: Any
) -> None:
    """The reference client against a broker that says ``sealed_jobs``, through the echo double
    (a test double) that checks each job's cost as the worker does."""
    broker = start_broker()
    start_double(broker)
    client = start_client(broker.frontend)
    poll_until(lambda: client._async._conn.sealed_jobs, what="the broker to tell the client")
    sent: list[bytes] = []
    conn = client._async._conn
    send_before = conn.send

    async def spying_send(command: bytes, body: Any) -> None:
        sent.append(command)
        await send_before(command, body)

    conn.send = spying_send
    out: list[Any] = []
    thread = threading.Thread(
        target=lambda: out.extend(client.generate([[1, 2], [3]], SamplingParams(n=2, max_tokens=2)))
    )
    thread.start()
    thread.join(10)
    assert p.SEALED_SUBMIT in sent and p.SUBMIT not in sent
    assert [r.prompt_token_ids for r in out] == [[1, 2], [1, 2], [3], [3]]  # one result per sample of n=2
    assert broker.malformed() == {}


def test_a_job_the_broker_cannot_send_a_worker_ends_without_refreshing_that_worker() -> None:
    """``fit_jobs``' refusals end their tickets as a worker's ERROR would, but the worker did not
    speak: a dead one must still expire."""
    s = Scheduler(BrokerConfig())
    s.worker_ready(b"w", p.WorkerInfo("w", "m", 4, 0, [p.TOKEN_BINS]), 0.0)
    s.outbox.take()
    lying = msgspec.structs.replace(p.SealedJob.of(JOB, encode_job(JOB, True)), n=1)
    s.submit(b"c", [lying], 1.0)
    ((_, _, command, body),) = [m for m in s.outbox.take() if m[2] == p.JOBS]
    worker = s.workers[b"w"]
    kept, refused = fit_jobs(worker, body)
    assert (kept, [e.key for e in refused]) == ([], [body[0].ticket])
    s.fail_tickets(worker, refused, 2.0)
    assert (worker.last_seen, worker.credits_used, worker.running) == (0.0, 0, {})
    ((_, _, command, errors),) = s.outbox.take()
    assert command == p.ERROR and [(e.key, e.code) for e in errors] == [("s1", "invalid_request")]
