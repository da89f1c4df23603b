"""The valid messages a fuzzer starts from, and a walk of their fields by type. A TEST TOOL,
not the product (``fuzzing.py`` says who uses it).

``templates(table)`` gives valid ``(command, body)`` pairs covering every command of one
direction of the protocol (``TABLES``); ``PORTS`` says which direction each fuzzed port reads,
and ``RECEIVERS`` how its receiver decodes it. ``nodes`` walks a body (as msgpack builtins)
with the msgspec type of each field, so that a mutation knows what kind of value it replaces;
``node_at`` and ``with_node`` read and replace the value at one path.
"""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.submissions import encode_job

PORTS = {"frontend": "from_client", "backend": "from_worker", "worker": "to_worker"}
TABLES = {
    "from_client": codec.FROM_CLIENT,
    "from_worker": codec.FROM_WORKER,
    "to_worker": codec.TO_WORKER,
    "to_client": codec.TO_CLIENT,
}
RECEIVERS = {
    "from_client": codec.BROKER_FROM_CLIENT,
    "from_worker": codec.FROM_WORKER,
    "to_worker": codec.WORKER_FROM_BROKER,
}
"""How each port's receiver decodes it: the broker reads jobs as ``JobRelay`` and a worker
opens JOBS job by job, so a job whose token ids only a worker refuses is not malformed there."""


_KINDS: dict[type, str] = {
    mi.IntType: "int",
    mi.FloatType: "float",
    mi.StrType: "str",
    mi.BoolType: "bool",
    mi.NoneType: "nil",
    mi.BytesType: "bytes",
    mi.ListType: "list",
    mi.DictType: "dict",
    mi.StructType: "struct",
}


def kind_of(info: Any) -> str:
    """The msgpack kind of a msgspec type (``_KINDS``): what a mutation replaces; ``any`` for the rest."""
    return _KINDS.get(type(info), "any")


def _member(value: Any, union: mi.UnionType) -> Any:
    """The member of ``union`` that ``value`` (wire builtins) is an instance of, or None."""
    for t in union.types:
        if isinstance(t, mi.StructType) and t.tag is not None:
            if isinstance(value, list) and value and value[0] == t.tag:
                return t
            continue
        kind = kind_of(t)
        if kind == "struct" and isinstance(value, list):
            return t
        if {"int": int, "float": float, "str": str, "nil": type(None), "list": list, "dict": dict}.get(kind) is type(
            value
        ):
            return t
    return None


