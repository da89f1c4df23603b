"""vLLM's weight-update endpoints on the gateway (zmq_rollout/gateway/weight_transfer.py).

First with no socket: vLLM's bodies and packed layout (``weight_bodies``), and the state
machine (``WeightUpdates``) against ``FakeBroker``, a test double that answers steps and
status as a broker would. Then over HTTP: a real broker with echo worker doubles, and a
*gloo worker double* that joins the trainer's group and receives its broadcasts for real, so
the trainer's side (``WeightTransferClient``) is proven byte for byte without vLLM.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import httpx
import pytest
import torch
import zmq
from helpers import poll_until

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.errors import BrokerUnavailableError, InvalidRequestError, SyncError
from zmq_rollout.gateway.openai_protocol import OpenAIError
from zmq_rollout.gateway.weight_bodies import GROUP_NAME, BadBody, InitInfo, UpdateInfo, chunks
from zmq_rollout.gateway.weight_rounds import WeightUpdates, http_error
from zmq_rollout.integrations.vllm_weights import WeightTransferClient
from zmq_rollout.testing import EchoWorkerDouble
from zmq_rollout.weight_sync.buckets import unpack
from zmq_rollout.weight_sync.collective import CollectiveGroup

INIT = {"master_address": "10.0.0.9", "master_port": 51216, "rank_offset": 1, "world_size": 3, "packed": True,
        "check_names": True}  # fmt: skip
UPDATE = {"names": ["a.weight", "b.weight", "c.bias"], "dtype_names": ["bfloat16", "bfloat16", "float32"],
          "shapes": [[4, 8], [16], [3]]}  # fmt: skip


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- vLLM's bodies and layout (pure) ---------------------------------------------------------
def test_init_info_takes_vllms_fields_and_refuses_what_gloo_cannot_do() -> None:
    info = InitInfo.parse({"init_info": {**INIT, "packed_buffer_size_bytes": 64}}, "gloo")
    assert (info.master_address, info.master_port, info.world_size, info.packed) == ("10.0.0.9", 51216, 3, True)
    assert info.packed_buffer_size_bytes == 64 and info.backend == "gloo"
    assert InitInfo.parse(info.body(), "gloo") == info  # what the trainer side posts parses back to itself
    assert InitInfo.parse({"init_info": {**INIT, "packed": False}}, "gloo").packed is False
    vllms = {k: v for k, v in INIT.items() if k != "check_names"}  # what TRL sends: no checkpoint check, as vLLM
    assert InitInfo.parse({"init_info": vllms}, "gloo").check_names is False
    bad = {
        "init_info": {},
        "init_info.nccl_unique_id_b64": {**INIT, "nccl_unique_id_b64": "AAAA"},
        "init_info.rank_offset": {**INIT, "rank_offset": 2},
        "init_info.master_port": {**INIT, "master_port": 70000},
        "init_info.world_size": {**INIT, "world_size": True},
        "init_info.packed": {**INIT, "packed": "yes"},
        "init_info.backend": {**INIT, "backend": "nccl"},
        "init_info.surprise": {**INIT, "surprise": 1},
        "init_info.master_address": {k: v for k, v in INIT.items() if k != "master_address"},
    }
    for param, fields in bad.items():
        with pytest.raises(BadBody) as info_error:
            InitInfo.parse({"init_info": fields} if fields else {"nope": 1}, "gloo")
        assert info_error.value.param == param, (param, str(info_error.value))


def test_update_info_checks_every_tensor() -> None:
    update = UpdateInfo.parse({"update_info": UPDATE})
    assert update.names == UPDATE["names"] and update.packed is None
    assert UpdateInfo.parse(update.body()) == update
    assert UpdateInfo.parse({"update_info": {**UPDATE, "packed": False}}).packed is False  # vLLM < 0.28 said it here
    bad: dict[str, Any] = {
        "update_info.names": {**UPDATE, "names": ["a.weight", "b.weight"]},  # 2 names, 3 dtypes
        "update_info.dtype_names": {**UPDATE, "dtype_names": ["bfloat16", "complex64", "float32"]},
        "update_info.shapes": {**UPDATE, "shapes": [[4, 8], [-1], [3]]},
        "update_info.extra": {**UPDATE, "extra": 1},
    }
    for param, fields in bad.items():
        with pytest.raises(BadBody) as error:
            UpdateInfo.parse({"update_info": fields})
        assert error.value.param == param
    with pytest.raises(BadBody, match="list"):
        UpdateInfo.parse({"update_info": [UPDATE]})


def test_chunks_follow_vllms_packed_layout() -> None:
    """vLLM packs with no padding and closes a chunk right after the tensor that takes it past
    the buffer size; unpacked, each tensor is a broadcast of its own."""
    update = UpdateInfo(["a", "b", "c", "d"], ["bfloat16"] * 4, [[10], [20], [5], [100]])  # 20, 40, 10, 200 bytes
    small = chunks(update, InitInfo("h", 1, 2, packed=True, packed_buffer_size_bytes=50))
    layout = [[(m.name, m.offset, m.nbytes) for m in b.tensors] for b in small]
    assert layout == [[("a", 0, 20), ("b", 20, 40)], [("c", 0, 10), ("d", 10, 200)]]
    big = chunks(update, InitInfo("h", 1, 2, packed=True, packed_buffer_size_bytes=1 << 30))
    assert [b.nbytes for b in big] == [270] and [b.index for b in big] == [0]
    single = chunks(update, InitInfo("h", 1, 2, packed=False))
    assert [(b.nbytes, b.tensors[0].offset) for b in single] == [(20, 0), (40, 0), (10, 0), (200, 0)]
    packed_here = UpdateInfo(update.names, update.dtype_names, update.shapes, packed=True)
    assert len(chunks(packed_here, InitInfo("h", 1, 2, packed=False))) == 1  # the update's flag wins
    with pytest.raises(BadBody, match="byte 2"):  # an fp32 after one bf16 element: its view would be misaligned
        chunks(UpdateInfo(["x", "y"], ["bfloat16", "float32"], [[1], [1]]), InitInfo("h", 1, 2, packed=True))


# -- the state machine, against a broker double (no socket) ------------------------------------
class FakeBroker:
    """Answers steps and status as a broker with ``workers`` (name -> ranks) would. ``fail``:
    step -> message (every worker fails it); ``refuse``: an error for every step (another
    round); ``lost``: the broker is gone; ``unknown``: names the checkpoints lack."""

    def __init__(self, workers: dict[str, int] | None = None, **behaviour: Any) -> None:
        self.workers = dict({"w1": 1, "w2": 1} if workers is None else workers)
        self.fail: dict[str, str] = behaviour.get("fail", {})
        self.refuse: str = behaviour.get("refuse", "")
        self.lost: bool = behaviour.get("lost", False)
        self.unknown: list[str] = behaviour.get("unknown", [])
        self.running = 0
        self.fleet_version = 3
        self.steps: list[p.SyncStep] = []

    @property
    def ops(self) -> list[str]:
        return [s.op.kind for s in self.steps]

    async def sync_step(self, step: p.SyncStep) -> p.SyncReply:
        if self.lost:
            raise SyncError("the broker at tcp://x:5555 is not answering")
        self.steps.append(step)
        op = step.op
        if self.refuse:
            return p.SyncReply(step.round_id, op.kind, [], [], self.fleet_version, self.refuse)
        acks = [p.WorkerAck(w, op.kind not in self.fail, self._result(op, r), self.fail.get(op.kind, ""))
                for w, r in self.workers.items()]  # fmt: skip
        if isinstance(op, p.Commit):
            self.fleet_version = max(self.fleet_version, op.version)
        return p.SyncReply(7, op.kind, acks, [], self.fleet_version)

    def _result(self, op: p.SyncOp, ranks: int) -> p.AckResult:
        if isinstance(op, p.Begin):
            return ranks
        if isinstance(op, p.CheckNames):
            return p.NameCheck(["other.weight"], [n for n in op.names if n in self.unknown])
        if isinstance(op, p.Commit):
            return op.version
        return None

    async def status(self) -> p.StatusReply:
        if self.lost:
            raise BrokerUnavailableError("the broker has not answered for 30 s")
        workers = [p.WorkerStatus(w, "ready", "tiny", 4, 0, self.fleet_version, 0.1, [], 64, ranks)
                   for w, ranks in self.workers.items()]  # fmt: skip
        return p.StatusReply(workers, [], 0, self.running, self.fleet_version)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def updates_for(broker: FakeBroker, backend: str = "gloo", clock: Clock | None = None) -> WeightUpdates:
    return WeightUpdates(broker, broker.status, backend=backend, timeout_s=30.0, clock=clock or Clock())


def status_of(exc: BaseException) -> int:
    """The status the app answers (``http_error``, then the gateway's ``error_of``)."""
    from zmq_rollout.gateway.app import error_of

    return error_of(http_error(exc)).status


async def raises(coro: Any) -> int:
    """The HTTP status the call's error becomes."""
    try:
        await coro
    except Exception as exc:
        return status_of(exc)
    raise AssertionError("the call did not fail")


def test_init_start_update_finish_is_one_round_with_a_new_version() -> None:
    broker = FakeBroker()
    updates = updates_for(broker)

    async def main() -> None:
        assert await updates.world_size() == 2
        assert await updates.init_engine({"init_info": INIT}) == {"message": "Weight transfer initialized"}
        assert broker.steps == []  # init pauses nothing
        await updates.start()
        await updates.update({"update_info": UPDATE})
        second = {"names": ["d.weight"], "dtype_names": ["float16"], "shapes": [[2, 2]]}
        await updates.update({"update_info": second})
        done = await updates.finish({})
        assert done["weight_version"] == 4 and done["workers_updated"] == ["w1", "w2"]
        assert updates.phase == "idle" and updates.version == 4

    run(main())
    assert broker.ops == ["begin", "check_names", "join_group", "begin_update", "receive_bucket", "receive_bucket",
                          "leave_group", "finish_update", "commit"]  # fmt: skip
    begin, check, join = (s.op for s in broker.steps[:3])
    assert isinstance(begin, p.Begin) and begin.pause == "wait"
    assert isinstance(check, p.CheckNames) and check.names == UPDATE["names"]
    assert join == p.JoinGroup("10.0.0.9", 51216, "gloo", 30.0, GROUP_NAME)
    received = [s.op.bucket for s in broker.steps if isinstance(s.op, p.ReceiveBucket)]
    init = InitInfo.parse({"init_info": INIT}, "gloo")
    assert received[0] == chunks(UpdateInfo(**UPDATE), init)[0]
    assert [t.name for t in received[1].tensors] == ["d.weight"]
    assert broker.steps[-1].op == p.Commit(4)
    assert {s.timeout_s for s in broker.steps} == {30.0}


def test_calls_out_of_turn_are_400s_and_touch_nothing() -> None:
    broker = FakeBroker()
    updates = updates_for(broker)

    async def main() -> None:
        assert await raises(updates.start()) == 400  # no init yet
        await updates.init_engine({"init_info": INIT})
        assert await raises(updates.update({"update_info": UPDATE})) == 400  # no start
        assert await raises(updates.finish({})) == 400  # no start
        assert broker.steps == []
        await updates.start()
        assert await raises(updates.start()) == 409  # one update at a time
        bad = {**UPDATE, "shapes": [[4, 8], [16], ["x"]]}
        assert await raises(updates.update({"update_info": bad})) == 400
        assert await raises(updates.finish({"weight_version": "v7"})) == 400
        assert await raises(updates.finish({"weight_version": 3})) == 400  # not above the fleet's 3
        assert updates.phase == "updating"  # refused bodies leave the round as it was
        await updates.update({"update_info": UPDATE})
        assert (await updates.finish({"weight_version": "9"}))["weight_version"] == 9

    run(main())
    assert broker.ops[0] == "begin" and broker.ops[-1] == "commit" and broker.steps[-1].op == p.Commit(9)
    assert "abort" not in broker.ops


def test_a_fleet_that_changed_since_init_is_refused_before_anything_loads() -> None:
    broker = FakeBroker()
    updates = updates_for(broker)

    async def main() -> None:
        assert await raises(updates.init_engine({"init_info": {**INIT, "world_size": 4}})) == 400
        await updates.init_engine({"init_info": INIT})
        broker.workers["w3"] = 1  # a worker joined
        assert await raises(updates.start()) == 409
        assert updates.phase == "idle"
        broker.workers = {"w1": 2, "w2": 1}  # a tensor-parallel pair
        assert await updates.world_size() == 3 and await updates.world_size(include_dp=False) == 2
        assert await raises(updates.start()) == 409

    run(main())
    assert broker.ops == ["begin", "abort", "begin", "abort"]


def test_without_check_names_the_first_update_joins_at_once() -> None:
    broker = FakeBroker(unknown=["c.bias"])
    updates = updates_for(broker)

    async def main() -> None:
        await updates.init_engine({"init_info": {**INIT, "check_names": False}})
        await updates.start()
        await updates.update({"update_info": UPDATE})
        await updates.finish({})

    run(main())
    assert broker.ops[:4] == ["begin", "join_group", "begin_update", "receive_bucket"]


def test_names_the_checkpoint_lacks_end_the_round_before_loading() -> None:
    broker = FakeBroker(unknown=["c.bias"])
    updates = updates_for(broker)

    async def main() -> None:
        await updates.init_engine({"init_info": INIT})
        await updates.start()
        try:
            await updates.update({"update_info": UPDATE})
        except BadBody as exc:
            assert exc.param == "update_info.names" and "c.bias" in str(exc)
        else:
            raise AssertionError("unknown names were accepted")

    run(main())
    assert broker.ops == ["begin", "check_names", "abort"]  # no begin_update: the workers resume intact


def test_a_step_that_fails_aborts_the_round_and_is_a_500() -> None:
    broker = FakeBroker(fail={"receive_bucket": "RuntimeError: broadcast timed out"})
    updates = updates_for(broker)

    async def main() -> None:
        await updates.init_engine({"init_info": INIT})
        await updates.start()
        try:
            await updates.update({"update_info": UPDATE})
        except SyncError as exc:
            error = http_error(exc)
            assert isinstance(error, OpenAIError) and error.status == 500 and "broadcast timed out" in error.message
        else:
            raise AssertionError("a failed step was not raised")
        assert updates.phase == "idle"
        assert await raises(updates.finish({})) == 400  # the round is over

    run(main())
    assert broker.ops[-1] == "abort" and "commit" not in broker.ops


def test_a_lost_broker_is_503_and_another_round_409() -> None:
    async def main() -> None:
        lost = updates_for(FakeBroker(lost=True))
        assert await raises(lost.world_size()) == 503
        assert await raises(lost.server_info()) == 503
        assert await raises(lost.init_engine({"init_info": INIT})) == 503
        lost.init = InitInfo.parse({"init_info": INIT}, "gloo")
        assert await raises(lost.start()) == 503
        assert await raises(lost.pause("abort")) == 503
        busy = updates_for(FakeBroker(refuse="sync round 2 is still running; one round at a time"))
        await busy.init_engine({"init_info": INIT})
        assert await raises(busy.start()) == 409
        assert busy.phase == "idle"

    run(main())


def test_backend_off_reports_no_engine_and_refuses_init() -> None:
    async def main() -> None:
        off = updates_for(FakeBroker(), backend="")
        assert (await off.server_info())["weight_transfer_config"] is None
        assert await raises(off.init_engine({"init_info": INIT})) == 400
        on = updates_for(FakeBroker())
        info = await on.server_info()
        assert info["weight_transfer_config"] == {"backend": "gloo"} and info["model_config"]["model"] == "tiny"
        assert (await updates_for(FakeBroker(workers={})).server_info())["weight_transfer_config"] is None

    run(main())


def test_pause_and_resume_hold_a_round_and_an_update_can_use_it() -> None:
    broker = FakeBroker()
    updates = updates_for(broker)

    async def main() -> None:
        assert await raises(updates.pause("sleep")) == 400
        assert await updates.pause("keep") == {"status": "paused"}
        await updates.pause("abort")  # already paused: nothing more
        assert await updates.resume() == {"status": "resumed"}
        assert await updates.resume() == {"status": "resumed"}  # nothing to resume
        await updates.init_engine({"init_info": INIT})
        await updates.pause("abort")
        await updates.start()  # the paused round becomes the update's: no second begin
        await updates.update({"update_info": UPDATE})
        assert await raises(updates.resume()) == 409  # loading began: only finishing ends it
        await updates.finish({})
        await updates.start()
        assert await updates.resume() == {"status": "resumed"}  # a trainer giving up before loading
        assert updates.phase == "idle"
        assert await updates.resume() == {"status": "resumed"}  # commit resumed already

    run(main())
    begins = [s.op for s in broker.steps if isinstance(s.op, p.Begin)]
    assert [b.pause for b in begins] == ["keep", "abort", "wait"]
    assert broker.ops[-3:] == ["commit", "begin", "abort"] and broker.ops.count("abort") == 2


def test_reset_prefix_cache_is_a_round_or_false_while_jobs_run() -> None:
    broker = FakeBroker()
    updates = updates_for(broker)

    async def main() -> None:
        broker.running = 2
        assert await updates.reset_prefix_cache() == {"success": False}
        assert broker.steps == []
        assert await updates.reset_prefix_cache(running=True) == {"success": True}
        broker.running = 0
        assert await updates.reset_prefix_cache() == {"success": True}
        await updates.pause("keep")
        assert await updates.reset_prefix_cache() == {"success": False}  # keep keeps the caches, by design
        await updates.resume()
        await updates.pause("wait")
        assert await updates.reset_prefix_cache() == {"success": True}  # the round's end clears them

    run(main())
    assert broker.ops == ["begin", "abort", "begin", "abort", "begin", "abort", "begin"]
    assert [s.op.pause for s in broker.steps if isinstance(s.op, p.Begin)] == ["abort", "abort", "keep", "wait"]


def test_a_round_left_idle_is_aborted_after_the_timeout() -> None:
    broker, clock = FakeBroker(), Clock()
    updates = updates_for(broker, clock=clock)

    async def main() -> None:
        await updates.init_engine({"init_info": INIT})
        await updates.start()
        await updates.update({"update_info": UPDATE})
        clock.now += 29.9
        assert await updates.expire(clock.now) is False
        clock.now += 0.2
        assert await updates.expire(clock.now) is True
        assert updates.phase == "idle" and updates.round is None
        assert await raises(updates.finish({})) == 400

    run(main())
    assert broker.ops[-1] == "abort" and "commit" not in broker.ops


# -- over HTTP: a real broker, worker doubles, uvicorn -----------------------------------------
def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error  # type: ignore[no-any-return]


def test_http_endpoints_drive_a_round_on_worker_doubles(
    start_broker: Any, start_double: Any, start_gateway: Any
) -> None:
    broker = start_broker()
    doubles = [start_double(broker), start_double(broker)]
    url = start_gateway(broker.frontend, weight_transfer_backend="gloo", weight_transfer_timeout_s=10)
    http = httpx.Client(base_url=url, timeout=30)
    assert http.get("/get_world_size").json() == {"world_size": 2}
    info = http.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["weight_transfer_config"] == {"backend": "gloo"} and info["model_config"]["model"] == "echo-double"
    assert error_of(http.post("/start_weight_update", json={}), 400)["message"].startswith("no weight transfer")
    error_of(http.post("/update_weights", json={"update_info": UPDATE}), 400)
    wrong = {"init_info": {**INIT, "world_size": 2}}  # the trainer and two workers make 3
    assert error_of(http.post("/init_weight_transfer_engine", json=wrong), 400)["param"] == "init_info.world_size"
    error_of(http.post("/init_weight_transfer_engine", content=b"{"), 400)
    assert http.post("/init_weight_transfer_engine", json={"init_info": INIT}).json() == {
        "message": "Weight transfer initialized"
    }
    assert http.post("/start_weight_update", json={}).status_code == 200
    assert poll_until(lambda: {w.state for w in broker.status().workers} == {"syncing"}, what="a paused fleet")
    bad = {**UPDATE, "dtype_names": ["bfloat16", "bfloat16", "complex32"]}
    assert error_of(http.post("/update_weights", json={"update_info": bad}), 400)["param"] == "update_info.dtype_names"
    assert http.post("/update_weights", json={"update_info": UPDATE}).json() == {"message": "Weights updated"}
    done = http.post("/finish_weight_update", json={"weight_version": "5"}).json()
    assert done["weight_version"] == 5 and sorted(done["workers_updated"]) == sorted(d.name for d in doubles)
    status = broker.status()
    assert status.fleet_version == 5 and {w.weight_version for w in status.workers} == {5}
    assert {w.state for w in status.workers} == {"ready"}
    answer = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).json()
    assert answer["choices"][0]["weight_version"] == 5  # completions carry the new version
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert error_of(http.post("/pause", params={"mode": "later"}), 400)["param"] == "mode"
    assert http.post("/resume").json() == {"status": "resumed"}
    assert broker.status().fleet_version == 5


