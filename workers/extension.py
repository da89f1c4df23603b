"""The weight-sync entry point inside vLLM's worker processes (``worker_extension_cls``).

vLLM mixes this class into its ``Worker``; the worker process calls it through
``AsyncLLM.collective_rpc``, which runs the call in every engine worker process (one per
tensor-parallel rank). It is a shim: ``zr_sync`` takes a ``Control`` as msgpack bytes,
decodes it with a typed decoder, and hands it to this process's ``Receiver``.

Importing it also asks Linux for AMX tile state for this process (``amx.py``): vLLM's CPU
kernels use AMX without asking, and die of SIGILL on a machine that has it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from zmq_rollout import protocol as p

from .amx import request_amx_tiles
from .receiver import Receiver

__all__ = ["WeightSyncExtension"]

request_amx_tiles()  # vLLM imports this module in its worker process before it loads the model

_control = msgspec.msgpack.Decoder(p.Control)


class WeightSyncExtension:
    """Weight-sync RPCs for vLLM's worker; ``self`` is the vLLM ``Worker``.

    Names are prefixed ``zr_`` / ``_zr`` so they cannot shadow the worker's own.
    """

    # Provided by vLLM's Worker.
    model_runner: Any
    device: Any

    def _zr_receiver(self) -> Receiver:
        receiver = self.__dict__.get("_zr_receiver_state")
        if receiver is None:
            receiver = self.__dict__["_zr_receiver_state"] = Receiver(self.model_runner, getattr(self, "device", None))
        return receiver

    def zr_sync(self, control: bytes) -> int | None:
        """Run one data step of a round (``Control`` encoded as msgpack); returns its result."""
        return self._zr_receiver().run(_control.decode(control))

    def zr_checksum(self, names: list[str] | None = None) -> dict[str, float]:
        """Sum (in float32) of each of vLLM's parameters, for tests and debugging.

        Covers what vLLM keeps as parameters after loading, under vLLM's names (e.g.
        ``...qkv_proj.weight``). On CPU the linear layers' weights live prepacked inside
        their gemm kernels and the parameter is left empty: those are skipped (embeddings,
        norms and biases remain), so compare outputs to check linear weights.
        """
        import torch

        wanted = set(names) if names is not None else None
        sums: dict[str, float] = {}
        with torch.no_grad():
            for name, param in self.model_runner.get_model().named_parameters():
                if (wanted is None or name in wanted) and param.numel() and not param.is_meta:
                    sums[name] = float(param.detach().float().sum())
        return sums
