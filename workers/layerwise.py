"""vLLM's layerwise reload, as the weight-sync extension uses it, and the two gaps it fills.

vLLM (0.25.1 and 0.32) can put a model into layerwise-reload mode: ``load_weights`` then
buffers each layer's weights until the layer is complete, runs its post-load processing
and copies the result into the original storage. Two things are ours: tensors a waiting
layer still holds as views of a receive buffer are cloned before the buffer is reused
(``detach_pending``), and layers that share a parameter with a loaded one but received
nothing themselves (a tied LM head) are processed again (``reprocess_tied``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from zmq_rollout.protocol import Bucket
from zmq_rollout.weight_sync.buckets import unpack

from .bucket_loader import BucketLoader

if TYPE_CHECKING:
    import torch

__all__ = [
    "LayerwiseLoader",
    "detach_pending",
    "pending_registry",
    "reload_api",
    "reprocess_tied",
    "unloaded_layers",
]

log = logging.getLogger(__name__)


class LayerwiseLoader(BucketLoader):
    """vLLM's layerwise reload: ``load_weights`` buffers each layer until it is complete,
    processes it (CPU gemm repacking, quantization, ...) and copies the result into the
    original storage, so CUDA graphs stay valid."""

    name = "layerwise"

    def __init__(self, model: Any, model_config: Any, reload: Any) -> None:
        self.model, self.model_config, self.reload = model, model_config, reload
        self.registry: Any = None

    def begin(self) -> None:
        import torch

        self.registry = pending_registry()
        if self.registry is None:
            log.warning("weight sync: this vLLM's layerwise reload state is unfamiliar; cloning every bucket")
        with torch.no_grad():
            self.reload.initialize_layerwise_reload(self.model)

    def load(self, bucket: Bucket, buffer: torch.Tensor, buffer_key: str | None = None, layout: str = "") -> None:
        tensors = unpack(bucket, buffer)
        if self.registry is None:  # we cannot find the views a waiting layer keeps: copy first
            tensors = [(name, t.clone()) for name, t in tensors]
        self.model.load_weights(tensors)
        del tensors
        if self.registry is not None:
            detach_pending(self.registry, buffer)

    def finish(self) -> None:
        unloaded = unloaded_layers(self.registry, self.model) if self.registry is not None else []
        self.reload.finalize_layerwise_reload(self.model, self.model_config)
        reprocess_tied(self.model, unloaded)


def reload_api() -> Any:
    """vLLM's layerwise reload module, or None where this vLLM has none."""
    try:
        from vllm.model_executor.model_loader import reload
    except ImportError:
        return None
    return reload if hasattr(reload, "initialize_layerwise_reload") else None


def pending_registry() -> Any:
    """vLLM's per-layer reload state (``LAYERWISE_INFO``), or None where it is not as expected.

    Internal to vLLM (same shape in 0.25.1 and 0.32): a ``WeakKeyDictionary`` from layer to
    an info with ``loaded_weights`` (the buffered loader calls), ``load_numel`` and
    ``can_load()``. Without it, buckets are cloned before loading and tied layers are not
    re-processed.
    """
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo
    except ImportError:
        return None
    fields = getattr(LayerReloadingInfo, "__dataclass_fields__", {})
    if not {"loaded_weights", "load_numel"} <= fields.keys() or not hasattr(LayerReloadingInfo, "can_load"):
        return None
    return LAYERWISE_INFO


def detach_pending(registry: Any, buffer: torch.Tensor) -> int:
    """Clone the tensors that layers still waiting for weights hold as views of ``buffer``."""
    import torch

    storage = buffer.untyped_storage().data_ptr()
    cloned = 0
    for info in list(registry.values()):
        for _, bound in info.loaded_weights:
            for key, value in list(bound.arguments.items()):
                if (
                    isinstance(value, torch.Tensor)
                    and value.device == buffer.device
                    and value.untyped_storage().data_ptr() == storage
                ):
                    bound.arguments[key] = value.clone()
                    cloned += 1
    return cloned


def unloaded_layers(registry: Any, model: torch.nn.Module) -> list[torch.nn.Module]:
    """Layers still in reload mode that no weight reached: finalize puts their old tensors back."""
    return [
        layer
        for layer in model.modules()
        if (info := registry.get(layer)) is not None and info.can_load() and info.load_numel <= 0
    ]


def reprocess_tied(model: torch.nn.Module, unloaded: list[torch.nn.Module]) -> int:
    """Redo the post-load processing of unloaded layers that share a parameter with a loaded one.

    A tied LM head shares its weight with the embedding, but only the embedding receives
    weights, so layerwise reload processes only the embedding (vLLM's documented limitation).
    On CPU the LM head keeps a prepacked *copy* of the weight for its gemm, which would stay
    stale: the head would score tokens with the old embeddings. Returns layers re-processed.
    """
    owners: dict[int, list[torch.nn.Module]] = {}
    for layer in model.modules():
        for param in layer._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(layer)
    unloaded_ids = {id(layer) for layer in unloaded}
    done = 0
    for layer in unloaded:
        method = getattr(layer, "quant_method", None)
        if method is None or not hasattr(method, "process_weights_after_loading"):
            continue
        shared = any(
            any(id(owner) not in unloaded_ids for owner in owners[id(param)])
            for param in layer._parameters.values()
            if param is not None
        )
        if shared:
            method.process_weights_after_loading(layer)
            done += 1
    return done
