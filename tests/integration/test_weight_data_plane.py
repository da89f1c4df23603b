"""The weight-sync data plane: bucket packing, and weights pushed into a REAL vLLM CPU engine.

The proof that a sync works: change every weight of the tiny model in Hugging Face
transformers, push the result into a running engine (over shared memory, then over a gloo
collective), and check that the engine now computes what transformers computes with the
new weights: the same greedy tokens and the same logprobs of sampled tokens, where before
the sync it did not. One engine serves the module; it runs on an event loop in a thread.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import psutil
import pytest
import torch
from model_helpers import trained_model

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.weight_sync.buckets import Bucket, named_tensors, pack, plan_buckets, tensor_specs
from zmq_rollout.weight_sync.collective import CollectiveGroup
from zmq_rollout.weight_sync.shm import ShmBuffers

EXTENSION = "zmq_rollout.workers.extension.WeightSyncExtension"
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(5 + i % 7)] for i in range(12)]
NUM_TOKENS = 16
BUCKET_BYTES = 64 << 10  # the tiny model (~0.7 MB) travels in about a dozen buckets
MiB = 1 << 20


# =========================================================================================
# A real engine
# =========================================================================================


class LoopThread:
    """An event loop in a daemon thread; the engine lives on it and tests submit to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class EngineHandle:
    def __init__(self, llm: Any, loop: LoopThread, worker: psutil.Process) -> None:
        self.llm = llm
        self.loop = loop
        self.worker = worker

    def rpc(self, method: str, *args: Any) -> Any:
        (result,) = self.loop.run(self.llm.collective_rpc(method, timeout=120, args=args))
        return result

    def step(self, op: p.SyncOp) -> Any:
        """A data step in the engine, as the worker forwards it: the test process is rank 0,
        the engine's one worker process rank 1 of 2."""
        return self.rpc("zr_sync", control(op))

    def rss(self) -> int:
        return int(self.worker.memory_info().rss)


def _vllm_workers() -> set[psutil.Process]:
    """vLLM worker processes under this one (named by setproctitle)."""
    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if "VLLM::Worker" in proc.name() + " ".join(proc.cmdline()[:1]):
                found.add(proc)
        except psutil.Error:
            pass
    return found


def control(op: p.SyncOp) -> bytes:
    return codec.encode_body(p.Control(1, op, rank_offset=1, world_size=2))


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[EngineHandle]:
    from zmq_rollout.config import WorkerConfig
    from zmq_rollout.workers.engine import engine_args

    config = WorkerConfig(
        model=tiny_model, max_model_len=256, max_num_seqs=16, dtype="bfloat16", gpu_memory_utilization=0.05
    )
    args = engine_args(config)
    args.worker_extension_cls = EXTENSION
    if hasattr(args, "kv_cache_memory_bytes"):
        args.kv_cache_memory_bytes = 64 * MiB

    async def build() -> Any:  # on the loop, so the engine's output handler runs there
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(args)

    async def shutdown(llm: Any) -> None:
        # Stop the output handler first, so it does not report the engine's exit as a death.
        handler = getattr(llm, "output_handler", None)
        if handler is not None:
            handler.cancel()
            await asyncio.sleep(0)
        llm.shutdown()

    loop = LoopThread()
    before = _vllm_workers()
    llm = loop.run(build())
    try:
        (worker,) = _vllm_workers() - before  # this engine's one worker (TP 1)
        yield EngineHandle(llm, loop, worker)
    finally:
        loop.run(shutdown(llm), timeout=60)
        loop.close()
        del llm
        gc.collect()  # now, not in an interpreter that is shutting down


# -- the trainer's side: a changed copy of the model in transformers ----------------------


def hf_greedy(model: Any) -> list[list[int]]:
    outs = []
    for ids in PROMPTS:
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NUM_TOKENS, pad_token_id=256)
        outs.append(out[0, len(ids) :].tolist())
    return outs


def hf_logprobs(model: Any, tokens: list[list[int]]) -> list[list[float]]:
    """transformers' log-softmax at the given continuation tokens of each prompt."""
    out = []
    with torch.no_grad():
        for ids, toks in zip(PROMPTS, tokens, strict=True):
            logits = model(torch.tensor([ids + toks])).logits[0, len(ids) - 1 : -1].float()
            out.append(logits.log_softmax(-1).gather(1, torch.tensor(toks)[:, None])[:, 0].tolist())
    return out


# -- the engine's side ---------------------------------------------------------------------


async def _generate(llm: Any, params: Callable[[int], Any], tag: str) -> list[tuple[list[int], list[float]]]:
    async def one(i: int, ids: list[int]) -> tuple[list[int], list[float]]:
        final = None
        async for out in llm.generate({"prompt_token_ids": ids}, params(i), f"{tag}-{i}"):
            final = out
        comp = final.outputs[0]
        lps = [d[t].logprob for d, t in zip(comp.logprobs, comp.token_ids, strict=True)] if comp.logprobs else []
        return list(comp.token_ids), lps

    return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(PROMPTS)))


