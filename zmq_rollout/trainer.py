"""The trainer's side of a weight sync: one round through the broker, the data over a transport.

``update_weights`` drives a round step by step (see ``zmq_rollout.broker.sync``):

    begin (pause every worker) → [check_names] → begin_update → buckets → finish_update → commit

(with ``shm`` and ``cuda_ipc`` the first bucket's step begins the update and the last one
finishes it, so a one-bucket sync is three steps: begin, load, commit).

Tensors are flattened into buckets (``zmq_rollout.weights``); names, dtypes, shapes and
offsets travel as msgpack in each step, the bytes over the transport:

- ``shm``: the trainer fills a shared-memory segment (two, alternating, so packing the next
  bucket overlaps the workers' loading of this one); every worker on this node loads it.
  The segments are kept on the client (``client.shm_buffers``) across rounds.
- ``cuda_ipc``: the same two-buffer flow over GPU buffers that the trainer exports once and
  keeps on the client (``client.weight_buffers``); workers on this node map each buffer the
  first time and load straight from it. Nothing is exported, mapped or allocated per round.
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
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zmq_rollout import protocol as p
from zmq_rollout.errors import InvalidRequestError, SyncError

if TYPE_CHECKING:
    from zmq_rollout.client import AsyncRolloutClient

DEFAULT_BUCKET_BYTES = 1 << 30
TRANSPORTS = ("shm", "cuda_ipc", "gloo", "nccl")


@dataclass
class SyncReport:
    version: int
    transport: str
    seconds: float
    bytes: int
    num_buckets: int
    workers_updated: list[str]
    workers_evicted: list[p.Evicted] = field(default_factory=list)
    step_seconds: dict[str, float] = field(default_factory=dict)
    """Wall seconds the trainer waited on each kind of step (summed over buckets)."""


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
        self.step_seconds: dict[str, float] = {}

    async def step(self, op: str, args: dict[str, Any] | None = None) -> p.SyncReply:
        started = time.monotonic()
        reply = await self.client.sync_step(p.SyncStep(self.round_id, op, args or {}, self.timeout))
        self.step_seconds[op] = self.step_seconds.get(op, 0.0) + time.monotonic() - started
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
    direct_load: bool = True,
) -> SyncReport:
    """Push ``source`` (an ``nn.Module`` or ``(name, tensor)`` pairs, checkpoint names) into
    every worker; returns when the new version is live on every worker that stayed.

    ``direct_load``: workers whose model qualifies (unquantized, on CUDA) copy tensors
    straight into vLLM's parameters through a name→slice map built on the first sync;
    False always goes through vLLM's layerwise reload (``load_weights``)."""
    from zmq_rollout import weights as wt

    if transport not in TRANSPORTS:
        raise InvalidRequestError(f"transport={transport!r}; expected one of {TRANSPORTS}")
    _check_pause(pause)
    started = time.monotonic()
    tensors = wt.named_tensors(source)
    by_name = dict(tensors)
    buckets = wt.plan_buckets(wt.tensor_specs(tensors), bucket_bytes)
    if not buckets:
        raise InvalidRequestError("update_weights got no tensors to send")
    total = sum(b.nbytes for b in buckets)

    staged: list[Any] = []

    def prepare() -> None:  # runs while the workers pause: the first bucket is packed by then
        if transport == "shm":
            staged.append(_prepare_shm(client, buckets, by_name))
        elif transport == "cuda_ipc":
            staged.append(_prepare_cuda_ipc(client, buckets, by_name))

    async def transfer(rnd: _Round) -> None:
        if check_names:
            reply = await rnd.step("check_names", {"names": list(by_name)})
            _raise_on_mismatch(reply)
        if transport == "shm":  # the first bucket begins the update, the last finishes it
            await _send_shm(rnd, staged[0], buckets, by_name, direct_load)
        elif transport == "cuda_ipc":
            await _send_cuda_ipc(rnd, staged[0], buckets, by_name, direct_load)
        else:
            await rnd.step("begin_update", {"direct": direct_load})
            await _send_collective(rnd, buckets, by_name, transport, master_addr, direct_load)
            await rnd.step("finish_update")

    rnd, target = await _run_round(client, pause, version, timeout, transfer, prepare)
    seconds = time.monotonic() - started
    return SyncReport(target, transport, seconds, total, len(buckets), rnd.members, rnd.evicted, rnd.step_seconds)


