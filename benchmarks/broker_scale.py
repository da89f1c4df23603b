"""``broker_throughput.py --scale``: how the broker's cost per job grows with workers and clients.

The goal (issue 12, goal 4): with 1,024 workers and 64 clients, the broker's CPU per job
stays within 1.5x of the 8 clients x 8 workers case, and its memory per registered worker
and per client is bounded and reported.

One broker per worker count (1, 8, 64, 256, 1,024; ``--quick``: 1, 8, 1,024), the product's
``Broker(BrokerConfig(...))`` with its default heartbeat (1 s) and liveness (5 beats). The
workers are echo worker doubles (TEST DOUBLES that answer every job at once, no model),
``roles.echo_double_fleet``: each its own DEALER with its own identity, spread over
``--worker-procs`` processes of ``--worker-threads`` threads, heartbeating every second as the real worker
does. For each client count (1, 8, 64, largest first) the clients (``roles.client_fleet``: each
its own DEALER and identity, their SUBMITs made from a byte template, or through the codec with
``--doubles echo``; up to ``--client-procs`` processes) run one batched and one unbatched
window, like ``broker_throughput.py``'s raw clients: 4 SUBMITs x 64 jobs, or 64 one-job
SUBMITs, in flight per client. Per window: jobs/s, and the broker process's CPU time per
completed job (``/proc``), the figure the goal is about; every ratio is to the 8 x 8 case of
the same mode.

Memory: the broker's VmRSS (``/proc/PID/status``) with no peer, after every worker has
registered (STATUS lists them all), and after the first (largest) set of clients has
registered (each sent a HEARTBEAT and got its answer), before any job; the differences per
worker and per client, in bytes. Then VmHWM (peak) and VmRSS after all windows. The RSS
moves in pages and allocator arenas, so only the 256- and 1,024-worker figures say much
per worker; what they show is the cost of a registered peer: its scheduler records and
libzmq's pipe and buffers for its connection.

After each window the broker is asked for STATUS: every worker must still be registered and
no job requeued, and at the end each double says how many times the broker purged it
(DISCONNECT): a double taken for dead under load is reported, not hidden.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import roles
import zmq
from broker_throughput import (
    CLK_TCK,
    CTX,
    REPO,
    Group,
    Tree,
    _git,
    split,
    tree_broker_ready,
    wait_registered,
    wire_differences,
    worktree,
)
from report import BATCH, SINGLE_WINDOW, _cpu_model

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.config import BrokerConfig, WorkerConfig

WORKERS = (1, 8, 64, 256, 1024)
CLIENTS = (64, 8, 1)  # largest first: the clients' memory is measured before any job has run
QUICK_SHAPES = {1: (1,), 8: (8,), 1024: (64,)}
REFERENCE = (8, 8)  # (workers, clients): the case every ratio is to
GOAL_SHAPE = (1024, 64)
GOAL_RATIO = 1.5
IDLE_S = 1.0  # seconds the broker's CPU is measured with every worker registered and no client


@dataclass(frozen=True)
class Case:
    workers: int
    clients: int
    batched: bool

    @property
    def mode(self) -> str:
        return "batched" if self.batched else "unbatched"


def shapes(quick: bool, spec: str = "") -> dict[int, tuple[int, ...]]:
    """Worker count -> its client counts, largest first (the first registers before any job).
    ``spec``: ``CLIENTSxWORKERS`` shapes, comma-separated (``--scale-shapes 8x8,64x1024``)."""
    if not spec:
        return dict(QUICK_SHAPES) if quick else dict.fromkeys(WORKERS, CLIENTS)
    out: dict[int, set[int]] = {}
    for shape in spec.split(","):
        try:
            clients, workers = (int(x) for x in shape.strip().split("x"))
        except ValueError:
            raise ValueError(f"a shape is CLIENTSxWORKERS (e.g. 64x1024), not {shape!r}") from None
        if clients < 1 or workers < 1:
            raise ValueError(f"a shape needs a client and a worker at least, not {shape!r}")
        out.setdefault(workers, set()).add(clients)
    return {w: tuple(sorted(c, reverse=True)) for w, c in sorted(out.items())}


def vm_status(text: str) -> dict[str, int]:
    """The ``Vm*`` lines of a ``/proc/PID/status`` text, in bytes."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.startswith("Vm") and value.strip().endswith("kB"):
            out[key] = int(value.split()[0]) * 1024
    return out


