"""A REAL worker's port fuzzed (vLLM CPU engine, the tiny model), through a fake broker.

``FakeBroker`` (``zmq_rollout.fuzz_peers``) is the ROUTER the worker connects to; after the
READY it sends ``Fuzzer("worker")`` messages (mutated JOBS, CONTROL, CANCEL, HEARTBEAT,
DISCONNECT, client and worker commands in the wrong direction, broken frames), then one valid
job. The short run of ``benchmarks/fuzz.py --worker-frames``; ``ZMQ_ROLLOUT_FUZZ_SEED`` picks
another seed.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port, scrape

from zmq_rollout import protocol as p
from zmq_rollout.config import WorkerConfig
from zmq_rollout.fuzz_peers import FakeBroker, rss_bytes
from zmq_rollout.fuzzing import Fuzzer
from zmq_rollout.workers.main import worker_command

SEED = int(os.environ.get("ZMQ_ROLLOUT_FUZZ_SEED", "2026"))
MESSAGES = 5000
RSS_GROWTH_LIMIT = 64 << 20
"""The worker process may grow by this much over the fuzz: it holds a vLLM engine client
(~580 MiB here) whose allocator keeps slack after the largest messages (~1 MB); a worker
that kept anything per hostile message (a task, a reply, a LoRA part) would grow with the
~7 MB sent and more."""
PROMPT = list(range(5, 65))  # 60 ids: with 2 x 8 sampled, a result worth sealing (p.SEAL_MIN_TOKENS)
JOB = p.JobSpec("ref", p.SamplingParams(n=2, seed=5, max_tokens=8, ignore_eos=True), prompt_token_ids=PROMPT)


@pytest.fixture
def fuzzed_worker(tiny_model: str, tmp_path: Path) -> Iterator[tuple[FakeBroker, subprocess.Popen[bytes], int]]:
    fake = FakeBroker()
    port = free_port()
    config = WorkerConfig(
        broker=fake.address,
        model=tiny_model,
        name="fuzzed",
        max_num_seqs=8,
        max_model_len=256,
        kv_cache_gib=0.25,
        metrics_port=port,
    )
    with open(tmp_path / "worker.log", "wb") as log:
        proc = subprocess.Popen(worker_command(config), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield fake, proc, port
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        fake.close()
        if os.environ.get("ZMQ_ROLLOUT_KEEP_LOGS"):
            print((tmp_path / "worker.log").read_text()[-5000:])


def test_a_real_worker_survives_fuzzing_and_then_answers_a_job_exactly_as_before(fuzzed_worker: Any) -> None:
    fake, proc, metrics_port = fuzzed_worker
    fake.wait_ready(300)
    before = fake.run_job(p.Assignment(1, JOB), 120)
    assert isinstance(before, p.Result), before
    rss_start = rss_bytes(proc.pid)

    fake.sealed = True  # the connections after the fuzz's DISCONNECTs send SEALED_FINAL
    fuzzer = Fuzzer("worker", SEED)
    try:
        fake.fuzz(fuzzer, MESSAGES)
        fake.settle(60)  # it has read all of it
        assert proc.poll() is None, f"the worker exited with {proc.returncode}"
        after = fake.run_job(p.Assignment(2, JOB), 120)
    except BaseException:
        print(f"fuzz seed {SEED}: replay with ZMQ_ROLLOUT_FUZZ_SEED={SEED}")
        raise

    # Correct: the same seeded job gives the same samples as before the fuzz, once.
    assert isinstance(after, p.Result), after
    assert [s.token_ids for s in after.samples] == [s.token_ids for s in before.samples]
    for a, b in zip(after.samples, before.samples, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert (after.prompt_token_ids, after.weight_version, after.worker_id) == (PROMPT, 0, "fuzzed")
    assert fake.answers[1] == fake.answers[2] == 1
    # The first connection's broker said nothing of SEALED_FINAL: the first result came as FINAL;
    # the later connections, told, sealed it (and it opens as the same); small ones stay FINAL.
    assert 1 not in fake.sealed_tickets and 2 in fake.sealed_tickets
    # Every message it could not decode counted (and the probe of settle()), none lost; every
    # answer it sent decodes; it reconnected on each well-formed DISCONNECT.
    assert fake.rejected > MESSAGES // 2
    malformed = scrape(metrics_port)["zmq_rollout_worker_malformed_messages_total"]
    assert malformed == fake.rejected + fake.probes
    assert fake.undecodable == 0 and fake.readies > 1
    assert fake.replies["control_ack"] > 0  # a CONTROL it cannot decode is refused, not left waiting
    growth = rss_bytes(proc.pid) - rss_start
    print(f"seed {SEED}: {fake.sent} messages, {fake.rejected} malformed, RSS growth {growth / 2**20:.1f} MiB")
    assert growth < RSS_GROWTH_LIMIT
    # And it still leaves as it should.
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
