"""The name→slice loader (``workers/direct_load.py``) on a toy model shaped like vLLM's.

The toy's ``load_weights`` does what vLLM's loaders do: fused q/k/v rows through
``narrow().copy_``, plain ``copy_``, an embedding padded past the checkpoint's vocabulary
(``fill_``), a skipped (tied) name, and one loader that transforms its tensor (which must
fall back to ``load_weights``). Replayed loads must leave the parameters exactly as a plain
``load_weights`` of the same tensors does.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from zmq_rollout import protocol as p
from zmq_rollout.workers.direct_load import DirectLoader, parameter_pointers, qualifies


class ToyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4), requires_grad=False)  # q 8 rows, k 2, v 2
        self.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)  # checkpoint has 5 rows
        self.scaled = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
        self.loads = 0

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        self.loads += 1
        rows = {"q": (0, 8), "k": (8, 2), "v": (10, 2)}
        for name, w in weights:
            if name in rows:
                start, size = rows[name]
                self.qkv.data.narrow(0, start, size).copy_(w)
            elif name == "norm":
                self.norm.data.copy_(w)
            elif name == "embed":
                self.embed[: w.shape[0]].data.copy_(w)
                self.embed[w.shape[0] :].data.fill_(0)
            elif name == "scaled":
                self.scaled.data.copy_(w * 2)  # a transformed tensor: not replayable
            elif name == "lm_head":
                continue  # tied: the loader skips it
        return set()


def checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (8, 4), "k": (2, 4), "v": (2, 4), "norm": (4,), "embed": (5, 4), "scaled": (3,), "lm_head": (5, 4)}
    return [(name, torch.randn(shape, generator=g)) for name, shape in shapes.items()]


def as_bucket(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors as views of one flat buffer, the way a bucket arrives."""
    flat = torch.cat([t.reshape(-1) for _, t in tensors])
    out, offset = [], 0
    for name, t in tensors:
        out.append((name, flat[offset : offset + t.numel()].view(t.shape)))
        offset += t.numel()
    return out


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_replayed_loads_equal_load_weights() -> None:
    direct, reference = ToyModel(), ToyModel()
    loader = DirectLoader(direct)
    for seed in range(3):  # the first records, the others replay
        tensors = as_bucket(checkpoint(seed))
        loader.load_tensors(tensors)
        reference.load_weights(tensors)
        got, want = params(direct), params(reference)
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), (seed, name)
    assert {n for n, r in loader.recipes.items() if r is None} == {"scaled"}
    assert loader.recipes["lm_head"] is not None and loader.recipes["lm_head"].copies == []
    # 7 names recorded once, then 6 replayed and 1 loaded through load_weights per round.
    assert loader.num_replayed == 12 and loader.num_loaded == 7 + 2
    assert direct.loads == 7 + 2


def test_a_changed_shape_is_recorded_again() -> None:
    model = ToyModel()
    loader = DirectLoader(model)
    loader.load_tensors(as_bucket(checkpoint(0)))
    smaller = torch.randn(3, 4)
    loader.load_tensors([("embed", smaller)])  # 3 rows now: the loader pads differently
    assert loader.recipes["embed"] is not None and loader.recipes["embed"].key[1] == (3, 4)
    assert torch.equal(model.embed[:3], smaller) and not model.embed[3:].any()


def test_stale_when_parameters_move() -> None:
    model = ToyModel()
    loader = DirectLoader(model)
    assert not loader.stale(model)
    model.norm.data = torch.zeros(4)
    assert loader.stale(model) and loader.stale(ToyModel())


def test_one_walk_gives_the_pointers_that_stale_compares() -> None:
    model = ToyModel()
    loader = DirectLoader(model)
    pointers, why_not = parameter_pointers(model)
    assert why_not == "" and not loader.stale(model, pointers)
    model.norm.data = torch.zeros(4)
    moved, _ = parameter_pointers(model)
    assert moved != pointers and loader.stale(model, moved) and loader.stale(model)
    with torch.device("meta"):
        on_meta = ToyModel()
    assert "on the meta device" in parameter_pointers(on_meta)[1]
    assert "on the meta device" in qualifies(on_meta, SimpleNamespace(quantization=None), torch.device("cuda"))


