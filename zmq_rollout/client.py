"""The trainer-side client: ``AsyncRolloutClient`` (asyncio) and ``RolloutClient`` (blocking).

The blocking client is the asyncio one running on a private event-loop thread, so the two
never drift apart: every method of ``RolloutClient`` is a one-line bridge.

    with RolloutClient("tcp://127.0.0.1:5555") as client:
        rollouts = client.generate(["2+2="], SamplingParams(n=4, max_tokens=8))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, Union

import zmq
import zmq.asyncio

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.config import ClientConfig
from zmq_rollout.errors import (
    ClientClosedError,
    InvalidRequestError,
    RolloutError,
    RolloutTimeoutError,
    error_from_code,
)

Prompt = Union[str, Sequence[int], Sequence[dict[str, str]], Sequence[p.ChatMessage]]  # noqa: UP007 (runtime alias)
T = TypeVar("T")


@dataclass
class Rollout:
    """One sampled completion, ready for a trainer's loss."""

    job_id: str
    prompt_index: int  # position of its prompt in the call's input
    index: int  # sample index within the prompt (0..n-1)
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # the sampled tokens' processed logprobs
    finish_reason: str
    weight_version: int
    worker_id: str
    top_logprobs: list[dict[int, float]] | None = None
    weight_versions: list[int] | None = None  # per token, only if the sample spans a weight sync


@dataclass
class TokenDelta:
    """Tokens streamed for one sample of a job."""

    job_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]


def make_job(
    job_id: str,
    prompt: Prompt,
    sampling: p.SamplingParams,
    *,
    stream: bool = False,
    min_weight_version: int = 0,
    lora: str | None = None,
) -> p.JobSpec:
    """Build and validate a job from a prompt string, chat messages or token ids."""
    kwargs: dict[str, Any] = {}
    if isinstance(prompt, str):
        kwargs["prompt"] = prompt
    elif isinstance(prompt, (bytes, bytearray)):
        raise InvalidRequestError("a prompt is a str, not bytes: decode it first", job_id=job_id)
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) for t in prompt):
        kwargs["prompt_token_ids"] = list(prompt)
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, (dict, p.ChatMessage)) for m in prompt):
        try:
            kwargs["messages"] = [m if isinstance(m, p.ChatMessage) else p.ChatMessage(**m) for m in prompt]  # type: ignore[arg-type]
        except TypeError as exc:
            raise InvalidRequestError(f"a chat message has a role and a content: {exc}", job_id=job_id) from None
    else:
        raise InvalidRequestError(
            "a prompt is a string, a non-empty list of token ids, or a list of chat messages; "
            f"got {type(prompt).__name__}"
        )
    try:
        sampling.__post_init__()  # again: a Struct's fields can be reassigned after construction
        return p.JobSpec(job_id, sampling, stream=stream, min_weight_version=min_weight_version, lora=lora, **kwargs)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(str(exc), job_id=job_id) from None


def to_rollouts(result: p.Result, prompt_index: int = 0) -> list[Rollout]:
    return [
        Rollout(
            str(result.key),
            prompt_index,
            s.index,
            result.prompt_token_ids,
            s.token_ids,
            s.logprobs,
            s.finish_reason,
            result.weight_version,
            result.worker_id,
            s.top_logprobs,
            s.weight_versions,
        )
        for s in sorted(result.samples, key=lambda s: s.index)
    ]


class _Pending:
    __slots__ = ("future", "stream")

    def __init__(self, future: asyncio.Future[p.Result], stream: asyncio.Queue[Any] | None) -> None:
        self.future = future
        self.stream = stream


