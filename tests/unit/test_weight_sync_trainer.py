"""The trainer's side of weight sync without a broker: rounds, transports and errors.

``FakeFleet`` stands in for the broker and its workers (a test double: it answers each step
the way the broker's SYNC_REPLY would, from workers that always succeed unless told not to).
It shows the extension point too: a transport is one ``WeightTransport`` subclass, here
``RecordingTransport``, passed to ``update_weights`` like the built-in ones.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from zmq_rollout import protocol as p
from zmq_rollout.client import AsyncRolloutClient
from zmq_rollout.errors import InvalidRequestError, SyncError
from zmq_rollout.weight_sync import Shipment, SyncRound, WeightTransport, make_transport, update_lora, update_weights
from zmq_rollout.weight_sync.shm import ShmTransport, attach_shm


class FakeFleet:
    """Answers sync steps as a broker with ``workers`` would. ``fail``: op name -> message
    (every worker fails that step); ``evict``: op name -> worker evicted during it;
    ``names``: the checkpoint names each worker holds."""

    def __init__(self, workers: tuple[str, ...] = ("w1", "w2"), **behaviour: Any) -> None:
        self.workers = list(workers)
        self.fail: dict[str, str] = behaviour.get("fail", {})
        self.evict: dict[str, str] = behaviour.get("evict", {})
        self.names: set[str] | None = behaviour.get("names")
        self.steps: list[p.SyncStep] = []
        self.fleet_version = 3

    @property
    def ops(self) -> list[str]:
        return [s.op.kind for s in self.steps]

    async def sync_step(self, step: p.SyncStep) -> p.SyncReply:
        self.steps.append(step)
        op = step.op
        evicted = []
        if op.kind in self.evict:
            gone = self.evict.pop(op.kind)
            self.workers.remove(gone)
            evicted = [p.Evicted(gone, "evicted: no answer")]
        acks = [
            p.WorkerAck(w, op.kind not in self.fail, self._result(op), self.fail.get(op.kind, "")) for w in self.workers
        ]
        if isinstance(op, p.Commit):
            self.fleet_version = max(self.fleet_version, op.version)
        return p.SyncReply(7, op.kind, acks, evicted, self.fleet_version)

    def _result(self, op: p.SyncOp) -> p.AckResult:
        if isinstance(op, p.Begin):
            return 1
        if isinstance(op, p.CheckNames):
            have = self.names if self.names is not None else set(op.names)
            return p.NameCheck(sorted(have - set(op.names)), sorted(set(op.names) - have))
        if isinstance(op, (p.LoadShm, p.ReceiveBucket, p.LoraBucket)):
            return len(op.bucket.tensors)
        return op.version if isinstance(op, p.Commit) else None


class RecordingTransport(WeightTransport):
    """A whole transport: prepare, then one step per bucket (here ``finish_update`` stands in
    for a load step, so that the fake fleet needs nothing new)."""

    name = "recording"

    def __init__(self, raise_in_send: BaseException | None = None) -> None:
        super().__init__()
        self.raise_in_send = raise_in_send
        self.prepared: list[int] = []
        self.sent: list[list[str]] = []
        self.closed = False

    def prepare(self, shipment: Shipment) -> None:
        self.prepared.append(len(shipment.buckets))

    async def send(self, rnd: SyncRound, shipment: Shipment) -> None:
        if self.raise_in_send is not None:
            raise self.raise_in_send
        for bucket in shipment.buckets:
            self.sent.append([m.name for m in bucket.tensors])
            await rnd.step(p.FinishUpdate())

    def close(self) -> None:
        self.closed = True


def tensors(n: int = 4, size: int = 64) -> list[tuple[str, torch.Tensor]]:
    return [(f"layer.{i}.weight", torch.full((size,), float(i), dtype=torch.float32)) for i in range(n)]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_round_is_begin_transfer_commit_and_reports_what_it_did() -> None:
    fleet, transport = FakeFleet(), RecordingTransport()
    report = run(update_weights(fleet, transport, tensors(), bucket_bytes=512, pause="abort", check_names=True))
    assert fleet.ops == ["begin", "check_names", "finish_update", "finish_update", "commit"]
    assert fleet.steps[0].op == p.Begin("abort") and fleet.steps[-1].op == p.Commit(4)  # fleet 3 + 1
    assert transport.prepared == [2] and transport.sent == [["layer.0.weight", "layer.1.weight"],
                                                           ["layer.2.weight", "layer.3.weight"]]  # fmt: skip
    assert (report.version, report.transport, report.num_buckets, report.bytes) == (4, "recording", 2, 1024)
    assert report.workers_updated == ["w1", "w2"] and report.workers_evicted == []
    assert set(report.step_seconds) == {"begin", "check_names", "finish_update", "commit"}


def test_an_eviction_mid_round_is_reported_and_the_round_completes() -> None:
    fleet = FakeFleet(evict={"finish_update": "w2"})
    report = run(update_weights(fleet, RecordingTransport(), tensors(), version=9))
    assert fleet.ops[-1] == "commit" and report.version == 9
    assert report.workers_updated == ["w1"] and [e.name for e in report.workers_evicted] == ["w2"]


def test_a_name_mismatch_aborts_before_any_weight_moves() -> None:
    fleet, transport = FakeFleet(names={"layer.0.weight", "lm_head.weight"}), RecordingTransport()
    with pytest.raises(InvalidRequestError, match=r"missing \['lm_head.weight'\].*unknown \['layer.1.weight'"):
        run(update_weights(fleet, transport, tensors(2), check_names=True))
    assert fleet.ops == ["begin", "check_names", "abort"] and transport.sent == []


def test_a_step_that_fails_on_a_worker_aborts_the_round_and_names_it() -> None:
    fleet = FakeFleet(fail={"finish_update": "RuntimeError: boom"})
    with pytest.raises(SyncError, match="'finish_update' failed on w1: RuntimeError: boom"):
        run(update_weights(fleet, RecordingTransport(), tensors()))
    assert fleet.ops[-1] == "abort" and "commit" not in fleet.ops


@pytest.mark.parametrize(
    ("error", "raised", "match"),
    [
        (OSError(28, "No space left on device"), SyncError, "weight sync failed: OSError"),
        (RuntimeError("NCCL error"), SyncError, "NCCL error"),
        (ValueError("bucket too small"), InvalidRequestError, "bucket too small"),
    ],
    ids=["os", "runtime", "value"],
)
def test_lower_layer_errors_leave_as_the_error_tree_after_the_abort(
    error: BaseException, raised: type[Exception], match: str
) -> None:
    fleet = FakeFleet()
    with pytest.raises(raised, match=match) as info:
        run(update_weights(fleet, RecordingTransport(raise_in_send=error), tensors()))
    assert info.value.__cause__ is error
    assert fleet.ops == ["begin", "abort"]


def test_a_prepare_failure_aborts_the_round_it_began() -> None:
    class Broken(RecordingTransport):
        def prepare(self, shipment: Shipment) -> None:
            raise InvalidRequestError("no CUDA here")

    fleet = FakeFleet()
    with pytest.raises(InvalidRequestError, match="no CUDA here"):
        run(update_weights(fleet, Broken(), tensors()))
    assert fleet.ops == ["begin", "abort"]


@pytest.mark.parametrize(
    ("kwargs", "source", "match"),
    [
        ({"pause": "sometimes"}, tensors(), "pause='sometimes'"),
        ({"timeout_s": 0.0}, tensors(), "timeout_s"),
        ({}, [], "no tensors"),
        ({"bucket_bytes": 0}, tensors(), "bucket_bytes must be positive"),
        ({}, [("x", torch.zeros(2, dtype=torch.complex64))], "complex64"),
    ],
    ids=["pause", "timeout", "empty", "bucket-bytes", "dtype"],
)
def test_bad_arguments_fail_before_anything_is_sent(kwargs: dict[str, Any], source: Any, match: str) -> None:
    fleet = FakeFleet()
    with pytest.raises(InvalidRequestError, match=match):
        run(update_weights(fleet, RecordingTransport(), source, **kwargs))
    assert fleet.steps == []


def test_no_members_means_no_transfer_but_a_commit() -> None:
    fleet, transport = FakeFleet(workers=()), RecordingTransport()
    report = run(update_weights(fleet, transport, tensors()))
    assert fleet.ops == ["begin", "commit"] and transport.sent == [] and report.workers_updated == []


def test_shm_transport_folds_begin_and_finish_into_the_loads_and_keeps_its_segments() -> None:
    fleet, transport = FakeFleet(), ShmTransport()
    try:
        source = tensors(6)
        run(update_weights(fleet, transport, source, bucket_bytes=512, direct_load=False))
        loads = [s.op for s in fleet.steps if isinstance(s.op, p.LoadShm)]
        assert [(op.begin, op.finish, op.direct) for op in loads] == [(True, False, False), (False, False, False),
                                                                       (False, True, False)]  # fmt: skip
        assert fleet.ops == ["begin", "load_shm", "load_shm", "load_shm", "commit"]
        names = transport.buffers.names  # type: ignore[union-attr]
        assert [op.shm_name for op in loads] == [names[0], names[1], names[0]]  # alternating segments
        with attach_shm(names[0]) as seg:  # the last bucket packed into segment 0 holds layer 4 and 5
            assert torch.equal(seg[:256].view(torch.float32), source[4][1])
            del seg
        run(update_weights(fleet, transport, source, bucket_bytes=512))
        assert transport.buffers is not None and transport.buffers.names == names  # kept across rounds
        run(update_weights(fleet, transport, tensors(2, size=512), bucket_bytes=512))  # a 2 KiB bucket
        assert transport.buffers.names != names and transport.buffers.size >= 2048  # grown
    finally:
        transport.close()
    assert transport.buffers is None


def test_the_client_keeps_one_transport_and_replaces_it_when_asked_for_another() -> None:
    async def main() -> None:
        client = AsyncRolloutClient("tcp://127.0.0.1:1")  # never connects: nothing is sent here
        shm = client._transport_for("shm", None)
        assert client._transport_for("shm", None) is shm
        gloo = client._transport_for("gloo", "10.0.0.1")
        assert gloo.name == "gloo" and gloo.options == {"master_addr": "10.0.0.1"} and client.transport is gloo
        assert client._transport_for("gloo", "10.0.0.2") is not gloo
        mine = RecordingTransport()
        assert client._transport_for(mine, None) is mine and client.transport is mine
        await client.close()
        assert mine.closed and client.transport is None

    run(main())


def test_unknown_transports_and_options_are_refused() -> None:
    with pytest.raises(
        InvalidRequestError, match=r"transport='rdma'; expected one of \['cuda_ipc', 'cuda_ipc_tensors', 'gloo'"
    ):
        make_transport("rdma")
    with pytest.raises(InvalidRequestError, match=r"transport 'shm' does not take \['master_addr'\]"):
        make_transport("shm", master_addr="10.0.0.1")


def test_update_lora_sends_the_adapter_inline_then_loads_it() -> None:
    fleet = FakeFleet()
    adapter = {f"base_model.model.layers.{i}.q_proj.lora_A.weight": torch.randn(8, 16) for i in range(3)}
    report = run(update_lora(fleet, adapter, {"r": 8, "lora_alpha": 16}, name="policy", bucket_bytes=600))
    assert fleet.ops == ["begin", "lora_bucket", "lora_bucket", "lora_bucket", "load_lora", "commit"]
    buckets = [s.op for s in fleet.steps if isinstance(s.op, p.LoraBucket)]
    assert [b.first for b in buckets] == [True, False, False] and all(b.adapter == "policy" for b in buckets)
    first = buckets[0]
    sent = torch.frombuffer(bytearray(first.data), dtype=torch.float32)[: 8 * 16].view(8, 16)
    assert torch.equal(sent, next(iter(adapter.values())))
    assert fleet.steps[4].op == p.LoadLora("policy", {"r": 8, "lora_alpha": 16})
    assert report.transport == "inline" and report.num_buckets == 3


def test_update_lora_refuses_a_config_without_a_rank() -> None:
    fleet = FakeFleet()
    with pytest.raises(InvalidRequestError, match="peft_config must be a PEFT LoRA config"):
        run(update_lora(fleet, {"a": torch.zeros(2)}, {"target_modules": ["q_proj"]}))
    assert fleet.steps == []


class LayoutFleet(FakeFleet):
    """Workers that hold the ``load_ipc2`` layouts sent to them in full, and refuse a name
    they were never sent, as ``workers/control.py`` does."""

    def __init__(self, workers: tuple[str, ...] = ("w1", "w2")) -> None:
        super().__init__(workers)
        self.held: dict[str, set[str]] = {w: set() for w in workers}

    async def sync_step(self, step: p.SyncStep) -> p.SyncReply:
        op = step.op
        if not isinstance(op, p.LoadIpc):
            return await super().sync_step(step)
        self.steps.append(step)
        acks = []
        for w in self.workers:
            held = self.held.setdefault(w, set())
            if op.bucket.tensors:
                held.add(op.layout)
            ok = op.layout in held
            why = "" if ok else f"UnknownLayout: {p.UNKNOWN_LAYOUT} {op.layout!r}: never sent to this worker"
            acks.append(p.WorkerAck(w, ok, 1 if ok else None, why))
        return p.SyncReply(7, op.kind, acks, [], self.fleet_version)


def test_cuda_ipc_sends_a_layout_once_then_by_name_and_again_to_a_worker_without_it() -> None:
    from types import SimpleNamespace

    from zmq_rollout.weight_sync.cuda_ipc import CudaIpcTransport

    handle = p.CudaIpcHandle("b1", "GPU-x", 1 << 20, b"h", 1 << 20, 0, b"r", 0, b"ready-event", False)
    transport = CudaIpcTransport()
    transport.buffers = SimpleNamespace(handles=[handle], pack=lambda *a: None)  # type: ignore[assignment]
    shipment = Shipment.plan(tensors(), 1 << 20)
    fleet = LayoutFleet()

    def sent(members: list[str]) -> list[bool]:
        """One round's load steps: True for a layout sent in full."""
        rnd = SyncRound(fleet, 5.0)
        rnd.members = members
        fleet.workers = members
        before = len(fleet.steps)
        run(transport.send(rnd, shipment))
        return [bool(s.op.bucket.tensors) for s in fleet.steps[before:]]

    assert sent(["w1", "w2"]) == [True]
    assert sent(["w1", "w2"]) == [False]
    assert all(s.op.layout == fleet.steps[0].op.layout for s in fleet.steps)
    assert sent(["w1", "w2", "w3"]) == [True], "a new member gets it in full"
    fleet.held["w2"].clear()  # say, its engine restarted under the same name
    assert sent(["w1", "w2", "w3"]) == [False, True], "refused by name, sent again in full"
    assert sent(["w1", "w2", "w3"]) == [False]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error for a trainer without CUDA")
