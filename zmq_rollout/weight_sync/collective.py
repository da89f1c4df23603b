"""The collective transport (gloo on CPU, NCCL on GPU): trainer and workers on any hosts.

The trainer (rank 0, hosting the TCPStore on ``master_addr``) and every worker rank (an
engine with tensor parallelism 4 brings 4 ranks) form a ``CollectiveGroup`` for the round;
each bucket is packed into one reused trainer buffer and broadcast, and each rank loads
what it received. If a member is evicted mid-transfer, the group is rebuilt without it and
the transfer starts over, once per lost member.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from zmq_rollout import protocol as p
from zmq_rollout.errors import SyncError

from .buckets import pack
from .transport import Shipment, WeightTransport

if TYPE_CHECKING:
    import torch

    from .round import SyncRound

__all__ = ["CollectiveGroup", "CollectiveTransport"]

log = logging.getLogger(__name__)


class CollectiveTransport(WeightTransport):
    """``join_group``, ``receive_bucket`` per bucket, ``leave_group``, between ``begin_update``
    and ``finish_update``. ``backend``: gloo (CPU tensors) or nccl (CUDA tensors);
    ``master_addr``: an address of the trainer that every worker can reach."""

    def __init__(self, backend: str, *, master_addr: str = "127.0.0.1") -> None:
        if backend not in p.BACKENDS:
            raise ValueError(f"backend={backend!r}; expected one of {list(p.BACKENDS)}")
        super().__init__(master_addr=master_addr)
        self.backend = backend
        self.master_addr = master_addr

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.backend

    async def send(self, rnd: SyncRound, shipment: Shipment) -> None:
        await rnd.step(p.BeginUpdate(shipment.direct_load))
        for _attempt in range(len(rnd.members) + 1):
            if not rnd.members:
                break
            lost_before = len(rnd.evicted)
            try:
                await self._broadcast_all(rnd, shipment)
                break
            except SyncError:
                if len(rnd.evicted) == lost_before:
                    raise  # nobody was lost: the failure is real, not a membership change
                await rnd.step(p.BeginUpdate(shipment.direct_load))  # rebuild without the lost member
        await rnd.step(p.FinishUpdate())

    async def _broadcast_all(self, rnd: SyncRound, shipment: Shipment) -> None:
        import torch

        loop = asyncio.get_running_loop()
        host = self.master_addr
        # Bound and listening before the workers are told the port; the store takes it over (no race).
        sock = socket.create_server((host, 0))
        port, name = int(sock.getsockname()[1]), f"zr-{uuid.uuid4().hex[:8]}"
        join = asyncio.ensure_future(rnd.step(p.JoinGroup(host, port, self.backend, rnd.timeout_s, name)))
        make = functools.partial(
            CollectiveGroup, host, port, 0, rnd.num_ranks, self.backend, rnd.timeout_s, name, True, listen_socket=sock
        )
        group = await loop.run_in_executor(None, make)
        try:
            await join
            device = "cuda" if self.backend == "nccl" else "cpu"
            buf = torch.empty(shipment.largest, dtype=torch.uint8, device=device)
            for bucket in shipment.buckets:
                pack(bucket, shipment.tensors, buf)
                received = asyncio.ensure_future(rnd.step(p.ReceiveBucket(bucket)))
                sent = loop.run_in_executor(None, functools.partial(group.broadcast, buf[: bucket.nbytes], 0))
                for r in await asyncio.gather(received, sent, return_exceptions=True):
                    if isinstance(r, BaseException):
                        raise SyncError(f"bucket {bucket.index} broadcast failed: {r}") from r
            await rnd.step(p.LeaveGroup())
        finally:
            group.close()


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
        backend: str,
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
