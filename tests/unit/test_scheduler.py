"""The broker's pure scheduler, driven event by event: no sockets, no threads, no clock."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from zmq_rollout import protocol as p
from zmq_rollout.broker.outbox import CLIENT, WORKER
from zmq_rollout.broker.scheduler import Scheduler
from zmq_rollout.config import BrokerConfig

A, B = b"client-a", b"client-b"
W1, W2 = b"worker-1", b"worker-2"

Sent = list[tuple[int, bytes, bytes, Any]]


def make(**config: Any) -> Scheduler:
    return Scheduler(BrokerConfig(**config))


def job(job_id: str, n: int = 1, **fields: Any) -> p.JobSpec:
    return p.JobSpec(job_id, p.SamplingParams(n=n), prompt="hi", **fields)


def jobs(prefix: str, count: int) -> list[p.JobSpec]:
    return [job(f"{prefix}{i}") for i in range(count)]


def ready(s: Scheduler, worker: bytes, credits: int, *, version: int = 0, now: float = 0.0) -> None:
    s.worker_ready(worker, p.WorkerInfo(worker.decode(), "tiny", credits, version), now)


def body(sent: Sent, side: int, peer: bytes, command: bytes) -> Any:
    """The body sent to ``peer`` with ``command`` in one drain (None if nothing was)."""
    found = [b for s, i, c, b in sent if (s, i, c) == (side, peer, command)]
    assert len(found) <= 1, "the outbox coalesces one message per peer and command"
    return found[0] if found else None


def assigned(sent: Sent, worker: bytes) -> list[p.Assignment]:
    return body(sent, WORKER, worker, p.JOBS) or []


def assigned_ids(sent: Sent, worker: bytes) -> list[str]:
    return [a.job.job_id for a in assigned(sent, worker)]


def finish(s: Scheduler, worker: bytes, assignments: list[p.Assignment], now: float = 1.0) -> None:
    results = [p.Result(a.ticket, [1], [p.Sample(0, [2], [-0.5], "stop")], 0, worker.decode()) for a in assignments]
    s.worker_final(worker, results, now)


def commands(sent: Sent, peer: bytes) -> set[bytes]:
    return {c for _, i, c, _ in sent if i == peer}


# -- dispatch -----------------------------------------------------------------------------
def test_submit_without_workers_queues_and_accepts() -> None:
    s = make()
    s.submit(A, jobs("a", 3), now=0.0)
    sent = s.outbox.take()
    assert sent == [(CLIENT, A, p.ACCEPTED, ["a0", "a1", "a2"])]
    assert s.num_queued == 3
    assert s.stats.submitted == 3


def test_dispatch_only_to_workers_with_free_credits() -> None:
    s = make()
    ready(s, W1, 1)
    ready(s, W2, 0)
    s.submit(A, jobs("a", 3), now=0.0)
    sent = s.outbox.take()
    assert assigned_ids(sent, W1) == ["a0"]
    assert assigned(sent, W2) == []
    assert s.num_queued == 2
    finish(s, W1, assigned(sent, W1))
    sent = s.outbox.take()
    assert assigned_ids(sent, W1) == ["a1"]
    assert assigned(sent, W2) == []


def test_credit_update_opens_a_worker() -> None:
    s = make()
    ready(s, W1, 0)
    s.submit(A, jobs("a", 2), now=0.0)
    s.outbox.take()
    s.worker_credit(W1, 2, now=1.0)
    assert assigned_ids(s.outbox.take(), W1) == ["a0", "a1"]


def test_least_loaded_worker_first() -> None:
    s = make()
    ready(s, W1, 4)
    ready(s, W2, 4)
    s.submit(A, jobs("a", 4), now=0.0)
    sent = s.outbox.take()
    assert len(assigned(sent, W1)) == 2
    assert len(assigned(sent, W2)) == 2


def test_jobs_that_finish_before_the_next_arrives_take_turns_over_idle_workers() -> None:
    """Between equally loaded workers the one idle longest gets the job: on a fast fleet, where
    each job ends before the next comes, work spreads instead of all going to one worker."""
    s = make()
    ready(s, W1, 4)
    ready(s, W2, 4)
    got = []
    for i in range(6):
        s.submit(A, jobs(f"j{i}", 1), now=float(i))
        sent = s.outbox.take()
        (worker,) = [w for w in (W1, W2) if assigned(sent, w)]
        got.append(worker)
        finish(s, worker, assigned(sent, worker), now=i + 0.5)
    assert got == [W1, W2] * 3


def test_new_worker_takes_work_before_a_loaded_one() -> None:
    s = make()
    ready(s, W1, 4)
    s.submit(A, jobs("a", 3), now=0.0)
    s.outbox.take()
    ready(s, W2, 4)
    s.submit(A, jobs("b", 2), now=1.0)
    sent = s.outbox.take()
    # W1 is at 3/4; W2 at 0/4 takes both (after the first it is at 1/4, still less loaded).
    assert assigned_ids(sent, W2) == ["b0", "b1"]
    assert assigned(sent, W1) == []


def test_cost_is_n_credits() -> None:
    s = make()
    ready(s, W1, 4)
    s.submit(A, [job("a0", n=3), job("a1", n=2)], now=0.0)
    sent = s.outbox.take()
    assert assigned_ids(sent, W1) == ["a0"]
    assert s.workers[W1].credits_used == 3
    assert s.workers[W1].credits_free == 1
    # A job that fits in the one credit left still goes (another client's, A's head is blocked).
    s.submit(B, [job("b0", n=1)], now=0.0)
    assert assigned_ids(s.outbox.take(), W1) == ["b0"]
    assert s.workers[W1].credits_free == 0
    assert s.num_queued == 1


def test_job_larger_than_capacity_runs_alone_on_an_idle_worker() -> None:
    s = make()
    ready(s, W1, 2)
    s.submit(A, [job("small", n=1), job("big", n=5), job("after", n=1)], now=0.0)
    sent = s.outbox.take()
    assert assigned_ids(sent, W1) == ["small"]  # "big" waits until the worker is idle
    finish(s, W1, assigned(sent, W1))
    sent = s.outbox.take()
    assert assigned_ids(sent, W1) == ["big"]
    assert s.workers[W1].credits_used == 5
    assert s.num_queued == 1  # nothing joins an over-committed worker
    finish(s, W1, assigned(sent, W1))
    assert assigned_ids(s.outbox.take(), W1) == ["after"]


def test_fair_sharing_interleaves_a_later_client() -> None:
    s = make()
    ready(s, W1, 1)
    s.submit(A, jobs("a", 100), now=0.0)
    order = [a.job.job_id for a in assigned(s.outbox.take(), W1)]
    s.submit(B, jobs("b", 10), now=0.5)
    running = [*s.workers[W1].running.values()]
    for _ in range(25):
        ticket = running[0].ticket
        s.worker_final(W1, [p.Result(ticket, [1], [], 0, "w")], now=1.0)
        new = assigned(s.outbox.take(), W1)
        order += [a.job.job_id for a in new]
        running = [*s.workers[W1].running.values()]
    b_positions = [i for i, jid in enumerate(order) if jid.startswith("b")]
    assert len(b_positions) == 10
    # One job per client in turn: B's ten jobs alternate with A's, not after A's hundred.
    assert b_positions == list(range(2, 22, 2))


def test_outbox_coalesces_one_jobs_message_per_worker() -> None:
    s = make()
    ready(s, W1, 64)
    s.submit(A, jobs("a", 64), now=0.0)
    sent = s.outbox.take()
    assert [(side, peer, cmd) for side, peer, cmd, _ in sent] == [
        (WORKER, W1, p.JOBS),  # workers first: their work starts sooner
        (CLIENT, A, p.ACCEPTED),
    ]
    assert len(assigned(sent, W1)) == 64
    assert len({a.ticket for a in assigned(sent, W1)}) == 64


# -- bounds and duplicates ----------------------------------------------------------------
def test_per_client_queue_bound_answers_busy() -> None:
    s = make(max_queue_per_client=3)
    s.submit(A, jobs("a", 5), now=0.0)
    sent = s.outbox.take()
    assert body(sent, CLIENT, A, p.ACCEPTED) == ["a0", "a1", "a2"]
    busy = body(sent, CLIENT, A, p.BUSY)
    assert [e.key for e in busy] == ["a3", "a4"]
    assert {e.code for e in busy} == {"busy"}
    assert "max_queue_per_client" in busy[0].message
    assert s.stats.rejected_busy == 2
    # The bound is per client: B still gets in.
    s.submit(B, jobs("b", 3), now=0.0)
    assert body(s.outbox.take(), CLIENT, B, p.ACCEPTED) == ["b0", "b1", "b2"]


def test_global_queue_bound_answers_busy() -> None:
    s = make(max_queue_total=4)
    s.submit(A, jobs("a", 3), now=0.0)
    s.submit(B, jobs("b", 3), now=0.0)
    sent = s.outbox.take()
    assert body(sent, CLIENT, B, p.ACCEPTED) == ["b0"]
    assert [e.key for e in body(sent, CLIENT, B, p.BUSY)] == ["b1", "b2"]
    assert s.stats.rejected_busy == 2
    assert s.num_queued == 4


def test_dispatched_jobs_leave_room_in_the_queue() -> None:
    s = make(max_queue_per_client=2)
    ready(s, W1, 2)
    s.submit(A, jobs("a", 2), now=0.0)  # both dispatched at once
    s.submit(A, jobs("b", 2), now=0.0)  # so two more fit in the queue
    s.submit(A, jobs("c", 1), now=0.0)  # and then it is full
    sent = s.outbox.take()
    assert body(sent, CLIENT, A, p.ACCEPTED) == ["a0", "a1", "b0", "b1"]
    assert [e.key for e in body(sent, CLIENT, A, p.BUSY)] == ["c0"]


def test_duplicate_job_id_is_an_error() -> None:
    s = make()
    ready(s, W1, 1)
    s.submit(A, [job("x"), job("y")], now=0.0)  # x runs, y is queued
    s.outbox.take()
    s.submit(A, [job("x"), job("y"), job("z")], now=0.0)
    sent = s.outbox.take()
    errors = body(sent, CLIENT, A, p.ERROR)
    assert [(e.key, e.code) for e in errors] == [("x", "invalid_request"), ("y", "invalid_request")]
    assert "already in flight" in errors[0].message
    assert body(sent, CLIENT, A, p.ACCEPTED) == ["z"]
    assert s.stats.rejected_invalid == 2
    # Job ids are per client.
    s.submit(B, [job("x")], now=0.0)
    assert body(s.outbox.take(), CLIENT, B, p.ACCEPTED) == ["x"]


def test_an_id_twice_in_one_submit_is_queued_once_and_refused_once() -> None:
    """A SUBMIT whose own ids repeat is not queued as a block: the first of them is queued, the
    second refused, the others in the message queued in order."""
    s = make()
    ready(s, W1, 8)
    s.submit(A, [job("a"), job("b"), job("a", ack=False), job("c")], now=0.0)
    sent = s.outbox.take()
    assert [(e.key, e.code) for e in body(sent, CLIENT, A, p.ERROR)] == [("a", "invalid_request")]
    assert body(sent, CLIENT, A, p.ACCEPTED) == ["a", "b", "c"]
    assert assigned_ids(sent, W1) == ["a", "b", "c"]
    assert s.stats.submitted == 3 and s.stats.rejected_invalid == 1


def test_a_submit_queued_as_a_block_keeps_its_order_and_acknowledges_whom_it_asks() -> None:
    s = make()
    s.submit(A, [job("a0"), job("a1", ack=False), job("a2")], now=0.0)
    assert body(s.outbox.take(), CLIENT, A, p.ACCEPTED) == ["a0", "a2"]
    assert [j.spec.job_id for j in s.clients[A].queue] == ["a0", "a1", "a2"]
    assert list(s.clients[A].queued) == ["a0", "a1", "a2"] and s.num_queued == 3
    ready(s, W1, 8)
    assert assigned_ids(s.outbox.take(), W1) == ["a0", "a1", "a2"]


# -- cancel and departures ----------------------------------------------------------------
def test_cancel_queued_job_is_never_dispatched() -> None:
    s = make()
    s.submit(A, jobs("a", 2), now=0.0)
    s.outbox.take()
    s.cancel(A, ["a0"], now=0.1)
    sent = s.outbox.take()
    (err,) = body(sent, CLIENT, A, p.ERROR)
    assert (err.key, err.code) == ("a0", "cancelled")
    assert s.num_queued == 1
    assert s.stats.cancelled == 1
    ready(s, W1, 4)
    assert assigned_ids(s.outbox.take(), W1) == ["a1"]


def test_cancel_running_job_aborts_it_on_its_worker() -> None:
    s = make()
    ready(s, W1, 2)
    s.submit(A, jobs("a", 1), now=0.0)
    (assignment,) = assigned(s.outbox.take(), W1)
    s.cancel(A, ["a0"], now=0.1)
    sent = s.outbox.take()
    assert body(sent, WORKER, W1, p.CANCEL) == [assignment.ticket]
    assert [(e.key, e.code) for e in body(sent, CLIENT, A, p.ERROR)] == [("a0", "cancelled")]
    assert s.workers[W1].credits_used == 0
    assert s.workers[W1].running == {}
    # Its result, if the worker had already sent it, is dropped: the client had its one answer.
    finish(s, W1, [assignment])
    assert body(s.outbox.take(), CLIENT, A, p.FINAL) is None
    assert s.stats.late_replies == 1
    assert s.stats.completed == 0


def test_cancel_running_job_dispatches_into_the_freed_credits() -> None:
    s = make()
    ready(s, W1, 1)
    s.submit(A, jobs("a", 1), now=0.0)
    s.submit(B, jobs("b", 1), now=0.0)  # waits for W1's only credit
    s.outbox.take()
    s.cancel(A, ["a0"], now=0.1)
    # Nothing else will happen on this idle worker: the cancel itself must dispatch b0.
    assert assigned_ids(s.outbox.take(), W1) == ["b0"]


def test_cancel_unknown_job_sends_nothing() -> None:
    s = make()
    s.cancel(A, ["nope"], now=0.0)
    assert s.outbox.take() == []
    assert s.stats.cancelled == 0


def test_client_gone_drops_queue_and_cancels_running() -> None:
    s = make()
    ready(s, W1, 1)
    s.submit(A, jobs("a", 3), now=0.0)
    (assignment,) = assigned(s.outbox.take(), W1)
    s.client_gone(A, "client disconnected", 1.0)
    sent = s.outbox.take()
    assert body(sent, WORKER, W1, p.CANCEL) == [assignment.ticket]
    assert commands(sent, A) == set()  # nobody to tell
    assert A not in s.clients
    assert s.num_queued == 0
    assert s.workers[W1].credits_used == 0
    assert s.stats.dropped_client_gone == 3
    # Nothing of A's is dispatched later.
    s.submit(B, jobs("b", 2), now=1.0)
    sent = s.outbox.take()
    assert assigned_ids(sent, W1) == ["b0"]


def test_client_gone_dispatches_other_clients_into_the_freed_credits() -> None:
    s = make()
    ready(s, W1, 1)
    s.submit(A, jobs("a", 1), now=0.0)
    s.submit(B, jobs("b", 1), now=0.0)
    s.outbox.take()
    s.client_gone(A, "client disconnected", 1.0)
    assert assigned_ids(s.outbox.take(), W1) == ["b0"]


def test_silent_client_expires_on_tick() -> None:
    s = make(client_expiry_s=10.0)
    s.submit(A, jobs("a", 2), now=0.0)
    s.client_seen(B, now=5.0)
    s.tick(9.0)
    assert A in s.clients
    s.tick(10.5)
    assert A not in s.clients
    assert B in s.clients
    assert s.num_queued == 0
    assert s.stats.dropped_client_gone == 2


# -- workers: expiry, requeue, failures ---------------------------------------------------
def test_tick_sends_heartbeats_to_workers() -> None:
    s = make()
    ready(s, W1, 1)
    ready(s, W2, 1)
    s.client_seen(A, now=0.0)  # clients get no heartbeat from tick
    s.tick(0.5)
    sent = s.outbox.take()
    assert {(side, peer) for side, peer, cmd, _ in sent if cmd == p.HEARTBEAT} == {
        (WORKER, W1),
        (WORKER, W2),
    }


def test_tick_sends_no_heartbeat_to_a_worker_sent_jobs_within_the_interval() -> None:
    s = make(heartbeat_interval_s=1.0)
    ready(s, W1, 4)
    ready(s, W2, 4)
    s.outbox.take()

    def beats(now: float) -> set[bytes]:
        s.tick(now)
        return {peer for side, peer, cmd, _ in s.outbox.take() if cmd == p.HEARTBEAT and side == WORKER}

    assert beats(0.5) == {W1, W2}
    s.submit(A, jobs("a", 1), now=0.6)  # one job: the least loaded worker, W1 (idle longest: a tie)
    (target,) = {peer for side, peer, cmd, _ in s.outbox.take() if cmd == p.JOBS}
    other = W2 if target == W1 else W1
    assert beats(1.5) == {other}  # JOBS 0.9 s ago: that told it the broker lives
    assert beats(1.6) == {target, other}  # a full interval since its JOBS: it gets one again
    s.submit(A, jobs("b", 1), now=2.0)
    s.outbox.take()
    assert len(beats(2.9)) == 1
    assert beats(3.0) == {W1, W2}  # exactly one interval since its JOBS: beaten again (never two skipped)


def test_expired_worker_jobs_are_requeued_at_the_front_and_late_final_is_dropped() -> None:
    s = make(heartbeat_interval_s=1.0, worker_liveness=3)  # expiry after 3 s of silence
    ready(s, W1, 2, now=0.0)
    s.submit(A, jobs("a", 3), now=0.0)
    old = assigned(s.outbox.take(), W1)
    assert [a.job.job_id for a in old] == ["a0", "a1"]
    s.tick(2.9)
    assert W1 in s.workers
    s.outbox.take()

    s.tick(3.5)
    sent = s.outbox.take()
    assert (WORKER, W1, p.DISCONNECT) in [(side, peer, cmd) for side, peer, cmd, _ in sent]
    assert (WORKER, W1, p.HEARTBEAT) not in [(side, peer, cmd) for side, peer, cmd, _ in sent]
    assert W1 not in s.workers
    assert s.stats.workers_expired == 1
    assert s.stats.requeued == 2
    assert s.num_queued == 3

    ready(s, W2, 8, now=3.6)
    new = assigned(s.outbox.take(), W2)
    assert [a.job.job_id for a in new] == ["a0", "a1", "a2"]  # requeued ahead of a2, in order
    assert {a.ticket for a in new}.isdisjoint({a.ticket for a in old})

    # The expired worker's late FINAL under an old ticket: dropped, and it is told to reconnect.
    finish(s, W1, old, now=3.7)
    sent = s.outbox.take()
    assert body(sent, CLIENT, A, p.FINAL) is None
    assert (WORKER, W1, p.DISCONNECT) in [(side, peer, cmd) for side, peer, cmd, _ in sent]
    assert s.stats.unknown_worker_messages == 1

    finish(s, W2, new, now=3.8)
    finals = body(s.outbox.take(), CLIENT, A, p.FINAL)
    assert sorted(r.key for r in finals) == ["a0", "a1", "a2"]  # exactly one each
    assert s.stats.completed == 3


def test_job_fails_after_max_attempts() -> None:
    s = make(heartbeat_interval_s=1.0, worker_liveness=1, max_attempts=2)
    ready(s, W1, 1, now=0.0)
    s.submit(A, jobs("a", 1), now=0.0)
    s.tick(2.0)  # W1 expires: attempt 1 lost, requeued
    assert s.num_queued == 1
    ready(s, W2, 1, now=2.0)
    assert assigned_ids(s.outbox.take(), W2) == ["a0"]
    s.tick(4.0)  # W2 expires: attempt 2 lost, that is max_attempts
    sent = s.outbox.take()
    (err,) = body(sent, CLIENT, A, p.ERROR)
    assert (err.key, err.code) == ("a0", "job_failed")
    assert "max_attempts" in err.message
    assert s.num_queued == 0
    assert s.clients[A].running == {}
    assert s.stats.failed == 1
    assert s.stats.requeued == 1


def test_worker_disconnect_requeues_immediately() -> None:
    s = make()
    ready(s, W1, 1)
    ready(s, W2, 0)
    s.submit(A, jobs("a", 1), now=0.0)
    s.outbox.take()
    s.worker_gone(W1, "worker left", now=0.5)
    s.worker_credit(W2, 1, now=0.6)
    assert assigned_ids(s.outbox.take(), W2) == ["a0"]
    assert s.stats.requeued == 1


def test_unknown_worker_is_told_to_disconnect() -> None:
    s = make()
    for event in (
        lambda: s.worker_final(W1, [p.Result(1, [1], [], 0, "w")], 0.0),
        lambda: s.worker_partial(W1, [p.Delta(1, 0, [1], [0.0])], 0.0),
        lambda: s.worker_error(W1, [p.ErrorItem(1, "internal", "x")], 0.0),
        lambda: s.worker_credit(W1, 5, 0.0),
        lambda: s.worker_seen(W1, 0.0),
    ):
        event()
        assert s.outbox.take() == [(WORKER, W1, p.DISCONNECT, None)]
    assert s.stats.unknown_worker_messages == 5
    assert W1 not in s.workers


def test_min_weight_version_never_dispatches_to_an_older_worker() -> None:
    s = make()
    ready(s, W1, 4, version=1)
    s.submit(A, [job("new", min_weight_version=2)], now=0.0)
    s.submit(B, [job("any")], now=0.0)
    sent = s.outbox.take()
    assert assigned_ids(sent, W1) == ["any"]  # A waits without blocking B
    assert s.num_queued == 1
    ready(s, W2, 4, version=2)
    assert assigned_ids(s.outbox.take(), W2) == ["new"]


def test_weight_version_update_on_ready_unblocks_jobs() -> None:
    s = make()
    ready(s, W1, 4, version=1)
    s.submit(A, [job("new", min_weight_version=2)], now=0.0)
    assert assigned(s.outbox.take(), W1) == []
    ready(s, W1, 4, version=2)  # re-READY after a weight update
    assert assigned_ids(s.outbox.take(), W1) == ["new"]


def test_worker_error_is_forwarded_with_the_job_id() -> None:
    s = make()
    ready(s, W1, 1)
    s.submit(A, jobs("a", 2), now=0.0)
    (assignment,) = assigned(s.outbox.take(), W1)
    s.worker_error(W1, [p.ErrorItem(assignment.ticket, "invalid_request", "prompt too long")], now=1.0)
    sent = s.outbox.take()
    (err,) = body(sent, CLIENT, A, p.ERROR)
    assert (err.key, err.code, err.message) == ("a0", "invalid_request", "prompt too long")
    assert s.stats.failed == 1
    assert assigned_ids(sent, W1) == ["a1"]  # its credit went to the next job


def test_partials_are_forwarded_with_the_job_id() -> None:
    s = make()
    ready(s, W1, 1)
    s.submit(A, [job("a0", stream=True)], now=0.0)
    (assignment,) = assigned(s.outbox.take(), W1)
    s.worker_partial(W1, [p.Delta(assignment.ticket, 0, [5, 6], [-0.5, -0.25])], now=0.5)
    assert body(s.outbox.take(), CLIENT, A, p.PARTIAL) == [p.Delta("a0", 0, [5, 6], [-0.5, -0.25])]
    s.worker_partial(W1, [p.Delta(assignment.ticket + 100, 0, [1], [0.0])], now=0.5)
    assert s.outbox.take() == []
    assert s.stats.late_replies == 1


def test_final_is_forwarded_with_the_job_id_and_counted() -> None:
    s = make()
    ready(s, W1, 1)
    s.submit(A, jobs("a", 1), now=0.0)
    (assignment,) = assigned(s.outbox.take(), W1)
    s.worker_final(
        W1,
        [p.Result(assignment.ticket, [1, 2], [p.Sample(0, [3], [-1.0], "stop")], 4, "w1")],
        now=0.3,
    )
    (result,) = body(s.outbox.take(), CLIENT, A, p.FINAL)
    assert result == p.Result("a0", [1, 2], [p.Sample(0, [3], [-1.0], "stop")], 4, "w1")
    assert s.stats.completed == 1
    assert s.stats.job_latency.count == 1
    assert abs(s.stats.job_latency.total - 0.3) < 1e-9
    assert s.clients[A].running == {}


def test_waits_and_latencies_observed_per_block_are_each_jobs() -> None:
    """Queue waits and latencies are observed once per block of jobs submitted together: the
    histograms hold what one observation per job gives (count, sum, buckets)."""
    s = make()
    s.submit(A, jobs("a", 3), now=0.0)
    s.submit(A, [job("late-1"), job("late-2")], now=0.5)
    s.submit(B, [job("b0")], now=0.25)
    ready(s, W1, 8, now=1.0)  # all six dispatched in one pass at 1.0
    sent = assigned(s.outbox.take(), W1)
    assert len(sent) == 6
    wait = s.stats.queue_wait
    assert wait.count == 6
    assert wait.total == pytest.approx(3 * 1.0 + 2 * 0.5 + 0.75)
    expected = [0] * len(wait.counts)
    for value, times in ((1.0, 3), (0.5, 2), (0.75, 1)):
        expected[sum(b < value for b in wait.buckets)] += times
    assert wait.counts == expected
    results = [p.Result(a.ticket, [1], [p.Sample(0, [2], [0.0], "stop")], 0, "w1") for a in sent]
    s.worker_final(W1, results, now=2.0)
    latency = s.stats.job_latency
    assert latency.count == 6
    assert latency.total == pytest.approx(3 * 2.0 + 2 * 1.5 + 1.75)
    assert s.workers[W1].credits_used == 0
    s.submit(A, jobs("again", 8), now=3.0)  # the worker is back on the heap with all its credits
    assert len(assigned(s.outbox.take(), W1)) == 8


# -- status -------------------------------------------------------------------------------
def test_status_numbers() -> None:
    s = make()
    ready(s, W1, 2, version=3, now=0.0)
    s.submit(A, jobs("a", 5), now=0.0)
    s.submit(B, jobs("b", 1), now=0.0)
    s.outbox.take()
    status = s.status(now=1.5)
    assert (status.queued, status.running) == (4, 2)
    (worker,) = status.workers
    assert (
        worker.name,
        worker.state,
        worker.model,
        worker.credits,
        worker.running,
        worker.weight_version,
    ) == ("worker-1", "ready", "tiny", 2, 2, 3)
    assert worker.idle_s == 1.5
    assert {c.name: (c.queued, c.running) for c in status.clients} == {
        "client-a": (3, 2),
        "client-b": (1, 0),
    }


def test_status_names_unprintable_identities_in_hex() -> None:
    s = make()
    s.client_seen(b"\x00\x8f\x01", now=0.0)
    assert [c.name for c in s.status(0.0).clients] == ["008f01"]


def test_outbox_keeps_order_per_peer_and_merges_runs() -> None:
    from zmq_rollout.broker.outbox import Outbox

    box = Outbox()
    box.to_client(b"c", p.FINAL, "A-final")
    box.to_client(b"c", p.PARTIAL, "B-delta")
    box.to_client(b"c", p.FINAL, "B-final")
    box.to_client(b"c", p.FINAL, "C-final")
    box.to_worker(b"w", p.JOBS, "job-7")
    box.to_worker(b"w", p.CANCEL, 7)
    box.to_worker(b"w", p.HEARTBEAT, None)
    box.to_worker(b"w", p.HEARTBEAT, None)
    sent = [(side, ident, cmd, body) for side, ident, cmd, body in box.take()]
    assert [(cmd, body) for _, ident, cmd, body in sent if ident == b"c"] == [
        (p.FINAL, ["A-final"]),
        (p.PARTIAL, ["B-delta"]),
        (p.FINAL, ["B-final", "C-final"]),
    ]
    assert [(cmd, body) for _, ident, cmd, body in sent if ident == b"w"] == [
        (p.JOBS, ["job-7"]),
        (p.CANCEL, [7]),
        (p.HEARTBEAT, None),
    ]
    assert len(box) == 0


def test_outbox_items_to_hands_the_open_list_or_starts_one_after_another_command() -> None:
    from zmq_rollout.broker.outbox import CLIENT, Outbox

    box = Outbox()
    finals = box.items_to(CLIENT, b"c", p.FINAL)
    finals.append("A-final")
    assert box.items_to(CLIENT, b"c", p.FINAL) is finals  # still the last segment
    box.to_client(b"c", p.ERROR, "B-error")
    later = box.items_to(CLIENT, b"c", p.FINAL)
    assert later is not finals
    later.append("C-final")
    assert [(cmd, body) for _, _, cmd, body in box.take()] == [
        (p.FINAL, ["A-final"]),
        (p.ERROR, ["B-error"]),
        (p.FINAL, ["C-final"]),
    ]


def test_partial_then_final_of_one_job_reach_the_client_in_order() -> None:
    s = Scheduler(BrokerConfig())
    s.worker_ready(W1, p.WorkerInfo("w1", "m", 4), 0.0)
    s.submit(A, [p.JobSpec("j1", prompt="x", stream=True), p.JobSpec("j2", prompt="y", stream=True)], 0.0)
    tickets = {a.job.job_id: a.ticket for _, ident, cmd, body in s.outbox.take() if cmd == p.JOBS for a in body}
    s.worker_final(W1, [p.Result(tickets["j1"], [1], [], 0, "w1")], 1.0)
    s.worker_partial(W1, [p.Delta(tickets["j2"], 0, [5], [-0.1])], 1.0)
    s.worker_final(W1, [p.Result(tickets["j2"], [1], [], 0, "w1")], 1.0)
    to_a = [(cmd, [x.key for x in body]) for _, ident, cmd, body in s.outbox.take() if ident == A]
    assert to_a == [(p.FINAL, ["j1"]), (p.PARTIAL, ["j2"]), (p.FINAL, ["j2"])]


def test_time_the_broker_itself_stalled_is_not_a_peer_silence() -> None:
    s = make(heartbeat_interval_s=1.0, worker_liveness=3, client_expiry_s=10.0)
    s.worker_ready(W1, p.WorkerInfo("w1", "m", 4), 0.0)
    s.client_seen(A, 0.0)
    s.excuse(20.0)  # the broker got no CPU for 20 s
    s.tick(21.0)
    assert W1 in s.workers and A in s.clients
    s.tick(24.0)  # 4 s of real silence after the stall
    assert W1 not in s.workers


def test_a_resubmitted_job_already_here_is_acknowledged_once_a_plain_duplicate_refused() -> None:
    s = make()
    s.submit(A, [p.JobSpec("a0", prompt="x")], now=0.0)
    s.outbox.take()
    s.submit(A, [p.JobSpec("a0", prompt="x", resubmitted=True), p.JobSpec("a1", prompt="y", resubmitted=True)], 1.0)
    assert body(s.outbox.take(), CLIENT, A, p.ACCEPTED) == ["a0", "a1"]
    assert s.num_queued == 2 and s.stats.submitted == 2  # a0 once
    s.submit(A, [p.JobSpec("a0", prompt="x")], now=2.0)
    (err,) = body(s.outbox.take(), CLIENT, A, p.ERROR)
    assert err.code == "invalid_request" and "already in flight" in err.message


def test_a_resubmitted_job_this_broker_already_answered_is_not_run_again() -> None:
    """Sent while the old broker was down, a job reaches the new one as a plain submission and
    finishes before the client, seeing the new epoch, sends it again: acknowledged, not run
    twice. The memory lasts the client's first client_expiry_s (resubmissions come at once)."""
    s = make(client_expiry_s=10.0)
    ready(s, W1, 4)
    s.submit(A, [job("a0")], now=0.0)
    finish(s, W1, assigned(s.outbox.take(), W1), now=0.5)
    assert body(s.outbox.take(), CLIENT, A, p.FINAL) is not None
    s.submit(A, [job("a0", resubmitted=True), job("a1", resubmitted=True)], now=1.0)
    sent = s.outbox.take()
    assert body(sent, CLIENT, A, p.ACCEPTED) == ["a0", "a1"]
    assert assigned_ids(sent, W1) == ["a1"] and s.stats.submitted == 2
    finish(s, W1, assigned(sent, W1), now=1.5)
    s.worker_seen(W1, 10.0)
    s.tick(10.5)  # the session is older than client_expiry_s: nothing is remembered any more
    s.submit(A, [job("a1", resubmitted=True)], now=10.6)
    assert assigned_ids(s.outbox.take(), W1) == ["a1"]


