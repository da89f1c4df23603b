"""``JobSpec.max_staleness`` on single jobs, in the broker's pure scheduler: a result whose oldest
token is more than ``max_staleness`` versions behind the fleet is answered ``stale``
(``on_stale="abort"``) or run again from the start (``"restart"``, at most
``max_stale_restarts`` times). A sync is simulated by moving the fleet's and the workers'
versions as a committed round does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.broker.outbox import CLIENT, WORKER
from zmq_rollout.broker.scheduler import Scheduler
from zmq_rollout.config import BrokerConfig
from zmq_rollout.errors import ProtocolError, StaleRolloutError, error_from_code

A = b"client-a"
W1 = b"worker-1"
Sent = list[tuple[int, bytes, bytes, Any]]


def make(**config: Any) -> Scheduler:
    s = Scheduler(BrokerConfig(**config))
    s.worker_ready(W1, p.WorkerInfo("worker-1", "tiny", 4, 0), 0.0)
    return s


def job(job_id: str = "j", **fields: Any) -> p.JobSpec:
    return p.JobSpec(job_id, p.SamplingParams(n=2), prompt="hi", **fields)


def sent_to(sent: Sent, side: int, command: bytes) -> list[Any]:
    if (side, command) == (CLIENT, p.FINAL):  # as the client decodes them, message by message
        decoder = codec.Decoder(codec.TO_CLIENT)
        return [r for s, _, c, b in sent if (s, c) == (side, command) for r in decoder.decode(codec.encode(c, b)).body]
    return [item for s, _, c, b in sent if (s, c) == (side, command) for item in b]


@pytest.fixture(params=[p.FINAL, p.SEALED_FINAL], ids=["final", "sealed_final"])
def wire(request: pytest.FixtureRequest) -> Callable[[list[p.Result]], Any]:
    """Results as the broker decodes them off the wire, in either command a worker sends."""
    decoder = codec.Decoder(codec.FROM_WORKER)

    def relayed(results: list[p.Result]) -> Any:
        body = results if request.param == p.FINAL else [p.seal(r) for r in results]
        return decoder.decode(codec.encode(request.param, body)).body

    return relayed


def committed(s: Scheduler, version: int) -> None:
    """What a committed round leaves: the fleet and its worker at ``version``."""
    s.sync.fleet_version = version
    s.workers[W1].weight_version = version


def result(ticket: int, version: int, per_token: list[int] | None = None) -> p.Result:
    samples = [p.Sample(i, [5, 6, 7], [-0.1] * 3, "length", weight_versions=per_token) for i in range(2)]
    return p.Result(ticket, [1], samples, version, "worker-1")


def dispatched(s: Scheduler, spec: p.JobSpec, now: float = 0.0) -> int:
    s.submit(A, [spec], now)
    (assignment,) = sent_to(s.outbox.take(), WORKER, p.JOBS)
    return assignment.ticket  # type: ignore[no-any-return]


def test_abort_answers_a_stale_error_naming_the_versions_and_frees_the_credits(wire: Any) -> None:
    s = make()
    ticket = dispatched(s, job(max_staleness=0))
    committed(s, 1)
    s.worker_final(W1, wire([result(ticket, 1, per_token=[0, 0, 1])]), 1.0)
    sent = s.outbox.take()
    assert sent_to(sent, CLIENT, p.FINAL) == []
    (error,) = sent_to(sent, CLIENT, p.ERROR)
    assert (error.key, error.code) == ("j", "stale")
    assert "1 weight versions behind" in error.message and "max_staleness is 0" in error.message
    assert isinstance(error_from_code(error.code, error.message), StaleRolloutError)
    assert s.stats.stale == 1 and s.stats.failed == 1 and s.stats.completed == 0
    assert s.workers[W1].credits_used == 0 and s.workers[W1].running == {}
    assert s.clients[A].running == {}


def test_restart_runs_it_again_once_and_only_the_fresh_result_reaches_the_client(wire: Any) -> None:
    s = make()
    first = dispatched(s, job(max_staleness=0, on_stale="restart"))
    committed(s, 1)
    s.worker_final(W1, wire([result(first, 1, per_token=[0, 1, 1])]), 1.0)
    sent = s.outbox.take()
    assert sent_to(sent, CLIENT, p.FINAL) == [] and sent_to(sent, CLIENT, p.ERROR) == []
    (again,) = sent_to(sent, WORKER, p.JOBS)  # at once, to the (current) worker
    assert again.job.job_id == "j" and again.ticket != first
    assert s.stats.stale_restarted == 1 and s.workers[W1].credits_used == 2
    s.worker_final(W1, wire([result(first, 1)]), 1.5)  # a late copy of the old attempt is dropped
    assert sent_to(s.outbox.take(), CLIENT, p.FINAL) == []
    s.worker_final(W1, wire([result(again.ticket, 1)]), 2.0)
    (final,) = sent_to(s.outbox.take(), CLIENT, p.FINAL)
    assert final.key == "j" and final.weight_version == 1
    assert s.stats.completed == 1 and s.stats.failed == 0 and s.stats.requeued == 0


def test_restarts_stop_at_max_stale_restarts_then_the_job_fails_stale(wire: Any) -> None:
    s = make(max_stale_restarts=1)
    ticket = dispatched(s, job(max_staleness=0, on_stale="restart"))
    committed(s, 1)
    s.worker_final(W1, wire([result(ticket, 1, per_token=[0, 1, 1])]), 1.0)
    (again,) = sent_to(s.outbox.take(), WORKER, p.JOBS)
    committed(s, 2)
    s.worker_final(W1, wire([result(again.ticket, 2, per_token=[1, 2, 2])]), 2.0)
    sent = s.outbox.take()
    assert sent_to(sent, WORKER, p.JOBS) == []
    (error,) = sent_to(sent, CLIENT, p.ERROR)
    assert error.code == "stale" and "after 1 restarts" in error.message


def test_within_the_limit_or_without_one_the_result_goes_on(wire: Any) -> None:
    s = make()
    lenient = dispatched(s, job("lenient", max_staleness=1))
    unlimited = dispatched(s, job("unlimited"))
    committed(s, 1)
    s.worker_final(W1, wire([result(lenient, 1, per_token=[0, 1, 1]), result(unlimited, 1, per_token=[0, 0, 1])]), 1.0)
    assert sorted(r.key for r in sent_to(s.outbox.take(), CLIENT, p.FINAL)) == ["lenient", "unlimited"]
    assert s.stats.stale == s.stats.stale_restarted == 0


def test_a_result_whose_tokens_are_all_new_is_fresh_though_dispatched_before_the_sync(wire: Any) -> None:
    s = make()
    ticket = dispatched(s, job(max_staleness=0))
    committed(s, 1)
    s.worker_final(W1, wire([result(ticket, 1, per_token=[1, 1, 1])]), 1.0)
    assert [r.key for r in sent_to(s.outbox.take(), CLIENT, p.FINAL)] == ["j"]


def test_a_crossing_result_without_per_token_versions_counts_as_its_dispatch_version(wire: Any) -> None:
    """An unstreamed job that crossed a sync does not know its split: the broker counts it as
    made by the version its worker had at dispatch (never younger), so the limit holds."""
    s = make()
    ticket = dispatched(s, job(max_staleness=0))
    committed(s, 1)
    s.worker_final(W1, wire([result(ticket, 1)]), 1.0)
    assert [e.code for e in sent_to(s.outbox.take(), CLIENT, p.ERROR)] == ["stale"]


def test_a_streamed_job_run_again_tells_its_client_to_drop_its_deltas(wire: Any) -> None:
    """ACCEPTED again for a job already running: the client turns it into ``StreamRestarted``.
    Sent when a stale streamed job restarts and when its worker is lost."""
    s = make()
    ticket = dispatched(s, job("s", max_staleness=0, on_stale="restart", stream=True))
    committed(s, 1)
    s.worker_final(W1, wire([result(ticket, 1, per_token=[0, 1, 1])]), 1.0)
    sent = s.outbox.take()
    assert sent_to(sent, CLIENT, p.ACCEPTED) == ["s"]
    s.worker_ready(b"worker-2", p.WorkerInfo("worker-2", "tiny", 4, 1), 1.0)
    s.outbox.take()
    s.worker_gone(W1, "heartbeat expired", 2.0)
    sent = s.outbox.take()
    assert sent_to(sent, CLIENT, p.ACCEPTED) == ["s"]
    assert [a.job.job_id for a in sent_to(sent, WORKER, p.JOBS)] == ["s"]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"max_staleness": -1}, "max_staleness=-1 is outside"),
        ({"max_staleness": 1.5}, "max_staleness must be an integer"),
        ({"on_stale": "retry"}, "on_stale must be one of abort, restart"),
    ],
)
def test_bad_staleness_options_are_refused_on_construction(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        job(**fields)


def test_bad_staleness_options_from_the_wire_are_a_protocol_error() -> None:
    """Decoding runs the same checks: the broker answers the sender with the error (and counts
    it), as for any malformed job."""
    spec = p.JobSpec("ok", prompt="hi", max_staleness=0)
    spec.on_stale = "never"  # fields can be reassigned after construction: what a hostile peer sends
    frames = codec.encode(p.SUBMIT, [spec])
    with pytest.raises(ProtocolError, match="on_stale must be one of abort, restart"):
        codec.Decoder(codec.FROM_CLIENT).decode(frames)


def test_a_stale_error_keeps_its_place_among_the_finals_of_one_message() -> None:
    """The FINALs of one worker message go out in one list per client, except around an
    ERROR (or restart) that a stale result in the middle sends: order stays as the results'."""
    s = Scheduler(BrokerConfig())
    s.worker_ready(W1, p.WorkerInfo("worker-1", "tiny", 8, 0), 0.0)
    s.submit(A, [job("a"), job("b", max_staleness=0), job("c")], 0.0)
    tickets = {a.job.job_id: a.ticket for a in sent_to(s.outbox.take(), WORKER, p.JOBS)}
    committed(s, 1)
    s.worker_final(W1, [result(tickets[k], 0) for k in "abc"], 1.0)  # type: ignore[misc]
    to_a = [(c, [getattr(item, "key", None) for item in b]) for side, ident, c, b in s.outbox.take() if ident == A]
    assert to_a == [(p.FINAL, ["a"]), (p.ERROR, ["b"]), (p.FINAL, ["c"])]


