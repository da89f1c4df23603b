"""vLLM's weight-transfer request bodies, and its packed layout as our buckets. Pure (no torch).

The bodies are vLLM 0.32's (``vllm/distributed/weight_transfer/nccl_common.py``
``NCCLWeightTransferInitInfo``, ``nccl_engine.py`` ``NCCLWeightTransferUpdateInfo``):

- ``init_info``: ``master_address``, ``master_port`` (the trainer, rank 0, hosts the
  rendezvous there), ``rank_offset`` (the first worker rank: 1), ``world_size`` (the trainer
  and every worker rank), ``packed``, ``packed_buffer_size_bytes``, ``packed_num_buffers``;
  and ours: ``backend`` (``"gloo"``), which a trainer may send to say what it speaks, and
  ``check_names`` (false), to have each update's names checked against the workers'
  checkpoints before anything loads.
- ``update_info``: ``names``, ``dtype_names`` (``"bfloat16"``), ``shapes``, in the order the
  trainer broadcasts them (vLLM before 0.28 also took ``packed`` here).

vLLM's packed broadcast (``packed_tensor.py``) concatenates the tensors' bytes with no
padding and cuts a chunk right after the tensor that takes it past
``packed_buffer_size_bytes``; unpacked, every tensor is its own broadcast. ``chunks`` gives
that layout as our ``Bucket``s, so each broadcast is one ``receive_bucket`` step, and the
trainer side packs with the same function (``zmq_rollout.integrations.vllm_weights``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from zmq_rollout.protocol.steps import DTYPE_SIZES, MAX_TENSORS, Bucket, TensorMeta

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
"""vLLM's ``DEFAULT_PACKED_BUFFER_SIZE_BYTES``."""
DEFAULT_PACKED_NUM_BUFFERS = 2
GROUP_NAME = "zr-vllm-weights"
"""The keys of the group's rendezvous (a ``PrefixStore`` in the trainer's ``TCPStore``)."""
INIT_KEYS = frozenset(
    {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed",
     "packed_buffer_size_bytes", "packed_num_buffers", "backend", "check_names"}
)  # fmt: skip


class BadBody(ValueError):
    """A request body the weight endpoints refuse (a 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _int(d: dict[str, Any], key: str, lo: int, hi: int, default: int | None = None) -> int:
    value = d.get(key, default)
    if type(value) is not int or not lo <= value <= hi:
        raise BadBody(f"init_info.{key} must be an integer in {lo}..{hi}, got {value!r}", f"init_info.{key}")
    return value


def _bool(d: dict[str, Any], key: str, where: str, default: bool | None = None) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise BadBody(f"{where}.{key} must be true or false, got {value!r}", f"{where}.{key}")
    return value


@dataclass(frozen=True)
class InitInfo:
    """What ``/init_weight_transfer_engine`` said: where the trainer's group meets, and the layout."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    backend: str = "gloo"
    check_names: bool = False
    """Ours: an update's names are first compared with the workers' checkpoints (off, as vLLM:
    a trainer may send names the engine maps, which a checkpoint check would refuse)."""

    @classmethod
    def parse(cls, body: Any, backend: str) -> InitInfo:
        """``{"init_info": {...}}`` as vLLM's endpoint takes it; ``backend``: the gateway's."""
        info = body.get("init_info") if isinstance(body, dict) else None
        if not isinstance(info, dict):
            raise BadBody('the body must be {"init_info": {...}}', "init_info")
        unknown = sorted(set(info) - INIT_KEYS)
        if unknown:
            raise BadBody(f"init_info has unknown fields {unknown}", f"init_info.{unknown[0]}")
        if info.get("nccl_unique_id_b64"):
            raise BadBody(
                f"init_info.nccl_unique_id_b64 needs NCCL; this gateway's weight transfer is {backend}, "
                "which meets at master_address:master_port",
                "init_info.nccl_unique_id_b64",
            )
        asked = info.get("backend", backend)
        if asked != backend:
            raise BadBody(f"init_info.backend={asked!r}, but this gateway's weight transfer is {backend!r}",
                          "init_info.backend")  # fmt: skip
        address = info.get("master_address")
        if not isinstance(address, str) or not address:
            raise BadBody(f"init_info.master_address must be a host name or address, got {address!r}",
                          "init_info.master_address")  # fmt: skip
        offset = _int(info, "rank_offset", 0, 1 << 20)
        if offset != 1:
            raise BadBody(
                f"init_info.rank_offset must be 1 (the trainer is rank 0 and the broker numbers the workers' "
                f"ranks from 1), got {offset}",
                "init_info.rank_offset",
            )
        return cls(
            master_address=address,
            master_port=_int(info, "master_port", 1, 65535),
            world_size=_int(info, "world_size", 2, 1 << 20),
            rank_offset=offset,
            packed=_bool(info, "packed", "init_info", False),
            packed_buffer_size_bytes=_int(
                info, "packed_buffer_size_bytes", 1, 1 << 40, DEFAULT_PACKED_BUFFER_SIZE_BYTES
            ),
            packed_num_buffers=_int(info, "packed_num_buffers", 1, 64, DEFAULT_PACKED_NUM_BUFFERS),
            backend=backend,
            check_names=_bool(info, "check_names", "init_info", False),
        )

    def body(self) -> dict[str, Any]:
        """The request body that says this (what a trainer posts)."""
        return {"init_info": asdict(self)}


