"""Weight-sync steps on the wire: one typed Struct per step, tagged by name, checked on decode."""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
import pytest

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.errors import ProtocolError

BUCKET = p.Bucket(0, 264, [p.TensorMeta("a", "bfloat16", [2, 2], 0, 8), p.TensorMeta("b", "float32", [2], 256, 8)])
HANDLE = p.CudaIpcHandle("buf-1", "GPU-1234", 1024, b"\x01" * 64, 1024, 0, b"\x02" * 64, 0, b"\x03" * 64, False)

#: One instance of every step, with every field set to something other than its default.
EXAMPLES: dict[type[p.SyncOp], p.SyncOp] = {
    p.Begin: p.Begin("abort"),
    p.CheckNames: p.CheckNames(["a", "b"]),
    p.BeginUpdate: p.BeginUpdate(direct=False),
    p.LoadShm: p.LoadShm("zr-1-0", BUCKET, begin=True, finish=True, direct=False),
    p.LoadIpc: p.LoadIpc(HANDLE, BUCKET, "layout-1", ["buf-1", "buf-2"], begin=True, finish=False, direct=True),
    p.LoadIpcTensors: p.LoadIpcTensors(
        "ready-1", b"\x04" * 64, "layout-2", [p.IpcSource(HANDLE, BUCKET)], ["buf-9"], True, True, False
    ),
    p.JoinGroup: p.JoinGroup("10.0.0.1", 29500, "nccl", 30.0, "zr-group"),
    p.ReceiveBucket: p.ReceiveBucket(BUCKET),
    p.LeaveGroup: p.LeaveGroup(),
    p.FinishUpdate: p.FinishUpdate(),
    p.LoraBucket: p.LoraBucket("policy", BUCKET, b"\x00" * 264, first=True),
    p.LoadLora: p.LoadLora("policy", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}),
    p.Commit: p.Commit(7),
    p.Abort: p.Abort(),
}


def test_every_step_has_an_example_and_a_unique_name() -> None:
    assert set(EXAMPLES) == set(p.SYNC_OPS)
    names = [op.__struct_config__.tag for op in p.SYNC_OPS]
    assert len(set(names)) == len(names)
    assert all(isinstance(n, str) and n == n.lower() for n in names)


@pytest.mark.parametrize("op", list(EXAMPLES.values()), ids=lambda op: op.kind)
def test_every_step_round_trips_in_sync_and_control(op: p.SyncOp) -> None:
    step = codec.Decoder(codec.FROM_CLIENT).decode(codec.encode(p.SYNC, p.SyncStep(3, op, 12.5))).body
    assert step == p.SyncStep(3, op, 12.5) and type(step.op) is type(op)
    control = codec.Decoder(codec.TO_WORKER).decode(codec.encode(p.CONTROL, p.Control(3, op, 2, 5))).body
    assert control == p.Control(3, op, 2, 5)


def test_a_step_is_a_plain_msgpack_array_tagged_by_its_name() -> None:
    raw = msgpack.unpackb(codec.encode_body(p.SyncStep(0, p.Begin("abort"))))
    assert raw == [0, ["begin", "abort"], 60.0]
    raw = msgpack.unpackb(codec.encode_body(p.Control(7, p.Commit(4), 1, 3)))
    assert raw == [7, ["commit", 4], 1, 3]
    # Written by hand in another language, with the defaults left out:
    step = codec.Decoder(codec.FROM_CLIENT).decode([p.SIGNATURE, p.SYNC, msgpack.packb([5, ["abort"]])]).body
    assert step == p.SyncStep(5, p.Abort(), 60.0)


@pytest.mark.parametrize(
    ("raw_op", "message"),
    [
        pytest.param(["begin", "pause-forever"], "pause='pause-forever'", id="pause-mode"),
        pytest.param(["fetch_weights"], "fetch_weights", id="unknown-step"),
        pytest.param(["commit"], "at least length 2", id="missing-field"),
        pytest.param(["commit", -1], "version=-1", id="negative-version"),
        pytest.param(["join_group", "h", 99999, "gloo", 1.0, "g"], "port=99999", id="port"),
        pytest.param(["join_group", "h", 1234, "mpi", 1.0, "g"], "backend='mpi'", id="backend"),
        pytest.param(["receive_bucket", [0, 8, [["x", "complex64", [1], 0, 8]]]], "complex64", id="dtype"),
        pytest.param(["receive_bucket", [0, 8, [["x", "float32", [3], 0, 8]]]], "do not fit", id="nbytes"),
        pytest.param(["receive_bucket", [0, 8, [["x", "float32", [2], 4, 8]]]], "ends past", id="overflow"),
        pytest.param(["lora_bucket", "ad", [0, 8, [["x", "int8", [8], 0, 8]]], b"1234"], "carries 4 bytes", id="lora"),
        pytest.param(["load_lora", "", {}], "adapter name", id="lora-name"),
    ],
)
def test_bad_steps_fail_decoding_with_a_clear_message(raw_op: list[Any], message: str) -> None:
    frames = [p.SIGNATURE, p.SYNC, msgpack.packb([1, raw_op])]
    with pytest.raises(ProtocolError, match="invalid sync message") as info:
        codec.Decoder(codec.FROM_CLIENT).decode(frames)
    assert message in str(info.value)


