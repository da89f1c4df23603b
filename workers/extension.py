"""The worker side of weight sync, mixed into vLLM's ``Worker`` (``worker_extension_cls``).

The control plane drives one round through ``AsyncLLM.collective_rpc``; each call runs in
every worker process of the engine (one per tensor-parallel rank) and returns plain,
msgpack-able values::

    zr_begin_update()                      # once per round
    zr_load_shm(name, bucket)              # per bucket: shared memory ...
    zr_load_ipc(handle, bucket, live)      # ... or a CUDA IPC buffer of the trainer's ...
    zr_receive_bucket(bucket)              # ... or the collective (after zr_join_group)
    zr_finish_update() -> tensors loaded   # once per round; then reset the prefix cache

Between begin and finish the model is half-loaded (layers wait on the meta device until
all their weights have arrived), so no forward pass may run then: pause generation first.
A failed round is repaired by running a whole round again.

How weights land: where the model qualifies (unquantized, on CUDA; ``direct_load.py``),
straight into the parameters through a name→slice map recorded from ``load_weights`` on
the first round and replayed after (post-load processing does nothing for such a model).
Otherwise, where vLLM has the layerwise reload API (0.25.1 and 0.32 both do), begin
puts every layer into reload mode, ``model.load_weights`` (which maps checkpoint names such
as q/k/v_proj onto vLLM's fused qkv_proj and shards for TP) buffers each layer's weights
until the layer is complete, then runs its post-load processing (e.g. the CPU gemm weight
repacking, quantization) and copies the result into the *original* storage, so CUDA graphs
stay valid. Without that API, weights are loaded directly and ``process_weights_after_loading``
runs once at finish.

Buffers: buckets arrive in one receive buffer that is reused (grown only for a larger
bucket), in a shared-memory segment mapped only for the call, or in one of the trainer's
CUDA IPC buffers, mapped the first time its id is seen and reused every round after (a
buffer the trainer no longer names is unmapped), so memory does not grow with the number
of rounds. A layer whose weights straddle two buckets still holds views of
the buffer when its bucket returns; those few tensors are cloned before the buffer is
reused or unmapped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from zmq_rollout.cuda_ipc import CudaIpcCache, CudaIpcHandle
from zmq_rollout.weights import Bucket, CollectiveGroup, attach_shm, unpack
from zmq_rollout.workers.direct_load import DirectLoader, qualifies
from zmq_rollout.workers.layerwise import (
    detach_pending,
    pending_registry,
    reload_api,
    reprocess_tied,
    unloaded_layers,
)

if TYPE_CHECKING:
    import torch

__all__ = ["WeightSyncExtension"]

log = logging.getLogger(__name__)


@dataclass
class _SyncState:
    buffer: torch.Tensor | None = None
    """The receive (or, on an accelerator, shared-memory staging) buffer, reused across buckets."""
    group: CollectiveGroup | None = None
    updating: bool = False
    layerwise: bool = False
    """This vLLM has the layerwise reload API."""
    registry: Any = None
    """vLLM's per-layer reload state, when it is as expected (see ``layerwise.pending_registry``)."""
    num_loaded: int = 0
    ipc: CudaIpcCache | None = None
    """The trainer's CUDA IPC buffers this worker has mapped, kept across rounds."""
    direct: DirectLoader | None = None
    """Name→slice recipes, kept across rounds (``direct_load.py``)."""
    direct_mode: bool = False
    """This round loads straight into the parameters (no layerwise reload)."""
    why_not_direct: str | None = None


def _as_bucket(bucket: Any) -> Bucket:
    """A ``Bucket`` from itself or from what msgpack made of it (lists)."""
    return bucket if isinstance(bucket, Bucket) else msgspec.convert(bucket, Bucket)


