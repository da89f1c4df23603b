"""Broker throughput and latency, beside zmq.proxy and an HTTP server, on one machine.

    python benchmarks/broker_throughput.py            # full run, about 3 minutes
    python benchmarks/broker_throughput.py --quick    # CI smoke, under a minute
    python benchmarks/broker_throughput.py --profile  # one batched case, broker profiled

Every party is its own spawned process: the broker; the workers (``EchoWorkerDouble``, the
*test double* that answers each job at once, as threads spread over ``--worker-procs``
processes); each client. So what is measured is the broker's cost, and on a small machine
every process competes for the same cores: the table shows each role's CPU use to tell a
saturated broker from a starved one. Prompts are 100 bytes. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling role modules

import profiling
import roles
from report import BATCH, BATCH_WINDOW, SINGLE_WINDOW, percentile_us, report

CTX = mp.get_context("spawn")
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Setup:
    kind: str  # broker | curve (the broker with CurveZMQ on both ports) | library | proxy | http
    clients: int
    workers: int
    batch: int
    window: int

    @property
    def name(self) -> str:
        label = {
            "broker": "broker",
            "curve": "broker+curve",
            "library": "broker+RolloutClient",
            "proxy": "zmq.proxy",
            "http": "HTTP",
        }[self.kind]
        shape = f"{self.clients}c x {self.workers}w" if self.kind != "http" else "1c x server"
        return f"{label} {shape} {'batched' if self.batch > 1 else 'unbatched'}"


class Group:
    """The processes of one case; ``close`` terminates and joins every one of them."""

    def __init__(self) -> None:
        self.report = CTX.Queue()
        self.go = CTX.Event()
        self.clock = CTX.Array("d", 2, lock=False)
        self.procs: list[tuple[str, str, Any]] = []  # (role, tag, process)

    def start(self, role: str, tag: str, target: Any, *args: Any) -> str:
        proc = CTX.Process(target=target, args=(self.report, tag, *args), name=tag, daemon=True)
        proc.start()
        self.procs.append((role, tag, proc))
        return tag

    def expect(self, kind: str, tags: list[str], timeout: float = 60.0) -> dict[str, Any]:
        got: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(tags):
            try:
                k, tag, payload = self.report.get(timeout=0.2)
            except queue.Empty:
                dead = [t for _, t, pr in self.procs if pr.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"waiting for {kind} from {sorted(set(tags) - set(got))}: "
                        f"{'died: ' + str(dead) if dead else 'timed out'}"
                    ) from None
                continue
            if k == "error":
                raise RuntimeError(f"{tag} failed:\n{payload}")
            got[tag] = payload
        return got

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far, summed per role (all threads, from /proc), and by the
        whole machine (``machine``), to show load from outside the benchmark."""
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        out = {"machine": (sum(ticks[:8]) - ticks[3] - ticks[4]) / CLK_TCK}  # all but idle, iowait
        for role, _, proc in self.procs:
            try:
                with open(f"/proc/{proc.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
        return out

    def pid(self, tag: str) -> int:
        return next(int(proc.pid) for _, t, proc in self.procs if t == tag)

    def start_window(self, warmup: float, duration: float) -> tuple[float, float]:
        t_begin = time.monotonic() + warmup
        self.clock[0], self.clock[1] = t_begin, t_begin + duration
        self.go.set()
        return t_begin, t_begin + duration

    def close(self) -> None:
        for _, _, proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for _, _, proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.report.close()


def wait_registered(address: str, num_workers: int, timeout: float = 30.0) -> None:
    """Ask the broker for STATUS until it lists ``num_workers`` workers."""
    import zmq

    from zmq_rollout import codec
    from zmq_rollout import protocol as p

    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    keys = roles.curve_keys()
    if keys is not None:
        keys.apply(sock)
    sock.connect(address)
    decoder = codec.Decoder(codec.TO_CLIENT)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            sock.send_multipart(codec.encode(p.STATUS))
            if sock.poll(1000):
                msg = decoder.decode(sock.recv_multipart())
                if msg.command == p.STATUS_REPLY and len(msg.body.workers) >= num_workers:
                    sock.send_multipart(codec.encode(p.DISCONNECT))
                    return
            time.sleep(0.05)
        raise RuntimeError(f"the broker did not list {num_workers} workers within {timeout} s")
    finally:
        sock.close()


def split(total: int, procs: int) -> list[int]:
    procs = min(total, procs)
    return [total // procs + (1 if i < total % procs else 0) for i in range(procs)]


def start_servers(
    g: Group, setup: Setup, args: argparse.Namespace, profile: str | None = None
) -> tuple[str, list[str]]:
    """Start the server side of ``setup``; returns the clients' address and the worker tags."""
    if setup.kind == "http":
        from http_baseline import http_server

        g.start("server", "http-server", http_server)
        return g.expect("ready", ["http-server"])["http-server"], []
    extra: tuple[Any, ...] = ()
    if setup.kind == "proxy":
        g.start("server", "proxy", roles.proxy)
        front, back = g.expect("ready", ["proxy"])["proxy"]
        target = roles.raw_echoes
    else:
        g.start("server", "broker", roles.broker, profile)
        front, back = g.expect("ready", ["broker"])["broker"]
        target, extra = roles.echo_doubles, (args.credits,)
    tags = [
        g.start("workers", f"workers{i}", target, back, n, *extra)
        for i, n in enumerate(split(setup.workers, args.worker_procs))
    ]
    return front, tags


def run_throughput(setup: Setup, args: argparse.Namespace, profile: tuple[str, str] | None = None) -> dict[str, Any]:
    """One case. ``profile``: (``py-spy`` or ``cprofile``, output path) profiles the broker."""
    if setup.kind == "curve":  # every process of the case (spawned: they read it at start) uses the keys
        os.environ[roles.CURVE_ENV] = roles.make_curve_keys(args.keys_dir)
    else:
        os.environ.pop(roles.CURVE_ENV, None)
    g, spy = Group(), None
    try:
        cprofile_out = profile[1] if profile and profile[0] == "cprofile" else None
        address, worker_tags = start_servers(g, setup, args, cprofile_out)
        if setup.kind == "http":
            from http_baseline import http_client

            target: Any = http_client
        else:
            target = {
                "broker": roles.submit_client,
                "curve": roles.submit_client,
                "library": roles.library_client,
                "proxy": roles.raw_client,
            }[setup.kind]
        tags = [
            g.start("clients", f"client{i}", target, address, setup.batch, setup.window, g.go, g.clock)
            for i in range(setup.clients)
        ]
        g.expect("ready", tags + worker_tags)
        if setup.kind in ("broker", "curve", "library"):
            wait_registered(address, setup.workers)
        t_begin, t_end = g.start_window(args.warmup, args.duration)
        time.sleep(max(0.0, t_begin - time.monotonic()))
        cpu0 = g.cpu()
        if profile and profile[0] == "py-spy":
            spy = profiling.start_py_spy(g.pid("broker"), args.duration, profile[1])
        time.sleep(max(0.0, t_end - time.monotonic()))
        cpu1 = g.cpu()
        done = g.expect("done", tags, timeout=roles.DRAIN_SECONDS + 30)
        if spy is not None and spy.wait(timeout=30) != 0:
            raise RuntimeError(f"py-spy failed: {spy.stderr.read().decode() if spy.stderr else ''}")
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
            spy.wait()
        g.close()
    jobs = sum(d["jobs"] for d in done.values())
    cpu = {role: round((cpu1[role] - cpu0.get(role, 0.0)) / args.duration, 2) for role in cpu1}
    cpu["other"] = round(max(0.0, cpu.pop("machine") - sum(cpu.values())), 2)
    server_us = (cpu1["server"] - cpu0.get("server", 0.0)) / jobs * 1e6 if jobs else float("nan")
    return {
        "case": setup.name,
        "kind": setup.kind,
        "clients": setup.clients,
        "workers": setup.workers,
        "jobs_per_message": setup.batch,
        "messages_in_flight_per_client": setup.window,
        "jobs_per_s": round(jobs / args.duration),
        "errors": sum(d["errors"] for d in done.values()),
        "cpu_cores": cpu,
        "server_cpu_us_per_job": round(server_us, 2),
    }


LATENCY_PATHS = {  # name: (server role, worker role or None, client kind)
    "direct": ("direct_echo_server", None, "submit"),
    "broker": ("broker", "echo_doubles", "submit"),
    "raw-direct": ("raw_echo_server", None, "raw"),
    "proxy": ("proxy", "raw_echoes", "raw"),
}


def run_latency(path: str, args: argparse.Namespace) -> list[int]:
    server, workers, kind = LATENCY_PATHS[path]
    g = Group()
    try:
        g.start("server", server, getattr(roles, server), *((None,) if server == "broker" else ()))
        ready = g.expect("ready", [server])[server]
        address = ready[0] if isinstance(ready, tuple) else ready
        if workers is not None:
            extra = (args.credits,) if workers == "echo_doubles" else ()
            g.start("workers", "workers", getattr(roles, workers), ready[1], 1, *extra)
            g.expect("ready", ["workers"])
        if server == "broker":
            wait_registered(address, 1)
        g.start(
            "clients",
            "latency",
            roles.latency_client,
            address,
            kind,
            args.latency_count,
            args.latency_count // 10,
            g.go,
        )
        g.expect("ready", ["latency"])
        g.go.set()
        samples: list[int] = g.expect("done", ["latency"], timeout=120)["latency"]
        return samples
    finally:
        g.close()


def profile(args: argparse.Namespace) -> None:
    tool = args.profiler
    if tool == "auto":
        tool = "py-spy" if profiling.find_py_spy() else "cprofile"
    path = os.path.abspath(args.profile_out + (".txt" if tool == "py-spy" else ".prof"))
    clients, workers = (int(x) for x in args.profile_shape.split("x"))
    batch, window = (BATCH, BATCH_WINDOW) if args.profile == "batched" else (1, SINGLE_WINDOW)
    row = run_throughput(Setup("broker", clients, workers, batch, window), args, (tool, path))
    print(f"{row['case']}, profiled by {tool}: {row['jobs_per_s']:,} jobs/s, CPU cores "
          f"{row['cpu_cores']}, broker {row['server_cpu_us_per_job']} us CPU per job")  # fmt: skip
    if tool == "py-spy":
        profiling.print_py_spy(path, 25)
    else:
        profiling.print_cprofile(path, 30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short windows for a CI smoke run (under a minute)")
    ap.add_argument("--duration", type=float, help="seconds measured per case (default 5, quick 1)")
    ap.add_argument("--warmup", type=float, help="seconds of load before measuring (default 1, quick 0.25)")
    ap.add_argument("--latency-count", type=int, help="round trips per latency path (default 5000, quick 500)")
    ap.add_argument("--credits", type=int, default=64, help="credits per echo double (vLLM max_num_seqs)")
    ap.add_argument("--worker-procs", type=int, default=2, help="processes the worker threads are spread over")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this text")
    ap.add_argument(
        "--profile",
        nargs="?",
        const="batched",
        choices=["batched", "unbatched"],
        help="run only one broker case (8c x 8w by default) and profile the broker process",
    )
    ap.add_argument("--profile-shape", default="8x8", help="CLIENTSxWORKERS of the profiled case")
    ap.add_argument(
        "--profiler",
        choices=["auto", "py-spy", "cprofile"],
        default="auto",
        help="auto: py-spy when it is on PATH, else cProfile",
    )
    ap.add_argument("--profile-out", default="broker-profile", help="profile data path (no suffix)")
    args = ap.parse_args()
    args.keys_dir = tempfile.mkdtemp(prefix="zr-bench-keys-")
    args.duration = args.duration or (1.0 if args.quick else 5.0)
    args.warmup = args.warmup if args.warmup is not None else (0.25 if args.quick else 1.0)
    args.latency_count = args.latency_count or (500 if args.quick else 5000)

    if args.profile:
        profile(args)
        return
    started = time.monotonic()
    latency: dict[str, list[int]] = {}
    for path in LATENCY_PATHS if "latency" in args.only or not args.only else ():
        latency[path] = run_latency(path, args)
        print(f"  latency {path:<10} p50 {percentile_us(latency[path], 0.5):7.1f} us", flush=True)
    setups = [
        Setup("broker", c, w, b, win)
        for c in (1, 8)
        for w in (1, 8, 64)
        for b, win in ((1, SINGLE_WINDOW), (BATCH, BATCH_WINDOW))
    ]
    setups += [  # the cost of CurveZMQ: the same cases with keys on both ports
        Setup("curve", c, c, b, win) for c in (1, 8) for b, win in ((1, SINGLE_WINDOW), (BATCH, BATCH_WINDOW))
    ]
    setups.append(Setup("library", 1, 8, BATCH, BATCH_WINDOW))
    setups += [Setup("proxy", c, c, b, win) for c in (1, 8) for b, win in ((1, SINGLE_WINDOW), (BATCH, BATCH_WINDOW))]
    setups += [Setup("http", 1, 0, 1, 64), Setup("http", 1, 0, BATCH, 64)]
    rows = []
    for setup in setups:
        if args.only and args.only not in setup.name:
            continue
        rows.append(run_throughput(setup, args))
        print(f"  {rows[-1]['case']:<40} {rows[-1]['jobs_per_s']:>10,} jobs/s", flush=True)
    report(rows, latency, args, time.monotonic() - started)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # so that a SIGTERM also runs every ``Group.close``


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted; every benchmark process was terminated", file=sys.stderr)
        sys.exit(130)
