"""How fast each way of copying a model's tensors to or from one flat GPU buffer is.

The copies a cuda_ipc weight sync makes (the trainer packs its tensors into a buffer, a
worker copies them out into vLLM's parameters), timed on one GPU for a model shape of
``benchmarks/weight_sync.py``: one flat copy of the same bytes (the bound), ``_foreach_copy_``
over byte views (the old pack), over typed views (the pack now, and a worker's load), and
one ``copy_`` per tensor. Prints one line per path and a ``RESULT {json}`` line.

    python benchmarks/gpu/copy_paths.py --shape 7b
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weight_sync import SHAPES


def tensors_of(shape: dict[str, int]) -> list[torch.Tensor]:
    """Empty bf16 tensors of a Qwen2 of ``shape``, in checkpoint order (tied embeddings)."""
    h, i, v, n = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = [(h, h), (h,), (kv, h), (kv,), (kv, h), (kv,), (h, h), (i, h), (i, h), (h, i), (h,), (h,)]
    shapes = [(v, h)] + per_layer * n + [(h,)]
    return [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes]


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    params = tensors_of(SHAPES[args.shape])
    offsets, end = [], 0
    for t in params:
        offsets.append(end)
        end = -(-(end + t.numel() * 2) // 256) * 256
    flat = torch.empty(end, dtype=torch.uint8, device="cuda")
    other = torch.empty_like(flat)
    typed = [
        flat[o : o + t.numel() * 2].view(torch.bfloat16).view(t.shape) for o, t in zip(offsets, params, strict=True)
    ]
    raw = [flat[o : o + t.numel() * 2] for o, t in zip(offsets, params, strict=True)]
    nbytes = sum(t.numel() * 2 for t in params)

    def per_tensor_in() -> None:
        for d, s in zip(typed, params, strict=True):
            d.copy_(s)

    def per_tensor_out() -> None:
        for d, s in zip(params, typed, strict=True):
            d.copy_(s)

    big = [k for k, t in enumerate(params) if t.numel() * 2 >= 1 << 20]
    small = [k for k in range(len(params)) if k not in set(big)]

    def mixed_out() -> None:
        for k in big:
            params[k].copy_(typed[k])
        torch._foreach_copy_([params[k] for k in small], [typed[k] for k in small])

    paths = {
        "flat copy": lambda: other.copy_(flat),
        "pack: foreach, byte views (before)": lambda: torch._foreach_copy_(
            raw, [t.reshape(-1).view(torch.uint8) for t in params]
        ),
        "pack: foreach, typed views": lambda: torch._foreach_copy_(typed, params),
        "pack: copy_ per tensor": per_tensor_in,
        "load: foreach, typed views": lambda: torch._foreach_copy_(params, typed),
        "load: copy_ per tensor": per_tensor_out,
        "load: copy_ per tensor >= 1 MiB, foreach the rest": mixed_out,
    }
    results = {}
    print(f"{args.shape}: {len(params)} tensors, {nbytes / 1e9:.3f} GB")
    for name, fn in paths.items():
        sec = timed(fn, args.reps)
        results[name] = {"ms": sec * 1e3, "gbps": nbytes / sec / 1e9}
        print(f"  {name:<48} {sec * 1e3:8.2f} ms  {nbytes / sec / 1e9:8.1f} GB/s")
    print("RESULT " + json.dumps({"shape": args.shape, "bytes": nbytes, "paths": results}))


if __name__ == "__main__":
    main()
