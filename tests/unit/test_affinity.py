"""Session affinity (broker/affinity.py): a session's turns go to the worker of its last turn.

Pure tests drive the scheduler event by event with ``now`` given (no socket, no clock): the
same worker across turns, a full worker waited for at most ``affinity_wait_s``, a held turn
never blocking others, worker death, idle expiry, the cap, ``session_end``, affinity off;
then random interleavings checking credits, exactly-once and fairness. One test runs a
broker over loopback with two echo worker doubles.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import zmq

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.broker.outbox import CLIENT, WORKER
from zmq_rollout.broker.salvage import split_submit
from zmq_rollout.broker.scheduler import Scheduler
from zmq_rollout.config import BrokerConfig
from zmq_rollout.errors import ProtocolError

A, B, C = b"client-a", b"client-b", b"client-c"
W1, W2, W3 = b"worker-1", b"worker-2", b"worker-3"

Sent = list[tuple[int, bytes, bytes, Any]]


def make(**config: Any) -> Scheduler:
    return Scheduler(BrokerConfig(**config))


def ready(s: Scheduler, worker: bytes, credits: int, now: float = 0.0) -> None:
    s.worker_ready(worker, p.WorkerInfo(worker.decode(), "tiny", credits), now)


def turn(job_id: str, session: str | None, *, end: bool = False, n: int = 1) -> p.JobSpec:
    return p.JobSpec(job_id, p.SamplingParams(n=n), prompt="hi", session_id=session, session_end=end)


def assignments(sent: Sent) -> dict[bytes, list[p.Assignment]]:
    out: dict[bytes, list[p.Assignment]] = {}
    for side, peer, command, body in sent:
        if side == WORKER and command == p.JOBS:
            out.setdefault(peer, []).extend(body)
    return out


def where(sent: Sent) -> dict[str, bytes]:
    """Job id -> the worker it was sent to."""
    return {a.job.job_id: w for w, assigned in assignments(sent).items() for a in assigned}


def finish(s: Scheduler, worker: bytes, assigned: list[p.Assignment], now: float) -> None:
    results = [p.Result(a.ticket, [1], [p.Sample(0, [2], [-0.5], "stop")], 0, worker.decode()) for a in assigned]
    s.worker_final(worker, results, now)


def finish_all(s: Scheduler, sent: Sent, now: float) -> None:
    for worker, assigned in assignments(sent).items():
        finish(s, worker, assigned, now)


def occupy(s: Scheduler, worker: bytes, now: float) -> p.Assignment:
    """Fill the only credit of ``worker`` with a sessionless job of B (the others take no job
    meanwhile, whatever their load)."""
    others = [w for identity, w in s.workers.items() if identity != worker and w.accepting]
    for w in others:
        w.accepting = False
    s.submit(B, [turn(f"filler-{now}", None)], now)
    for w in others:
        w.accepting = True
    s.workers_changed()  # as a sync round says when it lets workers take jobs again
    ((to, (assignment,)),) = assignments(s.outbox.take()).items()
    assert to == worker
    return assignment


def outcomes(s: Scheduler) -> dict[str, int]:
    return dict(s.stats.sessions.dispatches)


# -- the same worker across turns ---------------------------------------------------------
def test_a_sessions_turns_go_to_the_worker_of_its_last_turn() -> None:
    s = make()
    ready(s, W1, 4)
    ready(s, W2, 4)
    s.submit(A, [turn(f"s{i}-1", f"s{i}") for i in range(4)], 0.0)
    sent = s.outbox.take()
    first = where(sent)
    assert set(first.values()) == {W1, W2}  # first turns: least loaded first, so both workers
    finish_all(s, sent, 0.5)
    s.outbox.take()
    # Each next turn alone, on two idle workers: least loaded first alone would pick one worker for all.
    for k, session in enumerate(["s2", "s0", "s3", "s1"]):
        s.submit(A, [turn(f"{session}-2", session)], 1.0 + k)
        sent = s.outbox.take()
        assert where(sent) == {f"{session}-2": first[f"{session}-1"]}
        finish_all(s, sent, 1.5 + k)
    assert outcomes(s) == {"affine": 4, "moved": 0, "new": 4}
    assert len(s.affinity.sessions) == 4


def test_sessions_are_scoped_to_their_client() -> None:
    s = make()
    ready(s, W1, 1)
    ready(s, W2, 1)
    s.submit(A, [turn("a1", "ep")], 0.0)
    s.submit(B, [turn("b1", "ep")], 0.0)
    sent = s.outbox.take()
    assert {where(sent)["a1"], where(sent)["b1"]} == {W1, W2}
    assert outcomes(s)["new"] == 2  # B's "ep" is not A's
    assert len(s.affinity.sessions) == 2


# -- a full worker: wait at most affinity_wait_s, never blocking others -------------------------
def test_a_full_worker_is_waited_for_then_the_session_moves_to_the_least_loaded() -> None:
    s = make(affinity_wait_s=0.05)
    ready(s, W1, 1)
    ready(s, W2, 1)
    s.submit(A, [turn("t1", "ep")], 0.0)
    sent = s.outbox.take()
    pinned = where(sent)["t1"]
    other = W2 if pinned == W1 else W1
    finish_all(s, sent, 0.1)
    filler = occupy(s, pinned, 0.2)
    assert s.workers[pinned].credits_free == 0
    s.submit(A, [turn("t2", "ep")], 1.0)
    assert where(s.outbox.take()) == {}  # held for its worker although the other is idle
    assert s.num_queued == 1 and s.affinity.num_held == 1
    assert s.wake_at() == pytest.approx(1.05)
    s.wake(1.049)
    assert where(s.outbox.take()) == {}
    s.wake(1.05)  # the wait is over: least loaded, and the session moves there
    assert where(s.outbox.take()) == {"t2": other}
    assert s.affinity.num_held == 0 and s.wake_at() is None
    assert outcomes(s) == {"affine": 0, "moved": 1, "new": 1}
    assert dict(s.stats.sessions.holds) == {"served": 0, "released": 1}
    s.worker_credit(other, 2, 1.1)  # other: 1 of 2 credits used; pinned: idle once the filler ends
    finish(s, pinned, [filler], 1.2)
    s.outbox.take()
    s.submit(A, [turn("t3", "ep")], 2.0)  # the session's worker is now the other (not the least loaded)
    assert where(s.outbox.take()) == {"t3": other}


def test_a_held_turn_gets_its_worker_when_a_credit_frees_within_the_wait() -> None:
    s = make(affinity_wait_s=0.05)
    ready(s, W1, 1)
    ready(s, W2, 1)
    s.submit(A, [turn("t1", "ep")], 0.0)
    sent = s.outbox.take()
    pinned = where(sent)["t1"]
    finish_all(s, sent, 0.1)
    filler = occupy(s, pinned, 0.2)
    s.submit(A, [turn("t2", "ep")], 1.0)
    assert where(s.outbox.take()) == {}
    finish(s, pinned, [filler], 1.03)
    assert where(s.outbox.take()) == {"t2": pinned}
    assert outcomes(s) == {"affine": 1, "moved": 0, "new": 1}
    assert dict(s.stats.sessions.holds) == {"served": 1, "released": 0}
    assert s.wake_at() is None


def test_a_held_turn_does_not_block_the_jobs_behind_it() -> None:
    s = make(affinity_wait_s=0.05)
    ready(s, W2, 3)
    s.submit(A, [turn("x1", "x")], 0.0)
    first = s.outbox.take()
    assert where(first) == {"x1": W2}
    finish_all(s, first, 0.1)
    s.outbox.take()
    ready(s, W1, 1, now=0.15)
    s.submit(A, [turn("x1b", "x"), turn("x1c", "x"), turn("x1d", "x")], 0.2)  # W2 full with x's turns
    busy = s.outbox.take()
    assert where(busy) == {"x1b": W2, "x1c": W2, "x1d": W2}
    s.submit(A, [turn("x2", "x"), turn("plain", None), turn("y1", "y")], 1.0)
    s.submit(B, [turn("b1", None)], 1.0)
    sent = s.outbox.take()
    assert where(sent) == {"plain": W1}  # x2 waits for W2; the job behind it goes on
    assert s.affinity.num_held == 1 and s.num_queued == 3
    finish(s, W1, assignments(sent)[W1], 1.01)
    sent = s.outbox.take()
    assert where(sent) == {"y1": W1}  # A's next job, past its held turn (A's turn came before B's)
    finish(s, W1, assignments(sent)[W1], 1.02)
    assert where(s.outbox.take()) == {"b1": W1}  # then B's: one job per client in turn
    finish(s, W2, assignments(busy)[W2][:1], 1.03)
    assert where(s.outbox.take()) == {"x2": W2}  # its worker has room within the wait
    assert dict(s.stats.sessions.holds) == {"served": 1, "released": 0}


def test_affinity_wait_zero_sends_the_turn_elsewhere_at_once() -> None:
    s = make(affinity_wait_s=0.0)
    ready(s, W1, 1)
    ready(s, W2, 1)
    s.submit(A, [turn("t1", "ep")], 0.0)
    sent = s.outbox.take()
    pinned = where(sent)["t1"]
    finish_all(s, sent, 0.1)
    occupy(s, pinned, 0.2)
    s.submit(A, [turn("t2", "ep")], 1.0)
    assert where(s.outbox.take()) == {"t2": W2 if pinned == W1 else W1}
    assert outcomes(s)["moved"] == 1


def test_held_turns_take_their_clients_turn_not_another_clients() -> None:
    """A's turns are all held for W1 (one credit); B's jobs go anywhere. As W1's credit frees,
    A and B alternate: a held turn is its client's job, sent in that client's turn."""
    s = make(affinity_wait_s=10.0)
    ready(s, W1, 1)
    for i in range(4):  # four sessions of A pinned to W1
        s.submit(A, [turn(f"a{i}", f"s{i}")], 0.0)
        finish_all(s, s.outbox.take(), 0.0)
        s.outbox.take()
    running = occupy(s, W1, 0.0)
    ready(s, W2, 1, now=0.05)
    s.submit(A, [turn(f"a{i}-2", f"s{i % 4}") for i in range(8)], 0.1)
    assert where(s.outbox.take()) == {} and s.affinity.num_held == 8  # W2 is idle, but they wait for W1
    s.submit(B, [turn(f"b{i}", None) for i in range(8)], 0.1)
    assert where(s.outbox.take()) == {"b0": W2}  # B's first job takes W2, which keeps it
    order = []
    for k in range(12):
        finish(s, W1, [running], 0.2 + k * 0.001)
        ((running,),) = assignments(s.outbox.take()).values()
        order.append(running.job.job_id[0])
    assert order == ["a", "b"] * 6


# -- worker death, requeue ---------------------------------------------------------------------
def test_a_dead_workers_sessions_move_on() -> None:
    s = make()
    ready(s, W1, 2)
    ready(s, W2, 2)
    s.submit(A, [turn("t1", "ep")], 0.0)
    sent = s.outbox.take()
    pinned = where(sent)["t1"]
    other = W2 if pinned == W1 else W1
    finish_all(s, sent, 0.1)
    s.worker_gone(pinned, "worker left", 0.5)
    s.outbox.take()
    s.submit(A, [turn("t2", "ep")], 1.0)
    assert where(s.outbox.take()) == {"t2": other}
    assert outcomes(s) == {"affine": 0, "moved": 1, "new": 1}


def test_turns_held_for_a_worker_that_dies_go_elsewhere_at_once() -> None:
    s = make(affinity_wait_s=10.0)
    ready(s, W1, 1)
    ready(s, W2, 1)
    s.submit(A, [turn("t1", "ep")], 0.0)
    sent = s.outbox.take()
    pinned = where(sent)["t1"]
    finish_all(s, sent, 0.1)
    occupy(s, pinned, 0.2)
    s.submit(A, [turn("t2", "ep")], 1.0)
    assert where(s.outbox.take()) == {}
    s.worker_gone(pinned, "heartbeat expired", 1.01)  # long before its 10 s wait is over
    sent = s.outbox.take()
    other = W2 if pinned == W1 else W1
    assert where(sent)["t2"] == other  # and the filler, requeued, waits for a credit
    assert s.affinity.num_held == 0 and s.num_queued == 1
    assert dict(s.stats.sessions.holds) == {"served": 0, "released": 1}


def test_a_requeued_turn_goes_anywhere_without_waiting() -> None:
    """t1 runs on W1; t2 of the same session waited, then moved to W2 (full now); W1 dies:
    t1, requeued, goes to the idle W3 at once, not held for the session's worker W2."""
    s = make(affinity_wait_s=0.05)
    ready(s, W1, 1)
    s.submit(A, [turn("t1", "ep")], 0.0)
    assert where(s.outbox.take()) == {"t1": W1}
    ready(s, W2, 1, now=0.1)
    s.submit(A, [turn("t2", "ep")], 0.2)
    assert where(s.outbox.take()) == {}
    s.wake(0.25)
    assert where(s.outbox.take()) == {"t2": W2}
    ready(s, W3, 1, now=0.3)
    s.worker_gone(W1, "worker left", 0.4)
    assert where(s.outbox.take()) == {"t1": W3}
    assert s.affinity.num_held == 0