def test_http_world_size_counts_every_rank_the_workers_announce(
    start_broker: Any, start_double: Any, start_gateway: Any, raw_socket: Any
) -> None:
    broker = start_broker(worker_liveness=1000)  # the hand-made worker below sends no heartbeat
    start_double(broker)
    pair = raw_socket(zmq.DEALER)  # an engine of tensor parallelism 2, as its READY says
    pair.connect(broker.backend)
    pair.send_multipart(codec.encode(p.READY, p.WorkerInfo("tp-pair", "echo-double", 8, num_ranks=2)))
    poll_until(lambda: broker.has_worker("tp-pair"), what="the pair to register")
    assert sorted(w.num_ranks for w in broker.status().workers) == [1, 2]  # STATUS carries them
    url = start_gateway(broker.frontend, weight_transfer_backend="gloo")
    assert httpx.get(f"{url}/get_world_size").json() == {"world_size": 3}
    assert httpx.get(f"{url}/get_world_size", params={"include_dp": "false"}).json() == {"world_size": 2}


def test_http_weight_endpoints_without_a_broker_are_503(start_gateway: Any) -> None:
    with socket.socket() as s:  # a port where no broker listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = start_gateway(f"tcp://127.0.0.1:{port}", request_timeout_s=0.3, broker_timeout_s=0.5,
                        weight_transfer_backend="gloo")  # fmt: skip
    assert error_of(httpx.get(f"{url}/get_world_size", timeout=10), 503)["type"] == "Service Unavailable"
    error_of(httpx.post(f"{url}/init_weight_transfer_engine", json={"init_info": INIT}, timeout=10), 503)


