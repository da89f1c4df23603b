"""The weight-sync round state machine in the broker's pure logic (no sockets)."""

from __future__ import annotations

from typing import Any

from zmq_rollout import protocol as p
from zmq_rollout.broker.scheduler import Scheduler
from zmq_rollout.config import BrokerConfig

T = b"trainer"
C = b"client"
W1, W2, W3 = b"w1", b"w2", b"w3"


def sent(s: Scheduler) -> list[tuple[bytes, bytes, Any]]:
    return [(ident, cmd, body) for _, ident, cmd, body in s.outbox.take()]


def fleet(*workers: bytes, credits: int = 4, ranks: int = 1, **config: object) -> Scheduler:
    s = Scheduler(BrokerConfig(**config))  # type: ignore[arg-type]
    for w in workers:
        s.worker_ready(w, p.WorkerInfo(w.decode(), "m", credits, num_ranks=ranks), 0.0)
    sent(s)
    return s


def replies(out: list[tuple[bytes, bytes, Any]]) -> list[p.SyncReply]:
    return [body for ident, cmd, body in out if cmd == p.SYNC_REPLY]


def controls(out: list[tuple[bytes, bytes, Any]]) -> dict[bytes, p.Control]:
    return {ident: body for ident, cmd, body in out if cmd == p.CONTROL}


def ack(s: Scheduler, w: bytes, rnd: int, op: str, version: int = 0, result: Any = None, ok: bool = True) -> None:
    s.sync.ack(w, p.ControlAck(rnd, op, ok, version, "", result), 1.0)


def test_begin_pauses_every_worker_and_replies_when_all_acked() -> None:
    s = fleet(W1, W2)
    s.sync.step(T, p.SyncStep(0, p.Begin("abort")), 1.0)
    out = sent(s)
    ctl = controls(out)
    assert set(ctl) == {W1, W2}
    assert all(c.op == p.Begin("abort") for c in ctl.values())  # the same step, on every hop
    assert sorted(c.rank_offset for c in ctl.values()) == [1, 2]
    assert all(c.world_size == 3 for c in ctl.values())
    assert replies(out) == []
    assert all(not w.accepting for w in s.workers.values())
    rnd = ctl[W1].round_id
    ack(s, W1, rnd, "pause")
    assert replies(sent(s)) == []
    ack(s, W2, rnd, "pause")
    (reply,) = replies(sent(s))
    assert reply.op == "begin" and {a.name for a in reply.acks} == {"w1", "w2"} and reply.evicted == []


def test_rank_offsets_count_tensor_parallel_ranks() -> None:
    s = fleet(W1, W2, ranks=2)
    s.sync.step(T, p.SyncStep(0, p.Begin()), 1.0)
    ctl = controls(sent(s))
    assert sorted(c.rank_offset for c in ctl.values()) == [1, 3]
    assert all(c.world_size == 5 for c in ctl.values())


def test_no_jobs_are_dispatched_during_a_round_and_commit_resumes_with_the_new_version() -> None:
    s = fleet(W1)
    s.sync.step(T, p.SyncStep(0, p.Begin()), 1.0)
    rnd = controls(sent(s))[W1].round_id
    ack(s, W1, rnd, "pause")
    sent(s)
    s.submit(C, [p.JobSpec("j", prompt="x")], 1.0)
    assert [cmd for _, cmd, _ in sent(s)] == [p.ACCEPTED]  # queued, not dispatched
    s.sync.step(T, p.SyncStep(rnd, p.Commit(7)), 2.0)
    assert controls(sent(s))[W1].op == p.Commit(7)
    ack(s, W1, rnd, "commit", version=7, result=7)
    out = sent(s)
    (reply,) = replies(out)
    assert reply.fleet_version == 7 and s.fleet_version == 7
    assert s.workers[W1].weight_version == 7 and s.workers[W1].accepting
    assert any(cmd == p.JOBS for _, cmd, _ in out)  # the queued job goes out now
    assert s.sync.round is None


