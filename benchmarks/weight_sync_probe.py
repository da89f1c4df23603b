"""Benchmark probes that run inside vLLM's worker process (``worker_extension_cls``).

``LoadProbe`` is the product's ``WeightSyncExtension`` plus timing methods, so a benchmark
can measure, on the engine's own model and device, what a weight sync is made of:

- ``probe_load_weights``: vLLM's ``model.load_weights`` with HF-named tensors already on
  the device (what every rollout server's sync ends in);
- ``probe_round``: our worker path for one whole-model bucket (begin_update, load,
  finish_update), from a flat device buffer, with no transport and no broker;
- ``probe_param_copy``: a raw copy into each of vLLM's parameter tensors;
- ``probe_flat_copy``: one device-to-device copy of the same number of bytes.

Each returns a list of wall seconds (the device synchronized around each repeat).
Benchmark-only: the worker never loads this module.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Any

import torch

from zmq_rollout import protocol as p
from zmq_rollout.weight_sync.buckets import pack, plan_buckets, tensor_specs
from zmq_rollout.workers.extension import WeightSyncExtension
from zmq_rollout.workers.receiver import _synchronize


def _timed(device: torch.device, fn: Any, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return times


class LoadProbe(WeightSyncExtension):
    def probe_prepare(self, model_dir: str) -> dict[str, Any]:
        """Load the checkpoint's tensors (HF names) onto the worker's device."""
        from safetensors.torch import load_file

        device = self._zr_receiver().device
        tensors = []
        for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
            tensors.extend((name, t.to(device)) for name, t in load_file(path).items())
        self._probe_tensors = tensors
        params = [p for p in self._zr_receiver().model.parameters() if p.numel() and not p.is_meta]
        return {
            "checkpoint_tensors": len(tensors),
            "checkpoint_bytes": sum(t.numel() * t.element_size() for _, t in tensors),
            "vllm_params": len(params),
            "vllm_param_bytes": sum(p.numel() * p.element_size() for p in params),
            "device": str(device),
        }

    def probe_load_weights(self, reps: int) -> list[float]:
        model = self._zr_receiver().model

        def run() -> None:
            with torch.no_grad():
                model.load_weights(list(self._probe_tensors))

        return _timed(self._zr_receiver().device, run, reps)

    def probe_round(self, reps: int) -> list[float]:
        device = self._zr_receiver().device
        by_name = dict(self._probe_tensors)
        (bucket,) = plan_buckets(tensor_specs(self._probe_tensors), 1 << 62)
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        pack(bucket, by_name, buffer)

        receiver, control = self._zr_receiver(), p.Control(0, p.BeginUpdate())

        def run() -> None:
            receiver.begin_update(p.BeginUpdate(), control)
            receiver.load_buffer(bucket, buffer)
            receiver.finish_update(p.FinishUpdate(), control)

        return _timed(device, run, reps)

    def probe_param_copy(self, reps: int) -> list[float]:
        params = [p for p in self._zr_receiver().model.parameters() if p.numel() and not p.is_meta]
        sources = [p.detach().clone() for p in params]

        def run() -> None:
            with torch.no_grad():
                for dst, src in zip(params, sources, strict=True):
                    dst.data.copy_(src)

        return _timed(self._zr_receiver().device, run, reps)

    def probe_flat_copy(self, nbytes: int, reps: int) -> list[float]:
        device = self._zr_receiver().device
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return _timed(device, lambda: dst.copy_(src), reps)

    def probe_release(self) -> None:
        self._probe_tensors = []
        if self._zr_receiver().device.type == "cuda":
            torch.cuda.empty_cache()
