"""Worker pieces that need no engine: the GPU plan, CLI round trip, logprob extraction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from zmq_rollout import protocol as p
from zmq_rollout.cli import app
from zmq_rollout.config import WorkerConfig
from zmq_rollout.workers import main as worker_main
from zmq_rollout.workers.engine import engine_args, sampled_logprobs, vllm_sampling


@pytest.mark.parametrize(
    ("gpus", "tp", "plan"),
    [("", 1, [""]), ("0", 1, ["0"]), ("0,1", 1, ["0", "1"]), ("0,1", 2, ["0,1"]), ("0,1,2,3", 2, ["0,1", "2,3"])],
)
def test_plan_engines(gpus: str, tp: int, plan: list[str]) -> None:
    assert worker_main.plan_engines(gpus, tp) == plan


@pytest.mark.parametrize(
    ("gpus", "tp", "match"), [("0,1,2", 2, "cannot be split"), ("0,0", 1, "twice"), ("0", 0, "split")]
)
def test_plan_engines_rejects(gpus: str, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        worker_main.plan_engines(gpus, tp)


def test_cli_args_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    config = WorkerConfig(
        broker="tcp://h:1",
        model="/m",
        gpus="3",
        tensor_parallel_size=1,
        max_num_seqs=7,
        max_model_len=99,
        gpu_memory_utilization=0.25,
        dtype="bfloat16",
        enforce_eager=False,
        attention_backend="TRITON_ATTN",
        name="w",
        seed=5,
        metrics_port=9200,
    )
    seen: list[WorkerConfig] = []
    monkeypatch.setattr(worker_main, "run_worker", lambda c: seen.append(c) or 0)
    result = CliRunner().invoke(app, ["worker", *worker_main.cli_args(config)])
    assert result.exit_code == 0, result.output
    assert seen == [config]


def _pos(entries: dict[int, tuple[float, int]]) -> dict[int, SimpleNamespace]:
    return {t: SimpleNamespace(logprob=lp, rank=rank) for t, (lp, rank) in entries.items()}


def test_sampled_logprobs_picks_the_sampled_token_and_top_k() -> None:
    logprobs = [_pos({5: (-0.5, 2), 1: (-0.1, 1)}), _pos({7: (-2.0, 1)})]
    chosen, tops = sampled_logprobs([5, 7], logprobs, top=1)
    assert chosen == [-0.5, -2.0]
    assert tops == [{1: -0.1}, {7: -2.0}]
    assert sampled_logprobs([5], None, 0) == ([], None)
    assert sampled_logprobs([5], logprobs[:1], 0) == ([-0.5], None)


def test_vllm_sampling_translation() -> None:
    from vllm.sampling_params import RequestOutputKind

    s = vllm_sampling(
        p.SamplingParams(n=3, temperature=0.5, top_k=-1, max_tokens=9, stop=["x"], seed=4, logprobs=2), stream=True
    )
    assert (s.n, s.temperature, s.max_tokens, s.seed, s.logprobs) == (3, 0.5, 9, 4, 2)
    assert s.stop == ["x"] and s.output_kind == RequestOutputKind.DELTA
    assert vllm_sampling(p.SamplingParams(), stream=False).output_kind == RequestOutputKind.FINAL_ONLY


def test_engine_args_asks_for_processed_logprobs() -> None:
    args = engine_args(WorkerConfig(model="/m", max_num_seqs=8, attention_backend=None))
    assert args.model == "/m" and args.max_num_seqs == 8
    assert args.logprobs_mode == "processed_logprobs"
