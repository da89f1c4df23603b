"""The weight-sync data plane without an engine: buckets, shared memory, a gloo group in threads."""

from __future__ import annotations

import socket
import threading
from typing import Any

import msgspec
import pytest
import torch

from zmq_rollout.protocol import Bucket, TensorMeta
from zmq_rollout.weight_sync.buckets import named_tensors, pack, plan_buckets, tensor_specs, unpack
from zmq_rollout.weight_sync.collective import CollectiveGroup
from zmq_rollout.weight_sync.shm import ShmBuffers, attach_shm

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


def test_copy_split_copies_every_pair_big_ones_alone() -> None:
    from zmq_rollout.weight_sync.buckets import BIG_COPY_BYTES, copy_split, split_copies

    sizes = [BIG_COPY_BYTES // 4, 3, BIG_COPY_BYTES // 4 - 1, 5, 0]  # float32: 1 MiB, 12 B, 1 MiB - 4 B, ...
    srcs = [torch.randn(n) for n in sizes]
    dsts = [torch.zeros(n) for n in sizes]
    big, small = split_copies(dsts, srcs)
    assert big == [0] and small == [1, 2, 3, 4]
    copy_split(dsts, srcs, big, small)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
