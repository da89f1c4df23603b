"""The ``zmq-rollout`` command line. Heavy modules (vLLM, torch) load late: ``--help`` is instant."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from zmq_rollout.config import BrokerConfig, WorkerConfig

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Rollout tier for RL post-training: broker, vLLM workers, client."
)


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@app.command()
def broker(
    frontend: str = typer.Option(BrokerConfig.frontend, help="Address clients connect to."),
    backend: str = typer.Option(BrokerConfig.backend, help="Address workers connect to."),
    metrics_port: Optional[int] = typer.Option(None, help="Port of the Prometheus /metrics endpoint."),  # noqa: UP045
    metrics_host: str = typer.Option(BrokerConfig.metrics_host, help="Interface of the /metrics endpoint."),
    heartbeat_interval: float = typer.Option(BrokerConfig.heartbeat_interval, help="Seconds between heartbeats."),
    worker_liveness: int = typer.Option(
        BrokerConfig.worker_liveness, help="Missed heartbeats before a worker is purged."
    ),
    client_expiry: float = typer.Option(
        BrokerConfig.client_expiry, help="Seconds of client silence before its jobs drop."
    ),
    max_queue_per_client: int = typer.Option(
        BrokerConfig.max_queue_per_client, help="Queued jobs per client before BUSY."
    ),
    max_queue_total: int = typer.Option(BrokerConfig.max_queue_total, help="Queued jobs in all before BUSY."),
    max_attempts: int = typer.Option(BrokerConfig.max_attempts, help="Workers a job may lose before it fails."),
    max_message_bytes: int = typer.Option(BrokerConfig.max_message_bytes, help="Largest client message accepted."),
    round_idle_timeout: float = typer.Option(
        BrokerConfig.round_idle_timeout, help="Seconds a sync round may wait for its trainer's next step."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Run the broker."""
    import signal

    from zmq_rollout.broker.server import Broker

    _logging(verbose)
    config = BrokerConfig(
        frontend=frontend,
        backend=backend,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        heartbeat_interval=heartbeat_interval,
        worker_liveness=worker_liveness,
        client_expiry=client_expiry,
        max_queue_per_client=max_queue_per_client,
        max_queue_total=max_queue_total,
        max_attempts=max_attempts,
        max_message_bytes=max_message_bytes,
        round_idle_timeout=round_idle_timeout,
    )
    b = Broker(config)
    signal.signal(signal.SIGTERM, lambda *_: b.stop())
    with contextlib.suppress(KeyboardInterrupt):
        b.run()


