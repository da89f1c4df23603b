"""Every query of every Grafana dashboard returns data from a REAL Prometheus scraping a live
fleet, and ``deploy/grafana/render.py`` draws the dashboards from it.

The fleet: a ``zmq-rollout broker`` process that requires CurveZMQ, with ``/metrics``, and
two real vLLM CPU workers, each with its own ``--metrics-port``, scraped every second by
Prometheus from before they start. What happens, so that every panel has something to show:
three clients run jobs; a peer whose key is not on the broker's list is refused (an auth
failure) and an allowed one sends a malformed message; a clean weight sync (shm); a sync
that fails on every worker (its segment is gone: step failures, an aborted round); a sync
with jobs in flight (``pause="abort"``) during which one worker is SIGKILLed: it is lost
from the round (an eviction, a lost worker), and the jobs it held requeue on the other worker;
then a clean round (``pause="abort"``) while that worker decodes them, so that samples cross a
sync (stale samples, per-token version spans).

Then every target of every panel of every ``deploy/grafana/dashboards/*.json`` is asked over
the test's window (``query_range``, step 1 s) with the variables (resolved by the
dashboard's own ``label_values`` queries) and Grafana's macros written in as Grafana would
(``deploy/grafana/promql.py``); each must return a series with a number in it.

``ZMQ_ROLLOUT_RENDER_DIR=DIR`` keeps the PNGs (``docs/images/dashboard-fleet.png`` is the
Fleet one). Prometheus: ``prometheus_helpers`` (a missing binary fails the test).
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers import free_port, poll_until, scrape
from prometheus_helpers import JOB, Prometheus, prometheus_binary, start_prometheus_fixture  # noqa: F401

from zmq_rollout import protocol as p

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
RENDER_ENV = "ZMQ_ROLLOUT_RENDER_DIR"
WORKERS = ("worker-0", "worker-1")
VICTIM = "worker-1"
CLIENTS = ("trainer-a", "trainer-b", "eval")
LONG = 900  # tokens of the jobs the second sync catches in flight: seconds on a fast machine (300 were one or two)


def grafana() -> tuple[ModuleType, ModuleType]:
    """``promql`` and ``render`` from deploy/grafana (scripts beside the dashboards, not a package)."""
    if str(GRAFANA) not in sys.path:
        sys.path.insert(0, str(GRAFANA))
    return importlib.import_module("promql"), importlib.import_module("render")


def query_problems(results: list[Any], names: set[str]) -> list[str]:
    """What is wrong with evaluated targets: an error, no series, no number; with the
    metrics a query names that Prometheus never saw (``names``: every series name)."""
    import re

    problems = []
    for r in results:
        if r.error:
            problems.append(f"{r.where}: {r.error}")
        elif not r.series or not r.finite:
            named = set(re.findall(r"\b(?:zmq_rollout_\w+|vllm:[\w:]+)", r.expr))
            unknown = sorted(named - names)
            why = f"no such metric {', '.join(unknown)}" if unknown else "no series" if not r.series else "only NaN"
            problems.append(f"{r.where}: {why} (ran {r.expr!r})")
    return problems


# -- the parts without a fleet --------------------------------------------------------------
def test_substitution_writes_variables_and_macros_as_grafana_does() -> None:
    promql, _ = grafana()
    window = promql.Window(start=1000.0, end=1180.0, step=1.0, scrape_interval=1.0)
    variables = {"worker": ["w-0", "w.1"], "client": ".*", "q": "0.9"}
    expr = 'histogram_quantile($q, rate(x{worker=~"$worker",c=~"${client}"}[$__rate_interval])) [[worker:pipe]]'
    assert promql.substitute(expr, variables, window) == (
        'histogram_quantile(0.9, rate(x{worker=~"(w-0|w\\.1)",c=~".*"}[4s])) w-0|w.1'
    )
    assert promql.substitute("increase(x[$__range]) / $__interval_ms", {}, window) == "increase(x[180s]) / 1000"
    assert promql.substitute('label_replace(x, "a", "$1", "b", "(.*)")', {}, window).count("$1") == 1
    with pytest.raises(promql.UnknownVariable, match=r"\$instance"):
        promql.substitute('up{instance="$instance"}', variables, window)


def test_render_says_one_line_and_exits_2_when_prometheus_is_unreachable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, render = grafana()
    (tmp_path / "d.json").write_text('{"title": "D", "panels": []}')
    argv = ["--prometheus", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path), "--dashboards", str(tmp_path)]
    assert render.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Prometheus unreachable at http://127.0.0.1:" in err, err


# -- the fleet -------------------------------------------------------------------------------
class Fleet:
    """A ``zmq-rollout broker`` process that requires CurveZMQ, with ``/metrics``, and real vLLM
    CPU worker processes, each with its own ``--metrics-port``. It owns every process it
    starts and stops exactly those."""

    def __init__(self, model: str, tmp: Path) -> None:
        from zmq_rollout.curve import generate_keypair

        self.model, self.logs = model, tmp / "logs"
        self.logs.mkdir()
        self.broker_key, broker_secret = generate_keypair(tmp / "keys", "broker")
        _, self.trainer_secret = generate_keypair(tmp / "keys" / "allowed", "trainer")
        _, self.worker_secret = generate_keypair(tmp / "keys" / "allowed", "worker")
        _, self.stranger_secret = generate_keypair(tmp / "keys", "stranger")  # not on the list
        self.frontend, self.backend = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        self.metrics_port = free_port()
        self.broker_args = [
            *("--frontend", self.frontend, "--backend", self.backend),
            *("--metrics-port", str(self.metrics_port), "--heartbeat-interval-s", "0.5", "--worker-liveness", "10"),
            *("--curve-secret-key", str(broker_secret), "--allow-keys", str(tmp / "keys" / "allowed")),
        ]
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.worker_ports: dict[str, int] = {}
        """Each worker's ``--metrics-port``."""

    def generated_tokens(self, name: str) -> float:
        """Tokens worker ``name``'s engine has generated so far: vLLM's counter, scraped from the
        worker itself (its stat logger raises it as the engine steps; a job's own count comes at
        its end)."""
        samples = scrape(self.worker_ports[name])
        return sum(value for key, value in samples.items() if key.startswith("vllm:generation_tokens_total"))

    def _spawn(self, name: str, argv: list[str], niceness: int = 0) -> subprocess.Popen[bytes]:
        from zmq_rollout.local import start_nicer

        with (self.logs / f"{name}.log").open("ab") as log:
            proc = start_nicer(argv, niceness, stdout=log, stderr=subprocess.STDOUT)
        self.processes[name] = proc
        return proc

    def start_broker(self) -> None:
        self._spawn("broker", [sys.executable, "-m", "zmq_rollout.cli", "broker", *self.broker_args])

    def start_worker(self, name: str, metrics_port: int) -> None:
        from zmq_rollout.config import WorkerConfig
        from zmq_rollout.local import LOCAL_WORKER_DEFAULTS
        from zmq_rollout.workers.main import worker_command

        config = WorkerConfig(
            broker=self.backend,
            model=self.model,
            name=name,
            metrics_port=metrics_port,
            heartbeat_interval_s=0.5,
            curve_server_key=str(self.broker_key),
            curve_secret_key=str(self.worker_secret),
            **LOCAL_WORKER_DEFAULTS,
        )
        self.worker_ports[name] = metrics_port
        self._spawn(name, worker_command(config), niceness=10)  # as LocalCluster's: the broker keeps its CPU

    def client(self, name: str, **overrides: Any) -> Any:
        from zmq_rollout.blocking import RolloutClient

        keys = {"curve_server_key": str(self.broker_key), "curve_secret_key": str(self.trainer_secret)}
        return RolloutClient(self.frontend, name=name, **keys, **overrides)

    def raw_socket(self, secret: Path) -> Any:
        """A bare DEALER on the frontend under the keypair ``secret``."""
        import zmq

        from zmq_rollout.curve import PeerKeys

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        keys = PeerKeys.from_files(str(self.broker_key), str(secret), "test")
        assert keys is not None
        keys.apply(sock)
        sock.connect(self.frontend)
        return sock

    def kill(self, name: str) -> None:
        """SIGKILL a worker's process group (the worker and its engine core); reaped by ``reap``."""
        os.killpg(self.processes[name].pid, signal.SIGKILL)

    def reap(self, name: str) -> int:
        return self.processes.pop(name).wait(timeout=60)

    def alive(self) -> dict[str, int | None]:
        return {name: proc.poll() for name, proc in self.processes.items()}

    def stop(self) -> None:
        """Workers first (they hand their jobs back), then the broker; SIGKILL after 30 s."""
        workers = [proc for name, proc in self.processes.items() if name != "broker"]
        for group in (workers, [self.processes[n] for n in self.processes if n == "broker"]):
            for proc in group:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc in group:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