# -- records: session_end, idle, the cap ---------------------------------------------------------
def test_session_end_drops_the_record_after_its_affine_turn() -> None:
    s = make()
    ready(s, W1, 2)
    ready(s, W2, 2)
    s.submit(A, [turn("t1", "ep")], 0.0)
    sent = s.outbox.take()
    pinned = where(sent)["t1"]
    finish_all(s, sent, 0.1)
    s.submit(A, [turn("t2", "ep", end=True)], 1.0)
    assert where(s.outbox.take()) == {"t2": pinned}  # the last turn still goes to its worker
    assert len(s.affinity.sessions) == 0
    assert s.stats.sessions.dropped["ended"] == 1
    assert outcomes(s) == {"affine": 1, "moved": 0, "new": 1}
    s.submit(A, [turn("t3", "ep")], 2.0)  # the same id again is a new session
    assert outcomes(s)["new"] == 2


def test_idle_sessions_are_forgotten_on_tick() -> None:
    s = make(session_idle_s=10.0)
    ready(s, W1, 8)
    s.submit(A, [turn("a1", "a"), turn("b1", "b")], 0.0)
    s.submit(A, [turn("a2", "a")], 5.0)  # a's turn at 5 s keeps it
    s.worker_seen(W1, 10.4)
    s.tick(10.5)
    assert list(s.affinity.sessions) == [(A, "a")]
    assert s.stats.sessions.dropped["idle"] == 1
    s.worker_seen(W1, 15.4)
    s.tick(15.5)
    assert len(s.affinity.sessions) == 0
    assert s.stats.sessions.dropped["idle"] == 2