class WeightSyncExtension:
    """Weight-sync RPCs for vLLM's worker; ``self`` is the vLLM ``Worker``.

    Methods and state are prefixed ``zr_`` / ``_zr`` so they cannot shadow the worker's own.
    """

    # Provided by vLLM's Worker.
    model_runner: Any
    device: Any

    # -- state -----------------------------------------------------------------------------

    def _zr(self) -> _SyncState:
        state = self.__dict__.get("_zr_state")
        if state is None:
            state = self.__dict__["_zr_state"] = _SyncState()
        return state

    def _zr_model(self) -> Any:
        return self.model_runner.get_model()

    def _zr_model_config(self) -> Any:
        return self.model_runner.vllm_config.model_config

    def _zr_device(self) -> torch.device:
        import torch

        device = getattr(self, "device", None)
        if device is None:
            device = next(self._zr_model().parameters()).device
        return torch.device(device)

    def _zr_buffer(self, nbytes: int) -> torch.Tensor:
        """The reusable buffer's first ``nbytes`` bytes, growing it if it is smaller."""
        import torch

        state = self._zr()
        if state.buffer is None or state.buffer.numel() < nbytes:
            state.buffer = None  # free the old one before allocating the new one
            state.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self._zr_device())
        return state.buffer[:nbytes]

    # -- a round ---------------------------------------------------------------------------

    def zr_begin_update(self, direct: bool = True) -> None:
        """Start a round: load straight into the parameters where the model qualifies
        (``direct_load.qualifies``) and ``direct``; else put it into layerwise-reload mode
        (where vLLM has it)."""
        import torch

        state = self._zr()
        if state.updating:
            # The last transfer broke off (a member was lost, the collective failed): close
            # the half-done reload first, so that layers are whole again before a new one
            # starts; the transfer that follows overwrites every tensor anyway.
            log.warning("weight sync: a round began before the last one finished; closing it, starting over")
            self.zr_finish_update()
        model = self._zr_model()
        why_not = "the trainer turned it off"
        if direct:
            why_not = qualifies(model, self._zr_model_config(), self._zr_device())
        if why_not != state.why_not_direct:
            log.info("weight sync: %s", f"direct load not used: {why_not}" if why_not else "loading directly")
            state.why_not_direct = why_not
        state.direct_mode = not why_not
        if state.direct_mode:
            if state.direct is None or state.direct.stale(model):
                state.direct = DirectLoader(model)
            state.layerwise, state.registry = False, None
            state.updating, state.num_loaded = True, 0
            return
        reload = reload_api()
        state.layerwise = reload is not None
        state.registry = pending_registry() if reload is not None else None
        if reload is not None and state.registry is None:
            log.warning("weight sync: this vLLM's layerwise reload state is unfamiliar; cloning every bucket")
        if reload is not None:
            with torch.no_grad():
                reload.initialize_layerwise_reload(self._zr_model())
        state.updating = True
        state.num_loaded = 0

    def zr_load_shm(
        self, shm_name: str, bucket: Any, begin: bool = False, finish: bool = False, direct: bool = True
    ) -> int:
        """Load ``bucket`` from the shared-memory segment ``shm_name``; returns tensors loaded.

        The segment is mapped for this call only and never unlinked (the trainer owns it).
        On an accelerator the bucket is first copied to the device in one transfer.
        ``begin`` / ``finish``: begin the round before (with ``direct``), finish it after,
        saving the control plane two steps.
        """
        bucket = _as_bucket(bucket)
        if begin:
            self.zr_begin_update(direct)
        with attach_shm(shm_name) as shm:
            try:
                if shm.numel() < bucket.nbytes:
                    raise ValueError(f"shared memory {shm_name} has {shm.numel()} bytes; bucket needs {bucket.nbytes}")
                if self._zr_device().type == "cpu":
                    loaded = self._zr_load(bucket, shm[: bucket.nbytes])
                else:
                    staging = self._zr_buffer(bucket.nbytes)
                    staging.copy_(shm[: bucket.nbytes])
                    _synchronize(staging.device)  # the trainer may reuse the segment once we return
                    loaded = self._zr_load(bucket, staging)
            finally:
                del shm  # the last view: now the segment can be unmapped
        if finish:
            self.zr_finish_update()
        return loaded

    def zr_load_ipc(
        self,
        handle: Any,
        bucket: Any,
        live: list[str] | None = None,
        begin: bool = False,
        finish: bool = False,
        direct: bool = True,
    ) -> int:
        """Load ``bucket`` from the trainer's CUDA IPC buffer ``handle``; returns tensors loaded.

        The buffer is mapped once and kept; ``live`` (the ids of every buffer the trainer
        still holds) unmaps the others. Loading reads the trainer's GPU memory directly, and
        the call returns only once the reads are done, so the trainer may then reuse it.
        ``begin`` / ``finish`` as for ``zr_load_shm``.
        """
        bucket = _as_bucket(bucket)
        if begin:
            self.zr_begin_update(direct)
        handle = handle if isinstance(handle, CudaIpcHandle) else msgspec.convert(handle, CudaIpcHandle)
        if bucket.nbytes > handle.nbytes:
            raise ValueError(
                f"CUDA IPC buffer {handle.buffer_id} has {handle.nbytes} bytes; "
                f"bucket {bucket.index} needs {bucket.nbytes}"
            )
        state = self._zr()
        if state.ipc is None:
            state.ipc = CudaIpcCache()
        keep = [*(live or ()), handle.buffer_id]
        state.ipc.retain(keep)
        if state.direct is not None:
            state.direct.forget(set(keep))
        buffer = state.ipc.get(handle)
        loaded = self._zr_load(bucket, buffer[: bucket.nbytes], handle.buffer_id)
        if finish:
            self.zr_finish_update()
        _synchronize(self._zr_device())
        if buffer.device != self._zr_device():
            _synchronize(buffer.device)
        return loaded

    def zr_join_group(
        self,
        host: str,
        port: int,
        rank: int | None,
        world_size: int,
        backend: Literal["gloo", "nccl"],
        timeout_s: float,
        group_name: str,
        rank_offset: int | None = None,
    ) -> None:
        """Join the trainer's ``CollectiveGroup``; blocks until every rank has joined.

        Each tensor-parallel (and pipeline) rank of an engine is its own worker process and
        its own member of the group. Give either ``rank`` (an engine of one worker) or
        ``rank_offset``: then this worker is ``rank_offset + parallel_config.rank`` (its rank
        within the engine, 0..TP*PP-1), and the control plane gives each engine its own
        range of ranks.
        """
        state = self._zr()
        if state.group is not None:
            log.warning("weight sync: joining %s; leaving %s first", group_name, state.group.group_name)
            self.zr_leave_group()
        if rank_offset is not None:
            rank = rank_offset + int(self.model_runner.vllm_config.parallel_config.rank)
        elif rank is None:
            raise ValueError("give rank or rank_offset")
        elif self.model_runner.vllm_config.parallel_config.world_size > 1:
            raise ValueError("an engine of several workers joins with rank_offset, not one rank for all")
        if backend == "nccl":
            import torch

            torch.cuda.set_device(self._zr_device())
        state.group = CollectiveGroup(
            host,
            port,
            rank,
            world_size,
            backend,
            timeout_s,
            group_name,
            is_master=False,
        )
        log.info("weight sync: joined group %s as rank %d of %d (%s)", group_name, rank, world_size, backend)

    def zr_receive_bucket(self, bucket: Any) -> int:
        """Receive ``bucket`` by broadcast from rank 0 of the group, and load it."""
        bucket = _as_bucket(bucket)
        state = self._zr()
        if state.group is None:
            raise RuntimeError("weight sync: zr_receive_bucket before zr_join_group")
        buffer = self._zr_buffer(bucket.nbytes)
        state.group.broadcast(buffer, src=0)
        return self._zr_load(bucket, buffer)

    def zr_leave_group(self) -> None:
        """Leave the group and free the receive buffer."""
        state = self._zr()
        group, state.group = state.group, None
        state.buffer = None
        if group is not None:
            group.close()
            log.info("weight sync: left group %s", group.group_name)

    def zr_finish_update(self) -> int:
        """Finish the round (process what is still pending); returns tensors loaded this round."""
        import torch

        state = self._zr()
        if not state.updating:
            raise RuntimeError("weight sync: zr_finish_update without zr_begin_update")
        model = self._zr_model()
        with torch.no_grad():
            if state.direct_mode:
                pass  # the model qualified: nothing to process after loading
            elif state.layerwise:
                unloaded = unloaded_layers(state.registry, model) if state.registry is not None else []
                reload_api().finalize_layerwise_reload(model, self._zr_model_config())
                reprocess_tied(model, unloaded)
            else:
                from vllm.model_executor.model_loader.utils import process_weights_after_loading

                process_weights_after_loading(model, self._zr_model_config(), self._zr_device())
        for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            reset = getattr(self.model_runner, name, None)
            if reset is not None:
                reset()  # state derived from the old weights, as vLLM's own reload_weights does
        _synchronize(self._zr_device())
        state.updating = False
        log.info("weight sync: round finished, %d tensors loaded", state.num_loaded)
        return state.num_loaded

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
            for name, param in self._zr_model().named_parameters():
                if (wanted is None or name in wanted) and param.numel() and not param.is_meta:
                    sums[name] = float(param.detach().float().sum())
        return sums

    # -- internals -------------------------------------------------------------------------

    def _zr_load(self, bucket: Bucket, buffer: torch.Tensor, buffer_key: str | None = None) -> int:
        """``load_weights`` the bucket's views of ``buffer``; leave nothing referring to it
        (``buffer_key``: except in direct mode, for a buffer that stays mapped under it)."""
        import torch

        state = self._zr()
        if not state.updating:
            raise RuntimeError("weight sync: a bucket arrived before zr_begin_update")
        if state.direct_mode:
            assert state.direct is not None
            with torch.no_grad():
                state.direct.load_bucket(bucket, buffer, buffer_key)
            state.num_loaded += len(bucket.tensors)
            return len(bucket.tensors)
        tensors = unpack(bucket, buffer)
        if state.layerwise and state.registry is None:
            tensors = [(name, t.clone()) for name, t in tensors]
        with torch.no_grad():
            self._zr_model().load_weights(tensors)
        del tensors
        if state.registry is not None:
            detach_pending(state.registry, buffer)
        state.num_loaded += len(bucket.tensors)
        return len(bucket.tensors)


def _synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
