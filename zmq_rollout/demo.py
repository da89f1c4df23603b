"""``zmq-rollout demo``: the embedded default, end to end on one CPU machine."""

from __future__ import annotations

import collections
import tempfile
import time

from zmq_rollout.blocking import RolloutClient
from zmq_rollout.local import LocalCluster
from zmq_rollout.protocol import SamplingParams
from zmq_rollout.tiny_model import make_tiny_model


def run_demo(*, num_prompts: int = 32, n: int = 2, max_tokens: int = 24, num_workers: int = 1) -> int:
    with tempfile.TemporaryDirectory(prefix="zmq-rollout-demo-") as tmp:
        model = str(make_tiny_model(f"{tmp}/tiny-qwen2"))
        print(f"[demo] tiny model at {model}; starting a broker and {num_workers} CPU worker(s) (about 30 s)...")
        started = time.monotonic()
        with LocalCluster(model, num_workers=num_workers, log_dir=tmp) as cluster:
            print(f"[demo] {num_workers} worker(s) registered after {time.monotonic() - started:.1f} s")
            prompts = [f"Question {i}: what is {i} + {i}?" for i in range(num_prompts)]
            sampling = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=1234)
            with RolloutClient(cluster.address) as client:
                t0 = time.monotonic()
                rollouts = client.generate(prompts, sampling)
                elapsed = time.monotonic() - t0
                status = client.status()
        num_tokens = sum(len(r.token_ids) for r in rollouts)
        by_worker = collections.Counter(r.worker_id for r in rollouts)
        first = rollouts[0]
        print(
            f"[demo] {len(rollouts)} rollouts ({num_prompts} prompts x n={n}), {num_tokens} tokens "
            f"in {elapsed:.2f} s = {num_tokens / elapsed:.0f} tok/s"
        )
        print(f"[demo] per worker: {dict(by_worker)}; weight versions: {sorted({r.weight_version for r in rollouts})}")
        print(
            f"[demo] first rollout: prompt {len(first.prompt_token_ids)} tokens -> {first.token_ids[:8]}... "
            f"logprobs {[round(x, 3) for x in first.logprobs[:4]]}... finish={first.finish_reason}"
        )
        print(f"[demo] broker saw {len(status.workers)} worker(s), {status.queued} queued, {status.running} running")
        print("[demo] clean shutdown done")
        ok = len(rollouts) == num_prompts * n and all(r.token_ids for r in rollouts)
        return 0 if ok else 1
