"""Token bins (``zmq_rollout/protocol/token_bins.py``, docs/protocol.md section 5.8): a job's
prompt ids as one msgpack bin of 4-byte little-endian ids, which the broker steps over instead of
walking; sent by a client once the broker says it reads them, and by the broker only to workers
whose READY lists ``token_bins`` (the others get an array of the same ids)."""

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
from zmq_rollout.protocol.jobs import check_raw_list
from zmq_rollout.protocol.token_bins import as_array, bin_length, is_bin
from zmq_rollout.submissions import encode_job, pack_submits

IDS = [0, 1, 255, 256, 65_535, 65_536, 151_935, (1 << 32) - 1]


def test_a_token_bin_is_4_byte_little_endian_ids() -> None:
    data = p.to_bin(IDS)
    assert data is not None and len(data) == 4 * len(IDS)
    assert data[:16] == b"\x00\x00\x00\x00\x01\x00\x00\x00\xff\x00\x00\x00\x00\x01\x00\x00"
    assert p.from_bin(data) == IDS


@pytest.mark.parametrize("bad", [[-1], [1 << 32], [0, 1, -7]])
def test_ids_that_do_not_fit_32_unsigned_bits_make_no_bin(bad: list[int]) -> None:
    assert p.to_bin(bad) is None


def test_a_bin_of_a_length_not_a_multiple_of_4_is_refused() -> None:
    with pytest.raises(ValueError, match=r"must be 4 bytes an id \(little-endian\), not 7 bytes"):
        p.from_bin(b"\x01" * 7)


def test_a_job_given_or_decoded_with_a_bin_holds_a_list() -> None:
    data = p.to_bin(IDS)
    assert p.JobSpec("a", prompt_token_ids=data).prompt_token_ids == IDS
    wire = msgpack.packb(["a", [], None, None, data])  # bytes pack as a bin
    decoded = msgspec.msgpack.decode(wire, type=p.JobSpec)
    assert decoded.prompt_token_ids == IDS
    with pytest.raises(msgspec.ValidationError, match="4 bytes an id"):
        msgspec.msgpack.decode(msgpack.packb(["a", [], None, None, b"\x01\x02"]), type=p.JobSpec)


def _relay(ids_item: Any) -> p.JobRelay:
    return msgspec.msgpack.decode(msgpack.packb(["a", [], None, None, ids_item]), type=p.JobRelay)


@pytest.mark.parametrize("count", [1, 63, 64, 16_384, 70_000])  # bin 8, 16 and 32 headers
def test_the_broker_reads_a_bins_id_count_from_its_header(count: int) -> None:
    relay = _relay(b"\x07\x00\x00\x00" * count)
    assert is_bin(relay.prompt_token_ids) and bin_length(relay.prompt_token_ids) == 4 * count
    check_raw_list("prompt_token_ids", relay.prompt_token_ids, count, token_bin=True)
    with pytest.raises(ValueError, match=f"must hold 1..{count - 1} items, not {count}"):
        check_raw_list("prompt_token_ids", relay.prompt_token_ids, count - 1, token_bin=True)


@pytest.mark.parametrize(
    ("ids_item", "error"),
    [
        (b"", "prompt_token_ids must hold 1..1048576 items, not 0"),
        (b"\x01\x02\x03\x04\x05", r"prompt_token_ids as bytes must be 4 bytes an id \(little-endian\), not 5 bytes"),
    ],
)
def test_the_broker_refuses_a_bin_that_is_no_list_of_ids(ids_item: bytes, error: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=error):
        _relay(ids_item)


def test_messages_as_a_bin_are_still_refused() -> None:
    with pytest.raises(ValueError, match="messages must be a list"):
        check_raw_list("messages", msgspec.Raw(msgpack.packb(b"\x00" * 8)), 10)


def test_a_bin_becomes_the_array_of_the_same_ids_for_an_older_worker() -> None:
    relay = _relay(p.to_bin(IDS))
    array = as_array(relay.prompt_token_ids)
    assert msgspec.msgpack.decode(array) == IDS
    assert as_array(array) is array  # an array stays as it is


def test_a_client_sends_a_bin_only_where_the_broker_reads_it() -> None:
    job = p.JobSpec("a", SamplingParams(max_tokens=4), prompt_token_ids=list(range(1000, 1512)))
    as_bin, as_list = encode_job(job, True), encode_job(job, False)
    assert not is_bin(msgspec.msgpack.decode(as_list, type=p.JobRelay).prompt_token_ids)
    assert msgspec.msgpack.decode(as_list, type=p.JobSpec) == job
    assert is_bin(msgspec.msgpack.decode(as_bin, type=p.JobRelay).prompt_token_ids)
    assert msgspec.msgpack.decode(as_bin, type=p.JobSpec) == job  # the same job
    assert job.prompt_token_ids == list(range(1000, 1512))  # the caller's job is untouched
    huge = p.JobSpec("h", prompt_token_ids=[1 << 32])  # too big for a bin: an array, for the worker to refuse
    assert not is_bin(msgspec.msgpack.decode(encode_job(huge, True), type=p.JobRelay).prompt_token_ids)
    assert msgspec.msgpack.decode(encode_job(huge, True), type=p.JobSpec) == huge
    text = p.JobSpec("t", prompt="hi")
    assert msgspec.msgpack.decode(encode_job(text, True), type=p.JobSpec) == text
    ((_, encoded),) = pack_submits([job], 64, 1 << 20, token_bins=True)
    assert bytes(encoded[0]) == as_bin


