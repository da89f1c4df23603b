"""Buckets: how a model's tensors are cut into contiguous buffers, packed and unpacked.

A round of weight sync ships every tensor of the trainer's model to each engine, a
*bucket* at a time. A bucket is one contiguous byte buffer plus a list of ``TensorMeta``
saying where each tensor lies in it (both are wire Structs, ``zmq_rollout.protocol.steps``):
``plan_buckets`` cuts the model into buckets, ``pack`` fills a buffer, ``unpack`` turns one
back into zero-copy tensor views. Transports only ever move one bucket's buffer.

torch is imported inside functions: importing this module is cheap.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from zmq_rollout.protocol.steps import DTYPE_SIZES, Bucket, TensorMeta

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPE_SIZES",
    "Bucket",
    "TensorMeta",
    "copy_split",
    "dtype_name",
    "named_tensors",
    "pack",
    "plan_buckets",
    "plan_buckets_cached",
    "split_copies",
    "tensor_specs",
    "unpack",
]


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_PLANS: dict[Any, list[Bucket]] = {}


def plan_buckets_cached(
    named_shapes: list[tuple[str, str, list[int]]], bucket_bytes: int, align: int = 256
) -> list[Bucket]:
    """``plan_buckets``, remembered for the last few layouts: a trainer that syncs the same
    model every step plans it once (the buckets are only read, never changed)."""
    key = (bucket_bytes, align, tuple((n, d, tuple(s)) for n, d, s in named_shapes))
    buckets = _PLANS.get(key)
    if buckets is None:
        buckets = plan_buckets(named_shapes, bucket_bytes, align)
        if len(_PLANS) >= 8:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = buckets
    return buckets


def plan_buckets(named_shapes: list[tuple[str, str, list[int]]], bucket_bytes: int, align: int = 256) -> list[Bucket]:
    """Cut ``(name, dtype, shape)`` into buckets of at most ``bucket_bytes``, greedily and in order.

    Every offset is a multiple of ``align`` (a power of two, which also makes every view
    aligned for its dtype). A tensor larger than ``bucket_bytes`` gets a bucket of its own,
    so a buffer must hold ``max(b.nbytes for b in buckets)``, which can exceed ``bucket_bytes``.
    Keeping the trainer's order keeps a layer's tensors together, which is what vLLM's
    layerwise reload wants (it processes a layer once all its weights have arrived).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    buckets: list[Bucket] = []
    current: list[TensorMeta] = []
    end = 0
    for name, dtype, shape in named_shapes:
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {name!r} has dtype {dtype!r}, which weight sync does not carry")
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        offset = -(-end // align) * align
        if current and offset + nbytes > bucket_bytes:
            buckets.append(Bucket(len(buckets), end, current))
            current, offset = [], 0
        current.append(TensorMeta(name, dtype, list(shape), offset, nbytes))
        end = offset + nbytes
    if current:
        buckets.append(Bucket(len(buckets), end, current))
    return buckets


def named_tensors(source: Any) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of a ``torch.nn.Module`` or of any iterable of such pairs.

    For a module: its ``state_dict()`` (parameters and persistent buffers, detached), with
    tied weights sent once, under the first name (e.g. ``model.embed_tokens.weight`` and
    not ``lm_head.weight``; vLLM's ``load_weights`` skips the tied name).
    """
    import torch

    if isinstance(source, torch.nn.Module):
        seen: set[tuple[int, int, tuple[int, ...]]] = set()
        out: list[tuple[str, torch.Tensor]] = []
        for name, tensor in source.state_dict(keep_vars=False).items():
            key = (tensor.data_ptr(), tensor.numel(), tuple(tensor.shape))
            if tensor.numel() and key in seen:
                continue
            seen.add(key)
            out.append((name, tensor))
        return out
    return [(str(name), tensor) for name, tensor in source]


def tensor_specs(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int]]]:
    """``(name, dtype, shape)`` of each tensor: what ``plan_buckets`` takes."""
    return [(name, dtype_name(t.dtype), list(t.shape)) for name, t in tensors]


def pack(bucket: Bucket, tensors_by_name: dict[str, torch.Tensor], out_uint8: torch.Tensor) -> None:
    """Copy each of ``bucket``'s tensors to its bytes of ``out_uint8`` (any device: copied there)."""
    import torch

    if out_uint8.dtype != torch.uint8 or out_uint8.dim() != 1 or out_uint8.numel() < bucket.nbytes:
        raise ValueError(f"bucket {bucket.index} needs a 1-D uint8 buffer of at least {bucket.nbytes} bytes")
    for meta in bucket.tensors:
        tensor = tensors_by_name[meta.name]
        if dtype_name(tensor.dtype) != meta.dtype or list(tensor.shape) != meta.shape:
            raise ValueError(
                f"tensor {meta.name!r} is {dtype_name(tensor.dtype)}{list(tensor.shape)}, "
                f"but bucket {bucket.index} was planned for {meta.dtype}{meta.shape}"
            )
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        out_uint8[meta.offset : meta.offset + meta.nbytes].copy_(raw)


def unpack(bucket: Bucket, buf_uint8: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into ``buf_uint8`` (no copy): valid while the buffer is."""
    import torch

    if buf_uint8.numel() < bucket.nbytes:
        raise ValueError(f"bucket {bucket.index} needs {bucket.nbytes} bytes, the buffer has {buf_uint8.numel()}")
    return [
        (m.name, buf_uint8[m.offset : m.offset + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape))
        for m in bucket.tensors
    ]


BIG_COPY_BYTES = 1 << 20
"""A copy at least this large gets a ``copy_`` of its own (a memcpy at nearly a flat copy's
speed on an H200); the smaller ones share one ``_foreach_copy_`` (whose kernel moves a
7B-shaped model at about 2/3 of that speed: benchmarks/gpu/copy_paths.py)."""


def split_copies(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Indices of the copies of at least ``BIG_COPY_BYTES``, and of the rest."""
    big: list[int] = []
    small: list[int] = []
    for i, d in enumerate(dsts):
        (big if d.numel() * d.element_size() >= BIG_COPY_BYTES else small).append(i)
    return big, small


def copy_split(dsts: list[torch.Tensor], srcs: list[torch.Tensor], big: list[int], small: list[int]) -> None:
    """``dst.copy_(src)`` for each pair: one ``copy_`` per big one, one foreach copy for the rest."""
    import torch

    for i in big:
        dsts[i].copy_(srcs[i])
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is not None and len(small) > 1:
        foreach_copy([dsts[i] for i in small], [srcs[i] for i in small])
        return
    for i in small:
        dsts[i].copy_(srcs[i])
