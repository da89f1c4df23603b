"""The ``zmq-rollout`` command line. Heavy modules (vLLM, torch) load late: ``--help`` is instant."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from zmq_rollout.config import BrokerConfig, ClientConfig, WorkerConfig
from zmq_rollout.settings import config_options

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Rollout tier for RL post-training: broker, vLLM workers, client."
)


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _print_config(config: object) -> None:
    typer.echo(json.dumps(dataclasses.asdict(config), indent=2))  # type: ignore[call-overload]


@app.command()
@config_options(BrokerConfig)
def broker(
    config: BrokerConfig,
    print_config: bool = typer.Option(False, "--print-config", help="Print the settings as JSON and exit."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Run the broker."""
    if print_config:
        _print_config(config)
        return
    import signal

    from zmq_rollout.broker.server import Broker

    _logging(verbose)
    b = Broker(config)
    signal.signal(signal.SIGTERM, lambda *_: b.stop())
    with contextlib.suppress(KeyboardInterrupt):
        b.run()


@app.command()
@config_options(WorkerConfig, required=("model",))
def worker(
    config: WorkerConfig,
    print_config: bool = typer.Option(False, "--print-config", help="Print the settings as JSON and exit."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Run a worker around vLLM (one engine per GPU group)."""
    if print_config:
        _print_config(config)
        return
    from zmq_rollout.workers.main import run_worker

    _logging(verbose)
    raise typer.Exit(run_worker(config))


@app.command()
@config_options(ClientConfig)
def generate(
    config: ClientConfig,
    input: Path = typer.Option(..., "--input", "-i", help="JSONL: one {prompt|messages|prompt_token_ids} per line."),
    output: Path = typer.Option(..., "--output", "-o", help="JSONL: one rollout per line."),
    n: int = typer.Option(1, help="Samples per prompt."),
    temperature: float = typer.Option(1.0),
    top_p: float = typer.Option(1.0),
    max_tokens: int = typer.Option(64),
    seed: Optional[int] = typer.Option(None),  # noqa: UP045
) -> None:
    """Submit prompts from a JSONL file and write the rollouts to another."""
    import concurrent.futures

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
    with RolloutClient(config=config) as client, output.open("w") as out:
        futures = {client.submit(prompt, sampling): i for i, prompt in enumerate(prompts)}
        with typer.progressbar(length=len(futures), label="rollouts", file=sys.stderr) as bar:
            for future in concurrent.futures.as_completed(futures):
                for rollout in future.result():
                    rollout.prompt_index = futures[future]
                    out.write(json.dumps(dataclasses.asdict(rollout)) + "\n")
                bar.update(1)
    typer.echo(f"wrote {output}")


@app.command()
@config_options(ClientConfig, skip=("timeout_s", "batch_size"))
def status(config: ClientConfig) -> None:
    """Show the broker's workers, queues and job totals."""
    from zmq_rollout import RolloutClient

    with RolloutClient(config=config) as client:
        st = client.status()
    typer.echo(f"{'WORKER':<32} {'STATE':<7} {'CREDITS':>7} {'RUNNING':>7} {'VERSION':>7} {'IDLE_S':>7}  MODEL")
    for w in st.workers:
        typer.echo(
            f"{w.name:<32} {w.state:<7} {w.credits:>7} {w.running:>7} {w.weight_version:>7} {w.idle_s:>7.1f}  {w.model}"
        )
    typer.echo(f"\n{'CLIENT':<32} {'QUEUED':>7} {'RUNNING':>7}")
    for c in st.clients:
        typer.echo(f"{c.name:<32} {c.queued:>7} {c.running:>7}")
    t = st.totals
    typer.echo(
        f"\nnow: {st.queued} queued, {st.running} running, {len(st.workers)} workers, fleet version {st.fleet_version}"
        f"\nsince start: {t.submitted} submitted, {t.completed} completed, {t.failed} failed, "
        f"{t.cancelled} cancelled, {t.requeued} requeued"
    )


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
