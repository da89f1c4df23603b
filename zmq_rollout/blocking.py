"""``RolloutClient``: the blocking client, an ``AsyncRolloutClient`` on a private event-loop thread.

The two never drift apart: every method here is a one-line bridge to the asyncio client.

    with RolloutClient("tcp://127.0.0.1:5555") as client:
        rollouts = client.generate(["2+2="], SamplingParams(n=4, max_tokens=8))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from zmq_rollout import protocol as p
from zmq_rollout.client import AsyncRolloutClient
from zmq_rollout.config import ClientConfig
from zmq_rollout.episodes import Trajectory
from zmq_rollout.errors import ClientClosedError
from zmq_rollout.rollouts import Prompt, Rollout, TokenDelta
from zmq_rollout.weight_sync import SyncReport, WeightTransport

__all__ = ["RolloutClient"]

log = logging.getLogger(__name__)

SETTLE_S = 5.0
"""At close, how long the calls still running on the loop get to finish (each fails with
ClientClosedError at once; one that does not is cancelled), and the loop thread to stop."""


class RolloutClient:
    """Blocking client: an ``AsyncRolloutClient`` on a private event-loop thread."""

    def __init__(self, address: str | None = None, config: ClientConfig | None = None, **overrides: Any) -> None:
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="zmq-rollout-client", daemon=True)
        self._thread.start()
        try:
            self._async = self._call(self._make(address, config, overrides))
        except BaseException:  # a bad setting: no loop thread left behind
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            raise

    @staticmethod
    async def _make(address: str | None, config: ClientConfig | None, overrides: dict[str, Any]) -> AsyncRolloutClient:
        return await AsyncRolloutClient(address, config, **overrides).connect()

    async def _shutdown(self) -> None:
        """Close the client, then let every call still running on the loop settle: a call
        left unsettled is cancelled, so that no caller waits on a loop that has stopped."""
        await self._async.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:
            _, stuck = await asyncio.wait(others, timeout=SETTLE_S)
            for task in stuck:
                task.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=SETTLE_S)

    def _call(self, coro: Any) -> Any:
        if self._closed:
            coro.close()
            raise ClientClosedError("the client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        while True:  # a call made as another thread closes the client must not wait on a dead loop
            try:
                return future.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if future.done():  # the call's own error (RolloutTimeoutError is a TimeoutError)
                    raise
                if not self._thread.is_alive():
                    future.cancel()
                    raise ClientClosedError("the client was closed") from None

    @property
    def config(self) -> ClientConfig:
        return self._async.config

    @property
    def identity(self) -> str:
        """See ``AsyncRolloutClient.identity``."""
        return self._async.identity

    @property
    def transport(self) -> WeightTransport | None:
        """See ``AsyncRolloutClient.transport``."""
        return self._async.transport

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling: p.SamplingParams | None = None, **kwargs: Any
    ) -> list[Rollout]:
        return self._call(self._async.generate(prompts, sampling, **kwargs))

    def submit(
        self, prompt: Prompt, sampling: p.SamplingParams | None = None, **kwargs: Any
    ) -> concurrent.futures.Future[list[Rollout]]:
        """Start one prompt; the returned future resolves to its rollouts."""
        if self._closed:
            future: concurrent.futures.Future[list[Rollout]] = concurrent.futures.Future()
            future.set_exception(ClientClosedError("the client is closed"))
            return future
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
            if not self._closed:
                self._call(agen.aclose())

    def cancel(self, job_ids: Sequence[str]) -> None:
        self._call(self._async.cancel(job_ids))

    def status(self) -> p.StatusReply:
        return self._call(self._async.status())

    def run_episodes(
        self, env: Any, samples: Sequence[Any], sampling: p.SamplingParams | None = None, **kwargs: Any
    ) -> list[Trajectory]:
        """See ``AsyncRolloutClient.run_episodes`` (docs/multi_turn.md)."""
        return self._call(self._async.run_episodes(env, samples, sampling, **kwargs))

    def update_weights(self, source: Any, **kwargs: Any) -> SyncReport:
        """See ``AsyncRolloutClient.update_weights``."""
        return self._call(self._async.update_weights(source, **kwargs))

    def update_lora(self, tensors: Any, peft_config: Any, **kwargs: Any) -> SyncReport:
        """See ``AsyncRolloutClient.update_lora``."""
        return self._call(self._async.update_lora(tensors, peft_config, **kwargs))

    def close(self) -> None:
        """Close the client (every pending call fails with ClientClosedError) and stop its
        loop thread. Returns within seconds whatever the broker does."""
        if self._closed:
            return
        self._closed = True
        if not self._thread.is_alive():
            return
        shutdown = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        try:
            shutdown.result(timeout=3 * SETTLE_S)
        except concurrent.futures.TimeoutError:
            if shutdown.done():
                raise
            log.warning("the client's loop did not shut down within %.0f s; stopping it", 3 * SETTLE_S)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=SETTLE_S)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
