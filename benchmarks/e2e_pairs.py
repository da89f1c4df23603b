"""Interleaved pairs for ``gpu_e2e.py --phases pairs``: direct ``AsyncLLM`` and the service, both alive.

One process holds both: the service (``LocalCluster``: a broker thread, or with
``--broker-process`` a broker process of its own, and one worker process, at the same
priority as this one) and a direct ``AsyncLLM`` built with exactly the
worker's engine arguments, each with its share of the GPU (``--gpu-memory-utilization``,
``--kv-cache-gib``). Start-up and CUDA-graph capture are paid once; then each pair runs the
same batch (prompts, per-prompt seeds) on one side and then on the other, the order
alternating from pair to pair, so neither side profits from going first and both see the
same machine within seconds of each other.

Each batch also records the CPU seconds of every process it touches (``Cpu``): this process
(the client, or the direct ``AsyncLLM``'s front end: never both at once) without the broker
thread, the broker (its thread or its process), the worker process, the worker's engine core and the direct
engine core. The idle side's figures show what sleeping costs; the busy side's, where the
time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import stack_samples
from gpu_e2e import batches, log, sampling, summarize, worker_config, worker_overrides
from ports import free_port

from zmq_rollout.gc_pauses import GENERATIONS, GcClock, process_clock
from zmq_rollout.scrape import fetch_metrics


def _cpu(proc: psutil.Process) -> float:
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def gc_seconds(here: GcClock, worker_metrics_port: int) -> dict[str, float]:
    """Seconds of Python garbage collection so far, by process and generation: this process's
    (``here``) and the worker's (its ``zmq_rollout_worker_gc_seconds_total``; absent if unread)."""
    out = {f"here_gen{g}": here.seconds[g] for g in GENERATIONS}
    scrape = fetch_metrics(f"http://127.0.0.1:{worker_metrics_port}/metrics", 5.0)
    for labels, value in scrape.find("zmq_rollout_worker_gc_seconds_total"):
        out[f"worker_gen{labels['generation']}"] = value
    return out


class Cpu:
    """CPU seconds used so far by each part of the run, by name (``snapshot``)."""

    def __init__(self, worker_pid: int, broker: threading.Thread | int) -> None:
        """``broker``: the broker's thread in this process, or its own process's pid."""
        self.me = psutil.Process()
        self.worker = psutil.Process(worker_pid)
        self.broker_tid = broker.native_id if isinstance(broker, threading.Thread) else None
        self.broker_proc = None if isinstance(broker, threading.Thread) else psutil.Process(broker)

    def snapshot(self) -> dict[str, float]:
        if self.broker_proc is not None:
            broker, broker_thread = _cpu(self.broker_proc), 0.0
        else:
            broker = broker_thread = next(
                (t.user_time + t.system_time for t in self.me.threads() if t.id == self.broker_tid), 0.0
            )
        try:
            worker_tree = {self.worker.pid, *(c.pid for c in self.worker.children(recursive=True))}
            if self.broker_proc is not None:
                worker_tree.add(self.broker_proc.pid)  # not the direct engine's
            mine = self.me.children(recursive=True)
            worker_kids = self.worker.children(recursive=True)
        except psutil.Error:
            worker_tree, mine, worker_kids = set(), [], []
        return {
            "client_or_direct_frontend": _cpu(self.me) - broker_thread,
            "broker": broker,
            "worker": _cpu(self.worker),
            "worker_engine_core": sum(_cpu(c) for c in worker_kids),
            "direct_engine_core": sum(_cpu(c) for c in mine if c.pid not in worker_tree),
        }

    @staticmethod
    def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {k: round(after[k] - before.get(k, 0.0), 3) for k in after}


def identical(a: list[list[int]], b: list[list[int]]) -> int:
    """How many of two batches' token sequences (the first sample of each prompt, in order) match
    exactly."""
    return sum(x == y for x, y in zip(a, b, strict=True))


