"""Chaos soak: clients submit without pause while workers, the broker and clients are killed.

    python benchmarks/chaos.py --workers echo    # 1,000 worker kills, 20 broker restarts: ~5 min
    python benchmarks/chaos.py --workers vllm    # real CPU vLLM workers, tiny model: ~14 min
    python benchmarks/chaos.py --workers echo --duration-s 40 --worker-kills 20 --broker-restarts 2   # CI

Every party is its own process (``chaos_parties.py`` holds them, ``chaos_roles.py`` is what
the forked ones run): the broker (``zmq-rollout broker`` on two fixed loopback ports); the
workers (``--workers echo``: one ``EchoWorkerDouble``, the *test double*, per process, forked
from a fork server; ``vllm``: ``zmq-rollout worker`` around a real CPU engine on a tiny local
model); the clients (the product's ``AsyncRolloutClient``, ``window`` jobs in flight each).
The script itself is the trainer: ``update_weights`` (shm, a random pause mode) every
``--sync-every-s``. A seeded timeline of faults runs meanwhile: SIGKILL a worker (a new one
starts at once; vllm: one that has served ``--min-serve-s``); SIGSTOP a worker and SIGCONT it
0.2 to 2 heartbeat expiries later; SIGKILL a client (its jobs are not counted; a new client
takes its place; never client 0, which so sees every broker restart and the warm-up);
SIGKILL the broker, down for up to ``--max-outage-s``, then started again on the same ports
(every other time while ``update_weights`` runs). Any worker that exits by itself (exit 4
after a round that died mid-load, ...) is counted and started again.

A broker restart is measured alone: stopped workers are continued and one worker at least
serves before the kill, and no other fault or sync comes in the ``2 x expiry + 1 s`` after
it. At the end the faults stop, every worker is brought back (and synced if stale), and each
surviving client waits for every job it ever submitted. Checked: each has exactly one answer,
a FINAL with its own prompt (``lost``: none, or an error; ``duplicated``: more than one FINAL
or ERROR reached the client, which would otherwise drop the second unseen); a sync fails only
if the broker was down during it; and, per broker restart, the jobs in flight at the restart
finish within the broker's start time + 2 x heartbeat expiry + the generation time (the
longest job latency of the calm warm-up, under the same load). Exit code 1 if any check fails.

``max_attempts`` (a job whose worker dies that many times in a row fails: a poison-pill
guard, 3 by default) is 100 here: workers die here a hundred times more often than in any
fleet, and a dead worker looks idle to the broker until it expires, so a few jobs would hit
3 by bad luck alone. ``--max-attempts 3`` shows how many.
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import math
import multiprocessing as mp
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling chaos_* modules

from chaos_parties import BrokerProcess, Clients, Fleet, SyncLog, Trainer, status, wait_for_fleet

from zmq_rollout import protocol as p

log = logging.getLogger("chaos")

MODES: dict[str, dict[str, Any]] = {
    "echo": {
        "duration_s": 300.0, "num_workers": 12, "worker_kills": 1000, "stops": 100, "broker_restarts": 20,
        "client_kills": 4, "clients": 3, "window": 64, "sync_every_s": 2.0, "max_tokens": 4,
        "broker_heartbeat_s": 0.2, "liveness": 10, "warmup_s": 5.0, "max_outage_s": 1.0, "drain_s": 60.0,
        "sync_timeout_s": 5.0, "start_timeout_s": 60.0, "min_serve_s": 0.0,
    },
    "vllm": {
        "duration_s": 600.0, "num_workers": 2, "worker_kills": 20, "stops": 6, "broker_restarts": 3,
        "client_kills": 1, "clients": 2, "window": 8, "sync_every_s": 20.0, "max_tokens": 32,
        "broker_heartbeat_s": 0.5, "liveness": 10, "warmup_s": 20.0, "max_outage_s": 2.0, "drain_s": 300.0,
        "sync_timeout_s": 60.0, "start_timeout_s": 300.0, "min_serve_s": 10.0,
    },
}  # fmt: skip
HELP = {
    "duration_s": "seconds of faults (after the warm-up)",
    "num_workers": "worker processes (each slot always has one running or starting)",
    "worker_kills": "SIGKILLs of workers",
    "stops": "SIGSTOPs of workers (SIGCONT 0.2 to 2 heartbeat expiries later)",
    "broker_restarts": "SIGKILLs of the broker, each started again on the same ports",
    "client_kills": "SIGKILLs of clients (a new client takes each one's place)",
    "clients": "client processes submitting without pause",
    "window": "jobs each client keeps in flight",
    "sync_every_s": "seconds between update_weights calls (jittered)",
    "max_tokens": "tokens per job",
    "broker_heartbeat_s": "the broker's heartbeat_interval_s (clients' too unless --client-heartbeat-s)",
    "liveness": "worker_liveness and the clients' broker_liveness (expiry = heartbeat x liveness)",
    "warmup_s": "seconds without faults first: their longest job latency is the generation time",
    "max_outage_s": "the broker stays down up to this long before it is started again",
    "drain_s": "at the end, how long the clients wait for their last jobs",
    "sync_timeout_s": "update_weights' timeout_s (per step)",
    "start_timeout_s": "how long workers may take to register",
    "min_serve_s": "a worker is killed only after it has served this long (vllm: engines start slowly)",
}


# -- the timeline ----------------------------------------------------------------------------
def timeline(args: argparse.Namespace, rng: random.Random, start: float) -> list[tuple[float, str]]:
    """Broker restarts evenly spaced (jittered); the other faults uniform over what is left
    once the quiet window after each restart is cut out."""
    d, quiet = args.duration_s, args.quiet_s
    restarts = sorted(d * (k + rng.uniform(0.3, 0.7)) / args.broker_restarts for k in range(args.broker_restarts))
    events = [(start + t, "restart_broker") for t in restarts]
    free, cursor = [], 0.0  # the intervals faults may fall in
    for t in restarts:
        if t > cursor:
            free.append((cursor, t))
        cursor = max(cursor, t + quiet)
    if cursor < d:
        free.append((cursor, d))
    total = sum(b - a for a, b in free)
    for kind, count in (
        ("kill_worker", args.worker_kills),
        ("stop_worker", args.stops),
        ("kill_client", args.client_kills),
    ):
        for _ in range(count):
            u = rng.uniform(0, total)
            for a, b in free:
                if u <= b - a:
                    events.append((start + a + u, kind))
                    break
                u -= b - a
    heapq.heapify(events)
    return events


# -- the run ---------------------------------------------------------------------------------
@dataclass
class Counts:
    worker_kills: int = 0
    stops: int = 0
    broker_restarts: int = 0
    client_kills: int = 0
    restarts: list[tuple[float, float]] = field(default_factory=list)  # (when started, seconds to answer)
    kill_times: list[float] = field(default_factory=list)


def fault(
    kind: str,
    args: argparse.Namespace,
    rng: random.Random,
    fleet: Fleet,
    clients: Clients,
    broker: BrokerProcess,
    counts: Counts,
    now: float,
) -> bool:
    """Carry out one fault; False if it cannot be done now (tried again a little later)."""
    if kind == "kill_worker":
        candidates = fleet.slots
        if args.min_serve_s > 0:  # a worker that has served a while, not one still loading its engine
            st = status(broker.frontend, 2.0)
            for w in st.workers if st is not None else []:
                fleet.serving_since.setdefault(w.name, now)
            serving = fleet.serving_since
            candidates = [s for s in fleet.slots if now - serving.get(s.name, math.inf) >= args.min_serve_s]
        if not candidates:
            return False
        fleet.kill(rng.choice(candidates))
        counts.worker_kills += 1
    elif kind == "stop_worker":
        candidates = fleet.running()
        if not candidates:
            return False
        expiry = args.broker_heartbeat_s * args.liveness
        fleet.stop(rng.choice(candidates), now + expiry * rng.uniform(0.2, 2.0))
        counts.stops += 1
    elif kind == "kill_client":  # never client 0: every restart and the warm-up keep a witness
        clients.kill(rng.choice(sorted(clients.live)[1:] or sorted(clients.live)))
        counts.client_kills += 1
    return True


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    print(f"chaos: --workers {args.workers} --seed {args.seed}", flush=True)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["chaos_roles", "zmq_rollout.testing", "zmq_rollout.client"])
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="zr-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    broker = BrokerProcess(args, log_dir)
    fleet = Fleet(args, ctx, broker.backend, log_dir)
    clients = Clients(args, ctx, broker.frontend)
    trainer: Trainer | None = None
    counts = Counts()
    began = time.monotonic()
    try:
        broker.start()
        for slot in fleet.slots:
            fleet.start(slot)
        wait_for_fleet(broker, fleet, args.start_timeout_s)
        trainer = Trainer(args, broker.frontend, random.Random(args.seed + 1))
        for i in range(args.clients):
            clients.start(i)
        warm0 = time.monotonic()
        time.sleep(args.warmup_s)  # the calm: its job latencies are the generation time
        warm1 = time.monotonic()
        print(f"warm-up done; faults for {args.duration_s:.0f} s (logs: {log_dir})", flush=True)
        trainer.start()
        events = timeline(args, rng, warm1)
        end = warm1 + args.duration_s
        while time.monotonic() < end or events:
            now = time.monotonic()
            fleet.supervise(now)
            if events and events[0][0] <= now:
                _, kind = heapq.heappop(events)
                if kind != "restart_broker" and now < trainer.quiet_until:  # one postponed into the quiet
                    heapq.heappush(events, (trainer.quiet_until + rng.uniform(0, 1), kind))
                elif kind == "restart_broker":
                    # Measured alone: no worker stopped, one at least serving (vLLM engines start slowly).
                    for slot in fleet.slots:
                        if slot.stopped_until is not None:
                            fleet.cont(slot)
                    wait_for_fleet(broker, fleet, args.start_timeout_s, at_least=1)
                    if counts.broker_restarts % 2:  # every other one lands in a sync round
                        trainer.syncing.wait(4 * args.sync_every_s)
                    broker.kill()
                    counts.kill_times.append(time.monotonic())
                    time.sleep(rng.uniform(0, args.max_outage_s))
                    restarted = time.monotonic()
                    counts.restarts.append((restarted, broker.start()))
                    counts.broker_restarts += 1
                    trainer.quiet_until = restarted + args.quiet_s
                elif not fault(kind, args, rng, fleet, clients, broker, counts, now):
                    heapq.heappush(events, (now + 1.0, kind))
                continue
            if now >= end + 120:  # faults that could not be done (no serving worker) for 2 min
                log.warning("dropping %d faults that found no target", len(events))
                break
            time.sleep(min(0.02, max(0.0, (events[0][0] if events else end) - now)))
        chaos_s = time.monotonic() - warm1
        print("faults done; bringing every worker back and draining", flush=True)
        trainer.stop()
        for slot in fleet.slots:
            if slot.stopped_until is not None:
                fleet.cont(slot)
        st = wait_for_fleet(broker, fleet, args.start_timeout_s)
        for _ in range(3):  # restarted workers are stale once a version was committed
            if all(w.state == "ready" for w in st.workers):
                break
            trainer.sync()
            st = wait_for_fleet(broker, fleet, args.start_timeout_s)
        order = {"restarts": [t for t, _ in counts.restarts], "warmup": [warm0, warm1], "drain_s": args.drain_s}
        summaries = clients.finish(order, args.drain_s + 60)
        final = status(broker.frontend, 5.0)
        return result(args, counts, fleet, trainer.log, summaries, final, chaos_s, time.monotonic() - began)
    finally:
        if trainer is not None:
            trainer.close()
        clients.close()
        fleet.close()
        broker.close()


def result(
    args: argparse.Namespace,
    counts: Counts,
    fleet: Fleet,
    syncs: SyncLog,
    summaries: list[dict[str, Any]],
    final: p.StatusReply | None,
    chaos_s: float,
    total_s: float,
) -> dict[str, Any]:
    missing = [s["tag"] for s in summaries if s.get("no_summary")]
    good = [s for s in summaries if not s.get("no_summary")]
    codes: dict[str, int] = {}
    for s in good:
        for code, n in s["codes"].items():
            codes[code] = codes.get(code, 0) + n
    expiry = args.broker_heartbeat_s * args.liveness
    generation_s = max((s["calm_latency_max"] or 0.0 for s in good), default=0.0)
    restarts = []
    for i, (_, start_s) in enumerate(counts.restarts):
        times = [s["recovery"][i] for s in good if s["recovery"][i] is not None]
        recovery = max(times) if times else None
        bound = start_s + 2 * expiry + generation_s
        in_flight = sum(s["in_flight_at_restart"][i] for s in good)
        restarts.append(
            {"start_s": round(start_s, 3), "in_flight": in_flight, "recovery_s": recovery, "bound_s": round(bound, 3)}
        )
    recoveries = [r["recovery_s"] for r in restarts if r["recovery_s"] is not None]
    # A round is expected to fail if the broker was down (from its kill until a heartbeat
    # after it answered again) at some point while the round ran.
    down = [
        (k, t + start_s + 2 * args.client_heartbeat_s)
        for k, (t, start_s) in zip(counts.kill_times, counts.restarts, strict=True)
    ]
    for failure in syncs.failures:
        at, until = failure["at"], failure["at"] + failure["seconds"]
        failure["broker_killed"] = any(a - 0.1 <= until and at <= b for a, b in down)
    return {
        "workers": args.workers,
        "seed": args.seed,
        "duration_s": round(chaos_s, 1),
        "total_s": round(total_s, 1),
        "jobs": sum(s["jobs"] for s in good),
        "worker_kills": counts.worker_kills,
        "stops": counts.stops,
        "broker_restarts": counts.broker_restarts,
        "client_kills": counts.client_kills,
        "worker_exits": fleet.exits,
        "syncs_ok": syncs.ok,
        "syncs_failed": syncs.failed,
        "sync_evictions": syncs.evicted,
        "syncs_failed_unexpectedly": sum(not f["broker_killed"] for f in syncs.failures),
        "sync_failures": syncs.failures[:10],
        "lost": sum(s["lost"] for s in good),
        "duplicated": sum(s["duplicated"] for s in good),
        "first_duplicates": [(s["tag"], *d) for s in good for d in s["doubles"]][:10],
        "wrong": sum(s["wrong"] for s in good),
        "foreign": sum(s["foreign"] for s in good),
        "errors": codes,
        "clients_without_summary": missing,
        "max_recovery_s": round(max(recoveries), 3) if recoveries else None,
        "recovery_goal_met": all(
            r["recovery_s"] is not None and r["recovery_s"] <= r["bound_s"] for r in restarts if r["in_flight"]
        ),
        "generation_s": round(generation_s, 3),
        "heartbeat_expiry_s": expiry,
        "restarts": restarts,
        "restart_times": [round(t, 3) for t, _ in counts.restarts],
        "broker_kill_times": [round(t, 3) for t in counts.kill_times],
        "latency_p50_s": max((s["latency_p50"] or 0.0 for s in good), default=None),
        "latency_max_s": max((s["latency_max"] or 0.0 for s in good), default=None),
        "final_queued": final.queued if final else None,
        "final_running": final.running if final else None,
    }


def print_result(r: dict[str, Any]) -> None:
    rows = [
        ("jobs (surviving clients)", r["jobs"]),
        ("worker kills (SIGKILL)", r["worker_kills"]),
        ("worker stops (SIGSTOP/SIGCONT)", r["stops"]),
        ("broker restarts (SIGKILL)", r["broker_restarts"]),
        ("client kills (SIGKILL)", r["client_kills"]),
        ("workers that exited by themselves", r["worker_exits"] or 0),
        (
            "syncs ok / failed (of which not by a broker kill)",
            f"{r['syncs_ok']} / {r['syncs_failed']} ({r['syncs_failed_unexpectedly']}); "
            f"{r['sync_evictions']} workers evicted",
        ),
        ("lost", r["lost"]),
        ("duplicated", r["duplicated"]),
        ("wrong result / foreign answers", f"{r['wrong']} / {r['foreign']}"),
        ("errors by code", r["errors"] or 0),
        ("max recovery after a broker restart", f"{r['max_recovery_s']} s"),
        ("recovery goal (start + 2 x expiry + generation)", "met" if r["recovery_goal_met"] else "NOT MET"),
        ("generation time (calm max latency)", f"{r['generation_s']} s"),
        ("fault phase / whole run", f"{r['duration_s']} s / {r['total_s']} s"),
    ]
    for name, value in rows:
        print(f"  {name:<48} {value}")
    for failure in r["sync_failures"]:
        print(f"  sync failure: {failure}")
    print("RESULT " + json.dumps(r), flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", choices=sorted(MODES), default="echo")
    ap.add_argument("--seed", type=int, default=None, help="random if not given (printed)")
    ap.add_argument("--model", default=None, help="vllm: a local model folder (default: a fresh tiny model)")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--max-attempts", type=int, default=100)
    ap.add_argument("--credits", type=int, default=16, help="echo: credits per double")
    for key in MODES["echo"]:
        kind = type(MODES["echo"][key])
        ap.add_argument(f"--{key.replace('_', '-')}", dest=key, type=kind, default=None, help=HELP[key])
    ap.add_argument("--client-heartbeat-s", type=float, default=None)
    ap.add_argument("--client-expiry-s", type=float, default=None)
    ap.add_argument("--quiet-s", type=float, default=None, help="after a broker restart (default 2 x expiry + 1)")
    args = ap.parse_args(argv)
    for key, value in MODES[args.workers].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    expiry = args.broker_heartbeat_s * args.liveness
    args.client_heartbeat_s = args.client_heartbeat_s or args.broker_heartbeat_s
    args.client_expiry_s = args.client_expiry_s or 3 * expiry
    args.quiet_s = args.quiet_s if args.quiet_s is not None else 2 * expiry + 1
    args.seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    return args


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("zmq_rollout").setLevel(logging.ERROR)  # the trainer's "broker lost" lines: expected here
    args = parse(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM ends the run like Ctrl-C: everything is stopped
    if args.workers == "vllm" and args.model is None:
        from zmq_rollout.tiny_model import make_tiny_model

        args.model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="zr-chaos-model-")) / "tiny-qwen2"))
    r = run(args)
    print_result(r)
    clean = r["lost"] == r["duplicated"] == r["wrong"] == r["foreign"] == r["syncs_failed_unexpectedly"] == 0
    clean = clean and r["recovery_goal_met"] and not r["clients_without_summary"]
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
