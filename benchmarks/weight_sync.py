"""Weight-sync speed and memory: the trainer pushes a whole model into a real vLLM worker.

Two phases, each in its own process (so they never share GPU memory):

(a) ``engine``: vLLM with this repo's extension plus timing probes
    (``weight_sync_probe.LoadProbe``), no broker. On the engine's own device it times
    vLLM's ``model.load_weights`` (HF-named tensors already on the device), our worker's
    load path for one whole-model bucket, a raw copy into vLLM's parameter tensors, and a
    flat device-to-device copy of the same bytes: the baselines of this run.
(b) ``service``: ``LocalCluster`` (broker + one real worker) and a trainer holding an HF
    copy of the model on its device. For each transport and bucket size: one warm-up sync,
    then ``--syncs`` timed ``client.update_weights`` calls (end to end: planning, the
    round through the broker, pauses, transfer, post-load processing, commit). Then memory
    before and after ``--memory-syncs`` more syncs (GPU: device memory in use; both sides:
    resident memory of the worker's process tree and of the trainer).

Effective GB/s = model bytes / wall seconds of one sync (median). Ratios are against the
baselines measured in the same run.

    python benchmarks/weight_sync.py                        # CPU: shm and gloo, ~100M model
    python benchmarks/weight_sync.py --shape 1.5b --transports cuda_ipc,shm \\
        --bucket-mb 256,1024 --memory-syncs 100             # the H200 run (gpu/run_gpu_e2e.sh)

Prints a table and one ``RESULT {json}`` line (also written to --json-out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from gpu_e2e import make_model  # noqa: E402  (the same random Qwen2 builder)

SHAPES: dict[str, dict[str, int]] = {
    # A test-sized model: a few MB.
    "tiny": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
             "intermediate_size": 256, "vocab_size": 259},
    # ~100M parameters (~0.2 GB bf16): the CPU default.
    "100m": {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 2,
             "intermediate_size": 2816, "vocab_size": 4096},
    # Qwen2.5-0.5B and Qwen2.5-1.5B (3.09 GB bf16), random weights.
    "0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936},
    "1.5b": {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "intermediate_size": 8960, "vocab_size": 151936},
    # Qwen2.5-7B's shape, tied embeddings (14.1 GB bf16), random weights.
    "7b": {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "intermediate_size": 18944, "vocab_size": 152064},
}  # fmt: skip


def log(msg: str) -> None:
    print(f"[weight_sync {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _stats(times: list[float], nbytes: int) -> dict[str, float]:
    median = statistics.median(times)
    return {"median_s": median, "min_s": min(times), "gbps": nbytes / median / 1e9, "n": len(times)}


# ---------------------------------------------------------------------------------------------
# (a) engine probes
# ---------------------------------------------------------------------------------------------
def phase_engine(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM

    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process has touched CUDA already
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
    kwargs: dict[str, Any] = {
        "model": args.model_dir,
        "worker_extension_cls": "weight_sync_probe.LoadProbe",
        "enforce_eager": True,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": 1024,
        "max_num_seqs": 16,
    }
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    if not _cuda():
        kwargs["enable_chunked_prefill"] = False
    llm = LLM(**kwargs)
    try:
        (info,) = llm.collective_rpc("probe_prepare", args=(args.model_dir,))
        nbytes = info["checkpoint_bytes"]
        out: dict[str, Any] = {"info": info}
        reps = args.engine_reps
        if info["device"].startswith("cuda"):
            # On CPU the linear weights live prepacked in their kernels: a plain load_weights
            # or a raw parameter copy would not reach them (only the round path does).
            out["load_weights"] = _stats(llm.collective_rpc("probe_load_weights", args=(reps,))[0], nbytes)
            out["param_copy"] = _stats(llm.collective_rpc("probe_param_copy", args=(reps,))[0], nbytes)
        out["worker_round"] = _stats(llm.collective_rpc("probe_round", args=(reps,))[0], nbytes)
        out["flat_copy"] = _stats(llm.collective_rpc("probe_flat_copy", args=(nbytes, reps))[0], nbytes)
        llm.collective_rpc("probe_release")
        return out
    finally:
        del llm


# ---------------------------------------------------------------------------------------------
# (b) the service
# ---------------------------------------------------------------------------------------------
def _tree_rss_mib(pid: int) -> float:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return float("nan")
    total = 0
    for q in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += q.memory_info().rss
    return total / 2**20


def _memory(worker_pid: int) -> dict[str, float]:
    import psutil

    out = {"worker_rss_mib": _tree_rss_mib(worker_pid), "trainer_rss_mib": psutil.Process().memory_info().rss / 2**20}
    if _cuda():
        import torch

        free, total = torch.cuda.mem_get_info()
        out["gpu_used_mib"] = (total - free) / 2**20
        out["trainer_gpu_reserved_mib"] = torch.cuda.memory_reserved() / 2**20
    return out


def phase_service(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from zmq_rollout import RolloutClient, SamplingParams
    from zmq_rollout.config import BrokerConfig
    from zmq_rollout.local import LocalCluster

    cuda = _cuda()
    device = "cuda" if cuda else "cpu"
    overrides: dict[str, Any] = {
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": 1024,
        "max_num_seqs": 16,
        "attention_backend": args.attention_backend or None,
    }
    if cuda:
        overrides["gpus"] = "0"
    config = BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", worker_liveness=30)
    results: dict[str, Any] = {"runs": []}
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).to(device)
    with LocalCluster(args.model_dir, worker_overrides=overrides, broker_config=config, log_dir=args.work_dir) as c:
        worker_pid = c.workers["worker-0"].pid
        with RolloutClient(c.address, timeout_s=600) as client:
            plan = [(t, True) for t in args.transports.split(",")]
            if args.also_layerwise:
                plan.insert(1, (plan[0][0], False))
            memory_transports = args.memory_transports.split(",") if args.memory_transports else [plan[0][0]]
            for transport, direct in plan:
                for mb in [float(x) for x in args.bucket_mb.split(",")]:
                    bucket = int(mb * 2**20)
                    kw = {"transport": transport, "bucket_bytes": bucket, "timeout_s": 300, "direct_load": direct}
                    first = client.update_weights(model, **kw)
                    times, steps = [], {}
                    for _ in range(args.syncs):
                        report = client.update_weights(model, **kw)
                        times.append(report.seconds)
                        for op, sec in report.step_seconds.items():
                            steps[op] = steps.get(op, 0.0) + sec / args.syncs
                        # the trainer's own time: planning, packing not hidden by a step, the client
                        rest = report.seconds - sum(report.step_seconds.values())
                        steps["trainer"] = steps.get("trainer", 0.0) + rest / args.syncs
                    run = {"transport": transport, "direct_load": direct, "bucket_mb": mb, "buckets": first.num_buckets,
                           "bytes": first.bytes, "first_s": first.seconds, **_stats(times, first.bytes),
                           "step_ms": {op: round(sec * 1e3, 2) for op, sec in steps.items()}}  # fmt: skip
                    ms, gbps = run["median_s"] * 1e3, run["gbps"]
                    name = transport if direct else f"{transport}/layerwise"
                    log(f"{name:>18} bucket {mb:>7g} MiB x{first.num_buckets:<3} median {ms:8.1f} ms "
                        f"{gbps:7.2f} GB/s (first {first.seconds:.2f} s) steps(ms) {run['step_ms']}")  # fmt: skip
                    results["runs"].append(run)
                if args.memory_syncs and direct and transport in memory_transports:
                    bucket = int(float(args.bucket_mb.split(",")[-1]) * 2**20)
                    before = _memory(worker_pid)
                    started = time.monotonic()
                    for _ in range(args.memory_syncs):
                        client.update_weights(model, transport=transport, bucket_bytes=bucket, timeout_s=300)
                    wall = time.monotonic() - started
                    after = _memory(worker_pid)
                    results.setdefault("memory", []).append(
                        {
                            "transport": transport,
                            "syncs": args.memory_syncs,
                            "seconds": wall,
                            "before": before,
                            "after": after,
                        }
                    )
                    log(f"{transport:>8} memory over {args.memory_syncs} syncs ({wall:.1f} s): "
                        + ", ".join(f"{k} {before[k]:.0f}->{after[k]:.0f}" for k in before))  # fmt: skip
            # The service still serves, on the last version.
            final = client.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))[0]
            results["served_version"] = final.weight_version
            results["fleet_version"] = client.status().fleet_version
    # The trainer-side flat copy of the same bytes (the shm transport's own bound).
    nbytes = results["runs"][0]["bytes"] if results["runs"] else 0
    if nbytes:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        times = []
        for _ in range(5):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        results["trainer_flat_copy"] = _stats(times, nbytes)
    return results


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def run_phase(phase: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE), "--phase", phase, "--model-dir", args.model_dir, "--work-dir", args.work_dir,
           "--transports", args.transports, "--bucket-mb", args.bucket_mb, "--syncs", str(args.syncs),
           "--memory-syncs", str(args.memory_syncs), "--memory-transports", args.memory_transports,
           *(["--also-layerwise"] if args.also_layerwise else []), "--engine-reps", str(args.engine_reps),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--attention-backend", args.attention_backend]  # fmt: skip
    log(f"phase {phase}")
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        deadline = time.monotonic() + args.phase_timeout
        assert proc.stdout is not None
        for line in proc.stdout:  # stream, so a run cut short still shows what it measured
            if line.startswith("RESULT "):
                lines.append(line)
            else:
                print(line, end="", flush=True)
            if time.monotonic() > deadline:
                proc.kill()
                break
    if proc.returncode or not lines:
        raise SystemExit(f"phase {phase} failed (exit {proc.returncode})")
    return dict(json.loads(lines[-1].removeprefix("RESULT ")))


def report(res: dict[str, Any]) -> None:
    eng, svc = res.get("engine", {}), res.get("service", {})
    flat = eng.get("flat_copy", {}).get("gbps")
    lw = eng.get("load_weights", {}).get("gbps")
    print(f"\nmodel {res['shape']}: {res.get('bytes', 0) / 1e9:.3f} GB, device {res['device']}")
    for key in ("load_weights", "worker_round", "param_copy", "flat_copy"):
        if key in eng:
            s = eng[key]
            print(f"  engine {key:<14} {s['median_s'] * 1e3:9.2f} ms  {s['gbps']:8.1f} GB/s")
    for run in svc.get("runs", []):
        extra = ""
        if flat:
            extra += f"  {run['gbps'] / flat:6.1%} of flat copy"
        if lw:
            extra += f"  {run['gbps'] / lw:6.1%} of load_weights"
        label = run["transport"] + ("" if run.get("direct_load", True) else "/layerwise")
        print(f"  sync {label:>18} bucket {run['bucket_mb']:>7g} MiB x{run['buckets']:<3} "
              f"{run['median_s'] * 1e3:9.1f} ms  {run['gbps']:8.2f} GB/s{extra}")  # fmt: skip
    for mem in svc.get("memory", []):
        deltas = ", ".join(f"{k} {mem['before'][k]:.0f}->{mem['after'][k]:.0f}" for k in mem["before"])
        print(f"  memory {mem['transport']} over {mem['syncs']} syncs: {deltas}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="100m", choices=sorted(SHAPES))
    ap.add_argument("--transports", default=None, help="default: cuda_ipc,shm on a GPU; shm,gloo on CPU")
    ap.add_argument("--bucket-mb", default=None, help="comma-separated bucket sizes in MiB (default 64,1024)")
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--memory-syncs", type=int, default=None, help="default 100 on a GPU, 20 on CPU")
    ap.add_argument("--memory-transports", default="", help="transports to measure memory for (default: the first)")
    ap.add_argument("--also-layerwise", action="store_true", help="also time the first transport, direct_load=False")
    ap.add_argument("--engine-reps", type=int, default=5)
    ap.add_argument("--no-engine", action="store_true", help="skip the engine probes")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--attention-backend", default=os.environ.get("ZMQ_ROLLOUT_ATTENTION_BACKEND", ""))
    ap.add_argument("--phase-timeout", type=float, default=540)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    cuda = _cuda()
    args.transports = args.transports or ("cuda_ipc,shm" if cuda else "shm,gloo")
    args.bucket_mb = args.bucket_mb or "64,1024"
    args.memory_syncs = (100 if cuda else 20) if args.memory_syncs is None else args.memory_syncs
    args.gpu_memory_utilization = args.gpu_memory_utilization or (0.3 if cuda else 0.1)

    if args.phase:
        out = phase_engine(args) if args.phase == "engine" else phase_service(args)
        print("RESULT " + json.dumps(out), flush=True)
        return

    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="weight_sync-")
    args.model_dir = str(make_model(Path(args.work_dir) / f"qwen2-{args.shape}", SHAPES[args.shape]))
    res: dict[str, Any] = {"shape": args.shape, "device": "cuda" if cuda else "cpu", "args": vars(args)}
    if not args.no_engine:
        res["engine"] = run_phase("engine", args)
        res["bytes"] = res["engine"]["info"]["checkpoint_bytes"]
    res["service"] = run_phase("service", args)
    res["bytes"] = res.get("bytes") or res["service"]["runs"][0]["bytes"]
    report(res)
    print("RESULT " + json.dumps(res), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
