"""Broker throughput and latency, beside zmq.proxy and an HTTP server, on one machine.

    python benchmarks/broker_throughput.py            # full run, about 3 minutes
    python benchmarks/broker_throughput.py --quick    # CI smoke, under a minute
    python benchmarks/broker_throughput.py --profile  # one batched case, broker profiled
    python benchmarks/broker_throughput.py --baseline-ref 39adf1e  # broker cases, that commit's broker vs. this one
    python benchmarks/broker_throughput.py --scale    # 1 to 1,024 workers, 1 to 64 clients (broker_scale.py), ~3 min
    python benchmarks/broker_throughput.py --goal-pairs 5  # full run, then the 3x-HTTP goal's two cases as 5 pairs
    python benchmarks/broker_throughput.py --only latency --latency-rounds 5  # the latency goal over 5 rounds

Every party runs in spawned processes of its own: the broker; the workers (*test doubles* that
answer each job at once, spread over ``--worker-procs`` processes); the clients, a process each,
but in the batched broker and Curve cases, where they run in ``--batched-client-procs``
processes (default 1), as the HTTP baseline's client is one process (``client_fleets``). So what
is measured is the broker's cost, and on a small machine every process competes for the same
cores: the table shows each role's CPU use to tell a saturated broker from a starved one.
Prompts are 100 bytes.

``--doubles lean`` (the default): the workers are ``roles.echo_double_fleet`` (one thread per
process serving its doubles' sockets) and clients and workers make their messages from byte
templates (``lean_doubles.py``): the same bytes as ``--doubles echo``, where the workers are
``EchoWorkerDouble`` threads and clients and workers build and read every object through the
codec, which left the broker a third of the 2 cores. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling role modules

import profiling
import roles
from report import (
    BATCH,
    BATCH_WINDOW,
    HTTP_WINDOW,
    SINGLE_WINDOW,
    clients_share_processes,
    percentile_us,
    report,
    report_comparison,
)

from zmq_rollout.config import BrokerConfig, WorkerConfig

CTX = mp.get_context("spawn")
CLK_TCK = os.sysconf("SC_CLK_TCK")
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Tree:
    """A source tree whose broker a ``--baseline-ref`` run measures: ``before`` (a worktree of
    the ref) or ``after`` (this checkout's working tree, or a worktree of ``--after-ref``)."""

    label: str
    path: str
    describe: str
    wire: dict[str, Any] = field(default_factory=dict)
    """Its ``roles.wire_fingerprint()``, from its broker's ready line."""
    files: list[str] = field(default_factory=list)
    """The files of the ``zmq_rollout`` modules its broker imported, relative to ``path``."""


class TreeProcess:
    """A ``subprocess.Popen`` with the parts of ``multiprocessing.Process`` that ``Group`` uses."""

    def __init__(self, popen: subprocess.Popen[str]) -> None:
        self.popen = popen
        self.pid = popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        if self.popen.poll() is not None and self.popen.stdout is not None:
            self.popen.stdout.close()


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
        self.broker_metrics: int | None = None
        """The port of the broker's ``/metrics``, where it serves one (``roles.broker_messages``)."""

    def start(self, role: str, tag: str, target: Any, *args: Any) -> str:
        proc = CTX.Process(target=target, args=(self.report, tag, *args), name=tag, daemon=True)
        proc.start()
        self.procs.append((role, tag, proc))
        return tag

    def start_tree_broker(self, tag: str, tree: Tree) -> str:
        """``roles.tree_broker``: the broker of ``tree`` in a fresh interpreter (``python -c``);
        its ready line goes on the report queue like a role's ``ready``."""
        command = roles.tree_command(tree.path, f"tree_broker({tree.path!r})")
        popen = subprocess.Popen(command, cwd=tree.path, stdout=subprocess.PIPE, text=True)
        self.procs.append(("server", tag, TreeProcess(popen)))

        def relay() -> None:
            line = popen.stdout.readline() if popen.stdout else ""
            try:
                self.report.put(("ready", tag, json.loads(line)))
            except ValueError:
                if line:  # else it died: ``expect`` sees its exit code
                    self.report.put(("error", tag, f"not a ready line: {line!r}"))

        threading.Thread(target=relay, daemon=True).start()
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


def client_fleets(setup: Setup, args: argparse.Namespace) -> list[int]:
    """How many clients each process of a case runs, where they share processes: the batched broker
    and Curve cases with lean doubles, as ``roles.client_fleet`` (one thread serving their DEALERs)
    in ``--batched-client-procs`` processes, as the HTTP baseline's one aiohttp process keeps all
    its POSTs in flight. A process per client, each 2 threads with libzmq's, took a quarter of the
    2 cores from the broker they loaded (benchmarks/README.md, twenty-second session). Empty: a
    process per client (the unbatched cases, as zmq.proxy's clients; the RolloutClient's; all with
    ``--batched-client-procs 0``)."""
    if setup.kind in ("broker", "curve") and setup.batch > 1 and clients_share_processes(args):
        return split(setup.clients, args.batched_client_procs)
    return []


def split(total: int, procs: int) -> list[int]:
    procs = min(total, procs)
    return [total // procs + (1 if i < total % procs else 0) for i in range(procs)]


def _own_files(tree: Tree, files: list[str]) -> list[str]:
    """``files`` relative to the tree; raises if one is not in it (a module of another tree)."""
    root = os.path.realpath(tree.path) + os.sep
    strays = [f for f in files if not os.path.realpath(f).startswith(root)]
    if strays or not files:
        raise RuntimeError(f"the {tree.label} broker imported zmq_rollout from outside {tree.path}: {strays}")
    return sorted(os.path.relpath(os.path.realpath(f), root) for f in files)


def tree_broker_ready(g: Group, tree: Tree) -> tuple[str, str]:
    """Start ``tree``'s broker; check that every ``zmq_rollout`` module it imported is the
    tree's and that it speaks the wire it spoke before (``check_protocol``); its addresses."""
    ready = g.expect("ready", [g.start_tree_broker("broker", tree)])["broker"]
    g.broker_metrics = ready.get("metrics")
    tree.files = _own_files(tree, ready["files"])
    if tree.wire and ready["wire"] != tree.wire:
        raise RuntimeError(f"the {tree.label} broker's wire changed during the run ({tree.path} was edited?)")
    tree.wire = ready["wire"]
    return ready["frontend"], ready["backend"]


def run_tree_scheduler(tree: Tree, args: argparse.Namespace) -> float:
    """``roles.tree_scheduler``: the scheduler of ``tree`` alone, in process; best us/job."""
    rounds, samples = (50, 5) if args.quick else (200, 9)
    command = roles.tree_command(tree.path, f"tree_scheduler({tree.path!r}, {rounds}, {samples})")
    result = last_json_line(command, f"the {tree.label} scheduler run", cwd=tree.path)
    _own_files(tree, result["files"])
    return float(result["us_per_job"])


def last_json_line(command: list[str], what: str, cwd: str | None = None) -> Any:
    """Run ``command`` (an in-process measurement in a fresh interpreter) and return the JSON of
    the last line it printed; raises with its stderr if it failed."""
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


FLOOR_CASE = ["--workers", "64", "--pack-step", "64", "--clients", "8", "--sealed", "--finals", "final"]
"""``broker_phases.py``'s arguments for the goal's case (8c x 64w batched, sealed jobs, FINALs)."""


def in_process_floor(args: argparse.Namespace) -> float:
    """The goal's case's scheduler and codec alone, in a fresh process (``broker_phases.py``):
    us of CPU per job, the best of a few samples. What this machine charges, at this moment, for
    the broker's work before any socket, poll or loop; a full run measures it at its start and
    end, so that its absolute figures can be read against the machine's speed."""
    rounds, samples = ("20", "1") if args.quick else ("300", "3")
    command = [sys.executable, str(Path(__file__).with_name("broker_phases.py")), *FLOOR_CASE]
    command += ["--rounds", rounds, "--samples", samples, "--json"]
    return float(last_json_line(command, "broker_phases.py")["final"]["total"])


def start_servers(
    g: Group, setup: Setup, args: argparse.Namespace, profile: str | None = None, tree: Tree | None = None
) -> tuple[str, list[str]]:
    """Start the server side of ``setup``; returns the clients' address and the worker tags.
    ``tree``: the broker is that source tree's (``--baseline-ref``), not the installed one."""
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
        if tree is not None:
            front, back = tree_broker_ready(g, tree)
        else:
            g.start("server", "broker", roles.broker, profile)
            front, back, g.broker_metrics = g.expect("ready", ["broker"])["broker"]
        target, extra = roles.echo_doubles, (args.credits,)
    sizes = split(setup.workers, args.worker_procs)
    if setup.kind != "proxy" and args.doubles == "lean":
        heartbeat_s = WorkerConfig().heartbeat_interval_s
        return front, [
            g.start(
                "workers",
                f"workers{i}",
                roles.echo_double_fleet,
                back,
                n,
                args.credits,
                1,  # one thread per process: they take turns on the GIL anyway
                heartbeat_s,
                CTX.Array("q", roles.FLEET_COUNTS, lock=False),
            )
            for i, n in enumerate(sizes)
        ]
    return front, [g.start("workers", f"workers{i}", target, back, n, *extra) for i, n in enumerate(sizes)]


def run_throughput(
    setup: Setup, args: argparse.Namespace, profile: tuple[str, str] | None = None, tree: Tree | None = None
) -> dict[str, Any]:
    """One case. ``profile``: (``py-spy`` or ``cprofile``, output path) profiles the broker;
    ``tree``: the broker of that source tree (``--baseline-ref``)."""
    if setup.kind == "curve":  # every process of the case (spawned: they read it at start) uses the keys
        os.environ[roles.CURVE_ENV] = roles.make_curve_keys(args.keys_dir)
    else:
        os.environ.pop(roles.CURVE_ENV, None)
    g, spy = Group(), None
    try:
        cprofile_out = profile[1] if profile and profile[0] == "cprofile" else None
        address, worker_tags = start_servers(g, setup, args, cprofile_out, tree)
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
        run = (setup.batch, setup.window, g.go, g.clock)
        fleets = client_fleets(setup, args)
        if fleets:
            tags = [
                g.start("clients", f"clients{i}", roles.client_fleet, address, n, *run) for i, n in enumerate(fleets)
            ]
        else:
            tags = [g.start("clients", f"client{i}", target, address, *run) for i in range(setup.clients)]
        g.expect("ready", tags + worker_tags)
        if setup.kind in ("broker", "curve", "library"):
            wait_registered(address, setup.workers)
        t_begin, t_end = g.start_window(args.warmup, args.duration)
        time.sleep(max(0.0, t_begin - time.monotonic()))
        cpu0, messages0 = g.cpu(), roles.broker_messages(g.broker_metrics)
        if profile and profile[0] == "py-spy":
            spy = profiling.start_py_spy(g.pid("broker"), args.duration, profile[1])
        time.sleep(max(0.0, t_end - time.monotonic()))
        cpu1, messages1 = g.cpu(), roles.broker_messages(g.broker_metrics)
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
        "client_processes": len(tags),
        "jobs_per_s": round(jobs / args.duration),
        "errors": sum(d["errors"] for d in done.values()),
        "cpu_cores": cpu,
        "server_cpu_us_per_job": round(server_us, 2),
        "broker_messages_per_job": (
            None if messages0 is None or messages1 is None or not jobs else round((messages1 - messages0) / jobs, 3)
        ),
    }


LATENCY_PATHS = {  # name: (server role, worker role or None, client kind)
    "direct": ("direct_echo_server", None, "submit"),
    "broker": ("broker", "echo_doubles", "submit"),
    "raw-direct": ("raw_echo_server", None, "raw"),
    "proxy": ("proxy", "raw_echoes", "raw"),
}


def run_latency(path: str, args: argparse.Namespace, tree: Tree | None = None) -> list[int]:
    """Round trips of one path, in ns. ``tree``: the ``broker`` path's broker is that tree's."""
    server, workers, kind = LATENCY_PATHS[path]
    g = Group()
    try:
        if tree is not None and server == "broker":
            ready: Any = tree_broker_ready(g, tree)
        else:
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
    batch, window = (BATCH, args.batch_window) if args.profile == "batched" else (1, SINGLE_WINDOW)
    row = run_throughput(Setup("broker", clients, workers, batch, window), args, (tool, path))
    print(f"{row['case']}, profiled by {tool}: {row['jobs_per_s']:,} jobs/s, CPU cores "
          f"{row['cpu_cores']}, broker {row['server_cpu_us_per_job']} us CPU per job")  # fmt: skip
    if tool == "py-spy":
        profiling.print_py_spy(path, 25)
    else:
        profiling.print_cprofile(path, 30)


def selected(args: argparse.Namespace, name: str) -> bool:
    """Whether ``--only`` (texts, comma-separated) lets the case ``name`` run."""
    return not args.only or any(text and text in name for text in args.only.split(","))


# -- --baseline-ref: the broker of another commit beside this one -----------------------------
def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.rstrip()


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[tuple[str, str]]:
    """``git worktree add --detach`` of ``ref`` in a temporary folder: (its path, the commit).
    Removed (and pruned) at the end, on an error and on Ctrl-C or SIGTERM too."""
    try:
        sha = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"{ref!r} is not a commit of {REPO}") from None
    tmp = tempfile.mkdtemp(prefix="zr-bench-tree-")
    path = os.path.join(tmp, "tree")
    try:
        _git("worktree", "add", "--detach", "--quiet", path, sha)
        yield path, sha
    finally:
        # A second Ctrl-C (or the SIGTERM that follows one) must not leave a worktree behind.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            git = ["git", "-C", str(REPO), "worktree"]
            subprocess.run([*git, "remove", "--force", path], check=False, capture_output=True)
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run([*git, "prune"], check=False, capture_output=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def wire_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two ``roles.wire_fingerprint()``s: commands, then structs."""
    out, defs_a, defs_b = [], {}, {}
    for table in sorted(set(a["tables"]) | set(b["tables"])):
        ta, tb = a["tables"].get(table, {}), b["tables"].get(table, {})
        for cmd in sorted(set(ta) | set(tb)):
            for schema, defs in ((ta.get(cmd), defs_a), (tb.get(cmd), defs_b)):
                defs.update((schema or {}).get("$defs", {}))
            if cmd not in ta or cmd not in tb or ta[cmd] != tb[cmd]:
                out.append(f"{table} 0x{cmd}")
    out += [f"struct {n}" for n in sorted(set(defs_a) | set(defs_b)) if defs_a.get(n) != defs_b.get(n)]
    return out


def check_protocol(tree: Tree, args: argparse.Namespace, clients: dict[str, Any]) -> str:
    """Before measuring: ``tree``'s broker must speak the wire of this checkout's clients and
    echo doubles (both trees' brokers serve the same clients and workers). The protocol
    version (the signature, ``ZR1``) must be the same; then one echo double and one client of
    this checkout exchange what the benchmark sends (one SUBMIT of 64 jobs, 64 one-job
    SUBMITs): every job must come back FINAL, none refused. Raises naming the tree if not;
    a line for the report if so. A wire schema that differs (``wire_differences``) is
    reported, not refused: the protocol lets a receiver ignore trailing fields it does not
    know, and a sender omit those at their defaults (``zmq_rollout/protocol/base.py``)."""
    import zmq

    from zmq_rollout import codec
    from zmq_rollout import protocol as p

    g, sock, answered, refused = Group(), None, set(), []
    ids = [f"check-{i}" for i in range(2 * BATCH)]
    try:
        front, back = tree_broker_ready(g, tree)
        if tree.wire["signature"] != clients["signature"]:
            raise RuntimeError(
                f"the {tree.label} broker ({tree.describe}) speaks protocol {tree.wire['signature']!r}, this "
                f"checkout's clients and workers {clients['signature']!r}: they cannot be measured together"
            )
        g.start("workers", "check-workers", roles.echo_doubles, back, 1, args.credits)
        g.expect("ready", ["check-workers"])
        wait_registered(front, 1)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(front)
        specs = [p.JobSpec(i, roles.SAMPLING, roles.PROMPT) for i in ids]
        sock.send_multipart(codec.encode(p.SUBMIT, specs[:BATCH]))
        for spec in specs[BATCH:]:
            sock.send_multipart(codec.encode(p.SUBMIT, [spec]))
        decoder, deadline = codec.Decoder(codec.TO_CLIENT), time.monotonic() + 20
        while len(answered) + len(refused) < len(ids) and time.monotonic() < deadline:
            if sock.poll(200):
                msg = decoder.decode(sock.recv_multipart())
                if msg.command == p.FINAL:
                    answered.update(r.key for r in msg.body)
                elif msg.command in (p.ERROR, p.BUSY):
                    refused += [f"{e.key}: {e.code}: {e.message}" for e in msg.body]
        sock.send_multipart(codec.encode(p.DISCONNECT))
    finally:
        if sock is not None:
            sock.close()
        g.close()
    if refused or answered != set(ids):
        raise RuntimeError(
            f"the {tree.label} broker ({tree.describe}) does not serve this checkout's clients and workers: "
            f"{len(answered & set(ids))}/{len(ids)} jobs answered, refused: {refused[:3]}; wire differences: "
            f"{wire_differences(tree.wire, clients) or 'none'}"
        )
    diff = wire_differences(tree.wire, clients)
    wire = f"wire schema differs from the clients' in {', '.join(diff)}" if diff else "wire identical to the clients'"
    return f"{tree.label}: protocol {tree.wire['signature']}, {wire}, {len(answered)}/{len(ids)} check jobs answered"


def matrix_setups(batch_window: int = BATCH_WINDOW, http_window: int = HTTP_WINDOW) -> list[Setup]:
    """The full run's cases: the broker's, with CurveZMQ, the library's, ``zmq.proxy``'s and the
    HTTP endpoint's (``http_window`` POSTs in flight, of 1 or ``BATCH`` requests). ``batch_window``:
    SUBMITs in flight per client in the batched cases but HTTP's."""
    windows = ((1, SINGLE_WINDOW), (BATCH, batch_window))
    setups = [Setup("broker", c, w, b, win) for c in (1, 8) for w in (1, 8, 64) for b, win in windows]
    setups += [Setup("curve", c, c, b, win) for c in (1, 8) for b, win in windows]  # CurveZMQ on both ports
    setups.append(Setup("library", 1, 8, BATCH, batch_window))
    setups += [Setup("proxy", c, c, b, win) for c in (1, 8) for b, win in windows]
    return [*setups, Setup("http", 1, 0, 1, http_window), Setup("http", 1, 0, BATCH, http_window)]


def comparison_setups(batch_window: int = BATCH_WINDOW) -> list[Setup]:
    """The full run's broker cases and the library's; not ``broker+curve``: a baseline may
    predate CurveZMQ."""
    return [s for s in matrix_setups(batch_window) if s.kind in ("broker", "library")]


def compare(args: argparse.Namespace) -> None:
    """``--baseline-ref``: each broker case (and the broker latency path) with the broker of
    ``before`` (the ref) and of ``after`` (this working tree, or ``--after-ref``), the same
    clients and echo doubles (this checkout's) for both, ``--repeats`` pairs of runs back to
    back in alternating order (before-after, after-before, ...), so that drift on a shared
    machine hits both alike; medians reported."""
    started, load0 = time.monotonic(), os.getloadavg()
    os.environ.pop(roles.CURVE_ENV, None)
    with contextlib.ExitStack() as stack:
        path, sha = stack.enter_context(worktree(args.baseline_ref))
        before = Tree("before", path, f"{args.baseline_ref} = {sha[:9]} (a git worktree)")
        if args.after_ref:
            path, sha = stack.enter_context(worktree(args.after_ref))
            after = Tree("after", path, f"{args.after_ref} = {sha[:9]} (a git worktree)")
        else:
            after = Tree("after", str(REPO), f"this working tree, at HEAD {_git('rev-parse', '--short=9', 'HEAD')}")
        clients = roles.wire_fingerprint()
        checks = [check_protocol(tree, args, clients) for tree in (before, after)]
        if not args.after_ref:  # say which files the after broker imported are not as in HEAD
            changed = [line[3:] for line in _git("status", "--porcelain", "--", "broker", "zmq_rollout").splitlines()]
            dirty = [f for f in after.files if any(f == c or (c.endswith("/") and f.startswith(c)) for c in changed)]
            if dirty:
                after.describe += f", with uncommitted changes to {', '.join(dirty)} (others' work in progress?)"
        for line in checks:
            print(f"  {line}", flush=True)

        def pairs(r: int) -> tuple[Tree, Tree]:
            return (before, after) if r % 2 == 0 else (after, before)

        scheduler: dict[str, list[float]] = {"before": [], "after": []}
        if selected(args, "scheduler"):
            for r in range(args.repeats):
                for tree in pairs(r):
                    scheduler[tree.label].append(run_tree_scheduler(tree, args))
                print(
                    f"  scheduler alone pair {r + 1}/{args.repeats}: before {scheduler['before'][-1]:.2f}, "
                    f"after {scheduler['after'][-1]:.2f} us CPU per job",
                    flush=True,
                )
        latency: dict[str, list[dict[str, float]]] = {"direct": [], "before": [], "after": []}
        if selected(args, "latency"):
            for r in range(args.repeats):
                for tree in (None, *pairs(r)):
                    samples = run_latency("direct" if tree is None else "broker", args, tree)
                    lat = {"p50": percentile_us(samples, 0.5), "p99": percentile_us(samples, 0.99)}
                    latency["direct" if tree is None else tree.label].append(lat)
                print(
                    f"  latency pair {r + 1}/{args.repeats}: broker p50 before {latency['before'][-1]['p50']:.1f} us, "
                    f"after {latency['after'][-1]['p50']:.1f} us (direct {latency['direct'][-1]['p50']:.1f} us)",
                    flush=True,
                )
        cases = []
        for setup in comparison_setups(args.batch_window):
            if not selected(args, setup.name):
                continue
            runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
            for r in range(args.repeats):
                for tree in pairs(r):
                    runs[tree.label].append(run_throughput(setup, args, tree=tree))
                print(
                    f"  {setup.name:<40} pair {r + 1}/{args.repeats}: before {runs['before'][-1]['jobs_per_s']:>8,} "
                    f"after {runs['after'][-1]['jobs_per_s']:>8,} jobs/s",
                    flush=True,
                )
            cases.append({"case": setup.name, **runs})
    meta = {
        "before": before.describe,
        "after": after.describe,
        "checks": checks,
        "load_avg_1m": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
    }
    report_comparison(cases, latency, scheduler, meta, args, time.monotonic() - started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short windows for a CI smoke run (under a minute)")
    ap.add_argument("--duration", type=float, help="seconds measured per case (default 5, --scale 4, quick 1)")
    ap.add_argument(
        "--warmup", type=float, help="seconds of load before measuring (default 1, --scale 0.5, quick 0.25)"
    )
    ap.add_argument("--latency-count", type=int, help="round trips per latency path (default 5000, quick 500)")
    ap.add_argument("--credits", type=int, default=64, help="credits per echo double (vLLM max_num_seqs)")
    ap.add_argument("--worker-procs", type=int, default=2, help="processes the worker threads are spread over")
    ap.add_argument(
        "--batch-window",
        type=int,
        default=BATCH_WINDOW,
        metavar="N",
        help=f"batched cases: SUBMITs of {BATCH} jobs each client keeps in flight (default {BATCH_WINDOW}; "
        f"8 gives the 8-client cases the HTTP baseline's 4,096 jobs in flight)",
    )
    ap.add_argument(
        "--http-window",
        type=int,
        default=HTTP_WINDOW,
        metavar="N",
        help=f"the HTTP baseline: POSTs its client keeps in flight (default {HTTP_WINDOW}; "
        f"32 gives it the 2,048 jobs in flight of the broker's 8-client batched cases at the default --batch-window)",
    )
    ap.add_argument(
        "--doubles",
        choices=["lean", "echo"],
        default="lean",
        help="the broker cases' test doubles: lean (default: a fleet of worker doubles per process, clients "
        "and workers making the same bytes from templates) or echo (EchoWorkerDouble threads, everything "
        "built and read through the codec, as before the tenth session)",
    )
    ap.add_argument(
        "--scale",
        action="store_true",
        help="instead of the matrix: the broker's CPU per job and memory with 1 to 1,024 workers and 1 to 64 "
        "clients (broker_scale.py; '--only scale' too); --quick: 3 shapes",
    )
    ap.add_argument("--worker-threads", type=int, default=4, help="with --scale: threads per worker process")
    ap.add_argument(
        "--scale-shapes",
        default="",
        metavar="CxW,...",
        help="with --scale: only these CLIENTSxWORKERS shapes (e.g. 8x8,64x1024), instead of the table's",
    )
    ap.add_argument(
        "--batched-client-procs",
        type=int,
        default=1,
        metavar="N",
        help="the batched broker and Curve cases (lean doubles): processes their clients are spread over, each "
        "one thread serving its clients' sockets, as the HTTP baseline's client is one process (default 1; 0: a "
        "process per client, as before the twenty-second session)",
    )
    ap.add_argument("--client-procs", type=int, default=2, help="with --scale: processes the clients are spread over")
    ap.add_argument(
        "--only",
        default="",
        help="run only the cases whose name contains this text, or one of these texts, comma-separated "
        "('latency' runs the latency paths; with --baseline-ref, 'scheduler' the in-process scheduler)",
    )
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
    ap.add_argument(
        "--baseline-ref",
        metavar="REF",
        help="measure the broker cases with the broker of commit REF (a temporary git worktree) and with "
        "this one, interleaved; same clients and echo doubles (this checkout's) for both; with --scale: the "
        "scale run measures REF's broker alone (alternate runs with and without it for an A/B)",
    )
    ap.add_argument(
        "--after-ref",
        metavar="REF",
        help="with --baseline-ref: the 'after' broker is commit REF's (a worktree) instead of this working tree",
    )
    ap.add_argument(
        "--goal-pairs",
        type=int,
        default=0,
        metavar="N",
        help="after the cases: the 3x-HTTP goal's two cases (the best broker batched one, HTTP batched) N more "
        "times as back-to-back pairs, each pair's ratio and their median printed (default 0: none)",
    )
    ap.add_argument(
        "--latency-rounds",
        type=int,
        default=1,
        metavar="N",
        help="the four latency paths N times, in a rotated order each round: the latency goal's ratio per round "
        "and its median printed (default 1: one round, as before)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="with --baseline-ref: before/after pairs per case (median)")
    ap.add_argument(
        "--ack", action="store_true", help="the clients' jobs ask for ACCEPTED (JobSpec.ack; off as in the client)"
    )
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        metavar="N",
        help="the clients' prompts are N token ids, as an RL trainer sends them (default 0: 100 characters)",
    )
    ap.add_argument(
        "--sample-tokens",
        type=int,
        default=0,
        metavar="N",
        help="the worker doubles answer each job with N-token samples and their logprobs, sealed "
        "(SEALED_FINAL) where the broker reads it, and its prompt's ids (default 0: 4-token samples); the "
        "proxy and HTTP baselines do not carry them",
    )
    ap.add_argument(
        "--broker-config",
        default="",
        metavar="KEY=INT,...",
        help="BrokerConfig settings of the brokers measured (this checkout's and --baseline-ref's), e.g. "
        "pack_step=64,busy_poll_us=0 (default: the broker's own)",
    )
    args = ap.parse_args()
    if args.batched_client_procs < 0:
        ap.error(f"--batched-client-procs {args.batched_client_procs}: 0 (a process per client) or more")
    if args.batch_window < 1:
        ap.error(f"--batch-window {args.batch_window}: at least 1 SUBMIT in flight per client")
    if args.http_window < 1:
        ap.error(f"--http-window {args.http_window}: at least 1 POST in flight")
    try:
        settings = {k.strip(): int(v) for k, v in (kv.split("=") for kv in args.broker_config.split(",") if kv)}
        BrokerConfig(**settings)
    except (ValueError, TypeError) as exc:
        ap.error(f"--broker-config {args.broker_config!r}: {exc}")
    os.environ[roles.BROKER_CONFIG_ENV] = json.dumps(settings)  # the spawned brokers read it
    if args.ack:
        os.environ[roles.ACK_ENV] = "1"  # the client processes, spawned, read it (roles.ACK)
        roles.ACK = True
    os.environ[roles.DOUBLES_ENV] = args.doubles  # read by the spawned clients and doubles
    roles.LEAN = args.doubles == "lean"
    if args.prompt_tokens:
        os.environ[roles.PROMPT_TOKENS_ENV] = str(args.prompt_tokens)  # read by the spawned clients too
        roles.PROMPT_TOKENS = args.prompt_tokens
    if args.sample_tokens:
        os.environ[roles.SAMPLE_TOKENS_ENV] = str(args.sample_tokens)  # read by the spawned doubles
        roles.SAMPLE_TOKENS = args.sample_tokens
    if args.after_ref and not args.baseline_ref:
        ap.error("--after-ref needs --baseline-ref")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.goal_pairs < 0:
        ap.error("--goal-pairs must be 0 or more")
    if args.latency_rounds < 1:
        ap.error("--latency-rounds must be at least 1")
    if args.goal_pairs and (args.scale or args.baseline_ref or args.profile):
        ap.error("--goal-pairs pairs the full run's cases: not with --scale, --baseline-ref or --profile")
    args.keys_dir = tempfile.mkdtemp(prefix="zr-bench-keys-")
    scale = args.scale or "scale" in args.only.split(",")
    if scale:
        import broker_scale

        try:
            broker_scale.shapes(args.quick, args.scale_shapes)
        except ValueError as exc:
            ap.error(str(exc))
    args.duration = args.duration or (1.0 if args.quick else 4.0 if scale else 5.0)
    args.warmup = args.warmup if args.warmup is not None else (0.25 if args.quick else 0.5 if scale else 1.0)
    args.latency_count = args.latency_count or (500 if args.quick else 5000)

    if args.profile:
        profile(args)
        return
    if scale:
        broker_scale.run(args)
        return
    if args.baseline_ref:
        compare(args)
        return
    started = time.monotonic()
    floor = [in_process_floor(args)]
    print(f"  the scheduler and codec alone, in one process: {floor[0]:.2f} us/job", flush=True)
    rounds = latency_rounds(args) if selected(args, "latency") else []
    latency = rounds[0] if rounds else {}
    rows, setups = [], {}
    for setup in matrix_setups(args.batch_window, args.http_window):
        if not selected(args, setup.name):
            continue
        rows.append(run_throughput(setup, args))
        setups[setup.name] = setup
        print(f"  {rows[-1]['case']:<40} {rows[-1]['jobs_per_s']:>10,} jobs/s", flush=True)
    pairs = goal_pairs(rows, setups, args) if args.goal_pairs else []
    floor.append(in_process_floor(args))
    report(rows, latency, args, time.monotonic() - started, pairs, floor, rounds)


def latency_rounds(args: argparse.Namespace) -> list[dict[str, list[int]]]:
    """The four latency paths, ``--latency-rounds`` times; each round in the order of the last
    rotated by one, so that no path always runs first or after the same one. Round trips in ns,
    per path, per round."""
    rounds: list[dict[str, list[int]]] = []
    paths = list(LATENCY_PATHS)
    for r in range(args.latency_rounds):
        samples: dict[str, list[int]] = {}
        for path in paths[r % len(paths) :] + paths[: r % len(paths)]:
            samples[path] = run_latency(path, args)
            of = f" (round {r + 1}/{args.latency_rounds})" if args.latency_rounds > 1 else ""
            print(f"  latency {path:<10}{of} p50 {percentile_us(samples[path], 0.5):7.1f} us", flush=True)
        rounds.append({path: samples[path] for path in paths})  # the table's order
    return rounds


def goal_pairs(rows: list[dict[str, Any]], setups: dict[str, Setup], args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--goal-pairs N``: the 3x goal's two cases (the best broker batched case of ``rows`` and
    HTTP batched) run again N times as pairs, back to back, alternating which goes first: a
    ratio per pair, so that one noisy window on either side does not decide the verdict."""
    batched = [r for r in rows if r["kind"] == "broker" and r["jobs_per_message"] > 1]
    http = [r for r in rows if r["kind"] == "http" and r["jobs_per_message"] > 1]
    if not batched or not http:
        print("--goal-pairs: the run measured no broker batched case or no HTTP batched case; no pairs", flush=True)
        return []
    broker_setup = setups[max(batched, key=lambda r: r["jobs_per_s"])["case"]]
    http_setup = setups[http[0]["case"]]
    pairs = []
    for k in range(args.goal_pairs):
        order = (broker_setup, http_setup) if k % 2 == 0 else (http_setup, broker_setup)
        runs = {setup.kind: run_throughput(setup, args) for setup in order}
        broker, served = runs["broker"]["jobs_per_s"], runs["http"]["jobs_per_s"]
        pairs.append(
            {
                "pair": k + 1,
                "first": order[0].name,
                "broker_case": broker_setup.name,
                "broker_jobs_per_s": broker,
                "broker_us_per_job": runs["broker"]["server_cpu_us_per_job"],
                "http_jobs_per_s": served,
                "http_us_per_job": runs["http"]["server_cpu_us_per_job"],
                "ratio": round(broker / served, 3) if served else None,
            }
        )
        print(
            f"  goal pair {k + 1}/{args.goal_pairs}: {broker_setup.name} {broker:>8,} jobs/s, "
            f"HTTP batched {served:>8,} jobs/s: {pairs[-1]['ratio']}x",
            flush=True,
        )
    return pairs


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # so that a SIGTERM also runs every ``Group.close``


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted; every benchmark process was terminated", file=sys.stderr)
        sys.exit(130)
