"""The client's connection to its broker: one DEALER, every send on it, and the loops that keep
it (receive, heartbeat, handshake monitor), with what they learn of the broker.

``AsyncRolloutClient`` owns one ``Connection`` and hears, through ``Handlers``, every
message and every change in the broker (lost, gone, restarted, refusing us); jobs, sync
steps and status replies are the client's business.

Every send is bounded. A send cannot go out while the broker refuses our CurveZMQ handshake
(libzmq drops the connection and makes no other) or while the socket holds ``SNDHWM`` (1000)
messages for an absent broker. pyzmq's asyncio socket then keeps the send in a queue that
moves only when the socket has room again, and puts every later send behind it, a ``NOBLOCK``
one too (``_AsyncSocket._add_send_event`` tries a send at once only while no send waits):
the heartbeat stopped there, and with it the watch on the broker, and close() waited on its
DISCONNECT, for ever. So no send here goes through that queue: each is tried at once on a
plain shadow of the socket (``_try``). What the socket does not take then:

- a best-effort message (``send_now``: heartbeats, DISCONNECT, a CANCEL or an abort no
  caller waits on) is dropped;
- a request (``send``: SUBMIT, CANCEL, STATUS, SYNC) waits its turn, in order, until the
  socket takes it, the broker is declared gone (``BrokerUnavailableError``), the broker
  refuses us (``AuthenticationError``) or the client closes (``ClientClosedError``): the
  waiting requests then fail with that error, raised to their callers (the client also
  withdraws a waiting sync step when the broker is lost: ``SyncError``).

ZeroMQ errors become the client's errors here, in ``_try``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.config import ClientConfig
from zmq_rollout.curve import HANDSHAKE_EVENTS, PeerKeys, handshake_failure, monitor_socket, refusal
from zmq_rollout.errors import AuthenticationError, BrokerUnavailableError, ClientClosedError, RolloutError
from zmq_rollout.liveness import BrokerState, BrokerWatch

__all__ = ["CLOSE_LINGER_MS", "Connection", "Handlers"]

log = logging.getLogger(__name__)

CLOSE_LINGER_MS = 500
"""How long a closed socket may still try to deliver what it holds (its DISCONNECT): ample
for a connected broker, and a bound for one that is not there."""


def _ignore(*_: Any) -> None:
    return None


async def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Handlers:
    """What the connection tells its owner, on the loop. Only ``restarted`` may wait (for its
    requests to go out); the others return at once."""

    message: Callable[[bytes, Any], None] = _ignore
    """Every message from the broker, decoded (command, body): heartbeat replies too."""
    restarted: Callable[[], Awaitable[None]] = _nothing
    """A heartbeat reply says the broker restarted or forgot us (before that reply's
    ``message``): what was in flight there is gone. Awaited by the receive loop."""
    lost: Callable[[], None] = _ignore
    """No word from the broker for ``heartbeat_interval_s x broker_liveness``."""
    gone: Callable[[], None] = _ignore
    """Lost for ``broker_timeout_s``; the waiting requests have failed with ``unavailable()``."""
    refused: Callable[[str], None] = _ignore
    """The broker refuses our handshake (why, for the user); the waiting requests have failed."""


class _Request:
    __slots__ = ("command", "frames", "sent")

    def __init__(self, command: bytes, frames: list[Any], sent: asyncio.Future[None]) -> None:
        self.command, self.frames, self.sent = command, frames, sent


class Connection:
    """One DEALER to the broker at ``config.address``, opened on the running loop by ``open``."""

    def __init__(self, config: ClientConfig, curve: PeerKeys | None, identity: str, handlers: Handlers) -> None:
        self.config = config
        self._curve = curve
        self._identity = identity
        self._on = handlers
        self.watch = BrokerWatch(
            config.heartbeat_interval_s * config.broker_liveness, config.broker_timeout_s, time.monotonic()
        )
        self.refused: str | None = None
        """Why the broker refuses our handshake, while it does."""
        self.closed = False
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None  # the socket's handshake events
        self._out: zmq.Socket[Any] | None = None  # the same socket, without pyzmq's send queue
        self._tasks: list[asyncio.Task[None]] = []
        self._waiting: deque[_Request] = deque()
        self._writer: asyncio.Task[None] | None = None
        self._decoder = codec.Decoder(codec.TO_CLIENT)
        self.packed = False
        """Whether to send the packed form: the broker's last HEARTBEAT reply said it reads it."""
        self.token_bins = False
        """Whether jobs may carry their token ids as a token bin: the broker's last HEARTBEAT reply
        said it reads them (``Liveness.token_bins``)."""
        self.sealed_jobs = False
        """Whether to submit jobs sealed (SEALED_SUBMIT, ``p.SealedJob``): the broker's last
        HEARTBEAT reply said it reads them (``Liveness.sealed_jobs``)."""

    def open(self) -> None:
        """Create the socket and start the loops (once; never after ``close``)."""
        if self._sock is not None or self.closed:
            return
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self._identity.encode())
        if self._curve is not None:
            self._curve.apply(sock)
        self._monitor = monitor_socket(sock, HANDSHAKE_EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(self.config.address)
        self._sock, self._out = sock, zmq.Socket.shadow(sock.underlying)
        self._tasks = [
            asyncio.ensure_future(self._receive()),
            asyncio.ensure_future(self._heartbeat()),
            asyncio.ensure_future(self._handshakes(self._monitor)),
        ]

    # -- sending -------------------------------------------------------------------------------
    async def send(self, command: bytes, body: Any = None) -> None:
        """Send a request, after those waiting before it. Raises ``ClientClosedError``,
        ``AuthenticationError`` (refused: at once), ``BrokerUnavailableError`` (declared gone
        while it waited) or what ``fail_waiting`` gives it; cancelling the caller withdraws a
        request not yet sent."""
        if self.closed:
            raise ClientClosedError("the client is closed")
        self.open()
        if self.refused is not None:
            if command == p.CANCEL:
                return  # cleanup, which must not raise; it could not reach the broker anyway
            raise AuthenticationError(self.refused)
        frames = codec.encode(command, body, packed=self.packed)
        while self._waiting and self._waiting[0].sent.done():  # withdrawn
            self._waiting.popleft()
        if not self._waiting and self._try(frames):
            return
        request = _Request(command, frames, asyncio.get_running_loop().create_future())
        self._waiting.append(request)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write())
        await request.sent

    def send_now(self, command: bytes, body: Any = None) -> bool:
        """Best effort: sent now (True), or dropped, never waited on. It may pass requests
        that wait. For messages whose loss a timeout or the broker's expiry covers."""
        if self.closed or self._sock is None:
            return False
        try:
            return self._try(codec.encode(command, body, packed=self.packed))
        except ClientClosedError:
            return False

    def fail_waiting(self, error: Callable[[], RolloutError], command: bytes | None = None) -> None:
        """Fail the requests (of ``command``, or all) that wait to go out with a fresh ``error()``."""
        keep: deque[_Request] = deque()
        for request in self._waiting:
            if command is not None and request.command != command:
                keep.append(request)
            elif not request.sent.done():
                request.sent.set_exception(error())
        self._waiting = keep

    def unavailable(self) -> BrokerUnavailableError:
        return BrokerUnavailableError(
            f"the broker at {self.config.address} has not answered for {self.config.broker_timeout_s} s "
            "(ClientConfig.broker_timeout_s)"
        )

    def _try(self, frames: list[Any]) -> bool:
        """Send now if the socket takes it. On the shadow socket: the asyncio socket would
        queue it behind a waiting send (or behind ``_write``'s wait for room)."""
        assert self._sock is not None and self._out is not None
        try:
            self._out.send_multipart(frames, zmq.NOBLOCK, copy=False)
            sent = True
        except zmq.Again:
            sent = False
        except zmq.ZMQError as exc:  # the socket or its context is gone: the client cannot go on
            raise ClientClosedError(f"the client's connection to {self.config.address} failed: {exc}") from exc
        # A send may consume the edge of the socket's notification fd that would have woken
        # the receive loop: reading EVENTS through the asyncio socket makes it look again.
        self._sock.get(zmq.EVENTS)
        return sent

    async def _write(self) -> None:
        """Send the waiting requests, in order, as the socket takes them."""
        assert self._sock is not None
        room = zmq.asyncio.Poller()  # wakes when the socket has room (never in the way of a send: see _try)
        room.register(self._sock, zmq.POLLOUT)
        while self._waiting:
            await room.poll()
            self._sock.get(zmq.EVENTS)  # the poll read the socket's events too: see _try
            while self._waiting:
                request = self._waiting[0]
                if request.sent.done():  # withdrawn by its caller
                    self._waiting.popleft()
                    continue
                try:
                    if not self._try(request.frames):
                        break
                except ClientClosedError as exc:
                    self._waiting.popleft()
                    request.sent.set_exception(exc)
                    continue
                self._waiting.popleft()
                request.sent.set_result(None)

    # -- the loops -----------------------------------------------------------------------------
    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            if self.watch.heard(time.monotonic()):
                log.info("broker at %s answers again", self.config.address)
            try:
                msg = self._decoder.decode([f.buffer for f in frames])
            except RolloutError:
                continue  # a broker of another version; nothing to attribute it to
            if msg.command == p.HEARTBEAT:
                self.packed = msg.body is not None and msg.body.packed
                self.token_bins = msg.body is not None and msg.body.token_bins
                self.sealed_jobs = msg.body is not None and msg.body.sealed_jobs
                if self.watch.liveness(msg.body):
                    await self._on.restarted()
            self._on.message(msg.command, msg.body)

    async def _heartbeat(self) -> None:
        while True:  # the first at once: the broker's epoch is then known before any restart
            self.send_now(p.HEARTBEAT)  # one that cannot go out is no loss: silence is judged below
            state = self.watch.check(time.monotonic())
            if state is BrokerState.LOST:
                log.warning("broker at %s silent for %.1f s; waiting for it", self.config.address, self.watch.expiry_s)
                self._on.lost()
            elif state is BrokerState.GONE:
                self.fail_waiting(self.unavailable)
                self._on.gone()
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _handshakes(self, monitor: zmq.asyncio.Socket) -> None:
        """The broker refuses our CurveZMQ handshake (a key not allowed, a wrong broker key,
        or no keys for a broker that needs them): ``refused`` until a handshake succeeds."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            reason = handshake_failure(event)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.refused = None
            elif reason is not None and self.refused is None:
                self.refused = why = refusal(reason, self.config.address, self._curve is not None)
                log.error("%s", why)
                self.fail_waiting(functools.partial(AuthenticationError, why))
                self._on.refused(why)

    async def close(self) -> None:
        """Fail the waiting requests, say DISCONNECT if the socket takes it now, stop the
        loops and close the socket. Waits on nothing outside this process."""
        if self.closed:
            return
        self.closed = True
        self.fail_waiting(lambda: ClientClosedError("the client was closed"))
        if self._sock is None:
            return
        with contextlib.suppress(ClientClosedError):  # best effort: else the broker expires us
            self._try(codec.encode(p.DISCONNECT, packed=self.packed))
        # The monitor stops before its reader closes: libzmq sends each event with a blocking
        # send from its I/O thread, which a closed reader would hang, and with it every socket
        # of the context (the lingering socket may still report a handshake).
        self._sock.disable_monitor()
        tasks = [*self._tasks, *([self._writer] if self._writer is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        self._sock.close(linger=CLOSE_LINGER_MS)
