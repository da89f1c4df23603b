"""The processes of ``broker_throughput.py``, one function per role.

Each role runs in its own spawned process. It ignores SIGINT (the parent owns Ctrl-C and
terminates its children), stops on SIGTERM, and talks to the parent through one queue of
``(kind, tag, payload)`` tuples: ``ready`` once it can serve, ``done`` with its figures,
``error`` with a traceback.

Clients run one measurement window ``clock = [t_begin, t_end]`` (``time.monotonic``, which
is one clock for every process of the machine): they start sending when ``go`` is set,
count only what completes inside the window, then drain and leave.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import operator
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import lean_doubles as lean
import zmq

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.batching import append
from zmq_rollout.submissions import pack_submits, submit_command
from zmq_rollout.testing import echo_result

PROMPT = "Solve step by step: a train leaves at 9:40 and travels 210 km at 84 km/h. When?".ljust(100)
SAMPLING = p.SamplingParams(max_tokens=16)
ACK_ENV = "ZR_BENCH_ACK"
ACK = os.environ.get(ACK_ENV) == "1"
"""Whether the clients' jobs ask for ACCEPTED (``JobSpec.ack``). Off, as the reference client
sends them (``broker_throughput.py --ack`` turns it on; a broker older than the field ignores
it and answers ACCEPTED anyway)."""


DOUBLES_ENV = "ZR_BENCH_DOUBLES"
LEAN = os.environ.get(DOUBLES_ENV, "lean") == "lean"
"""``broker_throughput.py --doubles``: lean (the default), the clients and the fleet's worker
doubles make their messages from byte templates (``lean_doubles.py``) and count answers from
their headers; echo, they build and read every job and result through the codec."""

PROMPT_TOKENS_ENV = "ZR_BENCH_PROMPT_TOKENS"
PROMPT_TOKENS = int(os.environ.get(PROMPT_TOKENS_ENV) or 0)
"""With ``broker_throughput.py --prompt-tokens N``: the clients' prompts are N token ids (as an
RL trainer sends them) instead of ``PROMPT``; 0, the default: ``PROMPT``."""


def bench_job(job_id: str) -> p.JobSpec:
    """A job as the benchmark's clients send it."""
    if PROMPT_TOKENS:
        return p.JobSpec(job_id, SAMPLING, prompt_token_ids=prompt_ids(PROMPT_TOKENS), ack=ACK)
    return p.JobSpec(job_id, SAMPLING, PROMPT, ack=ACK)


SAMPLE_TOKENS_ENV = "ZR_BENCH_SAMPLE_TOKENS"
SAMPLE_TOKENS = int(os.environ.get(SAMPLE_TOKENS_ENV) or 0)
"""With ``broker_throughput.py --sample-tokens N``: the worker doubles answer each job with
samples of N tokens and their logprobs (as an RL rollout comes back); 0, the default: the echo
double's 4-token samples."""


def bench_result(assignment: p.Assignment, name: str, weight_version: int = 0) -> p.Result:
    """A worker double's answer to a job: ``echo_result``, or with ``SAMPLE_TOKENS``, the job's
    prompt ids and ``n`` samples of that many tokens with their logprobs."""
    if not SAMPLE_TOKENS:
        return echo_result(assignment, name, weight_version)
    job = assignment.job
    tokens, logprobs = _sample(SAMPLE_TOKENS)
    samples = [p.Sample(i, tokens, logprobs, "length") for i in range(job.sampling.n)]
    return p.Result(assignment.ticket, job.prompt_token_ids or [len(job.prompt or "")], samples, weight_version, name)


@functools.cache
def _sample(n: int) -> tuple[list[int], list[float]]:
    """``n`` token ids of a 150k vocabulary and their logprobs (float64 on the wire)."""
    return [(i * 104_729) % 150_000 for i in range(n)], [-((i * 37) % 1000) / 137.0 for i in range(n)]


@functools.cache
def prompt_ids(n: int) -> list[int]:
    """``n`` token ids of a 150k vocabulary, of 1-3 msgpack bytes each, as a real one's."""
    return [(i * 7919) % 150_000 for i in range(n)]


RAW_JOB = PROMPT.encode()  # the zmq.proxy baseline's unit of work: 100 opaque bytes
DRAIN_SECONDS = 3.0


