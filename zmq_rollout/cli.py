"""The ``zmq-rollout`` command line. Heavy modules (vLLM, torch) load late: ``--help`` is instant."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import typer

from zmq_rollout.config import BrokerConfig, ClientConfig, WorkerConfig
from zmq_rollout.gateway.config import GatewayConfig
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
    with _errors_as_messages(verbose):
        b = Broker(config)  # binds: an address in use is a message, not a traceback
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
    from zmq_rollout.workers.main import plan_engines, run_worker

    try:
        plan_engines(config.gpus, config.tensor_parallel_size)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    _logging(verbose)
    with _errors_as_messages(verbose):  # a bad key file, say: one line, before any engine starts
        code = run_worker(config)
    raise typer.Exit(code)


PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")


def read_prompts(path: Path, sampling: Any) -> tuple[list[tuple[int, Any]], list[str]]:
    """``(line number, prompt)`` for each usable line of a JSONL file, and ``FILE:LINE: what is
    wrong`` for each other one; a prompt is usable if the client would accept it as a job."""
    from zmq_rollout.errors import InvalidRequestError
    from zmq_rollout.rollouts import make_job

    prompts, problems = [], []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        return [], [f"{path}: cannot read it: {exc}"]
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{where}: not JSON ({exc.msg} at column {exc.colno})")
            continue
        keys = [k for k in PROMPT_KEYS if isinstance(row, dict) and k in row]
        if len(keys) != 1:
            problems.append(f"{where}: needs an object with exactly one of {', '.join(PROMPT_KEYS)}")
            continue
        try:
            make_job("check", row[keys[0]], sampling)
        except InvalidRequestError as exc:
            problems.append(f"{where}: {keys[0]}: {exc}")
            continue
        prompts.append((lineno, row[keys[0]]))
    return prompts, problems


@contextlib.contextmanager
def _errors_as_messages(verbose: bool) -> Iterator[None]:
    """An error of ours (or of the OS or ZeroMQ) is one line on stderr and exit code 1;
    ``--verbose`` shows the traceback instead."""
    import zmq

    from zmq_rollout.errors import RolloutError

    try:
        yield
    except (RolloutError, OSError, zmq.ZMQError) as exc:
        if verbose:
            raise
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command()
@config_options(ClientConfig)
def generate(
    config: ClientConfig,
    input: Path = typer.Option(..., "--input", "-i", help="JSONL: one {prompt|messages|prompt_token_ids} per line."),
    output: Path = typer.Option(..., "--output", "-o", help="JSONL: one rollout per line, with the input's line."),
    n: int = typer.Option(1, help="Samples per prompt."),
    temperature: float = typer.Option(1.0),
    top_p: float = typer.Option(1.0),
    max_tokens: int = typer.Option(64),
    seed: Optional[int] = typer.Option(None),  # noqa: UP045
    skip_invalid: bool = typer.Option(
        False, "--skip-invalid", help="Go on without invalid lines (listed at the end) instead of stopping."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show tracebacks."),
) -> None:
    """Submit prompts from a JSONL file and write the rollouts to another.

    Every line is checked before anything is sent: with an invalid one the command lists them
    all (FILE:LINE: what is wrong) and exits 2, unless --skip-invalid.
    """
    import concurrent.futures

    from zmq_rollout import RolloutClient, SamplingParams

    try:
        sampling = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if not input.is_file():
        raise typer.BadParameter(f"{input} is not a file", param_hint="--input")
    prompts, problems = read_prompts(input, sampling)
    if problems and not skip_invalid:
        for problem in problems[:50]:
            typer.echo(problem, err=True)
        more = f" (and {len(problems) - 50} more)" if len(problems) > 50 else ""
        typer.echo(
            f"{len(problems)} invalid line(s){more}; nothing was sent (--skip-invalid goes on without them)", err=True
        )
        raise typer.Exit(2)
    written = 0
    with _errors_as_messages(verbose), RolloutClient(config=config) as client, output.open("w") as out:
        futures = {client.submit(prompt, sampling): (i, lineno) for i, (lineno, prompt) in enumerate(prompts)}
        with typer.progressbar(length=len(futures), label="rollouts", file=sys.stderr) as bar:
            for future in concurrent.futures.as_completed(futures):
                index, lineno = futures[future]
                for rollout in future.result():
                    rollout.prompt_index = index
                    out.write(json.dumps({"line": lineno, **dataclasses.asdict(rollout)}) + "\n")
                    written += 1
                bar.update(1)
    for problem in problems:
        typer.echo(f"skipped {problem}", err=True)
    typer.echo(
        f"wrote {written} rollouts of {len(prompts)} prompts to {output}"
        + (f"; skipped {len(problems)} invalid line(s)" if problems else "")
    )


@app.command()
@config_options(ClientConfig, skip=("timeout_s", "batch_size"))
def status(config: ClientConfig, verbose: bool = typer.Option(False, "--verbose", "-v")) -> None:
    """Show the broker's workers, queues and job totals."""
    from zmq_rollout import RolloutClient

    with _errors_as_messages(verbose), RolloutClient(config=config) as client:
        st = client.status()
        me = client.identity
    st.clients = [c for c in st.clients if c.name != me]  # not this command's own connection
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


