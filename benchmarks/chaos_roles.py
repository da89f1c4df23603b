"""The processes of ``chaos.py`` that it forks: an echo worker double, a submitting client.

Each runs in its own process (forked from a multiprocessing fork server, so that a thousand
restarts cost milliseconds each, not a Python start-up each), dies with its parent
(``PR_SET_PDEATHSIG``) and ignores SIGINT (the parent owns Ctrl-C).

A client keeps ``window`` jobs in flight until the parent says stop, then waits for every
job it has submitted and sends back its ``Ledger`` summary. The ledger counts every FINAL
and ERROR as it comes off the wire, before the client's own bookkeeping: a job answered
twice (which the client would drop silently) is seen.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import logging
import math
import signal
import threading
import time
from collections import Counter
from typing import Any

from zmq_rollout import protocol as p
from zmq_rollout.client import AsyncRolloutClient
from zmq_rollout.errors import RolloutError
from zmq_rollout.rollouts import make_job


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux); SIGINT is the parent's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def prompt_for(client: int, seq: int) -> list[int]:
    """Token ids that name the job (ids 3..252: valid for the tiny model's vocabulary too)."""
    return [3 + seq % 250, 3 + seq // 250 % 250, 3 + seq // 62_500 % 250, 3 + client % 250]


# -- an echo worker --------------------------------------------------------------------------
def echo_worker(address: str, name: str, credits: int, heartbeat: float) -> None:
    """One ``EchoWorkerDouble`` (the test double), until SIGTERM or SIGKILL."""
    from zmq_rollout.testing import EchoWorkerDouble

    die_with_parent()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    double = EchoWorkerDouble(address, credits=credits, name=name, heartbeat=heartbeat).start()
    while not stop.wait(1.0):
        double.received.clear()  # the double records every assignment; keep memory flat
    double.stop()


# -- a client --------------------------------------------------------------------------------
class Ledger:
    """Every job one client process submitted: when, when and how it was answered, and how
    many answers came for it on the wire."""

    def __init__(self, client: int, tag: str) -> None:
        self.client, self.tag = client, tag
        self.submitted = array.array("d")
        self.done = array.array("d")  # nan until answered
        self.ok = bytearray()
        self.first_at = array.array("d")  # when the first answer came
        self.answers = bytearray()  # FINAL + ERROR messages about the job, as they came
        self.codes: Counter[str] = Counter()  # ERROR codes, and exception types of failed calls
        self.doubles: list[tuple[int, float, float, float]] = []  # (seq, submitted, 1st and 2nd answer)
        self.wrong = 0  # a FINAL whose prompt is not the job's: someone else's result
        self.foreign = 0  # an answer about a job id this client never used

    def job_id(self, seq: int) -> str:
        return f"{self.tag}-{seq:x}"

    def new(self, now: float) -> int:
        self.submitted.append(now)
        self.done.append(math.nan)
        self.ok.append(0)
        self.answers.append(0)
        self.first_at.append(math.nan)
        return len(self.submitted) - 1

    def _seq(self, key: Any) -> int | None:
        tag, _, seq = str(key).rpartition("-")
        if tag != self.tag:
            return None
        number = int(seq, 16)
        return number if number < len(self.submitted) else None

    def on_wire(self, command: bytes, body: Any) -> None:
        """A message from the broker, before the client handles it."""
        if command == p.FINAL:
            for result in body:
                seq = self._seq(result.key)
                if seq is None:
                    self.foreign += 1
                    continue
                self._answer(seq)
                if list(result.prompt_token_ids) != prompt_for(self.client, seq):
                    self.wrong += 1
        elif command in (p.ERROR, p.BUSY):
            for item in body:
                seq = self._seq(item.key) if item.key is not None else None
                if seq is None:
                    self.foreign += 1
                    continue
                self._answer(seq)
                self.codes[item.code] += 1

    def _answer(self, seq: int) -> None:
        self.answers[seq] = min(255, self.answers[seq] + 1)
        if self.answers[seq] == 1:
            self.first_at[seq] = time.monotonic()
        elif self.answers[seq] == 2 and len(self.doubles) < 20:
            self.doubles.append((seq, self.submitted[seq], self.first_at[seq], time.monotonic()))

    def settle(self, seq: int, future: asyncio.Future[Any]) -> None:
        """The client's call for job ``seq`` ended."""
        self.done[seq] = time.monotonic()
        error = asyncio.CancelledError() if future.cancelled() else future.exception()
        if error is None:
            self.ok[seq] = 1
        else:
            self.codes[type(error).__name__] += 1

    def summary(self, restarts: list[float], warmup: tuple[float, float]) -> dict[str, Any]:
        """Counts, latencies, and per broker restart (its time) how long the jobs then in
        flight took to finish (inf: one never did; None: none was in flight)."""
        import numpy as np

        sub = np.frombuffer(self.submitted, dtype=np.float64)
        done = np.frombuffer(self.done, dtype=np.float64)
        ok = np.frombuffer(bytes(self.ok), dtype=np.uint8).astype(bool)
        answers = np.frombuffer(bytes(self.answers), dtype=np.uint8)
        finished = np.where(np.isnan(done), np.inf, done)
        recovery: list[float | None] = []
        for t in restarts:
            caught = (sub < t) & (finished > t)
            recovery.append(float(finished[caught].max() - t) if caught.any() else None)
        latency = (done - sub)[ok]
        w0, w1 = warmup
        calm = ok & (sub >= w0) & (done < w1)  # submitted and answered in the warm-up
        return {
            "tag": self.tag,
            "jobs": len(sub),
            "ok": int(ok.sum()),
            "lost": int((~ok).sum()),
            "duplicated": int((answers > 1).sum()),
            "doubles": self.doubles,
            "wrong": self.wrong,
            "foreign": self.foreign,
            "codes": dict(self.codes),
            "recovery": recovery,
            "in_flight_at_restart": [int(((sub < t) & (finished > t)).sum()) for t in restarts],
            "latency_p50": float(np.percentile(latency, 50)) if latency.size else None,
            "latency_max": float(latency.max()) if latency.size else None,
            "calm_latency_max": float((done - sub)[calm].max()) if calm.any() else None,
        }


class TappedClient(AsyncRolloutClient):
    """The product's client, with every incoming FINAL and ERROR shown to a ``Ledger`` first."""

    ledger: Ledger

    def _dispatch(self, command: bytes, body: Any) -> None:
        self.ledger.on_wire(command, body)
        super()._dispatch(command, body)


async def _drive(conn: Any, ledger: Ledger, address: str, window: int, sampling: Any, config: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    order: dict[str, Any] = {}

    def on_order() -> None:
        order.update(conn.recv())
        stop.set()

    loop.add_reader(conn.fileno(), on_order)
    async with TappedClient(address, name=ledger.tag, **config) as client:
        client.ledger = ledger
        conn.send({"ready": True})
        inflight: set[asyncio.Future[Any]] = set()
        while not stop.is_set():
            room = window - len(inflight)
            if room > 0:
                now = time.monotonic()
                seqs = [ledger.new(now) for _ in range(room)]
                jobs = [make_job(ledger.job_id(s), prompt_for(ledger.client, s), sampling) for s in seqs]
                try:
                    handles = await client.submit_jobs(jobs)
                except RolloutError as exc:  # refused before sending (the broker gone for long)
                    for s in seqs:
                        ledger.done[s] = now
                    ledger.codes[f"refused:{type(exc).__name__}"] += len(seqs)
                    await asyncio.sleep(0.1)
                    continue
                for s, handle in zip(seqs, handles, strict=True):
                    handle.future.add_done_callback(lambda f, s=s: ledger.settle(s, f))
                    inflight.add(handle.future)
            if inflight:
                done, _ = await asyncio.wait(inflight, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
                inflight -= done
        loop.remove_reader(conn.fileno())
        if inflight:  # the parent stopped the chaos: every job must now finish
            await asyncio.wait(inflight, timeout=order["drain_s"])
        conn.send(ledger.summary(order["restarts"], tuple(order["warmup"])))


def client(conn: Any, index: int, tag: str, address: str, window: int, sampling: Any, config: dict[str, Any]) -> None:
    """Submit jobs, ``window`` in flight, until the parent sends ``{"restarts", "warmup",
    "drain_s"}``; then wait (at most ``drain_s``) for every job and send the summary."""
    die_with_parent()
    logging.basicConfig(level=logging.ERROR, format=f"[{tag}] %(levelname)s %(name)s: %(message)s")
    asyncio.run(_drive(conn, Ledger(index, tag), address, window, sampling, config))