def _die_with_parent() -> None:
    """Have the kernel send SIGTERM to this process when its parent dies (Linux), so that a
    killed benchmark leaves no broker or worker behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent is already gone
        os.kill(os.getpid(), signal.SIGTERM)


def role(fn: Callable[..., None]) -> Callable[..., None]:
    """Wrap a role: ignore SIGINT, die with the parent, report any exception to the parent."""

    @functools.wraps(fn)
    def run(report: Any, tag: str, *args: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _die_with_parent()
        logging.basicConfig(level=logging.WARNING, format=f"[{tag}] %(levelname)s %(name)s: %(message)s")
        try:
            fn(report, tag, *args)
        except Exception:
            report.put(("error", tag, traceback.format_exc()))
            raise

    return run


CURVE_ENV = "ZMQ_ROLLOUT_BENCH_KEYS"
"""Set (to a keys folder) for a ``curve`` case: the broker requires CurveZMQ and every peer has keys."""
BROKER_CONFIG_ENV = "ZMQ_ROLLOUT_BENCH_BROKER_CONFIG"
"""``BrokerConfig`` settings of the benchmark's brokers, as JSON (``--broker-config``; unset: the defaults)."""


def make_curve_keys(folder: str) -> str:
    """A broker keypair and one peer keypair (on the allow-list) in ``folder``, made once."""
    from zmq_rollout.curve import generate_keypair

    if not os.path.exists(os.path.join(folder, "broker.key_secret")):
        generate_keypair(folder, "broker")
        generate_keypair(os.path.join(folder, "allowed"), "peer")
    return folder


def curve_keys() -> Any:
    """The peer keys (``PeerKeys``) of a ``curve`` case, or None."""
    folder = os.environ.get(CURVE_ENV)
    if not folder:
        return None
    from zmq_rollout.curve import PeerKeys

    return PeerKeys.from_files(
        os.path.join(folder, "broker.key"), os.path.join(folder, "allowed", "peer.key_secret"), "benchmark"
    )


def _stop_event() -> threading.Event:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return stop


def _socket(kind: int, address: str, *, bind: bool = False, identity: str = "") -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    keys = None if bind else curve_keys()
    if keys is not None:
        keys.apply(sock)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


# -- servers ---------------------------------------------------------------------------------
def broker_options(env: str = BROKER_CONFIG_ENV) -> dict[str, Any]:
    """``BrokerConfig`` settings the benchmark's command line gave its brokers (``--broker-config``).
    Self-contained: ``tree_command`` runs its source in a bare interpreter."""
    import json
    import os

    return dict(json.loads(os.environ.get(env) or "{}"))


@role
def broker(report: Any, tag: str, profile_path: str | None) -> None:
    """The product broker, as ``zmq-rollout broker`` runs it (optionally under cProfile)."""
    from zmq_rollout.broker.server import Broker
    from zmq_rollout.config import BrokerConfig

    folder = os.environ.get(CURVE_ENV)
    curve = {"curve_secret_key": f"{folder}/broker.key_secret", "allow_keys": f"{folder}/allowed"} if folder else {}
    options = {**curve, **broker_options()}
    b = Broker(BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", metrics_port=0, **options))
    signal.signal(signal.SIGTERM, lambda *_: b.stop())
    report.put(("ready", tag, (b.frontend_address, b.backend_address, b.metrics_port)))
    if profile_path is None:
        b.run()
        return
    import cProfile

    # CPU time of this thread, not wall time: on a shared machine, time spent descheduled
    # would otherwise be charged to whatever function was running.
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    try:
        b.run()
    finally:
        profiler.disable()
        profiler.dump_stats(profile_path)


def wire_fingerprint() -> dict[str, Any]:
    """The protocol as this interpreter's ``zmq_rollout`` speaks it: its signature (which
    carries the protocol version, ``ZR1``) and, per direction and command, the JSON schema of
    the body without docstrings; a body whose defaults JSON schema cannot hold (a ``msgspec.Raw``)
    by its ``msgspec.inspect`` type info instead. Self-contained: ``tree_broker`` runs its source too."""
    import msgspec.inspect

    from zmq_rollout import codec
    from zmq_rollout import protocol as p

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "description"}
        return [strip(v) for v in x] if isinstance(x, list) else x

    def plain(x: Any) -> Any:  # type info as JSON, the same in every process
        if isinstance(x, msgspec.Struct):
            return {"info": type(x).__name__, **{f: plain(getattr(x, f)) for f in x.__struct_fields__}}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if x is None or isinstance(x, (str, int, float)):
            return x
        if isinstance(x, msgspec.Raw):
            return bytes(x).hex()
        if isinstance(x, type) or callable(x):
            return f"{getattr(x, '__module__', '')}.{getattr(x, '__qualname__', type(x).__name__)}"
        return repr(x)

    def schema(body: Any) -> Any:
        try:
            return strip(msgspec.json.schema(body))
        except TypeError:
            return plain(msgspec.inspect.type_info(body))

    tables = {
        name: {cmd.hex(): None if body is None else schema(body) for cmd, body in table.items()}
        for name in ("FROM_CLIENT", "TO_CLIENT", "FROM_WORKER", "TO_WORKER")
        for table in (getattr(codec, name),)
    }
    return {"signature": p.SIGNATURE.decode(), "tables": tables}


