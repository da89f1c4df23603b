"""The trainer-side client: input forms, validation, timeouts, cancel, streaming, close."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

import zmq_rollout
from zmq_rollout import (
    AsyncRolloutClient,
    ChatMessage,
    ClientClosedError,
    InvalidRequestError,
    JobCancelledError,
    Rollout,
    RolloutTimeoutError,
    SamplingParams,
    codec,
)
from zmq_rollout import protocol as p
from zmq_rollout.client import make_job


async def async_wait_until(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


def free_tcp_address() -> str:
    """A loopback address with nothing listening (a port the OS just handed out and took back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


# -- make_job -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "field", "expected"),
    [
        pytest.param("2+2=", "prompt", "2+2=", id="string"),
        pytest.param([1, 2, 3], "prompt_token_ids", [1, 2, 3], id="token-ids"),
        pytest.param((4, 5), "prompt_token_ids", [4, 5], id="token-id-tuple"),
        pytest.param(range(6, 9), "prompt_token_ids", [6, 7, 8], id="token-id-range"),
        pytest.param([2**63 - 1], "prompt_token_ids", [2**63 - 1], id="token-id-64-bit"),
        pytest.param(
            [{"role": "user", "content": "hi"}],
            "messages",
            [ChatMessage("user", "hi")],
            id="chat-dicts",
        ),
        pytest.param(
            [ChatMessage("system", "s"), {"role": "user", "content": "u"}],
            "messages",
            [ChatMessage("system", "s"), ChatMessage("user", "u")],
            id="chat-mixed",
        ),
    ],
)
def test_make_job_input_forms(prompt: Any, field: str, expected: Any) -> None:
    sampling = SamplingParams(n=3)
    job = make_job("job-1", prompt, sampling, stream=True, min_weight_version=5)
    assert getattr(job, field) == expected
    assert isinstance(getattr(job, field), list) or field == "prompt"
    others = {"prompt", "messages", "prompt_token_ids"} - {field}
    assert all(getattr(job, name) is None for name in others)
    assert (job.job_id, job.sampling, job.stream, job.min_weight_version) == (
        "job-1",
        sampling,
        True,
        5,
    )


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        pytest.param([], "a prompt is a string", id="empty-list"),
        pytest.param(5, "got int", id="int"),
        pytest.param(None, "got NoneType", id="none"),
        pytest.param([1, "a"], "a prompt is a string", id="mixed-list"),
        pytest.param([1.5], "a prompt is a string", id="float-ids"),
        pytest.param([1, 2.0], "a prompt is a string", id="a-float-among-ids"),
        pytest.param([1, True], "a prompt is a string", id="a-bool-among-ids"),
        pytest.param(range(3, -2, -1), "non-negative", id="negative-id-in-a-range"),
        pytest.param("", "prompt must be", id="empty-string"),
        pytest.param([3, -1], "non-negative", id="negative-id"),
        pytest.param([{"role": "user"}], "content", id="chat-dict-without-content"),
        pytest.param([{"role": "user", "content": "hi", "name": "bob"}], "name", id="chat-dict-unknown-key"),
    ],
)
def test_make_job_refuses_bad_forms(prompt: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        make_job("job-1", prompt, SamplingParams())


def test_make_job_revalidates_sampling_changed_after_construction() -> None:
    sampling = SamplingParams()
    sampling.n = 0
    with pytest.raises(InvalidRequestError, match="n=0") as info:
        make_job("job-1", "hi", sampling)
    assert info.value.job_id == "job-1"
    # A batch's later jobs skip it (the first job of the batch checked it): the caller's word.
    assert make_job("job-2", "hi", sampling, sampling_checked=True).sampling.n == 0


def test_make_job_refuses_a_sampling_that_is_not_a_sampling_params_by_name() -> None:
    for bad in ({"n": 1, "max_tokens": 8}, None):
        with pytest.raises(InvalidRequestError, match=r"sampling must be a zmq_rollout\.SamplingParams, got") as info:
            make_job("job-1", "hi", bad, sampling_checked=bad is None)  # type: ignore[arg-type]
        assert info.value.job_id == "job-1"


def test_generate_checks_a_batchs_sampling_with_its_first_job() -> None:
    sampling = SamplingParams()
    sampling.n = 0

    async def main() -> str | None:
        client = AsyncRolloutClient(free_tcp_address(), name="once")
        try:
            with pytest.raises(InvalidRequestError, match="n=0") as info:
                await client.generate(["a", "b"], sampling)
            return info.value.job_id
        finally:
            await client.close()

    job_id = asyncio.run(main())
    assert job_id is not None and job_id.endswith("-0")  # the first job's id: nothing was sent


def requests_reaching(fake_broker: zmq.Socket[Any]) -> list[bytes]:
    """Commands other than HEARTBEAT (a client heartbeats as it connects) that reach the
    socket until it has been quiet for 0.2 s."""
    commands = []
    while fake_broker.poll(200):
        command = fake_broker.recv_multipart()[2]
        if command != p.HEARTBEAT:
            commands.append(command)
    return commands


def test_invalid_requests_fail_before_anything_is_sent(start_client: Any, raw_socket: Any) -> None:
    fake_broker = raw_socket(zmq.ROUTER)
    fake_broker.bind("tcp://127.0.0.1:*")
    client = start_client(fake_broker.getsockopt_string(zmq.LAST_ENDPOINT))
    bad_sampling = SamplingParams()
    bad_sampling.temperature = -1.0
    with pytest.raises(InvalidRequestError, match="prompt must be"):
        client.generate(["fine", ""])  # one bad prompt fails the whole call, up front
    with pytest.raises(InvalidRequestError, match="temperature"):
        client.generate(["fine"], bad_sampling)
    assert requests_reaching(fake_broker) == [], "nothing but heartbeats may reach the broker"


def test_bad_weight_and_lora_pushes_fail_before_anything_is_sent(start_client: Any, raw_socket: Any) -> None:
    import torch

    fake_broker = raw_socket(zmq.ROUTER)
    fake_broker.bind("tcp://127.0.0.1:*")
    client = start_client(fake_broker.getsockopt_string(zmq.LAST_ENDPOINT))
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 4)}
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    cases = [
        (lambda: client.update_weights([("w", torch.zeros(2))], transport="rdma"), "transport='rdma'"),
        (lambda: client.update_weights([("w", torch.zeros(2))], pause="later"), "pause='later'"),
        (lambda: client.update_weights([]), "no tensors"),
        (lambda: client.update_lora(adapter, {"target_modules": ["q_proj"]}), "peft_config"),
        (lambda: client.update_lora({}, config), "no tensors"),
        (lambda: client.update_lora(adapter, config, name=""), "adapter name"),
        (lambda: client.update_lora(adapter, config, pause="later"), "pause='later'"),
        (lambda: client.generate(["hi"], lora=""), "lora must be"),
    ]
    for call, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            call()
    assert requests_reaching(fake_broker) == [], "nothing but heartbeats may reach the broker"