def test_answers_after_a_lookup_are_seen_by_the_next_resubmission() -> None:
    """The answered ids are a list indexed into a set at a lookup (``AnsweredIds``): a job
    answered after one resubmission's lookup is still found by the next resubmission."""
    s = make(client_expiry_s=10.0)
    ready(s, W1, 4)
    s.submit(A, [job("a0"), job("a1")], now=0.0)
    running = assigned(s.outbox.take(), W1)
    finish(s, W1, running[:1], now=0.5)
    s.submit(A, [job("a0", resubmitted=True)], now=0.6)  # the first lookup builds the index
    assert body(s.outbox.take(), CLIENT, A, p.ACCEPTED) == ["a0"] and s.stats.submitted == 2
    finish(s, W1, running[1:], now=0.7)
    s.outbox.take()
    s.submit(A, [job("a1", resubmitted=True), job("a2", resubmitted=True)], now=0.8)
    sent = s.outbox.take()
    assert body(sent, CLIENT, A, p.ACCEPTED) == ["a1", "a2"]
    assert assigned_ids(sent, W1) == ["a2"] and s.stats.submitted == 3


def test_a_final_of_clients_in_turn_answers_each_its_own_in_order() -> None:
    """Dispatched in turn, a worker's FINAL holds clients' results in turn: each client gets
    one FINAL of its own results, in the worker's order, and its jobs leave its running set."""
    s = make()
    s.submit(A, jobs("a", 2), now=0.0)
    s.submit(B, jobs("b", 2), now=0.0)
    s.outbox.take()
    ready(s, W1, 4)
    running = assigned(s.outbox.take(), W1)
    assert [a.job.job_id for a in running] == ["a0", "b0", "a1", "b1"]
    finish(s, W1, running, now=0.5)
    sent = s.outbox.take()
    assert [r.key for r in body(sent, CLIENT, A, p.FINAL)] == ["a0", "a1"]
    assert [r.key for r in body(sent, CLIENT, B, p.FINAL)] == ["b0", "b1"]
    assert [c for side, c, command, _ in sent if side == CLIENT and command == p.FINAL] == [A, B]
    assert not s.clients[A].running and not s.clients[B].running and s.stats.completed == 4


