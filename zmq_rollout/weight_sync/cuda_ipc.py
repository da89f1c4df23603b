"""The CUDA IPC transport: the trainer's GPU buffers, shared once, mapped once.

The trainer packs buckets into GPU buffers (``CudaIpcBuffers``) that it exports *once* and
keeps across rounds; a worker maps each by its handle *once* (``CudaIpcCache``) and loads
straight from it. Neither side allocates, exports or maps anything per round, so GPU
memory stays flat however many rounds run (exporting per round is what makes memory grow
in rollout servers that do). The handle is plain values (``protocol.CudaIpcHandle``,
msgpack): no pickle. torch is imported inside functions.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from zmq_rollout import protocol as p
from zmq_rollout.errors import InvalidRequestError, SyncError
from zmq_rollout.protocol import CudaIpcHandle

from .buckets import Bucket, copy_split, pack, split_copies
from .transport import Shipment, WeightTransport

if TYPE_CHECKING:
    import torch

    from .round import SyncRound

__all__ = [
    "BucketLayouts",
    "CudaIpcBuffers",
    "CudaIpcCache",
    "CudaIpcTransport",
    "LayoutNames",
    "UnknownLayout",
    "cuda_device_uuid",
    "exported_event",
    "open_cuda_ipc",
    "share_storage",
    "step_with_layout",
    "stream_wait",
]

log = logging.getLogger(__name__)

MAX_LAYOUTS = 64
"""Bucket layouts a worker holds (and a trainer names) at once; the oldest go first."""


class CudaIpcTransport(WeightTransport):
    """``load_ipc2`` steps over two exported GPU buffers (one for a one-bucket shipment) kept
    across rounds (reallocated only when a bucket outgrows them, or a second one is needed;
    workers unmap the old ones when a step no longer names them)."""

    name = "cuda_ipc"

    def __init__(self) -> None:
        super().__init__()
        self.buffers: CudaIpcBuffers | None = None
        self.layouts = LayoutNames()

    def prepare(self, shipment: Shipment) -> None:
        import torch

        if not torch.cuda.is_available():
            raise InvalidRequestError("transport='cuda_ipc' needs CUDA in the trainer; use 'shm' on CPU")
        on_gpu = next((t.device for t in shipment.tensors.values() if t.is_cuda), None)
        device = on_gpu if on_gpu is not None else torch.device("cuda", torch.cuda.current_device())
        held, count = self.buffers, min(2, len(shipment.buckets))  # one bucket needs one buffer
        if held is None or held.size < shipment.largest or held.device != device or len(held.handles) < count:
            self.close()
            held = self.buffers = CudaIpcBuffers(shipment.largest, n=count, device=device)
        held.pack(0, shipment.buckets[0], shipment.tensors)

    async def send(self, rnd: SyncRound, shipment: Shipment) -> None:
        """Bucket 0 is packed already (``prepare``; maybe still on the GPU's stream).

        No wait for a pack here: each pack records its buffer's ready event, and a worker's
        reads wait for it on the GPU, so the step travels while the bytes are still being
        packed (a worker answers only once its reads are done, so a buffer is reused only
        after every worker has read it)."""
        ipc = self.buffers
        assert ipc is not None, "prepare() first"
        live = [h.buffer_id for h in ipc.handles]
        buckets = shipment.buckets
        for i, bucket in enumerate(buckets):
            load = asyncio.ensure_future(self._load(rnd, ipc.handles[i % 2], bucket, live, shipment.edges(i)))
            if i + 1 < len(buckets):  # pack the next bucket while the workers load this one
                ipc.pack((i + 1) % 2, buckets[i + 1], shipment.tensors)
            await load

    async def _load(
        self, rnd: SyncRound, handle: CudaIpcHandle, bucket: Bucket, live: list[str], edges: dict[str, bool]
    ) -> None:
        """One ``load_ipc2``, its layout by name where every member holds it (``step_with_layout``)."""
        name = self.layouts.name(bucket)
        await step_with_layout(
            rnd,
            self.layouts,
            name,
            p.LoadIpc(handle, p.Bucket(bucket.index, bucket.nbytes, []), name, live, **edges),
            p.LoadIpc(handle, bucket, name, live, **edges),
        )

    def close(self) -> None:
        if self.buffers is not None:
            self.buffers.close()  # workers unmap it when the next load names only the new buffers
            self.buffers = None


async def step_with_layout(
    rnd: SyncRound, layouts: LayoutNames, name: str, by_name: p.AnySyncOp, in_full: p.AnySyncOp
) -> None:
    """Send a step that carries layout ``name``: ``by_name`` (the layout by its name alone: no
    tensor list to encode, relay, decode and check on each hop) where every member holds it,
    else ``in_full``. A member that lost it fails the step with ``UnknownLayout`` before any
    weight moved, and the step goes again in full."""
    if layouts.held_by(name, rnd.members):
        try:
            await rnd.step(by_name)
            return
        except SyncError as exc:
            if p.UNKNOWN_LAYOUT not in str(exc):
                raise
            log.info("weight sync: a worker lost layout %s; sending it again", name)
    await rnd.step(in_full)
    layouts.sent(name, rnd.members)


class LayoutNames:
    """The trainer's names for layouts, and which workers hold each.

    ``plan_buckets_cached`` hands out the same ``Bucket`` for the same layout (and
    ``cuda_ipc_tensors`` the same list of sources), so a layout is known by its object (held
    here, so that its ``id`` is not reused) and named once; a layout planned again gets a
    new name and is sent once more, which is only slower."""

    def __init__(self) -> None:
        self._names: dict[int, tuple[object, str]] = {}
        self._holders: dict[str, set[str]] = {}

    def name(self, layout: object) -> str:
        known = self._names.get(id(layout))
        if known is None:
            if len(self._names) >= MAX_LAYOUTS:  # workers keep as many: name the oldest no more
                _, old = self._names.pop(next(iter(self._names)))
                self._holders.pop(old, None)
            known = self._names[id(layout)] = (layout, uuid.uuid4().hex[:16])
        return known[1]

    def held_by(self, name: str, members: Iterable[str]) -> bool:
        """Whether every one of ``members`` was sent layout ``name`` (and answered)."""
        holders = self._holders.get(name)
        return holders is not None and holders.issuperset(members)

    def sent(self, name: str, members: Iterable[str]) -> None:
        """``members`` loaded a step that carried layout ``name`` in full (a worker identity
        is new after each reconnect, so the set never outgrows the fleet by much)."""
        self._holders[name] = set(members)


class UnknownLayout(ValueError):
    """A ``load_ipc2`` names a layout this worker does not hold (restarted, or evicted it)."""


class BucketLayouts:
    """A worker's bucket layouts by the trainer's name (``load_ipc2``'s and
    ``load_ipc_tensors``' ``layout``), the last ``MAX_LAYOUTS``: a ``Bucket`` for a
    ``load_ipc2``, the list of sources for a ``load_ipc_tensors``."""

    def __init__(self) -> None:
        self._layouts: dict[str, Bucket | list[p.IpcSource]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._layouts

    @staticmethod
    def carries_layout(op: p.LoadIpc | p.LoadIpcTensors) -> bool:
        """Whether the step carries its layout in full (else it names one sent before)."""
        return bool(op.bucket.tensors if isinstance(op, p.LoadIpc) else op.sources)

    def _keep(self, name: str, layout: Bucket | list[p.IpcSource]) -> None:
        if name not in self._layouts and len(self._layouts) >= MAX_LAYOUTS:
            self._layouts.pop(next(iter(self._layouts)))
        self._layouts[name] = layout

    def _held(self, name: str) -> Bucket | list[p.IpcSource]:
        layout = self._layouts.get(name)
        if layout is None:
            raise UnknownLayout(f"{p.UNKNOWN_LAYOUT} {name!r}: never sent to this worker")
        return layout

    def remember(self, op: p.LoadIpc | p.LoadIpcTensors) -> None:
        """Keep the layout of a step that carries it in full."""
        if isinstance(op, p.LoadIpc):
            self.resolve(op)
        else:
            self.sources(op)

    def resolve(self, op: p.LoadIpc) -> Bucket:
        """The step's bucket in full: kept if it came in full, else the one kept under its name."""
        if op.bucket.tensors:
            self._keep(op.layout, op.bucket)
            return op.bucket
        bucket = self._held(op.layout)
        if not isinstance(bucket, Bucket):
            raise ValueError(f"bucket layout {op.layout!r} names the trainer's tensors, not a bucket")
        if bucket.index != op.bucket.index or bucket.nbytes != op.bucket.nbytes:
            raise ValueError(
                f"bucket layout {op.layout!r} is bucket {bucket.index} of {bucket.nbytes} bytes, "
                f"not {op.bucket.index} of {op.bucket.nbytes}"
            )
        return bucket

    def sources(self, op: p.LoadIpcTensors) -> list[p.IpcSource]:
        """The step's sources in full: kept if they came in full, else those kept under its name."""
        if op.sources:
            self._keep(op.layout, op.sources)
            return op.sources
        sources = self._held(op.layout)
        if isinstance(sources, Bucket):
            raise ValueError(f"layout {op.layout!r} is a bucket, not the trainer's tensors")
        return sources


def cuda_device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def exported_event(device: torch.device) -> tuple[torch.cuda.Event, bytes]:
    """A new interprocess CUDA event made on ``device``, and its handle for other processes."""
    import torch

    event = torch.cuda.Event(interprocess=True)
    with torch.cuda.device(device):
        event.record(torch.cuda.current_stream(device))  # created on this device, and exportable
        return event, bytes(event.ipc_handle())


def share_storage(storage: Any, device_uuid: str, event_handle: bytes) -> CudaIpcHandle:
    """Export ``storage`` (``_share_cuda_``) under a new ``buffer_id``, with ``event_handle``
    as its ready event (empty for none). Export a storage once: each call wraps it again in
    torch's cross-process reference counting. Raises torch's RuntimeError where it cannot."""
    _, handle, storage_size, storage_offset, rc_handle, rc_offset, _ev_handle, _ev_sync = storage._share_cuda_()
    return CudaIpcHandle(
        uuid.uuid4().hex,
        device_uuid,
        int(storage.nbytes()),
        bytes(handle),
        int(storage_size),
        int(storage_offset),
        bytes(rc_handle),
        int(rc_offset),
        event_handle,
        False,
    )


def stream_wait(event: torch.cuda.Event, device: torch.device) -> None:
    """Make ``device``'s current stream wait for ``event`` (on the GPU: the host does not block)."""
    import torch

    torch.cuda.current_stream(device).wait_event(event)


class CudaIpcBuffers:
    """``n`` GPU buffers of ``size`` bytes, each exported once; the trainer keeps them across rounds.

    Exporting a storage (``_share_cuda_``) per round is what makes memory grow in rollout
    servers that do: each export pins the block on both sides until the other side lets go.
    Here a buffer is exported when it is allocated and the handle is reused every round.
    Not usable with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (torch cannot
    export such memory); the error says so.
    """

    def __init__(self, size: int, n: int = 2, device: Any = None) -> None:
        """Each buffer comes with an interprocess CUDA event, exported with it (the handle's
        ``event_handle``, ``event_sync_required`` False): ``pack`` records it, and a worker's
        reads wait for it on the GPU (``CudaIpcCache.ready_event``)."""
        import torch

        if size <= 0 or n <= 0:
            raise ValueError(f"need a positive size and count, got size={size} n={n}")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA IPC buffers live on a CUDA device, not {self.device}")
        self.size = size
        self.pack_plans: dict[Any, tuple[list[torch.Tensor], list[int], list[int]]] = {}
        uuid_ = cuda_device_uuid(self.device.index if self.device.index is not None else torch.cuda.current_device())
        self._tensors: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []
        self.handles: list[CudaIpcHandle] = []
        for _ in range(n):
            tensor = torch.empty(size, dtype=torch.uint8, device=self.device)
            # torch's own event (recorded once, at export) is superseded by ``ready``, which
            # every pack records again: a worker waits for it before each read.
            ready, ready_handle = exported_event(self.device)
            try:
                handle = share_storage(tensor.untyped_storage(), uuid_, ready_handle)
            except RuntimeError as e:
                raise RuntimeError(
                    f"could not export a CUDA buffer for IPC ({e}); CUDA IPC does not work with "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: unset it in the trainer, or use transport='shm'"
                ) from e
            self._tensors.append(tensor)
            self._events.append(ready)
            self.handles.append(handle)

    def tensor(self, i: int) -> torch.Tensor:
        return self._tensors[i]

    def pack(self, i: int, bucket: Bucket, tensors_by_name: dict[str, torch.Tensor]) -> None:
        """``pack`` into buffer ``i``, then record its ready event (on the current stream).

        The buffer's slices for a bucket laid out the same way are kept, as views of each
        tensor's dtype and shape (never the trainer's tensors), so later rounds copy straight
        from the trainer's tensors (no per-tensor view to make; whole elements, not bytes): a
        ``copy_`` per large tensor, one foreach copy for the rest (``copy_split``)."""
        import torch

        sources = [tensors_by_name[m.name] for m in bucket.tensors]
        device = self.device
        ok = all(t.device == device for t in sources)
        key = (i, tuple((m.name, m.dtype, tuple(m.shape), m.offset) for m in bucket.tensors))
        plan = self.pack_plans.get(key) if ok else None
        out = self._tensors[i]
        if plan is None:
            pack(bucket, tensors_by_name, out)  # checks dtypes and shapes too
            if ok:
                if len(self.pack_plans) >= 256:
                    self.pack_plans.clear()
                dsts = [
                    out[m.offset : m.offset + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape)
                    for m in bucket.tensors
                ]
                self.pack_plans[key] = (dsts, *split_copies(dsts, sources))
        else:
            with torch.no_grad():
                copy_split(plan[0], sources, plan[1], plan[2])
        self._events[i].record(torch.cuda.current_stream(device))

    def close(self) -> None:
        """Drop the buffers: torch frees each once every worker has unmapped it."""
        self._tensors.clear()
        self._events.clear()
        self.handles.clear()
        self.pack_plans.clear()


class CudaIpcCache:
    """A worker's mappings of the trainer's exported buffers, by ``buffer_id``.

    ``get`` maps a buffer the first time its id is seen and returns the same tensor after.
    ``retain(ids)`` unmaps every other buffer (and closes every other event), so a trainer that
    reallocates (a larger bucket, new parameters, a restart) does not leave its old buffers pinned.
    """

    def __init__(self) -> None:
        self._mapped: dict[str, torch.Tensor] = {}
        self._events: dict[str, torch.cuda.Event | None] = {}
        self.num_opened = 0

    def __len__(self) -> int:
        return len(self._mapped)

    def retain(self, buffer_ids: Iterable[str]) -> None:
        keep = set(buffer_ids)
        for buffer_id in [b for b in self._mapped if b not in keep]:
            del self._mapped[buffer_id]
        for event_id in [e for e in self._events if e not in keep]:
            del self._events[event_id]

    def ready_event(self, handle: CudaIpcHandle) -> torch.cuda.Event | None:
        """The trainer's ready event for this buffer, opened once: each pack records it, and
        reads must wait for it (``wait_ready``). None for a handle that carries torch's own
        export event instead (``event_sync_required``: waited for once, when mapped)."""
        if handle.buffer_id not in self._events:
            event = None
            if handle.event_handle and not handle.event_sync_required:
                import torch

                event = torch.cuda.Event.from_ipc_handle(self.get(handle).device, handle.event_handle)
            self._events[handle.buffer_id] = event
        return self._events[handle.buffer_id]

    def event(self, event_id: str, event_handle: bytes, device: torch.device) -> torch.cuda.Event:
        """The trainer's interprocess event ``event_id``, opened once (``retain`` drops it
        when a step no longer names it)."""
        event = self._events.get(event_id)
        if event is None:
            import torch

            event = self._events[event_id] = torch.cuda.Event.from_ipc_handle(device, event_handle)
        return event

    def wait_ready(self, handle: CudaIpcHandle, device: torch.device) -> None:
        """Make ``device``'s current stream wait until the trainer's last pack into this
        buffer is done (a GPU-side wait: the host does not block)."""
        event = self.ready_event(handle)
        if event is not None:
            stream_wait(event, device)

    def get(self, handle: CudaIpcHandle) -> torch.Tensor:
        tensor = self._mapped.get(handle.buffer_id)
        if tensor is None:
            tensor = self._mapped[handle.buffer_id] = open_cuda_ipc(handle)
            self.num_opened += 1
        return tensor

    def clear(self) -> None:
        self._mapped.clear()
        self._events.clear()


def open_cuda_ipc(handle: CudaIpcHandle) -> torch.Tensor:
    """Map the trainer's buffer ``handle`` as a 1-D uint8 CUDA tensor of ``handle.nbytes``."""
    import torch

    index = next((i for i in range(torch.cuda.device_count()) if cuda_device_uuid(i) == handle.device_uuid), None)
    if index is None:
        raise RuntimeError(
            f"the trainer's GPU {handle.device_uuid} is not visible to this worker "
            f"(it sees {torch.cuda.device_count()} GPUs); CUDA IPC needs trainer and worker on the same "
            "node with that GPU in CUDA_VISIBLE_DEVICES; use transport='nccl' or 'shm' otherwise"
        )
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        handle.handle,
        handle.storage_size,
        handle.storage_offset,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle,  # bytes, empty for none (torch reads it only if event_sync_required)
        handle.event_sync_required,
    )
    tensor = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    tensor.set_(storage, 0, (handle.nbytes,), (1,))
    return tensor