def test_a_bucket_must_fit_its_cuda_ipc_buffer() -> None:
    small = msgspec.structs.replace(HANDLE, nbytes=100)
    with pytest.raises(ValueError, match="does not fit CUDA IPC buffer buf-1"):
        p.LoadIpc(small, BUCKET, "layout-1")


class OldLoadIpc(msgspec.Struct, tag="load_ipc", array_like=True, omit_defaults=True):
    """``load_ipc`` as workers before the ready event decoded it: they map the buffer and read
    it at once, never waiting for ``handle.event_handle``."""

    handle: p.CudaIpcHandle
    bucket: p.Bucket
    live: list[str] = []
    begin: bool = False
    finish: bool = False
    direct: bool = True


class OldControl(msgspec.Struct, array_like=True, omit_defaults=True):
    round_id: int
    op: p.Begin | p.Commit | OldLoadIpc | p.Abort
    rank_offset: int = 0
    world_size: int = 0


def test_a_worker_that_would_not_wait_for_the_ready_event_refuses_the_load_instead() -> None:
    """The trainer's load step needs its buffer's ready event waited for; a worker of an
    older release would read a half-packed buffer, silently. It must fail to decode the step
    (and answer the round with a refusal) instead."""
    from zmq_rollout.workers.control import refusal

    header = codec.encode_body(p.Control(3, EXAMPLES[p.LoadIpc], 1, 2))
    with pytest.raises(msgspec.ValidationError, match="load_ipc2"):
        msgspec.msgpack.decode(header, type=OldControl)
    ack = refusal(header, "unknown step", 5)
    assert ack is not None and not ack.ok and ack.op == "load_ipc2"


def test_a_cuda_ipc_load_needs_the_ready_event_and_a_layout_name() -> None:
    for handle in (
        msgspec.structs.replace(HANDLE, event_handle=b""),
        msgspec.structs.replace(HANDLE, event_sync_required=True),
    ):
        with pytest.raises(ValueError, match="without its ready event"):
            p.LoadIpc(handle, BUCKET, "layout-1")
    with pytest.raises(ValueError, match="bucket layout"):
        p.LoadIpc(HANDLE, BUCKET, "")


def test_step_timeout_is_checked() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        p.SyncStep(0, p.Abort(), 0.0)
    with pytest.raises(ValueError, match="timeout_s"):
        p.SyncStep(0, p.Abort(), float("nan"))


@pytest.mark.parametrize(
    "result", [None, 12, p.NameCheck(["missing.weight"], ["unknown.weight"])], ids=["nil", "int", "names"]
)
def test_ack_results_are_typed(result: Any) -> None:
    ack = p.ControlAck(1, "check_names", True, 3, "", result)
    decoded = codec.Decoder(codec.FROM_WORKER).decode(codec.encode(p.CONTROL_ACK, ack)).body
    assert decoded == ack and type(decoded.result) is type(result)
    reply = p.SyncReply(1, "check_names", [p.WorkerAck("w", True, result)])
    assert codec.Decoder(codec.TO_CLIENT).decode(codec.encode(p.SYNC_REPLY, reply)).body == reply


def test_a_tensors_load_needs_the_ready_event_names_and_sources_that_fit() -> None:
    source = p.IpcSource(HANDLE, BUCKET)
    with pytest.raises(ValueError, match="without the trainer's ready event"):
        p.LoadIpcTensors("ready-1", b"", "layout-1", [source])
    with pytest.raises(ValueError, match="ready event id"):
        p.LoadIpcTensors("", b"\x04" * 64, "layout-1", [source])
    with pytest.raises(ValueError, match="bucket layout"):
        p.LoadIpcTensors("ready-1", b"\x04" * 64, "x" * 65, [source])
    with pytest.raises(ValueError, match="does not fit the trainer's storage buf-1"):
        p.IpcSource(msgspec.structs.replace(HANDLE, nbytes=100), BUCKET)


def test_a_tensors_load_that_does_not_fit_fails_decoding_at_the_broker() -> None:
    """A source whose tensors end past its storage is bad input: the broker's decoder says so."""
    raw = msgpack.unpackb(codec.encode_body(p.SyncStep(1, EXAMPLES[p.LoadIpcTensors])))
    raw[1][4][0][0][2] = 100  # the first source's handle: nbytes 1024 -> 100, smaller than its bucket
    with pytest.raises(ProtocolError, match="does not fit the trainer's storage"):
        codec.Decoder(codec.FROM_CLIENT).decode([p.SIGNATURE, p.SYNC, msgpack.packb(raw)])
