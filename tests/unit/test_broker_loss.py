"""The broker dies or restarts under a client: nothing stalls, nothing is lost, nothing doubles.

Brokers here are threads on fixed loopback ports, so that a new one can take the old one's
addresses (a restart); workers are echo worker doubles.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest
import torch
import zmq

from zmq_rollout import AsyncRolloutClient, BrokerUnavailableError, Rollout, StreamRestarted, SyncError, codec
from zmq_rollout import protocol as p
from zmq_rollout.liveness import BrokerWatch

FAST = {"heartbeat_interval_s": 0.1, "broker_liveness": 3}  # lost after 0.3 s of silence


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def wait_for_begin(worker: zmq.Socket[Any]) -> None:
    """Read the raw worker's messages until the broker's CONTROL (a round's begin) arrives: the
    HEARTBEAT answering its READY, and the broker's periodic ones, come first."""
    decoder, deadline = codec.Decoder(codec.TO_WORKER), time.monotonic() + 5
    while (left := deadline - time.monotonic()) > 0:
        if worker.poll(int(left * 1000) + 1) and decoder.decode(worker.recv_multipart()).command == p.CONTROL:
            return
    pytest.fail("the broker never sent begin")


def test_a_dead_broker_fails_pending_and_new_calls_after_broker_timeout(
    start_broker: Any, start_double: Any, start_client: Any, wait_until: Any
) -> None:
    broker = start_broker()
    holder = start_double(broker, hold=True)
    client = start_client(broker.frontend, broker_timeout_s=1.0, timeout_s=60, **FAST)
    future = client.submit("x")
    wait_until(lambda: holder.held, what="the job to reach the worker")
    broker.thread.close()  # gone, and nothing comes back
    started = time.monotonic()
    with pytest.raises(BrokerUnavailableError, match=r"ClientConfig\.broker_timeout_s") as info:
        future.result(timeout=30)
    assert time.monotonic() - started < 5, "the call waited far past broker_timeout_s"
    assert info.value.job_id is not None
    with pytest.raises(BrokerUnavailableError):
        client.generate(["y"])  # while it stays away, a new call fails at once


def test_a_restarted_broker_gets_the_unfinished_jobs_and_each_finishes_once(
    start_broker: Any, start_double: Any, start_client: Any, wait_until: Any
) -> None:
    front, back = free_address(), free_address()
    first = start_broker(frontend=front, backend=back)
    holder = start_double(first, hold=True, credits=8)
    client = start_client(front, broker_timeout_s=30, timeout_s=60, **FAST)
    futures = [client.submit([i + 1, i + 2]) for i in range(4)]
    wait_until(lambda: len(holder.held) == 4, what="the jobs to reach the worker")
    holder.die()
    first.thread.close()  # the broker dies with 4 jobs in flight
    second = start_broker(frontend=front, backend=back)  # a new process on the same addresses
    rescuer = start_double(second)
    results = [f.result(timeout=30) for f in futures]
    assert [[r.prompt_token_ids for r in rs] for rs in results] == [[[i + 1, i + 2]] for i in range(4)]
    assert {r.worker_id for rs in results for r in rs} == {rescuer.name}
    assert second.jobs("submitted") == 4 and second.jobs("completed") == 4  # resubmitted once each
    assert sorted(a.job.job_id for a in rescuer.received) == sorted({a.job.job_id for a in rescuer.received})


def test_a_broker_that_forgot_the_client_gets_its_jobs_again(
    start_broker: Any, start_double: Any, start_client: Any, wait_until: Any
) -> None:
    """Same broker, but it expired the client (silent past client_expiry_s, as after a network
    cut): the next heartbeat reply says new_session, and the client resubmits."""
    broker = start_broker(client_expiry_s=0.5)
    holder = start_double(broker, hold=True)
    client = start_client(broker.frontend, heartbeat_interval_s=1.5, broker_liveness=5, timeout_s=60)
    future = client.submit([7, 8])
    wait_until(lambda: holder.held, what="the job to reach the worker")
    wait_until(lambda: holder.cancelled, 5, "the broker to expire the client and cancel its job")
    holder.die()
    rescuer = start_double(broker)
    (rollout,) = future.result(timeout=30)
    assert rollout.worker_id == rescuer.name and rollout.prompt_token_ids == [7, 8]


def test_a_stream_across_a_restart_says_so_then_ends_with_the_rollout(
    start_broker: Any, start_double: Any, wait_until: Any
) -> None:
    front, back = free_address(), free_address()
    first = start_broker(frontend=front, backend=back)
    holder = start_double(first, hold=True)
    seen: list[Any] = []

    async def main() -> None:
        async with AsyncRolloutClient(front, timeout_s=60, **FAST) as client:
            seen.extend([item async for item in client.stream([3, 4, 5])])

    async def run() -> None:
        task = asyncio.ensure_future(main())
        while not holder.held:
            await asyncio.sleep(0.01)
        holder.die()
        first.thread.close()
        second = start_broker(frontend=front, backend=back)
        start_double(second)
        await asyncio.wait_for(task, 30)

    asyncio.run(run())
    assert isinstance(seen[0], StreamRestarted) and isinstance(seen[-1], Rollout)
    assert seen[-1].prompt_token_ids == [3, 4, 5] and len(seen) == 2


def test_a_broker_lost_mid_round_fails_the_sync_step_promptly(
    start_broker: Any, start_client: Any, raw_socket: Any, wait_until: Any
) -> None:
    """A worker that never answers ``begin`` (its step timeout is a minute); the broker dies:
    the trainer's update_weights raises SyncError within the broker-loss expiry, not later."""
    broker = start_broker()
    worker = raw_socket(zmq.DEALER)
    worker.connect(broker.backend)
    worker.send_multipart(codec.encode(p.READY, p.WorkerInfo("mute", "m", 4)))
    wait_until(lambda: broker.has_worker("mute"), what="the mute worker to register")
    client = start_client(broker.frontend, **FAST)
    errors: list[BaseException] = []

    def push() -> None:
        try:
            client.update_weights([("w", torch.zeros(4))], timeout_s=60)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=push)
    thread.start()
    wait_for_begin(worker)
    broker.thread.close()
    started = time.monotonic()
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - started < 5
    assert len(errors) == 1 and isinstance(errors[0], SyncError) and "stopped answering" in str(errors[0])


