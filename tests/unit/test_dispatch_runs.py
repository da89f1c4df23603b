"""Dispatch in runs (``Scheduler._run``) assigns exactly what one ``pick`` per job assigns.

The reference below is the dispatch before runs: each plain turn picks its worker from the
heap and offers the worker anew. Both schedulers take the same random events (submits of
jobs of several costs and weight versions, results, cancels, credit changes, new weight
versions, sessions) and must send the same messages, in the same order, with the same
tickets, in every heap order (least loaded first, packed, packed keeping blocks whole); and
no JOBS may leave a worker over its credits (but a job larger than them, alone).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from zmq_rollout import protocol as p
from zmq_rollout.broker.outbox import WORKER
from zmq_rollout.broker.scheduler import Scheduler
from zmq_rollout.broker.state import ClientState, WorkerState
from zmq_rollout.config import BrokerConfig


class OnePickPerJob(Scheduler):
    """The reference: a plain turn assigns its head job alone, as ``dispatch`` did before runs."""

    def _run(self, worker: WorkerState, client: ClientState, *rest: Any) -> None:
        _heap, now, jobs_to, taken = rest  # as Scheduler._run's
        job = self._dequeue(client, client.queue.popleft())
        self._assign(worker, client, job, now, jobs_to)
        if not job.submission.taken:
            taken.append(job.submission)
        job.submission.taken += 1
        if client.queue:
            self._waiting.append(client)


def comparable(sent: list[tuple[int, bytes, bytes, Any]]) -> list[tuple[Any, ...]]:
    out = []
    for side, peer, command, body in sent:
        shown = body
        if command == p.JOBS:
            shown = [(a.ticket, a.job.job_id) for a in body]
        elif command == p.FINAL:
            shown = [r.key for r in body]
        out.append((side, peer, command, repr(shown)))
    return out


def drive(s: Scheduler, events: list[tuple[Any, ...]], step: int, blocks: bool = False) -> list[list[tuple[Any, ...]]]:
    """Feed ``events`` to ``s``; what it sent after each, comparable across schedulers."""
    s.defer_dispatch = True
    s.set_dispatch_step(step, blocks)
    log = []
    running: dict[bytes, list[int]] = {}
    for now, event in enumerate(events):
        kind, *args = event
        if kind == "ready":
            worker, credits, version = args
            s.worker_ready(worker, p.WorkerInfo(worker.decode(), "tiny", credits, version), float(now))
        elif kind == "submit":
            client, specs = args
            s.submit(client, specs, float(now))
        elif kind == "finish":
            worker, fraction = args
            tickets = running.get(worker, [])
            done = tickets[: max(1, int(len(tickets) * fraction))] if tickets else []
            running[worker] = tickets[len(done) :]
            results = [p.Result(t, [1], [p.Sample(0, [2], [-0.5], "stop")], 0, worker.decode()) for t in done]
            s.worker_final(worker, results, float(now))
        elif kind == "cancel":
            client, ids = args
            s.cancel(client, ids, float(now))
        elif kind == "credit":
            worker, credits = args
            s.worker_credit(worker, credits, float(now))
        s.flush_dispatch(float(now))
        sent = s.outbox.take()
        for side, peer, command, body in sent:
            if side == WORKER and command == p.JOBS:
                running.setdefault(peer, []).extend(a.ticket for a in body)
                w = s.workers[peer]  # no JOBS overruns credits, but a job larger than them, alone
                assert w.credits_used <= w.credits or len(w.running) == 1, f"event {now}: {peer!r} overrun"
        log.append(comparable(sent))
    return log


def random_events(seed: int) -> list[tuple[Any, ...]]:
    rng = random.Random(seed)
    workers = [f"w{i}".encode() for i in range(rng.randint(1, 9))]
    clients = [f"c{i}".encode() for i in range(rng.randint(1, 6))]
    events: list[tuple[Any, ...]] = [("ready", w, rng.choice([1, 3, 8, 16, 64]), rng.randint(0, 1)) for w in workers]
    ids = 0
    submitted: list[tuple[bytes, str]] = []
    for _ in range(120):
        roll = rng.random()
        if roll < 0.45:
            client = rng.choice(clients)
            specs = []
            for _ in range(rng.choice([1, 2, 5, 64])):
                ids += 1
                fields: dict[str, Any] = {}
                if rng.random() < 0.1:
                    fields["min_weight_version"] = 1
                if rng.random() < 0.05:
                    fields["session_id"] = f"s{rng.randint(0, 3)}"
                n = rng.choice([1, 1, 1, 2, 4])
                specs.append(p.JobSpec(f"j{ids}", p.SamplingParams(n=n), prompt="hi", ack=False, **fields))
                submitted.append((client, f"j{ids}"))
            events.append(("submit", client, specs))
        elif roll < 0.8:
            events.append(("finish", rng.choice(workers), rng.choice([0.1, 0.5, 1.0])))
        elif roll < 0.9 and submitted:
            picked = rng.sample(submitted, min(len(submitted), rng.randint(1, 4)))
            for client, jid in picked:
                events.append(("cancel", client, [jid]))
        elif roll < 0.95:
            events.append(("credit", rng.choice(workers), rng.choice([0, 2, 8, 64])))
        else:
            w = rng.choice(workers)
            events.append(("ready", w, rng.choice([4, 16, 64]), 1))
    return events


@pytest.mark.parametrize(("step", "blocks"), [(1, False), (4, False), (64, False), (4, True), (64, True)])
@pytest.mark.parametrize("seed", range(12))
def test_runs_send_what_one_pick_per_job_sends(seed: int, step: int, blocks: bool) -> None:
    events = random_events(seed)
    expected = drive(OnePickPerJob(BrokerConfig()), events, step, blocks)
    got = drive(Scheduler(BrokerConfig()), events, step, blocks)
    assert sum(len(sent) for sent in expected) > 0
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have == want, f"event {i} ({events[i][0]}) sent differently"


def test_a_run_gives_one_worker_a_step_of_jobs_from_each_client_in_turn() -> None:
    """Packing (step 4): the first worker takes 4 credits, one job per client in turn, before the next."""
    s = Scheduler(BrokerConfig())
    s.set_dispatch_step(4)
    for w in (b"w1", b"w2"):
        s.worker_ready(w, p.WorkerInfo(w.decode(), "tiny", 8, 0), 0.0)
    s.outbox.take()
    s.defer_dispatch = True
    for client in (b"a", b"b"):
        specs = [p.JobSpec(f"{client.decode()}{i}", p.SamplingParams(), prompt="hi", ack=False) for i in range(3)]
        s.submit(client, specs, 0.0)
    s.flush_dispatch(0.0)
    sent = {peer: [a.job.job_id for a in body] for _, peer, command, body in s.outbox.take() if command == p.JOBS}
    first = sent.pop(b"w1") if sent[b"w1"][0] == "a0" else sent.pop(b"w2")
    assert first == ["a0", "b0", "a1", "b1"]
    assert list(sent.values()) == [["a2", "b2"]]
    assert s.num_queued == 0
