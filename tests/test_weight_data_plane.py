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

import msgspec
import psutil
import pytest
import torch
from model_helpers import trained_model

from zmq_rollout.weights import (
    Bucket,
    CollectiveGroup,
    ShmBuffers,
    TensorMeta,
    attach_shm,
    named_tensors,
    pack,
    plan_buckets,
    tensor_specs,
    unpack,
)

EXTENSION = "zmq_rollout.workers.extension.WeightSyncExtension"
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(5 + i % 7)] for i in range(12)]
NUM_TOKENS = 16
BUCKET_BYTES = 64 << 10  # the tiny model (~0.7 MB) travels in about a dozen buckets
MiB = 1 << 20


# =========================================================================================
# Buckets: plan, pack, unpack (no engine)
# =========================================================================================


def test_plan_buckets_is_greedy_in_order_and_aligned() -> None:
    specs = [("a", "float32", [10]), ("b", "bfloat16", [3, 5]), ("c", "int8", [7]), ("d", "float64", [2])]
    buckets = plan_buckets(specs, bucket_bytes=1024, align=64)
    assert len(buckets) == 1
    metas = buckets[0].tensors
    assert [m.name for m in metas] == ["a", "b", "c", "d"]
    assert [m.offset for m in metas] == [0, 64, 128, 192]
    assert [m.nbytes for m in metas] == [40, 30, 7, 16]
    assert buckets[0].nbytes == 208


def test_plan_buckets_splits_and_gives_a_big_tensor_its_own_bucket() -> None:
    specs = [("a", "float32", [100]), ("big", "float32", [1000]), ("b", "float32", [100]), ("c", "float32", [100])]
    buckets = plan_buckets(specs, bucket_bytes=1000)
    assert [[m.name for m in b.tensors] for b in buckets] == [["a"], ["big"], ["b", "c"]]
    assert [b.index for b in buckets] == [0, 1, 2]
    assert buckets[1].nbytes == 4000  # larger than bucket_bytes: alone
    assert [m.offset for m in buckets[2].tensors] == [0, 512]
    with pytest.raises(ValueError, match="power of two"):
        plan_buckets(specs, 1000, align=48)
    with pytest.raises(ValueError, match="complex64"):
        plan_buckets([("z", "complex64", [1])], 1000)


def test_pack_unpack_round_trip_several_dtypes() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "f32": torch.randn(5, generator=g),
        "f16": torch.randn(2, 2, 2, generator=g).to(torch.float16),
        "i64": torch.arange(9, dtype=torch.int64).reshape(3, 3),
        "i8": torch.arange(-5, 6, dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
        "big": torch.randn(300, generator=g),
    }
    buckets = plan_buckets(tensor_specs(tensors.items()), bucket_bytes=256, align=32)
    assert len(buckets) > 2 and any(m.name == "big" for m in buckets[-1].tensors)
    out: dict[str, torch.Tensor] = {}
    for planned in buckets:
        # Over the wire the bucket is plain msgpack, as the control plane sends it.
        bucket = msgspec.msgpack.decode(msgspec.msgpack.encode(planned), type=Bucket)
        buf = torch.full((max(b.nbytes for b in buckets),), 0xAB, dtype=torch.uint8)
        pack(bucket, tensors, buf)
        for name, view in unpack(bucket, buf):
            assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # zero copy
            assert all(m.offset % 32 == 0 for m in bucket.tensors)
            out[name] = view.clone()
    assert out.keys() == tensors.keys()
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name