def use_tree(tree: str) -> None:
    """Import ``zmq_rollout`` from the source tree ``tree`` (a checkout of this repository) in
    this fresh interpreter (``tree_command``: nothing of ``zmq_rollout`` is imported yet): an
    import hook maps ``zmq_rollout`` and its ``broker``/``workers`` packages to the tree's
    folders (the ``package-dir`` of its pyproject.toml) and refuses a ``zmq_rollout`` module
    the tree lacks, rather than fall through to the installed (editable) package; everything
    else (pyzmq, msgspec) comes from the venv. Also: ignore SIGINT (the parent owns Ctrl-C)
    and die with the parent."""
    import contextlib
    import ctypes
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import os
    import signal
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    try:
        import tomllib

        with open(os.path.join(tree, "pyproject.toml"), "rb") as f:
            package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    except ImportError:  # Python 3.10: the mapping every commit of this repository has had
        package_dir = {"zmq_rollout": "zmq_rollout", "zmq_rollout.broker": "broker", "zmq_rollout.workers": "workers"}
    roots = {name: os.path.join(tree, folder) for name, folder in package_dir.items()}

    class TreeFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name in roots:
                init = os.path.join(roots[name], "__init__.py")
                return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[roots[name]])
            if name.partition(".")[0] not in roots:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)  # path: the parent's, in the tree
            if spec is None:
                raise ModuleNotFoundError(f"no module named {name!r} in {tree}", name=name)
            return spec

    sys.meta_path.insert(0, TreeFinder())


def tree_files() -> list[str]:
    """The files of every ``zmq_rollout`` module imported in this interpreter."""
    import sys

    mine = [m for n, m in list(sys.modules.items()) if n.partition(".")[0] == "zmq_rollout"]
    return sorted({m.__file__ for m in mine if getattr(m, "__file__", None)})


def tree_broker(tree: str) -> None:
    """The broker of the source tree ``tree`` (``use_tree``), in a fresh interpreter. Prints
    one JSON line once it serves (addresses, ``wire_fingerprint()``, ``tree_files()``), then
    runs ``Broker(BrokerConfig(...)).run()`` as ``broker`` does, until SIGTERM."""
    import json
    import logging
    import signal

    use_tree(tree)
    logging.basicConfig(level=logging.WARNING, format="[broker %(process)d] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("zmq_rollout.broker.server").addFilter(  # the benchmark runs without keys, knowingly
        lambda record: not str(record.msg).startswith("no CurveZMQ keys")
    )

    from zmq_rollout.broker.server import Broker
    from zmq_rollout.config import BrokerConfig

    b = Broker(
        BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", metrics_port=0, **broker_options())
    )
    signal.signal(signal.SIGTERM, lambda *_: b.stop())
    wire = wire_fingerprint()
    ready = {"frontend": b.frontend_address, "backend": b.backend_address, "wire": wire, "files": tree_files()}
    ready["metrics"] = b.metrics_port
    print(json.dumps(ready), flush=True)
    b.run()


def tree_scheduler(tree: str, rounds: int, samples: int) -> None:
    """The per-job CPU cost of the scheduler of ``tree`` (``use_tree``) alone, in process, no
    sockets: one worker of 64 credits; per round one SUBMIT of 64 jobs decoded by the codec,
    ``submit`` (dispatch included) and the outbox taken, then their FINAL (one 4-token
    sample each, decoded as the broker decodes it) through ``worker_final``. Timed by this
    thread's CPU time (``time.thread_time``: time spent descheduled does not count), around
    the broker's part only (building the messages is not timed). Prints one JSON line: the
    best of ``samples`` samples of ``rounds`` rounds, in us per job, every sample, the files."""
    import gc
    import json
    import time

    use_tree(tree)
    from zmq_rollout import codec
    from zmq_rollout import protocol as p
    from zmq_rollout.broker.scheduler import Scheduler
    from zmq_rollout.config import BrokerConfig

    client, worker, batch = b"client", b"worker", 64
    s = Scheduler(BrokerConfig())
    s.worker_ready(worker, p.WorkerInfo("worker", "model", batch), 0.0)
    s.outbox.take()
    broker_view = getattr(codec, "BROKER_FROM_CLIENT", codec.FROM_CLIENT)  # JobRelay, where the tree has it
    from_client, from_worker = codec.Decoder(broker_view), codec.Decoder(codec.FROM_WORKER)
    sampling, sample = p.SamplingParams(max_tokens=16), p.Sample(0, [1, 2, 3, 4], [0.0] * 4, "length")
    ids, now, per_job = iter(range(1 << 62)), 0.0, []
    for _ in range(samples):
        gc.collect()
        spent = 0.0
        for _ in range(rounds):
            now += 0.001
            submit = codec.encode(p.SUBMIT, [p.JobSpec(f"j{next(ids):x}", sampling, "x" * 100) for _ in range(batch)])
            t0 = time.thread_time()
            s.submit(client, from_client.decode(submit).body, now)
            out = s.outbox.take()
            t1 = time.thread_time()
            tickets = [a.ticket for _, _, cmd, body in out if cmd == p.JOBS for a in body]
            assert len(tickets) == batch, len(tickets)
            final = codec.encode(p.FINAL, [p.Result(t, [1, 2, 3, 4], [sample], 0, "worker") for t in tickets])
            t2 = time.thread_time()
            s.worker_final(worker, from_worker.decode(final).body, now + 0.0005)
            s.outbox.take()
            spent += time.thread_time() - t2 + t1 - t0
        per_job.append(spent / (rounds * batch) * 1e6)
    assert s.stats.completed == samples * rounds * batch
    print(json.dumps({"us_per_job": min(per_job), "samples": per_job, "files": tree_files()}), flush=True)