# -- against a broker ---------------------------------------------------------------------
def test_generate_returns_rollouts_per_prompt_in_order(start_broker: Any, start_double: Any, start_client: Any) -> None:
    broker = start_broker()
    double = start_double(broker)
    client = start_client(broker.frontend)
    rollouts = client.generate(["abc", [7, 8, 9], [{"role": "user", "content": "hi"}]], SamplingParams(n=2))
    assert [(r.prompt_index, r.index) for r in rollouts] == [(i, s) for i in range(3) for s in range(2)]
    assert [r.prompt_token_ids for r in rollouts[::2]] == [
        [3],
        [7, 8, 9],
        [0],
    ]  # the echo double's answers
    assert {r.worker_id for r in rollouts} == {double.name}
    assert len({r.job_id for r in rollouts}) == 3
    assert client.generate("single prompt")[0].prompt_index == 0  # a string is one prompt


def test_status(start_broker: Any, start_double: Any, start_client: Any) -> None:
    broker = start_broker()
    double = start_double(broker, credits=7, weight_version=3)
    status = start_client(broker.frontend, name="trainer").status()
    (worker,) = status.workers
    assert (worker.name, worker.model, worker.credits, worker.weight_version, worker.state) == (
        double.name,
        "echo-double",
        7,
        3,
        "ready",
    )
    assert (status.queued, status.running) == (0, 0)
    assert [c.name.startswith("trainer-") for c in status.clients] == [True]


