"""The trainer-side client, ``AsyncRolloutClient``: one DEALER to the broker, asyncio.

    async with AsyncRolloutClient("tcp://127.0.0.1:5555") as client:
        rollouts = await client.generate(["2+2="], SamplingParams(n=4, max_tokens=8))

``zmq_rollout.blocking.RolloutClient`` is the same client for code without an event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.config import ClientConfig
from zmq_rollout.errors import (
    BrokerUnavailableError,
    ClientClosedError,
    InvalidRequestError,
    RolloutError,
    RolloutTimeoutError,
    SyncError,
    error_from_code,
)
from zmq_rollout.liveness import BrokerState, BrokerWatch
from zmq_rollout.rollouts import Prompt, Rollout, StreamRestarted, TokenDelta, make_job, to_rollouts
from zmq_rollout.submissions import Unanswered, pack_submits
from zmq_rollout.sync_methods import WeightSyncMethods
from zmq_rollout.weight_sync import WeightTransport

T = TypeVar("T")
log = logging.getLogger(__name__)

__all__ = ["AsyncRolloutClient", "Prompt", "Rollout", "TokenDelta", "make_job"]


def _config(address: str | None, config: ClientConfig | None, overrides: dict[str, Any]) -> ClientConfig:
    """A new config: ``config`` (or the defaults) with ``address`` and ``overrides``; the
    caller's object is never changed."""
    names = {f.name for f in dataclasses.fields(ClientConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"unknown ClientConfig setting(s) {unknown}; the settings are {sorted(names)}")
    if address is not None:
        overrides = {**overrides, "address": address}
    return dataclasses.replace(config or ClientConfig(), **overrides)


class _Pending:
    __slots__ = ("future", "job", "stream")

    def __init__(self, job: p.JobSpec, future: asyncio.Future[p.Result], stream: asyncio.Queue[Any] | None) -> None:
        self.job = job  # kept to send it again after a broker restart
        self.future = future
        self.stream = stream


class AsyncRolloutClient(WeightSyncMethods):
    """asyncio client. Create it inside a running event loop (or call ``connect`` there).

    Weight sync (``update_weights``, ``update_lora``) comes from ``WeightSyncMethods``."""

    def __init__(self, address: str | None = None, config: ClientConfig | None = None, **overrides: Any) -> None:
        self.config = _config(address, config, overrides)
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._pending: dict[str, _Pending] = {}
        self._status_waiters: list[asyncio.Future[p.StatusReply]] = []
        self._sync_waiters: list[asyncio.Future[p.SyncReply]] = []
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}{uuid.uuid4().hex[:6]}-"
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._decoder = codec.Decoder(codec.TO_CLIENT)
        self._unanswered = Unanswered()
        cfg = self.config
        self._watch = BrokerWatch(
            cfg.heartbeat_interval_s * cfg.broker_liveness, cfg.broker_timeout_s, time.monotonic()
        )
        self.identity = f"{self.config.name or 'client'}-{uuid.uuid4().hex[:8]}"
        """This client's name at the broker (its ZeroMQ identity), as status lists it."""
        self.transport: WeightTransport | None = None

    async def connect(self) -> AsyncRolloutClient:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, self.identity.encode())
            sock.connect(self.config.address)
            self._sock = sock
            self._tasks = [asyncio.ensure_future(self._receive()), asyncio.ensure_future(self._heartbeat())]
        return self

    async def __aenter__(self) -> AsyncRolloutClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- jobs ------------------------------------------------------------------------------
    def _new_id(self) -> str:
        return f"{self._prefix}{next(self._ids):x}"

    async def _send(self, command: bytes, body: Any) -> None:
        if self._closed:
            raise ClientClosedError("the client is closed")
        await self.connect()
        assert self._sock is not None
        try:
            await self._sock.send_multipart(codec.encode(command, body), copy=False)
        except zmq.ZMQError as exc:  # the socket or its context is gone: the client cannot go on
            raise ClientClosedError(f"the client's connection to {self.config.address} failed: {exc}") from exc

    async def submit_jobs(self, jobs: list[p.JobSpec], *, stream: bool = False) -> list[_Pending]:
        """Send validated jobs (in batches of ``batch_size`` per message); futures per job."""
        loop = asyncio.get_running_loop()
        handles = []
        if self._watch.gone:
            raise self._unavailable()
        for job in jobs:
            if job.job_id in self._pending:
                raise InvalidRequestError(f"job id {job.job_id!r} is already in flight", job_id=job.job_id)
        messages = pack_submits(jobs, self.config.batch_size, self.config.max_message_bytes)  # may refuse one
        for job in jobs:
            handle = _Pending(job, loop.create_future(), asyncio.Queue() if stream else None)
            self._pending[job.job_id] = handle
            handles.append(handle)
        for ids, encoded in messages:
            self._unanswered.sent(ids)
            await self._send(p.SUBMIT, encoded)
        return handles

    async def submit(
        self,
        prompt: Prompt,
        sampling: p.SamplingParams | None = None,
        *,
        min_weight_version: int = 0,
        lora: str | None = None,
    ) -> list[Rollout]:
        """Run one prompt; returns its ``n`` rollouts. Awaiting it waits for the answer."""
        return await self.generate([prompt], sampling, min_weight_version=min_weight_version, lora=lora)

    async def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: p.SamplingParams | None = None,
        *,
        timeout_s: float | None = None,
        min_weight_version: int = 0,
        lora: str | None = None,
    ) -> list[Rollout]:
        """Run every prompt; returns ``n`` rollouts per prompt, prompt-major, in input order.

        Each item of ``prompts`` is one prompt: a string, a list of token ids, or a list of
        chat messages. A single string is one prompt. ``lora``: sample with that adapter
        (pushed with ``update_lora``) instead of the base model. ``timeout_s``: how long to
        wait for all of them (None: ``ClientConfig.timeout_s``; ``math.inf``: no limit).
        """
        sampling = sampling or p.SamplingParams()
        items: list[Prompt] = [prompts] if isinstance(prompts, str) else list(prompts)  # type: ignore[arg-type]
        jobs = [make_job(self._new_id(), i, sampling, min_weight_version=min_weight_version, lora=lora) for i in items]
        handles = await self.submit_jobs(jobs)
        results = await self._wait([h.future for h in handles], jobs, timeout_s)
        out: list[Rollout] = []
        for i, result in enumerate(results):
            out.extend(to_rollouts(result, i))
        return out

    async def _wait(self, futures: list[asyncio.Future[T]], jobs: list[p.JobSpec], timeout_s: float | None) -> list[T]:
        limit = self.config.timeout_s if timeout_s is None else timeout_s
        try:
            return await asyncio.wait_for(asyncio.gather(*futures), None if math.isinf(limit) else limit)
        except asyncio.TimeoutError:
            left = [j.job_id for j in jobs if j.job_id in self._pending]
            await self.cancel(left)
            raise RolloutTimeoutError(
                f"{len(left)} of {len(jobs)} jobs had no result after {limit} s; they were cancelled "
                "(raise ClientConfig.timeout_s or pass timeout_s=)"
            ) from None
        except BaseException:
            await self.cancel([j.job_id for j in jobs if j.job_id in self._pending])
            raise

    async def stream(
        self,
        prompt: Prompt,
        sampling: p.SamplingParams | None = None,
        *,
        min_weight_version: int = 0,
        lora: str | None = None,
    ) -> AsyncIterator[TokenDelta | StreamRestarted | Rollout]:
        """Yield ``TokenDelta``s as tokens arrive, then the job's ``Rollout``s. After a broker
        restart the job runs again: a ``StreamRestarted`` says to drop its deltas so far."""
        sampling = sampling or p.SamplingParams()
        job = make_job(self._new_id(), prompt, sampling, stream=True, min_weight_version=min_weight_version, lora=lora)
        (handle,) = await self.submit_jobs([job], stream=True)
        assert handle.stream is not None
        try:
            while True:
                item = await handle.stream.get()
                if item is None:
                    break
                yield item
            for rollout in to_rollouts(await handle.future):
                yield rollout
        finally:
            if not handle.future.done():
                await self.cancel([job.job_id])

    async def cancel(self, job_ids: Sequence[str]) -> None:
        """Cancel jobs: queued ones are dropped, running ones aborted on their workers."""
        ids = [j for j in job_ids if j in self._pending]
        if ids and not self._closed:
            await self._send(p.CANCEL, ids)

    async def status(self) -> p.StatusReply:
        """Workers, queue depths and weight versions, as the broker sees them."""
        future: asyncio.Future[p.StatusReply] = asyncio.get_running_loop().create_future()
        self._status_waiters.append(future)
        await self._send(p.STATUS, None)
        try:
            return await asyncio.wait_for(future, self.config.request_timeout_s)
        except asyncio.TimeoutError:
            raise RolloutTimeoutError(
                f"the broker at {self.config.address} did not answer STATUS within "
                f"{self.config.request_timeout_s} s (ClientConfig.request_timeout_s)"
            ) from None
        finally:
            if future in self._status_waiters:
                self._status_waiters.remove(future)

    # -- weight sync -----------------------------------------------------------------------
    async def sync_step(self, step: p.SyncStep) -> p.SyncReply:
        """One step of a weight-sync round (``zmq_rollout.weight_sync`` drives them)."""
        future: asyncio.Future[p.SyncReply] = asyncio.get_running_loop().create_future()
        self._sync_waiters.append(future)
        await self._send(p.SYNC, step)
        limit = step.timeout_s + self.config.request_timeout_s
        try:
            return await asyncio.wait_for(future, limit)
        except asyncio.TimeoutError:
            raise RolloutTimeoutError(
                f"the broker did not answer sync step {step.op.kind!r} within {limit} s "
                "(the step's timeout_s plus ClientConfig.request_timeout_s)"
            ) from None
        finally:
            if future in self._sync_waiters:
                self._sync_waiters.remove(future)

    # -- background ------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            await self._send(p.HEARTBEAT, None)
            state = self._watch.check(time.monotonic())
            if state is BrokerState.LOST:
                self._broker_lost()
            elif state is BrokerState.GONE:
                await self._broker_gone()

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            if self._watch.heard(time.monotonic()):
                log.info("broker at %s answers again", self.config.address)
            try:
                msg = self._decoder.decode([f.buffer for f in frames])
            except RolloutError:
                continue  # a broker of another version; nothing to attribute it to
            if msg.command == p.HEARTBEAT and self._watch.liveness(msg.body):
                await self._resubmit()
            self._dispatch(msg.command, msg.body)

    # -- the broker lost, gone, back -------------------------------------------------------
    def _broker_lost(self) -> None:
        """No word for the expiry: jobs wait for it (ZeroMQ reconnects by itself), a sync step
        fails now (its round died with the broker, or will be aborted)."""
        log.warning("broker at %s silent for %.1f s; waiting for it", self.config.address, self._watch.expiry_s)
        waiters, self._sync_waiters = self._sync_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(SyncError(f"the broker at {self.config.address} stopped answering mid-round"))

    def _unavailable(self) -> BrokerUnavailableError:
        return BrokerUnavailableError(
            f"the broker at {self.config.address} has not answered for {self.config.broker_timeout_s} s "
            "(ClientConfig.broker_timeout_s)"
        )

    async def _broker_gone(self) -> None:
        """Lost for broker_timeout_s: every pending call fails (and its jobs are cancelled, in
        case the broker comes back with them)."""
        handles, self._pending = self._pending, {}
        if handles:
            with contextlib.suppress(RolloutError):
                await self._send(p.CANCEL, list(handles))
        for jid, handle in handles.items():
            if handle.stream is not None:
                handle.stream.put_nowait(None)
            if not handle.future.done():
                error = self._unavailable()
                error.job_id = jid
                handle.future.set_exception(error)

    async def _resubmit(self) -> None:
        """The broker restarted (or forgot us): send every unfinished job again, same ids."""
        jobs = [msgspec.structs.replace(h.job, resubmitted=True) for h in self._pending.values()]
        if not jobs:
            return
        log.warning("broker at %s restarted; resubmitting %d unfinished jobs", self.config.address, len(jobs))
        for job in jobs:
            stream = self._pending[job.job_id].stream
            if stream is not None:
                stream.put_nowait(StreamRestarted(job.job_id))
        for ids, encoded in pack_submits(jobs, self.config.batch_size, self.config.max_message_bytes):
            self._unanswered.sent(ids)
            await self._send(p.SUBMIT, encoded)

    def _dispatch(self, command: bytes, body: Any) -> None:
        pending, unanswered = self._pending, self._unanswered
        if command == p.ACCEPTED:
            for jid in body:
                unanswered.answered(jid)
        elif command == p.FINAL:
            for result in body:
                unanswered.answered(result.key)
                handle = pending.pop(result.key, None)
                if handle is not None:
                    if handle.stream is not None:
                        handle.stream.put_nowait(None)
                    if not handle.future.done():
                        handle.future.set_result(result)
        elif command == p.PARTIAL:
            for delta in body:
                handle = pending.get(delta.key)
                if handle is not None and handle.stream is not None:
                    handle.stream.put_nowait(TokenDelta(delta.key, delta.index, delta.token_ids, delta.logprobs))
        elif command in (p.ERROR, p.BUSY):
            for item in body:
                # An error about a whole message is about our oldest SUBMIT not answered yet
                # (the broker answers in order; this client sends nothing else it could refuse).
                keys = [item.key] if item.key is not None else unanswered.refused()
                for key in keys:
                    unanswered.answered(key)
                    handle = pending.pop(key, None)
                    if handle is None:
                        continue
                    if handle.stream is not None:
                        handle.stream.put_nowait(None)
                    if not handle.future.done():
                        handle.future.set_exception(error_from_code(item.code, item.message, key))
        elif command == p.SYNC_REPLY and self._sync_waiters:
            sync_waiter = self._sync_waiters.pop(0)
            if not sync_waiter.done():
                sync_waiter.set_result(body)
        elif command == p.STATUS_REPLY and self._status_waiters:
            waiter = self._status_waiters.pop(0)
            if not waiter.done():
                waiter.set_result(body)

    async def close(self) -> None:
        if self._closed:
            return
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                await self._sock.send_multipart(codec.encode(p.DISCONNECT, None))
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for jid, handle in list(self._pending.items()):
            if not handle.future.done():
                handle.future.set_exception(ClientClosedError("the client was closed", job_id=jid))
                handle.future.exception()  # mark retrieved: nobody may be waiting any more
        self._pending.clear()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self._sock is not None:
            self._sock.close(linger=0)
