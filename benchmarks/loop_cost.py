"""What a one-job round trip costs a server's loop thread: the broker's, a minimal Python loop
that speaks the protocol, a bare Python forwarder's and ``zmq.proxy``'s (issue 12, goal 3).

    python benchmarks/loop_cost.py [--round-trips 5000] [--rounds 3] [--servers broker,minimal,forwarder,proxy]
                                   [--baseline-ref REF]

Each server runs in a process of its own, with one client and one worker, both threads of this
process. One message is in flight at a time, so the two never run at once. The servers:
- ``broker``: ``Broker.run``, the real loop: a one-job SUBMIT in, JOBS out, FINAL in, FINAL out.
  Busy polling is off, or its polling would count as CPU per round trip.
- ``minimal``: the least a Python broker that speaks the protocol does for them: each message
  decoded with the broker's decoders, a ticket per job kept in a dict, each answer encoded and
  sent with the broker's own functions. No queue, credits or metrics: not a broker, the floor
  of one written in Python on this protocol.
- ``forwarder``: the least a Python loop on pyzmq does for the same four messages. Two ROUTERs
  and a poll; each message is read (identity, frames) and sent on, nothing decoded. The client's
  identity travels as a frame to the worker and back, as ``zmq.proxy`` carries it. Each socket
  is read until ``zmq.Again``. 100-byte messages.
- ``proxy``: ``zmq.proxy`` from a ROUTER to a DEALER, libzmq's own loop in C. 100-byte messages.
- ``direct`` and ``echo``: no server, the paths goal 3's "added" latency is measured against
  (``broker_throughput.py``'s ``direct`` and ``raw-direct``): the client straight to a process
  that answers as the worker does, one hop in all. ``direct`` answers a SUBMIT with the worker
  double's FINAL (decoded and encoded as the worker does); ``echo`` sends each 100-byte message
  back.

Per server, this prints:
- the CPU its loop thread spends per round trip: its clock at the start and end of the measured
  round trips, with the user and system split from ``/proc``;
- the client's round trip p50;
- for the servers in Python, each message's time inside the server (``Stamps``): from
  the start of its read to the start of the send it caused, and that send's own time. The
  first is the server's work on the latency path; the second, libzmq's send (waking its I/O
  thread, which on a small machine may run first), is paid by any server that forwards.

The servers take turns within each round, in a rotated order; each figure is the median over
the rounds. The ratios to ``zmq.proxy`` come from the same run. ``--baseline-ref REF`` adds the
broker of commit REF (a temporary git worktree, its own interpreter mapped to it) as the server
``baseline`` in the same rounds, and prints this tree's broker over it: CPU, p50 and read to
send, at the median and per round.

Why it matters: goal 3 wants the broker to add at most 1.5x the latency ``zmq.proxy`` adds. A
server's CPU per round trip is most of what it adds, past the hops that every process in the
path pays. The forwarder is the floor for any broker written as a Python loop on pyzmq, and
``minimal`` for one that decodes and encodes our messages. The broker's figure less the
forwarder's is what its own work costs: decoding, the scheduler, encoding; its read to send
less ``minimal``'s, what the scheduler costs on the latency path. With ``direct`` and ``echo``
in the run (the default), each server's added latency (its p50 less its path's without it,
``DIRECT_PATH``) over ``zmq.proxy``'s, per round: goal 3's ratio, for the broker and for the
floors beside it, so that a run says whether a Python broker on this protocol can meet the goal
on this machine at all. Prints a RESULT line.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import zmq
from message_cost import median  # the benchmarks' one median (the upper one of an even count)

from zmq_rollout import codec
from zmq_rollout import protocol as p

SERVERS = ("broker", "minimal", "forwarder", "proxy", "direct", "echo")
DIRECT_PATH = {"broker": "direct", "baseline": "direct", "minimal": "direct", "forwarder": "echo", "proxy": "echo"}
"""Each server's path without it (goal 3's "added" latency: the server's p50 less this one's): the
client straight to a process that answers as the worker does, one hop in all."""
GOAL_ADDED_OVER_PROXY = 1.5
"""Goal 3: the broker adds at most this many times the latency ``zmq.proxy`` adds."""
RAW = b"x" * 100
"""What the forwarder's and the proxy's client sends, and the echo returns."""
SAMPLE = p.Sample(0, [1, 2, 3, 4], [0.0] * 4, "length")
"""Each fake result's one sample (the worker double's and ``direct``'s)."""


