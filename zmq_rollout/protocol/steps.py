"""The steps of a weight-sync round, each its own typed Struct, and what they carry.

Every step is a ``SyncOp`` subclass, tagged on the wire by its name, e.g. ``["commit", 4]``;
one name per step on every hop: the trainer's ``begin`` is the worker's ``begin`` (which,
for a worker, means: pause generating). ``SYNC_OPS`` lists them in round order; each
docstring says what a worker does and ``RESULT`` what it answers (docs/protocol.md section
8.2 is generated from them). The messages that carry a step are in ``sync.py``.

The tensor bytes never travel in a step (except a LoRA adapter's, which is small):
``Bucket`` says where each tensor lies in a buffer that moves over shared memory, CUDA IPC
or a collective.
"""

from __future__ import annotations

import typing
from typing import Any, ClassVar, Union

from .base import MAX_LORA_NAME, MAX_VERSION, Struct, check_finite, check_int, check_name

PAUSE_MODES = ("abort", "wait", "keep")
BACKENDS = ("gloo", "nccl")
MAX_TENSORS = 1 << 20
MAX_LAYOUT_NAME = 64
UNKNOWN_LAYOUT = "unknown bucket layout"
"""What a worker's failed ``load_ipc2`` says when it does not hold the step's layout."""

#: Bytes per element of the dtypes a bucket may carry (torch names, no ``torch.`` prefix).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

# -- what a step carries -----------------------------------------------------------------


def _elements(shape: list[int], limit: int) -> int:
    """The product of ``shape`` (non-negative ints), or ``limit + 1`` once it passes ``limit``.
    Multiplied out in full, a shape of many huge dimensions costs time quadratic in its length
    (a 270 KB shape of 2**64-1s took 4 s; 64 MiB would stop the broker for days)."""
    if 0 in shape:
        return 0
    count = 1
    for d in shape:
        count *= d
        if count > limit:
            return limit + 1
    return count


class TensorMeta(Struct):
    """One tensor in a bucket: its contiguous row-major bytes at byte ``offset`` of the buffer."""

    name: str
    """The checkpoint name, e.g. ``model.layers.0.self_attn.q_proj.weight``."""
    dtype: str
    """A torch dtype name without ``torch.``: a key of ``DTYPE_SIZES``."""
    shape: list[int]
    offset: int
    """Byte offset in the bucket's buffer (the reference trainer aligns it to 256)."""
    nbytes: int
    """The product of ``shape`` times the dtype's size."""

    def __post_init__(self) -> None:
        size = DTYPE_SIZES.get(self.dtype)
        if size is None:
            raise ValueError(f"tensor {self.name!r} has dtype {self.dtype!r}, which weight sync does not carry")
        if any(type(d) is not int or d < 0 for d in self.shape) or self.offset < 0:
            raise ValueError(f"tensor {self.name!r}: shape and offset must be non-negative integers")
        if self.nbytes != _elements(self.shape, self.nbytes) * size:
            shape = self.shape if len(self.shape) <= 8 else f"[{len(self.shape)} dimensions]"
            raise ValueError(f"tensor {self.name!r}: {self.nbytes} bytes do not fit {self.dtype}{shape}")


class Bucket(Struct):
    """The tensors that travel together in one buffer of ``nbytes`` bytes (``index``: send order)."""

    index: int
    """Counts from 0 in send order."""
    nbytes: int
    """Bytes of the buffer the tensors lie in (little-endian, as on x86 and ARM)."""
    tensors: list[TensorMeta]

    def __post_init__(self) -> None:
        if self.index < 0 or self.nbytes < 0:
            raise ValueError("a bucket's index and nbytes are non-negative")
        for t in self.tensors:
            if t.offset + t.nbytes > self.nbytes:
                raise ValueError(f"tensor {t.name!r} ends past bucket {self.index}'s {self.nbytes} bytes")


class CudaIpcHandle(Struct):
    """What a worker needs to map one of the trainer's GPU buffers: plain values, no pickle.

    The fields after ``nbytes`` are those of torch's ``UntypedStorage._share_cuda_()``.
    ``buffer_id`` names this export: a worker maps a buffer once and reuses the mapping
    while the trainer keeps sending the same id.
    """

    buffer_id: str
    """Names this export; a worker maps a buffer once per id."""
    device_uuid: str
    """The GPU's UUID as torch reports it: device indices differ between processes (CUDA_VISIBLE_DEVICES)."""
    nbytes: int
    """The buffer's size."""
    handle: bytes
    """The allocation's ``cudaIpcMemHandle``."""
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    """torch's cross-process reference counter (a shared-memory file handle)."""
    ref_counter_offset: int
    event_handle: bytes
    """The buffer's interprocess CUDA event: ``load_ipc2`` needs the trainer's ready event here
    (``event_sync_required`` false), recorded after each pack."""
    event_sync_required: bool


