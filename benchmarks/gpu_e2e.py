"""End-to-end throughput: direct vLLM ``AsyncLLM`` vs. the same engine behind the service.

One run, one GPU, one workload, two phases in turn (each in its own process, so they never
share GPU memory):

(a) ``direct``:  ``AsyncLLM.from_engine_args`` with exactly the engine arguments the worker
    builds (``zmq_rollout.workers.engine.engine_args``) and the same vLLM ``SamplingParams``
    (``vllm_sampling``); every prompt of a batch submitted at once.
(b) ``service``: ``LocalCluster`` (broker thread + one real worker process) and the client;
    every prompt of a batch submitted at once (one SUBMIT message).

Tokens/s = generated tokens / wall time of the whole batch, measured after one warm-up
batch; the same batches (prompts, per-prompt seeds) run on both sides. The ratio
service/direct is the service's efficiency (goal >= 0.98).

The model is a random-weight Qwen2 of the real Qwen2.5-0.5B shape (hidden 896, 24 layers,
14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied embeddings, bf16), built
locally with the byte-level tokenizer of ``zmq_rollout.tiny_model``; nothing is fetched.

    python3 benchmarks/gpu_e2e.py                       # the H200 run (TRITON_ATTN, eager)
    python3 benchmarks/gpu_e2e.py --tiny --num-prompts 16 --max-tokens 16 --max-num-seqs 8 \\
        --gpu-memory-utilization 0.1 --attention-backend ""      # quick CPU check

Prints both figures, the ratio and one ``RESULT {json}`` line (also written to --json-out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()

# Qwen2.5-0.5B's shape.
SHAPE_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936}  # fmt: skip
# Qwen2.5-7B's shape, tied embeddings as in weight_sync.py's "7b" (about 14.1 GB bf16).
SHAPE_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "intermediate_size": 18944, "vocab_size": 152064}  # fmt: skip
# Small enough for a CPU check; same big vocabulary (sampled ids beyond the tokenizer's 259).
SHAPE_TINY = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "intermediate_size": 256, "vocab_size": 151936}  # fmt: skip
SHAPES = {"0.5b": SHAPE_05B, "7b": SHAPE_7B, "tiny": SHAPE_TINY}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def log(msg: str) -> None:
    print(f"[gpu_e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
def make_model(path: Path, shape: dict[str, int], max_position_embeddings: int = 32768, seed: int = 0) -> Path:
    """Random Qwen2 of ``shape`` + the byte-level tokenizer of tiny_model, saved to ``path``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from zmq_rollout.tiny_model import SPECIAL_TOKENS, make_tiny_model

    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny_model(Path(tmp) / "tok")  # for its tokenizer files only
        for name in TOKENIZER_FILES:
            if (tiny / name).exists():
                shutil.copy(tiny / name, path / name)
    tok_size = 256 + len(SPECIAL_TOKENS)
    assert shape["vocab_size"] >= tok_size, (shape["vocab_size"], tok_size)
    eot_id, im_end_id = 256, 258
    config = Qwen2Config(**shape, max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
                         bos_token_id=eot_id, eos_token_id=im_end_id, pad_token_id=eot_id)  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.monotonic()
    torch.manual_seed(seed)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a 7B shape in fp32 would need 30 GB first
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(dtype)
    model.generation_config = GenerationConfig(bos_token_id=eot_id, eos_token_id=im_end_id, pad_token_id=eot_id)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, safe_serialization=True)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["vocab_size"] >= tok_size
    log(f"model: {params / 1e6:.1f} M parameters, built on {device} and saved to {path} "
        f"in {time.monotonic() - started:.1f} s")  # fmt: skip
    return path