def test_pack_rejects_a_tensor_that_does_not_match_the_plan() -> None:
    bucket = Bucket(0, 8, [TensorMeta("x", "float32", [2], 0, 8)])
    with pytest.raises(ValueError, match="planned for float32"):
        pack(bucket, {"x": torch.zeros(2, dtype=torch.float16)}, torch.empty(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="at least 8 bytes"):
        pack(bucket, {"x": torch.zeros(2)}, torch.empty(4, dtype=torch.uint8))


def test_named_tensors_sends_tied_weights_once() -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    model = torch.nn.ModuleDict({"embed": emb, "head": head, "norm": torch.nn.LayerNorm(4)})
    model["head"].weight = emb.weight
    names = [name for name, _ in named_tensors(model)]
    assert names == ["embed.weight", "norm.weight", "norm.bias"]
    assert [n for n, _ in named_tensors([("a", torch.zeros(1))])] == ["a"]


def test_shm_buffers_round_trip_without_unlinking_on_attach(caplog: pytest.LogCaptureFixture) -> None:
    with ShmBuffers(4096, n=2) as shm:
        assert len(set(shm.names)) == 2 and all(n.startswith("zr-") for n in shm.names)
        shm.tensor(1)[:5] = torch.arange(5, dtype=torch.uint8)
        with attach_shm(shm.names[1]) as seen:
            assert seen.numel() == 4096
            assert seen[:5].tolist() == [0, 1, 2, 3, 4]
            seen[5] = 9
            del seen
        with attach_shm(shm.names[1]) as seen:  # still there after a detach
            assert int(seen[5]) == 9
            del seen
        names = shm.names
    assert "outlives" not in caplog.text  # every mapping was closed, none deferred
    with pytest.raises(FileNotFoundError), attach_shm(names[0]):
        pass


def test_a_view_that_outlives_its_shared_memory_stays_valid(caplog: pytest.LogCaptureFixture) -> None:
    shm = ShmBuffers(4096, n=1)
    kept = shm.tensor(0)[:8]
    with attach_shm(shm.names[0]) as seen:
        escaped = seen[:8]
        del seen
    assert "outlives its attachment" in caplog.text
    shm.close()  # unlinked; both mappings stay until their views go
    assert "outlives close()" in caplog.text
    kept[:] = 7
    assert escaped.tolist() == [7] * 8


def test_collective_group_gloo_in_threads() -> None:
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    groups: dict[int, CollectiveGroup] = {}

    def join(rank: int) -> None:
        kwargs: dict[str, Any] = {"listen_socket": sock} if rank == 0 else {}
        groups[rank] = CollectiveGroup("127.0.0.1", port, rank, 2, "gloo", 30, "unit", rank == 0, **kwargs)

    threads = [threading.Thread(target=join, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        received = torch.zeros(1000, dtype=torch.uint8)
        sent = torch.arange(1000).to(torch.uint8)
        t = threading.Thread(target=groups[1].broadcast, args=(received,))
        t.start()
        groups[0].broadcast(sent)
        t.join(30)
        assert torch.equal(received, sent)
    finally:
        for g in groups.values():
            g.close()


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

    def rss(self) -> int:
        return int(self.worker.memory_info().rss)


def _vllm_workers() -> set[psutil.Process]:
    """vLLM worker processes under this one (named by setproctitle)."""
    found = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "VLLM::Worker" in p.name() + " ".join(p.cmdline()[:1]):
                found.add(p)
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from zmq_rollout.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen2"))


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
    engine.rpc("zr_begin_update")
    for bucket in buckets:
        slot = bucket.index % len(shm.names)
        pack(bucket, tensors, shm.tensor(slot))
        # A Bucket, or plain lists as from msgpack: the worker takes either.
        wire = bucket if bucket.index % 2 else msgspec.to_builtins(bucket)
        assert engine.rpc("zr_load_shm", shm.names[slot], wire) == len(bucket.tensors)
    loaded = engine.rpc("zr_finish_update")
    assert engine.loop.run(engine.llm.reset_prefix_cache())
    return int(loaded)


def sync_collective(engine: EngineHandle, model: Any, group: CollectiveGroup, buckets: list[Bucket]) -> int:
    """One round over the collective: the worker's RPC blocks in the broadcast the trainer runs."""
    tensors = dict(named_tensors(model))
    send = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8)

    async def bucket_round(bucket: Bucket) -> int:
        receive = engine.llm.collective_rpc("zr_receive_bucket", timeout=120, args=(msgspec.to_builtins(bucket),))
        (n,), _ = await asyncio.gather(receive, asyncio.to_thread(group.broadcast, send[: bucket.nbytes]))
        return int(n)

    engine.rpc("zr_begin_update")
    for bucket in buckets:
        pack(bucket, tensors, send)
        assert engine.loop.run(bucket_round(bucket)) == len(bucket.tensors)
    loaded = engine.rpc("zr_finish_update")
    assert engine.loop.run(engine.llm.reset_prefix_cache())
    return int(loaded)


def join_group(engine: EngineHandle, name: str, rank_offset: int | None = None) -> CollectiveGroup:
    """The test process is rank 0 (hosting the store); the engine's worker joins as rank 1,
    given as such or as ``rank_offset`` + its rank within the engine (0)."""
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    rank = None if rank_offset is not None else 1

    async def both() -> CollectiveGroup:
        worker_args = ("127.0.0.1", port, rank, 2, "gloo", 60.0, name, rank_offset)
        join = engine.llm.collective_rpc("zr_join_group", timeout=120, args=worker_args)
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


@pytest.mark.slow
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


@pytest.mark.slow
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
        engine.rpc("zr_leave_group")
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


@pytest.mark.slow
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
    group = join_group(engine, "zr-memory", rank_offset=1)
    try:
        gloo_first, gloo_last, gloo_s = measure(lambda m: sync_collective(engine, m, group, buckets))
    finally:
        engine.rpc("zr_leave_group")
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