def test_a_silent_worker_is_evicted_at_the_step_deadline_and_its_jobs_requeued() -> None:
    s = fleet(W1, W2, credits=1)
    s.submit(C, [p.JobSpec("a", prompt="x"), p.JobSpec("b", prompt="y")], 0.5)
    sent(s)
    s.sync.step(T, p.SyncStep(0, p.Begin("wait"), timeout_s=5.0), 1.0)
    rnd = controls(sent(s))[W1].round_id
    ack(s, W1, rnd, "pause")
    s.sync.tick(3.0)
    assert replies(sent(s)) == []  # not yet
    s.sync.tick(6.5)  # W2 missed the deadline
    out = sent(s)
    (reply,) = replies(out)
    assert [e.name for e in reply.evicted] == ["w2"] and [a.name for a in reply.acks] == ["w1"]
    assert (W2, p.DISCONNECT, None) in out
    assert W2 not in s.workers and s.stats.requeued == 1
    assert s.sync.num_evicted == 1


def test_worker_lost_mid_step_completes_the_step_for_the_others() -> None:
    s = fleet(W1, W2)
    s.sync.step(T, p.SyncStep(0, p.Begin()), 1.0)
    rnd = controls(sent(s))[W1].round_id
    ack(s, W1, rnd, "pause")
    s.worker_gone(W2, "heartbeat expired", 2.0)
    (reply,) = replies(sent(s))
    assert [e.name for e in reply.evicted] == ["w2"] and "heartbeat" in reply.evicted[0].reason


def test_late_joiner_gets_no_jobs_until_synced() -> None:
    s = fleet(W1)
    s.sync.step(T, p.SyncStep(0, p.Begin()), 1.0)
    rnd = controls(sent(s))[W1].round_id
    ack(s, W1, rnd, "pause")
    s.sync.step(T, p.SyncStep(rnd, p.Commit(3)), 2.0)
    ack(s, W1, rnd, "commit", version=3, result=3)
    sent(s)
    s.worker_ready(W3, p.WorkerInfo("w3", "m", 4), 3.0)  # version 0 < fleet 3
    assert not s.workers[W3].accepting and s.worker_state(s.workers[W3]) == "stale"
    s.submit(C, [p.JobSpec(f"j{i}", prompt="x") for i in range(6)], 3.0)
    jobs = [(ident, body) for ident, cmd, body in sent(s) if cmd == p.JOBS]
    assert {ident for ident, _ in jobs} == {W1}
    # The next round includes it; after commit it takes work.
    s.sync.step(T, p.SyncStep(0, p.Begin()), 4.0)
    ctl = controls(sent(s))
    assert set(ctl) == {W1, W3}


def test_one_round_at_a_time_and_steps_need_the_round_owner() -> None:
    s = fleet(W1)
    s.sync.step(T, p.SyncStep(0, p.Begin()), 1.0)
    rnd = controls(sent(s))[W1].round_id
    s.sync.step(b"other", p.SyncStep(0, p.Begin()), 1.0)
    (refused,) = replies(sent(s))
    assert "still running" in refused.error
    s.sync.step(b"other", p.SyncStep(rnd, p.Commit(1)), 1.0)
    (refused,) = replies(sent(s))
    assert "no sync round" in refused.error


def test_trainer_loss_aborts_the_round_and_resumes_workers() -> None:
    s = fleet(W1)
    s.client_seen(T, 0.5)
    s.sync.step(T, p.SyncStep(0, p.Begin()), 1.0)
    rnd = controls(sent(s))[W1].round_id
    ack(s, W1, rnd, "pause")
    sent(s)
    s.client_gone(T, "client disconnected", 2.0)
    ctl = controls(sent(s))
    assert ctl[W1].op == p.Abort()
    assert s.sync.round is None and s.workers[W1].accepting