@app.command()
@config_options(ClientConfig, skip=("timeout_s", "batch_size"))
def top(
    config: ClientConfig,
    interval: float = typer.Option(2.0, "--interval", min=0.1, help="Seconds between refreshes (and rate samples)."),
    metrics_url: str = typer.Option(
        "", "--metrics-url", help="The broker's /metrics (http://BROKER:9100/metrics): jobs/s, sync rounds."
    ),
    worker_metrics: Optional[list[str]] = typer.Option(  # noqa: UP045
        None, "--worker-metrics", help="A worker's /metrics (repeat it): tokens/s and KV-cache use per engine."
    ),
    once: bool = typer.Option(False, "--once", help="Print one table and exit (always so when not a terminal)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show tracebacks."),
) -> None:
    """A live view of workers, client queues, jobs/s and sync rounds; Ctrl-C ends it.

    With metrics URLs the one-shot table reads them twice, --interval apart, for its rates.
    """
    from zmq_rollout.top import run_top

    with _errors_as_messages(verbose):
        run_top(
            config,
            interval_s=interval,
            metrics_url=metrics_url,
            worker_metrics=worker_metrics or (),
            once=True if once else None,
        )


@app.command()
@config_options(GatewayConfig)
def gateway(config: GatewayConfig, verbose: bool = typer.Option(False, "--verbose", "-v")) -> None:
    """Serve the OpenAI API of `vllm serve` that RL frameworks call (/v1/completions,
    /v1/chat/completions, /v1/models, /health) over the broker (docs/integrations.md)."""
    from zmq_rollout.gateway.app import serve

    _logging(verbose)
    with _errors_as_messages(verbose):
        serve(config)


keys_app = typer.Typer(no_args_is_help=True, help="CurveZMQ keypairs for the broker, clients and workers.")
app.add_typer(keys_app, name="keys")


@keys_app.command("generate")
def keys_generate(
    directory: Path = typer.Argument(..., help="Folder to write NAME.key and NAME.key_secret into (created)."),
    name: str = typer.Option(..., "--name", help="File name of the pair, e.g. broker, trainer, gpu-node-1."),
) -> None:
    """Write a CurveZMQ keypair: NAME.key (public: give it to the broker's --allow-keys folder, or, for
    the broker's own pair, to clients and workers as --curve-server-key) and NAME.key_secret (keep it private)."""
    from zmq_rollout.curve import generate_keypair
    from zmq_rollout.errors import ConfigError

    try:
        public, secret = generate_keypair(directory, name)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {public} (public) and {secret} (secret, owner-only)")


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
