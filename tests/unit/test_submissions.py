"""SUBMIT messages cut by count and by size, and whole-message errors traced to their message."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest

from zmq_rollout import InvalidRequestError, ProtocolError, SamplingParams
from zmq_rollout import protocol as p
from zmq_rollout.submissions import Unanswered, pack_submits


def job(i: int, chars: int = 10) -> p.JobSpec:
    return p.JobSpec(f"j{i}", prompt="x" * chars)


def test_messages_respect_the_job_count_and_the_byte_limit() -> None:
    jobs = [job(i, 1000) for i in range(10)]
    messages = pack_submits(jobs, batch_size=512, max_bytes=4096)
    assert [ids for ids, _ in messages] == [[f"j{i}" for i in range(k, min(k + 3, 10))] for k in range(0, 10, 3)]
    for _, encoded in messages:
        header = msgpack.packb([msgpack.unpackb(bytes(r)) for r in encoded])
        assert len(header) + 4 <= 4096  # with the signature and the command byte
    assert [ids for ids, _ in pack_submits([job(i) for i in range(5)], 2, 1 << 20)] == [
        ["j0", "j1"], ["j2", "j3"], ["j4"]
    ]  # fmt: skip


def test_one_job_too_big_for_any_message_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequestError, match=r"job 'j0' is \d+ bytes.*ClientConfig.max_message_bytes=2048"):
        pack_submits([job(0, 3000)], 512, 2048)


def test_a_whole_message_error_is_about_the_oldest_message_not_answered() -> None:
    u = Unanswered()
    u.sent(["a", "b"])
    u.sent(["c"])
    u.sent(["d"])
    u.answered("b")  # the first message was read
    assert len(u) == 2
    assert u.refused() == ["c"]
    u.answered("zzz")  # unknown ids change nothing
    assert u.refused() == ["d"] and u.refused() == []


def test_answers_out_of_order_are_kept_until_the_older_ones_come() -> None:
    u = Unanswered()
    u.sent(["a"])
    u.sent(["b"])
    u.answered("b")
    assert len(u) == 2  # "a"'s message still waits
    u.answered("a")
    assert len(u) == 0


def test_an_oversize_submit_fails_its_call_at_once(start_broker: Any, start_client: Any) -> None:
    """A broker with a smaller limit than the client's refuses the message as a whole (key nil):
    the call it belongs to fails now, naming the limit, not after ClientConfig.timeout_s."""
    broker = start_broker(max_message_bytes=4096)
    client = start_client(broker.frontend, timeout_s=60)
    started = time.monotonic()
    with pytest.raises(ProtocolError, match="max_message_bytes=4096"):
        client.generate(["x" * 5000])
    assert time.monotonic() - started < 10
    assert broker.malformed() == {"oversize": 1}


def test_a_client_limit_splits_large_batches_so_every_job_completes(
    start_broker: Any, start_double: Any, start_client: Any
) -> None:
    broker = start_broker(max_message_bytes=8192)
    start_double(broker)
    client = start_client(broker.frontend, max_message_bytes=8192)
    rollouts = client.generate([f"{i:04d}" + "y" * 2000 for i in range(12)], SamplingParams(max_tokens=2))
    assert len(rollouts) == 12 and broker.malformed() == {}
    with pytest.raises(InvalidRequestError, match=r"ClientConfig\.max_message_bytes=8192"):
        client.generate(["z" * 9000])