def test_the_answered_jobs_remembered_per_client_stop_at_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ids a young client's answered jobs are remembered by (for resubmissions) stop growing
    at MAX_REMEMBERED, whether its results come in one FINAL or in several."""
    monkeypatch.setattr("zmq_rollout.broker.results.MAX_REMEMBERED", 3)
    s = make(client_expiry_s=10.0)
    ready(s, W1, 8)
    s.submit(A, jobs("a", 5), now=0.0)
    running = assigned(s.outbox.take(), W1)
    finish(s, W1, running[:2], now=0.5)
    finish(s, W1, running[2:], now=0.6)
    assert len(body(s.outbox.take(), CLIENT, A, p.FINAL)) == 5
    finished = s.clients[A].finished
    assert finished is not None and finished.ids == ["a0", "a1", "a2"]
    assert "a2" in finished and "a3" not in finished


# -- ACCEPTED on request (JobSpec.ack) ---------------------------------------------------------
def test_only_jobs_that_ask_for_it_are_accepted() -> None:
    s = make()
    ready(s, W1, 4)
    s.submit(A, [job("loud"), job("quiet", ack=False), job("dup", ack=False)], now=0.0)
    sent = s.outbox.take()
    assert body(sent, CLIENT, A, p.ACCEPTED) == ["loud"]
    assert assigned_ids(sent, W1) == ["loud", "quiet", "dup"]
    s.submit(A, [job("quiet", ack=False, resubmitted=True), job("dup", resubmitted=True)], now=0.1)
    assert body(s.outbox.take(), CLIENT, A, p.ACCEPTED) == ["dup"]  # a known resubmission, asked for
    s.submit(A, [job("q2", ack=False)], now=0.2)
    assert commands(s.outbox.take(), A) == set()  # queued, assigned, and nothing said to the client


def test_a_quiet_streamed_job_that_starts_over_is_still_announced() -> None:
    s = make()
    ready(s, W1, 1)
    s.submit(A, [job("s", stream=True, ack=False)], now=0.0)
    assert commands(s.outbox.take(), A) == set()
    s.worker_gone(W1, "worker left", now=1.0)
    assert body(s.outbox.take(), CLIENT, A, p.ACCEPTED) == ["s"]  # the client's stream restarts


# -- the dispatch heap, kept between passes ----------------------------------------------------
def test_the_dispatch_heap_is_kept_between_passes_and_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch does not rebuild its heap of workers per pass (that cost O(workers) a message:
    277 us per one-job SUBMIT with 1,024 workers); entries pushed as loads change go stale and
    are dropped, and the heap never holds more than about twice the workers."""
    from zmq_rollout.broker import dispatch_heap as module

    built = Counter[str]()
    entry = module.entry

    def counted(w: Any, step: int, blocks: bool = False) -> Any:
        built["entries"] += 1
        return entry(w, step, blocks)

    monkeypatch.setattr(module, "entry", counted)
    s = make()
    workers = 50
    for i in range(workers):
        ready(s, f"w{i}".encode(), 4)
    passes = 2000
    for k in range(passes):  # one job in flight at a time: each pass is one SUBMIT of one job
        s.submit(A, [job(f"j{k}")], now=1.0 + k)
        ((to, assignments),) = [(i, b) for side, i, c, b in s.outbox.take() if side == WORKER and c == p.JOBS]
        finish(s, to, assignments, now=1.5 + k)
        assert len(s._heap.entries) <= 2 * workers + 65
    assert s.stats.completed == passes
    assert built["entries"] <= 4 * passes  # a rebuild per pass would be 50 per pass


