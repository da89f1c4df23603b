"""Where the broker's per-job CPU goes with 64 jobs a message, phase by phase, in one process.

    python benchmarks/broker_phases.py [--rounds 3000] [--workers 1] [--pack-step 1] [--clients 1]
        [--prompt-tokens 0] [--token-bins] [--sealed] [--sample-tokens 4] [--finals final,sealed_final]
        [--heap-keep-mib 64] [--gc-young 20000] [--json]

No sockets and no other process: the product's ``Scheduler`` and codec, driven as the socket
loop drives them (``defer_dispatch``, one dispatch pass per message). Per round, one SUBMIT of
64 jobs from each of ``--clients`` clients (100-character prompts, as ``broker_throughput.py``'s
clients send; or, with ``--prompt-tokens N``, prompts of N token ids below 150,000, as an RL
trainer sends; as token bins with ``--token-bins``, as the client sends them to a broker that
reads them; each job sealed in a SEALED_SUBMIT with ``--sealed``, as the client sends them to a
broker that reads them) is decoded and submitted; one dispatch pass follows and its JOBS are
encoded (with several clients, each worker gets their jobs in turn, so its results come back
mixed, as in ``broker_throughput.py``'s 8c x 64w case); then one FINAL per JOBS message (one
4-token sample per job, as the echo doubles answer; or, with ``--sample-tokens N``, an N-token
sample with its logprobs and the prompt's ids, as a worker answers an RL job) is decoded,
handed to ``worker_final``, and the clients' FINALs are taken and encoded once a round, as the
socket loop takes them once a pass. ``--finals`` names the forms a worker sends its results in,
each measured in turn: FINAL (the broker keeps token payloads raw, walking them) and
SEALED_FINAL (each result a bin the broker steps over); the last line is the ratio of their
totals. The heap is settled as a broker's own process settles it (``--gc-young``). Each phase
is timed by this thread's CPU time (``time.thread_time``), building the inputs is not. Prints
us per job per phase, each phase's share, and the total against the issue's budget (issue 12,
goal 1: 3 us per job for everything the broker does, sockets and polling included, which this
leaves out).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from typing import Any

import msgspec

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.broker.heap_keep import DEFAULT_KEEP_MIB, keep_freed_memory
from zmq_rollout.broker.scheduler import Scheduler
from zmq_rollout.broker.server import GC_YOUNG_THRESHOLD
from zmq_rollout.config import BrokerConfig
from zmq_rollout.gc_pauses import settle_heap
from zmq_rollout.submissions import pack_submits, submit_command

BATCH = 64
GOAL_US_PER_JOB = 3.0
PHASES = ("decode SUBMIT", "submit", "dispatch", "encode JOBS", "decode FINAL", "worker_final", "encode FINAL")


def run(
    rounds: int,
    workers: int,
    pack_step: int,
    prompt_tokens: int = 0,
    sample_tokens: int = 4,
    final: bytes = p.FINAL,
    token_bins: bool = False,
    sealed: bool = False,
    clients: int = 1,
) -> dict[str, float]:
    s = Scheduler(BrokerConfig())
    s.defer_dispatch = True
    for w in range(workers):
        s.worker_ready(f"w{w}".encode(), p.WorkerInfo(f"w{w}", "model", BATCH, 0, [p.TOKEN_BINS, p.SEALED_JOBS]), 0.0)
    s.set_dispatch_step(pack_step)
    s.flush_dispatch(0.0)
    s.outbox.take()
    from_client, from_worker = codec.Decoder(codec.BROKER_FROM_CLIENT), codec.Decoder(codec.FROM_WORKER)
    sampling = p.SamplingParams(max_tokens=max(16, sample_tokens))
    sample = p.Sample(0, [1, 2, 3, 4], [0.0] * 4, "length")
    spent = dict.fromkeys(PHASES, 0.0)
    clock, now, jobs = time.thread_time, 0.0, 0
    rng = random.Random(0)

    def prompt_ids() -> list[int]:
        return [rng.randrange(150_000) for _ in range(prompt_tokens)]

    if sample_tokens != 4:
        draw = random.Random(1)
        tokens = [draw.randrange(150_000) for _ in range(sample_tokens)]
        sample = p.Sample(0, tokens, [-draw.random() * 5 for _ in tokens], "length")
    gc.collect()
    for r in range(rounds):
        now += 0.001
        prompts: dict[str, Any] = {}
        for c in range(clients):
            ids = [f"j{r}-{c}-{i}" for i in range(BATCH)]
            if prompt_tokens:
                specs = [p.JobSpec(i, sampling, prompt_token_ids=prompt_ids(), ack=False) for i in ids]
            else:
                specs = [p.JobSpec(i, sampling, "x" * 100, ack=False) for i in ids]
            prompts.update((spec.job_id, spec.prompt_token_ids or [1, 2, 3, 4]) for spec in specs)
            ((_, encoded),) = pack_submits(specs, BATCH, 1 << 30, token_bins=token_bins, sealed=sealed)
            submit = codec.encode(submit_command(sealed), encoded, packed=True)
            t0 = clock()
            message = from_client.decode(submit)
            t1 = clock()
            s.submit(f"client{c}".encode(), message.body, now)
            t2 = clock()
            spent["decode SUBMIT"] += t1 - t0
            spent["submit"] += t2 - t1
        t2 = clock()
        s.flush_dispatch(now)
        t3 = clock()
        out = s.outbox.take()
        for _, _, command, body in out:
            codec.encode(command, body, packed=True)
        t4 = clock()
        spent["dispatch"] += t3 - t2
        spent["encode JOBS"] += t4 - t3
        for _, worker, command, body in out:
            if command != p.JOBS:
                continue
            results = [p.Result(a.ticket, prompts[_job_id(a)], [sample], 0, "w") for a in body]  # type: ignore[arg-type]
            if final == p.SEALED_FINAL:
                results = [p.seal(r) for r in results]  # type: ignore[misc]
            answer = codec.encode(final, results, packed=True)
            t0 = clock()
            message = from_worker.decode(answer)
            t1 = clock()
            s.worker_final(worker, message.body, now + 0.0005)
            s.flush_dispatch(now)
            t2 = clock()
            spent["decode FINAL"] += t1 - t0
            spent["worker_final"] += t2 - t1
        t2 = clock()  # the round's FINALs to their clients, taken once as a loop pass takes them
        for _, _, cmd, reply in s.outbox.take():
            codec.encode(cmd, reply, packed=True)
        spent["encode FINAL"] += clock() - t2
        jobs += BATCH * clients
    if s.stats.completed != jobs:
        raise RuntimeError(f"{s.stats.completed} of {jobs} jobs completed: the drive is wrong")
    return {phase: seconds / jobs * 1e6 for phase, seconds in spent.items()}


def _job_id(assignment: p.AssignmentRelay) -> str:
    """The job id of an assignment the scheduler made (a sealed job's, from its bytes)."""
    job = assignment.job
    return _job_spec(job).job_id if type(job) is msgspec.Raw else job.job_id  # type: ignore[union-attr]


_job_spec = msgspec.msgpack.Decoder(p.JobSpec).decode
FORMS = {"final": p.FINAL, "sealed_final": p.SEALED_FINAL}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3000, help="rounds of one SUBMIT of 64 jobs a client (default 3000)")
    ap.add_argument("--workers", type=int, default=1, help="workers of 64 credits each (default 1)")
    ap.add_argument("--pack-step", type=int, default=1, help="the dispatch step (1: least loaded first)")
    ap.add_argument("--clients", type=int, default=1, help="clients, each sending one SUBMIT a round (default 1)")
    ap.add_argument("--samples", type=int, default=3, help="runs; the one with the lowest total is printed")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="prompts of this many token ids (0: 100 characters)")
    ap.add_argument("--token-bins", action="store_true", help="the prompts' token ids as token bins (protocol 5.8)")
    ap.add_argument("--sealed", action="store_true", help="jobs sealed, in SEALED_SUBMIT (protocol 5.9)")
    ap.add_argument("--sample-tokens", type=int, default=4, help="tokens of each job's one sample (default 4)")
    ap.add_argument(
        "--finals", default="final,sealed_final", help="the forms results come in, each measured (default both)"
    )
    ap.add_argument("--json", action="store_true", help="also print the best run of each form as one JSON line, last")
    ap.add_argument(
        "--heap-keep-mib",
        type=int,
        default=DEFAULT_KEEP_MIB,
        help=f"keep this much freed memory, as a broker in its own process does (default {DEFAULT_KEEP_MIB}; 0: the "
        "allocator as it is)",
    )
    ap.add_argument(
        "--gc-young",
        type=int,
        default=GC_YOUNG_THRESHOLD,
        help=f"new objects between collections of the youngest generation, as a broker in its own process sets it "
        f"(default {GC_YOUNG_THRESHOLD}; 700 is Python's own)",
    )
    args = ap.parse_args()
    keep_freed_memory(args.heap_keep_mib)
    settle_heap(args.gc_young)
    forms = args.finals.split(",")
    unknown = set(forms) - set(FORMS)
    if unknown:
        ap.error(f"--finals: unknown {sorted(unknown)}; choose from {sorted(FORMS)}")
    prompts = f"{args.prompt_tokens} token ids" if args.prompt_tokens else "100 characters"
    if args.prompt_tokens and args.token_bins:
        prompts += " in token bins"
    sealed = ", each job sealed (SEALED_SUBMIT)" if args.sealed else ""
    if not 1 <= args.clients <= args.workers:
        ap.error("--clients: 1 or more, and no more than --workers (each round's jobs must all fit at once)")
    print(f"{args.rounds} rounds of {args.clients} SUBMIT(s) of {BATCH} jobs ({prompts} a prompt, "
          f"{args.sample_tokens}-token samples{sealed}), "
          f"{args.workers} worker(s), pack step {args.pack_step}, heap_keep_mib {args.heap_keep_mib}, "
          f"gc young {args.gc_young}")  # fmt: skip
    totals: dict[str, float] = {}
    bests: dict[str, dict[str, float]] = {}
    for form in forms:
        runs = [
            run(
                args.rounds,
                args.workers,
                args.pack_step,
                args.prompt_tokens,
                args.sample_tokens,
                FORMS[form],
                args.token_bins,
                args.sealed,
                args.clients,
            )
            for _ in range(args.samples)
        ]
        best = bests[form] = min(runs, key=lambda r: sum(r.values()))
        total = totals[form] = sum(best.values())
        print(f"results as {form.upper()}: best of {args.samples} runs "
              f"(totals {', '.join(f'{sum(r.values()):.2f}' for r in runs)} us/job)")  # fmt: skip
        for phase in PHASES:
            print(f"  {phase:<14} {best[phase]:6.3f} us/job  {best[phase] / total:6.1%}")
        print(f"  {'total':<14} {total:6.3f} us/job; the goal's budget for the whole broker {GOAL_US_PER_JOB} us/job: "
              f"{total / GOAL_US_PER_JOB:.2f}x of it before any socket, poll or loop")  # fmt: skip
    if len(totals) == 2 and "final" in totals:
        (other,) = set(totals) - {"final"}
        print(f"{other.upper()} / FINAL, total per job: {totals[other] / totals['final']:.2f}x")
    if args.json:
        print(json.dumps({form: {**best, "total": totals[form]} for form, best in bests.items()}))


if __name__ == "__main__":
    main()