async def _run_round(
    client: AsyncRolloutClient,
    pause: str,
    version: int | None,
    timeout: float,
    transfer: Callable[[_Round], Awaitable[None]],
    prepare: Callable[[], None] | None = None,
) -> tuple[_Round, int]:
    """begin (pause) → ``transfer`` (if any worker takes part) → commit; abort on any failure.

    ``prepare`` runs once the begin request is out, while the workers pause (packing the
    first bucket then costs the sync nothing)."""
    rnd = _Round(client, timeout)
    begin = asyncio.ensure_future(rnd.step("begin", {"pause": pause}))
    failed: BaseException | None = None
    if prepare is not None:
        await asyncio.sleep(0)  # let the begin request leave first
        try:
            prepare()
        except BaseException as exc:  # raised below, inside the round, so that it is aborted
            failed = exc
    await begin
    target = rnd.fleet_version + 1 if version is None else version
    try:
        if failed is not None:
            raise failed
        if rnd.members:
            await transfer(rnd)
        await rnd.step("commit", {"version": target})
    except BaseException:
        if rnd.round_id:
            with contextlib.suppress(Exception):  # if this fails, the broker ends the round on its own
                await rnd.step("abort")
        raise
    return rnd, target


LORA_BUCKET_BYTES = 8 << 20
MAX_LORA_BUCKET_BYTES = 48 << 20  # under the broker's default max_message_bytes (64 MiB)


async def update_lora(
    client: AsyncRolloutClient,
    tensors: Any,
    peft_config: Any,
    *,
    name: str = "default",
    pause: str = "wait",
    version: int | None = None,
    timeout: float = 60.0,
    bucket_bytes: int = LORA_BUCKET_BYTES,
) -> SyncReport:
    """Push a LoRA adapter into every worker's vLLM LoRA slot ``name``, replacing it in place.

    Adapters are small: the bytes travel inside the control messages (msgpack ``bin``,
    ``bucket_bytes`` per step), so this works wherever the broker reaches, with no shared
    memory or collective. Each worker writes the adapter to its private folder and has vLLM
    load it into the slot (``Engine.load_lora``); the round then commits a new version,
    which every rollout after it carries.
    """
    import msgspec
    import torch

    from zmq_rollout import weights as wt

    _check_pause(pause)
    if not isinstance(name, str) or not 0 < len(name) <= p.MAX_LORA_NAME:
        raise InvalidRequestError(f"name must be an adapter name of 1..{p.MAX_LORA_NAME} characters")
    started = time.monotonic()
    pairs = list(tensors.items()) if isinstance(tensors, Mapping) else wt.named_tensors(tensors)
    pairs = [(str(n), t.detach().to("cpu")) for n, t in pairs]
    if not pairs:
        raise InvalidRequestError("update_lora got no tensors to send")
    to_dict = getattr(peft_config, "to_dict", None)
    config = msgspec.to_builtins(to_dict() if to_dict is not None else peft_config, enc_hook=str)
    if not isinstance(config, dict) or "r" not in config:
        raise InvalidRequestError("peft_config must be a PEFT LoRA config (a dict with 'r', 'lora_alpha', ...)")
    buckets = wt.plan_buckets(wt.tensor_specs(pairs), bucket_bytes)
    too_big = [b for b in buckets if b.nbytes > MAX_LORA_BUCKET_BYTES]
    if too_big:
        raise InvalidRequestError(f"a LoRA tensor of {too_big[0].nbytes} bytes exceeds {MAX_LORA_BUCKET_BYTES}")
    by_name = dict(pairs)

    async def transfer(rnd: _Round) -> None:
        for i, bucket in enumerate(buckets):
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
            wt.pack(bucket, by_name, buf)
            args = {"name": name, "bucket": bucket, "data": buf.numpy().tobytes(), "first": i == 0}
            await rnd.step("lora_bucket", args)
        await rnd.step("load_lora", {"name": name, "peft_config": config})

    rnd, target = await _run_round(client, pause, version, timeout, transfer)
    seconds = time.monotonic() - started
    total = sum(b.nbytes for b in buckets)
    return SyncReport(target, "inline", seconds, total, len(buckets), rnd.members, rnd.evicted, rnd.step_seconds)


def _check_pause(pause: str) -> None:
    if pause not in p.PAUSE_MODES:
        raise InvalidRequestError(f"pause={pause!r}; expected one of {sorted(p.PAUSE_MODES)}")


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


def _edges(i: int, count: int, direct: bool) -> dict[str, bool]:
    return {"begin": i == 0, "finish": i == count - 1, "direct": direct}


