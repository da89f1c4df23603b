"""Weight sync end to end: a trainer-side HF copy of the tiny model, two real vLLM CPU
workers behind the broker, shm and gloo transports, pause modes, eviction, late joiners.

The proof that a sync is right: after it, the workers' greedy outputs equal the trainer
model's greedy outputs, and the logprobs vLLM reports for sampled tokens equal the trainer's
recomputation within bf16 noise; before it, neither holds.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
from model_helpers import SYNC_GREEDY, SYNC_PROMPTS, hf_greedy, hf_logprobs, trained_model

from zmq_rollout import RolloutClient, SamplingParams
from zmq_rollout.config import BrokerConfig
from zmq_rollout.local import LocalCluster

pytestmark = pytest.mark.slow

PROMPTS, GREEDY = SYNC_PROMPTS, SYNC_GREEDY


@pytest.fixture(scope="module")
def cluster(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    config = BrokerConfig(
        frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", heartbeat_interval=0.5, worker_liveness=10
    )
    c = LocalCluster(model_dir, num_workers=2, broker_config=config, log_dir=str(tmp_path_factory.mktemp("sync-logs")))
    try:
        c.start(wait=300)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster: LocalCluster):
    with RolloutClient(cluster.address, timeout=300) as c:
        yield c


def agreement(client: RolloutClient, model: torch.nn.Module) -> tuple[int, float]:
    """(prompts whose greedy tokens equal the trainer's, max |logprob diff| on sampled tokens)."""
    greedy = client.generate(PROMPTS, GREEDY)
    equal = sum(r.token_ids == hf_greedy(model, PROMPTS[r.prompt_index], 12) for r in greedy)
    sampled = client.generate(PROMPTS[:4], SamplingParams(temperature=1.0, max_tokens=8, seed=3, ignore_eos=True))
    diff = max(
        abs(a - b)
        for r in sampled
        for a, b in zip(r.logprobs, hf_logprobs(model, PROMPTS[r.prompt_index], r.token_ids), strict=True)
    )
    return equal, diff


@pytest.mark.parametrize(("transport", "seed"), [("shm", 1), ("gloo", 2)])
def test_sync_makes_workers_match_the_trainer(client: RolloutClient, model_dir: str, transport: str, seed: int) -> None:
    trainer_model = trained_model(model_dir, seed)
    equal_before, diff_before = agreement(client, trainer_model)
    report = client.update_weights(
        trainer_model, transport=transport, bucket_bytes=200_000, check_names=True, timeout=120
    )
    assert sorted(report.workers_updated) == ["worker-0", "worker-1"] and report.workers_evicted == []
    assert report.num_buckets > 1 and report.bytes > 0
    equal_after, diff_after = agreement(client, trainer_model)
    print(f"{transport}: greedy equal {equal_before}->{equal_after}/{len(PROMPTS)}, "
          f"max logprob diff {diff_before:.3f}->{diff_after:.4f}, sync {report.seconds:.2f} s")  # fmt: skip
    assert equal_after >= len(PROMPTS) - 1  # a bf16 near-tie may split one prompt
    assert equal_before <= len(PROMPTS) // 2
    assert diff_after < 0.05 < diff_before
    status = client.status()
    assert status.fleet_version == report.version
    assert {w.weight_version for w in status.workers} == {report.version}
    assert {r.weight_version for r in client.generate(PROMPTS[:4], GREEDY)} == {report.version}
    if transport == "shm":  # the segments are kept for the next round, not made anew
        import os

        names = client._async.shm_buffers.names
        assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
        client.update_weights(trainer_model, transport="shm", bucket_bytes=200_000)
        assert client._async.shm_buffers.names == names


def test_name_check_fails_early_with_the_mismatches(client: RolloutClient, model_dir: str) -> None:
    trainer_model = trained_model(model_dir, 3)
    version = client.status().fleet_version
    bad = [("model.embed_tokens.weight", trainer_model.model.embed_tokens.weight), ("not.a.weight", torch.zeros(2))]
    with pytest.raises(Exception, match=r"not\.a\.weight"):
        client.update_weights(bad, check_names=True)
    status = client.status()
    assert status.fleet_version == version and all(w.state == "ready" for w in status.workers)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of cuda_ipc without CUDA")
def test_cuda_ipc_without_cuda_aborts_the_round_and_leaves_the_fleet_serving(
    client: RolloutClient, model_dir: str
) -> None:
    from zmq_rollout.errors import InvalidRequestError

    version = client.status().fleet_version
    with pytest.raises(InvalidRequestError, match="needs CUDA"):
        client.update_weights(trained_model(model_dir, 4), transport="cuda_ipc")
    status = client.status()
    assert status.fleet_version == version and all(w.state == "ready" for w in status.workers)
    assert {r.weight_version for r in client.generate(PROMPTS[:2], GREEDY)} == {version}


def _long_jobs(client: RolloutClient, count: int, tokens: int) -> list:
    return [
        client.submit([i + 3, 7, 9], SamplingParams(max_tokens=tokens, seed=100 + i, ignore_eos=True))
        for i in range(count)
    ]


def _wait_dispatched(cluster: LocalCluster, submitted_before: int, count: int) -> None:
    """Until the broker has handed all ``count`` jobs to workers (then a little generating)."""
    sched = cluster.broker.broker.scheduler
    deadline = time.monotonic() + 60
    while sched.stats.submitted < submitted_before + count or sched.num_queued:
        assert time.monotonic() < deadline, f"jobs not dispatched: {sched.stats}"
        time.sleep(0.01)
    time.sleep(0.3)


@pytest.mark.parametrize("pause", ["abort", "keep", "wait"])
def test_pause_modes_with_jobs_in_flight(
    cluster: LocalCluster, client: RolloutClient, model_dir: str, pause: str
) -> None:
    trainer_model = trained_model(model_dir, {"abort": 4, "keep": 5, "wait": 6}[pause])
    old = client.status().fleet_version
    submitted = cluster.broker.broker.scheduler.stats.submitted
    futures = _long_jobs(client, 6, 900)
    _wait_dispatched(cluster, submitted, 6)
    report = client.update_weights(trainer_model, pause=pause, timeout=120)
    rollouts = [f.result(timeout=300)[0] for f in futures]
    assert all(len(r.token_ids) == len(r.logprobs) == 900 for r in rollouts)  # nothing lost, nothing doubled
    assert all(r.finish_reason == "length" for r in rollouts)
    spans = [r.weight_versions for r in rollouts if r.weight_versions is not None]
    versions = [r.weight_version for r in rollouts]
    if pause == "wait":  # drained first: jobs in flight finish on the old weights
        assert spans == [] and set(versions) <= {old, report.version} and versions.count(old) >= 4, versions
    elif pause == "keep":  # frozen, then finished on the new weights (no per-token split unstreamed)
        # Which version a frozen job reports depends on when vLLM's keep pause catches it;
        # what must hold is that nothing is lost and no unknown split is claimed.
        assert spans == [] and set(versions) <= {old, report.version}, versions
    else:  # abort: cut short and continued; per-token versions show the switch
        assert spans, f"no job spanned the {pause} sync"
        for versions in spans:
            assert versions[0] == old and versions[-1] == report.version and versions == sorted(versions)


def test_worker_killed_mid_sync_is_evicted_and_the_rest_serve_the_new_version(
    cluster: LocalCluster, client: RolloutClient, model_dir: str
) -> None:
    sched = cluster.broker.broker.scheduler
    trainer_model = trained_model(model_dir, 9)
    victim = "worker-1"
    result: dict = {}

    def sync() -> None:
        try:
            result["report"] = client.update_weights(trainer_model, transport="gloo", bucket_bytes=100_000, timeout=8)
        except Exception as exc:
            result["error"] = exc

    thread = threading.Thread(target=sync)
    started = time.monotonic()
    thread.start()
    deadline = time.monotonic() + 30
    while not (sched.sync.round and sched.sync.round.step and sched.sync.round.step.op == "receive_bucket"):
        assert time.monotonic() < deadline, "the sync never reached the data plane"
        time.sleep(0.01)
    cluster.kill_worker(victim, signal.SIGKILL)
    thread.join(timeout=120)
    elapsed = time.monotonic() - started
    assert not thread.is_alive(), "the trainer hung"
    assert "error" not in result, result.get("error")
    report = result["report"]
    assert [e.name for e in report.workers_evicted] == [victim]
    assert report.workers_updated == ["worker-0"]
    assert elapsed < 60
    equal, diff = agreement(client, trainer_model)
    assert equal >= len(PROMPTS) - 1 and diff < 0.05
    assert {r.worker_id for r in client.generate(PROMPTS, GREEDY)} == {"worker-0"}


def test_late_joiner_waits_for_the_next_round(cluster: LocalCluster, client: RolloutClient, model_dir: str) -> None:
    trainer_model = trained_model(model_dir, 10)
    fleet = client.status().fleet_version
    assert fleet > 0
    cluster.start_worker("worker-late")
    cluster.wait_for_workers(2, 300)
    late = next(w for w in client.status().workers if w.name == "worker-late")
    assert late.state == "stale" and late.weight_version == 0
    assert "worker-late" not in {r.worker_id for r in client.generate(PROMPTS * 4, GREEDY)}
    report = client.update_weights(trainer_model, timeout=120)
    assert "worker-late" in report.workers_updated
    assert all(w.state == "ready" and w.weight_version == report.version for w in client.status().workers)
    equal, diff = agreement(client, trainer_model)
    assert equal >= len(PROMPTS) - 1 and diff < 0.05


def test_a_step_outside_any_round_is_refused(client: RolloutClient) -> None:
    from zmq_rollout import protocol as p

    reply = client._call(client._async.sync_step(p.SyncStep(424242, "commit", {"version": 1}, 5.0)))
    assert "no sync round" in reply.error
