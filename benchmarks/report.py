"""The printed report of ``broker_throughput.py``: tables, ratios, goals and a RESULT line."""

from __future__ import annotations

import json
import os
import platform
import statistics
from typing import Any

BATCH = 64  # jobs per message in the batched cases
BATCH_WINDOW = 4  # messages in flight per client, batched
SINGLE_WINDOW = 64  # messages (= jobs) in flight per client, unbatched
HTTP_WINDOW = 64  # POSTs the HTTP baseline's one client keeps in flight, of 1 or BATCH requests each
# Issue 12's goals, all measured in one run.
GOAL_UNBATCHED_VS_PROXY = 0.5
GOAL_BATCHED_JOBS_PER_S = 250_000
GOAL_BATCHED_VS_HTTP = 3.0
GOAL_BATCHED_US_PER_JOB = 3.0
GOAL_ADDED_VS_PROXY = 1.5  # broker-added p50 over zmq.proxy-added p50

LATENCY_METHOD = """\
Broker-added latency, method: one client keeps ONE job in flight and times each round trip
(send SUBMIT -> receive its FINAL; the job asks for no ACCEPTED unless --ack, then it is skipped).
  broker  path: client DEALER -> broker -> EchoWorkerDouble (1 worker, own process) -> back
  direct  path: client DEALER -> a ROUTER running the echo double's logic (decode SUBMIT,
                build the fake result, encode FINAL) -> back; no broker, one hop fewer
broker-added = percentile(broker path) - percentile(direct path), for p50 and p99 (a
difference of percentiles, not a percentile of differences). It includes the extra TCP hop
and process wake-up, which the zmq.proxy reference below (raw 100 B, proxy vs. a direct
ROUTER echo) isolates: what any broker process costs before running a line of Python."""


def harness_ceiling(row: dict[str, Any], cores: int) -> tuple[float, float] | None:
    """What the test doubles of a case allow, whatever the broker: their CPU per job (the
    clients' and the echo workers' cores over the jobs per second, in us) and the jobs per
    second that ``cores`` would give them with a broker that cost nothing. None when the case
    has no such figures (HTTP has no workers; a case with no completed job or no CPU)."""
    cpu = row["cpu_cores"]
    if row["jobs_per_s"] <= 0 or "workers" not in cpu:
        return None
    doubles_us = (cpu["workers"] + cpu["clients"]) / row["jobs_per_s"] * 1e6
    return (doubles_us, cores * 1e6 / doubles_us) if doubles_us > 0 else None


def jobs_in_flight(row: dict[str, Any]) -> int:
    """The jobs a case keeps in flight: its clients times the messages each keeps in flight
    times the jobs a message carries (the HTTP baseline: one client, ``--http-window`` POSTs)."""
    return int(row["clients"] * row["messages_in_flight_per_client"] * row["jobs_per_message"])


def in_flight_note(best: dict[str, Any] | None, http: dict[str, Any] | None) -> str:
    """How the 3x comparison's two cases differ in jobs in flight, when they do."""
    if not best or not http or jobs_in_flight(best) == jobs_in_flight(http):
        return ""
    return (
        f"; jobs in flight: {jobs_in_flight(best):,} in {best['case']}, {jobs_in_flight(http):,} over HTTP "
        f"(--batch-window sets the broker's, --http-window HTTP's)"
    )


