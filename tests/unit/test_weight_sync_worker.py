"""The worker's side of a round against a recording vLLM: which calls reach the engine, in
which order, and what a step waits for.

A ``wait``-mode round makes one trip into the engine per bucket and none at ``begin`` or
``commit``: ``begin`` acks once the pause has left (the first load waits for its answer),
and the last bucket's load, the prefix-cache reset and the scheduler's resume go out
together. ``abort`` and ``keep`` rounds resume vLLM only at ``commit``, since vLLM holds
their requests. A pause that fails fails the first load before any weight moves.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from zmq_rollout import protocol as p
from zmq_rollout.workers.control import SyncParticipant
from zmq_rollout.workers.engine import Engine


class RecordingLLM:
    """The ``AsyncLLM`` calls a round makes, recorded in the order they reach the engine."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.pause_answered = asyncio.Event()  # the engine answers a pause once this is set
        self.pause_error: BaseException | None = None
        self.engine_core = SimpleNamespace(pause_scheduler_async=self.pause_scheduler_async)

    async def _pause(self, call: str) -> None:
        self.calls.append(call)
        await self.pause_answered.wait()
        if self.pause_error is not None:
            raise self.pause_error

    async def pause_scheduler_async(self, mode: str, clear_cache: bool) -> None:
        await self._pause(f"pause_scheduler:{mode}")

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        await self._pause(f"pause_generation:{mode}")

    async def collective_rpc(self, method: str, args: tuple[Any, ...]) -> list[int]:
        self.calls.append(method)
        return [1]

    async def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    async def resume_generation(self) -> None:
        self.calls.append("resume_generation")


def engine_with(llm: RecordingLLM) -> Engine:
    """An ``Engine`` whose vLLM is ``llm`` (its constructor starts a real one)."""
    engine = Engine.__new__(Engine)
    engine.config = SimpleNamespace(tensor_parallel_size=1)
    engine.llm = llm
    engine.weight_version = 0
    engine.pause_epoch = 0
    engine.pause_mode = ""
    engine._running = asyncio.Event()
    engine._running.set()
    engine._cache_cleared = False
    engine._scheduler_paused = False
    return engine


class Worker:
    """A ``SyncParticipant`` whose acks land in a queue."""

    def __init__(self, llm: RecordingLLM) -> None:
        self.engine = engine_with(llm)
        self.acks: asyncio.Queue[p.ControlAck] = asyncio.Queue()
        self.exits: list[int] = []

        async def drained() -> None:
            return None

        self.sync = SyncParticipant(
            self.engine, self.acks.put_nowait, lambda code, why: self.exits.append(code), drained
        )

    async def step(self, op: p.AnySyncOp) -> p.ControlAck:
        self.sync.submit(p.Control(1, op))
        return await asyncio.wait_for(self.acks.get(), 5)


def bucket() -> p.Bucket:
    return p.Bucket(0, 8, [p.TensorMeta("w", "float32", [2], 0, 8)])


def load(*, begin: bool, finish: bool) -> p.LoadShm:
    return p.LoadShm("zr-test", bucket(), begin=begin, finish=finish)


