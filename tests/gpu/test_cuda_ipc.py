"""CUDA IPC weight sync on a real GPU: a trainer and a vLLM CUDA worker sharing one GPU.

The GPU tier: runs on the device machine (``benchmarks/gpu/run_gpu_e2e.sh gpu``); on a
machine with no CUDA it is skipped, with that reason (tests/conftest.py). The proof is the same as on CPU
(greedy outputs equal the trainer's after a sync, not before), plus what only a GPU shows:
the exported buffers are reused across rounds and GPU memory stays flat over 100 syncs.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import SYNC_GREEDY, SYNC_PROMPTS, hf_greedy, trained_model

from zmq_rollout import RolloutClient, SamplingParams
from zmq_rollout.config import BrokerConfig
from zmq_rollout.local import LocalCluster

PROMPTS, GREEDY = SYNC_PROMPTS, SYNC_GREEDY


@pytest.fixture(scope="module")
def client(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    config = BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*")
    overrides = {"gpus": "0", "gpu_memory_utilization": 0.2}
    logs = str(tmp_path_factory.mktemp("ipc-logs"))
    with LocalCluster(tiny_model, broker_config=config, worker_overrides=overrides, log_dir=logs) as c:  # noqa: SIM117
        with RolloutClient(c.address, timeout_s=300) as rc:
            yield rc


def greedy_equal(client: RolloutClient, model: torch.nn.Module) -> int:
    results = client.generate(PROMPTS, GREEDY)
    return sum(r.token_ids == hf_greedy(model, PROMPTS[r.prompt_index], 12) for r in results)


def gpu_used_mib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def test_cuda_ipc_sync_matches_the_trainer_and_memory_stays_flat(client: RolloutClient, tiny_model: str) -> None:
    model = trained_model(tiny_model, 11).cuda()
    before = greedy_equal(client, model)
    report = client.update_weights(model, transport="cuda_ipc", bucket_bytes=200_000, check_names=True, timeout_s=120)
    assert report.workers_updated == ["worker-0"] and report.workers_evicted == [] and report.num_buckets > 1
    after = greedy_equal(client, model)
    print(f"cuda_ipc: greedy equal {before}->{after}/{len(PROMPTS)}, sync {report.seconds * 1e3:.1f} ms")
    assert after >= len(PROMPTS) - 1 and before <= len(PROMPTS) // 2
    assert {r.weight_version for r in client.generate(PROMPTS[:2], GREEDY)} == {report.version}

    transport = client.transport
    buffers = transport.buffers  # type: ignore[union-attr]
    ids = [h.buffer_id for h in buffers.handles]
    client.update_weights(model, transport="cuda_ipc", bucket_bytes=200_000)  # warm: both buffers mapped
    start = gpu_used_mib()
    for _ in range(100):
        client.update_weights(model, transport="cuda_ipc", bucket_bytes=200_000)
    end = gpu_used_mib()
    print(f"cuda_ipc: GPU memory in use {start:.0f} -> {end:.0f} MiB over 100 syncs")
    assert client.transport is transport and transport.buffers is buffers  # type: ignore[union-attr]
    assert [h.buffer_id for h in buffers.handles] == ids
    assert end - start < 16, f"GPU memory grew by {end - start:.0f} MiB over 100 syncs"

    # A larger bucket replaces the buffers; the worker lets go of the old ones.
    report = client.update_weights(model, transport="cuda_ipc", bucket_bytes=64 << 20)
    assert report.num_buckets == 1 and transport.buffers is not buffers  # type: ignore[union-attr]
    assert greedy_equal(client, model) >= len(PROMPTS) - 1


def test_direct_load_equals_layerwise_reload(client: RolloutClient, tiny_model: str) -> None:
    """The name→slice path and vLLM's load_weights (layerwise reload) give the same outputs."""
    model = trained_model(tiny_model, 12).cuda()
    sampled = SamplingParams(temperature=1.0, max_tokens=8, seed=5, ignore_eos=True)

    def outputs() -> list[tuple[list[int], list[float]]]:
        order = lambda r: (r.prompt_index, r.index)
        results = sorted(client.generate(PROMPTS, GREEDY), key=order)
        results += sorted(client.generate(PROMPTS[:4], sampled), key=order)
        return [(r.token_ids, r.logprobs) for r in results]

    client.update_weights(model, transport="cuda_ipc", bucket_bytes=200_000, direct_load=False)
    assert greedy_equal(client, model) >= len(PROMPTS) - 1
    layerwise = outputs()
    client.update_weights(trained_model(tiny_model, 13).cuda(), transport="cuda_ipc", direct_load=True)
    assert outputs() != layerwise  # other weights: the comparison below can fail
    report = client.update_weights(model, transport="cuda_ipc", bucket_bytes=200_000, direct_load=True)
    direct = outputs()
    print(f"direct load: {report.seconds * 1e3:.1f} ms, steps {report.step_seconds}")
    assert [t for t, _ in direct] == [t for t, _ in layerwise]
    pairs = [(a, b) for (_, la), (_, lb) in zip(direct, layerwise, strict=True) for a, b in zip(la, lb, strict=True)]
    assert max(abs(a - b) for a, b in pairs) < 1e-3


