"""Inputs the fuzzer (``zmq_rollout.fuzzing``, ``tests/unit/test_fuzz.py``) found harmful, one
test each, so that each stays fixed without a fuzz run finding it again."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.broker.salvage import split_submit
from zmq_rollout.errors import ProtocolError
from zmq_rollout.workers.control import refusal

DEEP = b"\x91" * 5000 + b"\xc0"  # [[[[...nil...]]]], 5000 deep: 5 KB
TABLES = {"from_client": codec.FROM_CLIENT, "from_worker": codec.FROM_WORKER, "to_worker": codec.TO_WORKER}


def test_nesting_thousands_deep_where_the_type_stops_checking_is_a_protocol_error() -> None:
    """msgspec raises RecursionError past Python's recursion limit, and the decoders caught
    only DecodeError and ValidationError: the broker's loop thread died on one 5 KB message,
    on either port (a FINAL's samples are kept raw; a SUBMIT that fails is salvaged job by
    job as raw items), and so would a worker's receive task (a CONTROL's LoRA ``peft_config``
    is any msgpack; an undecodable CONTROL is read once more for its round)."""
    final = b"\x91\x95\x07\x90" + DEEP + b"\x00\xa1w"  # [[7, [], <deep>, 0, "w"]]
    with pytest.raises(ProtocolError, match="recursion"):
        codec.Decoder(codec.FROM_WORKER).decode([p.SIGNATURE, p.FINAL, final])
    lora = b"\x93\xa9load_lora\xa1a\x81\xa1k" + DEEP  # ["load_lora", "a", {"k": <deep>}]
    with pytest.raises(ProtocolError, match="recursion"):
        codec.Decoder(codec.FROM_CLIENT).decode([p.SIGNATURE, p.SYNC, b"\x92\x00" + lora])
    with pytest.raises(ProtocolError, match="recursion"):
        codec.Decoder(codec.TO_WORKER).decode([p.SIGNATURE, p.CONTROL, b"\x92\x01" + lora])
    with pytest.raises(ProtocolError, match="recursion"):
        split_submit(b"\x92\x91\xa1a" + DEEP)  # [["a"], <deep>]
    assert refusal(DEEP, "bad", 0) is None


@pytest.mark.parametrize("table", TABLES)
def test_a_header_nested_thousands_deep_is_a_protocol_error_for_every_command(table: str) -> None:
    decoder = codec.Decoder(TABLES[table])
    for command, body_type in TABLES[table].items():
        if body_type is not None:
            with pytest.raises(ProtocolError):
                decoder.decode([p.SIGNATURE, command, DEEP])


def test_both_broker_ports_answer_a_deep_header_and_keep_serving(
    start_broker: Any, start_double: Any, start_client: Any, raw_socket: Any, wait_until: Any
) -> None:
    broker = start_broker()
    start_double(broker)
    client = raw_socket(zmq.DEALER)
    client.connect(broker.frontend)
    client.send_multipart([p.SIGNATURE, p.SUBMIT, DEEP])
    assert client.poll(5000)
    reply = codec.Decoder(codec.TO_CLIENT).decode(client.recv_multipart())
    assert reply.command == p.ERROR and reply.body[0].code == "protocol"
    worker = raw_socket(zmq.DEALER)
    worker.connect(broker.backend)
    worker.send_multipart([p.SIGNATURE, p.FINAL, DEEP])
    wait_until(lambda: broker.malformed().get("worker") == 1, what="the bad worker message counted")
    assert broker.thread.alive and broker.malformed()["invalid"] == 1
    rollouts = start_client(broker.frontend).generate([[1, 2, 3]])
    assert rollouts[0].token_ids == [1, 2, 3]


def test_a_tensor_shape_of_many_huge_dimensions_is_refused_at_once() -> None:
    """``math.prod`` of 30,000 dimensions of 2**64-1 took 4 s (quadratic in the length): one
    270 KB SYNC stopped the broker's loop for seconds, a 64 MiB one for days."""
    shape = [(1 << 64) - 1] * 40_000  # 360 KB: 7 s before
    step = [0, ["load_shm", "zr-0", [0, 4, [["a", "float32", shape, 0, 4]]]], 1.0]
    frames = [p.SIGNATURE, p.SYNC, msgspec.msgpack.encode(step)]
    started = time.perf_counter()
    with pytest.raises(ProtocolError, match=r"float32\[40000 dimensions\]"):
        codec.Decoder(codec.FROM_CLIENT).decode(frames)
    assert time.perf_counter() - started < 0.5
    # The check itself is unchanged: a product that fits is exact, one that does not fails.
    assert p.TensorMeta("a", "float32", [2, 3, 0], 0, 0).nbytes == 0
    assert p.TensorMeta("a", "bfloat16", [1] * 1000 + [3], 0, 6).nbytes == 6
    with pytest.raises(ValueError, match="do not fit"):
        p.TensorMeta("a", "float32", [1 << 40, 1 << 40], 0, 4)