async def settle(rounds: int = 20) -> None:
    """Let every ready task run (no time passes: only the loop turns)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def test_a_wait_round_acks_begin_before_the_pause_answers_and_commit_calls_nothing() -> None:
    async def main() -> None:
        llm = RecordingLLM()
        worker = Worker(llm)
        ack = await worker.step(p.Begin("wait"))
        assert ack.ok and ack.result == 1 and llm.calls == ["pause_scheduler:wait"]
        assert worker.engine.paused and not llm.pause_answered.is_set()

        worker.sync.submit(p.Control(1, load(begin=True, finish=True)))
        await settle()
        assert llm.calls == ["pause_scheduler:wait"], "no weight may move before the pause is answered"
        assert worker.acks.empty()
        llm.pause_answered.set()
        ack = await asyncio.wait_for(worker.acks.get(), 5)
        assert ack.ok and ack.result == 1 and worker.sync.dirty
        assert llm.calls == ["pause_scheduler:wait", "zr_sync", "reset_prefix_cache", "resume_generation"]
        assert worker.engine.paused, "our own gate stays shut until commit"

        ack = await worker.step(p.Commit(7))
        assert ack.ok and ack.result == 7 and ack.weight_version == 7
        assert llm.calls[-1] == "resume_generation" and len(llm.calls) == 4, "commit makes no call into the engine"
        assert not worker.engine.paused and not worker.sync.dirty

    asyncio.run(main())


def test_a_failed_wait_pause_fails_the_first_load_before_any_weight_moves() -> None:
    async def main() -> None:
        llm = RecordingLLM()
        llm.pause_error = RuntimeError("engine gone")
        llm.pause_answered.set()
        worker = Worker(llm)
        assert (await worker.step(p.Begin("wait"))).ok
        ack = await worker.step(load(begin=True, finish=True))
        assert not ack.ok and "engine gone" in ack.message
        assert "zr_sync" not in llm.calls and not worker.sync.dirty
        assert (await worker.step(p.Abort())).ok
        assert worker.exits == [] and not worker.engine.paused  # clean weights: it resumes, no restart
        assert llm.calls[-1] == "resume_generation"

    asyncio.run(main())


def test_abort_and_keep_rounds_resume_vllm_only_at_commit() -> None:
    async def main() -> None:
        for mode in ("abort", "keep"):
            llm = RecordingLLM()
            llm.pause_answered.set()
            worker = Worker(llm)
            assert (await worker.step(p.Begin(mode))).ok
            assert llm.calls == [f"pause_generation:{mode}"]
            assert (await worker.step(load(begin=True, finish=False))).ok
            assert (await worker.step(load(begin=False, finish=True))).ok
            assert "resume_generation" not in llm.calls, f"{mode}: vLLM holds requests that must wait for commit"
            assert (await worker.step(p.Commit(3))).ok
            assert llm.calls[-1] == "resume_generation" and llm.calls.count("resume_generation") == 1
            assert not worker.engine.paused

    asyncio.run(main())


def test_a_wait_round_aborted_after_begin_resumes_vllm_once() -> None:
    async def main() -> None:
        llm = RecordingLLM()
        worker = Worker(llm)
        assert (await worker.step(p.Begin("wait"))).ok
        worker.sync.submit(p.Control(1, p.Abort()))
        await settle()
        assert "resume_generation" not in llm.calls  # the abort waits for the pause's answer first
        llm.pause_answered.set()
        ack = await asyncio.wait_for(worker.acks.get(), 5)
        assert ack.ok and worker.exits == [] and not worker.engine.paused
        assert llm.calls == ["pause_scheduler:wait", "reset_prefix_cache", "resume_generation"]

    asyncio.run(main())


def test_only_a_trainer_ready_event_is_waited_for_per_load() -> None:
    """A handle whose ``event_handle`` is torch's own export event (``event_sync_required``:
    waited for once, at mapping), or that has none, needs no wait per load; only ours does
    (that path needs CUDA: tests/gpu/test_cuda_ipc.py)."""
    from zmq_rollout.weight_sync.cuda_ipc import CudaIpcCache

    cache = CudaIpcCache()
    torch_export = p.CudaIpcHandle("b1", "GPU-x", 8, b"h", 8, 0, b"r", 0, b"torch-event", True)
    no_event = p.CudaIpcHandle("b2", "GPU-x", 8, b"h", 8, 0, b"r", 0, b"", False)
    assert cache.ready_event(torch_export) is None and cache.ready_event(no_event) is None
    assert len(cache) == 0, "nothing was mapped to answer that"


IPC_HANDLE = p.CudaIpcHandle("b1", "GPU-x", 64, b"h", 64, 0, b"r", 0, b"ready-event", False)


def ipc_load(layout: str, *, full: bool) -> p.LoadIpc:
    b = bucket()
    sent = b if full else p.Bucket(b.index, b.nbytes, [])
    return p.LoadIpc(IPC_HANDLE, sent, layout, ["b1"], begin=True, finish=True)


def tensors_load(layout: str, *, full: bool) -> p.LoadIpcTensors:
    sources = [p.IpcSource(msgspec.structs.replace(IPC_HANDLE, event_handle=b""), bucket())] if full else []
    return p.LoadIpcTensors("ready-1", b"ready-event", layout, sources, begin=True, finish=True)


@pytest.mark.parametrize("load", [ipc_load, tensors_load], ids=["load_ipc2", "load_ipc_tensors"])
def test_a_layout_sent_by_name_alone_is_refused_untouched_until_it_was_sent_in_full(load: Any) -> None:
    """A ``load_ipc2`` (or ``load_ipc_tensors``) naming a layout this worker was never sent
    fails at once: no call into the engine, weights not dirty (the trainer sends it again in
    full); once sent in full, the name alone reaches the engine."""

    async def main() -> None:
        llm = RecordingLLM()
        llm.pause_answered.set()
        worker = Worker(llm)
        assert (await worker.step(p.Begin("wait"))).ok
        ack = await worker.step(load("layout-a", full=False))
        assert not ack.ok and ack.message.startswith(f"UnknownLayout: {p.UNKNOWN_LAYOUT} 'layout-a'")
        assert llm.calls == ["pause_scheduler:wait"] and not worker.sync.dirty
        assert (await worker.step(load("layout-a", full=True))).ok
        assert (await worker.step(p.Commit(1))).ok
        calls = len(llm.calls)
        assert (await worker.step(p.Begin("wait"))).ok
        assert (await worker.step(load("layout-a", full=False))).ok
        assert llm.calls[calls:].count("zr_sync") == 1
        assert not (await worker.step(load("layout-b", full=False))).ok

    asyncio.run(main())


def test_the_engine_resolves_a_layout_by_name_and_keeps_a_bounded_number() -> None:
    from zmq_rollout.weight_sync.cuda_ipc import MAX_LAYOUTS, BucketLayouts, UnknownLayout

    layouts = BucketLayouts()
    with pytest.raises(UnknownLayout, match=p.UNKNOWN_LAYOUT):
        layouts.resolve(ipc_load("l0", full=False))
    assert layouts.resolve(ipc_load("l0", full=True)) == bucket()
    assert layouts.resolve(ipc_load("l0", full=False)) == bucket()
    wrong = msgspec.structs.replace(ipc_load("l0", full=False), bucket=p.Bucket(3, 8, []))
    with pytest.raises(ValueError, match="is bucket 0 of 8 bytes, not 3"):
        layouts.resolve(wrong)
    for i in range(1, MAX_LAYOUTS + 1):
        layouts.resolve(ipc_load(f"l{i}", full=True))
    assert "l0" not in layouts and f"l{MAX_LAYOUTS}" in layouts


def test_the_engine_keeps_tensor_layouts_apart_from_bucket_layouts() -> None:
    from zmq_rollout.weight_sync.cuda_ipc import BucketLayouts, UnknownLayout

    layouts = BucketLayouts()
    with pytest.raises(UnknownLayout, match=p.UNKNOWN_LAYOUT):
        layouts.sources(tensors_load("t0", full=False))
    full = tensors_load("t0", full=True)
    assert layouts.sources(full) == full.sources
    assert layouts.sources(tensors_load("t0", full=False)) == full.sources
    layouts.resolve(ipc_load("b0", full=True))
    with pytest.raises(ValueError, match="is a bucket, not the trainer's tensors"):
        layouts.sources(tensors_load("b0", full=False))
    with pytest.raises(ValueError, match="names the trainer's tensors, not a bucket"):
        layouts.resolve(ipc_load("t0", full=False))


def test_unmapping_closes_the_events_no_step_names() -> None:
    """``retain`` drops the mappings and the events whose ids the step did not name, so a
    trainer that restarts (a new ready event each time) leaves nothing open on the worker."""
    from zmq_rollout.weight_sync.cuda_ipc import CudaIpcCache

    cache = CudaIpcCache()
    cache._events.update({"ready-old": object(), "ready-new": object(), "b1": None})  # type: ignore[dict-item]
    cache._mapped.update({"b1": object(), "b2": object()})  # type: ignore[dict-item]
    cache.retain({"ready-new", "b1"})
    assert set(cache._events) == {"ready-new", "b1"} and set(cache._mapped) == {"b1"}
