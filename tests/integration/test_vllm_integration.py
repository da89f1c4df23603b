"""End to end over tcp loopback with REAL vLLM CPU workers (two) and the tiny model.

One cluster serves the whole module (start-up costs about a minute on 2 cores). The test
that SIGKILLs a worker starts a replacement, so the tests after it still have two.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq
from helpers import free_port, poll_until, scrape

from zmq_rollout import (
    AsyncRolloutClient,
    InvalidRequestError,
    JobCancelledError,
    Rollout,
    RolloutClient,
    SamplingParams,
    StructuredOutput,
    TokenDelta,
    codec,
)
from zmq_rollout import protocol as p
from zmq_rollout.config import BrokerConfig
from zmq_rollout.local import LocalCluster

PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(5 + i % 7)] for i in range(12)]


def free_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    config = BrokerConfig(
        frontend="tcp://127.0.0.1:*",
        backend="tcp://127.0.0.1:*",
        heartbeat_interval_s=0.5,
        worker_liveness=10,  # expiry 5 s: quick for the SIGKILL test, tolerant of a loaded 2-core CI machine
        metrics_port=0,
        metrics_host="127.0.0.1",
    )
    logs = tmp_path_factory.mktemp("logs")
    c = LocalCluster(tiny_model, num_workers=2, broker_config=config, log_dir=str(logs))
    try:
        c.start(wait_s=300)
        yield c
    finally:
        c.stop()


@pytest.fixture()
def client(cluster: LocalCluster):
    with RolloutClient(cluster.address, timeout_s=300) as c:
        yield c


def reference(
    model: str, jobs: list[tuple[list[int], dict]], *, texts: bool = False, groups: list[int] | None = None
) -> Any:
    """Token ids from direct vLLM (tests/vllm_reference.py in its own process); with
    ``texts``, (token ids, texts) per job and sample."""
    script = Path(__file__).with_name("vllm_reference.py")
    out = subprocess.run(
        [sys.executable, str(script)],
        input=json.dumps({"model": model, "jobs": jobs, "groups": groups}),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, f"direct vLLM failed (exit {out.returncode}):\n{out.stderr[-4000:]}"
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("REFERENCE "))
    found = json.loads(line[len("REFERENCE ") :])
    return (found["outputs"], found["texts"]) if texts else found["outputs"]


def by_prompt(rollouts: list[Rollout]) -> list[list[list[int]]]:
    grouped: dict[int, list[Rollout]] = {}
    for r in rollouts:
        grouped.setdefault(r.prompt_index, []).append(r)
    return [[r.token_ids for r in sorted(grouped[i], key=lambda r: r.index)] for i in sorted(grouped)]


def test_token_ids_and_text_identical_to_direct_vllm(
    cluster: LocalCluster, client: RolloutClient, tiny_model: str
) -> None:
    """Token ids and text equal direct vLLM's: greedy, seeded, and with stop strings (cut, and
    kept with include_stop_str_in_output), which behave exactly as in vLLM."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=4321, ignore_eos=True)
    plain = client.generate(PROMPTS, greedy) + client.generate(PROMPTS, seeded)
    # A stop string that the seeded samples of prompt 0 are known to contain: a printable
    # ASCII character from the middle of its text (byte-level tokens: mostly other bytes).
    first = next(r.text for r in plain[len(PROMPTS) :] if r.prompt_index == 0)
    stop = next(ch for ch in first[2:] if ch.isascii() and ch.isprintable() and not ch.isspace())
    cut = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=4321, ignore_eos=True, stop=[stop])
    kept = SamplingParams(
        n=2, temperature=1.0, max_tokens=12, seed=4321, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    stopped = client.generate(PROMPTS, cut)
    with_stop = client.generate(PROMPTS, kept)
    calls = [(greedy, plain[: len(PROMPTS)]), (seeded, plain[len(PROMPTS) :]), (cut, stopped), (kept, with_stop)]
    as_dict = lambda s: {
        "n": s.n,
        "temperature": s.temperature,
        "max_tokens": s.max_tokens,
        "seed": s.seed,
        "ignore_eos": True,
        "stop": list(s.stop) or None,
        "include_stop_str_in_output": s.include_stop_str_in_output,
    }
    want_ids, want_texts = reference(
        tiny_model,
        [(ids, as_dict(params)) for params, _ in calls for ids in PROMPTS],
        texts=True,
        groups=[len(PROMPTS)] * len(calls),  # one generate() call's prompts at a time, as above
    )
    got_ids = [group for _, rollouts in calls for group in by_prompt(rollouts)]
    got_texts = [
        [r.text for r in sorted(rs, key=lambda r: r.index)]
        for _, rollouts in calls
        for rs in [[r for r in rollouts if r.prompt_index == i] for i in range(len(PROMPTS))]
    ]
    assert got_ids == want_ids
    assert got_texts == want_texts
    assert all(len(s) == 12 for group in got_ids[: 2 * len(PROMPTS)] for s in group)
    # the stop string behaves: cut before it, or kept at the end; the ids are what was sampled
    s0 = next(r for r in stopped if r.prompt_index == 0 and r.index == 0)
    k0 = next(r for r in with_stop if r.prompt_index == 0 and r.index == 0)
    assert s0.finish_reason == k0.finish_reason == "stop"
    assert stop not in s0.text and first.startswith(s0.text)
    assert k0.text == s0.text + stop
    first_ids = next(r.token_ids for r in plain[len(PROMPTS) :] if r.prompt_index == 0)
    assert s0.token_ids == k0.token_ids == first_ids[: len(s0.token_ids)]


def test_the_rest_of_vllms_sampling_surface_is_token_identical(
    cluster: LocalCluster, client: RolloutClient, tiny_model: str
) -> None:
    """min_p, the penalties, stop_token_ids, min_tokens, truncate_prompt_tokens, logit_bias and
    structured outputs (choice, regex, JSON schema): each seeded job's ids and text equal direct
    vLLM's for the same parameters, and each visibly acts (a biased byte is common, a stop id
    ends the sample, a constraint is met)."""
    prompt = PROMPTS[3]
    base = {"temperature": 1.0, "max_tokens": 12, "seed": 77, "n": 2}
    free = client.generate([prompt], SamplingParams(**base, ignore_eos=True))
    stop_id = free[0].token_ids[4]  # a token the unconstrained sample is known to emit
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [
        {"min_p": 0.2},
        {"repetition_penalty": 1.5},
        {"presence_penalty": 1.0, "frequency_penalty": 0.5},
        {"stop_token_ids": [stop_id]},
        {"min_tokens": 10},
        {"logit_bias": {97: 8.0}},
        {"structured": StructuredOutput(choice=["yes", "no"])},
        {"structured": StructuredOutput(regex="[0-9]{3}")},
        {"structured": StructuredOutput(json_schema=json.dumps(schema)), "max_tokens": 40},
    ]
    jobs, ours = [], []
    for case in list(cases):
        params = SamplingParams(**{**base, **case})
        try:
            ours.append(client.generate([prompt], params))
        except InvalidRequestError as exc:
            # The GPU tier's vLLM bundle has no structured-output backend installed: there the
            # worker must say so plainly (invalid_request), and the case is left out. On the CPU
            # build (CI) every case runs.
            import torch

            assert "structured" in case and torch.cuda.is_available(), exc
            assert "structured outputs are not available on this worker" in str(exc)
            cases.remove(case)
            continue
        vllm_params = {**base, **{k: v for k, v in case.items() if k != "structured"}}
        if "structured" in case:
            so = case["structured"]
            vllm_params["structured_outputs"] = {
                "choice": so.choice,
                "regex": so.regex,
                "json": None if so.json_schema is None else json.loads(so.json_schema),
            }
        jobs.append((prompt, vllm_params))
    truncated = client.generate([prompt], SamplingParams(**base, truncate_prompt_tokens=3))
    jobs.append((prompt[-3:], base))
    want_ids, want_texts = reference(tiny_model, jobs, texts=True, groups=[1] * len(jobs))  # one call at a time
    got = [*ours, truncated]
    assert [[r.token_ids for r in rs] for rs in got] == want_ids
    assert [[r.text for r in rs] for rs in got] == want_texts
    by_case = dict(zip([next(iter(c)) + str(i) for i, c in enumerate(cases)], ours, strict=True))
    structured = {k: v for k, v in by_case.items() if k.startswith("structured")}
    first = by_case["stop_token_ids3"][0]  # sample 0 emits stop_id at position 4 when free (or EOS before)
    assert first.finish_reason == "stop" and first.token_ids[-1] in (stop_id, 258)
    assert first.token_ids == free[0].token_ids[: len(first.token_ids)] and len(first.token_ids) <= 5
    assert all(r.token_ids.count(97) >= 6 for r in by_case["logit_bias5"])  # 'a' is pushed up
    if structured:  # always on the CPU build
        assert {r.text for r in by_case["structured6"]} <= {"yes", "no"}
        assert all(re.fullmatch("[0-9]{3}", r.text) for r in by_case["structured7"])
        assert all(isinstance(json.loads(r.text)["a"], int) for r in by_case["structured8"])
    assert truncated[0].prompt_token_ids == prompt[-3:]


def test_rollout_fields_for_a_trainer(client: RolloutClient) -> None:
    rollouts = client.generate(
        ["hello there", [{"role": "user", "content": "hi"}], [5, 6, 7]],
        SamplingParams(n=3, max_tokens=8, seed=1, ignore_eos=True),
    )
    assert len(rollouts) == 9
    assert [r.prompt_index for r in rollouts] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r.index for r in rollouts] == [0, 1, 2] * 3
    for r in rollouts:
        assert len(r.token_ids) == len(r.logprobs) == 8
        assert all(lp <= 0.0 for lp in r.logprobs)
        assert r.finish_reason == "length"
        assert r.weight_version == 0
        assert r.worker_id in ("worker-0", "worker-1", "worker-2")
    assert rollouts[0].prompt_token_ids == list(b"hello there")  # byte-level tokenizer
    assert rollouts[6].prompt_token_ids == [5, 6, 7]
    assert len(rollouts[3].prompt_token_ids) > 2  # chat template applied
    # n samples of one seeded prompt differ from each other
    assert len({tuple(r.token_ids) for r in rollouts[:3]}) > 1