class GlooWorkerDouble(EchoWorkerDouble):
    """A worker double whose weight-sync steps are real on the data side: ``join_group`` joins
    the trainer's gloo group at the rank the broker gives it, ``receive_bucket`` takes the
    broadcast and keeps the tensors it unpacks (``received``), ``leave_group`` leaves."""

    def __init__(self, address: str, **options: Any) -> None:
        super().__init__(address, **options)
        self.group: CollectiveGroup | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.ops: list[str] = []

    def sync_ack(self, control: p.Control) -> p.ControlAck:
        op = control.op
        self.ops.append(op.kind)
        if isinstance(op, p.JoinGroup):
            self.group = CollectiveGroup(op.host, op.port, control.rank_offset, control.world_size, op.backend,
                                         op.timeout_s, op.group_name, is_master=False)  # fmt: skip
        elif isinstance(op, p.ReceiveBucket):
            assert self.group is not None
            buf = torch.empty(op.bucket.nbytes, dtype=torch.uint8)
            self.group.broadcast(buf, 0)
            self.tensors.update({n: t.clone() for n, t in unpack(op.bucket, buf)})
        elif isinstance(op, p.LeaveGroup) and self.group is not None:
            self.group.close()
            self.group = None
        elif isinstance(op, p.CheckNames):  # a checkpoint with no tensor named bad.*
            unknown = [n for n in op.names if n.startswith("bad.")]
            return p.ControlAck(control.round_id, op.kind, True, self.weight_version, "", p.NameCheck(["x"], unknown))
        return super().sync_ack(control)


