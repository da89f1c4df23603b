"""Multi-turn episodes against REAL vLLM CPU workers (two) and the tiny model.

The workers run with the test hook ``ZMQ_ROLLOUT_TEST_PROMPT_LOG`` (workers/generation.py):
each appends the prompt ids its engine received per job, so the tests compare what the
engine saw with the trajectory the trainer gets. Proved here: every turn's prompt is the
trajectory's exact prefix and the loss mask covers exactly the generated ids; retokenizing
the final text would NOT give those ids (a constructed case); a worker SIGKILLed mid-episode
and a weight sync mid-episode in each pause mode leave every episode whole and exact.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import poll_until
from model_helpers import trained_model

from zmq_rollout import AsyncRolloutClient, SamplingParams
from zmq_rollout.config import BrokerConfig
from zmq_rollout.episodes import Trajectory, run_episodes
from zmq_rollout.local import LocalCluster
from zmq_rollout.workers.generation import PROMPT_LOG_ENV


@pytest.fixture(scope="module")
def prompt_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("multi-turn") / "prompts.jsonl"


@pytest.fixture(scope="module")
def cluster(tiny_model: str, prompt_log: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = BrokerConfig(
        frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", heartbeat_interval_s=0.5, worker_liveness=10
    )
    before = os.environ.get(PROMPT_LOG_ENV)
    os.environ[PROMPT_LOG_ENV] = str(prompt_log)  # the worker processes inherit it
    c = LocalCluster(tiny_model, num_workers=2, broker_config=config, log_dir=str(tmp_path_factory.mktemp("logs")))
    try:
        c.start(wait_s=300)
        yield c
    finally:
        c.stop()
        if before is None:
            os.environ.pop(PROMPT_LOG_ENV, None)
        else:
            os.environ[PROMPT_LOG_ENV] = before


def logged(prompt_log: Path) -> list[dict[str, Any]]:
    if not prompt_log.exists():
        return []
    return [json.loads(line) for line in prompt_log.read_text().splitlines() if line.strip()]


def check_exact(trajectories: list[Trajectory], prompt_log: Path) -> None:
    """Each turn's prompt, as the engine received it, is the trajectory up to that turn, under
    one session per episode; the mask is 1 on exactly the generated ids."""
    seen: dict[tuple[int, ...], set[str]] = {}
    for line in logged(prompt_log):
        seen.setdefault(tuple(line["prompt_token_ids"]), set()).add(line["session_id"])
    for t in trajectories:
        assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.weight_versions)
        sessions: set[str] = set()
        for k, span in enumerate(t.turns):
            prefix = tuple(t.token_ids[: span.start])
            assert prefix in seen, f"turn at {span.start}: no engine received the trajectory's prefix"
            if k:  # the first turn's prompt is the same for the n episodes of a sample
                sessions |= seen[prefix]
            assert t.loss_mask[span.start : span.end] == [1] * (span.end - span.start)
        assert len(sessions) == 1 and None not in sessions, sessions
        assert sum(t.loss_mask) == sum(s.end - s.start for s in t.turns) > 0
        assert all(lp < 0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m)


def episodes(cluster: LocalCluster, tiny_model: str, samples: list[Any], sampling: SamplingParams, **kw: Any) -> Any:
    async def main() -> list[Trajectory]:
        async with AsyncRolloutClient(cluster.address, timeout_s=300) as client:
            return await run_episodes(client, "scripted", samples, sampling, tokenizer=tiny_model, **kw)

    return asyncio.run(main())


def test_turns_are_token_exact_and_retokenizing_the_text_would_drift(
    cluster: LocalCluster, tiny_model: str, prompt_log: Path
) -> None:
    from transformers import AutoTokenizer

    status = cluster.status()  # what each worker can do, as its READY said
    assert all({"generate", "text"} <= set(w.capabilities) and w.max_model_len == 1024 for w in status.workers)
    sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    got = episodes(cluster, tiny_model, ["A ", "B ", "C "], sampling, n=2, env_kwargs={"turns": 3})
    assert [t.finish_reason for t in got] == ["done"] * 6 and all(t.num_turns == 3 for t in got)
    check_exact(got, prompt_log)
    assert all(set(t.weight_versions[s.start : s.end]) == {0} for t in got for s in t.turns)
    # Text for reward functions is vLLM's; the ids are not recoverable from it. The random
    # model emits bytes that are not UTF-8 (decoded to U+FFFD), so re-encoding the decoded
    # conversation gives other ids than the ones the engine saw: the drift run_episodes avoids.
    tok = AutoTokenizer.from_pretrained(tiny_model)
    case = got[0]
    retokenized = tok.encode(tok.decode(case.token_ids, skip_special_tokens=False), add_special_tokens=False)
    assert retokenized != case.token_ids
    second = case.turns[1].start
    assert retokenized[:second] != case.token_ids[:second]  # turn 2's prompt would have been wrong
    assert [m["role"] for m in case.messages] == ["user", "assistant"] * 3
    # the assistant's text is vLLM's: it holds back an incomplete UTF-8 sequence at the end
    decoded = tok.decode(case.token_ids[case.turns[0].start : case.turns[0].end])
    assert case.messages[1]["content"] and decoded.startswith(case.messages[1]["content"])


def test_worker_sigkilled_mid_episode_every_episode_finishes_exactly(
    cluster: LocalCluster, tiny_model: str, prompt_log: Path
) -> None:
    """A worker dies with turns in flight: the broker requeues them on the other worker and
    the episodes go on from the same prefix (no turn lost, none doubled). Whether the victim
    finished a turn before it died is timing (when every first turn landed on the other
    worker, it had not): what is asserted is that turns in flight on it were requeued."""
    start = len(logged(prompt_log))
    sampling = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)
    result: dict[str, Any] = {}

    async def main() -> None:
        async with AsyncRolloutClient(cluster.address, timeout_s=300) as client:
            task = asyncio.ensure_future(
                run_episodes(
                    client,
                    "scripted",
                    [f"{i} " for i in range(8)],
                    sampling,
                    tokenizer=tiny_model,
                    env_kwargs={"turns": 4},
                )
            )
            await asyncio.to_thread(
                poll_until, lambda: len(logged(prompt_log)) >= start + 12, 240, what="turn 2 under way"
            )
            # The victim is the worker with the most turns in flight (where the first turns
            # landed is the scheduler's business, tested in its unit tests; here a worker
            # must die with turns on it).
            status = await client.status()
            workers = status.workers
            result["at_kill"] = {w.name: (w.state, w.credits, w.running, w.idle_s) for w in workers}
            busiest = max(sorted(workers, key=lambda w: w.name), key=lambda w: w.running)
            assert busiest.running > 0, result["at_kill"]
            result["victim"] = busiest.name
            result["survivor"] = next(w.name for w in workers if w.name != busiest.name)
            await asyncio.to_thread(cluster.kill_worker, busiest.name)
            result["got"] = await task
            result["requeued"] = (await client.status()).totals.requeued - status.totals.requeued

    try:
        asyncio.run(main())
        got: list[Trajectory] = result["got"]
        assert [t.finish_reason for t in got] == ["done"] * 8 and all(t.num_turns == 4 for t in got)
        check_exact(got, prompt_log)
        workers = {s.worker_id for t in got for s in t.turns}
        assert result["requeued"] >= 1, result  # the kill caught turns in flight: they ran again
        assert result["survivor"] in workers, result  # on the other worker
    finally:
        if "victim" in result:
            cluster.start_worker(result["victim"])
            cluster.wait_for_workers(2, 300)


@pytest.mark.parametrize("pause", ["abort", "wait", "keep"])
def test_sync_mid_episode_every_pause_mode(
    cluster: LocalCluster, tiny_model: str, prompt_log: Path, pause: str
) -> None:
    """Episodes keep running through update_weights; each turn's tokens carry the version that
    made them (old turns before the sync, new after), and the trajectories stay exact. Six
    turns of 80 tokens: the episodes outlast the sync even on a fast machine (with four of 48
    they once all ended before it committed)."""
    model = trained_model(tiny_model, {"abort": 11, "wait": 12, "keep": 13}[pause])
    start = len(logged(prompt_log))
    sampling = SamplingParams(temperature=1.0, max_tokens=80, ignore_eos=True)
    out: dict[str, Any] = {}

    async def main() -> None:
        async with AsyncRolloutClient(cluster.address, timeout_s=300) as client:
            old = (await client.status()).fleet_version
            task = asyncio.ensure_future(
                run_episodes(
                    client,
                    "scripted",
                    [f"{i} " for i in range(6)],
                    sampling,
                    tokenizer=tiny_model,
                    env_kwargs={"turns": 6},
                )
            )
            await asyncio.to_thread(
                poll_until, lambda: len(logged(prompt_log)) >= start + 8, 240, what="turn 2 under way"
            )
            report = await client.update_weights(model, pause=pause, timeout_s=120)
            out.update(old=old, new=report.version, got=await task)

    asyncio.run(main())
    got: list[Trajectory] = out["got"]
    old, new = out["old"], out["new"]
    assert new == old + 1
    assert [t.finish_reason for t in got] == ["done"] * 6 and all(t.num_turns == 6 for t in got)
    check_exact(got, prompt_log)
    for t in got:
        made = [v for v, m in zip(t.weight_versions, t.loss_mask, strict=True) if m]
        assert set(made) <= {old, new} and made == sorted(made), made  # old tokens, then new
    crossed = [t for t in got if t.turns[0].weight_version == old and t.turns[-1].weight_version == new]
    assert crossed, "no episode ran turns both before and after the sync"
