"""Where environments run: in the client's event loop, or in a pool of processes.

``LocalEnvs`` keeps every episode's environment in this process and awaits its ``reset`` and
``step`` under a timeout: right for environments that wait (HTTP sandboxes, async tools).
``ProcessEnvs`` spreads the environments over ``K`` spawned processes, for environments that
compute (code execution) or block: a step that computes or blocks past its timeout cannot be
interrupted in the event loop, but a process can be killed.

Both raise ``EnvironmentFailedError`` naming the step and the reason when an environment raises
or hangs, and ``EnvironmentLost`` for the episodes that lost their environment with a process
that died, when that is not known to be their fault (the runner starts those over).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing as mp
import threading
import traceback
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from zmq_rollout.environments import Action, Environment, Observation, StepResult
from zmq_rollout.environments.registry import Factory, build
from zmq_rollout.errors import EnvironmentFailedError

EnvSpec = tuple["str | Factory", dict[str, Any]]
"""An environment's factory (a registered name, or a picklable callable) and its kwargs."""

KILL_GRACE_S = 5.0
"""How long past a step's timeout a process may stay silent before it is killed: a step that
hangs in ``await`` is cancelled inside the process at the timeout; only one that blocks the
process's event loop needs the kill."""

CLOSE_TIMEOUT_S = 10.0


class EnvironmentLost(Exception):
    """This episode's environment was in a process that died (not known to be its fault)."""


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _check_step(result: Any) -> StepResult:
    if not isinstance(result, StepResult):
        raise EnvironmentFailedError(f"the environment's step returned {type(result).__name__}, not a StepResult")
    return result


class LocalEnvs:
    """Environments in this event loop."""

    def __init__(self, spec: EnvSpec) -> None:
        self.spec = spec
        self._envs: dict[str, Environment] = {}

    async def reset(self, key: str, sample: Any, timeout_s: float) -> Observation:
        try:
            env = build(*self.spec)
        except Exception as exc:
            raise EnvironmentFailedError(f"the environment could not be built: {_describe(exc)}") from exc
        self._envs[key] = env
        return Observation.of(await self._call("reset", env.reset(sample), timeout_s))

    async def step(self, key: str, action: Action, timeout_s: float) -> StepResult:
        return _check_step(await self._call("step", self._envs[key].step(action), timeout_s))

    async def close(self, key: str) -> None:
        env = self._envs.pop(key, None)
        if env is not None:
            with contextlib.suppress(Exception):  # a failing close does not fail the episode it ends
                await asyncio.wait_for(env.close(), CLOSE_TIMEOUT_S)

    async def _call(self, what: str, call: Awaitable[Any], timeout_s: float) -> Any:
        try:
            return await asyncio.wait_for(call, timeout_s)
        except asyncio.TimeoutError:
            raise EnvironmentFailedError(f"the environment's {what} did not finish within {timeout_s:g} s") from None
        except EnvironmentFailedError:
            raise
        except Exception as exc:
            raise EnvironmentFailedError(f"the environment's {what} raised {_describe(exc)}") from exc

    async def shutdown(self) -> None:
        for key in list(self._envs):
            await self.close(key)


# ---- processes -----------------------------------------------------------------------------


def _child(conn: Any, spec: EnvSpec) -> None:
    """A pool process: runs its requests (reset, step, close) one at a time, each under its
    timeout. It says ``start`` before each, so when it dies the parent knows whose step killed
    it, and answers (request id, "ok" | "error", value or message)."""
    loop = asyncio.new_event_loop()
    envs: dict[str, Environment] = {}
    requests: asyncio.Queue[Any] = asyncio.Queue()

    def send(message: tuple[int, str, Any]) -> None:
        try:
            conn.send(message)
        except Exception as exc:  # an unpicklable result: say so instead
            conn.send((message[0], "error", f"its result cannot be sent back to the trainer: {_describe(exc)}"))

    async def run(op: str, key: str, arg: Any, timeout_s: float) -> Any:
        if op == "reset":
            env = envs[key] = build(*spec)
            return Observation.of(await asyncio.wait_for(env.reset(arg), timeout_s))
        if op == "step":
            return await asyncio.wait_for(envs[key].step(arg), timeout_s)
        closing = envs.pop(key, None)
        if closing is not None:
            await asyncio.wait_for(closing.close(), timeout_s)
        return None

    async def serve() -> None:
        while True:
            request = await requests.get()
            if request is None:
                return
            rid, op, key, arg, timeout_s = request
            send((rid, "start", None))
            try:
                send((rid, "ok", await run(op, key, arg, timeout_s)))
            except asyncio.TimeoutError:
                send((rid, "error", f"the environment's {op} did not finish within {timeout_s:g} s"))
            except Exception as exc:
                tb = traceback.format_exc(limit=-3)
                send((rid, "error", f"the environment's {op} raised {_describe(exc)}\n{tb}"))

    def read() -> None:
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                request = None  # the parent is gone
            loop.call_soon_threadsafe(requests.put_nowait, request)
            if request is None:
                return

    threading.Thread(target=read, daemon=True).start()
    loop.run_until_complete(serve())


@dataclass
class _Request:
    future: asyncio.Future[Any]
    key: str
    op: str
    timeout_s: float


