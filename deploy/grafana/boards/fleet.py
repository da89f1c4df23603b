"""Fleet: workers, credits, queues, job outcomes, errors, lost workers, heartbeats."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from .panels import CLIENT, RARE, RATE, WORKER, Query, dashboard, graph, single


def fleet() -> db.Dashboard:
    rate = f"[{RATE}]"
    return dashboard(
        "fleet",
        "Fleet",
        "Workers, credits, queues and job outcomes, as the broker sees them.",
        [
            single(
                "Ready workers",
                "Workers registered and taking jobs (not syncing, not behind the fleet's version).",
                "short",
                Query('sum(zmq_rollout_workers{state="ready"})', "ready"),
            ),
            single(
                "Credits free",
                "The share of all announced credits (sequences the engines run at once) not in use.",
                "percentunit",
                Query("sum(zmq_rollout_credits_free) / sum(zmq_rollout_credits)", "free"),
            ),
            single(
                "Queued jobs",
                "Jobs waiting in the selected clients' queues for a worker.",
                "short",
                Query(f"sum(zmq_rollout_queue_depth{{{CLIENT}}})", "queued"),
            ),
            single(
                "Completed jobs/s",
                "Jobs whose final result reached their client, per second.",
                "count:jobs/s",
                Query(f'sum(rate(zmq_rollout_jobs_total{{outcome="completed"}}{rate}))', "completed"),
            ),
            graph(
                "Workers by state",
                "Registered workers: ready, syncing (in a weight-sync round) or stale (behind the fleet's "
                "version: no jobs until a round brings them up to date).",
                "short",
                [Query("sum by (state) (zmq_rollout_workers)", "{{state}}")],
                stack=True,
            ),
            graph(
                "Credits",
                "Credits announced by all workers (each worker's max_num_seqs) and those not taken by running jobs.",
                "short",
                [Query("sum(zmq_rollout_credits)", "total"), Query("sum(zmq_rollout_credits_free)", "free")],
            ),
            graph(
                "Broker busy",
                "The share of each heartbeat interval the broker spent on its own work (reading, scheduling, "
                "sending; not waiting). Near 1 the broker, not the engines, sets the pace. packing is 1 while it "
                "packs jobs onto fewer workers to send fewer messages (from 0.5 until below 0.25; pack_step).",
                "percentunit",
                [
                    Query("max(zmq_rollout_broker_busy_ratio)", "busy"),
                    Query("max(zmq_rollout_broker_packing)", "packing"),
                ],
                max_value=1,
            ),
            graph(
                "Credits per worker",
                "Credits each worker's running jobs take (used) and those it has free.",
                "short",
                [
                    Query(f"sum by (worker) (zmq_rollout_worker_credits_used{{{WORKER}}})", "{{worker}} used"),
                    Query(f"sum by (worker) (zmq_rollout_worker_credits_free{{{WORKER}}})", "{{worker}} free"),
                ],
            ),
            graph(
                "Queue depth per client",
                "Jobs queued at the broker, per client: they wait for a worker with free credits.",
                "short",
                [Query(f"sum by (client) (zmq_rollout_queue_depth{{{CLIENT}}})", "{{client}}")],
                stack=True,
            ),
            graph(
                "Running jobs per client",
                "Jobs running on workers, per client.",
                "short",
                [Query(f"sum by (client) (zmq_rollout_running_jobs{{{CLIENT}}})", "{{client}}")],
                stack=True,
            ),
            graph(
                "Jobs/s by outcome",
                "Jobs per second by outcome: submitted, completed, failed, cancelled, requeued (a worker was "
                "lost), rejected, dropped because their client left, late replies, expired workers.",
                "count:jobs/s",
                [Query(f"sum by (outcome) (rate(zmq_rollout_jobs_total{rate}))", "{{outcome}}")],
            ),
            graph(
                "Errors/s",
                "Failed and rejected jobs, messages refused as malformed (by reason) and failed CurveZMQ "
                "handshakes (by port and reason), per second. Any of these is worth a look at the broker's log.",
                "cps",
                [
                    Query(f'sum(rate(zmq_rollout_jobs_total{{outcome="failed"}}{rate}))', "jobs failed"),
                    Query(
                        f'sum by (outcome) (rate(zmq_rollout_jobs_total{{outcome=~"rejected_.*"}}{rate}))',
                        "jobs {{outcome}}",
                    ),
                    Query(
                        f"sum by (reason) (rate(zmq_rollout_malformed_messages_total{rate}))", "malformed: {{reason}}"
                    ),
                    Query(
                        f"sum by (port, reason) (rate(zmq_rollout_auth_failures_total{rate}))",
                        "auth {{port}}: {{reason}}",
                    ),
                ],
            ),
            graph(
                "Workers lost by reason (10 min)",
                "Workers purged in the last 10 minutes: expired (missed heartbeats), evicted (a sync step's "
                "deadline), disconnected (said DISCONNECT), unroutable (a send failed). Their jobs are requeued.",
                "short",
                [Query(f"sum by (reason) (increase(zmq_rollout_workers_lost_total[{RARE}]))", "{{reason}}")],
                bars=True,
            ),
            graph(
                "Heartbeat age per worker",
                "Seconds since the broker last heard from each worker; past heartbeat_interval_s x "
                "worker_liveness the worker is purged and its jobs requeued.",
                "s",
                [Query(f"max by (worker) (zmq_rollout_worker_heartbeat_age_seconds{{{WORKER}}})", "{{worker}}")],
            ),
            graph(
                "Joins and requeues caused per worker (10 min)",
                "Per worker, in the last 10 minutes: times it registered (3 or more is flapping: an alert) and "
                "jobs requeued because a connection of it was lost.",
                "short",
                [
                    Query(
                        f"sum by (worker) (increase(zmq_rollout_worker_joins_total{{{WORKER}}}[{RARE}]))",
                        "{{worker}} joins",
                    ),
                    Query(
                        f"sum by (worker) (increase(zmq_rollout_worker_requeued_jobs_total{{{WORKER}}}[{RARE}]))",
                        "{{worker}} requeues",
                    ),
                ],
                bars=True,
            ),
        ],
    )
