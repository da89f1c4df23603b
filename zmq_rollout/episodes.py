"""Multi-turn episodes: exact token trajectories between a policy and an environment.

    trajectories = await run_episodes(client, "calculator", samples, SamplingParams(max_tokens=128),
                                      tokenizer=tokenizer, n=8, max_turns=4)

Each turn is one job whose prompt is the previous turn's prompt ids, the ids the model
generated, and the ids of what came after (``chat_tokens.ChatTokens``): nothing is ever
re-tokenized from text, so the trainer's tokens are the tokens the model saw. The jobs of
one episode share a ``session_id``, so the broker sends each turn to the worker that holds
the episode's prefix in its cache. docs/multi_turn.md has the whole story.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec

from zmq_rollout import protocol as p
from zmq_rollout.chat_tokens import ChatTokens
from zmq_rollout.config import ClientConfig
from zmq_rollout.env_hosts import EnvironmentLost, EnvSpec, LocalEnvs, ProcessEnvs
from zmq_rollout.environments import Action, Message, Observation, parse_tool_calls
from zmq_rollout.environments.registry import Factory
from zmq_rollout.errors import ConfigError, EnvironmentFailedError, RolloutError
from zmq_rollout.rollouts import make_job, to_rollouts
from zmq_rollout.submissions import settle


class JobClient(Protocol):
    """What run_episodes needs of a client (``AsyncRolloutClient`` is one)."""

    @property
    def config(self) -> ClientConfig: ...

    async def submit_jobs(self, jobs: list[p.JobSpec], *, stream: bool = False) -> list[Any]: ...

    async def cancel(self, job_ids: Sequence[str]) -> None: ...

    async def status(self) -> p.StatusReply: ...


_MASK63 = (1 << 63) - 1
FinishReason = Literal["done", "max_turns", "budget", "error", "stale"]


@dataclass
class TurnSpan:
    """Where one model turn sits in ``Trajectory.token_ids``, and who made it."""

    start: int
    end: int  # token_ids[start:end] are the ids the model generated this turn
    weight_version: int
    worker_id: str
    finish_reason: str


@dataclass
class Trajectory:
    """One episode, token-exact. ``token_ids`` is the whole conversation; ``loss_mask`` is 1 on
    the ids the model generated, 0 on the prompt and on everything the environment (and the
    chat template around it) added. ``logprobs`` and ``weight_versions`` are per token: the
    model's processed logprob and the version that made it, 0.0 and -1 where the mask is 0."""

    sample_index: int
    index: int  # 0..n-1: the episode's number among its sample's n
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    prompt_length: int  # the first turn's prompt: token_ids[:prompt_length]
    rewards: list[float]  # per environment step
    reward: float  # their sum
    num_turns: int
    finish_reason: FinishReason
    info: dict[str, Any] = field(default_factory=dict)  # the environment's last info
    messages: list[Message] = field(default_factory=list)  # the conversation as text, for reward functions
    turns: list[TurnSpan] = field(default_factory=list)
    error: str | None = None  # why, when finish_reason is "error"
    restarts: int = 0  # times it started over (a lost environment process, or on_stale="restart")

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.prompt_length :]


class _Restart(Exception):
    """Start the episode over; ``trajectory`` is what it ends with if it may not."""

    def __init__(self, trajectory: Trajectory) -> None:
        super().__init__(trajectory.finish_reason)
        self.trajectory = trajectory


@dataclass
class _Run:
    client: JobClient
    envs: LocalEnvs | ProcessEnvs
    chat: ChatTokens
    sampling: p.SamplingParams
    max_turns: int
    max_tokens_per_turn: int
    max_total_tokens: int | None
    step_timeout_s: float
    turn_timeout_s: float | None
    max_staleness: int | None
    on_stale: str
    max_restarts: int
    lora: str | None
    prefix: str
    fleet_version: int = 0
    ids: itertools.count[int] = field(default_factory=itertools.count)