class IpcSource(Struct):
    """One of the trainer's own GPU storages, exported once, and the round's tensors that lie in
    it (``bucket``: byte offsets within the storage; ``bucket.index`` counts the sources)."""

    handle: CudaIpcHandle
    """The storage's export (``event_handle`` empty: the step's ``ready_event`` covers every source)."""
    bucket: Bucket

    def __post_init__(self) -> None:
        if self.bucket.nbytes > self.handle.nbytes:
            raise ValueError(
                f"source {self.bucket.index} ({self.bucket.nbytes} bytes) does not fit the trainer's storage "
                f"{self.handle.buffer_id} ({self.handle.nbytes} bytes)"
            )


class NameCheck(Struct):
    """A worker's answer to ``check_names``."""

    missing: list[str]
    """Names in its checkpoint that the trainer will not send."""
    unknown: list[str]
    """Names the trainer will send that its checkpoint lacks."""


# -- the steps ---------------------------------------------------------------------------


class SyncOp(Struct):
    """A step of a round. ``RESULT`` describes ``ControlAck.result`` for it."""

    RESULT: ClassVar[str] = "nil"

    @property
    def kind(self) -> str:
        """The step's name on the wire (its tag), e.g. ``"load_shm"``."""
        return str(self.__struct_config__.tag)


class Begin(SyncOp, tag="begin"):
    """Opens a round (``round_id`` is ignored; the broker numbers rounds): every registered
    worker becomes a member and stops generating in ``pause`` mode (section 8.4)."""

    RESULT: ClassVar[str] = "int: the ranks it brings to a collective (its tensor-parallel size)"
    pause: str = "wait"

    def __post_init__(self) -> None:
        if self.pause not in PAUSE_MODES:
            raise ValueError(f"pause={self.pause!r}; expected one of {list(PAUSE_MODES)}")


class CheckNames(SyncOp, tag="check_names"):
    """Compares ``names`` (every tensor the trainer will send) with the tensor names in the
    worker's model folder (``*.safetensors``)."""

    RESULT: ClassVar[str] = "NameCheck"
    names: list[str]

    def __post_init__(self) -> None:
        if len(self.names) > MAX_TENSORS:
            raise ValueError(f"check_names takes at most {MAX_TENSORS} names")


class BeginUpdate(SyncOp, tag="begin_update"):
    """Prepares the model to receive weights (loading straight into the parameters where
    the model qualifies and ``direct``, else vLLM's layerwise reload). From here the
    worker's weights are *dirty* until ``commit``."""

    direct: bool = True


class LoadShm(SyncOp, tag="load_shm"):
    """Maps the POSIX shared-memory segment ``/shm_name`` (same host), loads ``bucket`` from
    its first ``bucket.nbytes`` bytes, unmaps it; never unlinks. ``begin``: run
    ``begin_update`` (with ``direct``) first; ``finish``: run ``finish_update`` after and
    reset the prefix cache."""

    RESULT: ClassVar[str] = "int: tensors loaded, summed over its ranks"
    shm_name: str
    bucket: Bucket
    begin: bool = False
    finish: bool = False
    direct: bool = True


class LoadIpc(SyncOp, tag="load_ipc2"):
    """Maps the trainer's GPU buffer ``handle`` unless its ``buffer_id`` is mapped already
    (mappings are kept across rounds), unmaps every buffer whose id is not in ``live``, makes
    its reads wait (on the GPU) for the buffer's ready event ``handle.event_handle``, which the
    trainer records after each pack, loads the bucket from the buffer's first ``bucket.nbytes``
    bytes, and answers once its reads are done. ``layout`` names the bucket's tensor layout:
    ``bucket.tensors`` empty means the tensors of the bucket sent earlier under that name (the
    trainer sends a layout once; a worker that does not hold it fails the step with
    "unknown bucket layout" and no weight moved, and the trainer sends it again). ``begin``,
    ``finish``, ``direct`` as for ``load_shm``.

    Named ``load_ipc2`` because ``load_ipc`` (releases before the ready event) read the buffer
    without waiting: such a worker refuses this step rather than read a half-packed buffer."""

    RESULT: ClassVar[str] = "int: tensors loaded, summed over its ranks"
    handle: CudaIpcHandle
    bucket: Bucket
    layout: str
    live: list[str] = []
    begin: bool = False
    finish: bool = False
    direct: bool = True

    def __post_init__(self) -> None:
        if self.bucket.nbytes > self.handle.nbytes:
            raise ValueError(
                f"bucket {self.bucket.index} ({self.bucket.nbytes} bytes) does not fit CUDA IPC buffer "
                f"{self.handle.buffer_id} ({self.handle.nbytes} bytes)"
            )
        if not self.handle.event_handle or self.handle.event_sync_required:
            raise ValueError(f"CUDA IPC buffer {self.handle.buffer_id} comes without its ready event")
        check_name("a bucket layout", self.layout, MAX_LAYOUT_NAME)


