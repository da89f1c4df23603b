"""Running workers: one engine in this process, or one process per engine (``--gpus``).

``--gpus 0,1`` with tensor parallel 1 runs two engines (data parallel), each in its own
worker process that sees one GPU; with tensor parallel 2 it runs one engine over both.
Every engine is a separate worker to the broker, so "least loaded first" spreads jobs
across them. If any engine process fails, the others are stopped and the exit code is
passed up, so a supervisor (systemd, k8s) restarts the set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time

from zmq_rollout.config import WorkerConfig
from zmq_rollout.curve import PeerKeys
from zmq_rollout.gc_pauses import settle_heap
from zmq_rollout.settings import to_argv

GC_YOUNG_THRESHOLD = 20_000
"""New objects between two collections of the youngest generation in a worker's process (Python's
default: 700), as in the broker's (``broker/server.py``). vLLM's output processing, on the
worker's event loop, makes objects per request and token; at Python's default the collector's
full collections came every few seconds and walked every request's state: 0.97-1.54 s of each
17-20 s batch at the 7B shape, 256 sequences, on a worker that had one core to itself and used
all of it (benchmarks/README.md, gpu_e2e, twenty-eighth session)."""

log = logging.getLogger(__name__)

EXIT_ENGINE_START = 5
"""The engine did not start (the log names the likely cause); a restart will not fix it."""


def plan_engines(gpus: str, tensor_parallel_size: int) -> list[str]:
    """Split a GPU list into one ``CUDA_VISIBLE_DEVICES`` value per engine."""
    ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if not ids:
        return [""]
    tp = tensor_parallel_size
    if tp < 1 or len(ids) % tp:
        raise ValueError(f"{len(ids)} GPUs ({gpus}) cannot be split into engines of tensor_parallel_size={tp}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"GPU list {gpus!r} names a GPU twice")
    return [",".join(ids[i : i + tp]) for i in range(0, len(ids), tp)]


async def _serve(config: WorkerConfig) -> int:
    from .engine import Engine, EngineStartError
    from .generation import warm_up
    from .worker import Worker

    started = time.monotonic()
    try:
        engine = Engine(config)
    except EngineStartError as exc:
        log.error("%s", exc)
        return EXIT_ENGINE_START
    await warm_up(engine)
    # What start-up made (vLLM, torch, the model's Python objects) lives as long as the
    # process: frozen, the collector no longer walks it each time the objects a batch
    # makes (vLLM's outputs and logprobs, per request and token) set off a full collection
    # in the loop that also runs vLLM's output processing. vLLM's own server does the same
    # after its warm-up (vllm.utils.gc_utils.freeze_gc_heap). And fewer collections after that
    # (``GC_YOUNG_THRESHOLD``): each full one walks every request in flight.
    settle_heap(GC_YOUNG_THRESHOLD)
    log.info(
        "engine ready in %.1f s: %s (max_model_len=%d, max_num_seqs=%d)",
        time.monotonic() - started,
        config.model,
        engine.max_model_len,
        engine.max_num_seqs,
    )
    worker = Worker(config, engine)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    try:
        return await worker.run()
    finally:
        engine.shutdown()


def run_worker(config: WorkerConfig) -> int:
    """Run the worker(s) that ``config`` asks for; returns the process exit code. Bad key
    settings raise ConfigError here, before any engine starts."""
    PeerKeys.from_files(config.curve_server_key, config.curve_secret_key, "WorkerConfig")
    groups = plan_engines(config.gpus, config.tensor_parallel_size)
    if len(groups) == 1:
        if groups[0]:
            os.environ["CUDA_VISIBLE_DEVICES"] = groups[0]
        return asyncio.run(_serve(config))
    return _supervise(config, groups)


def _supervise(config: WorkerConfig, groups: list[str]) -> int:
    children = []
    for i, group in enumerate(groups):
        name = f"{config.name or 'worker'}-gpu{group.replace(',', '_')}"
        port = None if config.metrics_port is None else config.metrics_port + i
        child = dataclasses.replace(config, gpus=group, name=name, metrics_port=port)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=group)
        children.append(subprocess.Popen(worker_command(child), env=env))

    def forward_term(*_: object) -> None:
        for c in children:
            c.terminate()

    signal.signal(signal.SIGTERM, forward_term)
    code = 0
    try:
        while all(c.poll() is None for c in children):
            time.sleep(0.5)
        code = next(c.returncode for c in children if c.returncode is not None)
    finally:
        for c in children:
            if c.poll() is None:
                c.terminate()
        for c in children:
            c.wait()
    log.info("engine process exited with %d; stopped the others", code)
    return code


def worker_command(config: WorkerConfig) -> list[str]:
    """The command that runs one worker process with exactly ``config`` (every field given)."""
    return [sys.executable, "-m", "zmq_rollout.cli", "worker", *to_argv(config)]