def test_real_workers_and_the_client_send_the_packed_form(cluster: LocalCluster, client: RolloutClient) -> None:
    """The reference worker and client switch to the packed form once the broker says it reads
    it (its answer to READY, its heartbeat replies): the broker answers them packed too."""
    client.generate([[3, 4, 5]], SamplingParams(max_tokens=2))
    workers = cluster.registered()
    assert len(workers) == 2
    broker = cluster.broker.broker

    def packed() -> bool:  # a fresh client's first SUBMIT may leave before its first heartbeat's answer
        split = broker.split_peers
        return client.identity.encode() not in split and not [
            i for i in split if i.decode(errors="replace").rsplit("-", 1)[0] in workers
        ]

    poll_until(packed, 10, "the client and both workers to send the packed form")
    (rollout,) = client.generate([[3, 4, 5]], SamplingParams(max_tokens=2))
    assert len(rollout.token_ids) == 2 and packed()


def test_top_logprobs(client: RolloutClient) -> None:
    (r,) = client.generate([[10, 11, 12]], SamplingParams(max_tokens=4, logprobs=3, seed=2, ignore_eos=True))
    assert r.top_logprobs is not None and len(r.top_logprobs) == 4
    for position, chosen in zip(r.top_logprobs, r.logprobs, strict=False):
        assert 3 <= len(position) <= 4  # top-3, plus the sampled token if it ranks lower
        assert max(position.values()) >= chosen - 1e-6