def tree_command(tree: str, call: str) -> list[str]:
    """``python -c`` running ``call`` (``tree_broker(...)`` or ``tree_scheduler(...)``) for the
    tree ``tree``: the source of this module's tree functions, then the call. Isolated (``-I``:
    no PYTHON* variables, no script or working folder on ``sys.path``)."""
    import inspect
    import sys

    functions = (wire_fingerprint, use_tree, tree_files, broker_options, tree_broker, tree_scheduler)
    source = "\n\n".join(
        ["from __future__ import annotations", "from typing import Any", f"BROKER_CONFIG_ENV = {BROKER_CONFIG_ENV!r}"]
        + [inspect.getsource(fn) for fn in functions]
        + [call]
    )
    return [sys.executable, "-I", "-c", source]


@role
def proxy(report: Any, tag: str) -> None:
    """libzmq's own forwarding: ``zmq.proxy`` from a ROUTER (clients) to a DEALER (workers)."""
    front = _socket(zmq.ROUTER, "tcp://127.0.0.1:*", bind=True)
    back = _socket(zmq.DEALER, "tcp://127.0.0.1:*", bind=True)
    report.put(
        (
            "ready",
            tag,
            (front.getsockopt_string(zmq.LAST_ENDPOINT), back.getsockopt_string(zmq.LAST_ENDPOINT)),
        )
    )
    zmq.proxy(front, back)  # until SIGTERM ends the process


def _echo_loop(sock: zmq.Socket[Any]) -> None:
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


@role
def raw_echo_server(report: Any, tag: str) -> None:
    """A ROUTER that sends every message straight back: the floor of a direct round trip."""
    sock = _socket(zmq.ROUTER, "tcp://127.0.0.1:*", bind=True)
    report.put(("ready", tag, sock.getsockopt_string(zmq.LAST_ENDPOINT)))
    _echo_loop(sock)


@role
def direct_echo_server(report: Any, tag: str) -> None:
    """A ROUTER that answers SUBMIT the way the echo double answers JOBS (decode, build the
    fake result, encode FINAL), with no broker in between: the reference for latency."""
    from zmq_rollout.testing import echo_result

    sock = _socket(zmq.ROUTER, "tcp://127.0.0.1:*", bind=True)
    decoder = codec.Decoder(codec.FROM_CLIENT)
    report.put(("ready", tag, sock.getsockopt_string(zmq.LAST_ENDPOINT)))
    while True:
        frames = sock.recv_multipart()
        msg, packed = decoder.decode(frames[1:]), codec.is_packed(frames[1:])  # answered alike, as the broker does
        if msg.command == p.HEARTBEAT:
            sock.send_multipart([frames[0], *codec.encode(p.HEARTBEAT, p.Liveness(tag, packed=True), packed=packed)])
        if msg.command != p.SUBMIT:
            continue
        results = []
        for job in msg.body:
            result = echo_result(p.Assignment(0, job), "direct-echo", 0)
            result.key = job.job_id
            results.append(result)
        sock.send_multipart([frames[0], *codec.encode(p.FINAL, results, packed=packed)])


def broker_messages(metrics_port: int | None) -> float | None:
    """Messages the broker read and sent so far (``zmq_rollout_broker_messages_total``, from its
    ``/metrics``); None for a broker without the counter (an older commit's)."""
    from zmq_rollout.scrape import fetch_metrics

    if metrics_port is None:
        return None
    scrape = fetch_metrics(f"http://127.0.0.1:{metrics_port}/metrics", 5.0)
    if scrape.error:
        raise RuntimeError(f"cannot read the broker's metrics: {scrape.error}")
    return scrape.total("zmq_rollout_broker_messages_total")