def test_stale_heap_entries_never_send_a_job_to_a_full_or_paused_worker() -> None:
    s = make()
    ready(s, W1, 1)
    ready(s, W2, 2)
    s.submit(A, jobs("a", 3), now=0.0)
    sent = s.outbox.take()
    assert sorted(assigned_ids(sent, W1) + assigned_ids(sent, W2)) == ["a0", "a1", "a2"]
    assert s.workers[W1].credits_free == s.workers[W2].credits_free == 0
    s.submit(A, jobs("b", 2), now=0.1)
    held = s.outbox.take()
    assert assigned_ids(held, W1) == assigned_ids(held, W2) == []
    assert s.num_queued == 2  # both full: nothing sent, whatever the heap still holds
    finish(s, W2, assigned(sent, W2), now=0.2)  # W2's two credits free up
    got = s.outbox.take()
    assert assigned_ids(got, W2) == ["b0", "b1"] and assigned_ids(got, W1) == []


# -- packing (packing.py): while the broker is the bottleneck -----------------------------------
def test_packing_fills_a_worker_by_a_step_before_the_next_gets_any() -> None:
    """Least loaded first would give four workers two jobs each; packed in steps of 4, two
    workers take four each and the others none: two JOBS instead of four, and two FINALs."""
    s = make()
    workers = [f"w{i}".encode() for i in range(4)]
    for w in workers:
        ready(s, w, 8)
    s.set_dispatch_step(4)
    s.submit(A, jobs("a", 8), now=0.0)
    sent = s.outbox.take()
    sizes = sorted(len(assigned(sent, w)) for w in workers)
    assert sizes == [0, 0, 4, 4]
    s.submit(A, jobs("b", 4), now=0.1)  # the loaded ones have a whole step in use: an idle one next
    got = s.outbox.take()
    assert sorted(len(assigned(got, w)) for w in workers) == [0, 0, 0, 4]
    assert all(s.workers[w].credits_used <= 8 for w in workers)