async def run_episodes(
    client: JobClient,
    env: str | Factory,
    samples: Sequence[Any],
    sampling: p.SamplingParams | None = None,
    *,
    tokenizer: Any,
    env_kwargs: dict[str, Any] | None = None,
    n: int = 1,
    concurrency: int = 64,
    processes: int = 0,
    max_turns: int = 8,
    max_tokens_per_turn: int | None = None,
    max_total_tokens: int | None = None,
    step_timeout_s: float = 60.0,
    turn_timeout_s: float | None = None,
    max_staleness: int | None = None,
    on_stale: Literal["abort", "restart"] = "abort",
    max_restarts: int = 2,
    lora: str | None = None,
    progress: bool | None = None,
) -> list[Trajectory]:
    """Run ``n`` episodes of ``env`` per sample; trajectories sample-major, in input order.

    ``env``: a registered name (``zmq_rollout.environments.available()``) or a factory, called
    with ``env_kwargs`` once per episode. ``tokenizer``: the policy's Hugging Face tokenizer
    (or a path to it), whose chat template turns the environment's messages into ids.
    ``sampling``: per turn; its ``n`` must be 1 (``n`` here is the episodes per sample), its
    ``max_tokens`` is the per-turn limit unless ``max_tokens_per_turn`` says otherwise; a
    ``seed`` makes the run reproducible, each turn of each episode sampled with its own seed
    derived from it (so the ``n`` episodes of a sample differ).
    ``max_total_tokens``: the whole conversation's budget (then ``finish_reason="budget"``).
    ``processes``: 0 runs environments in this event loop; K > 0 in K processes (for
    environments that compute or block). ``step_timeout_s``: a reset or step that takes
    longer ends its episode with ``finish_reason="error"``. ``max_staleness``: an episode
    whose oldest model token is more than that many weight versions behind the fleet is
    ended (``on_stale="abort"``: ``finish_reason="stale"``, what it has is kept) or started
    over (``"restart"``, at most ``max_restarts`` times, then ``"stale"``). ``progress``: a
    progress bar on stderr (None: when stderr is a terminal).
    """
    sampling = sampling or p.SamplingParams()
    if sampling.n != 1:
        raise ConfigError("sampling.n must be 1 in run_episodes: pass n= for episodes per sample")
    if max_turns < 1 or n < 1 or concurrency < 1:
        raise ConfigError("max_turns, n and concurrency must be at least 1")
    if on_stale not in ("abort", "restart"):
        raise ConfigError('on_stale is "abort" or "restart"')
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    spec: EnvSpec = (env, dict(env_kwargs or {}))
    if isinstance(env, str):
        from zmq_rollout.environments.registry import factory

        factory(env)  # an unknown name fails here, before any episode starts
    envs: LocalEnvs | ProcessEnvs = ProcessEnvs(spec, processes) if processes else LocalEnvs(spec)
    run = _Run(
        client,
        envs,
        ChatTokens(tokenizer),
        sampling,
        max_turns,
        max_tokens_per_turn or sampling.max_tokens,
        max_total_tokens,
        step_timeout_s,
        turn_timeout_s,
        max_staleness,
        on_stale,
        max_restarts,
        lora,
        f"ep{uuid.uuid4().hex[:8]}",
    )
    gate = asyncio.Semaphore(concurrency)
    bar = _progress(len(samples) * n, progress)
    watcher = asyncio.ensure_future(_watch_fleet(run)) if max_staleness is not None else None

    async def one(si: int, k: int) -> Trajectory:
        async with gate:
            trajectory = await _episode(run, si, k, samples[si])
        if bar is not None:
            bar.update(1)
        return trajectory

    try:
        if watcher is not None:
            run.fleet_version = (await client.status()).fleet_version
        return list(await asyncio.gather(*(one(si, k) for si in range(len(samples)) for k in range(n))))
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher
        if bar is not None:
            bar.close()
        await envs.shutdown()


async def _watch_fleet(run: _Run, every_s: float = 1.0) -> None:
    """The fleet's weight version, from the broker's status, once a second (max_staleness)."""
    while True:
        await asyncio.sleep(every_s)
        with contextlib.suppress(RolloutError):
            run.fleet_version = max(run.fleet_version, (await run.client.status()).fleet_version)


async def _episode(run: _Run, sample_index: int, index: int, sample: Any) -> Trajectory:
    restarts = 0
    while True:
        key = f"{run.prefix}-{sample_index}-{index}-{restarts}"
        try:
            trajectory = await _attempt(run, key, sample_index, index, sample)
        except _Restart as restart:
            if restarts < run.max_restarts:
                restarts += 1
                continue
            trajectory = restart.trajectory
        finally:
            await run.envs.close(key)
        trajectory.restarts = restarts
        return trajectory


