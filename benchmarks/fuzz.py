"""Hostile input at both of the broker's ports and at a real worker's port: does everything stay up?

    python benchmarks/fuzz.py                                  # 100,000 messages at the broker, 20,000 at a worker
    python benchmarks/fuzz.py --frames 10000 --worker-frames 0  # broker only, about a minute
    python benchmarks/fuzz.py --seed 7                         # another seed (a seed replays a run)

Broker phase. The broker runs in its own process (the product's ``Broker`` loop, so its
resident memory is its own); two echo worker doubles (``zmq_rollout.testing``) and a good
``RolloutClient`` run in this one. ``Hammer``s (``zmq_rollout.fuzz_peers``) send ``--frames``
messages from seeded ``Fuzzer``s (``zmq_rollout.fuzzing``), half to each port, 4 DEALERs per
port replaced every 250 messages; before each round of 1,000 the good client submits 8
prompts (n=2), and at the end every job must have come back once, with the doubles' echo.
The broker's ``max_message_bytes`` is 1 MiB (``--max-message-bytes``), so that oversize
messages (1 MiB + 1 and 3 MiB, past ZeroMQ's hard limit of twice that) stay cheap. Its
malformed counters are read from its ``/metrics``; its RSS from ``/proc`` after a warm-up of
1,000 messages per port, at the end, and once it has forgotten every fuzz peer (fuzz workers
expire after 5 s, fuzz clients after ``client_expiry_s`` = 5 s).

Worker phase (``--worker-frames``, 0 skips it). A real worker (``zmq-rollout worker``,
vLLM on the CPU, the tiny random model) connects to a ``FakeBroker``; a seeded job runs
before and after the fuzz and must give the same samples; rounds of 1,000 messages end when
the worker has read them all (``FakeBroker.settle``), so messages/s there is what the worker
processed. Its malformed counter is read from its ``/metrics``.

Prints a table and one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from typing import Any

from ports import free_port

from zmq_rollout import SamplingParams
from zmq_rollout import protocol as p
from zmq_rollout.blocking import RolloutClient
from zmq_rollout.config import BrokerConfig, WorkerConfig
from zmq_rollout.fuzz_peers import FakeBroker, Hammer, rss_bytes
from zmq_rollout.fuzzing import Fuzzer
from zmq_rollout.testing import EchoWorkerDouble

MIB = 1 << 20
ROUND = 1000  # messages per port between the good client's submissions


def metrics(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def malformed(port: int) -> dict[str, int]:
    prefix = "zmq_rollout_malformed_messages_total{"
    return {k[len(prefix) : -1]: int(v) for k, v in metrics(port).items() if k.startswith(prefix)}


def wait_for(predicate: Any, timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    """Seconds until ``predicate()``; raises after ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"no {what} within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - start


def serve_broker(settings: dict[str, Any]) -> None:
    """The broker process: the product's loop, stopped by SIGTERM."""
    from zmq_rollout.broker.server import Broker

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.ERROR)  # one warning per bad message otherwise
    broker = Broker(BrokerConfig(**settings))
    signal.signal(signal.SIGTERM, lambda *_: broker.stop())
    broker.run()