class AsyncRolloutClient:
    """asyncio client. Create it inside a running event loop (or call ``connect`` there)."""

    def __init__(self, address: str | None = None, config: ClientConfig | None = None, **overrides: Any) -> None:
        self.config = config or ClientConfig()
        if address is not None:
            self.config.address = address
        for key, value in overrides.items():
            setattr(self.config, key, value)
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
        self.weight_buffers: Any = None
        """The CUDA IPC buffers of ``update_weights(transport="cuda_ipc")``, kept across rounds."""
        self.shm_buffers: Any = None
        """The shared-memory segments of ``update_weights(transport="shm")``, kept across rounds."""

    async def connect(self) -> AsyncRolloutClient:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            name = self.config.name or "client"
            sock.setsockopt(zmq.IDENTITY, f"{name}-{uuid.uuid4().hex[:8]}".encode())
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
        await self._sock.send_multipart(codec.encode(command, body), copy=False)

    async def submit_jobs(self, jobs: list[p.JobSpec], *, stream: bool = False) -> list[_Pending]:
        """Send validated jobs (in batches of ``batch_size`` per message); futures per job."""
        loop = asyncio.get_running_loop()
        handles = []
        for job in jobs:
            if job.job_id in self._pending:
                raise InvalidRequestError(f"job id {job.job_id!r} is already in flight", job_id=job.job_id)
            handle = _Pending(loop.create_future(), asyncio.Queue() if stream else None)
            self._pending[job.job_id] = handle
            handles.append(handle)
        size = self.config.batch_size
        for start in range(0, len(jobs), size):
            await self._send(p.SUBMIT, jobs[start : start + size])
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
        timeout: float | None = -1.0,
        min_weight_version: int = 0,
        lora: str | None = None,
    ) -> list[Rollout]:
        """Run every prompt; returns ``n`` rollouts per prompt, prompt-major, in input order.

        Each item of ``prompts`` is one prompt: a string, a list of token ids, or a list of
        chat messages. A single string is one prompt. ``lora``: sample with that adapter
        (pushed with ``update_lora``) instead of the base model.
        """
        sampling = sampling or p.SamplingParams()
        items: list[Prompt] = [prompts] if isinstance(prompts, str) else list(prompts)  # type: ignore[arg-type]
        jobs = [make_job(self._new_id(), i, sampling, min_weight_version=min_weight_version, lora=lora) for i in items]
        handles = await self.submit_jobs(jobs)
        results = await self._wait([h.future for h in handles], jobs, timeout)
        out: list[Rollout] = []
        for i, result in enumerate(results):
            out.extend(to_rollouts(result, i))
        return out

    async def _wait(self, futures: list[asyncio.Future[T]], jobs: list[p.JobSpec], timeout: float | None) -> list[T]:
        limit = self.config.timeout if timeout == -1.0 else timeout
        try:
            return await asyncio.wait_for(asyncio.gather(*futures), limit)
        except asyncio.TimeoutError:
            left = [j.job_id for j in jobs if j.job_id in self._pending]
            await self.cancel(left)
            raise RolloutTimeoutError(
                f"{len(left)} of {len(jobs)} jobs had no result after {limit} s; they were cancelled "
                "(raise ClientConfig.timeout or pass timeout=)"
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
    ) -> AsyncIterator[TokenDelta | Rollout]:
        """Yield ``TokenDelta``s as tokens arrive, then the job's ``Rollout``s."""
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
            return await asyncio.wait_for(future, self.config.request_timeout)
        except asyncio.TimeoutError:
            raise RolloutTimeoutError(
                f"the broker at {self.config.address} did not answer STATUS within "
                f"{self.config.request_timeout} s (ClientConfig.request_timeout)"
            ) from None
        finally:
            if future in self._status_waiters:
                self._status_waiters.remove(future)

    # -- weight sync -----------------------------------------------------------------------
    async def sync_step(self, step: p.SyncStep) -> p.SyncReply:
        """One step of a weight-sync round (``zmq_rollout.trainer`` drives them)."""
        future: asyncio.Future[p.SyncReply] = asyncio.get_running_loop().create_future()
        self._sync_waiters.append(future)
        await self._send(p.SYNC, step)
        limit = step.timeout + self.config.request_timeout
        try:
            return await asyncio.wait_for(future, limit)
        except asyncio.TimeoutError:
            raise RolloutTimeoutError(
                f"the broker did not answer sync step {step.op!r} within {limit} s "
                "(the step's timeout= plus ClientConfig.request_timeout)"
            ) from None
        finally:
            if future in self._sync_waiters:
                self._sync_waiters.remove(future)

    async def update_weights(self, source: Any, **kwargs: Any) -> Any:
        """Push new policy weights into every worker; returns a ``SyncReport``.

        ``source``: an ``nn.Module`` or ``(name, tensor)`` pairs with checkpoint names.
        Keywords: ``transport`` ("shm" | "cuda_ipc" | "gloo" | "nccl"), ``pause`` ("abort" | "wait" |
        "keep"), ``version`` (default: the fleet's + 1), ``bucket_bytes``, ``timeout`` (per
        step; a worker that misses it is evicted), ``check_names``, ``master_addr``.
        """
        from zmq_rollout.trainer import update_weights

        return await update_weights(self, source, **kwargs)

    async def update_lora(self, tensors: Any, peft_config: Any, **kwargs: Any) -> Any:
        """Push a LoRA adapter into every worker's vLLM LoRA slot; returns a ``SyncReport``.

        ``tensors``: ``(name, tensor)`` pairs or a dict, PEFT names (e.g. from
        ``peft.get_peft_model_state_dict``); ``peft_config``: its ``adapter_config.json``
        as a dict (or a peft ``LoraConfig``). Keywords: ``name`` (the adapter jobs ask for
        with ``lora=``; default "default"), ``pause``, ``version``, ``timeout``. Workers
        need ``--enable-lora``.
        """
        from zmq_rollout.trainer import update_lora

        return await update_lora(self, tensors, peft_config, **kwargs)

    # -- background ------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            await self._send(p.HEARTBEAT, None)

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                msg = self._decoder.decode([f.buffer for f in frames])
            except RolloutError:
                continue  # a broker of another version; nothing to attribute it to
            self._dispatch(msg.command, msg.body)

    def _dispatch(self, command: bytes, body: Any) -> None:
        pending = self._pending
        if command == p.FINAL:
            for result in body:
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
                handle = pending.pop(item.key, None) if item.key is not None else None
                if handle is None:
                    continue
                if handle.stream is not None:
                    handle.stream.put_nowait(None)
                if not handle.future.done():
                    handle.future.set_exception(error_from_code(item.code, item.message, item.key))
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
        for buffers in (self.weight_buffers, self.shm_buffers):
            if buffers is not None:
                buffers.close()
        self.weight_buffers = self.shm_buffers = None
        if self._sock is not None:
            self._sock.close(linger=0)


