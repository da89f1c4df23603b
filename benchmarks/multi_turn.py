"""What session affinity buys: the engines' prefix-cache hit rate on turns 2+ of multi-turn
episodes, with the broker's affinity on against off, in the same run.

    python benchmarks/multi_turn.py                  # 2 workers, 32 episodes x 4 turns, 2 rounds each
    python benchmarks/multi_turn.py --episodes 64 --turns 6 --rounds 3 --json-out mt.json

Real vLLM CPU workers (the tiny random model, built locally) behind one broker; every round
runs ``--episodes`` concurrent episodes of the ``scripted`` environment through
``run_episodes``. Between rounds the broker is restarted with affinity on or off (the order
alternates, so drift hits both alike); the workers and their prefix caches stay, and every
round's prompts begin differently, so no round finds another's blocks.

The hit rate is vLLM's own: ``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``
(tokens) from the workers' ``/metrics``, summed over workers, across the round. Turn 1's
prompts are all different from their first block, so they hit nothing; their tokens (the
trajectories' ``prompt_length``) are taken out of the queries to give the rate on turns 2+:

    rate(turns 2+) = hits / (queries - sum of first-turn prompt lengths)

Each turn's new tokens (the environment's message and the generation header) are never in
any cache, and neither is the partial block at the end of the last turn's tokens; the most a
turn can hit is the previous turn's prompt and output rounded down to whole blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ports import free_port


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--episodes", type=int, default=32, help="concurrent episodes per round (default 32)")
    ap.add_argument("--turns", type=int, default=4, help="turns per episode (default 4)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per turn (default 96)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds with affinity on, and as many off (default 2)")
    ap.add_argument("--json-out", type=Path, default=None)
    return ap.parse_args(argv)


def cache_counters(ports: list[int]) -> tuple[float, float]:
    """(hits, queries) in tokens, summed over the workers' engines."""
    from zmq_rollout.scrape import fetch_metrics

    hits = queries = 0.0
    for port in ports:
        scrape = fetch_metrics(f"http://127.0.0.1:{port}/metrics", 10.0)
        if scrape.error:
            raise RuntimeError(f"worker metrics on :{port}: {scrape.error}")
        hits += scrape.total("vllm:prefix_cache_hits_total") or 0.0
        queries += scrape.total("vllm:prefix_cache_queries_total") or 0.0
    return hits, queries


async def one_round(address: str, model: str, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    from zmq_rollout import AsyncRolloutClient, SamplingParams
    from zmq_rollout.episodes import run_episodes

    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    samples = [f"{tag}{i:03d} " for i in range(args.episodes)]  # every round and episode begins differently
    started = time.monotonic()
    async with AsyncRolloutClient(address, timeout_s=600) as client:
        got = await run_episodes(
            client, "scripted", samples, sampling, tokenizer=model, env_kwargs={"turns": args.turns}, progress=False
        )
    seconds = time.monotonic() - started
    bad = [t.finish_reason for t in got if t.finish_reason != "done"]
    if bad:
        raise RuntimeError(f"{len(bad)} episodes did not finish: {bad[:5]}")
    same_worker = sum(
        t.turns[k].worker_id == t.turns[k - 1].worker_id for t in got for k in range(1, len(t.turns))
    ) / sum(len(t.turns) - 1 for t in got)
    return {
        "first_prompt_tokens": sum(t.prompt_length for t in got),
        "tokens": sum(len(t.token_ids) for t in got),
        "seconds": seconds,
        "same_worker": same_worker,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from zmq_rollout.config import BrokerConfig
    from zmq_rollout.local import LocalCluster
    from zmq_rollout.tiny_model import make_tiny_model

    workdir = tempfile.mkdtemp(prefix="zmq-rollout-mt-")
    model = str(make_tiny_model(f"{workdir}/tiny-qwen2"))
    config = BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", affinity=True)
    ports = [free_port() for _ in range(args.workers)]
    cluster = LocalCluster(model, num_workers=0, broker_config=config, log_dir=workdir)
    rows: list[dict[str, Any]] = []
    print(
        f"[multi_turn] {args.workers} vLLM CPU workers, {args.episodes} episodes x {args.turns} turns x "
        f"{args.max_tokens} tokens per round; logs in {workdir}",
        flush=True,
    )
    with cluster:
        cluster.start()
        for i, port in enumerate(ports):
            cluster.start_worker(f"worker-{i}", metrics_port=port)
        cluster.wait_for_workers(args.workers, 600)
        # on, off, then off, on, ...: each pair in the other order, so drift hits both alike
        order = [flag for i in range(args.rounds) for flag in ((True, False) if i % 2 == 0 else (False, True))]
        for r, affinity in enumerate(order):
            cluster.broker_config = dataclasses.replace(cluster.broker_config, affinity=affinity)
            cluster.restart_broker()
            cluster.wait_for_workers(args.workers, 120)
            hits0, queries0 = cache_counters(ports)
            row = asyncio.run(one_round(cluster.address, model, args, f"r{r}"))
            hits1, queries1 = cache_counters(ports)
            hits, queries = hits1 - hits0, queries1 - queries0
            later = queries - row["first_prompt_tokens"]
            row.update(
                round=r,
                affinity=affinity,
                hits=hits,
                queries=queries,
                rate_all=hits / queries if queries else 0.0,
                rate_turns_2plus=hits / later if later > 0 else 0.0,
            )
            rows.append(row)
            print(
                f"[multi_turn] round {r} affinity {'on ' if affinity else 'off'}: turns 2+ hit "
                f"{row['rate_turns_2plus']:.1%} of prompt tokens (all turns {row['rate_all']:.1%}); "
                f"same worker as the last turn {row['same_worker']:.0%}; {row['seconds']:.1f} s",
                flush=True,
            )
    on = [r["rate_turns_2plus"] for r in rows if r["affinity"]]
    off = [r["rate_turns_2plus"] for r in rows if not r["affinity"]]
    result = {
        "workers": args.workers,
        "episodes": args.episodes,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "affinity_on_rate": sum(on) / len(on),
        "affinity_off_rate": sum(off) / len(off),
        "ratio_on_over_off": (sum(on) / len(on)) / max(1e-9, sum(off) / len(off)),
        "rounds": rows,
    }
    print()
    print("| affinity | prefix-cache hit rate, turns 2+ | same worker as last turn | seconds per round |")
    print("| --- | --- | --- | --- |")
    for flag in (True, False):
        sel = [r for r in rows if r["affinity"] is flag]
        print(
            f"| {'on' if flag else 'off (baseline)'} | {sum(r['rate_turns_2plus'] for r in sel) / len(sel):.1%} | "
            f"{sum(r['same_worker'] for r in sel) / len(sel):.0%} | {sum(r['seconds'] for r in sel) / len(sel):.1f} |"
        )
    print(f"ratio on/off: {result['ratio_on_over_off']:.2f}x")
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k != "rounds"}), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