# -- workers ---------------------------------------------------------------------------------
@role
def echo_doubles(report: Any, tag: str, address: str, num: int, credits: int) -> None:
    """``num`` EchoWorkerDouble threads (the test double: answers every job at once)."""
    from zmq_rollout.testing import EchoWorkerDouble

    stop = _stop_event()
    keys = curve_keys()
    workers = [
        EchoWorkerDouble(address, credits=credits, name=f"{tag}-{i}", curve=keys, answer=bench_result).start()
        for i in range(num)
    ]
    report.put(("ready", tag, None))
    while not stop.wait(0.25):
        for w in workers:
            w.received.clear()  # the double records every assignment; keep memory flat
    stoppers = [threading.Thread(target=w.stop) for w in workers]  # in parallel: each waits a poll
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join()


@role
def raw_echoes(report: Any, tag: str, address: str, num: int) -> None:
    """``num`` DEALER threads behind ``zmq.proxy`` that echo bytes: no per-job work at all.
    Ends by SIGTERM's default action (its threads block in ``recv`` forever)."""
    socks = [_socket(zmq.DEALER, address) for _ in range(num)]
    for sock in socks:
        threading.Thread(target=_echo_loop, args=(sock,), daemon=True).start()
    report.put(("ready", tag, None))
    threading.Event().wait()


