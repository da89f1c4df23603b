"""The parties of ``chaos.py`` as the script holds them: the broker process (started again
on its ports after each kill), the worker processes (one per slot, started again whenever one
ends), the client processes, and the trainer (a ``RolloutClient`` in the script itself that
runs ``update_weights``).

Every process started here dies with the script (``PR_SET_PDEATHSIG``) and is stopped by the
``close`` of the object that started it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import chaos_roles
import zmq
from ports import free_port

from zmq_rollout import codec
from zmq_rollout import protocol as p

log = logging.getLogger("chaos")


def status(frontend: str, timeout_s: float) -> p.StatusReply | None:
    """STATUS over a fresh DEALER, as any client asks (None: no answer within ``timeout_s``)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"chaos-probe-{uuid.uuid4().hex[:8]}".encode())
    decoder = codec.Decoder(codec.TO_CLIENT)
    deadline = time.monotonic() + timeout_s
    try:
        sock.connect(frontend)
        sock.send_multipart(codec.encode(p.STATUS))
        while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            msg = decoder.decode(sock.recv_multipart())
            if msg.command == p.STATUS_REPLY:
                sock.send_multipart(codec.encode(p.DISCONNECT))
                return msg.body  # type: ignore[no-any-return]
            if time.monotonic() > deadline:
                break
        return None
    finally:
        sock.close(linger=200)


_DIE_WITH_PARENT = "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9); os.execv(sys.argv[1], sys.argv[1:])"