def identity_line(pairs: list[dict[str, Any]], prompts: int) -> str:
    """Identical sequences per pair: service against direct, and, where ``direct_frozen`` ran, the
    control: direct against direct_frozen, one engine with the same prompts and seeds in batches
    scheduled apart. A control as low as the service's says the differences are the engine's
    (sampling at temperature 1 on batches made up differently), not the service's."""
    service = ", ".join(str(pr["identical_sequences"]) for pr in pairs)
    line = f"identical sequences of {prompts}: service vs direct {service}"
    if pairs and all("identical_direct_frozen" in pr for pr in pairs):
        line += "; direct vs direct_frozen (control) " + ", ".join(str(pr["identical_direct_frozen"]) for pr in pairs)
    return line


def physical_cores() -> list[list[int]]:
    """Logical CPUs grouped by physical core (SMT siblings together), among those we may use."""
    allowed = sorted(os.sched_getaffinity(0))
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in allowed:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            key = (Path(f"{base}/physical_package_id").read_text().strip(), Path(f"{base}/core_id").read_text().strip())
        except OSError:
            key = ("?", str(cpu))
        cores.setdefault(key, []).append(cpu)
    return sorted(cores.values())


def pin(pid: int, cpus: list[int]) -> None:
    """Every thread of ``pid`` (threads started later inherit it) onto ``cpus``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


def core_groups(cores: list[list[int]], swap: bool = False) -> list[list[int]]:
    """Four groups of whole physical cores, in ``pin_all``'s order: this process, direct's engine
    core, the worker, the worker's engine core. ``swap``: the service's two groups and direct's
    trade places. An empty group where there are fewer than four cores."""
    share = max(1, len(cores) // 4)
    groups = [sorted(c for core in cores[i * share : (i + 1) * share] for c in core) for i in range(4)]
    return groups[2:] + groups[:2] if swap else groups


def pin_all(cpu: Cpu, swap: bool = False) -> dict[str, list[int]]:
    """This process, the worker, and each engine core on physical cores of their own (all
    their SMT siblings, and no other process's), as many each as there are for four
    (``core_groups``; ``swap``: the service's and direct's trade cores)."""
    groups = core_groups(physical_cores(), swap)
    if not all(groups):
        return {}
    worker_kids = cpu.worker.children(recursive=True)
    broker = [] if cpu.broker_proc is None else [cpu.broker_proc.pid]
    worker_tree = {cpu.worker.pid, *(c.pid for c in worker_kids), *broker}
    direct_kids = [c for c in cpu.me.children(recursive=True) if c.pid not in worker_tree]
    plan = {"this process (client, broker, direct front end)": ([cpu.me.pid, *broker], groups[0]),
            "direct engine core": ([c.pid for c in direct_kids], groups[1]),
            "worker": ([cpu.worker.pid], groups[2]),
            "worker engine core": ([c.pid for c in worker_kids], groups[3])}  # fmt: skip
    for pids, cpus in plan.values():
        for pid in pids:
            pin(pid, cpus)
    return {name: cpus for name, (_, cpus) in plan.items()}


async def run_pairs(args: argparse.Namespace) -> dict[str, Any]:
    import vllm
    from vllm.v1.engine.async_llm import AsyncLLM

    from zmq_rollout.client import AsyncRolloutClient, make_job
    from zmq_rollout.local import LocalCluster
    from zmq_rollout.workers.engine import engine_args
    from zmq_rollout.workers.sampling import vllm_sampling

    cfg = worker_config(args)
    overrides = {**worker_overrides(cfg), "metrics_port": free_port(), "vllm_metrics": args.vllm_metrics}
    gc_here = process_clock()  # this process: the client, the broker thread and the direct front end
    os.makedirs(args.log_dir, exist_ok=True)
    cluster = LocalCluster(args.model, num_workers=1, worker_overrides=overrides, log_dir=args.log_dir,
                           worker_niceness=0, broker_process=args.broker_process)  # fmt: skip
    deadline = time.monotonic() + args.phase_timeout - 30  # stop early, cleanly, rather than be killed
    started = time.monotonic()
    cluster.start(wait_s=args.start_timeout)
    service_startup = time.monotonic() - started
    where = "its own process" if args.broker_process else "a thread of this process"
    log(f"pairs: service up in {service_startup:.1f} s ({overrides}); the broker in {where}")
    llm = None
    try:
        started = time.monotonic()
        llm = AsyncLLM.from_engine_args(engine_args(cfg))
        direct_startup = time.monotonic() - started
        log(f"pairs: direct AsyncLLM up in {direct_startup:.1f} s (vLLM {vllm.__version__})")
        if cluster.broker is not None:
            cpu = Cpu(cluster.workers["worker-0"].pid, cluster.broker._thread)
        else:
            assert cluster.broker_proc is not None
            cpu = Cpu(cluster.workers["worker-0"].pid, cluster.broker_proc.pid)
        pinned = pin_all(cpu, args.pin_swap) if args.pin else {}
        log(f"pairs: pinned {pinned}" if pinned else "pairs: not pinned")
        work = batches(args)
        async with AsyncRolloutClient(cluster.address, timeout_s=args.batch_timeout,
                                      batch_size=max(512, args.num_prompts)) as client:  # fmt: skip

            async def direct(label: str, prompts: list[list[int]], seeds: list[int], max_tokens: int) -> list[Any]:
                async def one(i: int, ids: list[int], seed: int) -> list[int]:
                    params = vllm_sampling(sampling(args, seed, max_tokens), stream=False)
                    final = None
                    async for out in llm.generate({"prompt_token_ids": ids}, params, f"d-{label}-{i}"):
                        final = out
                    assert final is not None and final.finished
                    return list(final.outputs[0].token_ids)

                return await asyncio.gather(
                    *(one(i, ids, s) for i, (ids, s) in enumerate(zip(prompts, seeds, strict=True)))
                )

            async def service(label: str, prompts: list[list[int]], seeds: list[int], max_tokens: int) -> list[Any]:
                jobs = [make_job(f"s-{label}-{i}", ids, sampling(args, seed, max_tokens))
                        for i, (ids, seed) in enumerate(zip(prompts, seeds, strict=True))]  # fmt: skip
                handles = await client.submit_jobs(jobs)
                results = await asyncio.wait_for(asyncio.gather(*(h.future for h in handles)), args.batch_timeout)
                return [list(r.samples[0].token_ids) for r in results]

            # direct_frozen: ``direct`` with this process's heap frozen for the batch, as the
            # worker's is; ``measure`` freezes it before the clock starts (the collection that
            # comes first is not the batch's), and collects once more after it has unfrozen it:
            # the unfrozen heap is all in the oldest generation, and the full collection it soon
            # triggers (0.31 s with the 7B shape's direct AsyncLLM in this process) fell in the
            # next side's batch, the service's: the client and the broker thread live here.
            every = {"direct": direct, "service": service, "direct_frozen": direct}
            sides = {name: every[name] for name in args.sides.split(",")}
            assert list(sides)[:2] == ["direct", "service"], "--sides starts with direct,service"

            async def measure(side: str, label: str, prompts: Any, seeds: Any, max_tokens: int) -> dict[str, Any]:
                frozen = side == "direct_frozen"
                if frozen:
                    gc.collect()
                    gc.freeze()
                before, gc_before = cpu.snapshot(), gc_seconds(gc_here, overrides["metrics_port"])
                # --py-spy: the process that serves this side (the worker, or this one's front end)
                profile = os.path.join(args.log_dir, f"profile-{side}-{label.replace(' ', '_')}.txt")
                with stack_samples.sampled(args.py_spy, cpu.worker.pid if side == "service" else os.getpid(), profile):
                    t0 = time.perf_counter()
                    try:
                        tokens = await sides[side](label, prompts, seeds, max_tokens)
                    finally:
                        wall = time.perf_counter() - t0
                        if frozen:
                            gc.unfreeze()
                if args.py_spy and os.path.exists(profile):
                    summary = stack_samples.summarize(profile, top=12)
                    for line in stack_samples.report(f"py-spy, {side} {label}", summary):
                        log(line)
                row = summarize(f"{side} {label}", sum(map(len, tokens)), wall, len(prompts) * max_tokens)
                row["cpu_s"] = Cpu.delta(before, cpu.snapshot())
                row["gc_s"] = Cpu.delta(gc_before, gc_seconds(gc_here, overrides["metrics_port"]))
                row["side"] = side
                row["first_tokens"] = tokens
                log("    cpu s: " + ", ".join(f"{k} {v:.2f}" for k, v in row["cpu_s"].items()))
                log("    gc s: " + ", ".join(f"{k} {v:.3f}" for k, v in row["gc_s"].items()))
                if frozen:  # the full collection that unfreezing a heap invites, here, not in the next side's batch
                    gc.collect()
                return row

            warm, *measured = work
            for side in sides:  # each side warms up once (and again between pairs, never)
                await measure(side, *warm)
            pairs: list[dict[str, Any]] = []
            for k, batch in enumerate(measured):
                last = sum(r["wall_s"] for r in pairs[-1].values() if isinstance(r, dict)) if pairs else 0.0
                if time.monotonic() + 1.5 * last > deadline:
                    log(f"pairs: stopping after {k} pairs, before the phase's time runs out")
                    break
                names = list(sides)
                order = tuple(names[k % len(names) :] + names[: k % len(names)])
                if len(names) == 2 and k % 2:
                    order = ("service", "direct")
                rows = {side: await measure(side, *batch) for side in order}
                firsts = {side: row.pop("first_tokens") for side, row in rows.items()}
                same = identical(firsts["direct"], firsts["service"])
                ratio = rows["service"]["tokens_per_s"] / rows["direct"]["tokens_per_s"]
                control: dict[str, int] = {}
                if "direct_frozen" in rows:
                    frozen = rows["direct_frozen"]["tokens_per_s"] / rows["direct"]["tokens_per_s"]
                    # The control: the same engine, seeds and prompts, batches scheduled apart.
                    control["identical_direct_frozen"] = identical(firsts["direct"], firsts["direct_frozen"])
                    log(
                        f"  pair {k + 1}: direct with its heap frozen / direct {frozen:.2%}; identical sequences "
                        f"direct vs direct_frozen (one engine) {control['identical_direct_frozen']}/{len(batch[1])}"
                    )
                log(f"  pair {k + 1} ({' then '.join(order)}): service/direct {ratio:.2%}; "
                    f"identical sequences {same}/{len(batch[1])}")  # fmt: skip
                pairs.append({"pair": k + 1, "order": list(order), "ratio": round(ratio, 4),
                              "identical_sequences": same, **control, **rows})  # fmt: skip
    finally:
        if llm is not None:
            llm.shutdown()
        cluster.stop()
    ratios = [pr["ratio"] for pr in pairs]
    return {"vllm_version": vllm.__version__, "service_startup_s": round(service_startup, 1), "pinned": pinned,
            "direct_startup_s": round(direct_startup, 1), "pairs": pairs, "prompts": args.num_prompts,
            "ratio_min": min(ratios), "ratio_median": round(statistics.median(ratios), 4),
            "pairs_at_goal": sum(r >= 0.98 for r in ratios)}  # fmt: skip


def report(data: dict[str, Any]) -> None:
    """The pairs as a table: tok/s of each side, the ratio, and CPU seconds per process."""
    print()
    print(f"{'pair':>4} {'order':>16} {'direct tok/s':>13} {'service tok/s':>14} {'ratio':>7}   "
          "CPU s, direct batch | service batch: frontend/client, broker, worker, its core, direct core; "
          "GC s: direct's front end | the worker")  # fmt: skip
    for pr in data["pairs"]:
        d, s = pr["direct"], pr["service"]
        cpu = " | ".join(" ".join(f"{v:.1f}" for v in row["cpu_s"].values()) for row in (d, s))
        order = ">".join(x[0] for x in pr["order"])
        gc_s = f"{sum(v for k, v in d['gc_s'].items() if k.startswith('here')):.2f} | " + (
            f"{sum(v for k, v in s['gc_s'].items() if k.startswith('worker')):.2f}"
        )
        print(f"{pr['pair']:>4} {order:>16} {d['tokens_per_s']:>13,.0f} {s['tokens_per_s']:>14,.0f} "
              f"{pr['ratio']:>7.2%}   {cpu}; GC {gc_s}")  # fmt: skip
    if data["pairs"]:
        print(identity_line(data["pairs"], data["prompts"]))
    verdict = "MET" if data["pairs_at_goal"] == len(data["pairs"]) and len(data["pairs"]) >= 3 else "NOT MET"
    print(f"ratio service/direct: min {data['ratio_min']:.2%}, median {data['ratio_median']:.2%}; "
          f"{data['pairs_at_goal']}/{len(data['pairs'])} pairs >= 98% -> goal {verdict}")  # fmt: skip
