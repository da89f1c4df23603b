"""The weight-sync data plane shared by trainer and worker: buckets, and the two transports.

A round of weight sync ships every tensor of the trainer's model to each rollout engine,
a *bucket* at a time. A bucket is one contiguous byte buffer plus a list of
``TensorMeta`` saying where each tensor lies in it; ``plan_buckets`` cuts the model into
buckets, ``pack`` fills a buffer, ``unpack`` turns one back into zero-copy tensor views.

Three transports move the bytes; each only ever moves *one bucket's buffer*:

- **shared memory** (trainer and engine on one host): the trainer packs into a segment
  of ``ShmBuffers``; the worker maps it by name (``attach_shm``), loads, and unmaps.
- **CUDA IPC** (trainer and engine on the GPUs of one node): ``zmq_rollout.cuda_ipc``.
- **a collective** (across hosts, GPU to GPU): ``CollectiveGroup`` is a process group of
  the trainer (rank 0) and every engine worker, built without ``init_process_group`` so it
  lives beside vLLM's own groups. The same code runs on gloo (CPU, CI) and NCCL (GPU).

The bucket metadata itself is small and travels in the control plane (msgpack).
Nothing here pickles. torch is imported inside functions: importing this module is cheap.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import socket
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import msgspec

if TYPE_CHECKING:
    import torch

__all__ = [
    "Bucket",
    "CollectiveGroup",
    "ShmBuffers",
    "TensorMeta",
    "attach_shm",
    "dtype_name",
    "named_tensors",
    "pack",
    "plan_buckets",
    "tensor_specs",
    "unpack",
]

log = logging.getLogger(__name__)

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


class TensorMeta(msgspec.Struct, array_like=True, gc=False):
    """One tensor in a bucket: ``nbytes`` bytes at byte ``offset`` of the bucket's buffer."""

    name: str
    dtype: str
    """A torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``."""
    shape: list[int]
    offset: int
    nbytes: int


class Bucket(msgspec.Struct, array_like=True, gc=False):
    """The tensors that travel together in one buffer of ``nbytes`` bytes."""

    index: int
    nbytes: int
    tensors: list[TensorMeta]


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def plan_buckets(named_shapes: list[tuple[str, str, list[int]]], bucket_bytes: int, align: int = 256) -> list[Bucket]:
    """Cut ``(name, dtype, shape)`` into buckets of at most ``bucket_bytes``, greedily and in order.

    Every offset is a multiple of ``align`` (a power of two, which also makes every view
    aligned for its dtype). A tensor larger than ``bucket_bytes`` gets a bucket of its own,
    so a buffer must hold ``max(b.nbytes for b in buckets)``, which can exceed ``bucket_bytes``.
    Keeping the trainer's order keeps a layer's tensors together, which is what vLLM's
    layerwise reload wants (it processes a layer once all its weights have arrived).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    buckets: list[Bucket] = []
    current: list[TensorMeta] = []
    end = 0
    for name, dtype, shape in named_shapes:
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {name!r} has dtype {dtype!r}, which weight sync does not carry")
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        offset = -(-end // align) * align
        if current and offset + nbytes > bucket_bytes:
            buckets.append(Bucket(len(buckets), end, current))
            current, offset = [], 0
        current.append(TensorMeta(name, dtype, list(shape), offset, nbytes))
        end = offset + nbytes
    if current:
        buckets.append(Bucket(len(buckets), end, current))
    return buckets


def named_tensors(source: Any) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of a ``torch.nn.Module`` or of any iterable of such pairs.

    For a module: its ``state_dict()`` (parameters and persistent buffers, detached), with
    tied weights sent once, under the first name (e.g. ``model.embed_tokens.weight`` and
    not ``lm_head.weight``; vLLM's ``load_weights`` skips the tied name).
    """
    import torch

    if isinstance(source, torch.nn.Module):
        seen: set[tuple[int, int, tuple[int, ...]]] = set()
        out: list[tuple[str, torch.Tensor]] = []
        for name, tensor in source.state_dict(keep_vars=False).items():
            key = (tensor.data_ptr(), tensor.numel(), tuple(tensor.shape))
            if tensor.numel() and key in seen:
                continue
            seen.add(key)
            out.append((name, tensor))
        return out
    return [(str(name), tensor) for name, tensor in source]


