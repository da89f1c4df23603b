"""The engine's half of a weight-sync round, inside each of vLLM's worker processes.

One ``Receiver`` per vLLM worker process (one per tensor-parallel rank), reached through
``WeightSyncExtension.zr_sync`` with a ``Control`` the worker forwards. It handles the data
steps, one handler per step type (``HANDLERS``): begin and finish the update, receive a
bucket (map a shared-memory segment, map a CUDA IPC buffer, or take a broadcast) and hand
it to the round's ``BucketLoader``.

Buffers: a receive (or, on an accelerator, shared-memory staging) buffer is reused and grown
only for a larger bucket; shared memory is mapped for one bucket only; the trainer's CUDA
IPC buffers are mapped the first time their id is seen and kept (a buffer the trainer no
longer names is unmapped), so memory does not grow with the number of rounds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zmq_rollout import protocol as p
from zmq_rollout.weight_sync.collective import CollectiveGroup
from zmq_rollout.weight_sync.cuda_ipc import BucketLayouts, CudaIpcCache, stream_wait
from zmq_rollout.weight_sync.shm import attach_shm

from .bucket_loader import BucketLoader, PlainLoader
from .direct_load import DirectLoader, parameter_pointers, static_verdict
from .layerwise import LayerwiseLoader, reload_api

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class Receiver:
    """State kept across rounds (direct-load recipes, IPC mappings) and the round in progress."""

    def __init__(self, model_runner: Any, device: Any) -> None:
        self.model_runner = model_runner
        self._device = device
        self.loader: BucketLoader | None = None
        """The round's loader between ``begin_update`` and ``finish_update``."""
        self.direct: DirectLoader | None = None
        """Name→slice recipes, kept across rounds."""
        self.why_not_direct: str | None = None
        self._static: tuple[Any, Any, str] | None = None
        """(model, device, ``static_verdict``): worked out once per model."""
        self.buffer: torch.Tensor | None = None
        """The receive (or shared-memory staging) buffer on the engine's device, reused."""
        self.host_buffer: torch.Tensor | None = None
        """gloo to an accelerator: the host buffer a broadcast lands in first."""
        self.group: CollectiveGroup | None = None
        self.ipc = CudaIpcCache()
        self.layouts = BucketLayouts()
        """``load_ipc2``'s and ``load_ipc_tensors``' layouts by the trainer's name, sent once."""
        self.num_loaded = 0
        self.round_ms: dict[str, float] = {}
        """This round's milliseconds in the engine, by phase (logged when it finishes)."""
        self.handlers: dict[type[p.SyncOp], Callable[[Any, p.Control], int | None]] = {
            p.BeginUpdate: self.begin_update,
            p.LoadShm: self.load_shm,
            p.LoadIpc: self.load_ipc,
            p.LoadIpcTensors: self.load_ipc_tensors,
            p.JoinGroup: self.join_group,
            p.ReceiveBucket: self.receive_bucket,
            p.LeaveGroup: self.leave_group,
            p.FinishUpdate: self.finish_update,
        }

    def run(self, control: p.Control) -> int | None:
        handler = self.handlers.get(type(control.op))
        if handler is None:
            raise ValueError(f"{control.op.kind!r} is not a step for the engine")
        return handler(control.op, control)

    # -- the model -------------------------------------------------------------------------
    @property
    def model(self) -> Any:
        return self.model_runner.get_model()

    @property
    def model_config(self) -> Any:
        return self.model_runner.vllm_config.model_config

    @property
    def device(self) -> torch.device:
        import torch

        device = self._device if self._device is not None else next(self.model.parameters()).device
        return torch.device(device)

    def _choose_loader(self, direct: bool) -> BucketLoader:
        model, device = self.model, self.device
        pointers: dict[str, int] | None = None
        kept = False  # the recipes' model, every module and parameter object where it was
        if not direct:
            why_not = "the trainer turned it off"
        else:
            if self._static is None or self._static[0] is not model or self._static[1] != device:
                self._static = (model, device, static_verdict(model, self.model_config, device))
            why_not = self._static[2]
            kept = not why_not and self.direct is not None and self.direct.unchanged(model)
            if not why_not and not kept:  # walk the parameters: on the meta device? moved?
                pointers, why_not = parameter_pointers(model)
        if why_not != self.why_not_direct:
            log.info("weight sync: %s", f"direct load not used: {why_not}" if why_not else "loading directly")
            self.why_not_direct = why_not
        if not why_not:
            if self.direct is None or (not kept and self.direct.stale(model, pointers)):
                self.direct = DirectLoader(model)
            return self.direct
        reload = reload_api()
        if reload is not None:
            return LayerwiseLoader(model, self.model_config, reload)
        return PlainLoader(model, self.model_config, self.device)

    # -- the steps -------------------------------------------------------------------------
    def begin_update(self, op: p.BeginUpdate, control: p.Control) -> None:
        """Start a round with the loader that fits (``direct`` where the model qualifies)."""
        import torch

        if self.loader is not None:
            # The last transfer broke off (a member was lost, the collective failed): close
            # the half-done load first, so that layers are whole again before a new one
            # starts; the transfer that follows overwrites every tensor anyway.
            log.warning("weight sync: a round began before the last one finished; closing it, starting over")
            self.finish_update(p.FinishUpdate(), control)
        started = time.perf_counter()
        self.round_ms = {}
        self.loader = self._choose_loader(op.direct)
        self.num_loaded = 0
        with torch.no_grad():
            self.loader.begin()
        self._add_ms("begin_update", started)

    def load_shm(self, op: p.LoadShm, control: p.Control) -> int:
        """Map the segment for this bucket only (never unlinked: the trainer owns it); on an
        accelerator copy it to the device in one transfer first."""
        if op.begin:
            self.begin_update(p.BeginUpdate(op.direct), control)
        self.release_ipc()
        bucket = op.bucket
        with attach_shm(op.shm_name) as shm:
            try:
                if shm.numel() < bucket.nbytes:
                    raise ValueError(
                        f"shared memory {op.shm_name} has {shm.numel()} bytes; bucket needs {bucket.nbytes}"
                    )
                if self.device.type == "cpu":
                    loaded = self.load_buffer(bucket, shm[: bucket.nbytes])
                else:
                    staging = self._buffer(bucket.nbytes)
                    staging.copy_(shm[: bucket.nbytes])
                    _synchronize(staging.device)  # the trainer may reuse the segment once we return
                    loaded = self.load_buffer(bucket, staging)
            finally:
                del shm  # the last view: now the segment can be unmapped
        if op.finish:
            self.finish_update(p.FinishUpdate(), control)
        return loaded

    def load_ipc(self, op: p.LoadIpc, control: p.Control) -> int:
        """Load from the trainer's GPU buffer, mapped once and kept; returns once the reads are
        done, so the trainer may reuse the buffer. A layout sent by name only and not held
        fails here, before anything else (``UnknownLayout``)."""
        bucket = self.layouts.resolve(op)
        if op.begin:
            self.begin_update(p.BeginUpdate(op.direct), control)
        started = time.perf_counter()
        self._retain({*op.live, op.handle.buffer_id})
        buffer = self.ipc.get(op.handle)
        self.ipc.wait_ready(op.handle, self.device)  # the trainer may still be packing it
        self._add_ms("map", started)
        loaded = self.load_buffer(bucket, buffer[: bucket.nbytes], op.handle.buffer_id, op.layout)
        started = time.perf_counter()
        _synchronize(self.device)  # the loads are done before finish_update's own work
        self._add_ms("copy_wait", started)
        if op.finish:
            self.finish_update(p.FinishUpdate(), control)
        if buffer.device != self.device:
            _synchronize(buffer.device)
        return loaded

    def load_ipc_tensors(self, op: p.LoadIpcTensors, control: p.Control) -> int:
        """Load every tensor straight from the trainer's own storages, each mapped once and
        kept while the trainer names it; reads wait (on the GPU) for the trainer's ready
        event; returns once they are done, so the trainer may write its tensors again. A
        layout sent by name only and not held fails here, before anything else."""
        sources = self.layouts.sources(op)
        if op.begin:
            self.begin_update(p.BeginUpdate(op.direct), control)
        started = time.perf_counter()
        ids = tuple(s.handle.buffer_id for s in sources)
        self._retain({*op.live, *ids, op.ready_id})
        parts = [(s.bucket, self.ipc.get(s.handle)) for s in sources]  # no per-round view of each
        device = parts[0][1].device if parts else self.device
        stream_wait(self.ipc.event(op.ready_id, op.ready_event, device), self.device)
        self._add_ms("map", started)
        loaded = self.load_parts(parts, ids, op.layout)
        started = time.perf_counter()
        _synchronize(self.device)  # the trainer writes its tensors again once we answer
        self._add_ms("copy_wait", started)
        if op.finish:
            self.finish_update(p.FinishUpdate(), control)
        if device != self.device:
            _synchronize(device)
        return loaded

    def join_group(self, op: p.JoinGroup, control: p.Control) -> None:
        """Each rank of the engine joins as ``rank_offset`` + its rank within the engine."""
        if self.group is not None:
            log.warning("weight sync: joining %s; leaving %s first", op.group_name, self.group.group_name)
            self.leave_group(p.LeaveGroup(), control)
        rank = control.rank_offset + int(self.model_runner.vllm_config.parallel_config.rank)
        if op.backend == "nccl":
            import torch

            torch.cuda.set_device(self.device)
        self.group = CollectiveGroup(
            op.host, op.port, rank, control.world_size, op.backend, op.timeout_s, op.group_name, is_master=False
        )
        log.info(
            "weight sync: joined group %s as rank %d of %d (%s)", op.group_name, rank, control.world_size, op.backend
        )

    def receive_bucket(self, op: p.ReceiveBucket, control: p.Control) -> int:
        """Take the bucket's broadcast into the reusable buffer (gloo into host memory, then one
        copy to an accelerator; NCCL straight into the device) and load it."""
        import torch

        if self.group is None:
            raise RuntimeError("weight sync: receive_bucket before join_group")
        self.release_ipc()
        nbytes = op.bucket.nbytes
        if self.group.backend == "gloo" and self.device.type != "cpu":
            if self.host_buffer is None or self.host_buffer.numel() < nbytes:
                self.host_buffer = None
                self.host_buffer = torch.empty(nbytes, dtype=torch.uint8)
            host = self.host_buffer[:nbytes]
            self.group.broadcast(host, src=0)
            buffer = self._buffer(nbytes)
            buffer.copy_(host)
        else:
            buffer = self._buffer(nbytes)
            self.group.broadcast(buffer, src=0)
        return self.load_buffer(op.bucket, buffer)

    def leave_group(self, op: p.LeaveGroup, control: p.Control) -> None:
        """Leave the group and free the receive buffer."""
        group, self.group = self.group, None
        self.buffer = self.host_buffer = None
        if group is not None:
            group.close()
            log.info("weight sync: left group %s", group.group_name)

    def finish_update(self, op: p.FinishUpdate, control: p.Control) -> int:
        """Finish the round; returns the tensors loaded in it."""
        import torch

        loader, self.loader = self.loader, None
        if loader is None:
            raise RuntimeError("weight sync: finish_update without begin_update")
        started = time.perf_counter()
        with torch.no_grad():
            loader.finish()
        for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            reset = getattr(self.model_runner, name, None)
            if reset is not None:
                reset()  # state derived from the old weights, as vLLM's own reload_weights does
        _synchronize(self.device)
        self._add_ms("finish", started)
        log.info(
            "weight sync: round finished (%s), %d tensors loaded; in the engine (ms): %s",
            loader.name,
            self.num_loaded,
            " ".join(f"{k} {v:.2f}" for k, v in self.round_ms.items()),
        )
        return self.num_loaded

    def release_ipc(self) -> None:
        """Unmap every CUDA IPC buffer and trainer storage (and close their events): a load
        over another transport names none, and a trainer that switched transports must not
        keep its old GPU memory pinned here until some later CUDA IPC round."""
        if len(self.ipc):
            self._retain(set())

    def _retain(self, keep: set[str]) -> None:
        """Unmap every CUDA IPC buffer (and close every event) whose id is not in ``keep``, and
        drop the direct loader's plans that read one."""
        self.ipc.retain(keep)
        if self.direct is not None:
            self.direct.forget(keep)

    # -- internals -------------------------------------------------------------------------
    def _add_ms(self, what: str, started: float) -> None:
        self.round_ms[what] = self.round_ms.get(what, 0.0) + (time.perf_counter() - started) * 1e3

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """The reusable buffer's first ``nbytes`` bytes, growing it if it is smaller."""
        import torch

        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = None  # free the old one before allocating the new one
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.buffer[:nbytes]

    def load_buffer(
        self, bucket: p.Bucket, buffer: torch.Tensor, buffer_key: str | None = None, layout: str = ""
    ) -> int:
        """Hand ``bucket`` (its bytes in ``buffer``) to the round's loader; returns tensors loaded."""
        return self.load_parts([(bucket, buffer)], (buffer_key,) if buffer_key else (), layout)

    def load_parts(
        self, parts: list[tuple[p.Bucket, torch.Tensor]], buffer_keys: tuple[str, ...] = (), layout: str = ""
    ) -> int:
        """Hand ``parts`` (each a bucket and the buffer its bytes are in) to the round's loader
        as one load; returns tensors loaded."""
        import torch

        if self.loader is None:
            raise RuntimeError("weight sync: a bucket arrived before begin_update")
        started = time.perf_counter()
        with torch.no_grad():
            self.loader.load_parts(parts, buffer_keys, layout)
        self._add_ms("load", started)
        loaded = sum(len(bucket.tensors) for bucket, _ in parts)
        self.num_loaded += loaded
        return loaded


def _synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