_tags = iter(range(10**6))


def vllm_greedy(engine: EngineHandle) -> list[list[int]]:
    from vllm import SamplingParams

    def params(_: int) -> Any:
        return SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)

    return [toks for toks, _ in engine.loop.run(_generate(engine.llm, params, f"greedy{next(_tags)}"))]


def vllm_sampled(engine: EngineHandle, seed: int) -> tuple[list[list[int]], list[list[float]]]:
    """Sampled tokens (temperature 1, seeded) and the logprobs vLLM reports for them."""
    from vllm import SamplingParams

    def params(i: int) -> Any:
        return SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0, seed=seed * 100 + i)

    outs = engine.loop.run(_generate(engine.llm, params, f"sampled{next(_tags)}"))
    return [t for t, _ in outs], [lp for _, lp in outs]


def compare(engine: EngineHandle, model: Any, seed: int, report: bool = True) -> tuple[int, float]:
    """(prompts whose greedy tokens match transformers', max |logprob difference|).

    With ``report``, prints where the greedy outputs part and asserts that each parting is a
    near tie: transformers' logit for its own token beats vLLM's token by little (bf16; the
    CPU kernels round differently).
    """
    expected = hf_greedy(model)
    got = vllm_greedy(engine)
    same = sum(a == b for a, b in zip(got, expected, strict=True))
    tokens, lps = vllm_sampled(engine, seed)
    ref = hf_logprobs(model, tokens)
    diff = max(abs(a - b) for x, y in zip(lps, ref, strict=True) for a, b in zip(x, y, strict=True))
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if report and a != b:
            k = next(k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            with torch.no_grad():
                logits = model(torch.tensor([PROMPTS[i] + b[:k]])).logits[0, -1].float()
            margin = float(logits[b[k]] - logits[a[k]])
            print(f"  prompt {i}: greedy parts at token {k}: vLLM {a[k]}, transformers {b[k]} (margin {margin:.4f})")
            assert margin < 0.1, f"prompt {i}: not a near tie"
    return same, diff


def sync_shm(engine: EngineHandle, model: Any, shm: ShmBuffers, buckets: list[Bucket]) -> int:
    """One round over shared memory: begin, a bucket per segment in turn, finish."""
    tensors = dict(named_tensors(model))
    engine.step(p.BeginUpdate())
    for bucket in buckets:
        slot = bucket.index % len(shm.names)
        pack(bucket, tensors, shm.tensor(slot))
        assert engine.step(p.LoadShm(shm.names[slot], bucket)) == len(bucket.tensors)
    loaded = engine.step(p.FinishUpdate())
    assert engine.loop.run(engine.llm.reset_prefix_cache())
    return int(loaded)


def sync_collective(engine: EngineHandle, model: Any, group: CollectiveGroup, buckets: list[Bucket]) -> int:
    """One round over the collective: the worker's RPC blocks in the broadcast the trainer runs."""
    tensors = dict(named_tensors(model))
    send = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8)

    async def bucket_round(bucket: Bucket) -> int:
        receive = engine.llm.collective_rpc("zr_sync", timeout=120, args=(control(p.ReceiveBucket(bucket)),))
        (n,), _ = await asyncio.gather(receive, asyncio.to_thread(group.broadcast, send[: bucket.nbytes]))
        return int(n)

    engine.step(p.BeginUpdate())
    for bucket in buckets:
        pack(bucket, tensors, send)
        assert engine.loop.run(bucket_round(bucket)) == len(bucket.tensors)
    loaded = engine.step(p.FinishUpdate())
    assert engine.loop.run(engine.llm.reset_prefix_cache())
    return int(loaded)


def join_group(engine: EngineHandle, name: str) -> CollectiveGroup:
    """The test process is rank 0 (hosting the store); the engine's worker joins as rank 1
    (``rank_offset`` 1 + its rank within the engine, 0)."""
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]

    async def both() -> CollectiveGroup:
        op = p.JoinGroup("127.0.0.1", port, "gloo", 60.0, name)
        join = engine.llm.collective_rpc("zr_sync", timeout=120, args=(control(op),))
        master = asyncio.to_thread(
            CollectiveGroup, "127.0.0.1", port, 0, 2, "gloo", 60.0, name, is_master=True, listen_socket=sock
        )
        _, group = await asyncio.gather(join, master)
        return group

    return engine.loop.run(both())


def plan(model: Any) -> list[Bucket]:
    return plan_buckets(tensor_specs(named_tensors(model)), BUCKET_BYTES)