def test_the_number_of_records_is_capped_least_recently_used_first() -> None:
    s = make(max_sessions=3)
    ready(s, W1, 64)
    s.submit(A, [turn(f"s{i}-1", f"s{i}") for i in range(3)], 0.0)
    s.submit(A, [turn("s0-2", "s0")], 1.0)  # s0 is now the most recently used
    s.submit(A, [turn(f"s{i}-1", f"s{i}") for i in range(3, 5)], 2.0)
    assert [sid for _, sid in s.affinity.sessions] == ["s0", "s3", "s4"]
    assert s.stats.sessions.dropped["cap"] == 2
    s.submit(A, [turn(f"x{i}", f"x{i}") for i in range(1000)], 3.0)
    assert len(s.affinity.sessions) == 3


# -- cancel, clients leaving ----------------------------------------------------------------------
def test_a_cancelled_held_turn_is_never_dispatched() -> None:
    s = make(affinity_wait_s=0.05)
    ready(s, W1, 1)
    s.submit(A, [turn("t1", "ep")], 0.0)
    finish_all(s, s.outbox.take(), 0.1)
    filler = occupy(s, W1, 0.2)
    s.submit(A, [turn("t2", "ep")], 1.0)
    s.outbox.take()
    s.cancel(A, ["t2"], 1.01)
    sent = s.outbox.take()
    assert [(e.key, e.code) for e in next(b for _, i, c, b in sent if (i, c) == (A, p.ERROR))] == [("t2", "cancelled")]
    assert s.num_queued == 0
    finish(s, W1, [filler], 1.02)
    assert where(s.outbox.take()) == {}
    s.wake(2.0)
    assert where(s.outbox.take()) == {} and s.affinity.num_held == 0