def tensor_specs(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int]]]:
    """``(name, dtype, shape)`` of each tensor: what ``plan_buckets`` takes."""
    return [(name, dtype_name(t.dtype), list(t.shape)) for name, t in tensors]


def pack(bucket: Bucket, tensors_by_name: dict[str, torch.Tensor], out_uint8: torch.Tensor) -> None:
    """Copy each of ``bucket``'s tensors to its bytes of ``out_uint8`` (any device: copied there)."""
    import torch

    if out_uint8.dtype != torch.uint8 or out_uint8.dim() != 1 or out_uint8.numel() < bucket.nbytes:
        raise ValueError(f"bucket {bucket.index} needs a 1-D uint8 buffer of at least {bucket.nbytes} bytes")
    for meta in bucket.tensors:
        tensor = tensors_by_name[meta.name]
        if dtype_name(tensor.dtype) != meta.dtype or list(tensor.shape) != meta.shape:
            raise ValueError(
                f"tensor {meta.name!r} is {dtype_name(tensor.dtype)}{list(tensor.shape)}, "
                f"but bucket {bucket.index} was planned for {meta.dtype}{meta.shape}"
            )
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        out_uint8[meta.offset : meta.offset + meta.nbytes].copy_(raw)


def unpack(bucket: Bucket, buf_uint8: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into ``buf_uint8`` (no copy): valid while the buffer is."""
    import torch

    if buf_uint8.numel() < bucket.nbytes:
        raise ValueError(f"bucket {bucket.index} needs {bucket.nbytes} bytes, the buffer has {buf_uint8.numel()}")
    return [
        (m.name, buf_uint8[m.offset : m.offset + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape))
        for m in bucket.tensors
    ]


# ---------------------------------------------------------------------------------------
# Shared memory
# ---------------------------------------------------------------------------------------


class ShmBuffers:
    """``n`` shared-memory segments of ``size`` bytes that the trainer packs buckets into.

    Two (the default) let the trainer pack bucket i+1 while a worker loads bucket i. Names
    are unique (``zr-<pid>-<random>-<i>``), never fixed. The segments stay registered with
    this process's resource tracker, so they are unlinked even if the trainer dies without
    ``close()``; workers map them with ``attach_shm``, which never registers nor unlinks.
    """

    def __init__(self, size: int, n: int = 2) -> None:
        from multiprocessing.shared_memory import SharedMemory

        import torch

        if size <= 0 or n <= 0:
            raise ValueError(f"need a positive size and count, got size={size} n={n}")
        tag = f"zr-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.size = size
        self._segments: list[Any] = []
        self._tensors: list[torch.Tensor] = []
        try:
            for i in range(n):
                seg = SharedMemory(name=f"{tag}-{i}", create=True, size=size)
                self._segments.append(seg)
                # torch keeps its buffer object alive but holds no export on it: given
                # ``seg.buf`` itself, ``seg.close()`` would unmap under a live view. A
                # memoryview of its own keeps an export, so close() refuses instead.
                buf: Any = seg.buf
                self._tensors.append(torch.frombuffer(memoryview(buf), dtype=torch.uint8, count=size))
        except BaseException:
            self.close()
            raise

    @property
    def names(self) -> list[str]:
        return [seg.name for seg in self._segments]

    def tensor(self, i: int) -> torch.Tensor:
        """Segment ``i`` as a 1-D uint8 tensor (drop your views of it before ``close()``)."""
        return self._tensors[i]

    def close(self) -> None:
        """Unlink every segment and unmap it (once no view of it is left)."""
        self._tensors.clear()
        for seg in self._segments:
            with suppress(FileNotFoundError):
                seg.unlink()
            try:
                seg.close()
            except BufferError:
                log.warning("a view of shared memory %s outlives close(); unmapped when it is freed", seg.name)
                seg._mmap = None  # the view's memoryview owns the mapping now; no retry from __del__
                seg.close()
        self._segments.clear()

    def __enter__(self) -> ShmBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def attach_shm(name: str) -> Iterator[torch.Tensor]:
    """Map the segment ``name`` read-write as a 1-D uint8 tensor; unmap it on exit.

    Never unlinks, and never registers with a resource tracker: ``SharedMemory(name)``
    does register before Python 3.13, and a tracker unlinks what it tracks when its process
    ends (or, told to unregister, forgets the trainer's own registration).

    Every view of the tensor, the name bound by ``as`` included, should be deleted by the
    end of the block; one that is not keeps the mapping alive (with a warning) until it goes,
    rather than pointing into unmapped memory.
    """
    import _posixshmem  # what SharedMemory uses on POSIX

    import torch

    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        mapping = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    tensor = torch.frombuffer(memoryview(mapping), dtype=torch.uint8)  # the memoryview pins the mapping
    try:
        yield tensor
    finally:
        del tensor
        try:
            mapping.close()
        except BufferError:
            log.warning("a view of shared memory %s outlives its attachment; unmapped when it is freed", name)


# ---------------------------------------------------------------------------------------
# Collective
# ---------------------------------------------------------------------------------------


class CollectiveGroup:
    """A stateless process group of the trainer (rank 0, hosting the TCPStore) and the workers.

    Built from a ``TCPStore`` and ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` directly, not
    ``init_process_group``: it touches no global state, so it lives beside vLLM's own groups
    in a worker, and the same code runs on gloo (CPU tensors) and NCCL (CUDA tensors; the
    caller sets the current CUDA device first). The constructor returns once every rank has
    joined, so the trainer must build its end *while* the workers build theirs.

    ``listen_socket`` (master only): a bound, listening socket the store takes over, so a
    caller can bind port 0, tell the workers the port, and then build the group with no race.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: Literal["gloo", "nccl"],
        timeout_s: float,
        group_name: str,
        is_master: bool,
        *,
        listen_socket: socket.socket | None = None,
    ) -> None:
        import torch.distributed as dist

        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        timeout = timedelta(seconds=timeout_s)
        self._pg: Any = None
        try:
            if listen_socket is not None:
                if not is_master:
                    raise ValueError("only the master takes a listen_socket")
                fd = listen_socket.detach()
                try:
                    self._store: Any = dist.TCPStore(
                        host, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=fd
                    )
                except BaseException:
                    socket.close(fd)
                    raise
            else:
                self._store = dist.TCPStore(host, port, world_size, is_master, timeout, wait_for_workers=False)
            store = dist.PrefixStore(group_name, self._store)
            if backend == "gloo":
                self._pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
            else:
                nccl = getattr(dist, "ProcessGroupNCCL", None)
                if nccl is None:
                    raise RuntimeError("this torch has no NCCL (a CPU build?); use backend 'gloo'")
                options = nccl.Options()
                options._timeout = timeout
                self._pg = nccl(store, rank, world_size, options)
        except RuntimeError as e:
            raise RuntimeError(
                f"could not form weight-sync group {group_name!r} at {host}:{port} as rank {rank}/{world_size} "
                f"({backend}) within timeout_s={timeout_s}: {e}"
            ) from e

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` (contiguous; same size on every rank) from ``src``; returns when done.

        NCCL: done means enqueued on the current CUDA stream, which later work on that stream
        is ordered after.
        """
        import torch.distributed as dist

        if self._pg is None:
            raise RuntimeError(f"weight-sync group {self.group_name!r} is closed")
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        options.timeout = timedelta(seconds=self.timeout_s)
        try:
            self._pg.broadcast([tensor], options).wait()
        except RuntimeError as e:
            raise RuntimeError(
                f"broadcast of {tensor.numel() * tensor.element_size()} bytes from rank {src} in weight-sync "
                f"group {self.group_name!r} (rank {self.rank}/{self.world_size}, {self.backend}) failed or "
                f"timed out (timeout_s={self.timeout_s}): {e}"
            ) from e

    def close(self) -> None:
        """Leave the group (idempotent); the master's store stops serving."""
        pg, self._pg = self._pg, None
        if pg is not None:
            shutdown = getattr(pg, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except RuntimeError as e:
                    log.debug("weight-sync group %s: shutdown: %s", self.group_name, e)
        self._store = None
