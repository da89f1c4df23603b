"""Latency: job latency at the broker and the workers, vLLM's token latencies."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from .panels import WORKER, Query, dashboard, graph, quantiles


def latency() -> db.Dashboard:
    vllm_phases = [
        ("vllm:e2e_request_latency_seconds", "end to end"),
        ("vllm:request_queue_time_seconds", "queued"),
        ("vllm:request_prefill_time_seconds", "prefill"),
        ("vllm:request_decode_time_seconds", "decode"),
    ]
    return dashboard(
        "latency",
        "Latency",
        "Percentiles of job latency at the broker and the workers, and of vLLM's token latencies.",
        [
            graph(
                "Job latency (broker)",
                "Submit to final result, per completed job, as the broker measures it (p50, p90, p99).",
                "s",
                quantiles("zmq_rollout_job_latency_seconds"),
            ),
            graph(
                "Queue wait (broker)",
                "Submit to dispatch, per job attempt: time a job waits for a worker with free credits.",
                "s",
                quantiles("zmq_rollout_queue_wait_seconds"),
            ),
            graph(
                "Job latency (workers)",
                "Job start to final result on the workers, all workers together (p50, p90, p99).",
                "s",
                quantiles("zmq_rollout_worker_job_latency_seconds"),
            ),
            graph(
                "Job latency p90 per worker process",
                "Job start to final result, p90, per worker /metrics endpoint (a worker's own metrics carry "
                "no worker label: its scrape instance tells it apart).",
                "s",
                quantiles("zmq_rollout_worker_job_latency_seconds", by="instance", qs=(0.9,)),
            ),
            graph(
                "Time to first token (vLLM)",
                "Request arrival to first token in the selected workers' engines (p50, p90, p99).",
                "s",
                quantiles("vllm:time_to_first_token_seconds", selector=WORKER),
            ),
            graph(
                "Inter-token latency (vLLM)",
                "Time between consecutive output tokens in the selected workers' engines (p50, p90, p99).",
                "s",
                quantiles("vllm:inter_token_latency_seconds", selector=WORKER),
            ),
            graph(
                "Time to first token p90 per worker (vLLM)",
                "Request arrival to first token, p90, per worker: a slow engine stands out.",
                "s",
                quantiles("vllm:time_to_first_token_seconds", by="worker", selector=WORKER, qs=(0.9,)),
            ),
            graph(
                "Request phases p90 (vLLM)",
                "Per finished request, p90: end to end, queued inside vLLM, prefill, decode.",
                "s",
                [
                    Query(q.expr, f"{label} p90")
                    for histogram, label in vllm_phases
                    for q in quantiles(histogram, selector=WORKER, qs=(0.9,))
                ],
            ),
        ],
    )