@pytest.mark.parametrize("name", ["cuda_ipc", "cuda_ipc_tensors"])
def test_the_cuda_ipc_transports_say_they_need_cuda(name: str) -> None:
    shipment = Shipment.plan([("w", torch.zeros(4))], 1 << 20)
    with pytest.raises(InvalidRequestError, match=f"transport='{name}' needs CUDA in the trainer"):
        make_transport(name).prepare(shipment)


def test_a_shared_storage_becomes_a_handle_field_by_field() -> None:
    """``share_storage`` (both CUDA IPC transports) maps torch's ``_share_cuda_`` tuple onto
    ``CudaIpcHandle``; torch's own export event is replaced by the one given (empty: none)."""
    from zmq_rollout.weight_sync.cuda_ipc import share_storage

    class Storage:
        def _share_cuda_(self) -> tuple[Any, ...]:
            return (0, b"ipc-handle", 4096, 512, b"/torch_refs", 24, b"torch-event", True)

        def nbytes(self) -> int:
            return 4096

    handle = share_storage(Storage(), "GPU-x", b"ready")
    assert (handle.device_uuid, handle.nbytes, handle.handle, handle.storage_size, handle.storage_offset) == (
        "GPU-x", 4096, b"ipc-handle", 4096, 512,
    )  # fmt: skip
    assert (handle.ref_counter_handle, handle.ref_counter_offset) == (b"/torch_refs", 24)
    assert (handle.event_handle, handle.event_sync_required) == (b"ready", False)
    assert share_storage(Storage(), "GPU-x", b"").buffer_id != handle.buffer_id