def test_unchanged_sees_any_module_or_parameter_replaced_or_moved() -> None:
    model = ToyModel()
    loader = DirectLoader(model)
    assert loader.unchanged(model) and not loader.unchanged(ToyModel())
    model.norm.data = torch.zeros(4)  # moved
    assert not loader.unchanged(model)
    model = ToyModel()
    loader = DirectLoader(model)
    model.norm = torch.nn.Parameter(model.norm.detach().clone())  # another object
    assert not loader.unchanged(model)
    model = ToyModel()
    loader = DirectLoader(model)
    model.sub = torch.nn.Linear(2, 2)  # a module that was not there
    assert loader.unchanged(model), "a new module is not ours to check; stale() walks the model"
    with torch.no_grad():
        model.norm.add_(1)  # written in place: the recipes still hold
    assert loader.unchanged(model)
    outer = torch.nn.Module()
    outer.inner = ToyModel()
    loader = DirectLoader(outer)
    assert loader.unchanged(outer)
    outer.inner = ToyModel()  # a submodule replaced
    assert not loader.unchanged(outer)


def test_only_unquantized_models_on_cuda_qualify() -> None:
    class Config:
        quantization = None

    assert "device cpu" in qualifies(ToyModel(), Config(), torch.device("cpu"))

    class Quantized:
        quantization = "fp8"

    assert "quantization fp8" in qualifies(ToyModel(), Quantized(), torch.device("cuda"))

    class FakeMethod:
        pass

    model = ToyModel()
    model.quant_method = FakeMethod()  # type: ignore[assignment]
    assert "FakeMethod" in qualifies(model, Config(), torch.device("cuda"))
    assert qualifies(ToyModel(), Config(), torch.device("cuda")) == ""


def test_a_kept_buffer_replays_a_bucket_with_one_plan() -> None:
    from zmq_rollout.weight_sync.buckets import pack, plan_buckets, tensor_specs

    direct, reference = ToyModel(), ToyModel()
    loader = DirectLoader(direct)
    first = checkpoint(0)
    (bucket,) = plan_buckets(tensor_specs(first), 1 << 20)
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
    for seed in range(3):
        tensors = checkpoint(seed)
        pack(bucket, dict(tensors), buffer)  # the trainer refills the same buffer every round
        loader.load(bucket, buffer, "buffer-1")
        reference.load_weights(tensors)
        for name, want in params(reference).items():
            assert torch.equal(params(direct)[name], want), (seed, name)
    assert len(loader._plans) == 1 and direct.loads == 7 + 2  # "scaled" still via load_weights
    loader.forget({"buffer-2"})
    assert not loader._plans


def test_tensors_read_in_place_from_several_buffers_replay_with_one_plan() -> None:
    """``load_ipc_tensors``: each of the trainer's tensors lies in a storage of its own (two
    share one here), every storage stays mapped, and the trainer updates them in place. One
    plan covers every storage; it is dropped as soon as any of them is unmapped."""
    direct, reference = ToyModel(), ToyModel()
    loader = DirectLoader(direct)
    names = [name for name, _ in checkpoint(0)]
    shared = torch.zeros(8 * 4 + 2 * 4)  # q and k in one storage, as a flat parameter would hold them
    tensors = dict(checkpoint(0))
    storages = {"q": shared[:32].view(8, 4), "k": shared[32:].view(2, 4)}
    storages.update({n: torch.zeros_like(t) for n, t in tensors.items() if n not in storages})
    parts, keys = [], []
    by_storage: dict[int, list[str]] = {}
    for name in names:
        by_storage.setdefault(storages[name].untyped_storage().data_ptr(), []).append(name)
    for i, members in enumerate(by_storage.values()):
        base = storages[members[0]].untyped_storage()
        metas = [
            p.TensorMeta(
                n, "float32", list(storages[n].shape), storages[n].storage_offset() * 4, storages[n].numel() * 4
            )
            for n in members
        ]
        parts.append((p.Bucket(i, base.nbytes(), metas), torch.empty(0, dtype=torch.uint8).set_(base)))
        keys.append(f"storage-{i}")
    assert len(parts) == len(names) - 1
    for seed in range(3):
        for name, t in checkpoint(seed):
            storages[name].copy_(t)  # the optimizer's in-place update
        loader.load_parts(parts, tuple(keys), "layout-t")
        reference.load_weights(checkpoint(seed))
        for name, want in params(reference).items():
            assert torch.equal(params(direct)[name], want), (seed, name)
    assert len(loader._plans) == 1 and direct.loads == 7 + 2  # recorded once; "scaled" via load_weights
    loader.forget(set(keys))
    assert len(loader._plans) == 1
    loader.forget(set(keys[1:]))
    assert not loader._plans, "one of its storages is being unmapped"
