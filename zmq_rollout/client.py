"""The trainer-side client, ``AsyncRolloutClient``: jobs, status and weight-sync steps, asyncio.

    async with AsyncRolloutClient("tcp://127.0.0.1:5555") as client:
        rollouts = await client.generate(["2+2="], SamplingParams(n=4, max_tokens=8))

``zmq_rollout.blocking.RolloutClient`` is the same client for code without an event loop. Its
socket, heartbeats and what it knows of the broker are its ``Connection`` (``connection.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import math
import os
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import msgspec

from zmq_rollout import environments
from zmq_rollout import protocol as p
from zmq_rollout.config import ClientConfig
from zmq_rollout.connection import Connection, Handlers
from zmq_rollout.curve import PeerKeys
from zmq_rollout.episodes import Trajectory, run_episodes
from zmq_rollout.errors import (
    AuthenticationError,
    ClientClosedError,
    InvalidRequestError,
    RolloutError,
    RolloutTimeoutError,
    SyncError,
    error_from_code,
)
from zmq_rollout.rollouts import Prompt, Rollout, StreamRestarted, TokenDelta, make_job, to_rollouts
from zmq_rollout.submissions import Unanswered, pack_submits, settle, submit_command
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
    __slots__ = ("future", "job", "stream", "streamed")

    def __init__(self, job: p.JobSpec, future: asyncio.Future[p.Result], stream: asyncio.Queue[Any] | None) -> None:
        self.job = job  # kept to send it again after a broker restart
        self.future = future
        self.stream = stream
        self.streamed = False
        """Deltas of this attempt went to ``stream`` (a restart must say to drop them)."""


class _StepReply(asyncio.Future[p.SyncReply]):
    """What a sync step awaits: the SYNC_REPLY of its op (and, after ``begin``, its round)."""

    def __init__(self, step: p.SyncStep) -> None:
        super().__init__()
        self.round_id, self.op = step.round_id, step.op.kind

    def answered_by(self, reply: p.SyncReply) -> bool:
        return reply.op == self.op and (self.op == "begin" or reply.round_id == self.round_id)


class AsyncRolloutClient(WeightSyncMethods):
    """asyncio client. Create it inside a running event loop (or call ``connect`` there).

    Weight sync (``update_weights``, ``update_lora``) comes from ``WeightSyncMethods``.
    ``curve``: keys for a broker that requires CurveZMQ (or set ``curve_server_key`` and
    ``curve_secret_key``, files, in the config)."""

    def __init__(
        self,
        address: str | None = None,
        config: ClientConfig | None = None,
        *,
        curve: PeerKeys | None = None,
        **overrides: Any,
    ) -> None:
        self.config = _config(address, config, overrides)
        keys = curve or PeerKeys.from_files(self.config.curve_server_key, self.config.curve_secret_key, "ClientConfig")
        self._pending: dict[str, _Pending] = {}
        self._status_waiters: list[asyncio.Future[p.StatusReply]] = []
        self._sync_waiters: list[asyncio.Future[p.SyncReply]] = []  # each a _StepReply
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}{uuid.uuid4().hex[:6]}-"
        self._unanswered = Unanswered()
        self.identity = f"{self.config.name or 'client'}-{uuid.uuid4().hex[:8]}"
        """This client's name at the broker (its ZeroMQ identity), as status lists it."""
        self.transport: WeightTransport | None = None
        handlers = Handlers(
            message=self._dispatch,
            restarted=self._broker_restarted,
            lost=self._broker_lost,
            gone=self._broker_gone,
            refused=self._refused,
        )
        self._conn = Connection(self.config, keys, self.identity, handlers)

    async def connect(self) -> AsyncRolloutClient:
        self._conn.open()
        return self

    async def __aenter__(self) -> AsyncRolloutClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- jobs ------------------------------------------------------------------------------
    def _new_id(self) -> str:
        return f"{self._prefix}{next(self._ids):x}"

    async def submit_jobs(self, jobs: list[p.JobSpec], *, stream: bool = False) -> list[_Pending]:
        """Send validated jobs (in batches of ``batch_size`` per message); futures per job."""
        loop = asyncio.get_running_loop()
        handles = []
        if self._conn.watch.gone:
            raise self._conn.unavailable()
        for job in jobs:
            if job.job_id in self._pending:
                raise InvalidRequestError(f"job id {job.job_id!r} is already in flight", job_id=job.job_id)
        command, messages = self._packed(jobs)  # may refuse one
        for job in jobs:
            handle = _Pending(job, loop.create_future(), asyncio.Queue() if stream else None)
            self._pending[job.job_id] = handle
            handles.append(handle)
        sent: list[str] = []
        try:
            for ids, encoded in messages:
                await self._conn.send(command, encoded)
                self._unanswered.sent(ids)
                sent.extend(ids)
        except BaseException:
            self._abandon(handles, sent)
            raise
        return handles

    def _abandon(self, handles: list[_Pending], sent: list[str]) -> None:
        """A call whose SUBMIT failed raises that error: its jobs are forgotten, and those
        already sent cancelled (best effort)."""
        for handle in handles:
            if self._pending.get(handle.job.job_id) is handle:
                del self._pending[handle.job.job_id]
            if not handle.future.cancel() and not handle.future.cancelled():
                handle.future.exception()  # failed meanwhile (refused, gone): the call's error says it
        if sent:
            self._conn.send_now(p.CANCEL, sent)

    async def submit(
        self,
        prompt: Prompt,
        sampling: p.SamplingParams | None = None,
        *,
        min_weight_version: int = 0,
        lora: str | None = None,
        max_staleness: int | None = None,
        on_stale: str = "abort",
    ) -> list[Rollout]:
        """Run one prompt; returns its ``n`` rollouts. Awaiting it waits for the answer."""
        return await self.generate(
            [prompt],
            sampling,
            min_weight_version=min_weight_version,
            lora=lora,
            max_staleness=max_staleness,
            on_stale=on_stale,
        )

    async def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: p.SamplingParams | None = None,
        *,
        timeout_s: float | None = None,
        min_weight_version: int = 0,
        lora: str | None = None,
        max_staleness: int | None = None,
        on_stale: str = "abort",
    ) -> list[Rollout]:
        """Run every prompt; returns ``n`` rollouts per prompt, prompt-major, in input order.

        Each item of ``prompts`` is one prompt: a string, a list of token ids, or a list of
        chat messages. A single string is one prompt. ``lora``: sample with that adapter
        (pushed with ``update_lora``) instead of the base model. ``timeout_s``: how long to
        wait for all of them (None: ``ClientConfig.timeout_s``; ``math.inf``: no limit).
        ``max_staleness``: a job that finishes with its oldest token more than this many weight
        versions behind the fleet (a sync committed while it ran) raises ``StaleRolloutError``
        (``on_stale="abort"``) or runs again from the start (``"restart"``; the broker's
        ``max_stale_restarts`` times at most). ``min_weight_version``: run only on weights at
        least that new.
        """
        sampling = sampling or p.SamplingParams()
        items: list[Prompt] = [prompts] if isinstance(prompts, str) else list(prompts)  # type: ignore[arg-type]
        jobs = [
            make_job(
                self._new_id(),
                item,
                sampling,
                min_weight_version=min_weight_version,
                lora=lora,
                max_staleness=max_staleness,
                on_stale=on_stale,
                sampling_checked=k > 0,  # checked with the first job
            )
            for k, item in enumerate(items)
        ]
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
            settle(futures)
            await self.cancel(left)
            raise RolloutTimeoutError(
                f"{len(left)} of {len(jobs)} jobs had no result after {limit} s; they were cancelled "
                "(raise ClientConfig.timeout_s or pass timeout_s=)"
            ) from None
        except BaseException:
            settle(futures)
            await self.cancel([j.job_id for j in jobs if j.job_id in self._pending])
            raise

    async def stream(
        self,
        prompt: Prompt,
        sampling: p.SamplingParams | None = None,
        *,
        min_weight_version: int = 0,
        lora: str | None = None,
        max_staleness: int | None = None,
        on_stale: str = "abort",
    ) -> AsyncIterator[TokenDelta | StreamRestarted | Rollout]:
        """Yield ``TokenDelta``s as tokens arrive, then the job's ``Rollout``s. When the job runs
        again from the start (its worker was lost, the broker restarted, or it was too stale
        with ``on_stale="restart"``), a ``StreamRestarted`` says to drop its deltas so far.
        Options as in ``generate``."""
        sampling = sampling or p.SamplingParams()
        job = make_job(
            self._new_id(),
            prompt,
            sampling,
            stream=True,
            min_weight_version=min_weight_version,
            lora=lora,
            max_staleness=max_staleness,
            on_stale=on_stale,
        )
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
                settle([handle.future])
                await self.cancel([job.job_id])

    async def cancel(self, job_ids: Sequence[str]) -> None:
        """Cancel jobs: queued ones are dropped, running ones aborted on their workers."""
        ids = [j for j in job_ids if j in self._pending]
        if ids and not self._conn.closed:
            await self._conn.send(p.CANCEL, ids)

    async def status(self) -> p.StatusReply:
        """Workers (with their capabilities), queue depths and weight versions, as the broker
        sees them; and the multi-turn environments this process can build."""
        future: asyncio.Future[p.StatusReply] = asyncio.get_running_loop().create_future()
        self._status_waiters.append(future)
        try:
            reply: p.StatusReply = await self._ask(p.STATUS, None, future, self.config.request_timeout_s)
            reply.environments = environments.available()  # what run_episodes can build here
            return reply
        except asyncio.TimeoutError:
            raise RolloutTimeoutError(
                f"the broker at {self.config.address} did not answer STATUS within "
                f"{self.config.request_timeout_s} s (ClientConfig.request_timeout_s)"
            ) from None
        finally:
            if future in self._status_waiters:
                self._status_waiters.remove(future)

    async def run_episodes(
        self, env: Any, samples: Sequence[Any], sampling: p.SamplingParams | None = None, **kwargs: Any
    ) -> list[Trajectory]:
        """Multi-turn episodes with exact token trajectories: ``zmq_rollout.episodes.run_episodes``
        (docs/multi_turn.md) with this client."""
        return await run_episodes(self, env, samples, sampling, **kwargs)

    # -- weight sync -----------------------------------------------------------------------
    async def sync_step(self, step: p.SyncStep) -> p.SyncReply:
        """One step of a weight-sync round (``zmq_rollout.weight_sync`` drives them). While the
        broker is lost it fails at once: no round lives through that (an abort still goes out,
        for a broker that comes back)."""
        if self._conn.watch.lost_since is not None:
            if isinstance(step.op, p.Abort):
                self._conn.send_now(p.SYNC, step)
            raise SyncError(f"the broker at {self.config.address} is not answering")
        future = _StepReply(step)
        self._sync_waiters.append(future)
        limit = step.timeout_s + self.config.request_timeout_s
        try:
            return await self._ask(p.SYNC, step, future, limit)
        except asyncio.TimeoutError:
            raise RolloutTimeoutError(
                f"the broker did not answer sync step {step.op.kind!r} within {limit} s "
                "(the step's timeout_s plus ClientConfig.request_timeout_s)"
            ) from None
        finally:
            if future in self._sync_waiters:
                self._sync_waiters.remove(future)

    async def _ask(self, command: bytes, body: Any, reply: asyncio.Future[T], limit: float) -> T:
        """Send a request and await its reply, both within ``limit`` s (else TimeoutError)."""

        async def ask() -> T:
            await self._conn.send(command, body)
            return await reply

        return await asyncio.wait_for(ask(), limit)

    # -- the broker restarted, lost, gone, refusing us (the connection's Handlers) ------------
    async def _broker_restarted(self) -> None:
        """A heartbeat reply from a restarted broker, or one that forgot this client: the sync
        step in flight fails (its round is gone), and unfinished jobs are sent again."""
        self._fail_steps(f"the broker at {self.config.address} restarted (or forgot this client) mid-round")
        await self._resubmit()

    def _broker_lost(self) -> None:
        """No word for the expiry: jobs wait for it (ZeroMQ reconnects by itself), a sync step
        fails now (its round died with the broker, or will be aborted)."""
        self._fail_steps(f"the broker at {self.config.address} stopped answering mid-round")

    def _fail_steps(self, why: str) -> None:
        """The sync steps in flight will get no answer: their round is gone with the broker.
        A step still waiting to go out never goes."""
        waiters, self._sync_waiters = self._sync_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(SyncError(why))
        self._conn.fail_waiting(lambda: SyncError(why), p.SYNC)

    def _sync_reply(self, reply: p.SyncReply) -> None:
        waiter = next(
            (w for w in self._sync_waiters if isinstance(w, _StepReply) and not w.done() and w.answered_by(reply)), None
        )
        if waiter is not None:
            self._sync_waiters.remove(waiter)
            waiter.set_result(reply)
        elif reply.op == "begin" and not reply.error:
            # A round opened by a begin this client gave up on (the broker was lost while it
            # travelled, and another took it): nobody drives it, and it would hold its workers
            # paused until round_idle_timeout_s. Abort it.
            log.warning("aborting sync round %d: its begin came back after the step had failed", reply.round_id)
            self._conn.send_now(p.SYNC, p.SyncStep(reply.round_id, p.Abort()))  # else it ends at round_idle_timeout_s

    def _broker_gone(self) -> None:
        """Lost for broker_timeout_s: every pending call fails (and its jobs are cancelled, in
        case the broker comes back with them)."""
        ids = self._fail_pending(self._conn.unavailable)
        if ids:
            self._conn.send_now(p.CANCEL, ids)

    def _refused(self, why: str) -> None:
        """The broker refuses our CurveZMQ handshake: every pending call fails with
        AuthenticationError, and every new one, until a handshake succeeds."""
        self._fail_pending(lambda: AuthenticationError(why))
        self._fail_waiters(lambda: AuthenticationError(why))

    def _fail_pending(self, error: Callable[[], RolloutError]) -> list[str]:
        """Fail every pending job with a fresh ``error()``; returns their ids."""
        handles, self._pending = self._pending, {}
        for jid, handle in handles.items():
            if handle.stream is not None:
                handle.stream.put_nowait(None)
            if not handle.future.done():
                exc = error()
                exc.job_id = jid
                handle.future.set_exception(exc)
        return list(handles)

    def _fail_waiters(self, error: Callable[[], RolloutError]) -> None:
        """Fail every status and sync step awaiting its reply with a fresh ``error()``."""
        waiters: list[asyncio.Future[Any]] = [*self._sync_waiters, *self._status_waiters]
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error())

    async def _resubmit(self) -> None:
        """The broker restarted (or forgot us): send every unfinished job again, same ids."""
        jobs = [msgspec.structs.replace(h.job, resubmitted=True) for h in self._pending.values()]
        if not jobs:
            return
        log.warning("broker at %s restarted; resubmitting %d unfinished jobs", self.config.address, len(jobs))
        for job in jobs:
            handle = self._pending[job.job_id]
            if handle.stream is not None:
                handle.streamed = False
                handle.stream.put_nowait(StreamRestarted(job.job_id))
        command, messages = self._packed(jobs)
        for ids, encoded in messages:
            await self._conn.send(command, encoded)
            self._unanswered.sent(ids)

    def _packed(self, jobs: list[p.JobSpec]) -> tuple[bytes, list[tuple[list[str], list[msgspec.Raw]]]]:
        """``jobs`` in the forms the broker said it reads (token bins, sealed jobs): the command
        that carries them and its messages (``pack_submits``; raises for a job too big for one)."""
        conn, config = self._conn, self.config
        sealed = conn.sealed_jobs
        messages = pack_submits(
            jobs, config.batch_size, config.max_message_bytes, token_bins=conn.token_bins, sealed=sealed
        )
        return submit_command(sealed), messages

    def _dispatch(self, command: bytes, body: Any) -> None:
        pending, unanswered = self._pending, self._unanswered
        if command == p.ACCEPTED:
            for jid in body:
                unanswered.answered(jid)
                handle = pending.get(jid)
                if handle is not None and handle.streamed:  # queued again: it starts over
                    handle.streamed = False
                    handle.stream.put_nowait(StreamRestarted(jid))  # type: ignore[union-attr]
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
                    handle.streamed = True
                    handle.stream.put_nowait(
                        TokenDelta(delta.key, delta.index, delta.token_ids, delta.logprobs, delta.text or "")
                    )
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
        elif command == p.SYNC_REPLY:
            self._sync_reply(body)
        elif command == p.STATUS_REPLY and self._status_waiters:
            waiter = self._status_waiters.pop(0)
            if not waiter.done():
                waiter.set_result(body)

    async def close(self) -> None:
        """Fail every pending call with ClientClosedError, say DISCONNECT (best effort), close
        the socket and the weight-sync transport. Returns at once, whatever the broker does."""
        if self._conn.closed:
            return
        await self._conn.close()
        closed = functools.partial(ClientClosedError, "the client was closed")
        pending = list(self._pending.values())
        self._fail_pending(closed)
        for handle in pending:
            if not handle.future.cancelled():
                handle.future.exception()  # mark retrieved: nobody may be waiting any more
        self._fail_waiters(closed)
        if self.transport is not None:
            self.transport.close()
            self.transport = None
