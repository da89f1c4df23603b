"""Engines: vLLM's own statistics per worker: KV cache, prefix cache, batch, tokens, preemptions."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from .panels import RATE, WORKER, Query, dashboard, graph, single


def engines() -> db.Dashboard:
    def per_worker(metric: str, legend: str = "{{worker}}", *, rate: bool = False) -> Query:
        series = f"{metric}{{{WORKER}}}"
        if rate:
            series = f"rate({series}[{RATE}])"
        return Query(f"sum by (worker) ({series})", legend)

    def fleet_rate(metric: str) -> Query:
        return Query(f"sum(rate({metric}{{{WORKER}}}[{RATE}]))", "all workers")

    return dashboard(
        "engines",
        "Engines",
        "vLLM's own statistics, per worker engine: KV cache, prefix cache, batch, tokens, preemptions.",
        [
            single(
                "Generation tokens/s",
                "Tokens generated per second by the selected workers' engines together.",
                "count:tokens/s",
                fleet_rate("vllm:generation_tokens_total"),
            ),
            single(
                "KV-cache usage (mean)",
                "KV-cache usage averaged over the selected engines.",
                "percentunit",
                Query(f"avg(vllm:kv_cache_usage_perc{{{WORKER}}})", "mean"),
            ),
            single(
                "Requests running",
                "Requests in the selected engines' running batches.",
                "short",
                Query(f"sum(vllm:num_requests_running{{{WORKER}}})", "running"),
            ),
            single(
                "Requests waiting",
                "Requests waiting inside the selected engines to be scheduled (the broker's credits keep this low).",
                "short",
                Query(f"sum(vllm:num_requests_waiting{{{WORKER}}})", "waiting"),
                red_above=1,
            ),
            graph(
                "KV-cache usage per worker",
                "The share of each engine's KV cache in use; near 1 the scheduler preempts requests.",
                "percentunit",
                [Query(f"max by (worker) (vllm:kv_cache_usage_perc{{{WORKER}}})", "{{worker}}")],
                max_value=1,
            ),
            graph(
                "Prefix-cache hit rate per worker",
                "Prefix-cache hits over queries, in tokens. A weight sync resets the prefix cache, so the rate "
                "drops after each round.",
                "percentunit",
                [
                    Query(
                        f"sum by (worker) (rate(vllm:prefix_cache_hits_total{{{WORKER}}}[{RATE}])) / "
                        f"sum by (worker) (rate(vllm:prefix_cache_queries_total{{{WORKER}}}[{RATE}]))",
                        "{{worker}}",
                    )
                ],
                max_value=1,
            ),
            graph(
                "Requests running and waiting per worker",
                "Requests in each engine's running batch and waiting to be scheduled; weight-sync pauses show "
                "as gaps in running.",
                "short",
                [
                    per_worker("vllm:num_requests_running", "{{worker}} running"),
                    per_worker("vllm:num_requests_waiting", "{{worker}} waiting"),
                ],
            ),
            graph(
                "Preemptions/s per worker",
                "Requests preempted by vLLM's scheduler per second (the KV cache was full): they are "
                "recomputed later, which costs throughput.",
                "cps",
                [per_worker("vllm:num_preemptions_total", rate=True)],
            ),
            graph(
                "Prompt tokens/s per worker",
                "Prefill tokens processed per second by each engine.",
                "count:tokens/s",
                [per_worker("vllm:prompt_tokens_total", rate=True), fleet_rate("vllm:prompt_tokens_total")],
            ),
            graph(
                "Generation tokens/s per worker",
                "Tokens generated per second by each engine.",
                "count:tokens/s",
                [per_worker("vllm:generation_tokens_total", rate=True), fleet_rate("vllm:generation_tokens_total")],
            ),
        ],
    )