def dies_with_us(command: list[str]) -> list[str]:
    """``command``, run so that the kernel SIGKILLs it if this script dies (PR_SET_PDEATHSIG,
    set before exec: no ``preexec_fn``, which is unsafe with threads)."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, *command]


# -- the broker ------------------------------------------------------------------------------
class BrokerProcess:
    """``zmq-rollout broker`` on fixed ports, started again on the same ports after a kill."""

    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.frontend = f"tcp://127.0.0.1:{free_port()}"
        self.backend = f"tcp://127.0.0.1:{free_port()}"
        self.argv = [
            sys.executable, "-m", "zmq_rollout.cli", "broker", "--frontend", self.frontend, "--backend",
            self.backend, "--heartbeat-interval-s", str(args.broker_heartbeat_s), "--worker-liveness",
            str(args.liveness), "--client-expiry-s", str(args.client_expiry_s), "--max-attempts",
            str(args.max_attempts),
        ]  # fmt: skip
        self.log = (log_dir / "broker.log").open("ab")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> float:
        """Start it; seconds until it answers STATUS."""
        started = time.monotonic()
        self.proc = subprocess.Popen(
            dies_with_us(self.argv), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        if status(self.frontend, timeout_s) is None:
            raise RuntimeError(f"the broker did not answer within {timeout_s} s (log: {self.log.name})")
        return time.monotonic() - started

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# -- workers ---------------------------------------------------------------------------------
@dataclass
class Slot:
    index: int
    incarnation: int = 0
    proc: Any = None  # mp.Process (echo) or subprocess.Popen (vllm)
    stopped_until: float | None = None

    @property
    def name(self) -> str:
        return f"w{self.index}.{self.incarnation}"


class Fleet:
    """The worker processes, one per slot; each slot always has one running (or starting)."""

    def __init__(self, args: argparse.Namespace, ctx: Any, backend: str, log_dir: Path) -> None:
        self.args, self.ctx, self.backend, self.log_dir = args, ctx, backend, log_dir
        self.slots = [Slot(i) for i in range(args.num_workers)]
        self.exits: dict[str, int] = {}  # exit codes of workers that ended by themselves
        self.serving_since: dict[str, float] = {}  # worker name -> when first seen registered
        self._logs: list[Any] = []

    def start(self, slot: Slot) -> None:
        slot.incarnation += 1
        slot.stopped_until = None
        if self.args.workers == "echo":
            slot.proc = self.ctx.Process(
                target=chaos_roles.echo_worker,
                args=(self.backend, slot.name, self.args.credits, self.args.broker_heartbeat_s / 2),
                daemon=True,
            )
            slot.proc.start()
            return
        from zmq_rollout.config import WorkerConfig
        from zmq_rollout.local import LOCAL_WORKER_DEFAULTS
        from zmq_rollout.workers.main import worker_command

        config = WorkerConfig(broker=self.backend, model=self.args.model, name=slot.name, **LOCAL_WORKER_DEFAULTS)
        out = (self.log_dir / f"worker-{slot.index}.log").open("ab")
        self._logs.append(out)
        slot.proc = subprocess.Popen(
            dies_with_us(worker_command(config)), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _signal(self, slot: Slot, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.args.workers == "echo":
                os.kill(slot.proc.pid, sig)
            else:
                os.killpg(slot.proc.pid, sig)  # the worker and its engine core

    def exit_code(self, slot: Slot) -> int | None:
        return slot.proc.exitcode if self.args.workers == "echo" else slot.proc.poll()

    def _reap(self, slot: Slot) -> None:
        if self.args.workers == "echo":
            slot.proc.join(30)
        else:
            slot.proc.wait(60)
            self._signal(slot, signal.SIGKILL)  # leftovers of its group

    def kill(self, slot: Slot) -> None:
        self._signal(slot, signal.SIGKILL)
        self._reap(slot)
        self.start(slot)

    def stop(self, slot: Slot, until: float) -> None:
        self._signal(slot, signal.SIGSTOP)
        slot.stopped_until = until

    def cont(self, slot: Slot) -> None:
        self._signal(slot, signal.SIGCONT)
        slot.stopped_until = None

    def supervise(self, now: float) -> None:
        """Continue stopped workers whose time is up; start again any that exited."""
        for slot in self.slots:
            if slot.stopped_until is not None and now >= slot.stopped_until:
                self.cont(slot)
            code = self.exit_code(slot)
            if code is not None:
                key = str(code)
                self.exits[key] = self.exits.get(key, 0) + 1
                log.warning("worker %s exited with %s; starting it again", slot.name, code)
                self._reap(slot)
                self.start(slot)

    def running(self) -> list[Slot]:
        return [s for s in self.slots if s.stopped_until is None]

    def close(self) -> None:
        for slot in self.slots:
            if slot.proc is None:
                continue
            self._signal(slot, signal.SIGCONT)
            self._signal(slot, signal.SIGTERM)
        for slot in self.slots:
            if slot.proc is None:
                continue
            try:
                if self.args.workers == "echo":
                    slot.proc.join(5)
                    if slot.proc.exitcode is None:
                        slot.proc.kill()
                        slot.proc.join()
                else:
                    slot.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            self._signal(slot, signal.SIGKILL)
        for out in self._logs:
            out.close()


# -- clients ---------------------------------------------------------------------------------
@dataclass
class ClientProc:
    index: int
    tag: str
    proc: Any
    conn: Any


class Clients:
    def __init__(self, args: argparse.Namespace, ctx: Any, frontend: str) -> None:
        self.args, self.ctx, self.frontend = args, ctx, frontend
        self.live: dict[int, ClientProc] = {}
        self._incarnations: dict[int, int] = {}
        beat = args.client_heartbeat_s
        self.config = {"heartbeat_interval_s": beat, "broker_liveness": args.liveness, "timeout_s": math.inf}
        self.sampling = p.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)

    def start(self, index: int) -> None:
        n = self._incarnations[index] = self._incarnations.get(index, -1) + 1
        tag = f"c{index}.{n}"
        mine, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=chaos_roles.client,
            args=(theirs, index, tag, self.frontend, self.args.window, self.sampling, self.config),
            daemon=True,
        )
        proc.start()
        theirs.close()
        if not mine.poll(60) or not mine.recv().get("ready"):
            raise RuntimeError(f"client {tag} did not start")
        self.live[index] = ClientProc(index, tag, proc, mine)

    def kill(self, index: int) -> None:
        c = self.live.pop(index)
        c.proc.kill()
        c.proc.join(10)
        c.conn.close()
        self.start(index)

    def finish(self, order: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        for c in self.live.values():
            c.conn.send(order)
        summaries = []
        deadline = time.monotonic() + timeout_s
        for c in self.live.values():
            if c.conn.poll(max(0.0, deadline - time.monotonic())):
                summaries.append(c.conn.recv())
            else:
                summaries.append({"tag": c.tag, "no_summary": True})
        return summaries

    def close(self) -> None:
        for c in self.live.values():
            c.proc.kill()
            c.proc.join(10)
            c.conn.close()


# -- the trainer -----------------------------------------------------------------------------
@dataclass
class SyncLog:
    ok: int = 0
    failed: int = 0
    evicted: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)  # (when, seconds, error)
    seconds: list[float] = field(default_factory=list)


class Trainer:
    """``update_weights`` (shm) from one trainer client, every ``sync_every_s`` (jittered),
    on its own thread, outside the quiet windows after broker restarts."""

    def __init__(self, args: argparse.Namespace, frontend: str, rng: random.Random) -> None:
        from zmq_rollout import RolloutClient

        self.args, self.rng = args, rng
        self.source = self._source()  # first: importing torch holds the GIL for seconds
        self.client = RolloutClient(
            frontend, name="trainer", heartbeat_interval_s=args.client_heartbeat_s, broker_liveness=args.liveness
        )
        self.log = SyncLog()
        self.quiet_until = 0.0
        self.syncing = threading.Event()
        """Set while ``update_weights`` runs: every other broker restart waits for it."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainer", daemon=True)

    def _source(self) -> Any:
        import torch

        if self.args.workers == "echo":
            return [("w", torch.zeros(1024))]
        from transformers import AutoModelForCausalLM

        # The checkpoint's own weights: each sync is a new version of the same model.
        return AutoModelForCausalLM.from_pretrained(self.args.model, dtype=torch.bfloat16)

    def sync(self) -> bool:
        pause = self.rng.choice(["abort", "wait", "keep"])
        started = time.monotonic()
        self.syncing.set()
        try:
            report = self.client.update_weights(
                self.source, transport="shm", pause=pause, timeout_s=self.args.sync_timeout_s
            )
        except Exception as exc:
            seconds = time.monotonic() - started
            self.log.failed += 1
            self.log.failures.append(
                {"at": started, "seconds": round(seconds, 3), "pause": pause, "error": f"{type(exc).__name__}: {exc}"}
            )
            log.warning("sync failed after %.2f s: %s: %s", seconds, type(exc).__name__, exc)
            return False
        finally:
            self.syncing.clear()
        self.log.ok += 1
        self.log.evicted += len(report.workers_evicted)
        self.log.seconds.append(time.monotonic() - started)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.args.sync_every_s * self.rng.uniform(0.5, 1.5)):
            if time.monotonic() >= self.quiet_until:
                self.sync()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def close(self) -> None:
        self.client.close()


def wait_for_fleet(broker: BrokerProcess, fleet: Fleet, timeout_s: float, at_least: int = 0) -> p.StatusReply:
    """Until every slot's current worker is registered, or ``at_least`` of them (slots that
    exit are started again meanwhile)."""
    deadline = time.monotonic() + timeout_s
    want = at_least or len(fleet.slots)
    while True:
        fleet.supervise(time.monotonic())
        st = status(broker.frontend, 5.0)
        names = {w.name for w in st.workers} if st is not None else set()
        if st is not None and sum(s.name in names for s in fleet.slots) >= want:
            return st
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not registered after {timeout_s} s: {sorted(names)}")
        time.sleep(0.2)
