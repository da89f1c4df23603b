"""Transports by name: ``make_transport("shm")``. A new transport is one line here."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from zmq_rollout.errors import InvalidRequestError

from .collective import CollectiveTransport
from .cuda_ipc import CudaIpcTransport
from .cuda_ipc_tensors import CudaIpcTensorsTransport
from .shm import ShmTransport
from .transport import WeightTransport

TRANSPORTS: dict[str, Callable[..., WeightTransport]] = {
    "shm": ShmTransport,
    "cuda_ipc": CudaIpcTransport,
    "cuda_ipc_tensors": CudaIpcTensorsTransport,
    "gloo": functools.partial(CollectiveTransport, "gloo"),
    "nccl": functools.partial(CollectiveTransport, "nccl"),
}


def make_transport(name: str, **options: Any) -> WeightTransport:
    """A new transport ``name`` (a key of ``TRANSPORTS``) made with ``options``."""
    make = TRANSPORTS.get(name)
    if make is None:
        raise InvalidRequestError(f"transport={name!r}; expected one of {sorted(TRANSPORTS)}")
    try:
        return make(**options)
    except TypeError as exc:
        raise InvalidRequestError(f"transport {name!r} does not take {sorted(options)}: {exc}") from None
