"""The trainer's half of a data plane: ``WeightTransport``, one subclass per way to move bytes.

A transport moves the bytes of every bucket of a ``Shipment`` to the members of a round and
has them load it, through the round's steps (``load_shm``, ``load_ipc2``, or ``join_group``
+ ``receive_bucket``). The client keeps one transport across rounds, so buffers it
allocates (shared memory, exported GPU memory) are made once and reused.

Adding one (RDMA, vLLM's native weight-transfer engine, ...) is one new module with a
subclass and one line in ``factory.TRANSPORTS`` (docs/weight_sync.md shows a whole one);
the worker's half is a handler for its load step in ``zmq_rollout.workers.receiver``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .buckets import Bucket, named_tensors, plan_buckets_cached, tensor_specs

if TYPE_CHECKING:
    import torch

    from .round import SyncRound


@dataclass
class Shipment:
    """What one round ships: the tensors by checkpoint name, cut into buckets."""

    tensors: dict[str, torch.Tensor]
    buckets: list[Bucket]
    direct_load: bool = True
    """Workers whose model qualifies copy straight into vLLM's parameters (else layerwise reload)."""

    @classmethod
    def plan(cls, source: Any, bucket_bytes: int, direct_load: bool = True) -> Shipment:
        """``source``: an ``nn.Module`` or ``(name, tensor)`` pairs (see ``named_tensors``)."""
        pairs = named_tensors(source)
        return cls(dict(pairs), plan_buckets_cached(tensor_specs(pairs), bucket_bytes), direct_load)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def largest(self) -> int:
        """Bytes of the largest bucket: what a buffer must hold."""
        return max(b.nbytes for b in self.buckets)

    def edges(self, i: int) -> dict[str, bool]:
        """The flags of bucket ``i``'s load step: the first begins the update, the last
        finishes it (two steps saved per round)."""
        return {"begin": i == 0, "finish": i == len(self.buckets) - 1, "direct": self.direct_load}


class WeightTransport(ABC):
    """Moves one round's buckets to the workers. Subclasses set ``name``."""

    name: ClassVar[str]

    def __init__(self, **options: Any) -> None:
        self.options = options
        """The options it was made with (the client reuses it for the same name and options)."""

    def prepare(self, shipment: Shipment) -> None:  # noqa: B027 - optional hook
        """Runs while the workers pause, before ``send``: allocate or grow buffers, pack the first bucket."""

    @abstractmethod
    async def send(self, rnd: SyncRound, shipment: Shipment) -> None:
        """Every data step of the round: each bucket moved and loaded, begin and finish included."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free what it holds (the client calls this on close, or when it switches transport)."""