@dataclass(frozen=True)
class UpdateInfo:
    """What one ``/update_weights`` announces: the tensors the trainer is about to broadcast, in order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool | None = None
    """vLLM before 0.28 said it here; else ``InitInfo.packed`` holds."""

    @classmethod
    def parse(cls, body: Any) -> UpdateInfo:
        info = body.get("update_info") if isinstance(body, dict) else None
        if isinstance(info, list):
            raise BadBody("update_info as a list (sharded engines) is not served; send one object", "update_info")
        if not isinstance(info, dict):
            raise BadBody('the body must be {"update_info": {"names": [...], "dtype_names": [...], '
                          '"shapes": [...]}}', "update_info")  # fmt: skip
        unknown = sorted(set(info) - {"names", "dtype_names", "shapes", "packed"})
        if unknown:
            raise BadBody(f"update_info has unknown fields {unknown}", f"update_info.{unknown[0]}")
        lists: list[list[Any]] = []
        for key in ("names", "dtype_names", "shapes"):
            value = info.get(key)
            if not isinstance(value, list):
                raise BadBody(f"update_info.{key} must be a list, got {value!r}", f"update_info.{key}")
            lists.append(value)
        names, dtypes, shapes = lists
        if not len(names) == len(dtypes) == len(shapes):
            raise BadBody(f"update_info has {len(names)} names, {len(dtypes)} dtype_names and {len(shapes)} "
                          "shapes; they must pair up", "update_info.names")  # fmt: skip
        if len(names) > MAX_TENSORS:
            raise BadBody(f"update_info names at most {MAX_TENSORS} tensors", "update_info.names")
        for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
            if not isinstance(name, str) or not name:
                raise BadBody(f"update_info.names[{i}] must be a tensor name, got {name!r}", "update_info.names")
            if dtype not in DTYPE_SIZES:
                raise BadBody(f"update_info.dtype_names[{i}] ({name}): {dtype!r} is not one of "
                              f"{sorted(DTYPE_SIZES)}", "update_info.dtype_names")  # fmt: skip
            if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
                raise BadBody(f"update_info.shapes[{i}] ({name}) must be a list of non-negative integers, "
                              f"got {shape!r}", "update_info.shapes")  # fmt: skip
        packed = None if info.get("packed") is None else _bool(info, "packed", "update_info")
        return cls(names, dtypes, shapes, packed)

    def body(self) -> dict[str, Any]:
        fields = {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes}
        return {"update_info": fields if self.packed is None else {**fields, "packed": self.packed}}


def chunks(update: UpdateInfo, init: InitInfo) -> list[Bucket]:
    """The broadcasts the trainer makes for ``update``, in vLLM's layout, as buckets (one
    ``receive_bucket`` each). ``BadBody`` if a tensor's bytes would not start at a multiple of
    its element size (vLLM packs with no padding; then its workers could not view them either)."""
    packed = init.packed if update.packed is None else update.packed
    limit = init.packed_buffer_size_bytes
    out: list[Bucket] = []
    metas: list[TensorMeta] = []
    end = 0
    for name, dtype, shape in zip(update.names, update.dtype_names, update.shapes, strict=True):
        size = DTYPE_SIZES[dtype]
        nbytes = math.prod(shape) * size
        if end % size:
            raise BadBody(
                f"in vLLM's packed layout {name} ({dtype}) would start at byte {end} of its chunk, which is not a "
                f"multiple of {size}: order the tensors by dtype, or send packed=false",
                "update_info.names",
            )
        metas.append(TensorMeta(name, dtype, list(shape), end, nbytes))
        end += nbytes
        if not packed or end > limit:
            out.append(Bucket(len(out), end, metas))
            metas, end = [], 0
    if metas:
        out.append(Bucket(len(out), end, metas))
    return out