def nodes(value: Any, info: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """Every ``(path, type)`` of ``value`` (a body as msgpack builtins) whose msgspec type is
    ``info``; the items of lists up to 16 long."""
    if isinstance(info, mi.UnionType):
        info = _member(value, info)
        if info is None:
            return [(path, mi.AnyType())]
    out = [(path, info)]
    if isinstance(info, mi.StructType) and isinstance(value, list):
        offset = 1 if info.tag is not None else 0
        for i, field in enumerate(info.fields):
            if offset + i < len(value):
                out += nodes(value[offset + i], field.type, (*path, offset + i))
    elif isinstance(info, mi.ListType) and isinstance(value, list) and len(value) <= 16:
        for i, item in enumerate(value):  # not into the long lists of _reshape: their items are one object
            out += nodes(item, info.item_type, (*path, i))
    elif isinstance(info, mi.DictType) and isinstance(value, dict):
        for key in list(value)[:8]:
            out += nodes(value[key], info.value_type, (*path, key))
    return out


def node_at(root: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        root = root[key]
    return root


def with_node(root: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node_at(root, path[:-1])[path[-1]] = value
    return root


def _bucket() -> p.Bucket:
    return p.Bucket(0, 268, [p.TensorMeta("a", "bfloat16", [4, 4], 0, 32), p.TensorMeta("b", "float32", [3], 256, 12)])


def sync_ops() -> list[p.AnySyncOp]:
    """One example of every step of a weight-sync round."""
    handle = p.CudaIpcHandle("buf-1", "GPU-fuzz", 512, b"\x01" * 64, 512, 0, b"/torch_1", 0, b"\x02" * 64, False)
    return [
        p.Begin("abort"),
        p.CheckNames(["a", "b"]),
        p.BeginUpdate(),
        p.LoadShm("zr-fuzz-0", _bucket(), begin=True, finish=True),
        p.LoadIpc(handle, _bucket(), "layout-1", ["buf-1"], True, True, False),
        p.LoadIpcTensors("ready-1", b"\x03" * 64, "layout-2", [p.IpcSource(handle, _bucket())], [], True, True),
        p.JoinGroup("127.0.0.1", 29500, "gloo", 5.0, "zr-fuzz"),
        p.ReceiveBucket(_bucket()),
        p.LeaveGroup(),
        p.FinishUpdate(),
        p.LoraBucket("adapter", _bucket(), b"\x00" * 268, True),
        p.LoadLora("adapter", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}),
        p.Commit(3),
        p.Abort(),
    ]


def jobs() -> list[p.JobSpec]:
    full = p.SamplingParams(2, 0.7, 0.9, 5, 8, ["\n", "END"], 7, 2, True)
    return [
        p.JobSpec("fuzz-a", p.SamplingParams(max_tokens=4), prompt="hello"),
        p.JobSpec("fuzz-b", full, prompt_token_ids=[5, 6, 7], stream=True, resubmitted=True),
        p.JobSpec("fuzz-c", p.SamplingParams(), messages=[p.ChatMessage("user", "hi")], min_weight_version=2),
        p.JobSpec("fuzz-d", full, prompt="x", lora="adapter"),
    ]


def templates(table: str) -> list[tuple[bytes, Any]]:
    """Valid ``(command, body)`` pairs covering every command of a direction (``TABLES``)."""
    sample = p.Sample(0, [4, 5], [-0.5, -0.25], "length", [{4: -0.5}, {5: -0.25}], [0, 1])
    js = jobs()
    if table == "from_client":
        return [
            (p.SUBMIT, js[:1]),
            (p.SUBMIT, js[1:]),
            (p.SUBMIT, [msgspec.Raw(encode_job(js[1], token_bins=True))]),  # its ids as a token bin
            (p.SEALED_SUBMIT, [msgspec.Raw(p.sealed_job(j, encode_job(j, token_bins=True))) for j in js]),
            (p.CANCEL, ["fuzz-a", "fuzz-b"]),
            (p.STATUS, None),
            (p.HEARTBEAT, None),
            (p.DISCONNECT, None),
            *[(p.SYNC, p.SyncStep(0, op, 5.0)) for op in sync_ops()],
        ]
    if table == "from_worker":
        return [
            (p.READY, p.WorkerInfo("fuzz-worker", "tiny", 0, 0, ["generate"], 2048, 1)),
            (p.CREDIT, 0),
            (p.PARTIAL, [p.Delta(7, 0, [4, 5], [-0.5, -0.25])]),
            (p.FINAL, [p.Result(7, [1, 2, 3], [sample], 0, "fuzz-worker")]),
            (p.SEALED_FINAL, [p.seal(p.Result(7, [1, 2, 3], [sample], 0, "fuzz-worker"))]),
            (p.ERROR, [p.ErrorItem(7, "job_failed", "boom")]),
            (p.HEARTBEAT, None),
            (p.DISCONNECT, None),
            (p.CONTROL_ACK, p.ControlAck(1, "begin", True, 0, "", 1)),
            (p.CONTROL_ACK, p.ControlAck(1, "check_names", True, 0, "", p.NameCheck(["a"], ["b"]))),
        ]
    if table == "to_worker":
        return [
            (p.JOBS, [p.Assignment(1_000_000 + i, j) for i, j in enumerate(js)]),
            (p.JOBS, [p.Assignment(999_999, js[0])]),
            (p.CANCEL, [1_000_000, 1]),
            (p.HEARTBEAT, None),
            (p.DISCONNECT, None),
            *[(p.CONTROL, p.Control(1, op, 1, 2)) for op in sync_ops()],
        ]
    status = p.StatusReply(
        [p.WorkerStatus("w", "ready", "tiny", 4, 1, 0, 0.5)], [p.ClientStatus("c", 1, 2)], 1, 2, 0, p.JobTotals(1, 2)
    )
    return [
        (p.ACCEPTED, ["a"]),
        (p.PARTIAL, [p.Delta("a", 0, [4], [-0.5])]),
        (p.FINAL, [p.Result("a", [1], [sample], 0, "w")]),
        (p.ERROR, [p.ErrorItem(None, "protocol", "bad")]),
        (p.BUSY, [p.ErrorItem("a", "busy", "full")]),
        (p.STATUS_REPLY, status),
        (p.SYNC_REPLY, p.SyncReply(1, "begin", [p.WorkerAck("w", True, 1)], [p.Evicted("v", "gone")], 0)),
        (p.HEARTBEAT, p.Liveness("epoch", True)),
    ]