# -- many peers per process (broker_scale.py) ------------------------------------------------
def _many_sockets(num: int) -> zmq.Context[Any]:
    """The process's context, allowed ``num`` sockets and more (libzmq's default is 1,023)."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    ctx.set(zmq.MAX_SOCKETS, max(ctx.get(zmq.MAX_SOCKETS), num + 64))
    return ctx


def _send_now(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
    with contextlib.suppress(zmq.Again):
        sock.send_multipart(frames, zmq.NOBLOCK)


FLEET_COUNTS = 4
"""Counters per thread of ``echo_double_fleet``: jobs answered, JOBS messages, purges, HEARTBEATs received."""


def _serve_doubles(
    socks: dict[zmq.Socket[Any], str], credits: int, heartbeat_s: float, stop: threading.Event, counts: Any, k: int
) -> None:
    """Thread ``k`` of ``echo_double_fleet``: serve its doubles' sockets; counts its jobs, JOBS
    messages, purges and the broker's HEARTBEATs in ``counts[FLEET_COUNTS * k:][:FLEET_COUNTS]``
    (shared with the parent, this thread's own slots).

    Woken by epoll on each socket's ``zmq.FD``, so a wake-up costs what is ready, not what is
    registered (``zmq.Poller`` walks every socket on every call: 128 sockets a thread made the
    doubles outspend the broker). libzmq's rule for that descriptor: after any operation on a
    socket, look at its ``EVENTS`` before waiting again; so a socket is read until ``EVENTS``
    shows nothing, and every socket is looked at again after the heartbeats went out."""
    import select

    epoll, by_fd = select.epoll(), {}
    for sock in socks:
        fd = int(sock.getsockopt(zmq.FD))
        by_fd[fd] = sock
        epoll.register(fd, select.EPOLLIN)
    decoder = codec.Decoder(codec.WORKER_FROM_BROKER)
    beats = {f: codec.encode(p.HEARTBEAT, packed=f) for f in (False, True)}
    packed = dict.fromkeys(socks, False)  # per double: the broker's answer to READY said it reads packed
    sealed = dict.fromkeys(socks, False)  # ... and SEALED_FINAL
    answers: dict[tuple[str, bool], lean.AnswerTemplate] = {}
    next_beat = time.monotonic() + heartbeat_s
    ready = list(socks)
    slot = FLEET_COUNTS * k
    while not stop.is_set():
        if not ready:
            timeout = max(0.001, min(0.25, next_beat - time.monotonic()))
            ready = [by_fd[fd] for fd, _ in epoll.poll(timeout)]
        for sock in ready:
            name = socks[sock]
            while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                msg = decoder.decode(sock.recv_multipart(zmq.NOBLOCK))
                if msg.command == p.JOBS:
                    if LEAN:
                        answer = answers.get((name, sealed[sock]))
                        if answer is None:  # the benchmark's jobs are all alike: the first one's answer is each one's
                            answer = answers[name, sealed[sock]] = _answer_template(msg.body[0], name, sealed[sock])
                        sock.send_multipart(answer.frames([a.ticket for a in msg.body], packed[sock]))
                    else:
                        segments: list[list[Any]] = []  # coalesced as the worker's (FINAL, SEALED_FINAL)
                        for a in map(p.unseal, msg.body):
                            append(segments, *p.final_item(bench_result(a, name), sealed[sock]))  # type: ignore[arg-type]
                        for command, items in segments:
                            sock.send_multipart(codec.encode(command, items, packed=packed[sock]))
                    counts[slot] += len(msg.body)
                    counts[slot + 1] += 1
                elif msg.command == p.HEARTBEAT:
                    counts[slot + 3] += 1
                    if msg.body is not None:
                        packed[sock], sealed[sock] = msg.body.packed, msg.body.sealed
                elif msg.command == p.DISCONNECT:  # the broker purged this double: taken for dead
                    counts[slot + 2] += 1
                    packed[sock] = sealed[sock] = False
                    _send_now(sock, _ready(name, credits))
        ready = []
        if time.monotonic() >= next_beat:
            for sock in socks:
                _send_now(sock, beats[packed[sock]])
            next_beat = time.monotonic() + heartbeat_s
            ready = list(socks)
    epoll.close()


def _ready(name: str, credits: int) -> list[bytes]:
    """A fleet double's READY: it reads token bins (``p.unseal`` opens them) and says it checks each
    job's cost (``p.SEALED_JOBS``), as the worker does, so that the broker forwards it sealed jobs
    as they came. A test double's shortcut: the lean one opens only its first job (its answer
    template), the others not at all."""
    return codec.encode(p.READY, p.WorkerInfo(name, "echo-double", credits, 0, ["echo", p.TOKEN_BINS, p.SEALED_JOBS]))


def _answer_template(sealed_job: p.SealedAssignment, name: str, sealed: bool) -> lean.AnswerTemplate:
    """What double ``name`` answers to every job like ``sealed_job`` (``bench_result``)."""
    job = p.unseal(sealed_job)
    if not isinstance(job, p.Assignment):
        raise RuntimeError(f"a benchmark job the double cannot open: {job}")
    return lean.AnswerTemplate(bench_result(job, name), sealed)


@role
def echo_double_fleet(
    report: Any, tag: str, address: str, num: int, credits: int, threads: int, heartbeat_s: float, counts: Any
) -> None:
    """``num`` echo worker doubles (TEST DOUBLES: every job answered at once with
    ``bench_result``, from byte templates: ``lean_doubles.AnswerTemplate``), each its own
    DEALER with its own identity, served by ``threads`` threads of this process, each polling
    its share of the sockets: 1,024 doubles fit a few processes of a small machine (a thread
    per double would spend the cores on thread switches). Each announces ``credits`` in READY
    and heartbeats every ``heartbeat_s`` (the real worker's ``WorkerConfig.heartbeat_interval_s``).
    A DISCONNECT from the broker (it purged the double, taken for dead) is counted and answered
    with a fresh READY. ``counts``: a shared array of ``FLEET_COUNTS`` x ``threads`` integers, per thread the
    jobs answered, the JOBS messages they came in, the purges and the broker's HEARTBEATs, for the parent to read at any
    time (``FLEET_COUNTS`` per thread). On SIGTERM: DISCONNECT from each, then ``done``: {"jobs", "purged"}."""
    ctx = _many_sockets(num)
    stop = _stop_event()
    keys = curve_keys()
    socks: list[dict[zmq.Socket[Any], str]] = [{} for _ in range(max(1, min(threads, num)))]
    for i in range(num):
        name = f"{tag}-{i}"
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, name.encode())
        if keys is not None:
            keys.apply(sock)
        sock.connect(address)
        sock.send_multipart(_ready(name, credits))
        socks[i % len(socks)][sock] = name
    pool = [
        threading.Thread(target=_serve_doubles, args=(share, credits, heartbeat_s, stop, counts, k), daemon=True)
        for k, share in enumerate(socks)
    ]
    for t in pool:
        t.start()
    report.put(("ready", tag, None))
    stop.wait()
    for t in pool:
        t.join()
    for share in socks:
        for sock in share:
            _send_now(sock, codec.encode(p.DISCONNECT))
            sock.close(linger=100)
    n = FLEET_COUNTS
    report.put(("done", tag, {"jobs": sum(counts[0::n]), "purged": sum(counts[2::n])}))


@role
def client_fleet(report: Any, tag: str, address: str, num: int, batch: int, window: int, go: Any, clock: Any) -> None:
    """``num`` clients as ``submit_client`` runs one (a raw DEALER speaking the protocol
    through the codec, its own identity, ``window`` SUBMITs of ``batch`` jobs in flight), all
    served by one thread polling their sockets. Each first sends a HEARTBEAT and waits for
    the broker's answer: at ``ready`` the broker has registered every one of them. With CurveZMQ
    (a ``curve`` case), each uses the case's peer keys."""
    ctx = _many_sockets(num)
    decoder = codec.Decoder(codec.TO_CLIENT)
    keys = curve_keys()
    socks = []
    for i in range(num):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"{tag}-{i}".encode())
        if keys is not None:
            keys.apply(sock)
        sock.connect(address)
        sock.send_multipart(codec.encode(p.HEARTBEAT))
        socks.append(sock)
    packed, every = {}, Reads(True, True, True)
    for sock in socks:
        if not sock.poll(30_000):
            raise RuntimeError(f"{tag}: the broker did not answer a client's HEARTBEAT within 30 s")
        reads = _reads(decoder, sock.recv_multipart())
        packed[sock] = reads.packed
        every = Reads(*map(operator.and_, every, reads))  # what each client's answer said
    report.put(("ready", tag, None))
    go.wait()
    wins = {sock: _Window(clock) for sock in socks}
    submit, count = _submissions(tag, batch, decoder, every)
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    t_end = clock[1]
    while True:
        now = time.monotonic()
        if now >= t_end + DRAIN_SECONDS or (now >= t_end and all(w.inflight <= 0 for w in wins.values())):
            break
        if now < t_end:
            for sock, win in wins.items():
                while win.inflight + batch <= batch * window:
                    sock.send_multipart(submit(packed[sock]))
                    win.inflight += batch
        ready = poller.poll(50)
        now = time.monotonic()
        for sock, _ in ready:
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                wins[sock].complete(*count(frames), now)
    for sock in socks:
        sock.send_multipart(codec.encode(p.DISCONNECT, packed=packed[sock]))
        sock.close(linger=100)
    done = {
        "jobs": sum(w.done for w in wins.values()),
        "errors": sum(w.errors for w in wins.values()),
        "messages": sum(w.messages for w in wins.values()),
    }
    report.put(("done", tag, done))


