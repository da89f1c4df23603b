"""Worker pieces that need vLLM imported (not an engine): the translation into vLLM's arguments."""

from __future__ import annotations

from zmq_rollout import protocol as p
from zmq_rollout.config import WorkerConfig
from zmq_rollout.workers.engine import engine_args
from zmq_rollout.workers.sampling import vllm_sampling


def test_vllm_sampling_translation() -> None:
    from vllm.sampling_params import RequestOutputKind

    s = vllm_sampling(
        p.SamplingParams(n=3, temperature=0.5, top_k=-1, max_tokens=9, stop=["x"], seed=4, logprobs=2), stream=True
    )
    assert (s.n, s.temperature, s.max_tokens, s.seed, s.logprobs) == (3, 0.5, 9, 4, 2)
    assert s.stop == ["x"] and s.output_kind == RequestOutputKind.DELTA
    assert vllm_sampling(p.SamplingParams(), stream=False).output_kind == RequestOutputKind.FINAL_ONLY


def test_engine_args_asks_for_processed_logprobs_and_sizes_the_kv_cache() -> None:
    args = engine_args(WorkerConfig(model="/m", max_num_seqs=8, attention_backend=None))
    assert args.model == "/m" and args.max_num_seqs == 8
    assert args.logprobs_mode == "processed_logprobs"
    assert args.kv_cache_memory_bytes is None  # vLLM sizes it from gpu_memory_utilization
    assert engine_args(WorkerConfig(model="/m", kv_cache_gib=0.5)).kv_cache_memory_bytes == 1 << 29