def memory(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return vm_status(f.read())


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process's threads, summed by kind: ``io`` (libzmq's I/O threads,
    ``ZMQbg/IO/n``: the TCP reads and writes of every connection) and ``loop`` (the others: the
    broker's Python thread)."""
    out = {"io": 0.0, "loop": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended meanwhile
            continue
        out["io" if name.startswith("ZMQbg/IO") else "loop"] += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def per_peer(before: int, after: int, peers: int) -> int | None:
    """Bytes of resident memory per peer that registered between the two readings."""
    return round((after - before) / peers) if peers > 0 else None


def ratios(rows: list[dict[str, Any]]) -> None:
    """Set each row's ``ratio``: its broker us/job over that of the 8 x 8 row of its mode."""
    ref = {r["mode"]: r["broker_us_per_job"] for r in rows if (r["workers"], r["clients"]) == REFERENCE and r["jobs"]}
    for r in rows:
        base = ref.get(r["mode"])
        r["ratio"] = round(r["broker_us_per_job"] / base, 2) if base and r["jobs"] else None


def goal(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the 1,024-worker x 64-client case is within ``GOAL_RATIO`` of 8 x 8, per mode;
    ``met``: in both modes (None where a mode was not measured)."""
    by_mode = {r["mode"]: r["ratio"] for r in rows if (r["workers"], r["clients"]) == GOAL_SHAPE}
    verdicts = {mode: None if ratio is None else ratio <= GOAL_RATIO for mode, ratio in by_mode.items()}
    met = None if not verdicts or None in verdicts.values() else all(verdicts.values())
    return {"ratio_limit": GOAL_RATIO, "ratios": by_mode, "met_per_mode": verdicts, "met": met}


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (workers, clients): per mode jobs/s, broker us/job, its ratio to 8 x 8 and
    jobs per JOBS message (how well the broker batches at that shape)."""
    cells: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["workers"], r["clients"]), {})[r["mode"]] = r
    head = (
        f"{'workers':>7} {'clients':>7} | {'batched jobs/s':>14} {'us/job':>7} {'io':>5} {'x 8x8':>6} {'j/msg':>5} "
        f"{'m/job':>5} {'us/m':>5} | {'unbatched jobs/s':>16} {'us/job':>7} {'io':>5} {'x 8x8':>6} {'j/msg':>5} "
        f"{'m/job':>5} {'us/m':>5} | {'broker':>6} {'other':>5}"
    )
    out = [head, "-" * len(head)]
    for (workers, clients), modes in sorted(cells.items()):
        line = f"{workers:>7,} {clients:>7} |"
        for mode, width in (("batched", 14), ("unbatched", 16)):
            cell = modes.get(mode)
            if cell is None:
                line += f" {'-':>{width}} {'-':>7} {'-':>5} {'-':>6} {'-':>5} {'-':>5} {'-':>5} |"
            else:
                ratio = _fmt(cell["ratio"], ".2f")
                line += (
                    f" {cell['jobs_per_s']:>{width},} {cell['broker_us_per_job']:>7.2f} "
                    f"{_fmt(cell['broker_io_us_per_job'], '.1f'):>5} {ratio:>6} "
                    f"{cell['jobs_per_jobs_message']:>5.1f} {cell['broker_messages_per_job']:>5.2f} "
                    f"{_fmt(cell['broker_us_per_message'], '.1f'):>5} |"
                )
        cores = [m["cpu_cores"] for m in modes.values()]
        broker = max(c.get("server", 0.0) for c in cores)
        other = max(c.get("other", 0.0) for c in cores)
        out.append(f"{line} {broker:>6.2f} {other:>5.2f}")
    return out


def memory_table(fleets: list[dict[str, Any]]) -> list[str]:
    """One line per broker: its VmRSS with no peer, with its workers, with the first clients
    (bytes per worker and per client), after every window and at its peak; and the CPU cores
    it used at rest with every worker registered."""
    head = (
        f"{'workers':>7} {'no peer':>9} {'+workers':>9} {'B/worker':>9} {'clients':>7} {'+clients':>9} "
        f"{'B/client':>9} {'after load':>10} {'peak':>9} {'idle CPU':>8}"
    )
    out = [head, "-" * len(head)]
    mib = 1 << 20
    out += [
        f"{f['workers']:>7,} {f['rss_no_peer'] / mib:>7.1f}Mi {f['rss_workers'] / mib:>7.1f}Mi "
        f"{_fmt(f['bytes_per_worker'], ',d'):>9} {f['clients']:>7} {f['rss_clients'] / mib:>7.1f}Mi "
        f"{_fmt(f['bytes_per_client'], ',d'):>9} {f['rss_after_load'] / mib:>8.1f}Mi {f['hwm'] / mib:>7.1f}Mi "
        f"{f['idle_broker_cores']:>8.3f}"
        for f in fleets
    ]
    return out


# -- the runs --------------------------------------------------------------------------------
def snapshot(repo: Path, folder: str) -> Tree:
    """A copy of ``repo``'s packages (the folders of its pyproject.toml's ``package-dir``, no
    caches) in ``folder``: every broker of the run is that copy's (``roles.tree_broker``), so
    one run measures one broker even while its files are being edited."""
    try:
        import tomllib

        with open(repo / "pyproject.toml", "rb") as f:
            folders = set(tomllib.load(f)["tool"]["setuptools"]["package-dir"].values())
    except ImportError:  # Python 3.10: the folders ``roles.use_tree`` falls back to
        folders = {"zmq_rollout", "broker", "workers"}
    for name in sorted(folders):
        shutil.copytree(repo / name, os.path.join(folder, name), ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(repo / "pyproject.toml", folder)
    head = _git("rev-parse", "--short=9", "HEAD")
    dirty = [line[3:] for line in _git("status", "--porcelain", "--", *sorted(folders)).splitlines()]
    describe = f"{repo} at HEAD {head}" + (f", with uncommitted changes to {', '.join(dirty)}" if dirty else "")
    return Tree("scale", folder, describe + ", copied at the start of the run")


def broker_status(address: str, timeout: float = 10.0) -> Any:
    """The broker's STATUS_REPLY body, asked over a fresh DEALER (which then DISCONNECTs)."""
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    decoder = codec.Decoder(codec.TO_CLIENT)
    try:
        sock.send_multipart(codec.encode(p.STATUS))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sock.poll(200):
                msg = decoder.decode(sock.recv_multipart())
                if msg.command == p.STATUS_REPLY:
                    sock.send_multipart(codec.encode(p.DISCONNECT))
                    return msg.body
        raise RuntimeError(f"the broker did not answer STATUS within {timeout} s")
    finally:
        sock.close()


def start_clients(g: Group, front: str, case: Case, args: argparse.Namespace, go: Any, clock: Any) -> list[str]:
    batch, window = (BATCH, args.batch_window) if case.batched else (1, SINGLE_WINDOW)
    tags = [
        g.start(
            "clients",
            f"c{case.workers}w{case.clients}{case.mode[0]}{i}",
            roles.client_fleet,
            front,
            n,
            batch,
            window,
            go,
            clock,
        )
        for i, n in enumerate(split(case.clients, args.client_procs))
    ]
    g.expect("ready", tags, timeout=120)
    return tags


def fleet_counts(counts: list[Any]) -> tuple[int, ...]:
    """(jobs answered, JOBS messages, purges, HEARTBEATs from the broker) so far, summed over
    the doubles' shared counters (``roles.FLEET_COUNTS`` per thread)."""
    n = roles.FLEET_COUNTS
    return tuple(sum(sum(c[i::n]) for c in counts) for i in range(n))


def broker_messages(
    case: Case, jobs: int, jobs_messages: int, heartbeats: int, answers: int, args: argparse.Namespace
) -> float:
    """Messages the broker read or sent per completed job in a window: the clients' SUBMITs
    (``BATCH`` jobs each, batched), the JOBS it sent and the FINAL each double answers one with,
    the HEARTBEATs it sent, the answers its clients received (their FINALs: its batching toward
    them) and every worker's heartbeat, once a second. How much of a shape's cost per job is its
    number of messages (``us/m`` is then what one costs)."""
    if not jobs:
        return 0.0
    submits = jobs / (BATCH if case.batched else 1)
    beats_in = case.workers * args.duration / WorkerConfig().heartbeat_interval_s
    return (submits + 2 * jobs_messages + heartbeats + answers + beats_in) / jobs


def run_window(
    g: Group, case: Case, tags: list[str], go: Any, clock: Any, counts: list[Any], args: argparse.Namespace
) -> dict[str, Any]:
    """One measured window of ``case``, its clients started and registered; they end with it.
    ``counts``: the doubles' shared counters (``roles.echo_double_fleet``)."""
    t_begin = time.monotonic() + args.warmup
    clock[0], clock[1] = t_begin, t_begin + args.duration
    go.set()
    time.sleep(max(0.0, t_begin - time.monotonic()))
    pid = g.pid("broker")
    cpu0, fleet0, threads0 = g.cpu(), fleet_counts(counts), thread_cpu(pid)
    time.sleep(max(0.0, clock[1] - time.monotonic()))
    cpu1, fleet1, threads1 = g.cpu(), fleet_counts(counts), thread_cpu(pid)
    done = g.expect("done", tags, timeout=roles.DRAIN_SECONDS + 60)
    for _, _, proc in [x for x in g.procs if x[1] in tags]:
        proc.join(10)
    g.procs = [x for x in g.procs if x[1] not in tags]
    jobs = sum(d["jobs"] for d in done.values())
    cpu = {role: round((cpu1[role] - cpu0.get(role, 0.0)) / args.duration, 2) for role in cpu1}
    cpu["other"] = round(max(0.0, cpu.pop("machine") - sum(cpu.values())), 2)
    broker_us = (cpu1["server"] - cpu0["server"]) / jobs * 1e6 if jobs else float("nan")
    answers = sum(d["messages"] for d in done.values())
    messages = broker_messages(case, jobs, fleet1[1] - fleet0[1], fleet1[3] - fleet0[3], answers, args)
    return {
        "workers": case.workers,
        "clients": case.clients,
        "mode": case.mode,
        "jobs": jobs,
        "jobs_per_s": round(jobs / args.duration),
        "errors": sum(d["errors"] for d in done.values()),
        "broker_us_per_job": round(broker_us, 2),
        "broker_io_us_per_job": round((threads1["io"] - threads0["io"]) / jobs * 1e6, 2) if jobs else None,
        "cpu_cores": cpu,
        "jobs_per_jobs_message": round((fleet1[0] - fleet0[0]) / max(1, fleet1[1] - fleet0[1]), 1),
        "broker_messages_per_job": round(messages, 2),
        "broker_us_per_message": round(broker_us / messages, 2) if messages else None,
    }


def run_fleet(
    tree: Tree, workers: int, client_counts: tuple[int, ...], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One broker (``tree``'s) and ``workers`` doubles; a batched and an unbatched window per client count."""
    g, rows = Group(), []
    heartbeat_s = WorkerConfig().heartbeat_interval_s
    try:
        front, back = tree_broker_ready(g, tree)
        pid = g.pid("broker")
        time.sleep(0.5)  # its poll loop runs: the resident set of an idle broker
        rss_no_peer = memory(pid)["VmRSS"]
        sizes = split(workers, args.worker_procs)
        counts = [CTX.Array("q", roles.FLEET_COUNTS * args.worker_threads, lock=False) for _ in sizes]
        fleet = [
            g.start(
                "workers",
                f"w{workers}-{i}",
                roles.echo_double_fleet,
                back,
                n,
                args.credits,
                args.worker_threads,
                heartbeat_s,
                counts[i],
            )
            for i, n in enumerate(sizes)
        ]
        g.expect("ready", fleet, timeout=120)
        wait_registered(front, workers, timeout=60)
        rss_workers = memory(pid)["VmRSS"]
        mem: dict[str, Any] = {"workers": workers, "rss_no_peer": rss_no_peer, "rss_workers": rss_workers}
        mem["bytes_per_worker"] = per_peer(rss_no_peer, rss_workers, workers)
        cpu0 = g.cpu()["server"]
        time.sleep(IDLE_S)  # no client: what the workers' heartbeats alone cost the broker
        mem["idle_broker_cores"] = round((g.cpu()["server"] - cpu0) / IDLE_S, 3)
        requeued = 0
        for clients in client_counts:
            for batched in (True, False):
                case = Case(workers, clients, batched)
                go, clock = CTX.Event(), CTX.Array("d", [float("inf"), float("inf")], lock=False)
                before = memory(pid)["VmRSS"]
                tags = start_clients(g, front, case, args, go, clock)
                if "clients" not in mem:  # the first and largest set of clients, before any job
                    after = memory(pid)["VmRSS"]
                    mem.update(clients=clients, rss_clients=after, bytes_per_client=per_peer(before, after, clients))
                rows.append(run_window(g, case, tags, go, clock, counts, args))
                status = broker_status(front)
                rows[-1]["registered_after"] = len(status.workers)
                rows[-1]["requeued"] = status.totals.requeued - requeued
                requeued = status.totals.requeued
                r = rows[-1]
                print(
                    f"  {workers:>5}w x {clients:>2}c {case.mode:<9} {r['jobs_per_s']:>8,} jobs/s  broker "
                    f"{r['broker_us_per_job']:6.2f} us/job  cores {r['cpu_cores']}",
                    flush=True,
                )
        vm = memory(pid)
        mem.update(rss_after_load=vm["VmRSS"], hwm=vm["VmHWM"], purged=fleet_counts(counts)[2])
        return rows, mem
    finally:  # the broker first: doubles that leave before it make it log every heartbeat it cannot send
        for _, tag, proc in g.procs:
            if tag == "broker":
                proc.terminate()
                proc.join(10)
        g.close()


def run(args: argparse.Namespace) -> None:
    started, load0 = time.monotonic(), os.getloadavg()
    os.environ.pop(roles.CURVE_ENV, None)
    rows, fleets = [], []
    with tempfile.TemporaryDirectory(prefix="zr-bench-scale-") as folder, contextlib.ExitStack() as stack:
        if args.baseline_ref:  # that commit's broker alone: run with and without, alternately, for an A/B
            path, sha = stack.enter_context(worktree(args.baseline_ref))
            tree = Tree("scale", path, f"{args.baseline_ref} = {sha[:9]} (a git worktree)")
        else:
            tree = snapshot(REPO, folder)
        print(f"  broker: {tree.describe}", flush=True)
        for workers, client_counts in shapes(args.quick, args.scale_shapes).items():
            fleet_rows, mem = run_fleet(tree, workers, client_counts, args)
            rows += fleet_rows
            fleets.append(mem)
            if len(fleets) == 1:  # the copy's wire, beside the clients' and doubles' (this checkout's)
                clients = roles.wire_fingerprint()
                if tree.wire["signature"] != clients["signature"]:
                    raise RuntimeError(f"the broker copy speaks {tree.wire['signature']}, the clients {clients}")
                diff = wire_differences(tree.wire, clients)
                if diff:
                    print(f"  WARNING: the broker's wire differs from the clients' in {', '.join(diff)}", flush=True)
    ratios(rows)
    result = goal(rows)
    result["broker"] = tree.describe
    report(rows, fleets, result, args, time.monotonic() - started, load0)


def report(
    rows: list[dict[str, Any]],
    fleets: list[dict[str, Any]],
    result: dict[str, Any],
    args: argparse.Namespace,
    elapsed: float,
    load0: tuple[float, float, float],
) -> None:
    cfg = BrokerConfig()
    print()
    print(
        f"machine: {os.cpu_count()} cores ({_cpu_model()}), Python {platform.python_version()}; scale "
        f"{'quick' if args.quick else 'default'}: {args.warmup} s warm-up + {args.duration} s measured per "
        f"window; total {elapsed:.0f} s; load average {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    print(
        f"workers: {args.doubles} echo worker doubles (TEST DOUBLES, no model), {args.credits} credits each, over "
        f"{args.worker_procs} processes x {args.worker_threads} threads, heartbeat "
        f"{WorkerConfig().heartbeat_interval_s} s; broker: default BrokerConfig (heartbeat "
        f"{cfg.heartbeat_interval_s} s, a worker silent {cfg.worker_expiry_s} s is purged)"
    )
    print(
        f"clients: raw DEALERs over up to {args.client_procs} processes; "
        f"batched = {args.batch_window} x {BATCH} jobs, "
        f"unbatched = {SINGLE_WINDOW} x 1 job in flight per client"
    )
    print("\nbroker CPU per job by workers and clients (x 8x8: us/job over the 8 workers x 8 clients case's)")
    for line in table(rows):
        print(line)
    print(
        "us/job: the broker process's CPU time per completed job, of which io: its libzmq I/O thread's; "
        "broker/other: CPU cores the broker and "
        "processes outside the benchmark used (the more of either of a window's two modes);\n"
        "j/msg: jobs per JOBS message the doubles received (the broker's batching at that shape); m/job: messages "
        "the broker read or sent per job (SUBMITs, JOBS, the doubles' FINALs, FINALs to clients, heartbeats);\n"
        "us/m: broker CPU per message (us/job over m/job): what a shape's messages cost, apart from how many there are"
    )
    print("\nbroker memory (VmRSS): no peer, all workers registered, the clients registered (before any job)")
    for line in memory_table(fleets):
        print(line)
    print(
        "B/worker, B/client: the growth of VmRSS per peer registered (pages and allocator arenas: meaningful "
        "from 64 peers on); after load: after the last window, its clients gone; peak: VmHWM;\n"
        f"idle CPU: broker cores over {IDLE_S} s with every worker registered and no client (the workers' heartbeats)"
    )
    purged = sum(f["purged"] for f in fleets)
    requeued = sum(r["requeued"] for r in rows)
    missing = [f"{r['workers']}w x {r['clients']}c" for r in rows if r["registered_after"] != r["workers"]]
    errors = sum(r["errors"] for r in rows)
    print(
        f"liveness: doubles purged by the broker {purged}, jobs requeued {requeued}, windows ending with a "
        f"worker missing {len(missing)}{' (' + ', '.join(missing) + ')' if missing else ''}; job errors {errors}"
    )
    busy = sorted({f"{r['workers']}w x {r['clients']}c" for r in rows if r["cpu_cores"]["other"] > 0.2})
    if busy:
        print(f"WARNING: other load above 0.2 cores during {', '.join(busy)}")
    verdict = {True: "MET", False: "NOT MET", None: "not measured"}
    per_mode = ", ".join(f"{mode} {_fmt(ratio, '.2f')}x" for mode, ratio in result["ratios"].items())
    w, c = GOAL_SHAPE
    print(
        f"\ngoal: broker CPU per job at {w:,} workers x {c} clients within {GOAL_RATIO}x of 8 x 8: "
        f"{verdict[result['met']]} ({per_mode or 'n/a'})"
    )
    out = {
        "mode": "scale-quick" if args.quick else "scale",
        "duration_s": args.duration,
        "cpus": os.cpu_count(),
        "workers": "echo worker doubles (test doubles)",
        "scale": rows,
        "memory": fleets,
        "goal_1024w_64c_within_1_5x_of_8x8": result,
        "elapsed_s": round(elapsed, 1),
    }
    print("RESULT " + json.dumps(out, separators=(",", ":")))
