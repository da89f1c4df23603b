"""Running one job on the engine, across weight syncs.

Tokens are stamped with the weight version that produced them. If a sync pauses the
engine in ``abort`` mode, vLLM ends the job's requests early; the job then waits for the
engine to resume and *continues* every unfinished sample from the tokens it already has
(prompt + generated so far, the remaining ``max_tokens``), so no work is lost. Such a
sample carries exact per-token ``weight_versions`` (old for the first part, new after).

Non-streaming jobs ask vLLM for the final output only (a per-token output costs the worker's
event loop a message per token, which capped GPU throughput at about 60% of direct vLLM);
a request's tokens are then stamped with the version live when it started, which is exact
because weights change only while requests are paused and cut off. ``keep`` mode is the
exception: vLLM freezes the requests and they finish on the new weights, so a sample that
spans the switch reports the version it finished under and, unless it was streamed (then
each delta is stamped on arrival), no per-token split.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from zmq_rollout import protocol as p

from .sampling import sampled_logprobs, vllm_sampling

if TYPE_CHECKING:
    from .engine import Engine

_MASK63 = (1 << 63) - 1


@dataclass
class _Acc:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] | None = None
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    unsplit: bool = False
    text: list[str] = field(default_factory=list)  # vLLM's text, piece by piece

    def add(
        self, tokens: list[int], chosen: list[float], tops: Any, finish: str | None, version: int, text: str, now: int
    ) -> None:
        """One output of a request; ``now`` is the engine's version (see ``_drive``'s -1)."""
        self.token_ids.extend(tokens)
        self.text.append(text)
        self.logprobs.extend(chosen)
        if version < 0:  # a keep-mode switch inside an unstreamed request: no split known
            self.unsplit = True
            version = now
        self.versions.extend([version] * len(tokens))
        if tops is not None and self.top is not None:
            self.top.extend(tops)
        if finish is not None:
            self.finish_reason = finish

    def sample(self) -> p.Sample:
        spans = self.versions if len(set(self.versions)) > 1 and not self.unsplit else None
        return p.Sample(
            self.index, self.token_ids, self.logprobs, self.finish_reason, self.top, spans, "".join(self.text)
        )


def continuation(job: p.JobSpec, acc: _Acc, prompt_ids: list[int]) -> tuple[list[int], p.SamplingParams] | None:
    """The request that continues a preempted sample, or None if it has nothing left to do."""
    s = job.sampling
    left = s.max_tokens - len(acc.token_ids)
    if left <= 0:
        return None
    seed = None if s.seed is None else (s.seed * 1_000_003 + acc.index * 7919 + len(acc.token_ids)) & _MASK63
    # the continuation's prompt is already truncated; min_tokens counts what is still owed
    owed = max(0, s.min_tokens - len(acc.token_ids))
    params = msgspec.structs.replace(s, n=1, max_tokens=left, seed=seed, min_tokens=owed, truncate_prompt_tokens=None)
    return prompt_ids + acc.token_ids, params


PROMPT_LOG_ENV = "ZMQ_ROLLOUT_TEST_PROMPT_LOG"
"""A TEST HOOK: a file to which the worker appends, per job, the prompt ids its engine gets
(one JSON line: job id, session id, ids). tests/integration/test_multi_turn.py proves with it
that each turn's prompt is the trajectory's exact prefix. Unset in production."""
_PROMPT_LOG = os.environ.get(PROMPT_LOG_ENV)  # read once: a worker process's environment is fixed


def _log_prompt(job: p.JobSpec, ids: list[int]) -> None:
    path = _PROMPT_LOG
    if path:
        line = json.dumps({"job_id": job.job_id, "session_id": job.session_id, "prompt_token_ids": ids}) + "\n"
        with open(path, "a", encoding="utf-8") as log:  # one write per line: whole lines from each worker
            log.write(line)


async def run_job(engine: Engine, request_id: str, job: p.JobSpec) -> AsyncIterator[p.Delta | p.Result]:
    """``Delta``s (if ``job.stream``), then one ``Result``. Keys are left 0 for the caller."""
    ids = engine.prompt_ids(job)
    _log_prompt(job, ids)
    top = job.sampling.logprobs
    accs = {i: _Acc(i, top=[] if top else None) for i in range(job.sampling.n)}
    # (request id, prompt, params, index of the sample, or None: vLLM's own n samples)
    requests: list[tuple[str, list[int], p.SamplingParams, int | None]] = [(request_id, ids, job.sampling, None)]
    attempt = 0
    while requests:
        epoch = engine.pause_epoch
        queue: asyncio.Queue[Any] = asyncio.Queue()
        tasks = [
            asyncio.ensure_future(_drive(engine, rid, prompt, params, idx, queue, job.stream, job.lora))
            for rid, prompt, params, idx in requests
        ]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                index, tokens, chosen, tops, finish, version, text = item
                accs[index].add(tokens, chosen, tops, finish, version, text, engine.weight_version)
                if job.stream and tokens:
                    yield p.Delta(0, index, tokens, chosen, text)
        finally:
            for task in tasks:
                task.cancel()
        requests = []
        cut = [acc for acc in accs.values() if acc.finish_reason == "abort"]
        if cut and engine.pause_epoch != epoch:  # a sync preempted us: continue what was cut short
            await engine.resumed()
            attempt += 1
            for acc in accs.values():
                if acc.finish_reason == "abort":
                    nxt = continuation(job, acc, ids)
                    if nxt is None:
                        acc.finish_reason = "length"
                    else:
                        requests.append((f"{request_id}-c{attempt}-{acc.index}", nxt[0], nxt[1], acc.index))
    versions = [v for acc in accs.values() for v in acc.versions] or [engine.weight_version]
    yield p.Result(0, ids, [accs[i].sample() for i in sorted(accs)], max(versions), "")


async def _drive(
    engine: Engine,
    rid: str,
    prompt: list[int],
    params: p.SamplingParams,
    index: int | None,
    queue: asyncio.Queue[Any],
    stream: bool,
    lora: str | None = None,
) -> None:
    """Feed one vLLM request's outputs into ``queue`` as (index, tokens, logprobs, top, finish,
    version, text); version -1 marks tokens whose version split is unknown (see the module doc).
    Both output kinds give what is new: DELTA the step's tokens and text, FINAL_ONLY all of them."""
    started = engine.weight_version
    try:
        sampling = vllm_sampling(params, stream=stream)
        lora_request = engine.lora_request(lora)
        async for out in engine.llm.generate({"prompt_token_ids": prompt}, sampling, rid, lora_request=lora_request):
            version = engine.weight_version if stream else (started if engine.weight_version == started else -1)
            for comp in out.outputs:
                tokens = list(comp.token_ids)
                chosen, tops = sampled_logprobs(tokens, comp.logprobs, params.logprobs)
                finish = None if comp.finish_reason is None else str(comp.finish_reason)
                item = (comp.index if index is None else index, tokens, chosen, tops, finish, version, comp.text)
                queue.put_nowait(item)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        queue.put_nowait(exc)
    finally:
        queue.put_nowait(None)


async def warm_up(engine: Engine) -> None:
    """One short seeded job with logprobs: the first such request compiles kernels (seconds
    on CPU), which must not land on a real job or look like a slow worker."""
    job = p.JobSpec("warm-up", p.SamplingParams(max_tokens=2, seed=0, logprobs=1), prompt_token_ids=[0, 1])
    async for _ in run_job(engine, "zmq-rollout-warm-up", job):
        pass


def failure(exc: BaseException, job: p.JobSpec) -> tuple[str, str]:
    """(error code, message) for a job that raised ``exc``. vLLM wraps what went wrong in an
    ``EngineGenerateError`` with no message: the message names the whole cause chain, and a
    request vLLM refused (its ``ValueError``s), or structured outputs this engine cannot load,
    are the sender's ``invalid_request``, not a failed job."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = " <- ".join(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__ for e in chain)
    if job.sampling.structured is not None and any(isinstance(e, ImportError) for e in chain):
        return "invalid_request", f"structured outputs are not available on this worker ({text})"
    if any(isinstance(e, ValueError) for e in chain[1:]):  # vLLM's own validation of the request
        return "invalid_request", text
    return "job_failed", text
