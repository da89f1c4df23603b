"""Weight sync: rounds, steps, bytes moved, evictions, versions, staleness."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from .panels import RARE, RATE, WORKER, Query, dashboard, graph, quantiles, single


def weight_sync() -> db.Dashboard:
    rounds = "zmq_rollout_sync_rounds_total"
    staleness = "zmq_rollout_sample_staleness_versions"
    samples = f"sum(rate({staleness}_count[{RATE}]))"
    return dashboard(
        "weight-sync",
        "Weight sync",
        "Weight-sync rounds, their steps and throughput, weight versions, and how stale samples are.",
        [
            single(
                "Fleet weight version",
                "The newest version a round committed (0 after a broker start, until the next round).",
                "none",
                Query("max(zmq_rollout_fleet_weight_version)", "fleet"),
            ),
            single(
                "Rounds in progress",
                "Weight-sync rounds running now (0 or 1).",
                "short",
                Query("sum(zmq_rollout_sync_rounds_in_progress)", "in progress"),
            ),
            single(
                "Rounds committed",
                "Rounds committed within the dashboard's time range (increase() extrapolates: rounded).",
                "short",
                Query(f'round(sum(increase({rounds}{{outcome="committed"}}[$__range])))', "committed"),
            ),
            single(
                "Rounds not committed",
                "Rounds that failed, were aborted or lost their trainer, within the dashboard's time range.",
                "short",
                Query(f'round(sum(increase({rounds}{{outcome!="committed"}}[$__range])))', "not committed"),
                red_above=1,
            ),
            graph(
                "Round duration",
                "A round's begin to its end (p50, p90, p99 over the last 10 minutes).",
                "s",
                quantiles("zmq_rollout_sync_round_duration_seconds", window=RARE),
            ),
            graph(
                "Rounds by outcome (10 min)",
                "Rounds ended in the last 10 minutes: committed, failed (a commit failed or went unanswered), "
                "aborted (by the trainer), trainer_lost (the broker aborted it).",
                "short",
                [Query(f"sum by (outcome) (increase({rounds}[{RARE}]))", "{{outcome}}")],
                bars=True,
            ),
            graph(
                "Step duration p50 by step",
                "A step's CONTROL to its SYNC_REPLY (every member answered or was evicted), median, per step "
                "name, over the last 10 minutes.",
                "s",
                quantiles("zmq_rollout_sync_step_duration_seconds", by="step", window=RARE, qs=(0.5,)),
            ),
            graph(
                "Step duration p99 by step",
                "As the median beside it, at p99: a slow member holds the barrier of its step.",
                "s",
                quantiles("zmq_rollout_sync_step_duration_seconds", by="step", window=RARE, qs=(0.99,)),
            ),
            graph(
                "Weight bytes/s moved",
                "Weight bytes loaded by workers per second, by step (bucket size x members that loaded it), "
                "averaged over the rate window: the load a sync puts on the hosts.",
                "Bps",
                [Query(f"sum by (step) (rate(zmq_rollout_sync_bytes_total[{RATE}]))", "{{step}}")],
                stack=True,
            ),
            graph(
                "Bandwidth while syncing",
                "Weight bytes loaded per second of step time, by step, over the last 10 minutes: all "
                "members together, while a step runs (the GB/s a round achieves).",
                "Bps",
                [
                    Query(
                        f"sum by (step) (increase(zmq_rollout_sync_bytes_total[{RARE}])) / "
                        f"sum by (step) (increase(zmq_rollout_sync_step_duration_seconds_sum[{RARE}]))",
                        "{{step}}",
                    )
                ],
            ),
            graph(
                "Evictions and step failures (10 min)",
                "Members lost during rounds in the last 10 minutes, by reason, and members that answered a "
                "step with ok: false, by step.",
                "short",
                [
                    Query(
                        f"sum by (reason) (increase(zmq_rollout_sync_evictions_total[{RARE}]))", "evicted: {{reason}}"
                    ),
                    Query(
                        f"sum by (step) (increase(zmq_rollout_sync_step_failures_total[{RARE}]))", "failed: {{step}}"
                    ),
                ],
                bars=True,
            ),
            graph(
                "Weight version: fleet and workers",
                "The fleet's version (the newest committed) and the version each worker holds.",
                "none",
                [
                    Query("max(zmq_rollout_fleet_weight_version)", "fleet"),
                    Query(f"max by (worker) (zmq_rollout_worker_weight_version{{{WORKER}}})", "{{worker}}"),
                ],
            ),
            graph(
                "Versions behind the fleet per worker",
                "The fleet's version minus each worker's: a worker behind is stale and takes no jobs.",
                "none",
                [
                    Query(
                        "scalar(max(zmq_rollout_fleet_weight_version)) - "
                        f"max by (worker) (zmq_rollout_worker_weight_version{{{WORKER}}})",
                        "{{worker}}",
                    )
                ],
            ),
            graph(
                "Sample staleness (versions)",
                "Per completed sample: the fleet's version when its result passed the broker minus the "
                "sample's (oldest token's) version (p50, p90, p99). wait-mode syncs keep it at 0.",
                "none",
                quantiles(staleness),
            ),
            graph(
                "Stale samples and samples across a sync",
                "Of the completed samples: the share 1 or more versions behind, 2 or more (an alert above 5%), "
                "and the share that ran across a sync (tokens from more than one version).",
                "percentunit",
                [
                    Query(f'1 - sum(rate({staleness}_bucket{{le="0.0"}}[{RATE}])) / {samples}', ">= 1 behind"),
                    Query(f'1 - sum(rate({staleness}_bucket{{le="1.0"}}[{RATE}])) / {samples}', ">= 2 behind"),
                    Query(f"sum(rate(zmq_rollout_sample_span_versions_count[{RATE}])) / {samples}", "across a sync"),
                ],
                max_value=1,
            ),
            graph(
                "Sample span (versions)",
                "Per completed sample that crossed a sync: its newest token's version minus its oldest "
                "(p50, p90, p99).",
                "none",
                quantiles("zmq_rollout_sample_span_versions"),
            ),
        ],
    )