def check_checksums(engine: EngineHandle, model: Any) -> None:
    """vLLM's norm gains and (fused) qkv biases sum to what the trainer sent."""
    hf = {name: t.float().sum().item() for name, t in named_tensors(model)}
    sums = engine.rpc("zr_checksum", None)
    norms = [n for n in sums if "norm" in n]
    assert len(norms) == 5
    for name in norms:
        assert sums[name] == pytest.approx(hf[name], rel=1e-4, abs=1e-3), name
    for layer in (0, 1):
        qkv = sum(hf[f"model.layers.{layer}.self_attn.{p}_proj.bias"] for p in "qkv")
        assert sums[f"model.layers.{layer}.self_attn.qkv_proj.bias"] == pytest.approx(qkv, rel=1e-4, abs=1e-3)


# -- the proofs ----------------------------------------------------------------------------


def test_sync_over_shared_memory_makes_vllm_compute_the_new_model(engine: EngineHandle, tiny_model: str) -> None:
    model = trained_model(tiny_model, seed=1)
    same_before, diff_before = compare(engine, model, seed=11, report=False)
    buckets = plan(model)
    assert len(buckets) > 5 and any(b.nbytes > BUCKET_BYTES for b in buckets)
    with ShmBuffers(max(b.nbytes for b in buckets)) as shm:
        start = time.perf_counter()
        loaded = sync_shm(engine, model, shm, buckets)
        seconds = time.perf_counter() - start
    same, diff = compare(engine, model, seed=12)
    print(
        f"\nshm: {len(buckets)} buckets, {loaded} tensors in {seconds:.3f} s; greedy equal to transformers "
        f"{same_before}/12 before, {same}/12 after; max |logprob diff| {diff_before:.3f} before, {diff:.4f} after"
    )
    assert loaded == len(named_tensors(model))
    assert same_before <= 4, "the engine already computed the new model before the sync"
    assert diff_before > 0.5
    assert same >= 10
    assert diff < 0.05
    check_checksums(engine, model)


def test_sync_over_gloo_makes_vllm_compute_the_new_model(engine: EngineHandle, tiny_model: str) -> None:
    model = trained_model(tiny_model, seed=2)
    same_before, diff_before = compare(engine, model, seed=21, report=False)
    buckets = plan(model)
    group = join_group(engine, "zr-proof")
    try:
        start = time.perf_counter()
        loaded = sync_collective(engine, model, group, buckets)
        seconds = time.perf_counter() - start
    finally:
        engine.step(p.LeaveGroup())
        group.close()
    same, diff = compare(engine, model, seed=22)
    print(
        f"\ngloo: {len(buckets)} buckets, {loaded} tensors in {seconds:.3f} s; greedy equal to transformers "
        f"{same_before}/12 before, {same}/12 after; max |logprob diff| {diff_before:.3f} before, {diff:.4f} after"
    )
    assert loaded == len(named_tensors(model))
    assert same_before <= 4
    assert diff_before > 0.5
    assert same >= 10
    assert diff < 0.05
    check_checksums(engine, model)


def test_worker_memory_stays_flat_over_many_syncs(engine: EngineHandle, tiny_model: str) -> None:
    models = [trained_model(tiny_model, seed=s) for s in (3, 4)]
    buckets = plan(models[0])
    rounds = 20

    def measure(sync: Any) -> tuple[int, int, float]:
        sync(models[0])
        gc.collect()
        first = engine.rss()
        start = time.perf_counter()
        for i in range(rounds):
            sync(models[i % 2])
        per_sync = (time.perf_counter() - start) / rounds
        return first, engine.rss(), per_sync

    with ShmBuffers(max(b.nbytes for b in buckets)) as shm:
        shm_first, shm_last, shm_s = measure(lambda m: sync_shm(engine, m, shm, buckets))
        mapped = [m.path for m in engine.worker.memory_maps() if "/zr-" in m.path]
        assert not mapped, f"the worker still maps {mapped}"  # each segment was unmapped after its bucket
    group = join_group(engine, "zr-memory")
    try:
        gloo_first, gloo_last, gloo_s = measure(lambda m: sync_collective(engine, m, group, buckets))
    finally:
        engine.step(p.LeaveGroup())
        group.close()
    print(
        f"\nworker RSS over {rounds} syncs: shm {shm_first / MiB:.1f} -> {shm_last / MiB:.1f} MiB "
        f"({shm_s * 1000:.1f} ms/sync), gloo {gloo_first / MiB:.1f} -> {gloo_last / MiB:.1f} MiB "
        f"({gloo_s * 1000:.1f} ms/sync)"
    )
    assert shm_last - shm_first < 64 * MiB
    assert gloo_last - gloo_first < 64 * MiB
    assert gloo_last - shm_first < 64 * MiB
    # The last round pushed models[1]: the engine computes it.
    same, diff = compare(engine, models[1], seed=31)
    assert same >= 10 and diff < 0.05