def broker_phase(args: argparse.Namespace) -> dict[str, Any]:
    front_addr, back_addr = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    metrics_port = free_port()
    settings = {
        "frontend": front_addr,
        "backend": back_addr,
        "heartbeat_interval_s": 0.5,
        "worker_liveness": 10,
        "client_expiry_s": 5.0,
        "max_message_bytes": args.max_message_bytes,
        "metrics_port": metrics_port,
        "metrics_host": "127.0.0.1",
    }
    env = os.environ.copy()
    if args.malloc_mmap_threshold:  # glibc reads it at start: set for the child only
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    proc = mp.get_context("spawn").Process(target=serve_broker, args=(settings,), daemon=True)
    proc.start()
    os.environ.clear()
    os.environ.update(env)
    doubles = [EchoWorkerDouble(back_addr, credits=16, heartbeat=0.1).start() for _ in range(2)]
    client = RolloutClient(front_addr, timeout_s=600)
    hammers: list[Hammer] = []
    try:
        wait_for(lambda: len(client.status().workers) == 2, 60, "registered doubles")
        mm = args.max_message_bytes
        front = Hammer(front_addr, Fuzzer("frontend", args.seed, oversize_bytes=(mm + 1, 3 * mm)), max_message_bytes=mm)
        back = Hammer(back_addr, Fuzzer("backend", args.seed))
        hammers = [front, back]
        per_port = args.frames // 2
        front.run(ROUND)  # warm-up: the allocator's arenas, the decoders, the fuzz peers
        back.run(ROUND)
        rss_before = rss_bytes(proc.pid)
        rss_curve = []  # after each tenth of the run
        sampling = SamplingParams(n=2, max_tokens=4)
        prompts: list[list[int]] = []
        futures = []
        started = time.monotonic()
        while front.sent < per_port or back.sent < per_port:
            for _ in range(8):
                prompts.append([7000 + len(prompts), 3, 1 + len(prompts) % 7])
                futures.append(client.submit(prompts[-1], sampling))
            front.run(min(ROUND, per_port - front.sent))
            back.run(min(ROUND, per_port - back.sent))
            if not args.unpaced:  # the broker has read the round: its backend counted every bad message
                wait_for(lambda: malformed(metrics_port).get("worker", 0) == back.rejected, 120, "the round read", 0.01)
            if not proc.is_alive():
                raise RuntimeError(f"the broker exited with {proc.exitcode} (seed {args.seed})")
            if len(rss_curve) < 10 * front.sent // per_port:
                rss_curve.append(round(rss_bytes(proc.pid) / MIB, 1))
        sent_s = time.monotonic() - started
        # The broker has read everything once every bad worker message is counted.
        caught_up = wait_for(lambda: malformed(metrics_port).get("worker", 0) == back.rejected, 120, "catch-up")
        rss_after = rss_bytes(proc.pid)
        good = check_good_jobs(prompts, futures, doubles)
        for h in hammers:
            h.drain()
            h.close()
        names = {d.name for d in doubles}

        def forgotten() -> bool:
            status = client.status()
            clients = {c.name for c in status.clients}
            return {w.name for w in status.workers} == names and clients <= {client.identity}

        wait_for(forgotten, 60, "the broker to forget every fuzz peer")
        rss_idle = rss_bytes(proc.pid)
        counts = malformed(metrics_port)
        alive = proc.is_alive()
    finally:
        client.close()
        for d in doubles:
            d.stop()
        proc.terminate()
        proc.join(10)
    elapsed = sent_s + caught_up
    ports = {}
    for name, h in (("frontend", front), ("backend", back)):
        ports[name] = {
            "messages": h.sent,
            "frames": h.frames,
            "bytes": h.bytes,
            "messages_per_s": round((h.sent - ROUND) * 2 / elapsed),  # both ports shared the time
            "rejected": h.rejected,
            "over_zmq_limit": h.over_hard_limit,
            "replies": dict(h.replies),
            "undecodable_replies": h.undecodable,
            "strategies": dict(h.fuzzer.counts),
            "tamed": h.fuzzer.tamed,
        }
    from_clients = sum(counts.get(r, 0) for r in ("invalid", "invalid_job", "oversize"))
    return {
        "ports": ports,
        "seconds": round(elapsed, 2),
        "broker_alive": alive,
        "broker_rss_mib": {
            "before": round(rss_before / MIB, 1),
            "after": round(rss_after / MIB, 1),
            "each_tenth": rss_curve,
            "idle": round(rss_idle / MIB, 1),
        },
        "malloc_mmap_threshold": args.malloc_mmap_threshold,
        "paced": not args.unpaced,
        "malformed": counts,
        "malformed_from_clients": from_clients,
        "good_jobs": good,
    }


def check_good_jobs(prompts: list[list[int]], futures: list[Any], doubles: list[EchoWorkerDouble]) -> dict[str, int]:
    """Every good job: once, whole and right (the doubles echo the prompt's first 4 ids)."""
    names = {d.name for d in doubles}
    completed = wrong = lost = 0
    job_ids = []
    for prompt, future in zip(prompts, futures, strict=True):
        try:
            rollouts = future.result(timeout=120)
        except Exception:  # a lost job is a figure here
            lost += 1
            continue
        job_ids.append(rollouts[0].job_id)
        ok = [r.index for r in rollouts] == [0, 1] and all(
            (r.prompt_token_ids, r.token_ids, r.finish_reason) == (prompt, prompt[:4], "length")
            and r.worker_id in names
            for r in rollouts
        )
        completed += ok
        wrong += not ok
    runs = Counter(a.job.job_id for d in doubles for a in d.received)
    return {
        "submitted": len(futures),
        "completed": completed,
        "wrong": wrong,
        "lost": lost,
        "ran_twice": sum(runs[j] > 1 for j in job_ids),
    }


