"""``RolloutClient``: the blocking client, an ``AsyncRolloutClient`` on a private event-loop thread.

The two never drift apart: every method here is a one-line bridge to the asyncio client.

    with RolloutClient("tcp://127.0.0.1:5555") as client:
        rollouts = client.generate(["2+2="], SamplingParams(n=4, max_tokens=8))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from zmq_rollout import protocol as p
from zmq_rollout.client import AsyncRolloutClient
from zmq_rollout.config import ClientConfig
from zmq_rollout.rollouts import Prompt, Rollout, TokenDelta
from zmq_rollout.weight_sync import SyncReport, WeightTransport

__all__ = ["RolloutClient"]


class RolloutClient:
    """Blocking client: an ``AsyncRolloutClient`` on a private event-loop thread."""

    def __init__(self, address: str | None = None, config: ClientConfig | None = None, **overrides: Any) -> None:
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

    def update_weights(self, source: Any, **kwargs: Any) -> SyncReport:
        """See ``AsyncRolloutClient.update_weights``."""
        return self._call(self._async.update_weights(source, **kwargs))

    def update_lora(self, tensors: Any, peft_config: Any, **kwargs: Any) -> SyncReport:
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
