"""The broker's socket loop: two ROUTER sockets around the pure ``Scheduler``.

Each pass reads every message already waiting on both sockets (up to a bound), feeds them to
the scheduler, and sends what its outbox holds, one message per peer and command: once after
the workers' messages, once after the clients'. What each message means to the scheduler, and
the answer to bad input (which never reaches the scheduler), is ``inbound.py``'s. Each peer is
answered in the form (split or packed, ``codec``) of the last message it sent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any

import zmq

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.config import BrokerConfig
from zmq_rollout.gc_pauses import settle_heap

from .busy_poll import BusyPoll, IdleCores, JobsPerMessage, busy_poll_s
from .curve_ports import CurvePorts
from .heap_keep import heap_keep_mib, keep_freed_memory
from .inbound import Inbound
from .older_workers import fit_jobs, needs_fitting
from .outbox import CLIENT, WORKER
from .own_process import owns_process
from .packing import Packing, pack_step
from .scheduler import Scheduler

log = logging.getLogger(__name__)

REVIEW_S = 0.25
"""Seconds between two reviews of whether to pack (``Broker.review``, ``packing.py``): a broker
that a burst of jobs makes busy packs within two, where once a heartbeat interval (1 s) it
spread the first one to two seconds of every burst over the fleet (``benchmarks/README.md``)."""
_READ_BATCH = 256  # messages per socket per pass, so that neither side starves the other
GC_YOUNG_THRESHOLD = 20_000
"""New objects between two collections of the youngest generation in a broker's own process
(Python's default: 700). Each collection walks the objects of jobs in flight; with 700 the
collector was a tenth of the broker's CPU unbatched (8c x 8w); 20,000: 4-9% more jobs/s at 8 and
64 workers, 100,000 slower again (longer walks, colder caches; benchmarks/README.md)."""
# Plain ints: pyzmq's flag enums cost a conversion per call, and recv_multipart/send_multipart
# an option lookup and checks per frame (half the broker's time per message, unbatched).
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_COPY_BELOW = 1 << 16
"""Frames shorter than this are sent copied: a zero-copy send of a small frame costs more (pyzmq
builds a ``Frame`` and copies it anyway below its own ``COPY_THRESHOLD``)."""


def recv_frames(sock: zmq.Socket[Any]) -> tuple[bytes, list[zmq.Frame]]:
    """One whole waiting message of a ROUTER (raises ``zmq.Again`` if none waits): its sender's
    identity, copied (a few bytes: 0.4 us less a message than an uncopied ``Frame`` read as
    ``bytes``), and the frames the sender sent, uncopied (at least one; msgspec decodes them in
    place). ZeroMQ delivers a message's frames together: once the first is here, the others are."""
    identity: bytes = sock.recv(_NOBLOCK)
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return identity, frames


_get = zmq.backend.Socket.get


def more_waiting(sock: zmq.Socket[Any]) -> bool:
    """Whether a message waits on ``sock`` (its ``zmq.EVENTS``: libzmq's ``getsockopt``, without
    pyzmq's Python wrapper); no read is tried."""
    return bool(int(_get(sock, _EVENTS)) & _POLLIN)


_send = zmq.backend.Socket.send
"""libzmq's send as pyzmq's compiled backend has it: ``zmq.Socket.send`` is a Python method over
it for draft sockets' ``routing_id`` and ``group`` (unused here), and costs as much again
(about 0.6 against 0.3 us a frame): a quarter of a small message's sending."""


def send_frames(sock: zmq.Socket[Any], frames: list[Any]) -> None:
    """Send ``frames`` as one message without blocking (raises ``zmq.ZMQError``, e.g. EAGAIN)."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _send(sock, frame, _MORE if i < last else _NOBLOCK, len(frame) < _COPY_BELOW)


class Broker(Inbound):
    """Binds the frontend (clients) and backend (workers) and runs the loop; what each message
    means to the scheduler is ``Inbound``'s (``inbound.py``)."""

    def __init__(self, config: BrokerConfig | None = None, context: zmq.Context[Any] | None = None) -> None:
        self.config = config or BrokerConfig()
        self.scheduler = Scheduler(self.config)
        self.scheduler.defer_dispatch = True  # dispatched once per loop pass, in _flush
        self.epoch = uuid.uuid4().hex[:12]
        """This broker process's id in heartbeat replies: a client that sees it change resubmits."""
        self._curve = CurvePorts.setup(self.config, context, self.scheduler.stats)
        """Keys on both ports (``curve_ports.py``); None: the ports are open."""
        self._ctx = self._curve.context if self._curve is not None else context or zmq.Context.instance()
        self._sockets: list[zmq.Socket[Any]] = []
        try:
            self.frontend = self._router(self.config.frontend, "frontend")
            self.backend = self._router(self.config.backend, "backend")
        except BaseException:  # an address in use, say: leave no socket, thread or context behind
            self._release()
            raise
        if self._curve is None:
            log.warning(
                "no CurveZMQ keys: the broker's ports (%s, %s) accept any peer, unencrypted "
                "(set curve_secret_key and allow_keys to require keys; docs/security.md)",
                self.frontend_address,
                self.backend_address,
            )
        self._split: dict[bytes, float] = {}
        """Peers whose last message was in the split form (older ones), and when: they are
        answered split; every other peer packed. Forgotten with the peer (``tick``)."""
        self._read_one: dict[zmq.Socket[Any], bool] = {}
        """Per socket, whether its last read found one message (``_read``)."""
        self._from_client = codec.Decoder(codec.BROKER_FROM_CLIENT)
        self._from_worker = codec.Decoder(codec.FROM_WORKER)
        self._stop = threading.Event()
        self._packing = Packing(pack_step(self.config.pack_step))
        self._spin: BusyPoll | None = None
        """The busy polling of a running loop (``run``; None: it sleeps at once)."""
        self._idle, self._carried = IdleCores(), JobsPerMessage()
        self._submit_size = JobsPerMessage()  # the same ratio over SUBMITs: jobs per SUBMIT (``review``)
        self._metrics_server: Any = None
        if self.config.metrics_port is not None:
            from .metrics import serve_metrics

            self._metrics_server = serve_metrics(self.scheduler, self.config.metrics_port, self.config.metrics_host)

    def _router(self, address: str, port: str) -> zmq.Socket[Any]:
        sock = self._ctx.socket(zmq.ROUTER)
        self._sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # Hard cap: ZeroMQ drops the connection of a peer that sends more than twice the
        # soft limit; up to that, we answer with a clear error.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_message_bytes)
        if self._curve is not None:
            self._curve.serve(sock, port)
        sock.bind(address)
        return sock

    @property
    def frontend_address(self) -> str:
        return self.frontend.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def backend_address(self) -> str:
        return self.backend.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def split_peers(self) -> frozenset[bytes]:
        """The peers answered in the split form: their last message was split (older clients
        and workers, or hand-written ones); every other peer is answered packed."""
        return frozenset(self._split)

    @property
    def metrics_port(self) -> int | None:
        """The port ``/metrics`` is served on (the one picked, for ``metrics_port=0``), or None."""
        return None if self._metrics_server is None else int(self._metrics_server.port)

    # -- loop ------------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until ``stop()``. Closes the sockets (and the metrics endpoint) on the way out."""
        log.info(  # ``LocalCluster(broker_process=True)`` reads this line: its addresses and port
            "broker up: frontend %s, backend %s, metrics port %s",
            self.frontend_address,
            self.backend_address,
            self.metrics_port,
        )
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        for monitor in self._curve.monitors if self._curve is not None else ():
            poller.register(monitor, zmq.POLLIN)
        interval = self.config.heartbeat_interval_s
        next_tick = time.monotonic() + interval
        next_review = time.monotonic() + REVIEW_S
        self._packing = Packing(pack_step(self.config.pack_step))  # on the thread that runs the loop
        if owns_process():  # the collector is the process's to set
            settle_heap(GC_YOUNG_THRESHOLD)
        keep_freed_memory(heap_keep_mib(self.config.heap_keep_mib))  # the allocator too (0 on a thread)
        max_spin = busy_poll_s(self.config.busy_poll_us)
        spin = self._spin = BusyPoll(max_spin) if max_spin > 0 else None
        busy = False
        try:
            while not self._stop.is_set():
                held = self.scheduler.wake_at()  # a turn held for its session's worker stops waiting
                wake = next_tick if held is None else min(next_tick, held)
                timeout_ms = max(0.0, min(wake - time.monotonic(), 0.1)) * 1000
                before = time.monotonic()
                ready = self._poll(poller, timeout_ms, spin if busy else None)
                busy = bool(ready)
                now = time.monotonic()
                stalled = now - before - timeout_ms / 1000
                if stalled > interval + 1:  # this thread got no CPU: peers were not silent
                    log.warning("broker loop stalled for %.1f s", stalled)
                    self.scheduler.excuse(stalled)
                self._serve(ready, now)
                if now >= next_tick:
                    self.tick(now)
                    next_tick = now + interval
                if now >= next_review:
                    self.review(now)
                    next_review = now + REVIEW_S
                self.scheduler.wake(now)
                self._flush(now)
                self._packing.worked(time.monotonic() - now)  # this pass's work, its polling apart
        finally:
            self._close()

    def stop(self) -> None:
        self._stop.set()

    def _serve(self, ready: dict[Any, int], now: float) -> None:
        """Read what ``ready`` says waits: the workers' messages first, and what they answered
        or freed sent at once (results to their clients; freed credits filled from the queues)
        before the clients' messages are read. A client that waits for results to submit more
        gets them a pass sooner (benchmarks/README.md: 2-4% more jobs/s batched with 8 clients,
        6% unbatched)."""
        if self.backend in ready:
            self._read(self.backend, self._on_worker, now)
            self._flush(now)
        if self.frontend in ready:
            self._read(self.frontend, self._on_client, now)
        curve = self._curve
        if curve is not None:  # failed handshakes, counted
            for monitor in curve.monitors:
                if monitor in ready:
                    curve.read(monitor, now, _READ_BATCH)

    def review(self, now: float) -> None:
        """Every ``REVIEW_S``: whether to pack jobs, and keep their blocks whole, until the next
        review (``packing.py``), from the share of the interval the loop spent working."""
        stats = self.scheduler.stats
        step = self._packing.review(now, self._submit_size.sample(stats.submitted, stats.submits))
        self.scheduler.set_dispatch_step(step, self._packing.blocks)
        stats.busy, stats.packing = self._packing.busy, self._packing.packing

    def tick(self, now: float) -> None:
        """Once per heartbeat interval: the scheduler's expiry and heartbeats, and whether to
        poll without sleeping (``busy_poll.py``) in the next."""
        self.scheduler.tick(now)
        self._forget_split(now)
        stats = self.scheduler.stats
        if self._spin is not None:  # poll without sleeping in the next interval? (``busy_poll.py``)
            self._spin.spare(
                self._idle.sample(now, stats.busy_poll_s),
                self._carried.sample(stats.submitted + stats.completed, stats.messages_received),
            )
        stats.split_peers = len(self._split)

    def _forget_split(self, now: float) -> None:
        """Stop remembering the form of split peers the scheduler forgot (each is remembered
        again by its next message; the grace keeps one that spoke in this pass)."""
        sched, before = self.scheduler, now - self.config.heartbeat_interval_s
        for identity, seen in list(self._split.items()):
            if seen < before and identity not in sched.clients and identity not in sched.workers:
                del self._split[identity]

    def _poll(self, poller: zmq.Poller, timeout_ms: float, spin: BusyPoll | None) -> dict[Any, int]:
        """What is ready to read within ``timeout_ms``; after a busy pass (``spin``), polled
        without sleeping for the learnt window first (its time counted in ``stats.busy_poll_s``)."""
        if spin is None:
            return dict(poller.poll(int(timeout_ms)))
        start = time.monotonic()
        window = min(spin.window_s(), timeout_ms / 1000)
        if window > 0:
            end = start + window
            while True:
                ready = poller.poll(0)
                t = time.monotonic()
                if ready or t >= end:
                    break
                os.sched_yield()  # a process waiting for this CPU (on a small machine) runs first
            self.scheduler.stats.busy_poll_s += t - start
            if ready:
                spin.hit()
                return dict(ready)
            timeout_ms -= (t - start) * 1000
        ready = poller.poll(max(0, int(timeout_ms)))
        spin.slept(time.monotonic() - start)
        return dict(ready)

    def _close(self) -> None:
        self._release()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        log.info("broker stopped")

    def _release(self) -> None:
        """Close the sockets, then the Curve monitors, ZAP handler and own context."""
        curve = self._curve
        for sock in self._sockets:
            if curve is not None:
                curve.unwatch(sock)
            sock.close(linger=0)
        if curve is not None:
            curve.close()

    def _read(self, sock: zmq.Socket[Any], handler: Any, now: float) -> None:
        """Hand up to ``_READ_BATCH`` waiting messages of ``sock`` to ``handler``, noting
        which peers sent the split form. Reads until none is left, but where the last read of
        ``sock`` found one message, as while jobs come one at a time: then, after the first
        message, its events say whether another waits, and if none does it reads no more. A read
        that finds none costs more than reading a message (libzmq handles its pending commands,
        and pyzmq raises ``zmq.Again``); asking costs about half of that, a loss where several
        messages wait (``benchmarks/README.md``, twenty-fifth session)."""
        split, read, ask = self._split, 0, self._read_one.get(sock, False)
        while read < _READ_BATCH:
            try:
                identity, frames = recv_frames(sock)
            except zmq.Again:
                break
            read += 1
            if len(frames[0]) <= codec.SPLIT_PREFIX:
                split[identity] = now
            elif split and identity in split:
                del split[identity]
            handler(identity, frames, now)  # Frames: buffers msgspec decodes in place
            if read == 1 and ask and not more_waiting(sock):
                break
        self._read_one[sock] = read == 1
        self.scheduler.stats.messages_received += read

    def _flush(self, now: float) -> None:
        self.scheduler.flush_dispatch(now)
        split = self._split
        out = self.scheduler.outbox.take()
        self.scheduler.stats.messages_sent += len(out)  # tried; one that cannot go is counted unroutable
        workers = self.scheduler.workers
        for side, identity, command, message in out:
            sock = self.frontend if side == CLIENT else self.backend
            body, worker = message, workers.get(identity) if command == p.JOBS else None
            if worker is not None and needs_fitting(worker):
                body, refused = fit_jobs(worker, message)
                if refused:  # answered as if the worker had refused them (``older_workers.py``)
                    self.scheduler.fail_tickets(worker, refused, now)
                if not body:
                    continue
            try:
                send_frames(sock, [identity, *codec.encode(command, body, packed=identity not in split)])
            except zmq.ZMQError as exc:
                # EHOSTUNREACH: the peer is gone (ROUTER_MANDATORY); EAGAIN: it stopped reading.
                log.warning("cannot send %s to %r: %s", p.COMMAND_NAMES.get(command), identity, exc.strerror)
                self.scheduler.stats.count_malformed("unroutable")
                if side == WORKER:
                    self.scheduler.worker_gone(identity, f"unroutable: {exc.strerror}", now)
                else:
                    self.scheduler.client_gone(identity, f"unroutable: {exc.strerror}", now)
        if len(self.scheduler.outbox) or self.scheduler.dispatch_pending:  # a purge above requeued jobs
            self._flush(now)


class BrokerThread:
    """A broker running on a background thread: for tests, the demo and embedding."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.broker = Broker(config)
        self._thread = threading.Thread(target=self.broker.run, name="zmq-rollout-broker", daemon=True)

    def __enter__(self) -> BrokerThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """Whether the loop still runs (it stops on ``close`` or on an exception it let through)."""
        return self._thread.is_alive()

    def close(self) -> None:
        self.broker.stop()
        self._thread.join(timeout=10)
