"""Worker pieces that need neither vLLM nor an engine: the GPU plan, logprob extraction, the
sync dispatch tables."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zmq_rollout import protocol as p
from zmq_rollout.workers import main as worker_main
from zmq_rollout.workers.control import SyncParticipant, total
from zmq_rollout.workers.receiver import Receiver
from zmq_rollout.workers.sampling import sampled_logprobs


@pytest.mark.parametrize(
    ("gpus", "tp", "plan"),
    [("", 1, [""]), ("0", 1, ["0"]), ("0,1", 1, ["0", "1"]), ("0,1", 2, ["0,1"]), ("0,1,2,3", 2, ["0,1", "2,3"])],
)
def test_plan_engines(gpus: str, tp: int, plan: list[str]) -> None:
    assert worker_main.plan_engines(gpus, tp) == plan


@pytest.mark.parametrize(
    ("gpus", "tp", "match"), [("0,1,2", 2, "cannot be split"), ("0,0", 1, "twice"), ("0", 0, "split")]
)
def test_plan_engines_rejects(gpus: str, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        worker_main.plan_engines(gpus, tp)


def _pos(entries: dict[int, tuple[float, int]]) -> dict[int, SimpleNamespace]:
    return {t: SimpleNamespace(logprob=lp, rank=rank) for t, (lp, rank) in entries.items()}


def test_sampled_logprobs_picks_the_sampled_token_and_top_k() -> None:
    logprobs = [_pos({5: (-0.5, 2), 1: (-0.1, 1)}), _pos({7: (-2.0, 1)})]
    chosen, tops = sampled_logprobs([5, 7], logprobs, top=1)
    assert chosen == [-0.5, -2.0]
    assert tops == [{1: -0.1}, {7: -2.0}]
    assert sampled_logprobs([5], None, 0) == ([], None)
    assert sampled_logprobs([5], logprobs[:1], 0) == ([-0.5], None)


def _participant() -> SyncParticipant:
    async def nothing() -> None:
        return None

    return SyncParticipant(SimpleNamespace(), lambda ack: None, lambda code, why: None, nothing)  # type: ignore[arg-type]


def test_every_sync_step_has_a_handler_on_the_worker() -> None:
    """The worker handles each step; those it forwards into the engine, the engine handles."""
    participant = _participant()
    assert set(participant.handlers) == set(p.SYNC_OPS)
    forwarded = {op for op, h in participant.handlers.items() if h in (participant.in_engine, participant.load)}
    receiver = Receiver(model_runner=None, device="cpu")
    assert set(receiver.handlers) == forwarded
    data_steps = {
        p.BeginUpdate,
        p.LoadShm,
        p.LoadIpc,
        p.LoadIpcTensors,
        p.JoinGroup,
        p.ReceiveBucket,
        p.LeaveGroup,
        p.FinishUpdate,
    }
    assert forwarded == data_steps


def test_a_step_the_engine_does_not_handle_is_refused_there() -> None:
    with pytest.raises(ValueError, match="'commit' is not a step for the engine"):
        Receiver(model_runner=None, device="cpu").run(p.Control(1, p.Commit(2)))


def test_per_rank_results_add_up() -> None:
    assert total([3, 4]) == 7
    assert total([None, None]) is None
    with pytest.raises(ValueError, match="answered"):
        total([3, None])


def test_a_control_the_worker_cannot_decode_is_refused_not_ignored() -> None:
    import msgpack

    from zmq_rollout.workers.control import refusal

    header = msgpack.packb([9, ["load_rdma", "qp-7"], 1, 2])
    ack = refusal(header, "unknown step load_rdma", 4)
    assert ack == p.ControlAck(9, "load_rdma", False, 4, "ProtocolError: unknown step load_rdma")
    assert refusal(b"\xc1", "garbage", 4) is None  # not even the round can be read
    assert refusal(msgpack.packb(["x"]), "no round", 4) is None


class _EngineGenerateError(Exception):
    """Stands in for vLLM's EngineGenerateError: no message, the cause chained."""