def test_silent_trainer_between_steps_aborts_the_round() -> None:
    s = fleet(W1, round_idle_timeout_s=10.0)  # BrokerConfig (and `zmq-rollout broker --round-idle-timeout-s`)
    s.sync.step(T, p.SyncStep(0, p.Begin()), 1.0)
    rnd = controls(sent(s))[W1].round_id
    ack(s, W1, rnd, "pause")
    sent(s)
    s.sync.tick(10.5)
    assert not sent(s) and s.sync.round is not None  # not idle for 10 s yet
    s.sync.tick(20.0)
    assert controls(sent(s))[W1].op == p.Abort()
    assert s.sync.round is None


def test_a_step_while_another_runs_is_refused() -> None:
    s = fleet(W1)
    s.sync.step(T, p.SyncStep(0, p.Begin()), 1.0)
    rnd = controls(sent(s))[W1].round_id
    s.sync.step(T, p.SyncStep(rnd, p.BeginUpdate()), 1.0)
    (refused,) = replies(sent(s))
    assert "'begin' of round" in refused.error and "still running" in refused.error
    assert s.sync.round is not None and s.sync.round.step is not None  # the begin step goes on


def test_min_weight_version_never_goes_to_an_older_worker() -> None:
    s = fleet(W1)
    s.submit(C, [p.JobSpec("new", prompt="x", min_weight_version=2)], 1.0)
    assert [cmd for _, cmd, _ in sent(s)] == [p.ACCEPTED]
    s.workers[W1].weight_version = 2
    s.dispatch(2.0)
    assert [cmd for _, cmd, _ in sent(s)] == [p.JOBS]


def test_a_round_with_no_workers_commits_without_crashing() -> None:
    s = Scheduler(BrokerConfig())
    s.sync.step(T, p.SyncStep(0, p.Begin()), 1.0)
    (reply,) = replies(sent(s))
    assert reply.acks == [] and reply.error == ""
    s.sync.step(T, p.SyncStep(reply.round_id, p.Commit(1)), 2.0)
    (reply,) = replies(sent(s))
    assert reply.op == "commit" and s.sync.round is None and s.fleet_version == 0


def test_a_worker_that_joins_during_a_round_is_stale_after_the_commit() -> None:
    s = fleet(W1)
    s.sync.step(T, p.SyncStep(0, p.Begin()), 1.0)
    rnd = controls(sent(s))[W1].round_id
    ack(s, W1, rnd, "pause")
    s.worker_ready(W2, p.WorkerInfo("w2", "m", 4), 1.5)  # old weights, fine until the commit
    assert s.workers[W2].accepting
    s.sync.step(T, p.SyncStep(rnd, p.Commit(1)), 2.0)
    ack(s, W1, rnd, "commit", version=1, result=1)
    sent(s)
    assert not s.workers[W2].accepting and s.worker_state(s.workers[W2]) == "stale"
    assert s.workers[W1].accepting


def test_a_member_lost_between_steps_is_reported_with_the_next_reply() -> None:
    s = fleet(W1, W2)
    s.sync.step(T, p.SyncStep(0, p.Begin()), 1.0)
    rnd = controls(sent(s))[W1].round_id
    ack(s, W1, rnd, "pause")
    ack(s, W2, rnd, "pause")
    sent(s)
    s.worker_gone(W2, "heartbeat expired", 2.0)
    s.sync.step(T, p.SyncStep(rnd, p.BeginUpdate()), 3.0)
    ctl = controls(sent(s))
    assert set(ctl) == {W1} and ctl[W1].world_size == 2
    ack(s, W1, rnd, "begin_update")
    (reply,) = replies(sent(s))
    assert [e.name for e in reply.evicted] == ["w2"]


def test_a_worker_that_cannot_pause_leaves_the_round() -> None:
    s = fleet(W1, W2)
    s.sync.step(T, p.SyncStep(0, p.Begin()), 1.0)
    rnd = controls(sent(s))[W1].round_id
    ack(s, W1, rnd, "pause")
    ack(s, W2, rnd, "pause", ok=False)
    (reply,) = replies(sent(s))
    assert [a.ok for a in reply.acks] == [True, False]
    assert s.workers[W2].accepting and not s.workers[W1].accepting
    s.sync.step(T, p.SyncStep(rnd, p.BeginUpdate()), 2.0)
    assert set(controls(sent(s))) == {W1}