def test_streaming_deltas_add_up_to_the_final(cluster: LocalCluster) -> None:
    async def go() -> tuple[list[TokenDelta], list[Rollout]]:
        async with AsyncRolloutClient(cluster.address, timeout_s=300) as c:
            deltas, finals = [], []
            async for item in c.stream([9, 8, 7], SamplingParams(n=2, max_tokens=16, seed=3, ignore_eos=True)):
                (deltas if isinstance(item, TokenDelta) else finals).append(item)
            return deltas, finals

    deltas, finals = asyncio.run(go())
    assert len(finals) == 2
    assert len(deltas) > 2  # tokens arrived in more than one piece per sample
    for final in finals:
        streamed = [t for d in deltas if d.index == final.index for t in d.token_ids]
        assert streamed == final.token_ids
        assert len(final.token_ids) == 16
        said = "".join(d.text for d in deltas if d.index == final.index)
        assert said and final.text is not None and final.text.startswith(said)  # text streams with the tokens


def test_cancel_running_job_frees_credits(cluster: LocalCluster) -> None:
    cancelled_before = cluster.status().totals.cancelled

    async def go() -> None:
        async with AsyncRolloutClient(cluster.address, timeout_s=300) as c:
            # 32 samples x 1000 tokens: many seconds of work, so the cancel lands mid-job.
            job = SamplingParams(n=32, max_tokens=1000, ignore_eos=True)
            stream = c.stream([1, 2, 3], job)
            first = await stream.__anext__()  # tokens are flowing: the job runs on a worker
            assert isinstance(first, TokenDelta)
            with pytest.raises(JobCancelledError):
                await c.cancel([first.job_id])
                async for _ in stream:
                    pass
            quick = await c.generate([[4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
            assert len(quick[0].token_ids) == 4

    asyncio.run(go())
    poll_until(lambda: all(w.running == 0 for w in cluster.status().workers), 10, "the workers to be idle")
    assert cluster.status().totals.cancelled == cancelled_before + 1


def _raw_submit(address: str, header: bytes) -> list[bytes]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart([p.SIGNATURE, p.SUBMIT, header])
        assert sock.poll(120_000), "no answer from the broker"
        frames = sock.recv_multipart()
        while frames[1] == p.ACCEPTED:
            assert sock.poll(120_000), "no answer after ACCEPTED"
            frames = sock.recv_multipart()
        return frames
    finally:
        sock.close()


def malformed_total(cluster: LocalCluster) -> float:
    assert cluster.metrics_port is not None
    metrics = scrape(cluster.metrics_port)
    return sum(v for k, v in metrics.items() if k.startswith("zmq_rollout_malformed_messages_total"))


def test_bad_input_gets_clear_errors_while_other_jobs_finish(cluster: LocalCluster, client: RolloutClient) -> None:
    good = client.submit([3, 4, 5], SamplingParams(max_tokens=64, ignore_eos=True))
    # Impossible sampling never leaves the client.
    with pytest.raises(InvalidRequestError, match="temperature"):
        client.generate(["x"], _bad_sampling())
    # Too long for the model: the worker refuses it with a clear message.
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        client.generate([[1, 2]], SamplingParams(max_tokens=5000))
    # Token id beyond the vocabulary.
    with pytest.raises(InvalidRequestError, match="out of range"):
        client.generate([[100_000]], SamplingParams(max_tokens=2))
    # Malformed frames straight onto the wire.
    malformed_before = malformed_total(cluster)
    frames = _raw_submit(cluster.address, b"\xc1garbage")
    assert frames[1] == p.ERROR
    err = codec.Decoder(codec.TO_CLIENT).decode(frames).body[0]
    assert err.code == "protocol" and "submit" in err.message
    bad_job = codec.encode_body([["raw-1", [1, -3.0]], ["raw-2"]])  # temperature -3; no prompt
    frames = _raw_submit(cluster.address, bad_job)
    errors = codec.Decoder(codec.TO_CLIENT).decode(frames).body
    assert {e.key for e in errors} >= {"raw-1"}
    assert malformed_total(cluster) >= malformed_before + 2
    # Token ids the broker forwards raw (it reads only their count): the worker refuses a
    # negative one, that job alone.
    frames = _raw_submit(cluster.address, codec.encode_body([["raw-3", [], None, None, [1, -2]]]))
    (err,) = codec.Decoder(codec.TO_CLIENT).decode(frames).body
    assert (err.key, err.code) == ("raw-3", "invalid_request") and "non-negative" in err.message
    # The well-formed job submitted first still finishes.
    assert len(good.result(timeout=300)[0].token_ids) == 64


def _bad_sampling() -> SamplingParams:
    s = SamplingParams()
    s.temperature = -1.0  # bypasses __post_init__, as a buggy caller might
    return s


def test_seeded_long_prompts_in_one_batch_keep_the_engine_alive(cluster: LocalCluster, client: RolloutClient) -> None:
    """vLLM's CPU runner dies if a seeded prompt's prefill is split into chunks; the worker
    turns chunked prefill off there. Three 900-token seeded prompts at once would be split."""
    prompts = [[(i * 31 + j) % 250 + 3 for j in range(900)] for i in range(3)]
    rollouts = client.generate(prompts, SamplingParams(max_tokens=8, seed=11, ignore_eos=True))
    assert [len(r.token_ids) for r in rollouts] == [8, 8, 8]
    assert all(proc.poll() is None for proc in cluster.workers.values())  # no engine died
    cluster.wait_for_workers(2, 60)


def test_engine_crash_exits_worker_nonzero(cluster: LocalCluster) -> None:
    name = "worker-1"
    proc = cluster.workers[name]
    engine_cores = list(psutil.Process(proc.pid).children(recursive=True))
    assert engine_cores, "the worker has no engine process"
    for child in engine_cores:
        child.send_signal(signal.SIGKILL)
    assert cluster.reap(name) == 3  # EXIT_ENGINE_DEAD
    poll_until(lambda: name not in cluster.registered(), 30, f"{name} to leave the broker")
    cluster.start_worker("worker-2")
    cluster.wait_for_workers(2, 300)


def test_sigkilled_worker_jobs_finish_elsewhere_exactly_once(cluster: LocalCluster, client: RolloutClient) -> None:
    before = cluster.status().totals
    futures = [
        client.submit([i + 3, i + 4], SamplingParams(max_tokens=200, ignore_eos=True, seed=i)) for i in range(24)
    ]

    def a_busy_victim() -> tuple[str, int] | None:
        busy = {w.name: w.running for w in cluster.status().workers if w.running}
        name = next((n for n in busy if n != "worker-0"), None) if len(busy) > 1 else None
        return (name, busy[name]) if name else None

    victim, running_on_victim = poll_until(a_busy_victim, 60, "jobs on two workers")
    cluster.kill_worker(victim, signal.SIGKILL)
    results = [f.result(timeout=300) for f in futures]
    assert all(len(r) == 1 and len(r[0].token_ids) == 200 for r in results)
    after = cluster.status().totals
    assert after.requeued - before.requeued >= running_on_victim > 0
    assert after.completed - before.completed == 24  # each job's final exactly once


def test_a_worker_started_before_its_broker_joins_when_the_broker_appears(tiny_model: str) -> None:
    from zmq_rollout.broker.server import BrokerThread
    from zmq_rollout.config import WorkerConfig
    from zmq_rollout.local import LOCAL_WORKER_DEFAULTS
    from zmq_rollout.workers.main import worker_command

    front, back = free_address(), free_address()
    config = WorkerConfig(broker=back, model=tiny_model, name="early", **LOCAL_WORKER_DEFAULTS)
    proc = subprocess.Popen(worker_command(config), stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the engine is up and the worker says READY to nobody
            if "READY to" in line:
                break
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe from filling
        broker = BrokerThread(BrokerConfig(frontend=front, backend=back))
        with broker, RolloutClient(front, timeout_s=120) as client:
            poll_until(lambda: any(w.name == "early" for w in client.status().workers), 60, "the worker to join")
            (rollout,) = client.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
            assert rollout.worker_id == "early" and len(rollout.token_ids) == 4
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def test_broker_restart_with_jobs_on_real_workers_each_finishes_once(
    cluster: LocalCluster, client: RolloutClient
) -> None:
    """Last in this module: the broker's queues are gone after it. The client resubmits what
    had no answer; the workers, unknown to the new broker, reconnect and take it."""
    futures = [client.submit([i + 3, i + 9], SamplingParams(max_tokens=300, ignore_eos=True, seed=i)) for i in range(8)]
    poll_until(lambda: cluster.status().running > 0, 60, "jobs to run on the workers")
    workers = len(cluster.registered())
    cluster.restart_broker()
    results = [f.result(timeout=300) for f in futures]
    assert all(len(r) == 1 and len(r[0].token_ids) == 300 for r in results)
    assert [r[0].prompt_token_ids for r in results] == [[i + 3, i + 9] for i in range(8)]
    cluster.wait_for_workers(workers, 120)  # every worker found the new broker by itself
    totals = cluster.status().totals
    assert 0 < totals.submitted == totals.completed <= 8  # what the new broker got, each once