def percentile_us(samples: list[int], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000


def _find(rows: list[dict[str, Any]], kind: str, clients: int, workers: int, batched: bool) -> dict[str, Any] | None:
    for row in rows:
        if (row["kind"], row["clients"], row["workers"], row["jobs_per_message"] > 1) == (
            kind,
            clients,
            workers,
            batched,
        ):
            return row
    return None


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    return round(a["jobs_per_s"] / b["jobs_per_s"], 3) if a and b and b["jobs_per_s"] else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return platform.processor() or "?"


def doubles_line(args: Any) -> str:
    """How the broker cases' worker doubles (``--doubles``) were laid out."""
    if args.doubles == "lean":
        return (
            f"lean worker doubles, TEST DOUBLES that answer every job at once (no model) from a byte template, "
            f"{args.credits} credits each, spread over up to {args.worker_procs} processes of one thread; the "
            "clients' SUBMITs are byte templates too, their answers counted from headers"
        )
    return (
        "EchoWorkerDouble, a TEST DOUBLE that answers every job instantly (no model), "
        f"{args.credits} credits each, as threads spread over up to {args.worker_procs} processes "
        f"(64 workers = {args.worker_procs} processes x {64 // args.worker_procs} threads)"
    )


def clients_share_processes(args: Any) -> bool:
    """Whether the batched broker and Curve cases run their clients several to a process
    (``broker_throughput.client_fleets``): with lean doubles and ``--batched-client-procs``."""
    return args.doubles == "lean" and bool(args.batched_client_procs)


def clients_line(args: Any) -> str:
    """How the broker cases' clients were laid out (``broker_throughput.client_fleets``)."""
    procs = args.batched_client_procs
    if not clients_share_processes(args):
        return "one process each"
    return (
        f"one process each, but the batched broker and Curve cases': in {procs} process{'es' if procs > 1 else ''} "
        "of one thread serving their sockets (as HTTP's one client process)"
    )


def report(
    rows: list[dict[str, Any]],
    latency: dict[str, list[int]],
    args: Any,
    elapsed: float,
    pairs: list[dict[str, Any]] | None = None,
    floor: list[float] | None = None,
    rounds: list[dict[str, list[int]]] | None = None,
) -> None:
    """The full run's tables, ratios and goal verdicts; ``pairs``: ``--goal-pairs``' runs;
    ``floor``: the scheduler and codec alone, in us/job, at the run's start and end (``floor_line``);
    ``rounds``: ``--latency-rounds``' rounds (the first is ``latency``), for ``latency_rounds_line``."""
    print()
    print(
        f"machine: {os.cpu_count()} cores ({_cpu_model()}), Python {platform.python_version()}; "
        f"mode: {'quick' if args.quick else 'default'} ({args.warmup} s warm-up + {args.duration} s measured "
        f"per case); total {elapsed:.0f} s"
    )
    print(f"workers: {doubles_line(args)}; zmq.proxy's workers: raw DEALER echo threads, spread the same way")
    print(
        f"clients: {clients_line(args)}; unbatched = {SINGLE_WINDOW} one-job messages in flight per client, "
        f"batched = {args.batch_window} messages x {BATCH} jobs in flight per client; "
        "HTTP: 1 aiohttp process, "
        f"{args.http_window} POSTs in flight (1 or {BATCH} requests per POST); prompts: 100 bytes"
    )
    if rows:
        print("\nthroughput (round trips: job submitted -> its result back at the client)")
        head = (f"{'case':<40} {'jobs/s':>10}  {'server':>6} {'workers':>7} {'clients':>7} {'other':>6}"
                f"  {'server us/job':>13}  {'msgs/job':>8}  errors")  # fmt: skip
        print(head)
        print("-" * len(head))
        for r in rows:
            cpu = r["cpu_cores"]
            roles = " ".join(
                f"{cpu.get(role, 0):>{w}.2f}" for role, w in (("server", 6), ("workers", 7), ("clients", 7))
            )
            m = r.get("broker_messages_per_job")
            print(
                f"{r['case']:<40} {r['jobs_per_s']:>10,}  {roles} {cpu['other']:>6.2f}  "
                f"{r['server_cpu_us_per_job']:>13.2f}  {'' if m is None else f'{m:.3f}':>8}  {r['errors']}"
            )
        print(
            "server/workers/clients: CPU cores each role used while measured (1.00 = one core busy); "
            "server = the broker, zmq.proxy or uvicorn.\nother: CPU used by processes outside this "
            "benchmark at the same time (another load on the machine makes every figure lower).\n"
            "server us/job: the server's CPU time per completed job (moves less with other load than jobs/s).\n"
            "msgs/job: messages the broker read and sent per completed job (zmq_rollout_broker_messages_total); "
            "a job alone costs 4, 64 jobs that travel together 4/64 = 0.0625."
        )
        busy = [r["case"] for r in rows if r["cpu_cores"]["other"] > 0.2]
        if busy:
            print(f"WARNING: other load above 0.2 cores during {len(busy)} cases: {', '.join(busy)}")

    lat: dict[str, dict[str, float]] = {}
    if latency:
        print(f"\nround-trip latency, one job in flight (us){', first round' if rounds and len(rounds) > 1 else ''}")
        print(f"{'path':<12} {'p50':>8} {'p99':>8} {'n':>7}")
        lat = percentiles(latency)
        for path, samples in latency.items():
            print(f"{path:<12} {lat[path]['p50']:>8.1f} {lat[path]['p99']:>8.1f} {len(samples):>7}")
        print(LATENCY_METHOD)
    added, proxy_added = added_latency(lat)
    if added:
        print(f"broker-added latency: p50 {added['p50']} us, p99 {added['p99']} us")
    if proxy_added:
        print(f"zmq.proxy-added latency (reference): p50 {proxy_added['p50']} us, p99 {proxy_added['p99']} us")

    ratios: dict[str, float | None] = {}
    for n in (1, 8):
        ratios[f"broker_unbatched/proxy_unbatched_{n}c{n}w"] = _ratio(
            _find(rows, "broker", n, n, False), _find(rows, "proxy", n, n, False)
        )
        ratios[f"broker_batched/proxy_batched_{n}c{n}w"] = _ratio(
            _find(rows, "broker", n, n, True), _find(rows, "proxy", n, n, True)
        )
    http_batched = _find(rows, "http", 1, 0, True)
    broker_batched = [r for r in rows if r["kind"] == "broker" and r["jobs_per_message"] > 1]
    best_batched = max(broker_batched, key=lambda r: r["jobs_per_s"], default=None)
    ratios["broker_batched_1c1w/http_batched"] = _ratio(_find(rows, "broker", 1, 1, True), http_batched)
    ratios["broker_batched_best/http_batched"] = _ratio(best_batched, http_batched)
    ratios["broker_unbatched_1c1w/http_unbatched"] = _ratio(
        _find(rows, "broker", 1, 1, False), _find(rows, "http", 1, 0, False)
    )
    for n in (1, 8):  # what CurveZMQ costs: the same case with keys on both ports
        for batched, label in ((False, "unbatched"), (True, "batched")):
            ratios[f"curve_{label}/broker_{label}_{n}c{n}w"] = _ratio(
                _find(rows, "curve", n, n, batched), _find(rows, "broker", n, n, batched)
            )
    if rows:
        print("\nratios")
        for name, value in ratios.items():
            print(f"  {name:<42} {'n/a' if value is None else f'{value:.3f}'}")

    unbatched = [v for k, v in ratios.items() if k.startswith("broker_unbatched/proxy")]
    goals = {
        "unbatched_ge_50pct_of_proxy": (
            all(v is not None and v >= GOAL_UNBATCHED_VS_PROXY for v in unbatched)
            if any(v is not None for v in unbatched)
            else None
        ),
        "batched_ge_250k_jobs_per_s": best_batched["jobs_per_s"] >= GOAL_BATCHED_JOBS_PER_S if best_batched else None,
        "batched_ge_3x_http": (
            ratios["broker_batched_best/http_batched"] >= GOAL_BATCHED_VS_HTTP
            if ratios["broker_batched_best/http_batched"] is not None
            else None
        ),
        "batched_le_3us_per_job": (
            best_batched["server_cpu_us_per_job"] <= GOAL_BATCHED_US_PER_JOB if best_batched else None
        ),
        "added_p50_le_1_5x_proxy": (
            added["p50"] <= GOAL_ADDED_VS_PROXY * proxy_added["p50"] if added and proxy_added else None
        ),
    }
    verdict = {True: "MET", False: "NOT MET", None: "not measured"}
    print("\ngoals (issue 12)")
    shares = ", ".join("n/a" if v is None else f"{v:.0%}" for v in unbatched)
    print(
        f"  broker unbatched >= {GOAL_UNBATCHED_VS_PROXY:.0%} of zmq.proxy unbatched (1c x 1w and 8c x 8w): "
        f"{verdict[goals['unbatched_ge_50pct_of_proxy']]} ({shares})"
    )
    best = f"{best_batched['jobs_per_s']:,} jobs/s, {best_batched['case']}" if best_batched else "n/a"
    print(
        f"  broker batched >= {GOAL_BATCHED_JOBS_PER_S:,} jobs/s (best of the matrix): "
        f"{verdict[goals['batched_ge_250k_jobs_per_s']]} ({best})"
    )
    ceiling = harness_ceiling(best_batched, os.cpu_count() or 1) if best_batched else None
    if ceiling is not None:
        print(
            f"    (its clients and echo workers, test doubles, used {ceiling[0]:.1f} us of CPU per job: on these "
            f"{os.cpu_count()} cores they allow at most {ceiling[1]:,.0f} jobs/s with a broker that cost nothing)"
        )
    vs_http = ratios["broker_batched_best/http_batched"]
    print(
        f"  broker batched >= {GOAL_BATCHED_VS_HTTP:.0f}x the HTTP endpoint's batched rate: "
        f"{verdict[goals['batched_ge_3x_http']]} ({'n/a' if vs_http is None else f'{vs_http:.2f}x'}"
        f"{in_flight_note(best_batched, http_batched)})"
    )
    goals["batched_ge_3x_http_pairs_median"] = goal_pairs_line(pairs or [])
    us = f"{best_batched['server_cpu_us_per_job']} us" if best_batched else "n/a"
    print(
        f"  broker CPU per job, batched (best case) <= {GOAL_BATCHED_US_PER_JOB:.0f} us: "
        f"{verdict[goals['batched_le_3us_per_job']]} ({us}; includes its busy polling)"
    )
    if floor:
        print(floor_line(floor, best_batched["server_cpu_us_per_job"] if best_batched else None))
    ratio = f"{added['p50'] / proxy_added['p50']:.2f}x" if added and proxy_added and proxy_added["p50"] > 0 else "n/a"
    met = verdict[goals["added_p50_le_1_5x_proxy"]]
    print(
        f"  broker-added p50 <= {GOAL_ADDED_VS_PROXY}x zmq.proxy-added p50: {met} "
        f"({added.get('p50', 'n/a')} us vs {proxy_added.get('p50', 'n/a')} us: {ratio})"
    )
    rounds_added = [added_latency(percentiles(r)) for r in rounds or []]
    goals["added_p50_le_1_5x_proxy_rounds_median"] = latency_rounds_line(rounds_added)
    result = {
        "mode": "quick" if args.quick else "default",
        "duration_s": args.duration,
        "cpus": os.cpu_count(),
        "workers": f"{args.doubles} doubles (test doubles)",
        "throughput": rows,
        "latency_us": lat,
        "broker_added_latency_us": added,
        "proxy_added_latency_us": proxy_added,
        "ratios": ratios,
        "goals": goals,
        "goal_pairs": pairs or [],
        "latency_rounds": [{"broker_added": a, "proxy_added": p} for a, p in rounds_added],
        "doubles_ceiling_jobs_per_s": None if ceiling is None else round(ceiling[1]),
        "in_process_us_per_job": [round(v, 3) for v in floor or []],
        "elapsed_s": round(elapsed, 1),
    }
    print("RESULT " + json.dumps(result, separators=(",", ":")))


def floor_line(floor: list[float], through_sockets: float | None) -> str:
    """What the machine charged, during this run, for the goal's case's scheduler and codec alone
    (``floor``: us/job at the run's start and end, ``broker_throughput.in_process_floor``), against
    the 3 us budget and the broker's CPU per job through sockets. The same code has measured
    1.9-2.2 us/job there on a quiet machine and 3.7-5.9 on a slow one: a run's absolute figures
    compare with another run's only where these agree."""
    worst = max(floor)
    line = (
        f"    (the same scheduler and codec alone, in one process, as 8c x 64w loads them: "
        f"{', '.join(f'{v:.2f}' for v in floor)} us/job at the run's start and end; "
        f"{worst / GOAL_BATCHED_US_PER_JOB:.2f}x the budget"
    )
    if through_sockets:
        line += f"; through sockets the best batched case took {through_sockets / min(floor):.2f}x that"
    if min(floor) > GOAL_BATCHED_US_PER_JOB:
        line += ": on this machine now, the budget is out of reach before any socket"
    return line + ")"


def percentiles(latency: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """Each latency path's p50 and p99, in us, from its round trips in ns."""
    return {path: {"p50": percentile_us(s, 0.5), "p99": percentile_us(s, 0.99)} for path, s in latency.items()}


def added_latency(lat: dict[str, dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """What the broker adds (its path less the direct one) and what zmq.proxy adds (its path
    less the raw direct one), p50 and p99 in us; each {} where a path is missing."""

    def less(path: str, base: str) -> dict[str, float]:
        if not {path, base} <= lat.keys():
            return {}
        return {q: round(lat[path][q] - lat[base][q], 1) for q in ("p50", "p99")}

    return less("broker", "direct"), less("proxy", "raw-direct")


def latency_rounds_line(rounds: list[tuple[dict[str, float], dict[str, float]]]) -> bool | None:
    """Print the latency goal's verdict over ``--latency-rounds``' rounds, each given as its
    ``added_latency``: each round's broker-added p50 over its zmq.proxy-added p50, and their
    median; return it (None: fewer than two rounds, or no round with both figures). One round
    decides nothing: the proxy-added p50 of one run moved from 43 to 153 us between runs
    minutes apart (twenty-sixth session)."""
    if len(rounds) < 2:
        return None
    ratios = [a["p50"] / b["p50"] for a, b in rounds if a and b and b["p50"] > 0]
    if not ratios:
        return None
    median = _median(ratios)
    met = median <= GOAL_ADDED_VS_PROXY
    each = ", ".join(f"{r:.2f}x" for r in ratios)
    print(f"    over {len(ratios)} rounds: {'MET' if met else 'NOT MET'} (median {median:.2f}x; rounds {each})")
    return met


def goal_pairs_line(pairs: list[dict[str, Any]]) -> bool | None:
    """Print the 3x goal's verdict over ``--goal-pairs``' pairs (their median ratio); return it
    (None: no pairs ran)."""
    ratios = [r["ratio"] for r in pairs if r["ratio"] is not None]
    if not ratios:
        return None
    median = _median(ratios)
    met = median >= GOAL_BATCHED_VS_HTTP
    each = ", ".join(f"{r:.2f}x" for r in ratios)
    cpu = ", ".join(f"{r['http_us_per_job'] / r['broker_us_per_job']:.2f}x" for r in pairs if r["broker_us_per_job"])
    print(
        f"    over {len(ratios)} more pairs ({pairs[0]['broker_case']} and HTTP batched, back to back): "
        f"{'MET' if met else 'NOT MET'} (median {median:.2f}x; pairs {each}; "
        f"server CPU per job, HTTP's over the broker's: {cpu})"
    )
    return met


# -- --baseline-ref --------------------------------------------------------------------------
def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _cmp(before: list[float], after: list[float]) -> dict[str, Any]:
    """Medians of both sides, their ratio, and the lowest and highest ratio of single pairs."""
    b, a = _median(before), _median(after)
    # A difference of percentiles (broker-added) can come out negative on a loaded machine: no ratio then.
    pairs = [y / x for x, y in zip(before, after, strict=True) if x > 0 and y > 0]
    return {
        "before": round(b, 2),
        "after": round(a, 2),
        "ratio": round(a / b, 3) if a > 0 and b > 0 else None,
        "pair_ratios": [round(r, 3) for r in pairs],
        "before_runs": before,
        "after_runs": after,
    }


def _range(c: dict[str, Any]) -> str:
    r = c["pair_ratios"]
    return f"{min(r):.2f}-{max(r):.2f}" if r else "n/a"


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def report_comparison(
    cases: list[dict[str, Any]],
    latency: dict[str, list[dict[str, float]]],
    scheduler: dict[str, list[float]],
    meta: dict[str, Any],
    args: Any,
    elapsed: float,
) -> None:
    """The ``--baseline-ref`` report: per case, before / after / after over before."""
    print()
    print(
        f"machine: {os.cpu_count()} cores ({_cpu_model()}), Python {platform.python_version()}; mode: "
        f"{'quick' if args.quick else 'default'} ({args.warmup} s warm-up + {args.duration} s measured per run, "
        f"{args.latency_count} round trips per latency run); total {elapsed:.0f} s; 1-minute load average "
        f"{meta['load_avg_1m'][0]} at the start, {meta['load_avg_1m'][1]} at the end"
    )
    print(f"before: {meta['before']}\nafter:  {meta['after']}")
    for line in meta["checks"]:
        print(f"  {line}")
    print(
        f"Each case ran {args.repeats} times as a pair (before and after back to back, alternating which goes "
        f"first), with the same clients and {args.doubles} worker doubles (this checkout's) for both; figures are "
        "medians over the pairs, after/before is median over median, 'pairs' the lowest and highest ratio "
        "of single pairs (the noise)."
    )
    out: dict[str, Any] = {"cases": [], "latency_us": {}, "scheduler_us_per_job": None}
    if scheduler.get("before"):
        c = out["scheduler_us_per_job"] = _cmp(scheduler["before"], scheduler["after"])
        print(
            "\nscheduler alone, in process (no sockets): SUBMIT of 64 decoded, submit + dispatch, FINAL decoded, "
            "worker_final;\nus of CPU per job, the best of several samples per run (descheduled time not counted)"
        )
        print(f"{'':<22} {'before':>9} {'after':>9} {'after/before':>12} {'pairs':>10}")
        print(f"{'us per job':<22} {c['before']:>9.2f} {c['after']:>9.2f} {_x(c['ratio']):>12} {_range(c):>10}")
    if cases:
        head = (f"{'case':<40} {'jobs/s before':>13} {'after':>9} {'after/before':>12} {'pairs':>10}"
                f"  {'broker us/job before':>20} {'after':>7} {'ratio':>6}  {'other':>5}  errors")  # fmt: skip
        print("\nthroughput (jobs/s; broker us/job = the broker's CPU time per completed job)")
        print(head)
        print("-" * len(head))
        for case in cases:
            runs = case["before"] + case["after"]
            jobs = _cmp([r["jobs_per_s"] for r in case["before"]], [r["jobs_per_s"] for r in case["after"]])
            us = _cmp(
                [r["server_cpu_us_per_job"] for r in case["before"]],
                [r["server_cpu_us_per_job"] for r in case["after"]],
            )
            other = _median([r["cpu_cores"]["other"] for r in runs])
            errors = sum(r["errors"] for r in runs)
            print(
                f"{case['case']:<40} {jobs['before']:>13,.0f} {jobs['after']:>9,.0f} {_x(jobs['ratio']):>12} "
                f"{_range(jobs):>10}  {us['before']:>20.2f} {us['after']:>7.2f} {_x(us['ratio']):>6}  "
                f"{other:>5.2f}  {errors}"
            )
            out["cases"].append(
                {"case": case["case"], "jobs_per_s": jobs, "server_cpu_us_per_job": us, "other_cores": other}
                | {"errors": errors}
            )
        print(
            "other: CPU cores used by processes outside this benchmark while measured (median of the case's "
            "runs; above ~0.2 every figure is lower and noisier on a 2-core machine)."
        )
        busy = sum(r["cpu_cores"]["other"] > 0.2 for c in cases for r in c["before"] + c["after"])
        total = sum(len(c["before"]) + len(c["after"]) for c in cases)
        if busy:
            print(f"WARNING: other load above 0.2 cores during {busy} of {total} runs: read the ratios with the pairs")
    if latency.get("before"):
        print("\nbroker round-trip latency, one job in flight (us; broker-added = broker path - direct path)")
        print(f"{'':<22} {'before':>9} {'after':>9} {'after/before':>12} {'pairs':>10}")
        for q in ("p50", "p99"):
            rows = {
                f"broker path {q}": ([x[q] for x in latency["before"]], [x[q] for x in latency["after"]]),
                f"broker-added {q}": (
                    [x[q] - d[q] for x, d in zip(latency["before"], latency["direct"], strict=True)],
                    [x[q] - d[q] for x, d in zip(latency["after"], latency["direct"], strict=True)],
                ),
            }
            for name, (b, a) in rows.items():
                c = _cmp(b, a)
                out["latency_us"][name.replace(" ", "_")] = c
                print(f"{name:<22} {c['before']:>9.1f} {c['after']:>9.1f} {_x(c['ratio']):>12} {_range(c):>10}")
        direct = {q: _median([d[q] for d in latency["direct"]]) for q in ("p50", "p99")}
        out["latency_us"]["direct"] = direct
        print(f"{'direct path (no broker)':<22} p50 {direct['p50']:.1f}, p99 {direct['p99']:.1f} (median of the pairs)")
    result = {
        "mode": "baseline-ref " + ("quick" if args.quick else "default"),
        "duration_s": args.duration,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        **meta,
        **out,
        "elapsed_s": round(elapsed, 1),
    }
    print("RESULT " + json.dumps(result, separators=(",", ":")))