def test_a_client_that_leaves_leaves_no_held_turns() -> None:
    s = make(affinity_wait_s=0.05)
    ready(s, W1, 1)
    s.submit(A, [turn("t1", "ep")], 0.0)
    finish_all(s, s.outbox.take(), 0.1)
    filler = occupy(s, W1, 0.2)
    s.submit(A, [turn("t2", "ep")], 1.0)
    s.client_gone(A, "client disconnected", 1.01)
    assert s.affinity.num_held == 0 and s.wake_at() is None
    finish(s, W1, [filler], 1.02)
    assert where(s.outbox.take()) == {}


# -- affinity off ---------------------------------------------------------------------------------
def test_affinity_off_dispatches_exactly_as_without_sessions() -> None:
    """Random events twice, with the same seed: jobs with session ids and affinity off, and the
    same jobs without session ids. Every JOBS goes to the same worker in the same order; the
    first run still counts where sessions landed (the benchmark's baseline)."""
    logs = []
    for sessions in (True, False):
        sim = Sim(make(affinity=False, affinity_wait_s=0.05), random.Random(7), sessions=sessions)
        sim.run(1000)
        logs.append(sim.log)
        if sessions:
            counted = outcomes(sim.s)
            assert sum(counted.values()) > 100 and counted["moved"] > 0
    assert logs[0] == logs[1]
    assert len(logs[0]) > 250