# -- a message's time inside a server -------------------------------------------------------
class Stamps:
    """When a server's loop reads each message and sends each one (``perf_counter_ns``): a
    read's start and its side (``CLIENT`` or ``WORKER``: who sent it), a send's start and end.
    ``mark`` notes where the measured round trips start and end (the warm-up is left out)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int, int]] = []
        """(READ, start, side) for a read; (SEND, start, end) for a send."""
        self.marks: list[int] = []

    def read(self, start: int, side: int) -> None:
        self.events.append((READ, start, side))

    def sent(self, start: int, end: int) -> None:
        self.events.append((SEND, start, end))

    def mark(self) -> None:
        self.marks.append(len(self.events))

    def summary(self) -> dict[str, Any] | None:
        """The medians of ``residences`` between the first two marks (us), over all messages and
        per side (a client's message to its send, a worker's); None before the marks."""
        if len(self.marks) < 2:
            return None
        found = residences(self.events[self.marks[0] : self.marks[1]])
        out: dict[str, Any] = {"messages": len(found)}
        for key, side, at in INSIDE:
            times = [r[at] / 1e3 for r in found if side is None or r[0] == side]
            out[key] = median(times) if times else None
        return out


READ, SEND = 0, 1
CLIENT, WORKER = 0, 1
"""Who sent a message the server read."""
INSIDE = (
    ("to_send_us", None, 1),
    ("send_us", None, 2),
    ("client_to_send_us", CLIENT, 1),
    ("worker_to_send_us", WORKER, 1),
)
"""``Stamps.summary``'s figures: (key, the side whose messages it takes or None for all, the
field of ``residences``)."""


def residences(events: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Per message read and answered by a send before the next read: its side, the ns from its
    read's start to that send's start, and the send's own ns. A read with no send before the
    next read (a heartbeat that needs none) and a send with no read before it (the server's own
    heartbeat, a second message for one read) count for nothing."""
    found: list[tuple[int, int, int]] = []
    read: tuple[int, int] | None = None  # (start, side)
    for kind, start, value in events:
        if kind == READ:
            read = (start, value)
        elif read is not None:
            found.append((read[1], start - read[0], value - start))
            read = None
    return found