def test_timeout_names_the_setting(start_broker: Any, start_double: Any, start_client: Any) -> None:
    broker = start_broker()
    start_double(broker, hold=True)
    client = start_client(broker.frontend, timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(RolloutTimeoutError, match=r"after 0.3 s") as info:
        client.generate(["x", "y"])
    assert time.monotonic() - started < 3
    assert "ClientConfig.timeout_s" in str(info.value)
    assert isinstance(info.value, TimeoutError)
    with pytest.raises(RolloutTimeoutError, match=r"after 0\.1 s"):
        client.generate(["z"], timeout_s=0.1)  # per call


def test_timed_out_jobs_are_cancelled_on_the_broker(
    start_broker: Any, start_double: Any, start_client: Any, wait_until: Any
) -> None:
    broker = start_broker()
    holder = start_double(broker, hold=True)
    client = start_client(broker.frontend, timeout_s=0.3)
    with pytest.raises(RolloutTimeoutError) as info:
        client.generate(["x", "y"])
    assert str(info.value).startswith("2 of 2 jobs had no result after 0.3 s; they were cancelled")
    wait_until(lambda: len(holder.cancelled) == 2, what="the broker to cancel the jobs on the worker")
    assert sorted(holder.cancelled) == sorted(a.ticket for a in holder.received)
    assert broker.jobs("cancelled") == 2


def test_status_timeout_names_request_timeout(start_client: Any) -> None:
    address = free_tcp_address()
    client = start_client(address, request_timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(RolloutTimeoutError, match=r"ClientConfig.request_timeout_s") as info:
        client.status()
    assert address in str(info.value)
    assert time.monotonic() - started < 3


def test_worker_error_is_raised_as_its_class(
    start_broker: Any, start_client: Any, raw_socket: Any, wait_until: Any
) -> None:
    broker = start_broker()
    worker = raw_socket(zmq.DEALER)
    worker.connect(broker.backend)
    worker.send_multipart(codec.encode(p.READY, p.WorkerInfo("raw", "tiny", 4)))
    wait_until(lambda: broker.has_worker("raw"), what="the raw worker to register")
    future = start_client(broker.frontend).submit("too long")
    msg = None
    while msg is None or msg.command == p.HEARTBEAT:  # the broker's heartbeats may come first
        assert worker.poll(5000)
        msg = codec.Decoder(codec.TO_WORKER).decode(worker.recv_multipart())
    assert msg.command == p.JOBS
    (assignment,) = msg.body
    error = p.ErrorItem(assignment.ticket, "invalid_request", "prompt longer than max_model_len")
    worker.send_multipart(codec.encode(p.ERROR, [error]))
    with pytest.raises(InvalidRequestError, match="max_model_len") as info:
        future.result(timeout=5)
    assert info.value.job_id == assignment.job.job_id


@pytest.mark.parametrize("where", ["queued", "running"])
def test_async_cancel_raises_job_cancelled(where: str, start_broker: Any, start_double: Any, wait_until: Any) -> None:
    broker = start_broker()
    holder = start_double(broker, hold=True) if where == "running" else None

    async def main() -> None:
        async with AsyncRolloutClient(broker.frontend) as client:
            (handle,) = await client.submit_jobs([make_job("job-to-cancel", "hi", SamplingParams())])
            if holder is not None:
                await async_wait_until(lambda: holder.held, what="the job to reach the worker")
            else:
                await async_wait_until(lambda: broker.status().queued == 1, what="the job to be queued")
            await client.cancel(["job-to-cancel"])
            with pytest.raises(JobCancelledError) as info:
                await asyncio.wait_for(handle.future, 5)
            assert info.value.job_id == "job-to-cancel"

    asyncio.run(main())
    assert broker.jobs("cancelled") == 1
    if holder is not None:  # the broker aborts it on the worker too
        wait_until(lambda: holder.cancelled == [holder.received[0].ticket], what="the worker to get CANCEL")


def test_stream_ends_with_rollouts_when_only_final_comes(
    start_broker: Any, start_double: Any, start_client: Any
) -> None:
    broker = start_broker()
    double = start_double(broker)
    items = list(start_client(broker.frontend).stream([5, 6, 7], SamplingParams(n=2)))
    assert [type(item) for item in items] == [Rollout, Rollout]
    assert [r.index for r in items] == [0, 1]
    assert {r.worker_id for r in items} == {double.name}
    assert items[0].token_ids == [5, 6, 7]
    assert double.received[0].job.stream is True


def test_stream_says_restarted_when_its_job_is_accepted_again_after_deltas(start_client: Any, raw_socket: Any) -> None:
    """The broker sends ACCEPTED again for a streamed job it runs anew (worker lost, too stale
    with on_stale="restart"): the stream says StreamRestarted, then the new attempt's tokens."""
    fake_broker = raw_socket(zmq.ROUTER)
    fake_broker.bind("tcp://127.0.0.1:*")
    client = start_client(fake_broker.getsockopt_string(zmq.LAST_ENDPOINT))
    stream = client.stream([5, 6], SamplingParams(max_tokens=2), max_staleness=0, on_stale="restart")
    got: list[Any] = []
    reader = concurrent.futures.ThreadPoolExecutor(1).submit(lambda: got.extend(stream))
    while True:
        peer, _, command, header = fake_broker.recv_multipart()
        if command == p.SUBMIT:
            break
    (job,) = codec.Decoder(codec.FROM_CLIENT).decode([p.SIGNATURE, command, header]).body
    assert (job.max_staleness, job.on_stale, job.stream, job.ack) == (0, "restart", True, False)  # no ACCEPTED asked
    jid = job.job_id

    def send(cmd: bytes, body: Any) -> None:
        fake_broker.send_multipart([peer, *codec.encode(cmd, body)])

    send(p.ACCEPTED, [jid])
    send(p.PARTIAL, [p.Delta(jid, 0, [7], [-0.1])])
    send(p.ACCEPTED, [jid])  # run again from the start
    send(p.PARTIAL, [p.Delta(jid, 0, [8], [-0.2])])
    send(p.PARTIAL, [p.Delta(jid, 0, [9], [-0.3])])
    send(p.FINAL, [p.Result(jid, [5, 6], [p.Sample(0, [8, 9], [-0.2, -0.3], "length")], 1, "w0")])
    reader.result(timeout=10)
    kinds = [type(item).__name__ for item in got]
    assert kinds == ["TokenDelta", "StreamRestarted", "TokenDelta", "TokenDelta", "Rollout"]
    assert [t for item in got[2:4] for t in item.token_ids] == got[4].token_ids == [8, 9]


def test_async_stream(start_broker: Any, start_double: Any) -> None:
    broker = start_broker()
    start_double(broker)

    async def main() -> list[Any]:
        async with AsyncRolloutClient(broker.frontend) as client:
            return [item async for item in client.stream("hello")]

    items = asyncio.run(asyncio.wait_for(main(), 10))
    assert len(items) == 1
    assert isinstance(items[0], Rollout)
    assert items[0].prompt_token_ids == [5]


# -- close --------------------------------------------------------------------------------
def test_async_close_fails_pending_calls(start_broker: Any, start_double: Any) -> None:
    broker = start_broker()
    holder = start_double(broker, hold=True)

    async def main() -> None:
        client = await AsyncRolloutClient(broker.frontend).connect()
        call = asyncio.ensure_future(client.generate(["x", "y"]))
        await async_wait_until(lambda: len(holder.held) == 2, what="the jobs to reach the worker")
        await client.close()
        with pytest.raises(ClientClosedError):
            await asyncio.wait_for(call, 5)
        with pytest.raises(ClientClosedError):
            await client.generate(["after close"])
        await client.close()  # idempotent

    asyncio.run(main())


def test_async_close_fails_a_pending_sync_step_and_status(raw_socket: Any) -> None:
    """A broker that takes SYNC and STATUS and never answers: close() fails both calls at
    once, not at their timeouts (a minute here)."""
    fake_broker = raw_socket(zmq.ROUTER)
    fake_broker.bind("tcp://127.0.0.1:*")
    seen: set[bytes] = set()

    def received(*commands: bytes) -> bool:
        while fake_broker.poll(0):
            seen.add(fake_broker.recv_multipart()[2])
        return seen.issuperset(commands)

    async def main() -> None:
        address = fake_broker.getsockopt_string(zmq.LAST_ENDPOINT)
        client = await AsyncRolloutClient(address, request_timeout_s=60).connect()
        step = asyncio.ensure_future(client.sync_step(p.SyncStep(0, p.Begin(), timeout_s=60)))
        status = asyncio.ensure_future(client.status())
        await async_wait_until(lambda: received(p.SYNC, p.STATUS), what="the step and STATUS to reach the broker")
        await asyncio.wait_for(client.close(), 2)
        for call in (step, status):
            with pytest.raises(ClientClosedError):
                await asyncio.wait_for(call, 2)

    asyncio.run(main())


def test_blocking_close_fails_pending_futures(start_broker: Any, start_double: Any, wait_until: Any) -> None:
    """Repeated, with fresh clients, because whether a pending call is settled before the
    client's loop stops is a race: every one of them must end in ClientClosedError."""
    broker = start_broker()
    holder = start_double(broker, hold=True)
    for attempt in range(20):
        client = zmq_rollout.RolloutClient(broker.frontend)
        try:
            future = client.submit("x")
            wait_until(lambda n=attempt + 1: len(holder.received) == n, what="the job to reach the worker")
        finally:
            client.close()
        try:
            error = future.exception(timeout=2)
        except concurrent.futures.TimeoutError:
            pytest.fail(f"attempt {attempt}: the pending call never finished after close()")
        assert isinstance(error, ClientClosedError), f"attempt {attempt}: {error!r}"


# -- public API ---------------------------------------------------------------------------
def test_public_api_is_pinned() -> None:
    assert zmq_rollout.__all__ == [
        "AsyncRolloutClient",
        "AuthenticationError",
        "BrokerUnavailableError",
        "BusyError",
        "ChatMessage",
        "ClientClosedError",
        "ConfigError",
        "InvalidRequestError",
        "JobCancelledError",
        "JobFailedError",
        "ProtocolError",
        "Rollout",
        "RolloutClient",
        "RolloutError",
        "RolloutTimeoutError",
        "SamplingParams",
        "StaleRolloutError",
        "StreamRestarted",
        "StructuredOutput",
        "SyncError",
        "SyncReport",
        "TokenDelta",
        "__version__",
    ]
    for name in zmq_rollout.__all__:
        assert getattr(zmq_rollout, name) is not None
    assert issubclass(zmq_rollout.BusyError, zmq_rollout.RolloutError)


def test_jobs_given_up_on_leave_no_unretrieved_exceptions(start_broker: Any, start_double: Any) -> None:
    """A stream closed early and a call that timed out cancel their jobs; the JobCancelledError
    each job's future gets afterwards is expected, and asyncio must not report it as "Future
    exception was never retrieved"."""
    import contextlib
    import gc

    from helpers import poll_until

    broker = start_broker()
    double = start_double(broker, hold=True)  # never answers: every job is given up on
    reports: list[str] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reports.append(str(ctx.get("message"))))
        async with AsyncRolloutClient(broker.frontend, timeout_s=30) as client:
            agen = client.stream([1, 2, 3], SamplingParams(max_tokens=4))
            first = asyncio.ensure_future(agen.__anext__())
            await asyncio.to_thread(poll_until, lambda: len(double.received) == 1, 10.0, "the streamed job held")
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            await agen.aclose()
            with pytest.raises(RolloutTimeoutError):
                await client.generate([[4, 5], [6, 7]], SamplingParams(max_tokens=2), timeout_s=0.5)
            await asyncio.to_thread(poll_until, lambda: not client._pending, 10.0, "every cancellation answered")
            del agen, first
            gc.collect()
        gc.collect()

    asyncio.run(main())
    assert len(double.received) == 3  # the double got all three jobs, and their cancellations
    assert not [r for r in reports if "never retrieved" in r], reports