def test_cuda_ipc_tensors_reads_the_trainers_own_tensors(client: RolloutClient, tiny_model: str) -> None:
    """``cuda_ipc_tensors``: the worker copies straight from the trainer's parameters, each
    storage exported once. After an in-place update the worker still serves what it copied
    (a copy, not an alias) until the next sync, which exports nothing new; memory stays flat
    over 100 syncs; a model whose tensors are all new is exported anew and served."""
    model = trained_model(tiny_model, 14).cuda()
    report = client.update_weights(model, transport="cuda_ipc_tensors", check_names=True, timeout_s=120)
    assert report.workers_updated == ["worker-0"] and report.workers_evicted == []
    assert greedy_equal(client, model) >= len(PROMPTS) - 1
    transport = client.transport
    exported = transport.num_exported  # type: ignore[union-attr]
    assert exported == len(model.state_dict()) - 1  # every tensor but the tied lm_head, a storage each

    with torch.no_grad():  # the optimizer's step: every parameter written in place
        for mine, theirs in zip(model.parameters(), trained_model(tiny_model, 15).cuda().parameters(), strict=True):
            mine.copy_(theirs)
    stale = greedy_equal(client, model)
    report = client.update_weights(model, transport="cuda_ipc_tensors")
    fresh = greedy_equal(client, model)
    print(f"cuda_ipc_tensors: greedy equal {stale}->{fresh}/{len(PROMPTS)} after an in-place update, "
          f"sync {report.seconds * 1e3:.1f} ms")  # fmt: skip
    assert stale <= len(PROMPTS) // 2 and fresh >= len(PROMPTS) - 1
    assert client.transport is transport and transport.num_exported == exported  # type: ignore[union-attr]

    start = gpu_used_mib()
    for _ in range(100):
        client.update_weights(model, transport="cuda_ipc_tensors")
    end = gpu_used_mib()
    print(f"cuda_ipc_tensors: GPU memory in use {start:.0f} -> {end:.0f} MiB over 100 syncs")
    assert end - start < 16, f"GPU memory grew by {end - start:.0f} MiB over 100 syncs"
    assert transport.num_exported == exported  # type: ignore[union-attr]

    other = trained_model(tiny_model, 11).cuda()
    client.update_weights(other, transport="cuda_ipc_tensors")
    assert greedy_equal(client, other) >= len(PROMPTS) - 1
    assert transport.num_exported == 2 * exported  # type: ignore[union-attr]
    assert set(transport.exports) == {  # type: ignore[union-attr]
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in other.state_dict().values()
    }