class _Process:
    def __init__(self, ctx: Any, spec: EnvSpec, loop: asyncio.AbstractEventLoop, on_dead: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, spec), daemon=True, name="zmq-rollout-env")
        self.proc.start()
        child.close()
        self.loop = loop
        self.pending: dict[int, _Request] = {}
        self.running: int | None = None  # the request the process is running now
        self.keys: set[str] = set()
        self.dead = False
        self._on_dead = on_dead
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                rid, kind, value = self.conn.recv()
            except (EOFError, OSError):
                self.loop.call_soon_threadsafe(self._died)  # after the answers read before it
                return
            self.loop.call_soon_threadsafe(self._answer, rid, kind, value)

    def _answer(self, rid: int, kind: str, value: Any) -> None:
        if kind == "start":
            self.running = rid
            request = self.pending.get(rid)
            if request is not None:  # a step that blocks the process past its timeout is killed
                self.loop.call_later(request.timeout_s + KILL_GRACE_S, self._overdue, rid)
            return
        if self.running == rid:
            self.running = None
        request = self.pending.pop(rid, None)
        if request is None or request.future.done():
            return
        if kind == "ok":
            request.future.set_result(value)
        else:
            request.future.set_exception(EnvironmentFailedError(str(value)))

    def _died(self) -> None:
        self._on_dead(self, "its process died", self.running)

    def _overdue(self, rid: int) -> None:
        if not self.dead and self.running == rid and rid in self.pending:
            timeout_s = self.pending[rid].timeout_s
            self._on_dead(self, f"it blocked its process past the {timeout_s:g} s timeout (killed)", rid)

    def kill(self) -> None:
        self.dead = True
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class ProcessEnvs:
    """Environments spread over ``processes`` spawned processes (an episode stays on one).

    A process runs one request at a time, in order. A step past its timeout is cancelled in
    its process; a process still running it ``KILL_GRACE_S`` later (a step that blocks it) is
    killed and replaced, and so is one that dies. The episode whose step it was running ends
    with ``EnvironmentFailedError``; the others that lived there get ``EnvironmentLost`` and
    start over. Queued requests wait their turn: ``step_timeout_s`` counts from a step's start."""

    def __init__(self, spec: EnvSpec, processes: int) -> None:
        if processes < 1:
            raise ValueError("processes must be at least 1")
        self.spec = spec
        self._ctx = mp.get_context("spawn")
        self._loop = asyncio.get_running_loop()
        self._procs = [self._start() for _ in range(processes)]
        self._home: dict[str, _Process] = {}
        self._ids = itertools.count()
        self._lost: set[str] = set()

    def _start(self) -> _Process:
        return _Process(self._ctx, self.spec, self._loop, self._died)

    def _died(self, proc: _Process, why: str, culprit: int | None) -> None:
        """Replace ``proc``. The request it was running when it died or was killed
        (``culprit``) fails; every other episode that lived there lost its environment and
        starts over."""
        if proc.dead:
            return
        proc.kill()
        failed = set()
        for rid, request in proc.pending.items():
            if request.future.done():
                continue
            if rid == culprit:
                failed.add(request.key)
                request.future.set_exception(EnvironmentFailedError(f"the environment's {request.op} failed: {why}"))
            else:
                request.future.set_exception(EnvironmentLost(request.key))
        proc.pending.clear()
        self._lost |= proc.keys - failed
        self._procs[self._procs.index(proc)] = self._start()

    async def _call(self, key: str, op: str, arg: Any, timeout_s: float) -> Any:
        if key in self._lost:
            self._lost.discard(key)
            raise EnvironmentLost(key)
        proc = self._home[key]
        if proc.dead:
            raise EnvironmentLost(key)
        rid = next(self._ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        proc.pending[rid] = _Request(future, key, op, timeout_s)
        try:
            proc.conn.send((rid, op, key, arg, timeout_s))
        except OSError:
            pass  # the process died: its reader sees the end of the pipe, and ``_died`` answers this
        except Exception as exc:
            proc.pending.pop(rid, None)
            raise EnvironmentFailedError(f"the environment's {op} could not be sent: {_describe(exc)}") from exc
        return await future

    async def reset(self, key: str, sample: Any, timeout_s: float) -> Observation:
        self._lost.discard(key)
        proc = min(self._procs, key=lambda pr: len(pr.keys))
        self._home[key] = proc
        proc.keys.add(key)
        return Observation.of(await self._call(key, "reset", sample, timeout_s))

    async def step(self, key: str, action: Action, timeout_s: float) -> StepResult:
        return _check_step(await self._call(key, "step", action, timeout_s))

    async def close(self, key: str) -> None:
        self._lost.discard(key)
        proc = self._home.get(key)
        if proc is None:
            return
        proc.keys.discard(key)
        try:
            if not proc.dead:
                with contextlib.suppress(Exception, EnvironmentLost):  # a failing close ends nothing more
                    await self._call(key, "close", None, CLOSE_TIMEOUT_S)
        finally:
            self._home.pop(key, None)

    async def shutdown(self) -> None:
        for proc in self._procs:
            if not proc.dead:
                with contextlib.suppress(Exception):
                    proc.conn.send(None)
                proc.proc.join(5)
                proc.kill()