def test_a_broker_restarted_mid_round_fails_the_sync_step_at_once(
    start_broker: Any, start_client: Any, raw_socket: Any, wait_until: Any
) -> None:
    """The broker dies while a step waits on a mute worker and a new one takes its addresses
    before the client counts it lost: the round died with the old broker, so update_weights
    raises SyncError at the new broker's first heartbeat reply, not at the step's timeout."""
    front, back = free_address(), free_address()
    first = start_broker(frontend=front, backend=back)
    worker = raw_socket(zmq.DEALER)
    worker.connect(back)
    worker.send_multipart(codec.encode(p.READY, p.WorkerInfo("mute", "m", 4)))
    wait_until(lambda: first.has_worker("mute"), what="the mute worker to register")
    client = start_client(front, heartbeat_interval_s=0.1, broker_liveness=50, request_timeout_s=2)  # lost after 5 s
    errors: list[BaseException] = []

    def push() -> None:
        try:
            client.update_weights([("w", torch.zeros(4))], timeout_s=20)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=push)
    thread.start()
    wait_for_begin(worker)
    first.thread.close()
    started = time.monotonic()
    start_broker(frontend=front, backend=back)
    thread.join(30)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], SyncError), errors
    assert "restarted" in str(errors[0]) and time.monotonic() - started < 3  # not the 22 s of the step


def test_a_begin_that_outlived_its_step_is_aborted_and_the_next_round_runs(
    start_broker: Any, start_double: Any, start_client: Any, wait_until: Any
) -> None:
    """update_weights is called while the broker is down: its begin waits in the client's
    socket, the step fails when the broker counts as lost, and the begin reaches the next
    broker on those addresses. The round it opens has no driver: the client aborts it when
    its reply comes, so the next update_weights is not refused for round_idle_timeout_s."""
    front, back = free_address(), free_address()
    first = start_broker(frontend=front, backend=back)
    client = start_client(front, heartbeat_interval_s=0.1, broker_liveness=20)  # lost after 2 s
    client.update_weights([("w", torch.zeros(4))], timeout_s=5)  # warm: the next begin leaves at once
    first.thread.close()
    with pytest.raises(SyncError, match="stopped answering"):
        client.update_weights([("w", torch.zeros(4))], timeout_s=5)
    second = start_broker(frontend=front, backend=back, round_idle_timeout_s=300)
    double = start_double(second)
    client.status()  # the client hears the broker again

    def next_round_runs() -> bool:
        try:
            report = client.update_weights([("w", torch.zeros(4))], timeout_s=5)
        except SyncError as exc:
            assert "still running" in str(exc), exc  # only the orphan round may stand in the way
            return False
        return double.name in report.workers_updated

    wait_until(next_round_runs, 5, "a round after the orphaned begin")
    assert all(w.state == "ready" and w.weight_version > 0 for w in second.status().workers)


def test_the_first_heartbeat_reply_only_tells_the_epoch() -> None:
    """The client heartbeats as it connects: a broker that did not know it yet is no news; one
    that forgot it later, or a new epoch, means what it had in flight must go again."""
    watch = BrokerWatch(1.0, 30.0, 0.0)
    assert not watch.liveness(p.Liveness("a", new_session=True))
    assert not watch.liveness(p.Liveness("a"))
    assert watch.liveness(p.Liveness("a", new_session=True))  # it expired this client meanwhile
    assert watch.liveness(p.Liveness("b", new_session=True))  # restarted
    assert not watch.liveness(p.Liveness("b")) and not watch.liveness(None)
