"""The shared-memory transport: trainer and every worker on one host.

The trainer packs buckets into two POSIX shared-memory segments (``ShmBuffers``),
alternating, so it packs bucket i+1 while the workers load bucket i; each worker maps a
segment by name for one bucket (``attach_shm``), loads it, and unmaps it. The segments are
kept by the transport across rounds: a fresh segment costs page faults on every byte packed
into it (76 ms for 185 MB on the 2-core CI machine) and an unlink.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

from zmq_rollout import protocol as p

from .buckets import pack
from .transport import Shipment, WeightTransport

if TYPE_CHECKING:
    import torch

    from .round import SyncRound

__all__ = ["ShmBuffers", "ShmTransport", "attach_shm"]

log = logging.getLogger(__name__)


class ShmTransport(WeightTransport):
    """``load_shm`` steps over two segments kept across rounds (grown when a bucket outgrows them)."""

    name = "shm"

    def __init__(self) -> None:
        super().__init__()
        self.buffers: ShmBuffers | None = None

    def prepare(self, shipment: Shipment) -> None:
        size, count = shipment.largest, min(2, len(shipment.buckets))
        held = self.buffers
        if held is None or held.size < size or len(held.names) < count:
            self.close()
            held = self.buffers = ShmBuffers(size, n=count)
        pack(shipment.buckets[0], shipment.tensors, held.tensor(0))

    async def send(self, rnd: SyncRound, shipment: Shipment) -> None:
        """Bucket 0 is packed already (``prepare``)."""
        shm = self.buffers
        assert shm is not None, "prepare() first"
        num, buckets = len(shm.names), shipment.buckets
        for i, bucket in enumerate(buckets):
            load = asyncio.ensure_future(rnd.step(p.LoadShm(shm.names[i % num], bucket, **shipment.edges(i))))
            if i + 1 < len(buckets):  # pack the next bucket while the workers load this one
                pack(buckets[i + 1], shipment.tensors, shm.tensor((i + 1) % num))
            await load

    def close(self) -> None:
        if self.buffers is not None:
            self.buffers.close()
            self.buffers = None


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
