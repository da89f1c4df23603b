"""The trainer's side of a weight sync: one round through the broker, the data over a transport.

``update_weights`` drives a round step by step (see ``zmq_rollout.broker.sync``):

    begin (pause every worker) → [check_names] → begin_update → buckets → finish_update → commit

Tensors are flattened into buckets (``zmq_rollout.weights``); names, dtypes, shapes and
offsets travel as msgpack in each step, the bytes over the transport:

- ``shm``: the trainer fills a shared-memory segment (two, alternating, so packing the next
  bucket overlaps the workers' loading of this one); every worker on this node loads it.
- ``gloo`` / ``nccl``: a process group of the trainer (rank 0) and every worker rank, built
  per round for the round's members; each bucket is broadcast from rank 0. The same code
  runs on gloo (CPU) and NCCL (GPU). If a member is evicted mid-transfer, the group is
  rebuilt without it and the transfer restarts, once per lost member.

A step that some worker does not answer in time evicts that worker; the round completes for
the others and the ``SyncReport`` names whom it lost. Nothing blocks forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zmq_rollout import protocol as p
from zmq_rollout.errors import InvalidRequestError, SyncError

if TYPE_CHECKING:
    from zmq_rollout.client import AsyncRolloutClient

DEFAULT_BUCKET_BYTES = 1 << 30
TRANSPORTS = ("shm", "gloo", "nccl")


@dataclass
class SyncReport:
    version: int
    transport: str
    seconds: float
    bytes: int
    num_buckets: int
    workers_updated: list[str]
    workers_evicted: list[p.Evicted] = field(default_factory=list)


class _Round:
    """One round's steps, with evictions collected along the way."""

    def __init__(self, client: AsyncRolloutClient, timeout: float) -> None:
        self.client = client
        self.timeout = timeout
        self.round_id = 0
        self.members: list[str] = []
        self.ranks: dict[str, int] = {}  # member -> ranks it brings to a collective
        self.evicted: list[p.Evicted] = []
        self.fleet_version = 0

    async def step(self, op: str, args: dict[str, Any] | None = None) -> p.SyncReply:
        reply = await self.client.sync_step(p.SyncStep(self.round_id, op, args or {}, self.timeout))
        if reply.error:
            raise SyncError(f"sync step {op!r} refused: {reply.error}")
        self.round_id = reply.round_id
        self.fleet_version = reply.fleet_version
        self.evicted.extend(reply.evicted)
        gone = {e.name for e in reply.evicted}
        if op == "begin":
            self.members = [a.name for a in reply.acks if a.ok]
            self.ranks = {a.name: int(a.result or 1) for a in reply.acks if a.ok}
        else:
            self.members = [m for m in self.members if m not in gone]
        failed = [a for a in reply.acks if not a.ok]
        if failed and op not in ("begin", "abort"):
            raise SyncError(f"sync step {op!r} failed on {', '.join(f'{a.name}: {a.message}' for a in failed)}")
        return reply


async def update_weights(
    client: AsyncRolloutClient,
    source: Any,
    *,
    transport: str = "shm",
    pause: str = "wait",
    version: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout: float = 60.0,
    check_names: bool = False,
    master_addr: str = "127.0.0.1",
) -> SyncReport:
    """Push ``source`` (an ``nn.Module`` or ``(name, tensor)`` pairs, checkpoint names) into
    every worker; returns when the new version is live on every worker that stayed."""
    from zmq_rollout import weights as wt

    if transport not in TRANSPORTS:
        raise InvalidRequestError(f"transport={transport!r}; expected one of {TRANSPORTS}")
    if pause not in p.PAUSE_MODES:
        raise InvalidRequestError(f"pause={pause!r}; expected one of {sorted(p.PAUSE_MODES)}")
    started = time.monotonic()
    tensors = wt.named_tensors(source)
    by_name = dict(tensors)
    buckets = wt.plan_buckets(wt.tensor_specs(tensors), bucket_bytes)
    total = sum(b.nbytes for b in buckets)
    rnd = _Round(client, timeout)
    await rnd.step("begin", {"pause": pause})
    target = rnd.fleet_version + 1 if version is None else version
    try:
        if rnd.members:
            if check_names:
                reply = await rnd.step("check_names", {"names": list(by_name)})
                _raise_on_mismatch(reply)
            await rnd.step("begin_update")
            if transport == "shm":
                await _send_shm(rnd, buckets, by_name)
            else:
                await _send_collective(rnd, buckets, by_name, transport, master_addr)
            await rnd.step("finish_update")
        await rnd.step("commit", {"version": target})
    except BaseException:
        if rnd.round_id:
            with contextlib.suppress(Exception):  # if this fails, the broker ends the round on its own
                await rnd.step("abort")
        raise
    return SyncReport(target, transport, time.monotonic() - started, total, len(buckets), rnd.members, rnd.evicted)