@pytest.fixture
def fleet(tiny_model: str, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tiny_model, tmp_path)
    try:
        yield f
    finally:
        f.stop()


def killing_shm(kill: Callable[[], None]) -> Any:
    """The shm transport, killing a worker as its first bucket is about to go out: the round
    has begun (every member paused), so the dead worker is lost from the round."""
    from zmq_rollout.weight_sync.shm import ShmTransport

    class KillingShm(ShmTransport):
        async def send(self, rnd: Any, shipment: Any) -> None:
            kill()
            await super().send(rnd, shipment)

    return KillingShm()


def vanished_shm() -> Any:
    """The shm transport whose segment is gone when the workers look (a trainer that lost its
    shared memory): every member fails ``load_shm``, the trainer aborts the round. The step
    does not begin the update, so the workers' weights stay clean and they serve on."""
    from zmq_rollout.weight_sync.shm import ShmTransport

    class VanishedShm(ShmTransport):
        async def send(self, rnd: Any, shipment: Any) -> None:
            await rnd.step(p.LoadShm(f"zr-vanished-{os.getpid()}", shipment.buckets[0]))

    return VanishedShm()


def run_workload(fleet: Fleet, clients: dict[str, Any], tiny_model: str) -> dict[str, Any]:
    """Jobs from every client; a stranger refused; a malformed message; a clean sync; a sync
    that fails on every worker; a sync that loses a worker with jobs on it; a clean sync that
    the long jobs cross; more jobs. Returns what happened."""
    from model_helpers import trained_model

    from zmq_rollout.errors import SyncError
    from zmq_rollout.weight_sync.shm import ShmTransport

    prompts = [[(7 * i + j) % 200 + 3 for j in range(4 + i % 5)] for i in range(16)]
    sampling = p.SamplingParams(n=2, max_tokens=24, ignore_eos=True)
    trainer, status = clients["trainer-a"], clients["trainer-a"].status

    def load(seconds: float) -> None:
        """Every client generates, batch after batch, for about ``seconds``."""
        until = time.monotonic() + seconds

        def work(client: Any) -> None:
            while time.monotonic() < until:
                client.generate(prompts, sampling)

        threads = [threading.Thread(target=work, args=(c,)) for c in clients.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    load(8)
    # A peer whose key is not on the broker's list (refused in the handshake), and an allowed
    # one that sends something that is not msgpack.
    stranger, bad = fleet.raw_socket(fleet.stranger_secret), fleet.raw_socket(fleet.trainer_secret)
    try:
        bad.send_multipart([p.SIGNATURE, p.SUBMIT, b"\xc1"])
        poll_until(lambda: bad.poll(0), 10, "the broker's ERROR for a malformed message")
        refused = "zmq_rollout_auth_failures_total{port=frontend,reason=key_not_allowed}"
        poll_until(lambda: scrape(fleet.metrics_port).get(refused), 10, "the stranger's handshake refused")
    finally:
        stranger.close(linger=0)
        bad.close(linger=0)

    clean = trainer.update_weights(trained_model(tiny_model, 21), transport=ShmTransport(), bucket_bytes=200_000)
    assert sorted(clean.workers_updated) == list(WORKERS) and clean.workers_evicted == []
    with pytest.raises(SyncError, match="zr-vanished"):
        trainer.update_weights(trained_model(tiny_model, 22), transport=vanished_shm(), bucket_bytes=200_000)
    assert all(w.state == "ready" and w.weight_version == clean.version for w in status().workers)
    load(4)

    # Long jobs on both workers, then a round that loses the victim while it holds some.
    before = status().totals.requeued
    futures = [
        c.submit([i + 3, i + 7, 11], p.SamplingParams(max_tokens=LONG, ignore_eos=True, seed=i))
        for i in range(12)
        for c in (clients["trainer-b"], clients["eval"])
    ]

    def victim_busy() -> bool:
        running = {w.name: w.running for w in status().workers}
        return running.get(VICTIM, 0) > 0 and running.get(WORKERS[0], 0) > 0

    poll_until(victim_busy, 60, "long jobs running on both workers")
    lossy = trainer.update_weights(
        trained_model(tiny_model, 23),
        transport=killing_shm(lambda: fleet.kill(VICTIM)),
        pause="abort",
        bucket_bytes=200_000,
        timeout_s=60,  # the victim is lost at its heartbeat expiry (5 s) or a failed send, well before
    )
    fleet.reap(VICTIM)
    assert [e.name for e in lossy.workers_evicted] == [VICTIM], lossy
    assert lossy.workers_updated == [WORKERS[0]]
    # The survivor now decodes its long jobs and the victim's, requeued: seconds of work. A clean
    # round while it does cuts them ("abort": each goes on at the new version), the crossing
    # the span and staleness panels show. Waiting for the lossy round to catch a job both begun
    # and unfinished on the survivor raced the jobs' start against the victim's end.
    decoded = fleet.generated_tokens(WORKERS[0])
    poll_until(lambda: fleet.generated_tokens(WORKERS[0]) > decoded, 60, f"{WORKERS[0]} decoding the long jobs")
    crossing = trainer.update_weights(
        trained_model(tiny_model, 24), transport=ShmTransport(), pause="abort", bucket_bytes=200_000
    )
    assert crossing.workers_updated == [WORKERS[0]] and crossing.workers_evicted == [], crossing
    rollouts = [f.result(timeout=300)[0] for f in futures]
    assert all(len(r.token_ids) == LONG for r in rollouts)
    load(4)
    requeued = status().totals.requeued - before
    assert requeued > 0, "the victim held no jobs when it died"
    crossed = sum(r.weight_versions is not None for r in rollouts)
    assert crossed > 0, "no job ran across the round (the span and staleness panels would have nothing)"
    return {"version": crossing.version, "evicted": lossy.workers_evicted, "requeued": requeued, "crossed": crossed}


def test_every_dashboard_query_returns_data_from_a_live_fleet(
    fleet: Fleet, tmp_path: Path, start_prometheus: Callable[..., Prometheus]
) -> None:
    prometheus_binary()  # a missing binary fails here, before any work
    promql, render = grafana()
    dashboards = render.load(DASHBOARDS, [])
    assert dashboards, f"no dashboards in {DASHBOARDS}"
    began = time.monotonic()

    ports = {name: free_port() for name in WORKERS}
    targets = [f"127.0.0.1:{port}" for port in ports.values()]
    prometheus = start_prometheus({JOB: [f"127.0.0.1:{fleet.metrics_port}"], "zmq-rollout-worker": targets})
    fleet.start_broker()
    for name, port in ports.items():
        fleet.start_worker(name, port)
    prometheus.wait_ready(time.monotonic() + 30)
    clients = {name: fleet.client(name, timeout_s=300) for name in CLIENTS}
    try:

        def registered() -> bool:
            assert all(code is None for code in fleet.alive().values()), f"a process exited: {fleet.alive()}"
            return len(clients["eval"].status().workers) == len(WORKERS)

        poll_until(registered, 420, "both workers to register")  # minutes when the machine is busy
        up = time.monotonic()
        prometheus.wait_value("count(up == 1)", lambda v: v == 3, time.monotonic() + 30)  # every target scraped
        start = time.time()
        happened = run_workload(fleet, clients, fleet.model)
        worked = time.monotonic()
    finally:
        for client in clients.values():
            client.close()

    # Prometheus has scraped the end of it: the version, the eviction, the requeues.
    deadline = time.monotonic() + 30
    prometheus.wait_value("zmq_rollout_fleet_weight_version", lambda v: v == happened["version"], deadline)
    prometheus.wait_value("sum(zmq_rollout_sync_evictions_total)", lambda v: v == 1, deadline)
    prometheus.wait_value('zmq_rollout_jobs_total{outcome="requeued"}', lambda v: v >= happened["requeued"], deadline)
    api = promql.Prometheus(prometheus.url)
    window = promql.Window(start=start, end=time.time(), step=1.0, scrape_interval=api.scrape_interval())
    assert window.scrape_interval == 1.0

    # Every target of every panel of every dashboard, with its variables as the dashboard resolves them.
    names = set(api.get("/api/v1/label/__name__/values", start=window.start, end=window.end))
    counts = {"dashboards": len(dashboards), "panels": 0, "targets": 0, "non-empty": 0}
    problems = []
    for stem, dashboard in dashboards.items():
        variables = promql.Variables.resolve(dashboard, api, window)
        if "worker" in variables.values:
            assert variables.values["worker"] == sorted(WORKERS), (stem, variables.values)
        if "client" in variables.values:
            seen = variables.values["client"]
            assert all(any(c.startswith(name) for c in seen) for name in CLIENTS), (stem, seen)
        results = promql.evaluate(dashboard, api, window, variables)
        counts["panels"] += sum(p.get("type") != "row" for p in promql.panels(dashboard))
        counts["targets"] += len(results)
        found = query_problems(results, names)
        counts["non-empty"] += len(results) - len(found)
        problems += found
    print(f"dashboard queries over {window.end - window.start:.0f} s: {counts}; workload {happened}")
    assert problems == [], "dashboard queries without data:\n" + "\n".join(problems)
    assert counts["targets"] > 0

    # The checks above can fail: a target on a metric that does not exist, an unknown variable.
    exprs = ["rate(zmq_rollout_no_such_thing_total[$__rate_interval])", 'up{instance=~"$host"}']
    bogus = {"title": "Bogus", "panels": [{"title": "Nothing", "targets": [{"expr": e} for e in exprs]}]}
    found = query_problems(promql.evaluate(bogus, api, window, promql.Variables()), names)
    assert "'Nothing'" in found[0] and "no such metric zmq_rollout_no_such_thing_total" in found[0], found
    assert "$host is neither" in found[1], found

    # render.py draws each dashboard from the same Prometheus; beside each, its twin drawn over
    # an hour before the test (every panel "No data": titles and frames only) for scale.
    out = Path(os.environ.get(RENDER_ENV) or tmp_path / "render")
    span = f"{round(time.time() - start) + 1}s"
    argv = ["--prometheus", prometheus.url, "--dashboards", str(DASHBOARDS), "--since", span, "--step", "1s"]
    assert render.main([*argv, "--out", str(out)]) == 0
    assert render.main([*argv, "--out", str(tmp_path / "empty"), "--until", str(start - 3600)]) == 0
    for stem in dashboards:
        png, empty = out / f"{stem}.png", tmp_path / "empty" / f"{stem}.png"
        drawn, frames = drawn_fraction(png), drawn_fraction(empty)
        print(f"{png}: {png.stat().st_size} bytes, {drawn:.1%} of its pixels drawn ({frames:.1%} with no data)")
        assert drawn > 2 * frames, f"{png} draws hardly more than a dashboard without data"
    took = [up - began, worked - up, time.monotonic() - worked]
    print("workers up in {:.0f} s, the workload {:.0f} s, queries and PNGs {:.0f} s".format(*took), f"(in {out})")


def drawn_fraction(png: Path) -> float:
    """The share of a PNG's pixels that are neither the page's nor a panel's background."""
    import matplotlib.image
    import numpy as np

    _, render = grafana()
    image = matplotlib.image.imread(png)[..., :3]
    backgrounds = [np.array([int(c[i : i + 2], 16) / 255 for i in (1, 3, 5)]) for c in (render.PAGE, render.PANEL)]
    plain = np.zeros(image.shape[:2], dtype=bool)
    for bg in backgrounds:
        plain |= np.abs(image - bg).max(axis=-1) < 0.02
    return float(1 - plain.mean())
