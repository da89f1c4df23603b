"""The environment plugin API: registry (entry points and in-process), the calculator tool
environment, tool-call parsing, the gymnasium wrapper, and MultiTurnScheduler adapters."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from zmq_rollout.environments import (
    Action,
    Environment,
    MultiTurnScheduler,
    Observation,
    SchedulerEnvironment,
    StepResult,
    available,
    build,
    parse_tool_calls,
    register,
)
from zmq_rollout.environments.calculator import CalculatorEnvironment, evaluate
from zmq_rollout.environments.gym_text import GymTextEnvironment
from zmq_rollout.environments.scripted import ScriptedEnvironment
from zmq_rollout.errors import ConfigError


def act(text: str, ids: list[int] | None = None) -> Action:
    return Action(text, ids if ids is not None else list(text.encode()), "stop", parse_tool_calls(text))


def test_the_three_examples_are_installed_as_entry_points() -> None:
    assert {"calculator", "scripted", "gymnasium"} <= set(available())
    assert isinstance(build("scripted", {"turns": 2}), ScriptedEnvironment)
    assert isinstance(build("calculator"), CalculatorEnvironment)


def test_register_in_process_and_clear_errors() -> None:
    class Echo(MultiTurnScheduler):
        def next_message(self, history: list[dict[str, Any]], action: Action, sample: Any) -> str | None:
            return None if len(history) > 3 else f"you said {action.text}"

    register("test-echo", Echo)
    env = build("test-echo")
    assert isinstance(env, SchedulerEnvironment) and "test-echo" in available()
    with pytest.raises(ConfigError, match=r"no environment named 'nope'; available: .*calculator"):
        build("nope")
    with pytest.raises(ConfigError, match="not an Environment"):
        build(object)  # type: ignore[arg-type]


def test_scheduler_environment_drives_turns_until_none() -> None:
    class TwoTurns(MultiTurnScheduler):
        def next_message(self, history: list[dict[str, Any]], action: Action, sample: Any) -> str | None:
            return "again" if len(history) < 3 else None

    async def main() -> None:
        env = SchedulerEnvironment(TwoTurns())
        first = await env.reset({"prompt": "hello"})
        assert first.messages == [{"role": "user", "content": "hello"}]
        step = await env.step(act("a"))
        assert (step.done, step.observation) == (False, Observation([{"role": "user", "content": "again"}]))
        assert (await env.step(act("b"))).done
        assert [m["role"] for m in env.history] == ["user", "assistant", "user", "assistant"]

    asyncio.run(main())


def test_evaluate_is_arithmetic_only() -> None:
    assert evaluate("12 * 7") == 84 and evaluate("-(2 + 3) ** 2") == -25 and evaluate("7 // 2 % 3") == 0
    for bad, why in [
        ("__import__('os')", "Call is not allowed"),
        ("a + 1", "Name is not allowed"),
        ("1 / 0", "division by zero"),
        ("2 ** 1000", "exponent too large"),
        ("1 +", "not an expression"),
        ("1" * 300, "longer than 200"),
    ]:
        with pytest.raises(ValueError, match=why):
            evaluate(bad)


def test_parse_tool_calls_skips_garbage() -> None:
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "2+2"})]
    assert parse_tool_calls("no calls here") == []


def test_calculator_tool_call_result_then_answer() -> None:
    async def main() -> None:
        env = CalculatorEnvironment()
        first = await env.reset({"question": "What is 12 * 7?", "answer": 84})
        assert [m["role"] for m in first.messages] == ["system", "user"]
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>'
        step = await env.step(act(call))
        assert step.observation == Observation([{"role": "tool", "content": "84"}]) and not step.done
        garbage = await env.step(act('<tool_call>{"name": "calculator", "arguments": {"expression": "x"}}</tool_call>'))
        assert garbage.observation is not None
        assert "error: Name is not allowed" in garbage.observation.messages[0]["content"]
        assert not garbage.done  # a garbage call costs a turn, not the episode
        final = await env.step(act("The answer is 84"))
        assert (final.done, final.reward) == (True, 1.0)
        await env.reset({"question": "q", "answer": 3})
        assert (await env.step(act("I think 4"))).reward == 0.0
        assert (await env.step(act("no number at all"))).reward == 0.0
        with pytest.raises(ValueError, match="question"):
            await env.reset("just a string")

    asyncio.run(main())


def test_gymnasium_wrapper_plays_frozen_lake_and_survives_garbage() -> None:
    async def main() -> None:
        env = GymTextEnvironment("FrozenLake-v1", make_kwargs={"is_slippery": False})
        first = await env.reset({"seed": 0})
        assert "Observation: 0" in first.messages[0]["content"]
        bad = await env.step(act("left? right? who knows"))
        assert bad.info == {"invalid": True} and not bad.done and bad.observation is not None
        assert "not an action" in bad.observation.messages[0]["content"]
        # 4x4 map SFFF/FHFH/FFFH/HFFG, not slippery: down, down, right, right, down, right
        rewards = []
        for move in ["1", "1", "2", "2", "1", "2"]:
            step = await env.step(act(f"action {move}"))
            rewards.append(step.reward)
        assert step.done and rewards[-1] == 1.0 and sum(rewards) == 1.0
        await env.close()

    asyncio.run(main())
    with pytest.raises(ValueError, match="exactly one of env_id"):
        GymTextEnvironment()


def test_scripted_environment_rewards_the_target_byte() -> None:
    async def main() -> None:
        env = ScriptedEnvironment(turns=2, target="a")
        first = await env.reset("P: ")
        assert first.messages[0]["content"] == "P: Turn 1 of 2: say a."
        one = await env.step(act("aab", [97, 97, 98]))
        assert one.reward == pytest.approx(2 / 3) and not one.done
        two = await env.step(act("", []))
        assert (two.done, two.reward) == (True, 0.0)

    asyncio.run(main())


class _Bare(Environment):
    async def reset(self, sample: Any) -> Observation:
        return Observation.of(sample)

    async def step(self, action: Action) -> StepResult:
        return StepResult(done=True)


def test_observation_of_accepts_the_documented_shapes() -> None:
    assert Observation.of("hi") == Observation([{"role": "user", "content": "hi"}])
    assert Observation.of({"role": "tool", "content": "1"}).messages == [{"role": "tool", "content": "1"}]
    with pytest.raises(TypeError, match="an observation is"):
        Observation.of(42)  # type: ignore[arg-type]
    assert asyncio.run(_Bare().reset("x")).messages[0]["content"] == "x"