# -- through a broker ------------------------------------------------------------------------
@pytest.mark.parametrize("reads_bins", [True, False])
def test_the_broker_relays_a_bin_to_a_worker_that_reads_it_and_an_array_to_one_that_does_not(
    start_broker: Any, raw_socket: Any, reads_bins: bool
) -> None:
    broker = start_broker()
    worker = raw_worker(raw_socket, broker, ["generate", p.TOKEN_BINS] if reads_bins else ["generate"])
    client = raw_socket(zmq.DEALER)
    client.connect(broker.frontend)
    inbox = Inbox(client)
    send(client, p.HEARTBEAT)
    assert inbox.items(p.HEARTBEAT, 1)[0].token_bins  # what clients are told
    send(client, p.SUBMIT, [msgspec.Raw(encode_job(p.JobSpec("b", prompt_token_ids=IDS), token_bins=True))])
    ((ticket, job, cost),) = jobs_raw(worker)
    assert (job[4], cost) == ((p.to_bin(IDS) if reads_bins else IDS), 1)
    send(worker, p.FINAL, [p.Result(ticket, IDS, [], 0, "raw")])
    (result,) = inbox.items(p.FINAL, 1)
    assert (result.key, result.prompt_token_ids) == ("b", IDS)
    assert broker.malformed() == {}


def test_a_bad_bin_is_refused_to_its_sender_alone(start_broker: Any, start_double: Any, raw_socket: Any) -> None:
    broker = start_broker()
    start_double(broker)
    client = raw_socket(zmq.DEALER)
    client.connect(broker.frontend)
    header = [["bad", [], None, None, b"\x01\x02\x03"], ["good", [], None, None, p.to_bin([5, 6])]]
    client.send_multipart([p.SIGNATURE, p.SUBMIT, msgpack.packb(header)])
    inbox = Inbox(client)
    (err,) = inbox.items(p.ERROR, 1)
    assert (err.key, err.code) == ("bad", "invalid_request")
    assert "4 bytes an id" in err.message
    (final,) = inbox.items(p.FINAL, 1)
    assert (final.key, final.prompt_token_ids) == ("good", [5, 6])


def test_the_client_sends_bins_to_a_broker_that_reads_them_and_gets_its_ids_back(
    start_broker: Any, start_client: Any, raw_socket: Any
) -> None:
    broker = start_broker()
    worker = raw_worker(raw_socket, broker, ["generate", p.TOKEN_BINS])
    poll_until(lambda: broker.has_worker("raw"), what="the raw worker to register")
    client = start_client(broker.frontend)
    poll_until(lambda: client._async._conn.token_bins, what="the broker to tell the client")
    prompts = [list(range(i, i + 100)) for i in range(3)]
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.extend(client.generate(prompts, SamplingParams(max_tokens=4))))
    thread.start()
    seen = []
    while len(seen) < len(prompts):
        for ticket, job, _cost in jobs_raw(worker):
            seen.append(job[4])
            send(worker, p.FINAL, [p.Result(ticket, p.from_bin(job[4]), [p.Sample(0, [1], [0.0], "length")], 0, "raw")])
    thread.join(10)
    assert seen == [p.to_bin(ids) for ids in prompts]  # bins on the wire
    assert [r.prompt_token_ids for r in out] == prompts


def test_the_reference_client_sends_bins_only_while_the_broker_says_it_reads_them(raw_socket: Any) -> None:
    """Arrays to a broker that has not said ``token_bins`` (older ones never do), bins once a
    HEARTBEAT reply says it, arrays again after a reply without it (a restart onto an older one).
    Likewise SUBMIT, and SEALED_SUBMIT once a reply says ``sealed_jobs`` (``test_sealed_submit.py``)."""
    from zmq_rollout import RolloutClient

    broker = raw_socket(zmq.ROUTER)
    port = broker.bind_to_random_port("tcp://127.0.0.1")
    client = RolloutClient(f"tcp://127.0.0.1:{port}", name="bins", heartbeat_interval_s=0.05)

    def next_message(*commands: bytes) -> tuple[bytes, bytes, Any]:
        while broker.poll(5000):
            identity, *frames = broker.recv_multipart()
            parts = codec.parts(frames)
            if parts.command in commands:
                return identity, parts.command, msgpack.unpackb(bytes(parts.header))
        pytest.fail(f"no {[p.COMMAND_NAMES[c] for c in commands]} from the client within 5 s")

    def form_after(identity: bytes, reply: Any, prompt: list[int]) -> tuple[bytes, type]:
        """Answer a heartbeat with ``reply``; the command of the next submission and the form of
        ``prompt``'s ids in it."""
        broker.send_multipart([identity, *codec.encode(p.HEARTBEAT, reply)])
        next_message(p.HEARTBEAT)  # may have left before the reply arrived
        next_message(p.HEARTBEAT)  # left after it: the reply was read
        client.submit(prompt, SamplingParams(max_tokens=2))
        _, command, jobs = next_message(p.SUBMIT, p.SEALED_SUBMIT)
        job = jobs[0][2] if command == p.SEALED_SUBMIT else jobs[0]  # sealed: [job_id, n, job, ...]
        return command, type(job[4])

    try:
        identity, _, _ = next_message(p.HEARTBEAT)
        assert form_after(identity, p.Liveness("old", packed=True), [1, 2, 3]) == (p.SUBMIT, list)
        assert form_after(identity, p.Liveness("old", packed=True, token_bins=True), [4, 5]) == (p.SUBMIT, bytes)
        reads_all = p.Liveness("old", packed=True, token_bins=True, sealed_jobs=True)
        assert form_after(identity, reads_all, [7]) == (p.SEALED_SUBMIT, bytes)
        assert form_after(identity, p.Liveness("new", packed=True), [6]) == (p.SUBMIT, list)  # an older broker again
    finally:
        client.close()