class LoadIpcTensors(SyncOp, tag="load_ipc_tensors"):
    """Loads the round's tensors straight from the trainer's own GPU storages (its parameters,
    updated in place between rounds): no staging buffer, one copy per tensor on the GPU. Maps
    each source's ``handle`` unless its ``buffer_id`` is mapped already (kept across rounds),
    unmaps every buffer whose id is not in ``live``, makes its reads wait (on the GPU) for the
    trainer's ``ready_event`` (recorded after its last write before the round; opened once per
    ``ready_id``), loads every source's tensors, and answers once its reads are done: the
    trainer writes its parameters again only after the round. ``layout`` as for ``load_ipc2``:
    ``sources`` empty means those sent earlier under that name. ``begin``, ``finish``,
    ``direct`` as for ``load_shm``."""

    RESULT: ClassVar[str] = "int: tensors loaded, summed over its ranks"
    ready_id: str
    ready_event: bytes
    layout: str
    sources: list[IpcSource] = []
    live: list[str] = []
    begin: bool = False
    finish: bool = False
    direct: bool = True

    def __post_init__(self) -> None:
        if not self.ready_event:
            raise ValueError("load_ipc_tensors comes without the trainer's ready event")
        check_name("a ready event id", self.ready_id, MAX_LAYOUT_NAME)
        check_name("a bucket layout", self.layout, MAX_LAYOUT_NAME)
        if len(self.sources) > MAX_TENSORS:
            raise ValueError(f"load_ipc_tensors takes at most {MAX_TENSORS} sources")


class JoinGroup(SyncOp, tag="join_group"):
    """Each of the worker's ranks joins the trainer's process group (a TCPStore at
    ``host:port``, keys under ``group_name``) as rank ``Control.rank_offset`` + its rank in
    the engine, of ``Control.world_size``; answers once all have joined, fails after
    ``timeout_s``."""

    host: str
    port: int
    backend: str
    timeout_s: float
    group_name: str

    def __post_init__(self) -> None:
        check_int("port", self.port, 1, 65535)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}; expected one of {list(BACKENDS)}")
        check_finite("timeout_s", self.timeout_s, 0.0, 86_400.0, lo_open=True)


class ReceiveBucket(SyncOp, tag="receive_bucket"):
    """Each rank receives ``bucket.nbytes`` bytes broadcast from rank 0 of the group, then
    loads them."""

    RESULT: ClassVar[str] = "int: tensors loaded, summed over its ranks"
    bucket: Bucket


class LeaveGroup(SyncOp, tag="leave_group"):
    """Leaves the group and frees the receive buffer."""


class FinishUpdate(SyncOp, tag="finish_update"):
    """Finishes loading (post-load processing of what is pending) and resets the state
    derived from the old weights."""

    RESULT: ClassVar[str] = "int: tensors loaded this round, summed over its ranks"


class LoraBucket(SyncOp, tag="lora_bucket"):
    """Keeps ``bucket``'s tensors, whose bytes are ``data``, for ``load_lora`` of ``adapter``;
    ``first`` drops any kept before. (A LoRA adapter is small: its bytes travel in the step.)"""

    RESULT: ClassVar[str] = "int: tensors received"
    adapter: str
    bucket: Bucket
    data: bytes
    first: bool = False

    def __post_init__(self) -> None:
        check_name("a LoRA adapter name", self.adapter, MAX_LORA_NAME)
        if len(self.data) < self.bucket.nbytes:
            raise ValueError(f"LoRA bucket {self.bucket.index} carries {len(self.data)} bytes of {self.bucket.nbytes}")


class LoadLora(SyncOp, tag="load_lora"):
    """Writes the kept tensors and ``peft_config`` (an ``adapter_config.json``) as an adapter
    folder and loads it into vLLM's LoRA slot ``adapter``, replacing what it held (workers
    need ``--enable-lora``)."""

    RESULT: ClassVar[str] = "int: tensors in the adapter"
    adapter: str
    peft_config: dict[str, Any]

    def __post_init__(self) -> None:
        check_name("a LoRA adapter name", self.adapter, MAX_LORA_NAME)


class Commit(SyncOp, tag="commit"):
    """Sets the worker's weight version to ``version`` and resumes generating. The round
    ends after this step; the broker's fleet version becomes the highest committed."""

    RESULT: ClassVar[str] = "int: the new version"
    version: int

    def __post_init__(self) -> None:
        check_int("version", self.version, 0, MAX_VERSION)


class Abort(SyncOp, tag="abort"):
    """Ends the round without a new version: the worker resumes with the weights it has or,
    if they are dirty (after ``begin_update``), exits with code 4 to be restarted from its
    checkpoint. The broker sends it by itself when the trainer is lost."""


#: Every step, in the order a round uses them: the type of a step on the wire.
AnySyncOp = Union[  # noqa: UP007 (msgspec needs a runtime Union)
    Begin,
    CheckNames,
    BeginUpdate,
    LoadShm,
    LoadIpc,
    LoadIpcTensors,
    JoinGroup,
    ReceiveBucket,
    LeaveGroup,
    FinishUpdate,
    LoraBucket,
    LoadLora,
    Commit,
    Abort,
]
SYNC_OPS: tuple[type[SyncOp], ...] = typing.get_args(AnySyncOp)
AckResult = Union[int, NameCheck, None]  # noqa: UP007