def test_restarts_for_staleness_are_no_lost_attempts_toward_max_attempts(wire: Any) -> None:
    """``max_attempts`` counts the workers a job was lost with; running again because it finished
    too stale is none of them."""
    s = make(heartbeat_interval_s=1.0, worker_liveness=1, max_attempts=2, max_stale_restarts=5)
    ticket = dispatched(s, job(max_staleness=0, on_stale="restart"))
    for version in (1, 2):  # two restarts: each result a version behind the fleet
        committed(s, version)
        s.worker_final(W1, wire([result(ticket, version - 1)]), 1.0)
        (again,) = sent_to(s.outbox.take(), WORKER, p.JOBS)
        ticket = again.ticket
    assert s.stats.stale_restarted == 2
    s.tick(3.0)  # W1 expires with the job on it: its first loss, so it is queued again
    assert s.stats.requeued == 1 and s.stats.failed == 0 and s.num_queued == 1
    w2 = b"worker-2"
    s.worker_ready(w2, p.WorkerInfo("worker-2", "tiny", 4, 2), 3.0)
    (moved,) = sent_to(s.outbox.take(), WORKER, p.JOBS)
    assert moved.job.job_id == "j"
    s.tick(5.0)  # W2 expires too: the second loss is max_attempts
    (error,) = sent_to(s.outbox.take(), CLIENT, p.ERROR)
    assert (error.key, error.code) == ("j", "job_failed") and "lost with 2 workers" in error.message
    assert s.stats.failed == 1 and s.clients[A].jobs == {} and s.clients[A].num_queued == 0
