"""The client's weight-sync methods: ``update_weights``, ``update_lora``, and the transport it keeps.

A mixin of ``AsyncRolloutClient``: what it needs of the client is ``sync_step`` (it is a
``StepSender``); the rounds themselves are driven by ``zmq_rollout.weight_sync``.
"""

from __future__ import annotations

from typing import Any

from zmq_rollout import protocol as p
from zmq_rollout.weight_sync import DEFAULT_BUCKET_BYTES, SyncReport, WeightTransport, make_transport
from zmq_rollout.weight_sync import update_lora as _update_lora
from zmq_rollout.weight_sync import update_weights as _update_weights
from zmq_rollout.weight_sync.update import LORA_BUCKET_BYTES


class WeightSyncMethods:
    transport: WeightTransport | None
    """The weight-sync transport of the last ``update_weights``, kept (with its buffers) across rounds."""

    async def sync_step(self, step: p.SyncStep) -> p.SyncReply:
        raise NotImplementedError

    def _transport_for(self, transport: str | WeightTransport, master_addr: str | None) -> WeightTransport:
        """The transport to use, kept across rounds: the one held if it matches, else a new one."""
        if isinstance(transport, WeightTransport):
            chosen = transport
        else:
            options = {} if master_addr is None else {"master_addr": master_addr}
            held = self.transport
            if held is not None and held.name == transport and held.options == options:
                return held
            chosen = make_transport(transport, **options)
        if chosen is not self.transport and self.transport is not None:
            self.transport.close()
        self.transport = chosen
        return chosen

    async def update_weights(
        self,
        source: Any,
        *,
        transport: str | WeightTransport = "shm",
        pause: str = "wait",
        version: int | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 60.0,
        check_names: bool = False,
        master_addr: str | None = None,
        direct_load: bool = True,
    ) -> SyncReport:
        """Push new policy weights into every worker; returns when every worker that stayed
        serves them, with a ``SyncReport``.

        ``source``: an ``nn.Module`` (its ``state_dict()``, tied weights once) or
        ``(name, tensor)`` pairs with checkpoint names. ``transport``: ``"shm"`` (one host),
        ``"cuda_ipc"`` (the GPUs of one node), ``"cuda_ipc_tensors"`` (the same, workers
        copying straight from the trainer's tensors, which must stay in place between
        rounds: the fastest), ``"gloo"`` or ``"nccl"`` (any hosts; the
        trainer listens on ``master_addr``, default 127.0.0.1), or a ``WeightTransport``; it
        is kept, with its buffers, for the next call. ``pause``: what jobs in flight do
        (``"abort"``, ``"wait"``, ``"keep"``). ``version``: default the fleet's + 1.
        ``timeout_s``: per step; a worker that misses it is evicted. ``check_names``: compare
        names with every worker's checkpoint first. ``direct_load``: False forces vLLM's
        layerwise reload even where loading straight into the parameters qualifies.
        """
        chosen = self._transport_for(transport, master_addr)
        return await _update_weights(
            self,
            chosen,
            source,
            pause=pause,
            version=version,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            check_names=check_names,
            direct_load=direct_load,
        )

    async def update_lora(
        self,
        tensors: Any,
        peft_config: Any,
        *,
        name: str = "default",
        pause: str = "wait",
        version: int | None = None,
        timeout_s: float = 60.0,
        bucket_bytes: int = LORA_BUCKET_BYTES,
    ) -> SyncReport:
        """Push a LoRA adapter into every worker's vLLM LoRA slot ``name``; returns a ``SyncReport``.

        ``tensors``: ``(name, tensor)`` pairs or a dict, PEFT names (e.g. from
        ``peft.get_peft_model_state_dict``); ``peft_config``: its ``adapter_config.json``
        as a dict (or a peft ``LoraConfig``). Jobs sample with it by ``lora=name``.
        Workers need ``--enable-lora``. The adapter's bytes travel in the steps,
        ``bucket_bytes`` per step.
        """
        return await _update_lora(
            self,
            tensors,
            peft_config,
            name=name,
            pause=pause,
            version=version,
            timeout_s=timeout_s,
            bucket_bytes=bucket_bytes,
        )