async def _attempt(run: _Run, key: str, sample_index: int, index: int, sample: Any) -> Trajectory:
    t = Trajectory(sample_index, index, [], [], [], [], 0, [], 0.0, 0, "error")
    try:
        first = await run.envs.reset(key, sample, run.step_timeout_s)
        t.messages = list(first.messages)
        _extend(t, run.chat.prompt(first.messages), model=False)
        t.prompt_length = len(t.token_ids)
        for turn in range(run.max_turns):
            budget = run.max_tokens_per_turn
            if run.max_total_tokens is not None:
                budget = min(budget, run.max_total_tokens - len(t.token_ids))
            if budget <= 0:
                return _end(t, "budget")
            rollout = await _generate(run, key, t, budget, last=turn == run.max_turns - 1)
            start = len(t.token_ids)
            t.token_ids += rollout.token_ids
            t.loss_mask += [1] * len(rollout.token_ids)
            t.logprobs += rollout.logprobs
            t.weight_versions += rollout.weight_versions or [rollout.weight_version] * len(rollout.token_ids)
            t.turns.append(
                TurnSpan(start, len(t.token_ids), rollout.weight_version, rollout.worker_id, rollout.finish_reason)
            )
            t.num_turns = turn + 1
            t.messages.append({"role": "assistant", "content": rollout.text})
            run.fleet_version = max(run.fleet_version, rollout.weight_version)
            if _stale(run, t):
                if run.on_stale == "restart":
                    raise _Restart(_end(t, "stale"))
                return _end(t, "stale")
            action = Action(
                rollout.text, list(rollout.token_ids), rollout.finish_reason, parse_tool_calls(rollout.text), turn
            )
            result = await run.envs.step(key, action, run.step_timeout_s)
            t.rewards.append(float(result.reward))
            t.info = dict(result.info)
            if result.done or result.observation is None:
                return _end(t, "done")
            if turn == run.max_turns - 1:
                return _end(t, "max_turns")
            observation = Observation.of(result.observation)
            following = run.chat.close_turn(rollout.token_ids) + run.chat.messages(observation.messages)
            if run.max_total_tokens is not None and len(t.token_ids) + len(following) >= run.max_total_tokens:
                return _end(t, "budget")  # no room left to answer it: the trajectory ends on the model's turn
            _extend(t, following, model=False)
            t.messages.extend(observation.messages)
        return _end(t, "max_turns")  # not reached: the loop returns at its last turn
    except EnvironmentLost:
        raise _Restart(
            _end(t, "error", "its environment process was lost (another episode's step killed it)")
        ) from None
    except (EnvironmentFailedError, RolloutError, ValueError) as exc:
        return _end(t, "error", str(exc))


def _extend(t: Trajectory, ids: list[int], *, model: bool) -> None:
    t.token_ids += ids
    t.loss_mask += [int(model)] * len(ids)
    t.logprobs += [0.0] * len(ids)
    t.weight_versions += [-1] * len(ids)


def _end(t: Trajectory, why: FinishReason, error: str | None = None) -> Trajectory:
    t.finish_reason, t.error = why, error
    t.reward = float(sum(t.rewards))
    return t


def _stale(run: _Run, t: Trajectory) -> bool:
    if run.max_staleness is None:
        return False
    made = [v for v, m in zip(t.weight_versions, t.loss_mask, strict=True) if m]
    return bool(made) and run.fleet_version - min(made) > run.max_staleness


async def _generate(run: _Run, key: str, t: Trajectory, max_tokens: int, *, last: bool) -> Any:
    seed = run.sampling.seed
    if seed is not None:  # one seed for every turn of every episode would make a group's episodes alike
        seed = (seed * 1_000_003 + (t.sample_index * 65_537 + t.index) * 7_919 + t.num_turns) & _MASK63
    sampling = msgspec.structs.replace(run.sampling, max_tokens=max_tokens, seed=seed)
    job = make_job(f"{key}-t{next(run.ids)}", list(t.token_ids), sampling, lora=run.lora)
    job = _with_session(job, key, last)
    (handle,) = await run.client.submit_jobs([job])
    limit = run.turn_timeout_s if run.turn_timeout_s is not None else run.client.config.timeout_s
    try:
        result = await asyncio.wait_for(handle.future, None if math.isinf(limit) else limit)
    except asyncio.TimeoutError:
        settle([handle.future])  # its JobCancelledError is expected
        await run.client.cancel([job.job_id])
        raise EnvironmentFailedError(
            f"turn {t.num_turns + 1} had no result after {limit:g} s (turn_timeout_s)"
        ) from None
    except BaseException:
        if not handle.future.done():
            settle([handle.future])
            await run.client.cancel([job.job_id])
        raise
    return to_rollouts(result)[0]


def _with_session(job: p.JobSpec, session: str, last: bool) -> p.JobSpec:
    """The job with the episode's ``session_id`` (worker affinity), where the protocol has it."""
    fields = p.JobSpec.__struct_fields__
    changes: dict[str, Any] = {}
    if "session_id" in fields:
        changes["session_id"] = session
    if last and "session_end" in fields:
        changes["session_end"] = True
    return msgspec.structs.replace(job, **changes) if changes else job


def _progress(total: int, wanted: bool | None) -> Any:
    """A progress bar on stderr (rich): if ``wanted``, or if None and stderr is a terminal."""
    import sys

    if not (wanted or (wanted is None and sys.stderr.isatty())):
        return None
    from rich.progress import Progress

    bar = Progress(transient=True)
    task = bar.add_task("episodes", total=total)
    bar.start()

    class _Bar:
        def update(self, k: int) -> None:
            bar.advance(task, k)

        def close(self) -> None:
            bar.stop()

    return _Bar()


__all__ = ["Trajectory", "TurnSpan", "run_episodes"]
