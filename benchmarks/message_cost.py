"""What one message costs the broker's thread, and how much of it is waking other threads.

    python benchmarks/message_cost.py [--round-trips 3000] [--forms split,packed] [--parts]

One broker (``Broker``, its loop not running), one client DEALER and one worker DEALER, in one
process. The worker announces what a current worker reads (token bins, sealed jobs: its JOBS
go out as they came; before the twenty-fifth session it announced nothing, and each JOBS went
through ``older_workers.fit_jobs``). Per round trip: the client sends a one-job SUBMIT; the
broker reads it and flushes (JOBS out); the worker answers FINAL; the broker reads it and flushes (FINAL out). Only the
broker's ``_read`` + ``_flush`` are timed, by this thread's CPU time. No poll loop, no busy
polling: what a message costs the broker's thread.

It runs twice, each in a fresh process: on every CPU, and with the whole process (the broker's
thread, ZeroMQ's I/O thread, the peers) pinned to one CPU. A send wakes ZeroMQ's I/O thread and
a receive takes commands from it; on a VM a wake-up of another CPU is expensive, on one CPU it
is a plain context switch. The ratio (pinned / unpinned) is the share of a message's cost that
is not Python but cross-CPU wake-ups. Run it on a quiet machine: what costs is waking an
idle (halted) CPU, so with other load on every CPU the two figures meet. Prints both, the ratio
and a RESULT line.

``--parts``: instead, where a one-job round trip's time goes in the broker's thread, in this
process, packed form, every CPU: the broker's own functions are wrapped with a wall clock
(``PartClock``), so each call of ``recv_frames`` (a message read, or the read that finds none
and ends ``_read``, raising ``zmq.Again``), of the message handlers (decoding and the
scheduler), of the dispatch pass, of ``codec.encode`` and of ``send_frames`` is timed; the
rest of ``_read`` and ``_flush`` is ``other``. Wall time (the thread CPU clock is a system call
of 1-2 us here, as long as some parts); the thread CPU per round trip is printed beside it.
It tells the libzmq calls (reads and sends) from the Python (handlers, dispatch, encoding).

Each is measured for both message forms (docs/protocol.md section 2.0): the peers send
``split`` (signature, command and header in three frames; the broker answers split) or
``packed`` (one frame; answered packed). The packed / split ratio is what the packed form
saves the broker's thread, from runs interleaved with the split baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

PARTS = ("read a message", "read none (ends _read)", "handler", "dispatch pass", "encode", "send", "other")
"""``--parts``: what ``PartClock`` times (``other``: the rest of ``_read`` and ``_flush``)."""


class PartClock:
    """Wall time (ns) of the broker's parts while ``on``: ``wrap`` puts a timer around a callable."""

    def __init__(self) -> None:
        self.ns = dict.fromkeys(PARTS, 0)
        self.calls = 0
        """Timed calls: each adds the timer's own cost (``timer_ns``) to ``other``."""
        self.on = False

    def wrap(self, part: str, fn: Any, raised: str | None = None) -> Any:
        """``fn`` timed into ``part``; a call that raises, into ``raised`` if given (else ``part``)."""
        clock, ns = time.perf_counter_ns, self.ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            self.calls += 1
            start, into = clock(), raised or part
            try:
                got = fn(*args, **kwargs)
                into = part
                return got
            finally:
                ns[into] += clock() - start

        return timed

    @staticmethod
    def timer_ns(calls: int = 20_000) -> float:
        """What a timer adds to a call, in ns: a timed no-op against a bare one."""
        probe = PartClock()
        bare, timed = (lambda: None), probe.wrap("other", lambda: None)
        probe.on = True
        clock = time.perf_counter_ns
        start = clock()
        for _ in range(calls):
            bare()
        mid = clock()
        for _ in range(calls):
            timed()
        return max(0.0, ((clock() - mid) - (mid - start)) / calls)

    def install(self, broker: Any) -> Any:
        """Time ``broker``'s parts: its module's ``recv_frames``, ``send_frames`` and ``codec.encode``,
        and its scheduler's ``flush_dispatch`` (the handlers are wrapped where ``measure`` passes them).
        Returns what puts the module's functions back."""
        import types

        from zmq_rollout import codec
        from zmq_rollout.broker import server

        recv_frames = self.wrap("read a message", server.recv_frames, raised="read none (ends _read)")  # zmq.Again
        wrapped = types.SimpleNamespace(**{k: getattr(codec, k) for k in dir(codec) if not k.startswith("__")})
        wrapped.encode = self.wrap("encode", codec.encode)
        timed = {"recv_frames": recv_frames, "send_frames": self.wrap("send", server.send_frames), "codec": wrapped}
        kept = {name: getattr(server, name) for name in timed}
        for name, value in timed.items():  # ``codec``: the broker's encoding; its peers' here stays untimed
            setattr(server, name, value)
        broker.scheduler.flush_dispatch = self.wrap("dispatch pass", broker.scheduler.flush_dispatch)

        def restore() -> None:
            for name, value in kept.items():
                setattr(server, name, value)

        return restore