# -- clients ---------------------------------------------------------------------------------
class _Window:
    """Jobs in flight and jobs completed inside the measurement window."""

    def __init__(self, clock: Any) -> None:
        self.t_begin, self.t_end = clock[0], clock[1]
        self.inflight = self.done = self.errors = 0
        self.messages = 0
        """Answers (FINAL, ERROR, BUSY) received inside the window: the broker's batching toward clients."""

    def complete(self, jobs: int, errors: int, now: float) -> None:
        self.inflight -= jobs + errors
        if self.t_begin <= now < self.t_end:
            self.done += jobs
            self.errors += errors
            self.messages += jobs + errors > 0


def _submissions(
    tag: str, batch: int, decoder: codec.Decoder, reads: Reads
) -> tuple[Callable[[bool], list[bytes]], Callable[[list[bytes]], tuple[int, int]]]:
    """A client's (SUBMIT of ``batch`` new jobs, in the form asked; what an answer finishes and
    fails): from byte templates, answers counted from their array headers (``LEAN``), or jobs
    built and answers decoded through the codec. Token ids go as token bins, and jobs sealed
    (SEALED_SUBMIT), where the broker said it reads them (``reads``), as the reference client
    sends them."""
    ids = iter(range(1 << 62))
    token_bins, sealed = reads.token_bins, reads.sealed_jobs
    if LEAN:
        template = lean.SubmitTemplate(bench_job("template"), token_bins, sealed)
        return (lambda packed: template.frames([f"{tag}-{next(ids):x}" for _ in range(batch)], packed)), (
            lean.count_answer
        )

    def submit(packed: bool) -> list[bytes]:
        jobs = [bench_job(f"{tag}-{next(ids):x}") for _ in range(batch)]
        ((_, encoded),) = pack_submits(jobs, batch, 1 << 30, token_bins=token_bins, sealed=sealed)
        return codec.encode(submit_command(sealed), encoded, packed=packed)

    return submit, functools.partial(_count_answer, decoder)


def _count_answer(decoder: codec.Decoder, frames: list[bytes]) -> tuple[int, int]:
    """(jobs finished, jobs failed) in one broker message; ACCEPTED is skipped undecoded."""
    command = _command(frames)
    if command == p.FINAL:
        return len(decoder.decode(frames).body), 0
    if command in (p.ERROR, p.BUSY):
        return 0, len(decoder.decode(frames).body)
    return 0, 0


def _command(frames: list[bytes]) -> bytes:
    """A message's command, of either form, unchecked (the broker's own messages)."""
    first = frames[0]
    return first[3:4] if len(first) > 3 else frames[1]


class Reads(NamedTuple):
    """What a broker's answer to a HEARTBEAT says it reads (``p.Liveness``)."""

    packed: bool = False
    token_bins: bool = False
    sealed_jobs: bool = False


def _reads(decoder: codec.Decoder, frames: list[bytes]) -> Reads:
    """What the broker's answer to a HEARTBEAT says it reads."""
    msg = decoder.decode(frames)
    if msg.command != p.HEARTBEAT or msg.body is None:
        return Reads()
    return Reads(msg.body.packed, msg.body.token_bins, msg.body.sealed_jobs)


