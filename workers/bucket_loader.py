"""How one round's buckets land in a vLLM model: the ``BucketLoader`` strategy.

A round calls ``begin`` once, ``load`` per bucket (the bucket's tensors as views of a
buffer that the transport owns), and ``finish`` once. Three strategies:

- ``DirectLoader`` (``direct_load.py``): copies straight into the parameters through a
  name→slice map recorded from ``load_weights``; for unquantized models on CUDA.
- ``LayerwiseLoader`` (``layerwise.py``): vLLM's layerwise reload, right for any model.
- ``PlainLoader`` (here): ``load_weights``, then post-load processing once at the end; for
  a vLLM without the layerwise reload API.

Between ``begin`` and ``finish`` the model may be half-loaded: no forward pass may run, so
the worker pauses generation first. ``load`` must leave nothing referring to the buffer
when it returns, unless told the buffer stays mapped (``buffer_key``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from zmq_rollout.protocol import Bucket
from zmq_rollout.weight_sync.buckets import unpack

if TYPE_CHECKING:
    import torch


class BucketLoader(ABC):
    name: str = ""

    def begin(self) -> None:  # noqa: B027 - optional hook
        """Prepare the model to receive a round's weights."""

    @abstractmethod
    def load(self, bucket: Bucket, buffer: torch.Tensor, buffer_key: str | None = None, layout: str = "") -> None:
        """Load ``bucket``'s tensors from ``buffer``. ``buffer_key``: the buffer stays mapped
        under this name (a CUDA IPC buffer), so plans that refer to it may be kept; ``layout``:
        the trainer's name for the bucket's layout (``load_ipc2``), if it has one."""

    def load_parts(
        self, parts: list[tuple[Bucket, torch.Tensor]], buffer_keys: tuple[str, ...] = (), layout: str = ""
    ) -> None:
        """Load several buckets, each from its own buffer, as one load (``load_ipc_tensors``:
        a bucket per storage of the trainer's). ``buffer_keys``: every buffer stays mapped
        under these names, so a plan for all of them may be kept under ``layout``. By
        default, one ``load`` per part."""
        key = buffer_keys[0] if len(buffer_keys) == 1 else None
        for bucket, buffer in parts:
            self.load(bucket, buffer, key, layout if key else "")

    def finish(self) -> None:  # noqa: B027 - optional hook
        """Process what is pending; the model is whole again."""


class PlainLoader(BucketLoader):
    """``model.load_weights`` per bucket, ``process_weights_after_loading`` once at the end."""

    name = "plain"

    def __init__(self, model: Any, model_config: Any, device: Any) -> None:
        self.model, self.model_config, self.device = model, model_config, device

    def load(self, bucket: Bucket, buffer: torch.Tensor, buffer_key: str | None = None, layout: str = "") -> None:
        self.model.load_weights(unpack(bucket, buffer))

    def finish(self) -> None:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        process_weights_after_loading(self.model, self.model_config, self.device)