def _raise_on_mismatch(reply: p.SyncReply) -> None:
    for ack in reply.acks:
        result = ack.result or {}
        missing, unknown = result.get("missing", []), result.get("unknown", [])
        if missing or unknown:
            raise InvalidRequestError(
                f"tensor names do not match worker {ack.name}'s checkpoint: "
                f"missing {missing[:20]}{'...' if len(missing) > 20 else ''}, "
                f"unknown {unknown[:20]}{'...' if len(unknown) > 20 else ''}"
            )


async def _send_shm(rnd: _Round, buckets: list[Any], by_name: dict[str, Any]) -> None:
    from zmq_rollout import weights as wt

    size = max(b.nbytes for b in buckets)
    shm = wt.ShmBuffers(size, n=min(2, len(buckets)))
    num = len(shm.names)
    try:
        wt.pack(buckets[0], by_name, shm.tensor(0))
        for i, bucket in enumerate(buckets):
            load = asyncio.ensure_future(rnd.step("load_shm", {"shm_name": shm.names[i % num], "bucket": bucket}))
            if i + 1 < len(buckets):  # pack the next bucket while the workers load this one
                wt.pack(buckets[i + 1], by_name, shm.tensor((i + 1) % num))
            await load
    finally:
        shm.close()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def _send_collective(rnd: _Round, buckets: list[Any], by_name: dict[str, Any], backend: str, host: str) -> None:
    """Broadcast every bucket; rebuild the group and start over if a member is lost."""
    for _attempt in range(len(rnd.members) + 1):
        if not rnd.members:
            return
        lost_before = len(rnd.evicted)
        try:
            await _broadcast_all(rnd, buckets, by_name, backend, host)
            return
        except SyncError:
            if len(rnd.evicted) == lost_before:
                raise  # nobody was lost: the failure is real, not a membership change
            await rnd.step("begin_update")


async def _broadcast_all(rnd: _Round, buckets: list[Any], by_name: dict[str, Any], backend: str, host: str) -> None:
    import torch

    from zmq_rollout import weights as wt

    loop = asyncio.get_running_loop()
    port, name = _free_port(host), f"zr-{uuid.uuid4().hex[:8]}"
    world = 1 + sum(rnd.ranks.get(m, 1) for m in rnd.members)  # the broker lays ranks out the same way
    device = "cuda" if backend == "nccl" else "cpu"
    join = asyncio.ensure_future(
        rnd.step(
            "join_group", {"host": host, "port": port, "backend": backend, "timeout_s": rnd.timeout, "group_name": name}
        )
    )
    group = await loop.run_in_executor(
        None,
        lambda: wt.CollectiveGroup(host, port, 0, world, backend, rnd.timeout, name, True),  # type: ignore[arg-type]
    )
    try:
        await join
        buf = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8, device=device)
        for bucket in buckets:
            wt.pack(bucket, by_name, buf)
            recv = asyncio.ensure_future(rnd.step("receive_bucket", {"bucket": bucket}))
            view = buf[: bucket.nbytes]
            sent = loop.run_in_executor(None, functools.partial(group.broadcast, view, 0))
            results = await asyncio.gather(recv, sent, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise SyncError(f"bucket {bucket.index} broadcast failed: {r}") from r
        await rnd.step("leave_group")
    finally:
        group.close()