# ---------------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------------
def batches(args: argparse.Namespace) -> list[tuple[str, list[list[int]], list[int], int]]:
    """[(label, prompts, seeds, max_tokens)]: one warm-up batch, then ``repeats`` measured."""
    import random

    out = []
    for b in range(args.repeats + 1):
        rng = random.Random(1000 + b)
        prompts = [[rng.randrange(3, 256) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
        seeds = [b * 100_000 + i for i in range(args.num_prompts)]
        label = "warmup" if b == 0 else f"run{b}"
        out.append((label, prompts, seeds, warmup_tokens(args) if b == 0 else args.max_tokens))
    return out


def warmup_tokens(args: argparse.Namespace) -> int:
    """The warm-up batch's max_tokens: ``--warmup-max-tokens``, else the measured batches' own,
    so that every kernel they need is compiled before one is timed. A 64-token warm-up before
    128- and 192-token batches left Triton compiling the attention and sampling kernels during
    the first pair (twenty-sixth session)."""
    return args.max_tokens if args.warmup_max_tokens is None else args.warmup_max_tokens


def worker_config(args: argparse.Namespace) -> Any:
    from zmq_rollout.config import WorkerConfig

    return WorkerConfig(model=args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gib=args.kv_cache_gib,
                        enforce_eager=args.eager, extra_credits=args.extra_credits,
                        attention_backend=args.attention_backend or None, seed=0, name="bench-worker")  # fmt: skip


def worker_overrides(cfg: Any) -> dict[str, Any]:
    """The service's worker settings from ``worker_config``, as ``LocalCluster(worker_overrides=)``
    takes them."""
    keys = ("gpu_memory_utilization", "kv_cache_gib", "max_model_len", "max_num_seqs", "extra_credits",
            "enforce_eager", "attention_backend", "seed")  # fmt: skip
    return {key: getattr(cfg, key) for key in keys}


def sampling(args: argparse.Namespace, seed: int | None, max_tokens: int) -> Any:
    from zmq_rollout.protocol import SamplingParams

    return SamplingParams(temperature=args.temperature, max_tokens=max_tokens, seed=seed, ignore_eos=True)


def summarize(label: str, tokens: int, wall: float, expected: int) -> dict[str, Any]:
    row = {"batch": label, "tokens": tokens, "wall_s": round(wall, 4), "tokens_per_s": round(tokens / wall, 1)}
    log(f"  {label}: {tokens} tokens in {wall:.3f} s = {tokens / wall:,.0f} tok/s"
        + ("" if tokens == expected else f"  (EXPECTED {expected})"))  # fmt: skip
    return row


# ---------------------------------------------------------------------------------------------
# phase (a): direct AsyncLLM
# ---------------------------------------------------------------------------------------------
async def run_direct(args: argparse.Namespace) -> dict[str, Any]:
    import vllm
    from vllm.v1.engine.async_llm import AsyncLLM

    from zmq_rollout.workers.engine import engine_args
    from zmq_rollout.workers.sampling import vllm_sampling

    eargs = engine_args(worker_config(args))
    shown = {k: getattr(eargs, k) for k in ("model", "attention_backend", "enforce_eager", "gpu_memory_utilization",
                                             "max_num_seqs", "max_model_len", "enable_prefix_caching",
                                             "logprobs_mode", "max_logprobs", "seed", "dtype")}  # fmt: skip
    log(f"direct: vLLM {vllm.__version__}; AsyncEngineArgs {shown}")
    started = time.monotonic()
    llm = AsyncLLM.from_engine_args(eargs)
    startup = time.monotonic() - started
    log(f"direct: engine ready in {startup:.1f} s")
    rows, outputs = [], {}
    try:
        for label, prompts, seeds, max_tokens in batches(args):

            async def one(
                i: int, ids: list[int], seed: int, label: str = label, max_tokens: int = max_tokens
            ) -> list[int]:
                params = vllm_sampling(sampling(args, seed, max_tokens), stream=False)
                final = None
                async for out in llm.generate({"prompt_token_ids": ids}, params, f"{label}-{i}"):
                    final = out
                assert final is not None and final.finished
                return list(final.outputs[0].token_ids)

            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(one(i, ids, s) for i, (ids, s) in enumerate(zip(prompts, seeds, strict=True)))
            )
            wall = time.perf_counter() - t0
            rows.append(summarize(label, sum(map(len, results)), wall, len(prompts) * max_tokens))
            outputs[label] = results
    finally:
        llm.shutdown()
    return {"vllm_version": vllm.__version__, "startup_s": round(startup, 1), "batches": rows, "outputs": outputs,
            "engine_args": {k: str(v) for k, v in shown.items()}}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# phase (b): through the service
# ---------------------------------------------------------------------------------------------
async def _service_batches(args: argparse.Namespace, address: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from zmq_rollout.client import AsyncRolloutClient, make_job

    rows, outputs = [], {}
    batch_size = max(512, args.num_prompts)
    async with AsyncRolloutClient(address, timeout_s=args.batch_timeout, batch_size=batch_size) as client:
        for label, prompts, seeds, max_tokens in batches(args):
            jobs = [make_job(f"{label}-{i}", ids, sampling(args, seed, max_tokens)) for i, (ids, seed) in
                    enumerate(zip(prompts, seeds, strict=True))]  # fmt: skip
            t0 = time.perf_counter()
            handles = await client.submit_jobs(jobs)
            results = await asyncio.wait_for(asyncio.gather(*(h.future for h in handles)), args.batch_timeout)
            wall = time.perf_counter() - t0
            tokens = [list(r.samples[0].token_ids) for r in results]
            rows.append(summarize(label, sum(map(len, tokens)), wall, len(prompts) * max_tokens))
            outputs[label] = tokens
    return rows, outputs


def run_service(args: argparse.Namespace) -> dict[str, Any]:
    from zmq_rollout.local import LocalCluster

    overrides = worker_overrides(worker_config(args))
    log(f"service: LocalCluster(num_workers=1, worker_overrides={overrides})")
    os.makedirs(args.log_dir, exist_ok=True)
    # worker_niceness=0: the worker competes for the CPU as the direct engine's process does.
    cluster = LocalCluster(args.model, num_workers=1, worker_overrides=overrides, log_dir=args.log_dir,
                           worker_niceness=0, broker_process=args.broker_process)  # fmt: skip
    started = time.monotonic()
    try:
        cluster.start(wait_s=args.start_timeout)
        startup = time.monotonic() - started
        log(f"service: worker registered in {startup:.1f} s; broker at {cluster.address}")
        rows, outputs = asyncio.run(_service_batches(args, cluster.address))
    finally:
        cluster.stop()
    return {"startup_s": round(startup, 1), "batches": rows, "outputs": outputs}


# ---------------------------------------------------------------------------------------------
# orchestration
# ---------------------------------------------------------------------------------------------
def gpu_info() -> dict[str, Any]:
    try:
        query = "--query-gpu=name,memory.total,memory.used,driver_version"
        out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
        name, total, used, driver = (x.strip() for x in out.stdout.splitlines()[0].split(","))
        return {"gpu": name, "memory_total_mib": int(total), "memory_used_mib": int(used), "driver": driver}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {"gpu": "none (CPU)"}


def wait_gpu_free(limit_mib: int = 2048, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        used = gpu_info().get("memory_used_mib")
        if used is None or used < limit_mib:
            return
        if time.monotonic() > deadline:
            log(f"warning: GPU still has {used} MiB in use after {timeout} s")
            return
        time.sleep(1.0)


def phase_argv(args: argparse.Namespace) -> list[str]:
    """``args`` as a command line again, for a phase's process: a flag per option, a bool as
    ``--x`` or ``--no-x`` (so every bool option is a ``BooleanOptionalAction``)."""
    argv: list[str] = []
    for key, value in vars(args).items():
        if key in ("phase", "phase_out"):
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def child(args: argparse.Namespace, phase: str, out: Path, timeout: float) -> dict[str, Any]:
    """Run one phase of this script in a fresh process; returns its JSON."""
    argv = [sys.executable, str(HERE), "--phase", phase, "--phase-out", str(out), *phase_argv(args)]
    log(f"phase {phase}: {' '.join(argv)}")
    started = time.monotonic()
    proc = subprocess.run(argv, timeout=timeout, check=False)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(
            f"phase {phase} failed with exit code {proc.returncode} after {time.monotonic() - started:.0f} s"
        )
    data = json.loads(out.read_text())
    data["phase_wall_s"] = round(time.monotonic() - started, 1)
    return data


def best(rows: list[dict[str, Any]], key: str = "tokens_per_s") -> float:
    return max(r[key] for r in rows if r["batch"] != "warmup")


def median(rows: list[dict[str, Any]], key: str = "tokens_per_s") -> float:
    return statistics.median(r[key] for r in rows if r["batch"] != "warmup")


SIDES = {"direct", "service", "direct_frozen"}
"""What ``--sides`` may name (benchmarks/e2e_pairs.py runs them)."""


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    sides = args.sides.split(",")
    if sides[:2] != ["direct", "service"] or len(set(sides)) != len(sides) or not set(sides) <= SIDES:
        # checked here, not minutes later when the pairs phase has built the model and both engines
        ap.error(f"--sides {args.sides!r}: direct,service first, then optionally direct_frozen")
    main_with(args)


def parser() -> argparse.ArgumentParser:
    """This script's options (each phase's process gets them back through ``phase_argv``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=False,
                    help="a tiny shape (hidden 128, 2 layers, same vocabulary) for a quick CPU check")  # fmt: skip
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES), help="the model's shape (--tiny: tiny)")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache per engine (default: vLLM's)")
    ap.add_argument("--model", default=None, help="use this model folder instead of building one")
    ap.add_argument("--work-dir", default="/tmp/gpu_e2e")
    ap.add_argument("--log-dir", default=None, help="worker logs (default WORK_DIR/logs)")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument(
        "--warmup-max-tokens",
        type=int,
        default=None,
        help="the warm-up batch's max_tokens (default: --max-tokens, so no kernel compiles in a timed batch)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="measured batches per side (after one warm-up)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument(
        "--extra-credits",
        type=int,
        default=0,
        help="the service's worker announces max_num_seqs + this many credits (WorkerConfig.extra_credits)",
    )
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--attention-backend", default="TRITON_ATTN", help='"" lets vLLM choose (CPU)')
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                    help="enforce_eager (default); --no-eager: torch.compile + CUDA graphs")  # fmt: skip
    ap.add_argument("--phases", default="direct,service",
                    help="direct and service phases in turn, each in its own process; or 'pairs': both alive in "
                         "one process, batches alternating (benchmarks/e2e_pairs.py)")  # fmt: skip
    ap.add_argument(
        "--sides",
        default="direct,service",
        help="pairs: the sides of each pair in turn: direct,service, then optionally direct_frozen (its heap frozen)",
    )
    ap.add_argument(
        "--vllm-metrics",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="pairs: the service's worker keeps vLLM's statistics, as a worker with --metrics-port does "
        "(default: it serves /metrics, read for its GC time, with --no-vllm-metrics)",
    )
    ap.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pairs: each hot process on physical cores of its own",
    )
    ap.add_argument(
        "--pin-swap",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="pairs: the service's processes on the cores direct's get by default, and direct's on the "
        "service's (does a gap between the sides follow the cores?)",
    )
    ap.add_argument(
        "--py-spy",
        default=None,
        metavar="PATH",
        help="pairs: sample the process serving each batch with this py-spy binary (the worker for the "
        "service, this process for direct), into LOG_DIR/profile-SIDE-BATCH.txt, its summary in the log "
        "(benchmarks/stack_samples.py)",
    )
    ap.add_argument(
        "--broker-process",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the service's broker in a process of its own (LocalCluster(broker_process=True)), "
        "not a thread of the client's process, whose garbage collections then stop it",
    )
    ap.add_argument("--phase-timeout", type=float, default=400.0)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--batch-timeout", type=float, default=300.0)
    ap.add_argument("--json-out", default=None, help="also write the RESULT json here")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--phase-out", default=None, help=argparse.SUPPRESS)
    return ap


def main_with(args: argparse.Namespace) -> None:
    work = Path(args.work_dir)
    args.log_dir = args.log_dir or str(work / "logs")
    if args.tiny:
        args.shape = "tiny"

    if args.phase == "make":
        make_model(Path(args.model), SHAPES[args.shape])
        Path(args.phase_out).write_text("{}")
        return
    if args.phase == "direct":
        Path(args.phase_out).write_text(json.dumps(asyncio.run(run_direct(args))))
        return
    if args.phase == "service":
        Path(args.phase_out).write_text(json.dumps(run_service(args)))
        return
    if args.phase == "pairs":
        from e2e_pairs import run_pairs

        Path(args.phase_out).write_text(json.dumps(asyncio.run(run_pairs(args))))
        return

    t_start = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    info = gpu_info()
    log(f"GPU: {info}")
    if args.model is None:
        args.model = str(work / f"qwen2-{args.shape}-shape-random")
        child(args, "make", work / "make.json", args.phase_timeout)
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    data: dict[str, dict[str, Any]] = {}  # "direct", "service", then "direct2", "service2", ...
    for phase in phases:
        key = phase
        while key in data:
            key = f"{phase}{sum(k.rstrip('0123456789') == phase for k in data) + 1}"
        wait_gpu_free()
        data[key] = child(args, phase, work / f"{key}.json", args.phase_timeout)

    workload = {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                "warmup_max_tokens": warmup_tokens(args), "repeats": args.repeats, "temperature": args.temperature,
                "ignore_eos": True, "seeds": "one per prompt", "max_num_seqs": args.max_num_seqs,
                "extra_credits": args.extra_credits,
                "max_model_len": args.max_model_len,
                "gpu_memory_utilization": args.gpu_memory_utilization,
                "attention_backend": args.attention_backend or None, "enforce_eager": args.eager,
                "kv_cache_gib": args.kv_cache_gib, "shape": args.shape}  # fmt: skip
    result: dict[str, Any] = {"gpu": info.get("gpu"), "driver": info.get("driver"), "workload": workload}
    if "pairs" in data:
        from e2e_pairs import report

        report(data["pairs"])
        result["pairs"] = data["pairs"]
    for phase, d in data.items():
        if phase.startswith("pairs"):
            continue
        result[phase] = {"startup_s": d["startup_s"], "phase_wall_s": d["phase_wall_s"],
                         "batches": d["batches"], "median_tokens_per_s": median(d["batches"]),
                         "best_tokens_per_s": best(d["batches"])}  # fmt: skip
    if "direct" in data:
        result["vllm_version"] = data["direct"]["vllm_version"]
        result["engine_args"] = data["direct"]["engine_args"]
    if "direct" in data and "service" in data:
        # Pool every measured batch of each kind (phases may repeat, e.g. direct,service,direct,service,
        # so that neither side profits from running second on a machine that is still warming up).
        pooled = {kind: [r for k, d in data.items() if k.rstrip("0123456789") == kind for r in d["batches"]]
                  for kind in ("direct", "service")}  # fmt: skip
        result["direct_median_tokens_per_s"] = median(pooled["direct"])
        result["service_median_tokens_per_s"] = median(pooled["service"])
        result["ratio_median"] = round(median(pooled["service"]) / median(pooled["direct"]), 4)
        result["ratio_best"] = round(best(pooled["service"]) / best(pooled["direct"]), 4)
        direct, service = data["direct"], data["service"]
        same = total = 0
        for label, outs in direct["outputs"].items():
            for a, b in zip(outs, service["outputs"].get(label, []), strict=False):
                total += 1
                same += a == b
        result["identical_sequences"] = f"{same}/{total}"
        print()
        print(f"GPU {result['gpu']}, vLLM {result.get('vllm_version')}, enforce_eager={args.eager}, "
              f"attention_backend={args.attention_backend or None}")  # fmt: skip
        print(f"workload: {args.num_prompts} prompts x {args.prompt_len} ids -> {args.max_tokens} tokens "
              f"(ignore_eos, temperature {args.temperature}, one seed per prompt), "
              f"max_num_seqs {args.max_num_seqs}; phases in order: {', '.join(data)}")  # fmt: skip
        for key, d in data.items():
            per = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in d["batches"] if r["batch"] != "warmup")
            print(f"  {key:8s}: median {result[key]['median_tokens_per_s']:>10,.0f} tok/s   (batches: {per}; "
                  f"engine start {d['startup_s']} s)")  # fmt: skip
        print(f"  pooled  : direct {result['direct_median_tokens_per_s']:,.0f} tok/s, "
              f"service {result['service_median_tokens_per_s']:,.0f} tok/s")  # fmt: skip
        print(f"  ratio service/direct: {result['ratio_median']:.2%} (median), {result['ratio_best']:.2%} (best); "
              f"goal >= 98% -> {'MET' if result['ratio_median'] >= 0.98 else 'NOT MET'}")  # fmt: skip
        print(f"  identical token sequences direct vs service (first of each): {result['identical_sequences']}")
    result["total_wall_s"] = round(time.monotonic() - t_start, 1)
    line = json.dumps(result, sort_keys=True)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print("RESULT " + line, flush=True)


if __name__ == "__main__":
    main()