def test_a_worker_that_stays_first_takes_job_after_job_without_heap_operations(monkeypatch: Any) -> None:
    """``DispatchHeap.offer_next``: the worker just given a job is weighed against the heap's
    first at the next pick, not pushed and popped again: packing 64 jobs onto one of 8 workers
    pushes nothing per job, and the pass still ends with every worker on the heap."""
    import heapq

    from zmq_rollout.broker import dispatch_heap

    s = make()
    workers = [f"w{i}".encode() for i in range(8)]
    for w in workers:
        ready(s, w, 64)
    s.set_dispatch_step(64)
    s.submit(A, jobs("warm", 1), now=0.0)  # builds the heap
    s.outbox.take()
    pushes: list[Any] = []
    real_push = heapq.heappush
    monkeypatch.setattr(dispatch_heap.heapq, "heappush", lambda h, x: (pushes.append(x), real_push(h, x)))
    s.submit(A, jobs("a", 63), now=0.1)
    sent = s.outbox.take()
    assert [len(assigned(sent, w)) for w in workers] == [63] + [0] * 7  # the warm job's worker, to its step
    assert pushes == []  # the last job filled it: nothing to put back
    s.submit(A, jobs("b", 8), now=0.2)  # the next step goes to one other worker, whole
    sent = s.outbox.take()
    assert [len(assigned(sent, w)) for w in workers] == [0, 8] + [0] * 6
    assert [entry[2] for entry in pushes] == [workers[1]]  # its entry, once, at the end of the pass
    s.submit(A, jobs("c", 4), now=0.3)  # and the heap has it: it takes the next jobs too
    sent = s.outbox.take()
    assert [len(assigned(sent, w)) for w in workers] == [0, 4] + [0] * 6