# -- random interleavings ---------------------------------------------------------------------------
@dataclass
class Sim:
    """Clients running episodes (a session's next turn after its last one's answer, the last
    with ``session_end``) and sessionless jobs; workers joining, dying, answering (late ones
    too), changing credits; cancels; time passing. ``check`` runs after every event."""

    s: Scheduler
    rng: random.Random
    sessions: bool = True
    now: float = 0.0
    clients: tuple[bytes, ...] = (A, B, C)
    live: dict[bytes, list[int]] = field(default_factory=dict)  # worker -> tickets it runs
    dead: dict[bytes, list[int]] = field(default_factory=dict)
    jobs: dict[str, bytes] = field(default_factory=dict)  # accepted job id -> client
    ended: Counter[str] = field(default_factory=Counter)  # job id -> terminal answers
    tickets: dict[int, str] = field(default_factory=dict)
    episodes: dict[tuple[bytes, int], tuple[str | None, int, str | None]] = field(default_factory=dict)
    """(client, slot) -> its session (None: the next turn starts one), turns so far, last job."""
    log: list[tuple[str, bytes, str]] = field(default_factory=list)
    dispatched: Counter[bytes] = field(default_factory=Counter)  # client -> jobs sent to workers
    serial: int = 0
    packing: bool = False
    """Also switch dispatch between least loaded first and packing (``packing.py``) at random."""

    def run(self, steps: int) -> None:
        for name in (W1, W2):
            self.join(name)
        for _ in range(steps):
            self.step()

    def step(self) -> None:
        rng, s = self.rng, self.s
        self.now += rng.uniform(0.0, 0.03)
        if self.packing and rng.random() < 0.05:
            s.set_dispatch_step(rng.choice((1, 2, 4, 16)))
        event = rng.choices(
            ["turn", "plain", "final", "late", "join", "die", "credit", "cancel", "tick"],
            [30, 10, 40, 2, 2, 2, 3, 3, 2],
        )[0]
        if event == "turn":
            self.next_turn(rng.choice(self.clients), rng.randrange(4))
        elif event == "plain":
            self.submit(rng.choice(self.clients), None, end=False)
        elif event == "final":
            busy = [w for w, tickets in self.live.items() if tickets]
            if busy:
                worker = rng.choice(busy)
                tickets = self.live[worker]
                ticket = tickets.pop(rng.randrange(len(tickets)))
                s.worker_final(worker, [p.Result(ticket, [1], [], 0, worker.decode())], self.now)
        elif event == "late" and any(self.dead.values()):
            worker = rng.choice([w for w, tickets in self.dead.items() if tickets])
            s.worker_final(worker, [p.Result(self.dead[worker].pop(), [1], [], 0, "x")], self.now)
        elif event == "join" and len(self.live) < 4:
            self.join(f"w-{self.serial}".encode())
        elif event == "die" and len(self.live) > 1:
            worker = rng.choice(sorted(self.live))
            self.dead[worker] = self.live.pop(worker)
            s.worker_gone(worker, "worker left", self.now)
        elif event == "credit" and self.live:
            s.worker_credit(rng.choice(sorted(self.live)), rng.randint(0, 4), self.now)
        elif event == "cancel":
            open_jobs = sorted(j for j in self.jobs if not self.ended[j])
            if open_jobs:
                jid = rng.choice(open_jobs)
                s.cancel(self.jobs[jid], [jid], self.now)
        elif event == "tick":
            for worker in self.live:
                s.worker_seen(worker, self.now)
            s.tick(self.now)
        s.wake(self.now)  # as the socket loop does on every pass
        self.check()

    def join(self, name: bytes) -> None:
        self.serial += 1
        self.live[name] = []
        ready(self.s, name, self.rng.randint(1, 4), self.now)

    def next_turn(self, client: bytes, slot: int) -> None:
        """The next turn of the client's episode in ``slot``, once its last has its answer."""
        session, turns, last = self.episodes.get((client, slot), (None, 0, None))
        if last is not None and not self.ended[last]:
            return
        if session is None:
            self.serial += 1
            session, turns = f"ep{self.serial}", 0
        end = turns >= 2 and self.rng.random() < 0.4
        jid = self.submit(client, session, end=end)
        self.episodes[(client, slot)] = (None if end else session, turns + 1, jid)

    def submit(self, client: bytes, session: str | None, *, end: bool) -> str:
        self.serial += 1
        jid = f"{client.decode()}-{self.serial}"
        n = self.rng.choice([1, 1, 1, 2, 3])
        spec = p.JobSpec(
            jid,
            p.SamplingParams(n=n),
            prompt="hi",
            session_id=session if self.sessions else None,
            session_end=end and self.sessions,
        )
        self.jobs[jid] = client
        self.s.submit(client, [spec], self.now)
        return jid

    def check(self) -> None:
        s = self.s
        got_jobs = set()
        for side, peer, command, body in s.outbox.take():
            if side == WORKER and command == p.JOBS:
                got_jobs.add(peer)
                for a in body:
                    self.live[peer].append(a.ticket)
                    self.tickets[a.ticket] = a.job.job_id
                    self.log.append(("jobs", peer, a.job.job_id))
                    self.dispatched[self.jobs[a.job.job_id]] += 1
            elif side == WORKER and command == p.CANCEL:
                for ticket in body:
                    self.live[peer].remove(ticket)
            elif side == CLIENT and command in (p.FINAL, p.ERROR, p.BUSY):
                for item in body:
                    self.ended[item.key] += 1
                    assert self.ended[item.key] == 1, f"{item.key} answered twice"
        # Credits: exact accounting; a worker sent jobs has them within its credits (or one
        # job larger than all of them runs alone).
        for w in s.workers.values():
            assert w.credits_used == sum(j.cost for j in w.running.values())
            if w.identity in got_jobs:
                assert w.credits_used <= w.credits or len(w.running) == 1, (w.credits, w.credits_used)
        # Every open job is in exactly one place: queued (held ones too) or running on one worker.
        queued = [jid for c in s.clients.values() for jid in c.queued]
        running = [j.spec.job_id for w in s.workers.values() for j in w.running.values()]
        assert len(set(running)) == len(running)
        assert set(queued).isdisjoint(running)
        assert sorted(queued + running) == sorted(j for j in self.jobs if not self.ended[j])
        assert s.num_queued == len(queued)
        for c in s.clients.values():  # each client's counts, kept by the scheduler as it goes
            assert c.num_queued == len(c.queued)
            on_workers = [j for w in s.workers.values() for j in w.running.values() if j.client == c.identity]
            assert set(c.running) == {j.spec.job_id for j in on_workers}
        # No turn is held past its wait; records stay under the cap.
        deadline = s.wake_at()
        assert deadline is None or deadline > self.now
        assert len(s.affinity.sessions) <= s.config.max_sessions

    def drain(self) -> None:
        """Workers back with credits; answer everything until every job has its one answer."""
        for worker in list(self.live):
            self.s.worker_credit(worker, 4, self.now)
        self.check()
        for _ in range(10_000):
            if all(self.ended[j] for j in self.jobs):
                return
            self.now += 0.01
            for worker, tickets in self.live.items():
                results = [p.Result(t, [1], [], 0, "w") for t in tickets]
                tickets.clear()
                self.s.worker_final(worker, results, self.now)
            self.s.wake(self.now)
            self.check()
        pytest.fail("jobs left without an answer")


