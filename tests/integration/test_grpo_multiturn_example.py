"""examples/grpo_multiturn.py end to end: GRPO over 3-turn episodes against real vLLM CPU workers learns.

The example runs as a user would run it (a subprocess; vLLM spawns processes of its own) for
STEPS steps, and its ``--json-out`` result is checked: the mean reward per turn rose by a
wide margin, every step's weight sync reached the worker with the next version, every model
token of every episode came from the version synced the step before, every episode ran its
3 turns, the loss mask covered exactly the generated turns, and vLLM's logprobs agree with
the trainer's float32 recomputation over whole conversations.

Margins: in 4 runs on a 2-core machine loaded 4-20-fold (seeds 0-2 for 20 steps with one or
two workers, seed 0 for these 12) the reward went from 0.009-0.012 (mean of steps 0-2) to
0.56-0.68 at this test's end (mean of steps 9-11), crossing 0.3 at step 8 every time; each
turn's mean at step 11 was 0.69-0.82. Requiring 0.3 (and 5x the start) at the end, and 0.3
of every turn at the last step, leaves room for a slower learner (sampling is unseeded, so
every run is a new draw). vLLM's logprobs agreed with the trainer's float32 recomputation
within 0.006 at worst, so 0.05 still flags a sync or a mask that went wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_multiturn.py"
STEPS = 12
EPISODES = 8 * 8  # prompts x G
MODEL_TOKENS = EPISODES * 3 * 12  # episodes x turns x max_tokens, every turn full (ignore_eos)
TIMEOUT = 600  # seconds; a run took 141-245 s on 2 busy cores, 100-200 s of it start-up


def test_grpo_multiturn_example_learns_on_policy_with_exact_masks(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--seed", "0", "--json-out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the example stops its cluster (its workers run in their own sessions)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(f"the example ran past {TIMEOUT} s; its output:\n{output[-6000:]}")
    log = output[-6000:]
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{log}"
    assert out.exists(), log
    result = json.loads(out.read_text())
    printed = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert len(printed) == 1, log
    assert json.loads(printed[0].removeprefix("RESULT "))["reward_end"] == result["reward_end"]

    steps = result["per_step"]
    assert result["steps"] == len(steps) == STEPS, log
    # every step synced, to the next version; every episode complete, on-policy, exactly masked
    for key in ("synced_steps", "on_policy_steps", "complete_steps", "mask_exact_steps"):
        assert result[key] == STEPS, f"{key}: {result[key]}\n{log}"
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1)), log
    assert all(s["sampled_versions"] == [s["version"] - 1] for s in steps), log
    assert all(s["workers_updated"] == 1 and s["episodes"] == EPISODES for s in steps), log
    assert all(s["finish_reasons"] == ["done"] for s in steps), log
    # the mask sums to the turns' generated lengths, and those are all full turns
    assert all(s["model_tokens"] == s["generated_tokens"] == MODEL_TOKENS for s in steps), log
    # the conversations hold more than the model's tokens (prompt, environment, chat template)
    assert all(s["tokens"] > 2 * MODEL_TOKENS for s in steps), log
    assert all(len(s["turn_rewards"]) == 3 for s in steps), log
    assert result["logprob_mismatch_max"] < 0.05, log

    start, end = result["reward_start"], result["reward_end"]
    assert start < 0.05, f"the random model already says 'a' {start:.3f} of the time:\n{log}"
    assert end >= 0.3 and end >= 5 * start, f"reward {start:.3f} -> {end:.3f}:\n{log}"
    assert result["crossing_step"] is not None, log
    # every turn learned, not only the episode on average
    assert all(r >= 0.3 for r in steps[-1]["turn_rewards"]), log
    assert result["sync_seconds_mean"] > 0 and result["total_seconds"] > 0