def worker_phase(args: argparse.Namespace) -> dict[str, Any]:
    from zmq_rollout.tiny_model import make_tiny_model
    from zmq_rollout.workers.main import worker_command

    tmp = tempfile.mkdtemp(prefix="zr-fuzz-")
    model = str(make_tiny_model(os.path.join(tmp, "tiny")))
    fake = FakeBroker()
    port = free_port()
    config = WorkerConfig(
        broker=fake.address, model=model, name="fuzzed", max_num_seqs=8, max_model_len=256, kv_cache_gib=0.25,
        metrics_port=port,
    )  # fmt: skip
    with open(os.path.join(tmp, "worker.log"), "wb") as log:
        proc = subprocess.Popen(worker_command(config), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    job = p.JobSpec("ref", p.SamplingParams(n=2, seed=5, max_tokens=8, ignore_eos=True), prompt_token_ids=[5, 6, 7, 8])
    fuzzer = Fuzzer("worker", args.seed)
    try:
        fake.wait_ready(600)
        before = fake.run_job(p.Assignment(1, job), 300)
        rss_before = rss_bytes(proc.pid)
        started = time.monotonic()
        while fake.sent < args.worker_frames:
            fake.fuzz(fuzzer, min(ROUND, args.worker_frames - fake.sent))
            fake.settle(120)
            if proc.poll() is not None:
                raise RuntimeError(f"the worker exited with {proc.returncode} (seed {args.seed}); log in {tmp}")
        seconds = time.monotonic() - started
        rss_after = rss_bytes(proc.pid)
        after = fake.run_job(p.Assignment(2, job), 300)
        counted = int(metrics(port)["zmq_rollout_worker_malformed_messages_total"])
        probes = fake.probes
        same = (
            isinstance(before, p.Result)
            and isinstance(after, p.Result)
            and [s.token_ids for s in after.samples] == [s.token_ids for s in before.samples]
        )
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        fake.close()
    return {
        "messages": fake.sent,
        "frames": fake.frames,
        "bytes": fake.bytes,
        "messages_per_s": round(fake.sent / seconds),
        "rejected": fake.rejected,
        "malformed_counted": counted - probes,
        "reconnects": fake.readies - 1,
        "replies": dict(fake.replies),
        "undecodable_replies": fake.undecodable,
        "strategies": dict(fuzzer.counts),
        "tamed": fuzzer.tamed,
        "rss_mib": {"before": round(rss_before / MIB, 1), "after": round(rss_after / MIB, 1)},
        "job_after_fuzz_identical": same,
        "answers_per_job": [fake.answers[1], fake.answers[2]],
        "exit_code_on_sigterm": exit_code,
    }


def report(result: dict[str, Any]) -> None:
    print(f"\nseed {result['seed']}")
    print(f"{'port':10} {'messages':>9} {'frames':>9} {'MB':>7} {'msg/s':>7} {'bad':>8} {'counted':>8}")
    rows = []
    if "broker" in result:
        b = result["broker"]
        for name, counted in (("frontend", b["malformed_from_clients"]), ("backend", b["malformed"].get("worker", 0))):
            rows.append((name, b["ports"][name], counted))
    if "worker" in result:
        rows.append(("worker", result["worker"], result["worker"]["malformed_counted"]))
    for name, r, counted in rows:
        mb, rate = r["bytes"] / 1e6, r["messages_per_s"]
        print(f"{name:10} {r['messages']:9,} {r['frames']:9,} {mb:7.1f} {rate:7,} {r['rejected']:8,} {counted:8,}")
    if "broker" in result:
        b = result["broker"]
        rss, g = b["broker_rss_mib"], b["good_jobs"]
        print(
            f"broker: alive {b['broker_alive']}; RSS {rss['before']} MiB after warm-up, {rss['after']} MiB after, "
            f"{rss['idle']} MiB once the fuzz peers were gone; after each tenth: {rss['each_tenth']}"
        )
        print(f"broker malformed counters: {b['malformed']}")
        print(
            f"good client: {g['submitted']} jobs, {g['completed']} completed correctly, {g['wrong']} wrong, "
            f"{g['lost']} lost, {g['ran_twice']} ran twice"
        )
    if "worker" in result:
        w = result["worker"]
        print(
            f"worker: RSS {w['rss_mib']['before']} -> {w['rss_mib']['after']} MiB; {w['reconnects']} reconnects; "
            f"job after the fuzz identical: {w['job_after_fuzz_identical']}; "
            f"exit code on SIGTERM {w['exit_code_on_sigterm']}"
        )
    print("(bad: messages the receiver's decoder rejects, or over max_message_bytes; counted: its malformed counters)")
    if "broker" in result:
        n = result["broker"]["ports"]["frontend"]["over_zmq_limit"]
        print(f"({n} frontend messages were past ZeroMQ's MAXMSGSIZE: dropped with their connection, unseen)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=100_000, help="messages at the broker, half to each port")
    ap.add_argument("--worker-frames", type=int, default=20_000, help="messages at a real worker (0: skip)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-message-bytes", type=int, default=MIB, help="the broker's max_message_bytes")
    ap.add_argument(
        "--unpaced",
        action="store_true",
        help="do not wait for the broker to read each round: RSS then includes what waits unread in ZeroMQ",
    )
    ap.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=0,
        help="glibc's MALLOC_MMAP_THRESHOLD_ for the broker process (0: glibc's dynamic default)",
    )
    args = ap.parse_args()
    result: dict[str, Any] = {"seed": args.seed}
    if args.frames:
        result["broker"] = broker_phase(args)
    if args.worker_frames:
        result["worker"] = worker_phase(args)
    report(result)
    print("RESULT " + json.dumps(result, separators=(",", ":")), flush=True)
    broker = result.get("broker", {})
    worker = result.get("worker", {})
    good = broker.get("good_jobs", {})
    failed = (broker and (not broker["broker_alive"] or good["lost"] or good["wrong"] or good["ran_twice"])) or (
        worker and (not worker["job_after_fuzz_identical"] or worker["exit_code_on_sigterm"] != 0)
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