@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_keep_credits_and_answer_every_job_once(seed: int) -> None:
    s = make(affinity_wait_s=0.05, session_idle_s=2.0, max_sessions=8, max_attempts=3)
    sim = Sim(s, random.Random(seed))
    sim.run(1500)
    sim.drain()
    assert all(sim.ended[j] == 1 for j in sim.jobs)
    counted = outcomes(s)
    assert counted["affine"] > 0 and counted["moved"] > 0 and counted["new"] > 0
    assert s.stats.sessions.holds["served"] + s.stats.sessions.holds["released"] > 0
    assert sum(s.stats.sessions.dropped.values()) > 0


@pytest.mark.parametrize("seed", range(4))
def test_random_interleavings_while_dispatch_switches_to_packing_and_back(seed: int) -> None:
    """As above, with dispatch switching between least loaded first and packing in steps of
    2, 4 or 16 credits at random moments (the broker does at its ticks): still every job
    answered once, credits never overrun (``check``), sessions still sent to their worker."""
    s = make(affinity_wait_s=0.05, session_idle_s=2.0, max_sessions=8, max_attempts=3)
    sim = Sim(s, random.Random(100 + seed), packing=True)
    sim.run(0)  # the first workers join
    steps = set()
    for _ in range(1500):
        sim.step()
        steps.add(s.dispatch_step)
    sim.drain()
    assert all(sim.ended[j] == 1 for j in sim.jobs)
    assert steps >= {1, 16}
    assert outcomes(s)["affine"] > 0


