"""The trainer's side of a round: steps through the broker, members and evictions, the report.

``run_round`` drives ``begin`` (every worker pauses) → the transfer → ``commit``, and aborts
the round on any failure, so workers never stay paused because a trainer raised. It needs
one thing of the client: a way to send a step and await its reply (``StepSender``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from zmq_rollout import protocol as p
from zmq_rollout.errors import SyncError


class StepSender(Protocol):
    """What a round needs of the client: send one SYNC and await its SYNC_REPLY."""

    async def sync_step(self, step: p.SyncStep) -> p.SyncReply: ...


@dataclass
class SyncReport:
    """What a finished round did."""

    version: int
    """The weight version every updated worker now serves."""
    transport: str
    seconds: float
    """Wall time of the whole call."""
    bytes: int
    num_buckets: int
    workers_updated: list[str]
    workers_evicted: list[p.Evicted] = field(default_factory=list)
    step_seconds: dict[str, float] = field(default_factory=dict)
    """Wall seconds the trainer waited on each kind of step (summed over buckets)."""


class SyncRound:
    """One round's steps, with its members and the evictions collected along the way."""

    def __init__(self, sender: StepSender, timeout_s: float) -> None:
        self.sender = sender
        self.timeout_s = timeout_s
        self.round_id = 0
        self.members: list[str] = []
        self.ranks: dict[str, int] = {}  # member -> ranks it brings to a collective
        self.evicted: list[p.Evicted] = []
        self.fleet_version = 0
        self.step_seconds: dict[str, float] = {}

    @property
    def num_ranks(self) -> int:
        """The collective's world size: the trainer (rank 0) and every member's ranks, laid
        out as the broker lays them out."""
        return 1 + sum(self.ranks.get(m, 1) for m in self.members)

    async def step(self, op: p.AnySyncOp) -> p.SyncReply:
        """Run ``op`` on every member; raise ``SyncError`` if it was refused or failed on one."""
        started = time.monotonic()
        reply = await self.sender.sync_step(p.SyncStep(self.round_id, op, self.timeout_s))
        self.step_seconds[op.kind] = self.step_seconds.get(op.kind, 0.0) + time.monotonic() - started
        if reply.error:
            raise SyncError(f"sync step {op.kind!r} refused: {reply.error}")
        self.round_id = reply.round_id
        self.fleet_version = reply.fleet_version
        self.evicted.extend(reply.evicted)
        gone = {e.name for e in reply.evicted}
        if isinstance(op, p.Begin):
            self.members = [a.name for a in reply.acks if a.ok]
            self.ranks = {a.name: a.result if type(a.result) is int and a.result > 0 else 1 for a in reply.acks}
        else:
            self.members = [m for m in self.members if m not in gone]
        failed = [a for a in reply.acks if not a.ok]
        if failed and not isinstance(op, (p.Begin, p.Abort)):
            raise SyncError(f"sync step {op.kind!r} failed on {', '.join(f'{a.name}: {a.message}' for a in failed)}")
        return reply


async def run_round(
    sender: StepSender,
    pause: str,
    version: int | None,
    timeout_s: float,
    transfer: Callable[[SyncRound], Awaitable[None]],
    prepare: Callable[[], None] | None = None,
) -> tuple[SyncRound, int]:
    """begin (pause) → ``transfer`` (if any worker takes part) → commit; abort on any failure.

    ``prepare`` runs once the begin request is out, while the workers pause (packing the
    first bucket then costs the sync nothing)."""
    rnd = SyncRound(sender, timeout_s)
    begin = asyncio.ensure_future(rnd.step(p.Begin(pause)))
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
        await rnd.step(p.Commit(target))
    except BaseException:
        if rnd.round_id:
            with contextlib.suppress(Exception):  # if this fails, the broker ends the round on its own
                await rnd.step(p.Abort())
        raise
    return rnd, target