def _prepare_shm(client: AsyncRolloutClient, buckets: list[Any], by_name: dict[str, Any]) -> Any:
    """The client's segments (made or grown as needed), with the first bucket packed."""
    from zmq_rollout import weights as wt

    size, count = max(b.nbytes for b in buckets), min(2, len(buckets))
    shm = client.shm_buffers
    if shm is None or shm.size < size or len(shm.names) < count:
        if shm is not None:
            shm.close()
        # Kept on the client across rounds: a fresh segment costs page faults on every
        # byte packed into it (76 ms for 185 MB on the 2-core CI machine) and an unlink.
        client.shm_buffers = None
        shm = client.shm_buffers = wt.ShmBuffers(size, n=count)
    wt.pack(buckets[0], by_name, shm.tensor(0))
    return shm


async def _send_shm(rnd: _Round, shm: Any, buckets: list[Any], by_name: dict[str, Any], direct: bool) -> None:
    """Bucket 0 is packed already (``_prepare_shm``)."""
    from zmq_rollout import weights as wt

    num = len(shm.names)
    for i, bucket in enumerate(buckets):
        args = {"shm_name": shm.names[i % num], "bucket": bucket, **_edges(i, len(buckets), direct)}
        load = asyncio.ensure_future(rnd.step("load_shm", args))
        if i + 1 < len(buckets):  # pack the next bucket while the workers load this one
            wt.pack(buckets[i + 1], by_name, shm.tensor((i + 1) % num))
        await load


def _ipc_buffers(client: AsyncRolloutClient, size: int, device: Any) -> Any:
    """The client's exported GPU buffers, reallocated only when a bucket outgrows them."""
    from zmq_rollout.cuda_ipc import CudaIpcBuffers

    held = client.weight_buffers
    if held is not None and held.size >= size and held.device == device:
        return held
    if held is not None:
        held.close()  # workers unmap it when the next load names only the new buffers
        client.weight_buffers = None
    client.weight_buffers = CudaIpcBuffers(size, n=2, device=device)
    return client.weight_buffers


def _prepare_cuda_ipc(client: AsyncRolloutClient, buckets: list[Any], by_name: dict[str, Any]) -> Any:
    """The client's exported GPU buffers (made or grown as needed), with bucket 0 packed."""
    import torch

    if not torch.cuda.is_available():
        raise InvalidRequestError("transport='cuda_ipc' needs CUDA in the trainer; use 'shm' on CPU")
    on_gpu = next((t.device for t in by_name.values() if t.is_cuda), None)
    device = on_gpu if on_gpu is not None else torch.device("cuda", torch.cuda.current_device())
    ipc = _ipc_buffers(client, max(b.nbytes for b in buckets), device)
    ipc.pack(0, buckets[0], by_name)
    return ipc


async def _send_cuda_ipc(rnd: _Round, ipc: Any, buckets: list[Any], by_name: dict[str, Any], direct: bool) -> None:
    """Bucket 0 is packed already (``_prepare_cuda_ipc``; maybe still on the GPU's stream)."""
    import torch

    live = [h.buffer_id for h in ipc.handles]
    stream = torch.cuda.current_stream(ipc.device)
    for i, bucket in enumerate(buckets):
        stream.synchronize()  # bucket i is in its buffer before any worker reads it
        args = {"handle": ipc.handles[i % 2], "bucket": bucket, "live": live, **_edges(i, len(buckets), direct)}
        load = asyncio.ensure_future(rnd.step("load_ipc", args))
        if i + 1 < len(buckets):  # pack the next bucket while the workers load this one
            ipc.pack((i + 1) % 2, buckets[i + 1], by_name)
        await load


async def _send_collective(
    rnd: _Round, buckets: list[Any], by_name: dict[str, Any], backend: str, host: str, direct: bool
) -> None:
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
            await rnd.step("begin_update", {"direct": direct})


async def _broadcast_all(rnd: _Round, buckets: list[Any], by_name: dict[str, Any], backend: str, host: str) -> None:
    import torch

    from zmq_rollout import weights as wt

    loop = asyncio.get_running_loop()
    # Bound and listening before the workers are told the port; the store takes it over (no race).
    sock = socket.create_server((host, 0))
    port, name = int(sock.getsockname()[1]), f"zr-{uuid.uuid4().hex[:8]}"
    world = 1 + sum(rnd.ranks.get(m, 1) for m in rnd.members)  # the broker lays ranks out the same way
    device = "cuda" if backend == "nccl" else "cpu"
    join = asyncio.ensure_future(
        rnd.step(
            "join_group", {"host": host, "port": port, "backend": backend, "timeout_s": rnd.timeout, "group_name": name}
        )
    )
    group = await loop.run_in_executor(
        None,
        lambda: wt.CollectiveGroup(
            host,
            port,
            0,
            world,
            backend,  # type: ignore[arg-type]
            rnd.timeout,
            name,
            True,
            listen_socket=sock,
        ),
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
