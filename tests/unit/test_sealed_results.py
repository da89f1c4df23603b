"""SEALED_FINAL (docs/protocol.md section 5.3): a worker seals each result in a msgpack bin that
the broker steps over, and the broker gives the client the same plain ``Result`` a FINAL gives.

The broker says it reads SEALED_FINAL in its answer to READY (``Liveness.sealed``); a worker
that was not told sends FINAL, which the broker still reads.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq
from helpers import poll_until

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.errors import ProtocolError

FROM_WORKER = codec.Decoder(codec.FROM_WORKER)
TO_CLIENT = codec.Decoder(codec.TO_CLIENT)
TO_WORKER = codec.Decoder(codec.TO_WORKER)
SAMPLE = p.Sample(0, [7, 8, 9], [-0.5, -0.25, -0.125], "length", [{7: -0.5}, {8: -0.25}, {9: -0.125}], None, "abc")


def result(ticket: int, version: int = 3) -> p.Result:
    return p.Result(ticket, [1, 2, 150_000], [SAMPLE, SAMPLE], version, "worker-a")


def sealed_final(*items: Any) -> list[Any]:
    return codec.encode(p.SEALED_FINAL, list(items))


# -- the Struct ---------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [1, 31, 32, 255, 256, 65_535, 65_536])
def test_the_client_gets_the_sealed_result_keyed_by_job_ids_of_every_string_width(length: int) -> None:
    """fixstr, str 8, str 16 and str 32 job ids spliced in for the nil key."""
    job_id = "j" * length
    (relayed,) = FROM_WORKER.decode(sealed_final(p.seal(result(11)))).body
    assert (relayed.key, relayed.weight_version) == (11, 3)
    to_client = msgspec.msgpack.decode(codec.encode_body([relayed.to_client(job_id)]), type=list[p.Result])
    expected = result(11)
    expected.key = job_id
    assert to_client == [expected]


@pytest.mark.parametrize(
    ("prompt", "sampled", "worth"),
    [(p.SEAL_MIN_TOKENS - 1, [], False), (p.SEAL_MIN_TOKENS, [], True), (1, [31, 31], False), (2, [31, 31], True)],
)
def test_a_result_is_worth_sealing_from_seal_min_tokens_prompt_and_samples_together(
    prompt: int, sampled: list[int], worth: bool
) -> None:
    samples = [p.Sample(i, [7] * n, [-0.5] * n, "length") for i, n in enumerate(sampled)]
    assert p.worth_sealing(p.Result(1, [1] * prompt, samples, 0, "w")) is worth


def test_sealing_leaves_the_result_as_it_was() -> None:
    original = result(11)
    sealed = p.seal(original)
    assert original == result(11) and sealed.key == 11
    assert bytes(sealed.result[:2]) == b"\x95\xc0"


def test_a_sealed_result_of_more_fields_than_this_version_knows_is_relayed_whole() -> None:
    """A newer worker may append fields (docs/protocol.md 2.1): the client gets them, and
    ignores what it does not know."""
    body = msgspec.msgpack.encode([None, [1], [SAMPLE], 3, "w", "a field from the future"])
    (relayed,) = FROM_WORKER.decode(sealed_final(p.SealedResult(5, 3, memoryview(body)))).body
    raw = codec.encode_body(relayed.to_client("job"))
    assert msgspec.msgpack.decode(raw)[-1] == "a field from the future"
    assert msgspec.msgpack.decode(raw, type=p.Result) == p.Result("job", [1], [SAMPLE], 3, "w")


@pytest.mark.parametrize(
    "body",
    [
        msgspec.msgpack.encode([11, [1], [], 3, "w"]),  # keyed inside: the splice would keep a ticket
        msgspec.msgpack.encode({"key": None}),
        msgspec.msgpack.encode([None, [1], [], 3]),  # four items: not a Result
        b"",
        b"\x95",
    ],
    ids=["keyed_inside", "a_map", "four_items", "empty", "one_byte"],
)
def test_a_sealed_result_that_is_not_a_result_with_a_nil_key_fails_its_message(body: bytes) -> None:
    with pytest.raises(ProtocolError, match="invalid sealed_final message: a sealed result is a Result"):
        FROM_WORKER.decode(sealed_final([5, 3, body]))


@pytest.mark.parametrize(
    "item",
    [[5, 3, "a str, not a bin"], [5, 3], ["5", 3, b"\x95\xc0"], [5, 3.5, b"\x95\xc0"]],
    ids=["str_body", "no_body", "str_ticket", "float_version"],
)
def test_a_sealed_result_of_the_wrong_shape_fails_its_message(item: list[Any]) -> None:
    with pytest.raises(ProtocolError, match="invalid sealed_final message"):
        FROM_WORKER.decode(sealed_final(item))


def test_the_samples_of_a_sealed_result_that_does_not_decode_are_nil() -> None:
    """Read only for a result that crossed a sync (staleness): one that does not decode so far
    is counted at its version, and its client finds out."""
    (broken,) = FROM_WORKER.decode(sealed_final([5, 3, b"\x95\xc0\xc1"])).body  # c1: never used in msgpack
    assert broken.samples == msgspec.Raw(b"\xc0")
    (good,) = FROM_WORKER.decode(sealed_final(p.seal(result(5)))).body
    assert msgspec.msgpack.decode(good.samples, type=list[p.Sample]) == [SAMPLE, SAMPLE]


# -- a client's FINAL of sealed results, spliced as it is written (SplicedFinal) ---------------
def relayed_sealed(*tickets: int) -> list[p.SealedResult]:
    return FROM_WORKER.decode(sealed_final(*(p.seal(result(t)) for t in tickets))).body  # type: ignore[no-any-return]


@pytest.mark.parametrize("count", [1, 15, 16, 70_000])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "split"])
def test_a_spliced_final_is_the_same_bytes_as_the_list_to_client_builds(count: int, packed: bool) -> None:
    """Array headers of every width (fixarray, array 16, array 32) and job ids of 1 and 40 characters."""
    sealed = relayed_sealed(*range(1, min(count, 3) + 1))
    ids = [("j" * (1 + 39 * (i % 2))) + str(i) for i in range(count)]
    pairs = [(jid, sealed[i % len(sealed)]) for i, jid in enumerate(ids)]
    spliced = p.SplicedFinal((jid, s.result) for jid, s in pairs)
    plain = [s.to_client(jid) for jid, s in pairs]
    assert b"".join(map(bytes, codec.encode(p.FINAL, spliced, packed=packed))) == b"".join(
        map(bytes, codec.encode(p.FINAL, plain, packed=packed))
    )


def test_a_spliced_final_writes_results_of_every_other_kind_as_the_encoder_does() -> None:
    (relayed,) = FROM_WORKER.decode(codec.encode(p.FINAL, [result(4)])).body
    plain_result = result(5)
    (sealed,) = relayed_sealed(6)
    spliced = p.SplicedFinal([relayed.to_client("a"), ("b", sealed.result), plain_result])
    frames = codec.encode(p.FINAL, spliced, packed=True)
    assert frames == codec.encode(p.FINAL, [relayed, sealed.to_client("b"), plain_result], packed=True)
    keys = [r.key for r in TO_CLIENT.decode(frames).body]
    assert keys == ["a", "b", 5]


def scheduler_with_jobs(*job_ids: str) -> tuple[Any, dict[str, int]]:
    from zmq_rollout.broker.scheduler import Scheduler

    s = Scheduler()
    s.worker_ready(b"w", p.WorkerInfo("w", "m", 8), 0.0)
    s.submit(b"c", [p.JobSpec(jid, p.SamplingParams(max_tokens=4), "x", ack=False) for jid in job_ids], 0.0)
    tickets = {a.job.job_id: a.ticket for _, _, cmd, body in s.outbox.take() if cmd == p.JOBS for a in body}
    return s, tickets


def client_finals(sent: list[Any]) -> list[list[p.Result]]:
    """Each FINAL in ``sent`` (the outbox's), as the client decodes it."""
    return [TO_CLIENT.decode(codec.encode(cmd, body, packed=True)).body for _, _, cmd, body in sent]


def test_sealed_results_reach_the_client_keyed_by_their_job_ids_in_one_final() -> None:
    s, tickets = scheduler_with_jobs("j1", "j2", "j3")
    s.worker_final(b"w", relayed_sealed(tickets["j2"], tickets["j1"]), 1.0)
    s.worker_final(b"w", relayed_sealed(tickets["j3"]), 1.0)  # the same pass: the same FINAL
    sent = s.outbox.take()
    (body,) = [body for _, _, cmd, body in sent if cmd == p.FINAL]
    assert type(body) is p.SplicedFinal and [jid for jid, _ in body] == ["j2", "j1", "j3"]  # spliced when written
    (final,) = client_finals(sent)
    assert [r.key for r in final] == ["j2", "j1", "j3"]
    expected = result(0)
    assert all((r.prompt_token_ids, r.samples, r.weight_version) == (expected.prompt_token_ids, [SAMPLE, SAMPLE], 3)
               for r in final)  # fmt: skip


@pytest.mark.parametrize("sealed_first", [True, False], ids=["sealed_then_plain", "plain_then_sealed"])
def test_sealed_and_plain_results_of_one_pass_reach_the_client_in_order(sealed_first: bool) -> None:
    s, tickets = scheduler_with_jobs("j1", "j2")
    sealed_message = relayed_sealed(tickets["j1"])
    plain_message = FROM_WORKER.decode(codec.encode(p.FINAL, [result(tickets["j2"])])).body
    first, second = (sealed_message, plain_message) if sealed_first else (plain_message, sealed_message)
    s.worker_final(b"w", first, 1.0)
    s.worker_final(b"w", second, 1.0)
    keys = [r.key for final in client_finals(s.outbox.take()) for r in final]
    assert keys == (["j1", "j2"] if sealed_first else ["j2", "j1"])


# -- through a broker ---------------------------------------------------------------------------
def receive_command(sock: zmq.Socket[Any], decoder: codec.Decoder, command: bytes, timeout: float = 5.0) -> Any:
    """The body of the next message with ``command`` (heartbeats and the like skipped)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000)):
            break
        msg = decoder.decode(sock.recv_multipart())
        if msg.command == command:
            return msg.body
    pytest.fail(f"no {p.COMMAND_NAMES[command]} within {timeout} s")


def connected(raw_socket: Any, address: str, name: str) -> zmq.Socket[Any]:
    sock = raw_socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.connect(address)
    return sock


def test_the_broker_relays_sealed_and_plain_results_alike(start_broker: Any, raw_socket: Any) -> None:
    broker = start_broker()
    worker = connected(raw_socket, broker.backend, "w-sealed")
    worker.send_multipart(codec.encode(p.READY, p.WorkerInfo("w-sealed", "m", 8)))
    hello = receive_command(worker, TO_WORKER, p.HEARTBEAT)
    assert isinstance(hello, p.Liveness) and hello.sealed  # READY's answer: this broker reads SEALED_FINAL
    client = connected(raw_socket, broker.frontend, "c-sealed")
    jobs = [p.JobSpec(f"j{i}", p.SamplingParams(max_tokens=3), prompt_token_ids=[1, 2], ack=False) for i in range(3)]
    client.send_multipart(codec.encode(p.SUBMIT, jobs))
    tickets: dict[str, int] = {}
    while len(tickets) < 3:
        tickets.update({a.job.job_id: a.ticket for a in receive_command(worker, TO_WORKER, p.JOBS)})
    # j0 sealed beside a result for a ticket the broker never gave; j1 plain; j2 sealed alone.
    worker.send_multipart(codec.encode(p.SEALED_FINAL, [p.seal(result(tickets["j0"])), p.seal(result(999_999))]))
    worker.send_multipart(codec.encode(p.FINAL, [result(tickets["j1"])], packed=True))
    worker.send_multipart(codec.encode(p.SEALED_FINAL, [p.seal(result(tickets["j2"], 4))], packed=True))
    finals: list[p.Result] = []
    while len(finals) < 3:
        finals.extend(receive_command(client, TO_CLIENT, p.FINAL))
    expected = [result(0), result(0), result(0, 4)]
    for job_id, want in zip(("j0", "j1", "j2"), expected, strict=True):
        want.key = job_id
    assert finals == expected
    stats = broker.thread.broker.scheduler.stats
    poll_until(lambda: stats.completed == 3, what="three completed jobs")
    assert stats.late_replies == 1 and broker.malformed() == {}


def test_a_malformed_sealed_final_is_counted_and_its_job_stays_with_its_worker(
    start_broker: Any, raw_socket: Any
) -> None:
    """As a FINAL that does not decode: counted, and the job is not answered from it."""
    broker = start_broker()
    worker = connected(raw_socket, broker.backend, "w-bad")
    worker.send_multipart(codec.encode(p.READY, p.WorkerInfo("w-bad", "m", 8)))
    client = connected(raw_socket, broker.frontend, "c-bad")
    client.send_multipart(codec.encode(p.SUBMIT, [p.JobSpec("j", prompt="hi", ack=False)]))
    (assignment,) = receive_command(worker, TO_WORKER, p.JOBS)
    keyed_inside = msgspec.msgpack.encode([assignment.ticket, [1], [], 0, "w"])
    worker.send_multipart(codec.encode(p.SEALED_FINAL, [[assignment.ticket, 0, keyed_inside]]))
    poll_until(lambda: broker.malformed() == {"worker": 1}, what="the bad SEALED_FINAL to be counted")
    worker.send_multipart(codec.encode(p.SEALED_FINAL, [p.seal(result(assignment.ticket, 0))]))
    (final,) = receive_command(client, TO_CLIENT, p.FINAL)
    assert (final.key, final.samples) == ("j", [SAMPLE, SAMPLE])


def test_the_echo_double_seals_once_told_and_not_when_split_only(
    start_broker: Any, start_double: Any, start_client: Any
) -> None:
    """Both kinds of double give the client the same results through one broker."""
    broker = start_broker()
    sealed = start_double(broker, credits=2, name="sealing-double")
    start_double(broker, credits=2, name="old-double", split_only=True)
    client = start_client(broker.frontend, name="c-doubles")
    long, short = list(range(1, p.SEAL_MIN_TOKENS + 1)), [1, 2, 3]
    rollouts = client.generate([long] * 4 + [short] * 4, p.SamplingParams(max_tokens=2))
    assert [r.prompt_token_ids for r in rollouts] == [long] * 4 + [short] * 4
    assert {r.worker_id for r in rollouts} == {"sealing-double", "old-double"}
    # The sealing double sealed its long results alone: a short one goes as FINAL.
    long_there = sum(r.prompt_token_ids == long for r in rollouts if r.worker_id == "sealing-double")
    assert sealed.sealed_sent == long_there > 0
