"""The ``cuda_ipc_tensors`` transport: workers read the trainer's own tensors, no staging buffer.

``cuda_ipc`` packs each bucket into a buffer of its own and every worker copies from there:
the model crosses the GPU's memory twice per round. Here the trainer exports the storage of
each tensor it sends, once (its parameters: an optimizer updates them in place, so they stay
where they are), every worker maps each storage once, and a round is one copy per tensor,
straight from the trainer's tensor into vLLM's parameter. A round is one
``load_ipc_tensors`` step that, from the second round on, carries a layout name and the
trainer's ready event, nothing per tensor.

What it asks of the trainer: the tensors are CUDA tensors on one device, contiguous, in a
dtype weight sync carries, and not written between ``update_weights``' call and its return
(the call returns once every worker's reads are done). Writes queued on the trainer's
current stream before the call are waited for on the GPU (the ready event); writes on other
streams must be synchronized first. A tensor that is new each round (a dtype conversion,
an FSDP shard gathered into a fresh tensor) is exported anew each round, which costs more
than ``cuda_ipc``'s pack: the transport logs a warning when that happens.
torch is imported inside functions.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zmq_rollout import protocol as p
from zmq_rollout.errors import InvalidRequestError

from .buckets import dtype_name
from .cuda_ipc import LayoutNames, cuda_device_uuid, exported_event, share_storage, step_with_layout
from .transport import Shipment, WeightTransport

if TYPE_CHECKING:
    import torch

    from .round import SyncRound

__all__ = ["CudaIpcTensorsTransport"]

log = logging.getLogger(__name__)


@dataclass
class _Export:
    handle: p.CudaIpcHandle
    tensor: torch.Tensor
    """A tensor of the storage, held so that its memory is not reused while workers may map it."""


class CudaIpcTensorsTransport(WeightTransport):
    """One ``load_ipc_tensors`` step per round over the trainer's own storages, each exported
    once and kept while a round sends a tensor that lies in it."""

    name = "cuda_ipc_tensors"

    def __init__(self) -> None:
        super().__init__()
        self.layouts = LayoutNames()
        self.exports: dict[tuple[int, int], _Export] = {}
        """By (storage address, bytes): the storages the last round read."""
        self.num_exported = 0
        """Storages exported since this transport was made (grows only when tensors move)."""
        self._signature: tuple[Any, ...] | None = None
        self._sources: list[p.IpcSource] = []
        self._ready: Any = None
        self._ready_id = ""
        self._ready_handle = b""
        self._device: Any = None

    def prepare(self, shipment: Shipment) -> None:
        """Export the storages not exported yet (a round whose tensors are where they were
        last round exports nothing and rebuilds nothing), then record the ready event on the
        current stream: workers' reads wait for what the trainer queued before it."""
        import torch

        if not torch.cuda.is_available():
            raise InvalidRequestError("transport='cuda_ipc_tensors' needs CUDA in the trainer; use 'shm' on CPU")
        tensors = shipment.tensors
        signature = tuple((n, t.data_ptr(), t.dtype, t.shape, t.stride()) for n, t in tensors.items())
        if signature != self._signature:
            self._sources = self._plan(tensors)
            self._signature = signature
        self._ready.record(torch.cuda.current_stream(self._device))

    def _plan(self, tensors: dict[str, torch.Tensor]) -> list[p.IpcSource]:
        """A source per storage the tensors lie in, exporting the new ones; the storages no
        round names any more are let go (workers unmap them at this round's step)."""
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise InvalidRequestError(
                "transport='cuda_ipc_tensors' sends CUDA tensors of one device; "
                f"these are on {sorted(map(str, devices))}"
            )
        device = next(iter(devices))
        if device != self._device:
            self._open_event(device)
        by_storage: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}
        for name, t in tensors.items():
            if not t.is_contiguous():
                raise InvalidRequestError(f"tensor {name!r} is not contiguous; cuda_ipc_tensors reads tensors in place")
            storage = t.untyped_storage()
            by_storage.setdefault((storage.data_ptr(), storage.nbytes()), []).append((name, t))
        exports: dict[tuple[int, int], _Export] = {}
        sources: list[p.IpcSource] = []
        new = 0
        for i, (key, members) in enumerate(by_storage.items()):
            export = self.exports.get(key)
            if export is None:
                export = self._export(members[0][1], device)
                new += 1
            exports[key] = export
            metas = []
            for name, t in members:
                size = t.element_size()
                metas.append(
                    p.TensorMeta(
                        name, dtype_name(t.dtype), list(t.shape), int(t.storage_offset()) * size, t.numel() * size
                    )
                )
            sources.append(p.IpcSource(export.handle, p.Bucket(i, export.handle.nbytes, metas)))
        if new and self.num_exported:  # not the first round: tensors moved
            log.warning(
                "weight sync: %d of %d storages were new this round, each exported anew: with tensors that are "
                "new every round (a dtype conversion, a gathered shard) use transport='cuda_ipc'",
                new,
                len(exports),
            )
        self.exports = exports
        self.num_exported += new
        return sources

    def _export(self, tensor: torch.Tensor, device: torch.device) -> _Export:
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            handle = share_storage(tensor.untyped_storage(), cuda_device_uuid(index), b"")
        except RuntimeError as e:
            raise InvalidRequestError(
                f"could not export the trainer's tensor for CUDA IPC ({e}); this does not work with "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True nor for a tensor received from another process: "
                "use transport='cuda_ipc' or 'shm'"
            ) from e
        return _Export(handle, tensor)

    def _open_event(self, device: torch.device) -> None:
        """The ready event, made on ``device`` and exported once."""
        self._ready, self._ready_handle = exported_event(device)
        self._device, self._ready_id = device, uuid.uuid4().hex

    async def send(self, rnd: SyncRound, shipment: Shipment) -> None:
        sources = self._sources
        name = self.layouts.name(sources)
        direct = shipment.direct_load

        def step(full: list[p.IpcSource]) -> p.LoadIpcTensors:
            # ``live`` stays empty: a worker keeps the storages of the layout it loads, and the
            # ready event, and unmaps the rest.
            return p.LoadIpcTensors(
                self._ready_id, self._ready_handle, name, full, [], begin=True, finish=True, direct=direct
            )

        await step_with_layout(rnd, self.layouts, name, step([]), step(sources))

    def close(self) -> None:
        """Let the storages go (workers unmap them when the next step names other ones)."""
        self.exports.clear()
        self._sources = []
        self._signature = None