def measure(round_trips: int, packed: bool = False, parts: PartClock | None = None) -> float:
    """Broker thread CPU per one-job round trip, in us. ``parts``: also time the broker's parts
    into it (``PartClock.ns``; ``other``, the rest of ``_read`` and ``_flush``), summed over the
    measured round trips."""
    import zmq

    from zmq_rollout import codec
    from zmq_rollout import protocol as p
    from zmq_rollout.broker.server import Broker
    from zmq_rollout.config import BrokerConfig

    broker = Broker(BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", busy_poll_us=0))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    client = ctx.socket(zmq.DEALER)
    client.connect(broker.frontend_address)
    worker = ctx.socket(zmq.DEALER)
    worker.connect(broker.backend_address)

    on_client, on_worker, restore = broker._on_client, broker._on_worker, None
    if parts is not None:
        restore = parts.install(broker)
        on_client, on_worker = parts.wrap("handler", on_client), parts.wrap("handler", on_worker)
    wall = 0

    def serve(sock: zmq.Socket[bytes], handler: object) -> int:
        """The broker's part for the next message on ``sock``: its thread CPU time in ns."""
        nonlocal wall
        while not sock.poll(5000):
            raise TimeoutError("no message for the broker within 5 s")
        start, began = time.thread_time_ns(), time.perf_counter_ns()
        broker._read(sock, handler, time.monotonic())
        broker._flush(time.monotonic())
        wall += time.perf_counter_ns() - began
        return time.thread_time_ns() - start

    to_worker, to_client = codec.Decoder(codec.TO_WORKER), codec.Decoder(codec.TO_CLIENT)
    info = p.WorkerInfo("w", "m", 64, 0, [p.TOKEN_BINS, p.SEALED_JOBS])  # as a current worker announces
    worker.send_multipart(codec.encode(p.READY, info, packed=packed))
    sampling, sample = p.SamplingParams(max_tokens=16), p.Sample(0, [1, 2, 3, 4], [0.0] * 4, "length")
    warmup, spent = round_trips // 10, 0
    try:
        serve(broker.backend, on_worker)
        for i in range(warmup + round_trips):
            if i == warmup:
                wall = 0
                if parts is not None:
                    parts.on = True
            job = p.JobSpec(f"j{i}", sampling, "x" * 100, ack=False)
            client.send_multipart(codec.encode(p.SUBMIT, [job], packed=packed))
            ns = serve(broker.frontend, on_client)
            while (msg := to_worker.decode(worker.recv_multipart())).command != p.JOBS:
                pass
            result = p.Result(msg.body[0].ticket, [1, 2, 3, 4], [sample], 0, "w")
            worker.send_multipart(codec.encode(p.FINAL, [result], packed=packed))
            ns += serve(broker.backend, on_worker)
            while to_client.decode(client.recv_multipart()).command != p.FINAL:
                pass
            if i >= warmup:
                spent += ns
    finally:
        if restore is not None:
            restore()
        for sock in (client, worker):
            sock.close(linger=0)
        broker._release()
    assert broker.scheduler.stats.completed == warmup + round_trips
    assert (broker.split_peers == frozenset()) is packed  # the broker answered in the peers' form
    if parts is not None:
        parts.on = False
        parts.ns["other"] = wall - sum(parts.ns.values())
    return spent / round_trips / 1e3


def run(pin: bool, round_trips: int, packed: bool) -> float:
    """``measure`` in a fresh process (pinned to one CPU before ZeroMQ starts its thread)."""
    code = (
        "import os, sys, json; sys.path.insert(0, sys.argv[1]); import message_cost as m\n"
        "if sys.argv[2] == '1': os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})\n"
        "print(json.dumps(m.measure(int(sys.argv[3]), sys.argv[4] == 'packed')))"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    form = "packed" if packed else "split"
    out = subprocess.run(
        [sys.executable, "-c", code, here, "1" if pin else "0", str(round_trips), form],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def median(xs: list[float]) -> float:
    """The middle value (the upper one of an even count), as every figure here is reported."""
    return sorted(xs)[len(xs) // 2]


def report_parts(round_trips: int, repeats: int) -> dict[str, Any]:
    """``--parts``: ``repeats`` runs in this process; each part's median, in us per round trip."""
    runs, cpu, timers = [], [], []
    for _ in range(repeats):
        clock = PartClock()
        cpu.append(measure(round_trips, packed=True, parts=clock))
        runs.append({part: ns / round_trips / 1e3 for part, ns in clock.ns.items()})
        timers.append(clock.calls / round_trips * PartClock.timer_ns() / 1e3)
    parts = {part: median([r[part] for r in runs]) for part in PARTS}
    wall = sum(parts.values())
    zmq_calls = parts["read a message"] + parts["read none (ends _read)"] + parts["send"]
    print(f"where a one-job round trip's time goes in the broker's thread (packed, wall us, median of {repeats})")
    for part, us in parts.items():
        print(f"  {part:24} {us:7.1f} us  {us / wall:6.1%}   runs {', '.join(f'{r[part]:.1f}' for r in runs)}")
    print(f"  {'total':24} {wall:7.1f} us; thread CPU {median(cpu):.1f} us (runs {', '.join(f'{c:.1f}' for c in cpu)})")
    print(f"  of which the timers' own cost, in other: about {median(timers):.1f} us")
    print(f"  libzmq calls (reads, sends): {zmq_calls / wall:.0%} of it; the rest is Python")
    result = {
        "parts_us": {k: round(v, 2) for k, v in parts.items()},
        "wall_us": round(wall, 2),
        "cpu_us": median(cpu),
        "timers_us": round(median(timers), 2),
    }
    print("RESULT " + json.dumps(result))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--round-trips", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each, interleaved (median)")
    ap.add_argument("--forms", default="split,packed", help="message forms to measure, comma-separated")
    ap.add_argument("--parts", action="store_true", help="where a round trip's time goes in the broker (packed)")
    args = ap.parse_args()
    if args.parts:
        report_parts(args.round_trips, args.repeats)
        return
    if not hasattr(os, "sched_setaffinity"):
        sys.exit("this benchmark pins a process to one CPU: Linux only")
    forms = args.forms.split(",")
    if not forms or set(forms) - {"split", "packed"}:
        ap.error(f"--forms takes split and/or packed, got {args.forms!r}")
    free: dict[str, list[float]] = {f: [] for f in forms}
    pinned: dict[str, list[float]] = {f: [] for f in forms}
    for _ in range(args.repeats):
        for form in forms:
            free[form].append(run(False, args.round_trips, form == "packed"))
            pinned[form].append(run(True, args.round_trips, form == "packed"))
    print(f"broker thread CPU per one-job round trip (SUBMIT in, JOBS out, FINAL in, FINAL out), {os.cpu_count()} CPUs")
    result: dict[str, float] = {}
    for form in forms:
        a, b = median(free[form]), median(pinned[form])
        print(f"  {form:6}  every CPU {a:7.1f} us   runs {', '.join(f'{x:.1f}' for x in free[form])}")
        print(f"  {form:6}  one CPU   {b:7.1f} us   runs {', '.join(f'{x:.1f}' for x in pinned[form])}")
        print(f"  {form:6}  one CPU / every CPU: {b / a:.2f} (the rest is cross-CPU wake-ups)")
        result |= {f"{form}_every_cpu_us": a, f"{form}_one_cpu_us": b, f"{form}_ratio": round(b / a, 3)}
    if len(forms) == 2:
        for where, runs in (("every CPU", free), ("one CPU", pinned)):
            ratio = median(runs["packed"]) / median(runs["split"])
            print(f"  packed / split, {where}: {ratio:.2f}")
            result[f"packed_over_split_{where.split()[0]}_cpu"] = round(ratio, 3)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