@pytest.mark.parametrize("seed", range(3))
def test_affinity_never_starves_a_client(seed: int) -> None:
    """Three clients, always backlogged: A's jobs are turns of 6 sessions, B's of 2 (so B's
    turns often wait for their two busy workers), C's have none. Credits free one at a time,
    at random; each client still gets about its share of the dispatches."""
    rng = random.Random(seed)
    s = make(affinity_wait_s=0.05)
    for w in (W1, W2, W3):
        ready(s, w, 2)
    pools = {A: [f"a{i}" for i in range(6)], B: ["b0", "b1"], C: [None]}
    running: list[tuple[bytes, int]] = []
    count: Counter[bytes] = Counter()
    owner: dict[str, bytes] = {}
    now, serial = 0.0, 0
    while sum(count.values()) < 3000:
        for client, pool in pools.items():
            backlog = len(s.clients[client].queued) if client in s.clients else 0
            for _ in range(10 - backlog):
                serial += 1
                jid = f"{client.decode()}-{serial}"
                owner[jid] = client
                s.submit(client, [turn(jid, rng.choice(pool))], now)
        for w, assigned in assignments(s.outbox.take()).items():
            for a in assigned:
                running.append((w, a.ticket))
                count[owner[a.job.job_id]] += 1
        now += rng.uniform(0.0, 0.01)
        worker, ticket = running.pop(rng.randrange(len(running)))
        s.worker_final(worker, [p.Result(ticket, [1], [], 0, "w")], now)
        s.wake(now)
    share = sum(count.values()) / 3
    # No client is starved; C, which waits for no worker, gets at least its share (what A and B
    # give up is only the time their turns wait for their workers).
    assert all(count[c] >= 0.8 * share for c in pools), count
    assert count[C] >= share, count


