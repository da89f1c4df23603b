"""The worker's half of a weight-sync round: CONTROL steps in, CONTROL_ACKs out.

Steps run one at a time, in order, on their own task, so heartbeats and token streams go on
while a step waits on the engine. Each maps to the engine (pause, resume) or to the
``WeightSyncExtension`` inside vLLM's worker processes (``zr_*`` through collective_rpc).

A worker whose weights were partly overwritten by a round that then failed cannot say
which weights it holds; it exits with ``EXIT_WEIGHTS_DIRTY`` so that its supervisor
restarts it from the checkpoint, and it rejoins as a late joiner.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from zmq_rollout import protocol as p

from .engine import Engine

log = logging.getLogger(__name__)

EXIT_WEIGHTS_DIRTY = 4


def _total(results: list[Any]) -> Any:
    """Sum the per-rank results of a collective_rpc (counts), or pass a single one through."""
    if all(isinstance(r, int) for r in results):
        return sum(results)
    return results[0] if len(results) == 1 else results


class SyncParticipant:
    def __init__(
        self,
        engine: Engine,
        send_ack: Callable[[p.ControlAck], None],
        fatal: Callable[[int, str], None],
        drain: Callable[[], Awaitable[None]],
    ) -> None:
        self.engine = engine
        self._drain = drain
        self._send_ack = send_ack
        self._fatal = fatal
        self._steps: asyncio.Queue[p.Control] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.dirty = False  # weights partly overwritten and not yet committed
        self._lora_parts: dict[str, Any] = {}

    def submit(self, control: p.Control) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._loop())
        self._steps.put_nowait(control)

    async def _loop(self) -> None:
        while True:
            control = await self._steps.get()
            try:
                result = await self._run(control.op, control.args)
                ack = p.ControlAck(control.round_id, control.op, True, self.engine.weight_version, "", result)
            except Exception as exc:
                log.exception("sync step %s failed", control.op)
                ack = p.ControlAck(
                    control.round_id, control.op, False, self.engine.weight_version, f"{type(exc).__name__}: {exc}"
                )
            self._send_ack(ack)

    async def _run(self, op: str, args: dict[str, Any]) -> Any:
        engine = self.engine
        if op == "pause":
            mode = str(args.get("pause", "wait"))
            if mode == "wait":
                # Drain our own jobs first (the broker sends no new ones during a round):
                # every job in flight finishes on the old weights, whatever vLLM's own
                # "wait" counts as in flight.
                await self._drain()
            await engine.pause(mode)
            return engine.config.tensor_parallel_size  # ranks this worker brings to a collective
        if op == "check_names":
            have = engine.checkpoint_names()
            sent = set(args.get("names", []))
            return {"missing": sorted(have - sent), "unknown": sorted(sent - have)}
        if op == "begin_update":
            self.dirty = True
            return _total(await engine.rpc("zr_begin_update", bool(args.get("direct", True))))
        if op in ("load_shm", "load_ipc"):
            # A bucket; the first may begin the round and the last finish it (one step each saved).
            flags = {k: bool(args.get(k, d)) for k, d in (("begin", False), ("finish", False), ("direct", True))}
            self.dirty = self.dirty or flags["begin"]
            if op == "load_shm":
                load = engine.rpc("zr_load_shm", args["shm_name"], args["bucket"], **flags)
            else:
                load = engine.rpc("zr_load_ipc", args["handle"], args["bucket"], args.get("live"), **flags)
            if not flags["finish"]:
                return _total(await load)
            # The last bucket: reset the prefix cache meanwhile (the engine is paused), so
            # that commit only has to resume.
            results, _ = await asyncio.gather(load, engine.clear_prefix_cache())
            return _total(results)
        if op == "lora_bucket":  # an adapter's bytes, inline; kept here until load_lora
            if args.get("first"):
                self._lora_parts = {}
            return self._take_lora_bucket(args["bucket"], args["data"])
        if op == "load_lora":
            parts, self._lora_parts = self._lora_parts, {}
            return await engine.load_lora(str(args["name"]), parts, dict(args["peft_config"]))
        if op == "join_group":
            keys = ("host", "port", "world_size", "backend", "timeout_s", "group_name", "rank_offset")
            return _total(await engine.rpc("zr_join_group", rank=None, **{k: args[k] for k in keys}))
        if op == "receive_bucket":
            return _total(await engine.rpc("zr_receive_bucket", args["bucket"]))
        if op == "leave_group":
            return _total(await engine.rpc("zr_leave_group"))
        if op == "finish_update":
            return _total(await engine.rpc("zr_finish_update"))
        if op == "commit":
            engine.weight_version = int(args["version"])
            self.dirty = False
            await engine.resume()
            log.info("weights at version %d", engine.weight_version)
            return engine.weight_version
        if op == "resume":
            await self.resume_or_exit("the sync round was aborted")
            return None
        raise ValueError(f"unknown control op {op!r}")

    def _take_lora_bucket(self, bucket: Any, data: bytes) -> int:
        import msgspec
        import torch

        from zmq_rollout.weights import Bucket, unpack

        bucket = msgspec.convert(bucket, Bucket)
        if len(data) < bucket.nbytes:
            raise ValueError(f"LoRA bucket {bucket.index} carries {len(data)} bytes, needs {bucket.nbytes}")
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for name, tensor in unpack(bucket, buf):
            self._lora_parts[name] = tensor.clone()
        return len(bucket.tensors)

    async def resume_or_exit(self, why: str) -> None:
        """Leave a round without committing: resume if the weights are intact, else exit."""
        if self.dirty:
            self._fatal(EXIT_WEIGHTS_DIRTY, f"{why} after weights were partly overwritten; restart to reload them")
            return
        await self.engine.resume()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._steps = asyncio.Queue()
