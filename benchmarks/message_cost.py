"""What one message costs the broker's thread, and how much of it is waking other threads.

    python benchmarks/message_cost.py [--round-trips 3000] [--forms split,packed]

One broker (``Broker``, its loop not running), one client DEALER and one worker DEALER, in one
process. Per round trip: the client sends a one-job SUBMIT; the broker reads it and flushes
(JOBS out); the worker answers FINAL; the broker reads it and flushes (FINAL out). Only the
broker's ``_read`` + ``_flush`` are timed, by this thread's CPU time. No poll loop, no busy
polling: what a message costs the broker's thread.

It runs twice, each in a fresh process: on every CPU, and with the whole process (the broker's
thread, ZeroMQ's I/O thread, the peers) pinned to one CPU. A send wakes ZeroMQ's I/O thread and
a receive takes commands from it; on a VM a wake-up of another CPU is expensive, on one CPU it
is a plain context switch. The ratio (pinned / unpinned) is the share of a message's cost that
is not Python but cross-CPU wake-ups. Run it on a quiet machine: what costs is waking an
idle (halted) CPU, so with other load on every CPU the two figures meet. Prints both, the ratio
and a RESULT line.

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


def measure(round_trips: int, packed: bool = False) -> float:
    """Broker thread CPU per one-job round trip, in us."""
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

    def serve(sock: zmq.Socket[bytes], handler: object) -> int:
        """The broker's part for the next message on ``sock``: its thread CPU time in ns."""
        while not sock.poll(5000):
            raise TimeoutError("no message for the broker within 5 s")
        start = time.thread_time_ns()
        broker._read(sock, handler, time.monotonic())
        broker._flush(time.monotonic())
        return time.thread_time_ns() - start

    to_worker, to_client = codec.Decoder(codec.TO_WORKER), codec.Decoder(codec.TO_CLIENT)
    worker.send_multipart(codec.encode(p.READY, p.WorkerInfo("w", "m", 64), packed=packed))
    serve(broker.backend, broker._on_worker)
    sampling, sample = p.SamplingParams(max_tokens=16), p.Sample(0, [1, 2, 3, 4], [0.0] * 4, "length")
    warmup, spent = round_trips // 10, 0
    for i in range(warmup + round_trips):
        job = p.JobSpec(f"j{i}", sampling, "x" * 100, ack=False)
        client.send_multipart(codec.encode(p.SUBMIT, [job], packed=packed))
        ns = serve(broker.frontend, broker._on_client)
        while (msg := to_worker.decode(worker.recv_multipart())).command != p.JOBS:
            pass
        result = p.Result(msg.body[0].ticket, [1, 2, 3, 4], [sample], 0, "w")
        worker.send_multipart(codec.encode(p.FINAL, [result], packed=packed))
        ns += serve(broker.backend, broker._on_worker)
        while to_client.decode(client.recv_multipart()).command != p.FINAL:
            pass
        if i >= warmup:
            spent += ns
    assert broker.scheduler.stats.completed == warmup + round_trips
    assert (broker.split_peers == frozenset()) is packed  # the broker answered in the peers' form
    for sock in (client, worker):
        sock.close(linger=0)
    broker._release()
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--round-trips", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each, interleaved (median)")
    ap.add_argument("--forms", default="split,packed", help="message forms to measure, comma-separated")
    args = ap.parse_args()
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
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"broker thread CPU per one-job round trip (SUBMIT in, JOBS out, FINAL in, FINAL out), {os.cpu_count()} CPUs")
    result: dict[str, float] = {}
    for form in forms:
        a, b = med(free[form]), med(pinned[form])
        print(f"  {form:6}  every CPU {a:7.1f} us   runs {', '.join(f'{x:.1f}' for x in free[form])}")
        print(f"  {form:6}  one CPU   {b:7.1f} us   runs {', '.join(f'{x:.1f}' for x in pinned[form])}")
        print(f"  {form:6}  one CPU / every CPU: {b / a:.2f} (the rest is cross-CPU wake-ups)")
        result |= {f"{form}_every_cpu_us": a, f"{form}_one_cpu_us": b, f"{form}_ratio": round(b / a, 3)}
    if len(forms) == 2:
        for where, runs in (("every CPU", free), ("one CPU", pinned)):
            ratio = med(runs["packed"]) / med(runs["split"])
            print(f"  packed / split, {where}: {ratio:.2f}")
            result[f"packed_over_split_{where.split()[0]}_cpu"] = round(ratio, 3)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