def _hello(sock: zmq.Socket[Any], decoder: codec.Decoder, tag: str) -> Reads:
    """HEARTBEAT, as the reference client opens: what the broker reads."""
    sock.send_multipart(codec.encode(p.HEARTBEAT))
    while sock.poll(30_000):
        frames = sock.recv_multipart()
        if _command(frames) == p.HEARTBEAT:
            return _reads(decoder, frames)
    raise RuntimeError(f"{tag}: no answer to HEARTBEAT within 30 s")


def _pump(
    sock: zmq.Socket[Any],
    win: _Window,
    until: float,
    fill: Callable[[], None],
    answer: Callable[[list[bytes]], tuple[int, int]],
) -> None:
    """Keep the window full (``fill``) and count answers until ``until`` or nothing is left."""
    while True:
        now = time.monotonic()
        if now >= until or (now >= win.t_end and win.inflight <= 0):
            return
        if now < win.t_end:
            fill()
        if not sock.poll(50):
            continue
        now = time.monotonic()
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            win.complete(*answer(frames), now)


@role
def submit_client(report: Any, tag: str, address: str, batch: int, window: int, go: Any, clock: Any) -> None:
    """A raw DEALER speaking the protocol: ``window`` SUBMIT messages of ``batch`` jobs each in
    flight (``_submissions``)."""
    sock = _socket(zmq.DEALER, address, identity=tag)
    decoder = codec.Decoder(codec.TO_CLIENT)
    limit = batch * window
    reads = _hello(sock, decoder, tag)
    packed = reads.packed
    report.put(("ready", tag, None))
    go.wait()
    win = _Window(clock)

    submit, count = _submissions(tag, batch, decoder, reads)

    def fill() -> None:
        while win.inflight + batch <= limit:
            sock.send_multipart(submit(packed))
            win.inflight += batch

    _pump(sock, win, win.t_end + DRAIN_SECONDS, fill, count)
    sock.send_multipart(codec.encode(p.DISCONNECT, packed=packed))
    sock.close(linger=100)
    report.put(("done", tag, {"jobs": win.done, "errors": win.errors}))


@role
def raw_client(report: Any, tag: str, address: str, batch: int, window: int, go: Any, clock: Any) -> None:
    """The zmq.proxy baseline's client: ``window`` messages of ``batch`` x 100 bytes in flight."""
    sock = _socket(zmq.DEALER, address, identity=tag)
    payload = RAW_JOB * batch
    report.put(("ready", tag, None))
    go.wait()
    win = _Window(clock)

    def fill() -> None:
        while win.inflight + batch <= batch * window:
            sock.send(payload)
            win.inflight += batch

    _pump(
        sock,
        win,
        win.t_end + DRAIN_SECONDS,
        fill,
        lambda frames: (len(frames[-1]) // len(RAW_JOB), 0),
    )
    sock.close()
    report.put(("done", tag, {"jobs": win.done, "errors": 0}))


@role
def library_client(report: Any, tag: str, address: str, batch: int, window: int, go: Any, clock: Any) -> None:
    """The real ``RolloutClient``: ``window`` threads, each calling ``generate`` on ``batch`` prompts."""
    from zmq_rollout import RolloutClient

    client = RolloutClient(address, name=tag)
    report.put(("ready", tag, None))
    go.wait()
    win = _Window(clock)
    lock = threading.Lock()

    def caller() -> None:
        while time.monotonic() < win.t_end:
            rollouts = client.generate([PROMPT] * batch, SAMPLING)
            with lock:
                win.complete(len(rollouts), 0, time.monotonic())

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(window)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    report.put(("done", tag, {"jobs": win.done, "errors": 0}))


@role
def latency_client(report: Any, tag: str, address: str, kind: str, count: int, warmup: int, go: Any) -> None:
    """One job in flight at a time; reports every round trip in ns. ``kind``: ``submit``
    (a one-job SUBMIT, waits for its FINAL) or ``raw`` (100 bytes, waits for the echo)."""
    sock = _socket(zmq.DEALER, address, identity=tag)
    packed = kind != "raw" and _hello(sock, codec.Decoder(codec.TO_CLIENT), tag)[0]
    report.put(("ready", tag, None))
    go.wait()
    samples = []
    for i in range(warmup + count):
        if kind == "raw":
            start = time.perf_counter_ns()
            sock.send(RAW_JOB)
            sock.recv()
        else:
            frames = codec.encode(p.SUBMIT, [bench_job(f"{tag}-{i:x}")], packed=packed)
            start = time.perf_counter_ns()
            sock.send_multipart(frames)
            while _command(sock.recv_multipart()) != p.FINAL:
                pass  # ACCEPTED (when asked for) and heartbeat replies come first
        if i >= warmup:
            samples.append(time.perf_counter_ns() - start)
    if kind != "raw":
        sock.send_multipart(codec.encode(p.DISCONNECT, packed=packed))
    sock.close(linger=100)
    report.put(("done", tag, samples))