@app.command()
def worker(
    model: str = typer.Option(..., help="Local model folder."),
    broker: str = typer.Option(WorkerConfig.broker, help="The broker's backend address."),
    gpus: str = typer.Option("", help="GPU ids, e.g. 0,1 (empty: CPU)."),
    tensor_parallel_size: int = typer.Option(1, help="GPUs per engine."),
    max_num_seqs: int = typer.Option(WorkerConfig.max_num_seqs, help="Sequences per engine (= credits)."),
    max_model_len: int = typer.Option(WorkerConfig.max_model_len),
    gpu_memory_utilization: float = typer.Option(
        WorkerConfig.gpu_memory_utilization, help="On CPU: fraction of RAM for KV cache."
    ),
    dtype: str = typer.Option(WorkerConfig.dtype),
    enforce_eager: bool = typer.Option(True, help="Disable CUDA graphs / torch.compile."),
    attention_backend: Optional[str] = typer.Option(None, help="vLLM attention backend, e.g. TRITON_ATTN."),  # noqa: UP045
    name: str = typer.Option("", help="Worker name (default host-pid)."),
    seed: int = typer.Option(0),
    metrics_port: Optional[int] = typer.Option(None, help="Port of this worker's /metrics."),  # noqa: UP045
    enable_lora: bool = typer.Option(False, "--enable-lora", help="Serve LoRA adapters pushed by update_lora."),
    max_lora_rank: int = typer.Option(WorkerConfig.max_lora_rank, help="Largest adapter rank (8, 16, 32, ...)."),
    max_loras: int = typer.Option(WorkerConfig.max_loras, help="Adapters one batch may mix."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Run a worker around vLLM (one engine per GPU group)."""
    from zmq_rollout.workers.main import run_worker

    _logging(verbose)
    config = WorkerConfig(
        broker=broker,
        model=model,
        gpus=gpus,
        tensor_parallel_size=tensor_parallel_size,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        dtype=dtype,
        enforce_eager=enforce_eager,
        attention_backend=attention_backend,
        name=name,
        seed=seed,
        metrics_port=metrics_port,
        enable_lora=enable_lora,
        max_lora_rank=max_lora_rank,
        max_loras=max_loras,
    )
    raise typer.Exit(run_worker(config))


@app.command()
def generate(
    input: Path = typer.Option(..., "--input", "-i", help="JSONL: one {prompt|messages|prompt_token_ids} per line."),
    output: Path = typer.Option(..., "--output", "-o", help="JSONL: one rollout per line."),
    address: str = typer.Option("tcp://127.0.0.1:5555", help="The broker's frontend."),
    n: int = typer.Option(1),
    temperature: float = typer.Option(1.0),
    top_p: float = typer.Option(1.0),
    max_tokens: int = typer.Option(64),
    seed: Optional[int] = typer.Option(None),  # noqa: UP045
    timeout: float = typer.Option(600.0, help="Seconds to wait for all rollouts."),
) -> None:
    """Submit prompts from a JSONL file and write the rollouts to another."""
    import concurrent.futures
    import dataclasses

    from zmq_rollout import RolloutClient, SamplingParams

    prompts = []
    for lineno, line in enumerate(input.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        prompt = row.get("prompt", row.get("messages", row.get("prompt_token_ids")))
        if prompt is None:
            raise typer.BadParameter(f"{input}:{lineno}: needs prompt, messages or prompt_token_ids")
        prompts.append(prompt)
    sampling = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    with RolloutClient(address, timeout=timeout) as client, output.open("w") as out:
        futures = {client.submit(prompt, sampling): i for i, prompt in enumerate(prompts)}
        with typer.progressbar(length=len(futures), label="rollouts", file=sys.stderr) as bar:
            for future in concurrent.futures.as_completed(futures, timeout=timeout):
                for rollout in future.result():
                    rollout.prompt_index = futures[future]
                    out.write(json.dumps(dataclasses.asdict(rollout)) + "\n")
                bar.update(1)
    typer.echo(f"wrote {output}")


@app.command()
def status(address: str = typer.Option("tcp://127.0.0.1:5555", help="The broker's frontend.")) -> None:
    """Show the broker's workers and queues."""
    from zmq_rollout import RolloutClient

    with RolloutClient(address, request_timeout=5.0) as client:
        st = client.status()
    typer.echo(f"{'WORKER':<32} {'STATE':<6} {'CREDITS':>7} {'RUNNING':>7} {'VERSION':>7} {'IDLE_S':>7}  MODEL")
    for w in st.workers:
        typer.echo(
            f"{w.name:<32} {w.state:<6} {w.credits:>7} {w.in_flight:>7} {w.weight_version:>7} "
            f"{w.idle_seconds:>7.1f}  {w.model}"
        )
    typer.echo(f"\n{'CLIENT':<32} {'QUEUED':>7} {'RUNNING':>7}")
    for c in st.clients:
        typer.echo(f"{c.name:<32} {c.queued:>7} {c.running:>7}")
    typer.echo(f"\ntotal: {st.queued} queued, {st.running} running, {len(st.workers)} workers")


@app.command("make-tiny-model")
def make_tiny_model(path: Path, seed: int = typer.Option(0)) -> None:
    """Write a tiny random-weight Qwen2 with a byte-level tokenizer (for tests and the demo)."""
    from zmq_rollout.tiny_model import make_tiny_model as make

    typer.echo(f"wrote {make(path, seed=seed)}")


@app.command()
def demo(
    prompts: int = typer.Option(32, help="How many prompts."),
    n: int = typer.Option(2, help="Samples per prompt."),
    max_tokens: int = typer.Option(24),
    workers: int = typer.Option(1, help="CPU workers to start."),
) -> None:
    """Broker + CPU worker(s) + tiny model, a batch of rollouts, a summary, a clean shutdown."""
    from zmq_rollout.demo import run_demo

    _logging(False)
    raise typer.Exit(run_demo(num_prompts=prompts, n=n, max_tokens=max_tokens, num_workers=workers))


if __name__ == "__main__":
    app()