def test_the_trainer_side_broadcasts_what_the_workers_receive(
    start_broker: Any, start_double: Any, start_gateway: Any
) -> None:
    broker = start_broker(worker_liveness=100)  # a double is deaf while it joins or receives
    workers = [GlooWorkerDouble(broker.backend, heartbeat=0.05).start() for _ in range(2)]
    try:
        for w in workers:
            poll_until(lambda w=w: broker.has_worker(w.name), what="the gloo doubles to register")
        url = start_gateway(broker.frontend, weight_transfer_backend="gloo", weight_transfer_timeout_s=20)
        g = torch.Generator().manual_seed(0)
        sent = {
            "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        }
        client = WeightTransferClient(url, packed_buffer_size_bytes=2048, timeout_s=20, check_names=True)
        try:
            client.init_communicator()
            assert client.init is not None and client.init.world_size == 3
            client.update_named_params(None, sent.items())
            assert client.weight_version == 1
            for w in workers:
                assert w.ops == ["begin", "check_names", "join_group", "begin_update", "receive_bucket",
                                 "receive_bucket", "leave_group", "finish_update", "commit"]  # fmt: skip
                assert sorted(w.tensors) == sorted(sent)
                assert all(torch.equal(w.tensors[n], t) for n, t in sent.items())
                w.tensors.clear()
            # a weight_update() block: one round for several calls, the group formed once
            with client.weight_update():
                client.update_named_param("model.norm.weight", sent["model.norm.weight"] * 2)
                client.update_named_param("model.embed_tokens.weight", sent["model.embed_tokens.weight"])
            assert client.weight_version == 2
            assert workers[0].ops.count("join_group") == 2 and workers[0].ops.count("commit") == 2
            assert torch.equal(workers[1].tensors["model.norm.weight"], sent["model.norm.weight"] * 2)
            assert broker.status().fleet_version == 2
            with pytest.raises(InvalidRequestError, match="complex"):  # refused before anything is sent
                client.update_named_params([("x", "complex64", [2])], iter([]))
            # refused by the gateway (a name no checkpoint has) while this side waits in its rendezvous:
            # the error comes at once, nothing loaded, and the next update meets on a fresh port
            started = time.monotonic()
            with pytest.raises(InvalidRequestError, match=r"bad\.weight"):
                client.update_named_param("bad.weight", sent["model.norm.weight"])
            assert time.monotonic() - started < 10  # not the group's timeout (20 s)
            assert workers[0].ops[-3:] == ["begin", "check_names", "abort"]
            port = client.init.master_port
            client.update_named_param("model.norm.weight", sent["model.norm.weight"] * 3)
            assert client.init.master_port != port and client.weight_version == 3
            assert torch.equal(workers[0].tensors["model.norm.weight"], sent["model.norm.weight"] * 3)
            assert client.reset_prefix_cache() is True
            with pytest.raises(RuntimeError, match="trainer broke"), client.weight_update():
                raise RuntimeError("the trainer broke before sending anything")
            status = broker.status()  # the round ended at once (/resume), not at the gateway's timeout
            assert {w.state for w in status.workers} == {"ready"} and status.fleet_version == 3
            assert workers[0].ops[-2:] == ["begin", "abort"]
        finally:
            client.close()
    finally:
        for w in workers:
            w.stop()
