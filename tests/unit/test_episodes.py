"""run_episodes against a broker and an echo worker DOUBLE (a test double, not vLLM: it answers
each job with the prompt's first 4 ids): trajectories are token-exact (the ids each turn's
job carried are the trajectory's prefix), loss masks cover exactly the generated ids, jobs
carry the episode's session, and failing environments (raise, hang, block, die), budgets,
turn limits and staleness end only their own episodes. tests/integration/test_multi_turn.py
does the same with real vLLM workers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from zmq_rollout import AsyncRolloutClient, SamplingParams
from zmq_rollout import protocol as p
from zmq_rollout.chat_tokens import ChatTokens
from zmq_rollout.environments import Action, Environment, Observation, StepResult
from zmq_rollout.episodes import Trajectory, run_episodes
from zmq_rollout.errors import ConfigError
from zmq_rollout.tiny_model import _build_tokenizer

TOKENIZER = _build_tokenizer(4096)
SAMPLING = SamplingParams(max_tokens=8)


def episodes(broker: Any, env: Any, samples: list[Any], **kwargs: Any) -> list[Trajectory]:
    async def main() -> list[Trajectory]:
        async with AsyncRolloutClient(broker.frontend, timeout_s=60) as client:
            return await run_episodes(client, env, samples, SAMPLING, tokenizer=TOKENIZER, **kwargs)

    return asyncio.run(main())


def check_exact(t: Trajectory, received: dict[str, list[int]]) -> None:
    """Each turn's job prompt is the trajectory up to that turn; the mask is 1 exactly on the
    ids the worker returned; logprobs/versions are set on those and only those."""
    assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.weight_versions)
    for span in t.turns:
        prompt = t.token_ids[: span.start]
        assert prompt in received.values()
        assert t.token_ids[span.start : span.end] == prompt[:4]  # what the double generated
        assert t.loss_mask[span.start : span.end] == [1] * (span.end - span.start)
    assert sum(t.loss_mask) == sum(s.end - s.start for s in t.turns)
    assert all(v == -1 for v, m in zip(t.weight_versions, t.loss_mask, strict=True) if not m)


def received_prompts(double: Any) -> dict[str, list[int]]:
    return {a.job.job_id: list(a.job.prompt_token_ids) for a in double.received}


def test_trajectories_are_token_exact_and_carry_their_session(start_broker: Any, start_double: Any) -> None:
    broker = start_broker()
    double = start_double(broker)
    got = episodes(broker, "scripted", ["A: ", "B: "], n=2, env_kwargs={"turns": 3})
    assert [(t.sample_index, t.index) for t in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    received = received_prompts(double)
    chat = ChatTokens(TOKENIZER)
    for t in got:
        assert (t.finish_reason, t.num_turns, len(t.rewards), t.error) == ("done", 3, 3, None)
        check_exact(t, received)
        first = chat.prompt([{"role": "user", "content": f"{'AB'[t.sample_index]}: Turn 1 of 3: say a."}])
        assert t.token_ids[: t.prompt_length] == first
        # between turns: the end of the assistant message (cut by length: all of it), the user turn
        gap = t.token_ids[t.turns[0].end : t.turns[1].start]
        assert gap == [258, 10, *chat.messages([{"role": "user", "content": "Turn 2 of 3: say a."}])]
        assert [m["role"] for m in t.messages] == ["user", "assistant"] * 3
    jobs = [a.job for a in double.received]
    sessions = {j.session_id for j in jobs}
    assert len(jobs) == 12 and len(sessions) == 4 and None not in sessions
    assert sum(j.session_end for j in jobs) == 0  # the env ended them; no turn was known to be last


class _Script(Environment):
    """An in-process environment whose step runs a hook (closures cannot go to processes)."""

    def __init__(self, hook: Any = None, turns: int = 3) -> None:
        self.hook, self.turns, self.turn = hook, turns, 0

    async def reset(self, sample: Any) -> Observation:
        return Observation.of(f"start {sample}")

    async def step(self, action: Action) -> StepResult:
        self.turn += 1
        if self.hook is not None:
            await self.hook(self.turn)
        done = self.turn >= self.turns
        return StepResult(None if done else Observation.of(f"turn {self.turn + 1}"), 1.0, done)


def test_failing_environments_end_only_their_own_episode(start_broker: Any, start_double: Any) -> None:
    broker = start_broker()
    start_double(broker)
    samples = [{"prompt": "ok "}, {"prompt": "raise ", "raise_at": 2}, {"prompt": "hang ", "hang_at": 2}]
    got = episodes(broker, "scripted", samples, step_timeout_s=0.5)
    assert [t.finish_reason for t in got] == ["done", "error", "error"]
    assert "raised RuntimeError: scripted failure at turn 2" in (got[1].error or "")
    assert "did not finish within 0.5 s" in (got[2].error or "")
    assert got[1].num_turns == got[2].num_turns == 2 and len(got[1].rewards) == 1  # what it had is kept


@pytest.mark.timeout(120)
def test_environment_process_that_dies_fails_its_episode_others_start_over(
    start_broker: Any, start_double: Any
) -> None:
    """One process: the episode whose step kills it fails; the other lost its environment with
    the process, starts over, and finishes."""
    broker = start_broker()
    double = start_double(broker)
    samples = [{"prompt": "ok "}, {"prompt": "dies ", "die_at": 2}]
    ok, dies = episodes(broker, "scripted", samples, processes=1, step_timeout_s=5.0)
    assert dies.finish_reason == "error" and "step failed: its process died" in (dies.error or ""), dies.error
    assert dies.restarts == 0 and dies.num_turns == 2
    assert (ok.finish_reason, ok.num_turns, ok.restarts) == ("done", 3, 1), ok.error
    check_exact(ok, received_prompts(double))


@pytest.mark.timeout(120)
def test_environment_that_blocks_its_process_is_killed_and_fails_alone(start_broker: Any, start_double: Any) -> None:
    broker = start_broker()
    double = start_double(broker)
    samples = [{"prompt": "ok "}, {"prompt": "blocks ", "block_at": 2}, {"prompt": "ok2 "}]
    ok, blocks, ok2 = episodes(broker, "scripted", samples, processes=1, step_timeout_s=1.0)
    assert blocks.finish_reason == "error" and "blocked its process past the 1 s timeout" in (blocks.error or "")
    for t in (ok, ok2):
        assert (t.finish_reason, t.num_turns) == ("done", 3), t
        check_exact(t, received_prompts(double))


def test_budget_and_max_turns(start_broker: Any, start_double: Any) -> None:
    broker = start_broker()
    start_double(broker)
    short = episodes(broker, "scripted", ["x"], env_kwargs={"turns": 5}, max_turns=2)
    assert (short[0].finish_reason, short[0].num_turns) == ("max_turns", 2)
    first_prompt = short[0].prompt_length
    tight = episodes(broker, "scripted", ["x"], env_kwargs={"turns": 5}, max_total_tokens=first_prompt + 30)
    assert tight[0].finish_reason == "budget" and len(tight[0].token_ids) <= first_prompt + 30
    assert 1 <= tight[0].num_turns < 5


def test_max_staleness_aborts_or_restarts(start_broker: Any, start_double: Any) -> None:
    broker = start_broker()
    double = start_double(broker)

    async def new_weights(turn: int) -> None:
        if turn == 1 and double.weight_version == 0:
            double.weight_version = 3  # the next turn is sampled 3 versions later

    aborted = episodes(broker, lambda: _Script(new_weights), ["s"], max_staleness=1)
    assert aborted[0].finish_reason == "stale" and aborted[0].num_turns == 2
    assert sorted({v for v in aborted[0].weight_versions if v >= 0}) == [0, 3]
    double.weight_version = 0
    restarted = episodes(broker, lambda: _Script(new_weights), ["s"], max_staleness=1, on_stale="restart")
    t = restarted[0]
    assert (t.finish_reason, t.restarts, t.num_turns) == ("done", 1, 3)
    assert {v for v in t.weight_versions if v >= 0} == {3}


def test_bad_arguments_are_refused_before_any_episode(start_broker: Any) -> None:
    broker = start_broker()
    with pytest.raises(ConfigError, match=r"sampling\.n must be 1"):
        asyncio.run(
            _with_client(broker, lambda c: run_episodes(c, "scripted", ["x"], SamplingParams(n=2), tokenizer=TOKENIZER))
        )
    with pytest.raises(ConfigError, match="no environment named"):
        asyncio.run(_with_client(broker, lambda c: run_episodes(c, "nope", ["x"], tokenizer=TOKENIZER)))


async def _with_client(broker: Any, call: Any) -> Any:
    async with AsyncRolloutClient(broker.frontend, timeout_s=10) as client:
        return await call(client)


def test_a_seed_gives_every_turn_of_every_episode_its_own_reproducible_seed(
    start_broker: Any, start_double: Any
) -> None:
    broker = start_broker()
    double = start_double(broker)

    async def run_once() -> list[int | None]:
        double.received.clear()
        async with AsyncRolloutClient(broker.frontend, timeout_s=60) as client:
            await run_episodes(
                client, "scripted", ["a", "b"], SamplingParams(max_tokens=4, seed=5), tokenizer=TOKENIZER, n=2
            )
        return sorted(a.job.sampling.seed for a in double.received)  # type: ignore[type-var]

    first = asyncio.run(run_once())
    assert len(first) == 12 and len(set(first)) == 12  # 2 samples x 2 episodes x 3 turns, all different
    assert asyncio.run(run_once()) == first


def test_blocking_client_runs_episodes_and_status_says_what_runs_where(start_broker: Any, start_double: Any) -> None:
    from zmq_rollout import RolloutClient

    broker = start_broker()
    start_double(broker)
    with RolloutClient(broker.frontend, timeout_s=60) as client:
        status = client.status()
        assert {"calculator", "scripted", "gymnasium"} <= set(status.environments)
        # as the double's READY said
        assert [w.capabilities for w in status.workers] == [["echo", p.TOKEN_BINS, p.SEALED_JOBS]]
        got = client.run_episodes("scripted", ["x"], SamplingParams(max_tokens=4), tokenizer=TOKENIZER)
    assert (got[0].finish_reason, got[0].num_turns) == ("done", 3)
