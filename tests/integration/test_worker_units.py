"""Worker pieces that need vLLM imported (not an engine): the translation into vLLM's arguments."""

from __future__ import annotations

import subprocess
from pathlib import Path

from zmq_rollout import protocol as p
from zmq_rollout.config import WorkerConfig
from zmq_rollout.workers.engine import engine_args
from zmq_rollout.workers.main import worker_command
from zmq_rollout.workers.sampling import vllm_sampling


def test_vllm_sampling_translation() -> None:
    from vllm.sampling_params import RequestOutputKind

    s = vllm_sampling(
        p.SamplingParams(n=3, temperature=0.5, top_k=-1, max_tokens=9, stop=["x"], seed=4, logprobs=2), stream=True
    )
    assert (s.n, s.temperature, s.max_tokens, s.seed, s.logprobs) == (3, 0.5, 9, 4, 2)
    assert s.stop == ["x"] and s.output_kind == RequestOutputKind.DELTA
    assert vllm_sampling(p.SamplingParams(), stream=False).output_kind == RequestOutputKind.FINAL_ONLY
    assert (s.include_stop_str_in_output, s.skip_special_tokens) == (False, True)
    kept = vllm_sampling(p.SamplingParams(include_stop_str_in_output=True, skip_special_tokens=False), stream=False)
    assert (kept.include_stop_str_in_output, kept.skip_special_tokens) == (True, False)
    rich = vllm_sampling(
        p.SamplingParams(
            max_tokens=9, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=-0.4,
            stop_token_ids=[7], min_tokens=2, logit_bias={5: 1.5}, structured=p.StructuredOutput(choice=["a", "b"]),
        ),
        stream=False,
    )  # fmt: skip
    assert (rich.min_p, rich.repetition_penalty, rich.presence_penalty, rich.frequency_penalty) == (0.1, 1.2, 0.3, -0.4)
    assert (rich.stop_token_ids, rich.min_tokens, rich.logit_bias) == ([7], 2, {5: 1.5})
    assert rich.structured_outputs is not None and rich.structured_outputs.choice == ["a", "b"]


def test_engine_args_asks_for_processed_logprobs_and_sizes_the_kv_cache() -> None:
    args = engine_args(WorkerConfig(model="/m", max_num_seqs=8, attention_backend=None))
    assert args.model == "/m" and args.max_num_seqs == 8
    assert args.logprobs_mode == "processed_logprobs"
    # On a CPU a fixed 2 GiB (not half the RAM per engine, which OOMs two workers on one machine).
    assert args.kv_cache_memory_bytes == 2 << 30
    assert engine_args(WorkerConfig(model="/m", kv_cache_gib=0.5)).kv_cache_memory_bytes == 1 << 29


def test_an_engine_that_cannot_start_is_named_with_its_likely_causes(tmp_path: Path) -> None:
    """A folder that is no model: the worker exits 5 (EXIT_ENGINE_START) at once, and its log
    says what to check, not only vLLM's "Engine core initialization failed"."""
    command = [*worker_command(WorkerConfig(broker="tcp://127.0.0.1:9", model=str(tmp_path))), "--verbose"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 5, out.stderr[-3000:]
    assert "did not start" in out.stderr and "--model is not a local model folder" in out.stderr
    assert "--kv-cache-gib" in out.stderr