def test_packing_never_overruns_credits_and_keeps_clients_fair() -> None:
    s = make()
    ready(s, W1, 3)
    ready(s, W2, 3)
    s.set_dispatch_step(16)  # a step above the credits: each worker fills up, the next takes the rest
    s.defer_dispatch = True  # as the socket loop: one dispatch pass after both submissions
    s.submit(A, jobs("a", 6), now=0.0)
    s.submit(B, jobs("b", 6), now=0.0)
    s.flush_dispatch(0.0)
    sent = s.outbox.take()
    ids = assigned_ids(sent, W1) + assigned_ids(sent, W2)
    assert len(ids) == 6 and s.workers[W1].credits_used == s.workers[W2].credits_used == 3
    assert sum(i.startswith("a") for i in ids) == 3  # turns alternate between the two clients
    assert s.num_queued == 6


def test_switching_between_spreading_and_packing_keeps_every_job_and_credit() -> None:
    """The heap is rebuilt on each switch; entries pushed under the old step are never taken
    for current ones, so no job goes to a full worker and none is lost."""
    s = make()
    workers = [f"w{i}".encode() for i in range(3)]
    for w in workers:
        ready(s, w, 4)
    running: dict[bytes, list[p.Assignment]] = {w: [] for w in workers}

    def collect() -> None:
        sent = s.outbox.take()
        for w in workers:
            running[w] += assigned(sent, w)
            assert s.workers[w].credits_used == sum(a.job.sampling.n for a in running[w]) <= 4
        assert s.num_queued == 0 or all(s.workers[w].credits_free == 0 for w in workers)  # no job waits beside a credit

    for k in range(40):
        s.set_dispatch_step(1 if k % 3 else 4)
        s.submit(A, jobs(f"j{k}-", 2), now=float(k))
        collect()
        done = workers[k % 3]  # one worker finishes all it holds; the queue refills it
        finish(s, done, running[done], now=k + 0.5)
        running[done] = []
        collect()
    in_flight = sum(map(len, running.values()))
    assert s.stats.submitted == 80 and s.stats.completed + in_flight + s.num_queued == 80
    assert s.stats.completed > 40