class RolloutClient:
    """Blocking client: an ``AsyncRolloutClient`` on a private event-loop thread."""

    def __init__(self, address: str | None = None, config: ClientConfig | None = None, **overrides: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="zmq-rollout-client", daemon=True)
        self._thread.start()
        self._async = self._call(self._make(address, config, overrides))

    @staticmethod
    async def _make(address: str | None, config: ClientConfig | None, overrides: dict[str, Any]) -> AsyncRolloutClient:
        return await AsyncRolloutClient(address, config, **overrides).connect()

    async def _shutdown(self) -> None:
        """Close the client, then let every call still running on the loop settle."""
        await self._async.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:
            await asyncio.wait(others, timeout=5)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def config(self) -> ClientConfig:
        return self._async.config

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling: p.SamplingParams | None = None, **kwargs: Any
    ) -> list[Rollout]:
        return self._call(self._async.generate(prompts, sampling, **kwargs))

    def submit(
        self, prompt: Prompt, sampling: p.SamplingParams | None = None, **kwargs: Any
    ) -> concurrent.futures.Future[list[Rollout]]:
        """Start one prompt; the returned future resolves to its rollouts."""
        return asyncio.run_coroutine_threadsafe(self._async.submit(prompt, sampling, **kwargs), self._loop)

    def stream(
        self, prompt: Prompt, sampling: p.SamplingParams | None = None, **kwargs: Any
    ) -> Iterator[TokenDelta | Rollout]:
        agen = self._async.stream(prompt, sampling, **kwargs)
        try:
            while True:
                try:
                    yield self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(agen.aclose())

    def cancel(self, job_ids: Sequence[str]) -> None:
        self._call(self._async.cancel(job_ids))

    def status(self) -> p.StatusReply:
        return self._call(self._async.status())

    def update_weights(self, source: Any, **kwargs: Any) -> Any:
        """See ``AsyncRolloutClient.update_weights``."""
        return self._call(self._async.update_weights(source, **kwargs))

    def update_lora(self, tensors: Any, peft_config: Any, **kwargs: Any) -> Any:
        """See ``AsyncRolloutClient.update_lora``."""
        return self._call(self._async.update_lora(tensors, peft_config, **kwargs))

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
