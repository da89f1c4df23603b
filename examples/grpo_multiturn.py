"""Multi-turn GRPO on CPU in a few minutes: 3-turn episodes teach the tiny model to say "aaaa".

grpo_tiny.py's loop, with each sample an *episode*: ``run_episodes`` plays the "scripted"
environment for 3 turns (the user asks for ``a``, the model answers 12 tokens; again; again),
and each turn's reward is the fraction of the answer's tokens that are the byte ``a``. A
trajectory is the whole conversation as one list of token ids, the environment's messages
and the chat template's headers included, with ``loss_mask`` 1 exactly on the ids the model
generated and vLLM's logprob and weight version on each of them. The trainer (a float32
transformers copy of the model) runs one forward pass over each whole conversation, takes the
clipped policy-gradient loss on the masked tokens only, with one GRPO advantage per episode
(its summed reward against the other ``G - 1`` episodes of its prompt), and pushes bf16
weights into the workers (shared memory, ``pause="wait"``) *every step*. The loop checks that
every model token came from the version synced the step before (on-policy), that the mask
covers exactly the generated turns, and that vLLM's logprobs match the trainer's.

The reported reward is per turn: an episode's summed reward / its 3 turns, the share of its
model tokens that are ``a`` (0..1, comparable with grpo_tiny.py's); the per-turn means are
logged too. Sampling is unseeded here, so ``--seed`` fixes the model's init and the trainer
and curves vary from run to run (``run_episodes`` now derives a seed per turn and episode
from ``SamplingParams.seed``, so a seeded run would repeat; the curves below were unseeded).

Measured on 2 busy CPU cores (defaults: 8 prompts x G=8 episodes, 12 tokens a turn, lr 5e-3):

    seed  workers  reward at steps 0, 2, 4, ..., 18               >= 0.3          start-up  20 steps
    0     1        .00 .02 .08 .18 .39 .68 .89 .96 .99 1.0        step 8, 64 s    195 s     132 s
    1     2        .01 .02 .07 .19 .40 .67 .90 .97 .99 1.0        step 8, 48 s    131 s     133 s
    2     1        .01 .02 .05 .14 .30 .56 .83 .95 .99 .99        step 8, 72 s    221 s     168 s

The machine was loaded far past its 2 cores (load average 20-27: start-up takes 25-90 s on
idle cores), so these wall times are upper bounds; at a lighter load (about 10) a 12-step run
took 141 s, 104 s of it start-up, and crossed 0.3 after 20 s of training. The three turns learn together: their
per-turn means stay within 0.05 of each other, since every turn is the same request and a
turn's tokens are pushed up by the whole episode's advantage. vLLM's logprobs match the
trainer's recomputation to 0.006 or better (mean |difference| over a step's model tokens).

    python examples/grpo_multiturn.py                   # 20 steps, one worker
    python examples/grpo_multiturn.py --workers 2 --seed 1 --json-out result.json

The last line printed is ``RESULT {json}``: the reward at the start (mean of the first 3
steps) and at the end (mean of the last 3), the first step at or above 0.3 and the seconds of
training until then, seconds in all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TURNS = 3
CROSSING = 0.3  # RESULT's crossing_step: the first step whose mean reward is at least this
PROMPTS = [f"Prompt {i}. " for i in range(8)]  # the environment appends "Turn 1 of 3: say a."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="training steps, one weight sync each (default 20)")
    ap.add_argument("--workers", type=int, default=1, help="vLLM CPU workers (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the model's init and the trainer (default 0)")
    ap.add_argument("--group-size", "-G", type=int, default=8, help="episodes per prompt (default 8)")
    ap.add_argument("--max-tokens", type=int, default=12, help="tokens per assistant turn (default 12)")
    ap.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate (default 5e-3)")
    ap.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip (default 0.2)")
    ap.add_argument("--json-out", type=Path, default=None, help="also write the RESULT json to this file")
    return ap.parse_args(argv)


def bf16_tensors(model: Any) -> list[tuple[str, Any]]:
    """What the workers load: every tensor once (tied weights under the first name), bf16."""
    import torch

    from zmq_rollout.weight_sync.buckets import named_tensors

    return [(name, t.detach().to(torch.bfloat16)) for name, t in named_tensors(model)]


def mask_is_exact(t: Any, max_tokens: int) -> bool:
    """The mask is 1 on exactly the ids of the model's turns, each a full ``max_tokens`` long
    (``ignore_eos``), and only those carry a logprob and a weight version."""
    if not (len(t.token_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.weight_versions)):
        return False
    spans = {i for s in t.turns for i in range(s.start, s.end)}
    generated = sum(s.end - s.start for s in t.turns)
    outside = [(v, lp) for v, lp, m in zip(t.weight_versions, t.logprobs, t.loss_mask, strict=True) if not m]
    return (
        all(s.end - s.start == max_tokens for s in t.turns)
        and sum(t.loss_mask) == len(spans) == generated == max_tokens * t.num_turns
        and all(bool(m) == (i in spans) for i, m in enumerate(t.loss_mask))
        and all(v == -1 and lp == 0.0 for v, lp in outside)
        and not any(t.loss_mask[: t.prompt_length])
    )


def grpo_loss(model: Any, trajectories: list[Any], clip: float) -> tuple[Any, float, float]:
    """The clipped policy-gradient loss over whole conversations, on the model's tokens only.

    One forward pass per conversation; position ``t`` of the logits predicts token ``t + 1``,
    so ``loss_mask[t + 1]`` says whether that prediction is the model's. The old policy is
    the logprob vLLM reported for the token (bf16 weights synced last step); the new one the
    trainer's float32 recomputation. Returns (loss, mean |logprob difference|, clip fraction).
    """
    import torch

    groups: dict[int, list[Any]] = {}
    for t in trajectories:
        groups.setdefault(t.sample_index, []).append(t)
    advantage: dict[tuple[int, int], float] = {}
    for si, group in groups.items():
        rewards = torch.tensor([t.reward for t in group])
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        for t, a in zip(group, adv.tolist(), strict=True):
            advantage[(si, t.index)] = a

    width = max(len(t.token_ids) for t in trajectories)
    rows = len(trajectories)
    ids = torch.zeros(rows, width, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    old = torch.zeros(rows, width)
    adv = torch.zeros(rows, 1)
    for row, t in enumerate(trajectories):
        n = len(t.token_ids)
        ids[row, :n] = torch.tensor(t.token_ids)
        attention[row, :n] = 1
        mask[row, : n - 1] = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        old[row, : n - 1] = torch.tensor(t.logprobs[1:])
        adv[row, 0] = advantage[(t.sample_index, t.index)]
    targets = torch.roll(ids, -1, dims=1)
    logits = model(input_ids=ids, attention_mask=attention).logits.float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
    ratio = torch.exp(logp - old)
    per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    # GRPO: mean over each episode's model tokens, then over the episodes
    loss = ((per_token * mask).sum(1) / mask.sum(1)).mean()
    with torch.no_grad():
        mismatch = (logp - old).abs()[mask].mean().item()
        clipped = ((ratio - 1).abs() > clip)[mask].float().mean().item()
    return loss, mismatch, clipped


async def train(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zmq_rollout import AsyncRolloutClient, SamplingParams
    from zmq_rollout.episodes import run_episodes
    from zmq_rollout.local import LocalCluster
    from zmq_rollout.tiny_model import make_tiny_model

    started = time.monotonic()
    torch.manual_seed(args.seed)
    path = str(make_tiny_model(f"{workdir}/tiny-qwen2", seed=args.seed))
    print(f"[grpo] tiny model at {path}; starting a broker and {args.workers} vLLM CPU worker(s)...", flush=True)
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    with LocalCluster(path, num_workers=args.workers, log_dir=workdir) as cluster:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.train()
        tokenizer = AutoTokenizer.from_pretrained(path)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        startup = time.monotonic() - started
        print(
            f"[grpo] ready after {startup:.1f} s; {args.steps} steps of {len(PROMPTS)} prompts x G={args.group_size}"
            f" episodes x {TURNS} turns x {args.max_tokens} tokens",
            flush=True,
        )

        def learn(trajectories: list[Any]) -> tuple[float, float]:
            optimizer.zero_grad()
            loss, mismatch, clipped = grpo_loss(model, trajectories, args.clip)
            loss.backward()
            optimizer.step()
            return mismatch, clipped

        steps: list[dict[str, Any]] = []
        async with AsyncRolloutClient(cluster.address, timeout_s=300) as client:
            version = (await client.status()).fleet_version
            for step in range(args.steps):
                t0 = time.monotonic()
                trajectories = await run_episodes(
                    client,
                    "scripted",
                    PROMPTS,
                    sampling,
                    tokenizer=tokenizer,
                    env_kwargs={"turns": TURNS},
                    n=args.group_size,
                    max_turns=TURNS,
                    progress=False,
                )
                t_gen = time.monotonic() - t0
                made = [v for t in trajectories for v, m in zip(t.weight_versions, t.loss_mask, strict=True) if m]
                versions = sorted(set(made))
                on_policy = versions == [version]
                complete = all(t.finish_reason == "done" and t.num_turns == TURNS for t in trajectories)
                mask_exact = all(mask_is_exact(t, args.max_tokens) for t in trajectories)
                turn_rewards = [
                    sum(t.rewards[k] for t in trajectories if len(t.rewards) > k) / len(trajectories)
                    for k in range(TURNS)
                ]
                mean_reward = sum(t.reward / max(1, t.num_turns) for t in trajectories) / len(trajectories)

                # off the event loop, so the client keeps answering the broker's heartbeats
                mismatch, clipped = await asyncio.to_thread(learn, trajectories)

                report = await client.update_weights(bf16_tensors(model), transport="shm", pause="wait")
                synced = (
                    report.version == version + 1
                    and len(report.workers_updated) == args.workers
                    and not report.workers_evicted
                )
                version = report.version
                steps.append(
                    {
                        "step": step,
                        "reward": mean_reward,
                        "turn_rewards": turn_rewards,
                        "episodes": len(trajectories),
                        "complete": complete,
                        "finish_reasons": sorted({t.finish_reason for t in trajectories}),
                        "tokens": sum(len(t.token_ids) for t in trajectories),
                        "model_tokens": sum(sum(t.loss_mask) for t in trajectories),
                        "generated_tokens": sum(s.end - s.start for t in trajectories for s in t.turns),
                        "mask_exact": mask_exact,
                        "sampled_versions": versions,
                        "on_policy": on_policy,
                        "synced": synced,
                        "version": report.version,
                        "workers_updated": len(report.workers_updated),
                        "sync_seconds": report.seconds,
                        "generate_seconds": t_gen,
                        "logprob_mismatch": mismatch,
                        "clip_fraction": clipped,
                        "seconds": time.monotonic() - started - startup,  # since training began
                    }
                )
                ok = on_policy and synced and complete and mask_exact
                flags = "" if ok else f"  !! {on_policy=} {versions} {synced=} {complete=} {mask_exact=}"
                turns = " ".join(f"{r:.2f}" for r in turn_rewards)
                print(
                    f"step {step:3d}  reward {mean_reward:.3f} (turns {turns})  sync {report.seconds:.2f} s"
                    f"  version {report.version}  (generate {t_gen:.2f} s, |dlogp| {mismatch:.4f},"
                    f" step {time.monotonic() - t0:.2f} s){flags}",
                    flush=True,
                )
    total = time.monotonic() - started
    rewards = [s["reward"] for s in steps]
    k = min(3, len(rewards))
    syncs = [s["sync_seconds"] for s in steps]
    return {
        "steps": len(steps),
        "workers": args.workers,
        "seed": args.seed,
        "group_size": args.group_size,
        "prompts": len(PROMPTS),
        "turns": TURNS,
        "max_tokens": args.max_tokens,
        "lr": args.lr,
        "reward_start": sum(rewards[:k]) / k if k else math.nan,
        "reward_end": sum(rewards[-k:]) / k if k else math.nan,
        "crossing_step": next((s["step"] for s in steps if s["reward"] >= CROSSING), None),
        "crossing_seconds": next((s["seconds"] for s in steps if s["reward"] >= CROSSING), None),
        "rewards": rewards,
        "on_policy_steps": sum(s["on_policy"] for s in steps),
        "synced_steps": sum(s["synced"] for s in steps),
        "complete_steps": sum(s["complete"] for s in steps),
        "mask_exact_steps": sum(s["mask_exact"] for s in steps),
        "final_version": steps[-1]["version"] if steps else 0,
        "logprob_mismatch_max": max((s["logprob_mismatch"] for s in steps), default=0.0),
        "startup_seconds": startup,
        "train_seconds": total - startup,
        "total_seconds": total,
        "sync_seconds_mean": sum(syncs) / len(syncs) if syncs else math.nan,
        "per_step": steps,
    }


def _print_logs(workdir: str) -> None:
    for log in sorted(Path(workdir).glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()[-30:]
        print(f"--- last lines of {log.name} ---", *lines, sep="\n", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a CI timeout, a supervisor) unwinds like Ctrl-C, so the cluster stops its
    # workers: they run in sessions of their own and would outlive a killed parent.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with tempfile.TemporaryDirectory(prefix="zmq-rollout-grpo-mt-") as workdir:
        try:
            result = asyncio.run(train(args, workdir))
        except BaseException:
            _print_logs(workdir)
            raise
    n = result["steps"]
    counts = ("on_policy_steps", "synced_steps", "complete_steps", "mask_exact_steps")
    ok = all(result[c] == n for c in counts)
    print(
        f"[grpo] reward {result['reward_start']:.3f} -> {result['reward_end']:.3f} over {n} steps"
        f" (>= {CROSSING} from step {result['crossing_step']}); {result['synced_steps']}/{n} steps synced,"
        f" {result['on_policy_steps']} on-policy, {result['mask_exact_steps']} with exact masks;"
        f" sync {result['sync_seconds_mean']:.2f} s mean; {result['total_seconds']:.0f} s in all"
        f" ({result['startup_seconds']:.0f} s start-up)"
    )
    summary = {k: v for k, v in result.items() if k != "per_step"}
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print("RESULT " + json.dumps(summary), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