def _raised(cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as exc:
            raise _EngineGenerateError() from exc
    except _EngineGenerateError as outer:
        return outer


def test_a_failed_job_names_its_cause_and_a_refused_request_is_invalid() -> None:
    from zmq_rollout.workers.generation import failure

    structured = p.JobSpec("j", p.SamplingParams(structured=p.StructuredOutput(regex="a+")), prompt="x")
    plain = p.JobSpec("j", p.SamplingParams(), prompt="x")
    missing = _raised(ModuleNotFoundError("No module named 'lmformatenforcer'"))
    code, message = failure(missing, structured)
    assert code == "invalid_request" and "structured outputs are not available on this worker" in message
    assert "_EngineGenerateError <- ModuleNotFoundError: No module named 'lmformatenforcer'" in message
    assert failure(_raised(ValueError("logit_bias token 9999 out of range")), plain) == (
        "invalid_request",
        "_EngineGenerateError <- ValueError: logit_bias token 9999 out of range",
    )
    assert failure(RuntimeError("CUDA error"), plain) == ("job_failed", "RuntimeError: CUDA error")
    assert failure(missing, plain)[0] == "job_failed"  # an import error without structured outputs is ours


def test_the_worker_freezes_its_start_up_heap_after_the_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """What start-up made is frozen (as vLLM's own server does) once the warm-up is done and
    before the worker serves, so full collections during a batch do not walk it; from then on
    young objects are collected every ``GC_YOUNG_THRESHOLD``, so full collections come seldom."""
    import asyncio
    import gc

    from zmq_rollout.workers import engine, generation, worker

    seen: list[str] = []

    class FakeEngine:
        max_model_len, max_num_seqs = 8, 1

        def __init__(self, config: object) -> None:
            seen.append("engine")

        def shutdown(self) -> None:
            seen.append("shutdown")

    async def warm_up(e: object) -> None:
        seen.append(f"warm_up frozen={gc.get_freeze_count()} young={gc.get_threshold()[0]}")

    class FakeWorker:
        def __init__(self, config: object, e: object) -> None:
            pass

        def stop(self) -> None:
            pass

        async def run(self) -> int:
            seen.append(f"run frozen={gc.get_freeze_count() > 0} thresholds={gc.get_threshold()}")
            return 0

    monkeypatch.setattr(engine, "Engine", FakeEngine)
    monkeypatch.setattr(generation, "warm_up", warm_up)
    monkeypatch.setattr(worker, "Worker", FakeWorker)
    before = gc.get_threshold()
    gc.unfreeze()
    try:
        config = SimpleNamespace(model="m")
        assert asyncio.run(worker_main._serve(config)) == 0  # type: ignore[arg-type]
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    serving = (worker_main.GC_YOUNG_THRESHOLD, before[1], before[2])
    warm = f"warm_up frozen=0 young={before[0]}"  # the warm-up's objects are collected as usual
    assert seen == ["engine", warm, f"run frozen=True thresholds={serving}", "shutdown"]


def test_a_load_over_another_transport_unmaps_the_trainers_cuda_ipc_memory() -> None:
    """A trainer that switched from cuda_ipc(_tensors) to shm must not stay pinned: the
    worker's first shm load unmaps every CUDA IPC buffer and storage, closes their events and
    drops the direct loader's plans that read them, then loads the bucket as usual."""
    import uuid
    from multiprocessing import shared_memory

    import torch

    from zmq_rollout.workers.bucket_loader import BucketLoader

    class Recording(BucketLoader):
        def __init__(self) -> None:
            self.loaded: list[list[float]] = []

        def load(self, bucket: p.Bucket, buffer: torch.Tensor, buffer_key: str | None = None, layout: str = "") -> None:
            self.loaded.append(buffer[: bucket.nbytes].view(torch.float32).tolist())

    forgotten: list[set[str]] = []
    receiver = Receiver(model_runner=None, device="cpu")
    receiver.loader = loader = Recording()
    receiver.direct = SimpleNamespace(forget=forgotten.append)  # type: ignore[assignment]
    receiver.ipc._mapped.update({"trainer-storage-1": object(), "trainer-storage-2": object()})  # type: ignore[dict-item]
    receiver.ipc._events["ready-1"] = object()  # type: ignore[assignment]
    segment = shared_memory.SharedMemory(create=True, size=64, name=f"zr-test-{uuid.uuid4().hex[:12]}")
    try:
        segment.buf[:8] = torch.tensor([1.5, -2.0], dtype=torch.float32).numpy().tobytes()
        bucket = p.Bucket(0, 8, [p.TensorMeta("w", "float32", [2], 0, 8)])
        assert receiver.run(p.Control(1, p.LoadShm(segment.name, bucket))) == 1
    finally:
        segment.close()
        segment.unlink()
    assert loader.loaded == [[1.5, -2.0]]
    assert len(receiver.ipc) == 0 and not receiver.ipc._events and forgotten == [set()]


def test_vllm_keeps_statistics_only_for_a_metrics_endpoint_that_serves_them() -> None:
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from zmq_rollout.config import WorkerConfig
    from zmq_rollout.workers.engine import stat_loggers_for

    assert stat_loggers_for(WorkerConfig(model="m")) == []  # no /metrics
    assert stat_loggers_for(WorkerConfig(model="m", metrics_port=9200)) == [PrometheusStatLogger]
    assert stat_loggers_for(WorkerConfig(model="m", metrics_port=9200, vllm_metrics=False)) == []


def test_a_worker_announces_its_engines_sequences_plus_its_extra_credits() -> None:
    """READY's credits: ``max_num_seqs``, and ``extra_credits`` more for jobs that wait in the
    engine's own queue; a bad setting is refused by name."""
    from zmq_rollout.config import WorkerConfig
    from zmq_rollout.workers.worker import Worker

    engine = SimpleNamespace(max_num_seqs=256, max_model_len=1024, weight_version=3, vllm_metrics=False)
    assert Worker(WorkerConfig(model="m", name="w"), engine).ready_info().credits == 256  # type: ignore[arg-type]
    info = Worker(WorkerConfig(model="m", name="w", extra_credits=64), engine).ready_info()  # type: ignore[arg-type]
    assert (info.credits, info.weight_version, info.max_model_len) == (320, 3, 1024)
    for bad in (-1, 1.5, 1 << 17):
        with pytest.raises(ValueError, match=r"WorkerConfig\.extra_credits must be an int in 0\.\.65536"):
            WorkerConfig(model="m", extra_credits=bad)  # type: ignore[arg-type]
