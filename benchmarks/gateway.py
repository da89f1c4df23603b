"""What the OpenAI gateway costs: requests/s and added latency of ``zmq-rollout gateway``
against the Python client, on the same broker with the same workers.

Every party is its own process on this machine: the broker (``zmq-rollout broker``), the
workers (``EchoWorkerDouble`` threads in one process: a **test double** that answers every
job at once with a fake result, so that what is measured is the path, not a model), the
gateway (``zmq-rollout gateway``), and this driver. The driver runs two modes one after the
other, each with ``--concurrency`` requests in flight (one prompt, n=1, max_tokens=4 each):

- ``client``: ``AsyncRolloutClient.generate`` straight to the broker;
- ``gateway``: ``POST /v1/completions`` through the gateway (aiohttp, kept-alive connections);
- ``http``: the HTTP baseline (``http_baseline.py``: FastAPI + uvicorn, pydantic models, one
  ``POST /generate`` per request, answered in the server itself with an echoed result): what
  an HTTP rollout server costs before it does any work, with no broker and no worker behind.

A request's latency is from its send to its whole answer. Prints a table, the ratios
(gateway / client, gateway / http), and a last line ``RESULT {json}``.

    python benchmarks/gateway.py            # 2 s warm-up + 10 s per mode
    python benchmarks/gateway.py --quick    # 0.5 s + 3 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from ports import free_port

PROMPT = "x" * 100


def run_doubles(backend: str, num: int, credits: int) -> None:
    from zmq_rollout.testing import EchoWorkerDouble

    doubles = [EchoWorkerDouble(backend, credits=credits, name=f"echo-{i}").start() for i in range(num)]
    signal.sigwait({signal.SIGTERM})
    for d in doubles:
        d.stop()


def run_http_baseline(port: int) -> None:
    """The HTTP baseline's server (benchmarks/http_baseline.py), on ``port``."""
    import uvicorn

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from http_baseline import make_app

    uvicorn.run(make_app(), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def drive(send: Any, concurrency: int, warmup_s: float, measure_s: float) -> dict[str, float]:
    latencies: list[float] = []
    start = time.perf_counter()
    begin, end = start + warmup_s, start + warmup_s + measure_s

    async def loop() -> None:
        while (now := time.perf_counter()) < end:
            await send()
            done = time.perf_counter()
            if now >= begin and done <= end:
                latencies.append(done - now)

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return {
        "requests_per_s": len(latencies) / measure_s,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * percentile(latencies, 0.99),
        "requests": len(latencies),
    }


async def client_mode(frontend: str, args: argparse.Namespace) -> dict[str, float]:
    from zmq_rollout import AsyncRolloutClient, SamplingParams

    sampling = SamplingParams(max_tokens=4)
    async with AsyncRolloutClient(frontend, name="bench-client") as client:

        async def send() -> None:
            (r,) = await client.generate([PROMPT], sampling)
            assert r.finish_reason

        return await drive(send, args.concurrency, args.warmup, args.seconds)


async def gateway_mode(url: str, args: argparse.Namespace) -> dict[str, float]:
    import aiohttp

    body = json.dumps({"prompt": PROMPT, "max_tokens": 4}).encode()
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def send() -> None:
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
                answer = await response.json()
                assert response.status == 200, answer
                assert answer["choices"][0]["finish_reason"]

        return await drive(send, args.concurrency, args.warmup, args.seconds)


async def http_mode(url: str, args: argparse.Namespace) -> dict[str, float]:
    import aiohttp

    ids = iter(range(1 << 62))
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def send() -> None:
            body = [{"job_id": f"b{next(ids):x}", "prompt": PROMPT, "sampling": {"max_tokens": 4}}]
            async with session.post(url, json=body) as response:
                answer = await response.json()
                assert response.status == 200, answer
                assert answer[0]["samples"][0]["finish_reason"]

        return await drive(send, args.concurrency, args.warmup, args.seconds)


def wait_http(url: str, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="0.5 s warm-up + 3 s per mode")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    parser.add_argument("--workers", type=int, default=2, help="echo worker doubles")
    parser.add_argument("--credits", type=int, default=64)
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.warmup = 3.0, 0.5
    frontend, backend = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    http_port, baseline_port = free_port(), free_port()
    cli = [sys.executable, "-m", "zmq_rollout.cli"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs: list[Any] = []
    try:
        procs.append(subprocess.Popen([*cli, "broker", "--frontend", frontend, "--backend", backend], **quiet))
        doubles = mp.get_context("spawn").Process(target=run_doubles, args=(backend, args.workers, args.credits))
        doubles.start()
        procs.append(doubles)
        procs.append(
            subprocess.Popen([*cli, "gateway", "--broker", frontend, "--port", str(http_port)], **quiet)  # type: ignore[arg-type]
        )
        baseline = mp.get_context("spawn").Process(target=run_http_baseline, args=(baseline_port,))
        baseline.start()
        procs.append(baseline)
        wait_http(f"http://127.0.0.1:{http_port}/health", 60)
        wait_http(f"http://127.0.0.1:{baseline_port}/health", 60)
        results = {
            "client": asyncio.run(client_mode(frontend, args)),
            "gateway": asyncio.run(gateway_mode(f"http://127.0.0.1:{http_port}/v1/completions", args)),
            "http": asyncio.run(http_mode(f"http://127.0.0.1:{baseline_port}/generate", args)),
        }
    finally:
        for proc in reversed(procs):
            if isinstance(proc, subprocess.Popen):
                proc.terminate()
                proc.wait(10)
            elif proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)
                proc.join(10)
    print(f"{args.concurrency} requests in flight, {args.workers} echo worker doubles, {args.seconds} s per mode")
    print(f"{'mode':<8} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for mode, r in results.items():
        print(f"{mode:<8} {r['requests_per_s']:>9.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}")
    c, g, h = results["client"], results["gateway"], results["http"]
    ratio = {
        "requests_per_s": g["requests_per_s"] / c["requests_per_s"],
        "added_p50_ms": g["p50_ms"] - c["p50_ms"],
        "added_p99_ms": g["p99_ms"] - c["p99_ms"],
    }
    versus_http = {
        "requests_per_s": g["requests_per_s"] / h["requests_per_s"],
        "added_p50_ms": g["p50_ms"] - h["p50_ms"],
        "added_p99_ms": g["p99_ms"] - h["p99_ms"],
    }
    print(
        f"gateway / client: {ratio['requests_per_s']:.2f}x the requests/s; "
        f"adds {ratio['added_p50_ms']:.2f} ms at p50, {ratio['added_p99_ms']:.2f} ms at p99"
    )
    print(
        f"gateway / http baseline: {versus_http['requests_per_s']:.2f}x the requests/s; "
        f"adds {versus_http['added_p50_ms']:.2f} ms at p50, {versus_http['added_p99_ms']:.2f} ms at p99 "
        "(the baseline answers in its own process; the gateway goes through the broker to a worker)"
    )
    print("RESULT " + json.dumps({"args": vars(args), **results, "ratio": ratio, "versus_http": versus_http}))


if __name__ == "__main__":
    main()
