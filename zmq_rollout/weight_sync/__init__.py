"""Weight sync: pushing a trainer's weights into every rollout engine, and both halves of its data plane.

The trainer's half: ``update_weights`` / ``update_lora`` (``update.py``) drive a round
through the broker (``round.py``) and move the bytes over a ``WeightTransport``
(``transport.py``; one module per transport: ``shm.py``, ``cuda_ipc.py``,
``collective.py``; by name: ``factory.py``). The worker's half of each transport (mapping
a segment, a GPU buffer, joining a group) lives in the same module and is called from
``zmq_rollout.workers.receiver``. Buckets (``buckets.py``) are what every transport moves.

Nothing here imports torch at module level.
"""

from .factory import TRANSPORTS, make_transport
from .round import StepSender, SyncReport, SyncRound
from .transport import Shipment, WeightTransport
from .update import DEFAULT_BUCKET_BYTES, update_lora, update_weights

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "TRANSPORTS",
    "Shipment",
    "StepSender",
    "SyncReport",
    "SyncRound",
    "WeightTransport",
    "make_transport",
    "update_lora",
    "update_weights",
]