# -- the wire -------------------------------------------------------------------------------------
def test_session_fields_are_validated_on_construction_and_decode() -> None:
    for fields, message in [
        ({"session_id": ""}, "session_id must be a string of 1..128"),
        ({"session_id": "x" * 129}, "session_id must be a string of 1..128"),
        ({"session_end": True}, "true only with a session_id"),
    ]:
        with pytest.raises(ValueError, match=message):
            p.JobSpec("j", prompt="hi", **fields)
    ok = p.JobSpec("j", prompt="hi", session_id="x" * 128, session_end=True)
    frames = codec.encode(p.SUBMIT, [ok])
    assert codec.Decoder(codec.FROM_CLIENT).decode(frames).body == [ok]
    raw = ["j", [], "hi", None, None, False, 0, None, False, "x" * 129]
    with pytest.raises(ProtocolError, match="session_id must be"):
        codec.Decoder(codec.FROM_CLIENT).decode([p.SIGNATURE, p.SUBMIT, msgpack.packb([raw])])
    jobs, errors = split_submit(msgpack.packb([raw, ["k", [], "hi"]]))  # the broker's salvage path
    assert [j.job_id for j in jobs] == ["k"]
    assert [(e.key, e.code) for e in errors] == [("j", "invalid_request")]


def test_turns_of_a_session_land_on_one_worker_over_loopback(
    start_broker: Any, start_double: Any, raw_socket: Any
) -> None:
    """Two echo doubles; four sessions' first turns in one SUBMIT (spread over both), then each
    next turn alone, on idle workers (where least loaded first alone would pick one worker for
    all): every turn of a session comes back from the worker of its first."""
    broker = start_broker()
    doubles = [start_double(broker, credits=4, name=f"echo-{i}") for i in range(2)]
    client = raw_socket(zmq.DEALER)
    client.setsockopt(zmq.IDENTITY, b"trainer-affinity")
    client.connect(broker.frontend)
    decoder = codec.Decoder(codec.TO_CLIENT)

    def run(jobs: list[p.JobSpec]) -> dict[str, p.Result | p.ErrorItem]:
        client.send_multipart(codec.encode(p.SUBMIT, jobs))
        answers: dict[str, Any] = {}
        while len(answers) < len(jobs):
            assert client.poll(5000), f"no answer for {[j.job_id for j in jobs if j.job_id not in answers]}"
            msg = decoder.decode(client.recv_multipart())
            if msg.command in (p.FINAL, p.ERROR):
                answers.update((item.key, item) for item in msg.body)
        return answers

    first = run([turn(f"s{i}-0", f"s{i}") for i in range(4)])
    workers = {jid[:2]: r.worker_id for jid, r in first.items()}  # type: ignore[union-attr]
    assert set(workers.values()) == {d.name for d in doubles}
    for k in range(1, 4):
        for session in ("s3", "s1", "s0", "s2"):
            (result,) = run([turn(f"{session}-{k}", session, end=k == 3)]).values()
            assert result.worker_id == workers[session]  # type: ignore[union-attr]
    # A session id over 128 characters: that job is refused, as any invalid job is.
    too_long = ["too-long", [], "hi", None, None, False, 0, None, False, "x" * 129]
    client.send_multipart([p.SIGNATURE, p.SUBMIT, msgpack.packb([too_long])])
    assert client.poll(5000)
    msg = decoder.decode(client.recv_multipart())
    assert msg.command == p.ERROR
    assert [(e.key, e.code) for e in msg.body] == [("too-long", "invalid_request")]
    metrics = broker.metrics()
    assert metrics["zmq_rollout_session_dispatches_total{outcome=affine}"] == 12
    assert metrics["zmq_rollout_session_dispatches_total{outcome=new}"] == 4
    assert metrics["zmq_rollout_sessions_dropped_total{reason=ended}"] == 4
    assert metrics["zmq_rollout_sessions"] == 0
    assert broker.malformed() == {"invalid_job": 1}
