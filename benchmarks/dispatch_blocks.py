"""Jobs per JOBS message with packed dispatch, blocks kept whole or not, in the pure scheduler.

    python benchmarks/dispatch_blocks.py [--workers 1024] [--clients 64] [--passes 3000] [--seed 0]

No sockets and no other process: the product's ``Scheduler``, driven as the socket loop drives
it (``defer_dispatch``, one dispatch pass per loop pass, pack step 64). Each client keeps 4
SUBMITs of 64 jobs in flight and sends the next once 64 of its jobs are answered. Per pass,
``--submits`` SUBMITs arrive and ``--finals`` busy workers answer the oldest JOBS they hold:
whole (one FINAL per JOBS, as the echo doubles of ``broker_throughput.py`` answer), or in parts
(a random share of its jobs in one FINAL and the rest later, as an engine answers jobs that
end at different times). Prints the mean jobs per JOBS message with ``blocks`` off (packing
as before: a pass's block tops up the worker an earlier pass left part-filled first) and on
(``DispatchHeap.blocks``), and their ratio. A count of messages, not a timing: the broker's
CPU per job falls with its messages per job (``broker_throughput.py --scale``, "m/job").
"""

from __future__ import annotations

import argparse
import random

from zmq_rollout import protocol as p
from zmq_rollout.broker.outbox import CLIENT, WORKER
from zmq_rollout.broker.scheduler import Scheduler
from zmq_rollout.config import BrokerConfig

BLOCK = 64
WINDOW = 4


def jobs_per_jobs_message(args: argparse.Namespace, blocks: bool, in_parts: bool) -> float:
    rng = random.Random(args.seed)
    s = Scheduler(BrokerConfig(max_queue_total=10**7, max_queue_per_client=10**6))
    s.defer_dispatch = True
    for i in range(args.workers):
        s.worker_ready(f"w{i}".encode(), p.WorkerInfo(f"w{i}", "m", BLOCK, 0), 0.0)
    s.set_dispatch_step(BLOCK, blocks)
    due = [f"c{i}".encode() for i in range(args.clients) for _ in range(WINDOW)]  # SUBMITs to send
    rng.shuffle(due)
    held: dict[bytes, list[list[int]]] = {}  # per worker, the tickets of each JOBS it holds
    answered = dict.fromkeys(set(due), 0)
    sizes: list[int] = []
    ids = 0
    for n in range(args.passes):
        now = n / 1000
        for client in due[: args.submits]:
            specs = [p.JobSpec(f"j{ids + i}", p.SamplingParams(), prompt="x", ack=False) for i in range(BLOCK)]
            ids += BLOCK
            s.submit(client, specs, now)
        del due[: args.submits]
        busy = [w for w, jobs in held.items() if jobs]
        for w in rng.sample(busy, min(args.finals, len(busy))):
            tickets = held[w].pop(0)
            if in_parts and len(tickets) > 1 and rng.random() < 0.5:
                cut = rng.randint(1, len(tickets) - 1)
                held[w].insert(0, tickets[cut:])
                tickets = tickets[:cut]
            results = [p.Result(t, [1], [p.Sample(0, [2], [-0.5], "stop")], 0, "w") for t in tickets]
            s.worker_final(w, results, now)
        s.flush_dispatch(now)
        for side, peer, command, body in s.outbox.take():
            if side == WORKER and command == p.JOBS:
                held.setdefault(peer, []).append([a.ticket for a in body])
                sizes.append(len(body))
            elif side == CLIENT and command == p.FINAL:
                answered[peer] += len(body)
                while answered[peer] >= BLOCK:
                    answered[peer] -= BLOCK
                    due.append(peer)
    return sum(sizes) / len(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=1024)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--passes", type=int, default=3000)
    parser.add_argument("--submits", type=int, default=2, help="SUBMITs arriving per pass")
    parser.add_argument("--finals", type=int, default=3, help="workers answering per pass")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{args.workers} workers x {args.clients} clients, {WINDOW} x {BLOCK} jobs in flight each, pack step {BLOCK}")
    print(f"{'workers answer':<16} {'blocks off':>10} {'blocks on':>10} {'on / off':>9}   (jobs per JOBS message)")
    for in_parts in (False, True):
        off = jobs_per_jobs_message(args, False, in_parts)
        on = jobs_per_jobs_message(args, True, in_parts)
        print(f"{'in parts' if in_parts else 'whole JOBS':<16} {off:>10.1f} {on:>10.1f} {on / off:>8.2f}x")


if __name__ == "__main__":
    main()