def test_spreading_again_after_packing() -> None:
    s = make()
    ready(s, W1, 8)
    ready(s, W2, 8)
    s.set_dispatch_step(4)
    s.set_dispatch_step(1)
    s.submit(A, jobs("a", 4), now=0.0)
    sent = s.outbox.take()
    assert len(assigned(sent, W1)) == len(assigned(sent, W2)) == 2


def test_queue_wait_and_latency_are_each_jobs_own_over_passes_and_finals_of_interleaved_submissions() -> None:
    """The metrics count per submission, not per job (``state.Submission``): each dispatch pass
    and each FINAL still observe every job's own wait and latency, across clients in turn and
    submissions split over several passes and FINALs, and nothing carries over to the next."""
    s = make()
    submitted_at = {"a0": 0.0, "a1": 0.0, "a2": 0.0, "a3": 0.0, "b0": 0.5, "b1": 0.5, "a9": 1.0}
    s.submit(A, jobs("a", 4), now=0.0)
    s.submit(B, jobs("b", 2), now=0.5)
    s.submit(A, [job("a9")], now=1.0)
    ready(s, W1, 3, now=1.5)  # room for 3 of the 7 jobs: the rest wait for results
    waits, latencies, now = [], [], 1.5
    running = assigned(s.outbox.take(), W1)
    assert {a.job.job_id[0] for a in running} == {"a", "b"}  # the clients in turn
    waits += [now - submitted_at[a.job.job_id] for a in running]
    while running:  # finish two (or the last) at a time; what they free goes out at once
        now += 1.0
        done, running = running[:2], running[2:]
        finish(s, W1, done, now=now)
        latencies += [now - submitted_at[a.job.job_id] for a in done]
        more = assigned(s.outbox.take(), W1)
        waits += [now - submitted_at[a.job.job_id] for a in more]
        running += more
    wait, latency = s.stats.queue_wait, s.stats.job_latency
    assert len(waits) == len(latencies) == 7 and s.stats.completed == 7
    assert wait.count == 7 and wait.total == pytest.approx(sum(waits))
    assert latency.count == 7 and latency.total == pytest.approx(sum(latencies))


