"""The client's connection to its broker: no send waits forever, and close() always returns.

A send that cannot go out (nobody to take it: the broker is away and the socket's send
queue, ``SNDHWM`` messages, is full; or the broker refused our handshake and there is no
connection at all) must not hold up the sends behind it, the heartbeat, or close(). Here
a client points at a port where nothing listens and sends more SUBMITs than its socket
can hold, so that one of them cannot go out.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from zmq_rollout import (
    AsyncRolloutClient,
    AuthenticationError,
    BrokerUnavailableError,
    ClientClosedError,
    RolloutClient,
    codec,
)
from zmq_rollout import protocol as p
from zmq_rollout.config import ClientConfig
from zmq_rollout.connection import Connection, Handlers
from zmq_rollout.curve import generate_keypair

MORE_THAN_THE_SOCKET_HOLDS = 1100
"""SUBMITs (one job each): a DEALER holds 1000 messages (its default SNDHWM) for a peer
that is not there; the rest cannot go out."""
FAST = {"heartbeat_interval_s": 0.1, "broker_liveness": 3}  # lost after 0.3 s of silence


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def async_poll_until(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


async def stuck_call(client: AsyncRolloutClient) -> asyncio.Future[Any]:
    """A generate call whose last SUBMITs cannot go out. It registers its jobs and sends
    every SUBMIT it can without yielding to the loop: once its jobs are all pending, it is
    waiting on a send."""
    call = asyncio.ensure_future(client.generate([[1]] * MORE_THAN_THE_SOCKET_HOLDS, timeout_s=math.inf))
    await async_poll_until(
        lambda: len(client._pending) == MORE_THAN_THE_SOCKET_HOLDS or call.done(), what="the call to send its jobs"
    )
    assert not call.done(), call
    return call


def test_async_close_returns_at_once_with_a_send_that_cannot_go_out() -> None:
    async def main() -> None:
        client = await AsyncRolloutClient(free_tcp_address(), batch_size=1).connect()
        call = await stuck_call(client)
        await asyncio.wait_for(client.close(), 2)  # before: its DISCONNECT queued behind the stuck SUBMIT
        with pytest.raises(ClientClosedError):
            await asyncio.wait_for(call, 2)

    asyncio.run(main())


def test_blocking_close_returns_at_once_and_fails_every_call_with_sends_that_cannot_go_out() -> None:
    client = RolloutClient(free_tcp_address())
    futures = [client.submit([1]) for _ in range(MORE_THAN_THE_SOCKET_HOLDS)]
    closer = threading.Thread(target=client.close, daemon=True)  # a hung close() must fail the test, not hang it
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "RolloutClient.close() did not return"
    for i, future in enumerate(futures):
        assert isinstance(future.exception(timeout=2), ClientClosedError), f"call {i}"
    with pytest.raises(ClientClosedError):  # and every call after close
        client.generate([[1]])
    assert isinstance(client.submit([1]).exception(timeout=0), ClientClosedError)
    client.close()  # idempotent


def test_a_send_that_cannot_go_out_fails_with_broker_unavailable_when_the_broker_is_gone() -> None:
    """The heartbeat goes on beside the stuck send, counts the broker gone after
    broker_timeout_s, and the call waiting on its send gets BrokerUnavailableError."""

    async def main() -> None:
        client = await AsyncRolloutClient(free_tcp_address(), batch_size=1, broker_timeout_s=0.5, **FAST).connect()
        started = time.monotonic()
        with pytest.raises(BrokerUnavailableError, match=r"ClientConfig\.broker_timeout_s"):
            await asyncio.wait_for(client.generate([[1]] * MORE_THAN_THE_SOCKET_HOLDS, timeout_s=math.inf), 10)
        assert time.monotonic() - started < 5
        with pytest.raises(BrokerUnavailableError):  # a new call fails at once
            await asyncio.wait_for(client.generate([[1]]), 2)
        await asyncio.wait_for(client.close(), 2)

    asyncio.run(main())


def test_a_send_that_cannot_go_out_fails_with_authentication_error_when_the_broker_refuses_us(
    start_broker: Any, tmp_path: Path
) -> None:
    """The broker comes up on the address the client waits on, and requires CurveZMQ of a
    plaintext client: the call waiting on its send gets the AuthenticationError."""
    address = free_tcp_address()
    _, broker_secret = generate_keypair(tmp_path / "broker", "broker")
    (tmp_path / "allowed").mkdir()

    async def main() -> None:
        client = await AsyncRolloutClient(address, batch_size=1).connect()
        call = await stuck_call(client)
        start_broker(frontend=address, curve_secret_key=str(broker_secret), allow_keys=str(tmp_path / "allowed"))
        with pytest.raises(AuthenticationError, match="requires CurveZMQ"):
            await asyncio.wait_for(call, 10)
        await asyncio.wait_for(client.close(), 2)

    asyncio.run(main())


def test_requests_keep_their_order_a_withdrawn_one_never_goes_and_best_effort_never_waits(raw_socket: Any) -> None:
    address = free_tcp_address()
    received: list[Any] = []

    def cancels_received(count: int) -> bool:
        while late_broker.poll(0):
            msg = codec.Decoder(codec.FROM_CLIENT).decode(late_broker.recv_multipart()[1:])
            if msg.command == p.CANCEL:
                received.extend(msg.body)
        return len(received) >= count

    async def main() -> None:
        conn = Connection(ClientConfig(address=address, heartbeat_interval_s=60), None, "ordered", Handlers())
        conn.open()
        filled = 0
        while conn.send_now(p.CANCEL, [f"fill-{filled}"]):  # until the socket holds no more
            filled += 1
        first = asyncio.ensure_future(conn.send(p.CANCEL, ["first"]))
        withdrawn = asyncio.ensure_future(conn.send(p.CANCEL, ["withdrawn"]))
        second = asyncio.ensure_future(conn.send(p.CANCEL, ["second"]))
        await async_poll_until(lambda: len(conn._waiting) == 3, what="the three requests to wait")
        assert not conn.send_now(p.HEARTBEAT)  # dropped at once, not queued behind them
        withdrawn.cancel()
        late_broker.bind(address)
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        await async_poll_until(lambda: cancels_received(filled + 2), what="every CANCEL")
        await conn.close()

    late_broker = raw_socket(zmq.ROUTER)
    asyncio.run(main())
    assert received == [*(f"fill-{i}" for i in range(len(received) - 2)), "first", "second"]


def test_a_closed_client_that_meets_a_broker_while_it_lingers_stalls_no_other_client(
    start_broker: Any, raw_socket: Any
) -> None:
    """A closed socket keeps what it holds for CLOSE_LINGER_MS, its DISCONNECT too; a broker
    that appears meanwhile gets them after a handshake. libzmq reports handshakes to the
    monitor with a blocking send from the I/O thread that every client of the process
    shares: the monitor must be off by then, or no client of the process hears again."""
    address = free_tcp_address()

    async def close_unconnected() -> None:
        client = await AsyncRolloutClient(address).connect()
        await client.close()

    asyncio.run(close_unconnected())
    late_broker = raw_socket(zmq.ROUTER)
    late_broker.bind(address)
    commands = []
    while late_broker.poll(2000) and p.DISCONNECT not in commands:
        commands.append(late_broker.recv_multipart()[2])
    assert p.DISCONNECT in commands, "the DISCONNECT was not delivered while the socket lingered"
    broker = start_broker()
    with RolloutClient(broker.frontend, request_timeout_s=3) as other:
        assert other.status().workers == []