# -- the server side (a process of its own: ``--serve NAME``) -------------------------------
def _marks(report_cpu: Any, stop: Any) -> None:
    """Answer each line on stdin: ``mark``, the main thread's CPU clock (ns) and its user and
    system ticks; ``stop``, stop the server."""
    main = threading.main_thread()
    assert main.ident is not None  # started: this runs in its thread
    clock = time.pthread_getcpuclockid(main.ident)
    for line in sys.stdin:
        if line.strip() == "stop":
            stop()
            return
        with open(f"/proc/self/task/{main.native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        report_cpu(time.clock_gettime_ns(clock), int(fields[11]), int(fields[12]))


def _say(*values: Any) -> None:
    print(json.dumps(values), flush=True)


def serve_broker() -> None:
    from zmq_rollout.broker.server import Broker
    from zmq_rollout.config import BrokerConfig

    logging.disable(logging.WARNING)  # the open ports' warning; a failure still shows its traceback
    tcp = "tcp://127.0.0.1:*"
    broker = Broker(BrokerConfig(frontend=tcp, backend=tcp, busy_poll_us=0, metrics_port=None))
    stamps = _stamp_broker(lambda: broker.backend)
    _say(
        broker.frontend_address, broker.backend_address, os.path.realpath(sys.modules[Broker.__module__].__file__ or "")
    )
    threading.Thread(target=_marks, args=(_marked(stamps), broker.stop), daemon=True).start()
    broker.run()
    _say(broker.scheduler.stats.completed, stamps.summary())


def _stamp_broker(backend: Any) -> Stamps:
    """The broker loop's reads and sends (``server.recv_frames`` and ``send_frames``, which
    ``Broker._read`` and ``_flush`` call), stamped: two clock reads a message (a fraction of a
    microsecond, in its CPU figure too). ``backend()``: the broker's workers' socket."""
    from zmq_rollout.broker import server

    stamps, clock = Stamps(), time.perf_counter_ns
    recv_frames, send_frames = server.recv_frames, server.send_frames

    def read(sock: Any) -> tuple[bytes, list[Any]]:
        start = clock()
        got = recv_frames(sock)  # zmq.Again: no message, no stamp
        stamps.read(start, WORKER if sock is backend() else CLIENT)
        return got

    def send(sock: Any, frames: list[Any]) -> None:
        start = clock()
        send_frames(sock, frames)
        stamps.sent(start, clock())

    server.recv_frames, server.send_frames = read, send  # this process's only broker
    return stamps


def _marked(stamps: Stamps) -> Any:
    """``_say`` for ``_marks``: each mark also noted in ``stamps``."""

    def report(*cpu: Any) -> None:
        stamps.mark()
        _say(*cpu)

    return report


def _bound_pair(back_type: int) -> tuple[Any, Any]:
    """A ROUTER for the client and a socket of ``back_type`` for the worker, bound to free
    ports, which the parent is told."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(back_type)
    for sock in (front, back):
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:*")
    _say(front.getsockopt_string(zmq.LAST_ENDPOINT), back.getsockopt_string(zmq.LAST_ENDPOINT))
    return front, back


def _waiting(sock: Any) -> tuple[bytes, list[Any]] | None:
    """A ROUTER's next waiting message, its sender's identity and its frames uncopied; None if
    none waits."""
    try:
        identity = sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None
    frames = [sock.recv(zmq.NOBLOCK, copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(zmq.NOBLOCK, copy=False))
    return identity, frames


def _python_server() -> tuple[Any, Any, Any, threading.Event, Stamps]:
    """A server in Python (``forwarder``, ``minimal``): its two ROUTERs, bound (the parent is
    told their addresses), a poller of both, the event that stops its loop, and its ``Stamps``,
    marked with its CPU on each ``mark``."""
    front, back = _bound_pair(zmq.ROUTER)
    stopped, stamps = threading.Event(), Stamps()
    threading.Thread(target=_marks, args=(_marked(stamps), stopped.set), daemon=True).start()
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    return front, back, poller, stopped, stamps


def serve_forwarder() -> None:
    front, back, poller, stopped, stamps = _python_server()
    clock = time.perf_counter_ns
    nb, more = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
    worker: bytes | None = None
    forwarded = 0
    while not stopped.is_set():
        ready = dict(poller.poll(100))
        while back in ready and (got := _read_stamped(back, stamps, WORKER)) is not None:
            identity, frames = got
            if worker is None:  # its hello, answered: then its client may send
                worker = identity
                back.send(identity, more)
                back.send(b"welcome", nb)
                continue
            start = clock()
            for frame in frames[:-1]:  # the client's identity, then the body
                front.send(frame, more)
            front.send(frames[-1], nb)
            stamps.sent(start, clock())
            forwarded += 1
        while front in ready and (got := _read_stamped(front, stamps, CLIENT)) is not None:
            identity, frames = got
            start = clock()
            back.send(worker, more)
            back.send(identity, more)
            for frame in frames[:-1]:
                back.send(frame, more)
            back.send(frames[-1], nb)
            stamps.sent(start, clock())
    _say(forwarded, stamps.summary())
    os._exit(0)  # the context's sockets go with the process


def _read_stamped(sock: Any, stamps: Stamps, side: int) -> tuple[bytes, list[Any]] | None:
    """``_waiting``, its start stamped where it found a message."""
    start = time.perf_counter_ns()
    got = _waiting(sock)
    if got is not None:
        stamps.read(start, side)
    return got


def serve_minimal() -> None:
    """The least a Python broker that speaks the protocol does for the four messages: each read
    as the broker reads (``server.recv_frames``), decoded with its decoders, a ticket per job
    kept in a dict back to its client, each answer encoded packed and sent as the broker sends
    (``server.send_frames``). No queue, credits, fairness, metrics or checks: not a broker, the
    floor of any broker in Python on this protocol. Its read to send less the forwarder's is
    what decoding and encoding cost; the broker's less its own, what the scheduler costs."""
    from zmq_rollout.broker.server import recv_frames, send_frames

    front, back, poller, stopped, stamps = _python_server()
    clock = time.perf_counter_ns
    from_client, from_worker = codec.Decoder(codec.BROKER_FROM_CLIENT), codec.Decoder(codec.FROM_WORKER)
    welcome = codec.encode(p.HEARTBEAT, p.Liveness("minimal", packed=True, sealed=True), packed=True)
    worker = b""
    tickets: dict[int, tuple[bytes, str]] = {}
    next_ticket = itertools.count()
    forwarded = 0

    def read(sock: Any, side: int) -> tuple[bytes, list[Any]] | None:
        start = clock()
        try:
            got = recv_frames(sock)
        except zmq.Again:
            return None
        stamps.read(start, side)
        return got

    def send(sock: Any, frames: list[Any]) -> None:
        start = clock()
        send_frames(sock, frames)
        stamps.sent(start, clock())

    while not stopped.is_set():
        ready = dict(poller.poll(100))
        while back in ready and (got := read(back, WORKER)) is not None:
            identity, frames = got
            msg = from_worker.decode(frames)
            if msg.command == p.READY:  # registered: then its client may send
                worker = identity
                send(back, [identity, *welcome])
            elif msg.command == p.FINAL:
                client = b""
                for result in msg.body:
                    client, result.key = tickets.pop(result.key)
                send(front, [client, *codec.encode(p.FINAL, msg.body, packed=True)])
                forwarded += 1
        while front in ready and (got := read(front, CLIENT)) is not None:
            identity, frames = got
            msg = from_client.decode(frames)
            if msg.command == p.SUBMIT:
                jobs = []
                for spec in msg.body:
                    ticket = next(next_ticket)
                    tickets[ticket] = (identity, spec.job_id)
                    jobs.append(p.AssignmentRelay(ticket, spec, spec.cost()))
                send(back, [worker, *codec.encode(p.JOBS, jobs, packed=True)])
    _say(forwarded, stamps.summary())
    os._exit(0)  # the context's sockets go with the process


def serve_proxy() -> None:
    front, back = _bound_pair(zmq.DEALER)

    def stop() -> None:
        _say(None, None)  # zmq.proxy counts nothing, and its loop is not ours to stamp
        os._exit(0)

    threading.Thread(target=_marks, args=(_say, stop), daemon=True).start()
    zmq.proxy(front, back)


def _answering_server() -> tuple[Any, threading.Event]:
    """A server with no worker behind it (``direct``, ``echo``): one ROUTER for the client,
    bound (the parent is told its address, and none for workers), and the event that stops its
    loop; its CPU reported on each ``mark``."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    front = ctx.socket(zmq.ROUTER)
    front.setsockopt(zmq.LINGER, 0)
    front.bind("tcp://127.0.0.1:*")
    _say(front.getsockopt_string(zmq.LAST_ENDPOINT), "")
    stopped = threading.Event()
    threading.Thread(target=_marks, args=(_say, stopped.set), daemon=True).start()
    return front, stopped


def serve_direct() -> None:
    """Each one-job SUBMIT answered with the FINAL the worker double sends for its JOBS
    (``Peers._answer_jobs``), keyed by the job's id: the decoding and encoding a worker does,
    read and sent as the broker does, with no hop between."""
    from zmq_rollout.broker.server import recv_frames, send_frames

    front, stopped = _answering_server()
    from_client = codec.Decoder(codec.BROKER_FROM_CLIENT)
    answered = 0
    while not stopped.is_set():
        if not front.poll(100):
            continue
        while True:
            try:
                identity, frames = recv_frames(front)
            except zmq.Again:
                break
            msg = from_client.decode(frames)
            if msg.command == p.SUBMIT:
                results = [p.Result(spec.job_id, [1, 2, 3, 4], [SAMPLE], 0, "w") for spec in msg.body]
                send_frames(front, [identity, *codec.encode(p.FINAL, results, packed=True)])
                answered += 1
    _say(answered, None)
    os._exit(0)


def serve_echo() -> None:
    """Each message sent straight back to its sender."""
    front, stopped = _answering_server()
    echoed = 0
    while not stopped.is_set():
        if not front.poll(100):
            continue
        while (got := _waiting(front)) is not None:
            front.send_multipart([got[0], *got[1]], copy=False)
            echoed += 1
    _say(echoed, None)
    os._exit(0)


# -- the client and worker side (this process) ----------------------------------------------
class Peers:
    """A server's client and worker: ``round_trip()`` sends one message and waits for its answer."""

    def __init__(self, server: str, front: str, back: str) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.client, self.worker = self.ctx.socket(zmq.DEALER), self.ctx.socket(zmq.DEALER)
        self.client.setsockopt(zmq.RCVTIMEO, 10_000)  # a server that died: an error, not a hang
        self.client.connect(front)
        self.protocol = server in ("broker", "minimal", "direct")  # they speak the protocol
        self.sent = 0
        self.thread: threading.Thread | None = None
        if self.protocol:
            self.to_client = codec.Decoder(codec.TO_CLIENT)
            self.sampling = p.SamplingParams(max_tokens=16)
        if server in ("direct", "echo"):  # the client's own path: no worker behind the server
            return
        self.worker.connect(back)
        if self.protocol:
            to_worker = codec.Decoder(codec.TO_WORKER)
            info = p.WorkerInfo("w", "m", 64, 0, [p.TOKEN_BINS, p.SEALED_JOBS])  # as a current worker announces
            self.worker.send_multipart(codec.encode(p.READY, info, packed=True))
            while to_worker.decode(self.worker.recv_multipart()).command != p.HEARTBEAT:
                pass  # registered
            target: Any = self._answer_jobs
            args: tuple[Any, ...] = (to_worker,)
        else:
            if server == "forwarder":  # its worker is known once it said hello
                self.worker.send(b"hello")
                if self.worker.recv() != b"welcome":
                    raise RuntimeError("the forwarder did not answer its worker's hello")
            target, args = self._echo, ()
        self.thread = threading.Thread(target=target, args=args, daemon=True)
        self.thread.start()

    def _answer_jobs(self, to_worker: Any) -> None:
        """The worker: each JOBS answered with one FINAL of fake results, until ``close``."""
        try:
            while True:
                msg = to_worker.decode(self.worker.recv_multipart())
                if msg.command == p.JOBS:
                    results = [p.Result(a.ticket, [1, 2, 3, 4], [SAMPLE], 0, "w") for a in msg.body]
                    self.worker.send_multipart(codec.encode(p.FINAL, results, packed=True))
        except zmq.ContextTerminated:
            self.worker.close(linger=0)

    def _echo(self) -> None:
        """The worker: each message sent straight back, until ``close``."""
        try:
            while True:
                self.worker.send_multipart(self.worker.recv_multipart(copy=False), copy=False)
        except zmq.ContextTerminated:
            self.worker.close(linger=0)

    def round_trip(self) -> int:
        """One round trip, in ns."""
        self.sent += 1
        if not self.protocol:
            start = time.perf_counter_ns()
            self.client.send(RAW)
            if self.client.recv() != RAW:
                raise RuntimeError("the echo came back changed")
            return time.perf_counter_ns() - start
        frames = codec.encode(p.SUBMIT, [p.JobSpec(f"j{self.sent}", self.sampling, "x" * 100, ack=False)], packed=True)
        start = time.perf_counter_ns()
        self.client.send_multipart(frames)
        while self.to_client.decode(self.client.recv_multipart()).command != p.FINAL:
            pass
        return time.perf_counter_ns() - start

    def close(self) -> None:
        """End the worker's thread (its socket's context terminates under it) and the client."""
        self.client.close(linger=0)
        if self.thread is None:  # no worker ran: its socket is the context's last
            self.worker.close(linger=0)
        self.ctx.term()
        if self.thread is not None:
            self.thread.join(timeout=10)


def serve_command(server: str, tree: str | None = None) -> list[str]:
    """The command of a server's own process: this file with ``--serve``; or, for the broker of
    another source tree (``--baseline-ref``), a fresh isolated interpreter that maps
    ``zmq_rollout`` to that tree (``roles.use_tree``, as ``broker_throughput.py --baseline-ref``
    does) before it imports this module and serves."""
    here = os.path.abspath(__file__)
    if tree is None:
        return [sys.executable, here, "--serve", server]
    from roles import use_tree

    source = "\n\n".join(
        [
            "from __future__ import annotations",
            "from typing import Any",
            inspect.getsource(use_tree),
            f"use_tree({os.path.realpath(tree)!r})",
            f"import sys\nsys.path.insert(0, {os.path.dirname(here)!r})",
            f"import loop_cost\nloop_cost.serve_{server}()",
        ]
    )
    return [sys.executable, "-I", "-c", source]


def measure(server: str, round_trips: int, tree: str | None = None) -> dict[str, Any]:
    """``round_trips`` one-job round trips through ``server`` (after a fifth as many to warm up),
    in a fresh process: its loop thread's CPU per round trip (us; user and system from the
    thread's ticks), the client's p50 (us), what the server says it forwarded (round trips
    for the servers in Python, warm-up included; None for ``zmq.proxy``), and its messages'
    time inside it (``Stamps.summary``; None for ``zmq.proxy``). ``tree``: the broker of that
    source tree (``serve_command``), checked to be the one that ran. This tree's harness
    stamps it, so the tree's ``broker/server.py`` must have ``recv_frames`` and ``send_frames``
    (since c363a93)."""
    if server not in SERVERS:
        raise ValueError(f"unknown server {server!r}: one of {', '.join(SERVERS)}")
    if tree is not None and server != "broker":
        raise ValueError(f"only the broker comes from another tree, not {server!r}")
    proc = subprocess.Popen(serve_command(server, tree), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def ask(line: str) -> Any:
        stdin.write(line + "\n")
        stdin.flush()
        return json.loads(stdout.readline())

    peers = None
    try:
        front, back, *source = json.loads(stdout.readline())
        if tree is not None and not source[0].startswith(os.path.realpath(tree) + os.sep):
            raise RuntimeError(f"the broker of {tree} ran {source[0]}, another tree's")
        peers = Peers(server, front, back)
        for _ in range(max(1, round_trips // 5)):
            peers.round_trip()
        cpu0, user0, sys0 = ask("mark")
        times = [peers.round_trip() for _ in range(round_trips)]
        cpu1, user1, sys1 = ask("mark")
        forwarded, inside = ask("stop")
        proc.wait(timeout=30)
    finally:
        if peers is not None:
            peers.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    return {
        "cpu_us": (cpu1 - cpu0) / round_trips / 1e3,
        "user_us": (user1 - user0) * tick_us / round_trips,
        "sys_us": (sys1 - sys0) * tick_us / round_trips,
        "p50_us": statistics.median(times) / 1e3,
        "forwarded": forwarded,
        "sent": peers.sent,
        "inside": inside,
    }


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each server's medians over its runs, and the ratios of CPU per round trip: to
    ``zmq.proxy``'s, and the broker's own work (its CPU less the forwarder's). Where the runs
    stamped their messages (``Stamps``): the medians over the runs of ``INSIDE``'s figures, and
    each server's read to send less the forwarder's (its work on the latency path)."""
    out: dict[str, Any] = {}
    for server, rs in runs.items():
        out[server] = {key: round(median([r[key] for r in rs]), 1) for key in ("cpu_us", "user_us", "sys_us", "p50_us")}
        inside = [r["inside"] for r in rs if r.get("inside") and r["inside"]["messages"]]
        for key, _, _ in INSIDE:
            values = [i[key] for i in inside if i.get(key) is not None]
            if values:
                out[server][key] = round(median(values), 1)
    cpu = {server: out[server]["cpu_us"] for server in out}
    if "proxy" in cpu:
        out["cpu_over_proxy"] = {s: round(cpu[s] / cpu["proxy"], 2) for s in cpu if s != "proxy"}
    if "broker" in cpu and "forwarder" in cpu:
        out["broker_own_work_us"] = round(cpu["broker"] - cpu["forwarder"], 1)
    if "broker" in runs and "baseline" in runs:
        out["broker_over_baseline"] = over_baseline(runs["broker"], runs["baseline"])
    added = added_latency(runs)
    if added:
        out["added_over_proxy"] = added
    floor = out.get("forwarder", {}).get("to_send_us")
    if floor is not None:
        stamped = [s for s in runs if s != "forwarder" and "to_send_us" in out[s]]
        if stamped:
            out["to_send_beyond_forwarder_us"] = {s: round(out[s]["to_send_us"] - floor, 1) for s in stamped}
    return out


def added_latency(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Goal 3's ratio per server: the latency it adds (its p50 less its path's without it,
    ``DIRECT_PATH``, in the same round) over what ``zmq.proxy`` adds, per round and at the
    median of the rounds; with the added microseconds' median. Empty without the proxy and the
    echo; a server whose direct path did not run gets none."""
    if "proxy" not in runs or "echo" not in runs:
        return {}

    def added(server: str) -> list[float]:
        path = runs[DIRECT_PATH[server]]
        return [a["p50_us"] - b["p50_us"] for a, b in zip(runs[server], path, strict=True)]

    proxy = added("proxy")
    out: dict[str, Any] = {}
    for server in runs:
        if server == "proxy" or DIRECT_PATH.get(server) not in runs:
            continue
        us = added(server)
        rounds = [round(a / b, 2) if b > 0 else None for a, b in zip(us, proxy, strict=True)]
        known = [r for r in rounds if r is not None]
        ratio = median(known) if known else None
        out[server] = {
            "added_us": round(median(us), 1),
            "ratio": ratio,
            "rounds": rounds,
            "goal_met": ratio is not None and ratio <= GOAL_ADDED_OVER_PROXY,
        }
    return out


def over_baseline(after: list[dict[str, Any]], before: list[dict[str, Any]]) -> dict[str, Any]:
    """This tree's broker over the baseline's (``--baseline-ref``), for its CPU per round trip,
    client p50 and read to send: the ratio of the medians, and each round's ratio (the two ran
    in the same round, minutes apart at most: their spread is the noise)."""

    def value(run: dict[str, Any], key: str) -> float | None:
        inside = run.get("inside") or {}
        return run.get(key) if key in run else inside.get(key)

    out: dict[str, Any] = {}
    for key in ("cpu_us", "p50_us", "to_send_us"):
        pairs = [(value(a, key), value(b, key)) for a, b in zip(after, before, strict=True)]
        pairs = [(a, b) for a, b in pairs if a is not None and b]
        if pairs:
            ratio = median([a for a, _ in pairs]) / median([b for _, b in pairs])
            out[key] = {"ratio": round(ratio, 3), "rounds": [round(a / b, 3) for a, b in pairs]}
    return out


def report(runs: dict[str, list[dict[str, Any]]], round_trips: int, baseline: str | None = None) -> dict[str, Any]:
    """Print the summary and its RESULT line. ``baseline``: what the ``baseline`` server is."""
    result = summarize(runs)
    if baseline is not None:
        result["baseline_ref"] = baseline
    rounds = len(next(iter(runs.values())))
    print(f"a one-job round trip, {round_trips} of them per run, median of {rounds} rounds, {os.cpu_count()} CPUs")
    print("  server      loop thread CPU (user, system)   client p50   runs (CPU us)")
    for server, rs in runs.items():
        r = result[server]
        each = ", ".join(f"{x['cpu_us']:.1f}" for x in rs)
        cpu = f"{r['cpu_us']:7.1f} us ({r['user_us']:6.1f}, {r['sys_us']:5.1f})"
        print(f"  {server:10} {cpu}   {r['p50_us']:7.1f} us   {each}")
    stamped = [server for server in runs if "to_send_us" in result[server]]
    if stamped:
        print("  per message, read to send (median): all, a client's, a worker's; the send itself")
        for server in stamped:
            r = result[server]
            sides = "  ".join(f"{r[k]:6.1f} us" if k in r else f"{'-':>6}   " for k, _, _ in INSIDE if k != "send_us")
            print(f"  {server:10} {sides}   {r['send_us']:6.1f} us")
    for server, ratio in result.get("cpu_over_proxy", {}).items():
        print(f"  {server} / zmq.proxy, CPU per round trip: {ratio:.2f}x")
    if "broker_own_work_us" in result:
        print(f"  the broker's own work (its CPU less the bare forwarder's): {result['broker_own_work_us']:.1f} us")
    for server, us in result.get("to_send_beyond_forwarder_us", {}).items():
        print(f"  a message's read to send, the {server}'s less the forwarder's (twice a round trip): {us:.1f} us")
    added = result.get("added_over_proxy", {})
    if added:
        print(f"  latency added (p50 less its path's without it), over zmq.proxy's: goal 3 <= {GOAL_ADDED_OVER_PROXY}x")
        for server, r in added.items():
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
            each = ", ".join("-" if x is None else f"{x:.2f}" for x in r["rounds"])
            met = "met" if r["goal_met"] else "NOT met"
            print(f"    {server:10} {r['added_us']:7.1f} us  {ratio:>6} ({met})   rounds: {each}")
    if "broker_over_baseline" in result:
        print(f"  this tree's broker over the baseline's (the broker of {baseline}), median; per round:")
        for key, r in result["broker_over_baseline"].items():
            print(f"    {key:10} {r['ratio']:.3f}   {', '.join(f'{x:.3f}' for x in r['rounds'])}")
    print("RESULT " + json.dumps(result))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--round-trips", type=int, default=5000, help="measured round trips per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each server, their order rotated (median)")
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, of " + ", ".join(SERVERS))
    ap.add_argument(
        "--baseline-ref",
        metavar="REF",
        help="also the broker of commit REF (a temporary git worktree), as the server 'baseline', in the same "
        "rounds: this tree's broker over it, per round and at the median (with --servers including broker)",
    )
    ap.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)  # a server's own process
    args = ap.parse_args()
    if args.serve:
        globals()[f"serve_{args.serve}"]()  # as ``serve_command`` names it for another tree
        return
    servers = args.servers.split(",")
    if not servers or set(servers) - set(SERVERS):
        ap.error(f"--servers takes {', '.join(SERVERS)}, got {args.servers!r}")
    if args.round_trips < 1 or args.rounds < 1:
        ap.error("--round-trips and --rounds must be at least 1")
    if args.baseline_ref and "broker" not in servers:
        ap.error("--baseline-ref compares brokers: --servers must include broker")
    with contextlib.ExitStack() as stack:
        trees: dict[str, str | None] = dict.fromkeys(servers)
        label = None
        if args.baseline_ref:
            from broker_throughput import worktree  # a temporary worktree, removed on the way out

            path, sha = stack.enter_context(worktree(args.baseline_ref))
            trees = {"broker": None, "baseline": path, **trees}
            label = f"{args.baseline_ref} = {sha[:9]}"
        names = list(trees)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                server = "broker" if name == "baseline" else name
                runs[name].append(measure(server, args.round_trips, trees[name]))
    report(runs, args.round_trips, label)


if __name__ == "__main__":
    main()