def _to_client(sent: Sent, peer: bytes) -> list[tuple[bytes, list[str]]]:
    """What went to ``peer`` in one drain: each message's command and its items' keys."""
    return [
        (cmd, [getattr(item, "key", item) for item in items])
        for side, ident, cmd, items in sent
        if (side, ident) == (CLIENT, peer)
    ]


def test_one_pass_of_finals_from_many_workers_reaches_each_client_as_one_final() -> None:
    """The FINAL list a client's results go into is kept from one worker FINAL to the next until
    the outbox is taken (``Outbox.keep_final``): results read after a take go into the next
    take's message, none into one already sent."""
    s = make()
    ready(s, W1, 2)
    ready(s, W2, 2)
    s.submit(A, jobs("a", 2), now=0.0)
    s.submit(B, jobs("b", 2), now=0.0)
    sent = s.outbox.take()
    on_w1, on_w2 = assigned(sent, W1), assigned(sent, W2)
    assert sorted(a.job.job_id[0] for a in on_w1) == sorted(a.job.job_id[0] for a in on_w2) == ["a", "b"]
    for first in (True, False):  # each worker answers one job of each client per take
        for worker, on in ((W1, on_w1), (W2, on_w2)):
            finish(s, worker, [a for a in on if (a.job.job_id[0] == "a") == (first == (worker == W1))])
        taken = s.outbox.take()
        sent_to = {peer: _to_client(taken, peer) for peer in (A, B)}  # as the server sends it: encoded at once
        if first:
            earlier, earlier_to = taken, sent_to
        for peer in (A, B):
            assert len(sent_to[peer]) == 1 and sent_to[peer][0][0] == p.FINAL and len(sent_to[peer][0][1]) == 1
    assert {peer: _to_client(earlier, peer) for peer in (A, B)} == earlier_to  # nothing added once taken
    assert s.stats.completed == 4 and not s.clients[A].jobs and not s.clients[B].jobs


def _two_jobs_on_two_workers() -> tuple[Scheduler, Sent]:
    """A scheduler whose two workers of one credit each run one of client A's two jobs, and
    what it sent them."""
    s = make()
    ready(s, W1, 1)
    ready(s, W2, 1)
    s.submit(A, jobs("a", 2), now=0.0)
    return s, s.outbox.take()


def test_two_workers_finals_for_one_client_in_one_pass_are_one_message() -> None:
    s, sent = _two_jobs_on_two_workers()
    finish(s, W1, assigned(sent, W1))
    finish(s, W2, assigned(sent, W2))
    assert _to_client(s.outbox.take(), A) == [(p.FINAL, assigned_ids(sent, W1) + assigned_ids(sent, W2))]


def test_a_message_to_a_client_between_two_finals_keeps_its_place() -> None:
    """A result read after something else went to its client goes into a FINAL after that
    message, not into the FINAL list before it (order per peer)."""
    s, sent = _two_jobs_on_two_workers()
    (on_w1,), (on_w2,) = assigned(sent, W1), assigned(sent, W2)
    finish(s, W1, [on_w1])
    s.submit(A, [job(on_w2.job.job_id)], now=1.0)  # still running on W2: refused as a duplicate
    finish(s, W2, [on_w2])
    assert _to_client(s.outbox.take(), A) == [
        (p.FINAL, [on_w1.job.job_id]),
        (p.ERROR, [on_w2.job.job_id]),
        (p.FINAL, [on_w2.job.job_id]),
    ]


def test_a_client_gone_mid_pass_takes_its_kept_final_list_with_it() -> None:
    """A client that goes and comes back between two FINALs of one pass is a new client: its
    new job's result finishes the new state's job, not the old state's (``forget_final``)."""
    s = make()
    ready(s, W1, 1)
    s.submit(A, [job("a0")], now=0.0)
    (first,) = assigned(s.outbox.take(), W1)
    finish(s, W1, [first])
    s.client_gone(A, "test", now=1.0)
    s.submit(A, [job("a9", ack=False)], now=1.0)  # back at once: nothing sent to it yet
    (ticket,) = s.workers[W1].running  # dispatched at once; the outbox not yet taken
    s.worker_final(W1, [p.Result(ticket, [1], [], 0, "w1")], 1.0)
    assert not s.clients[A].jobs  # a9 answered and forgotten
    assert [ids for cmd, ids in _to_client(s.outbox.take(), A)] == [["a0", "a9"]]
    s.submit(A, [job("a9")], now=2.0)  # so the same id is a new job, not one in flight
    assert body(s.outbox.take(), CLIENT, A, p.ACCEPTED) == ["a9"]
