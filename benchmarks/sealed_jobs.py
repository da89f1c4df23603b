"""What a job would cost the broker's codec if the client sealed it: a design probe, not the product.

    python benchmarks/sealed_jobs.py [--rounds 3000] [--samples 7] [--prompt-tokens 0] [--token-bins]

Today the broker decodes every job of a SUBMIT into a ``JobRelay`` (fourteen fields, each
checked; the prompt a new Python string; three ``Raw`` views; ``__post_init__`` in Python)
and encodes it again, field by field, into a worker's JOBS. Results already skip that: a
worker seals each one into a bin the broker steps over (``SealedResult``). This measures the
same idea for jobs, with a probe type that exists only here (``SealedJobProbe``): each job is
``[job_id, sampling (raw), job (bin: the job's own encoding, as the client makes it today),
session_id, min_weight_version, max_staleness, on_stale, stream, resubmitted, ack]``, the
fields the broker reads outside the bin and the bytes it only forwards inside it. The JOBS
item for a worker becomes ``[ticket, job bin]``.

Per round, one SUBMIT of 64 jobs (``roles.PROMPT``, 100 characters, or with
``--prompt-tokens N`` N token ids (``roles.prompt_ids``), as a token bin with ``--token-bins``) is decoded and its 64
assignments encoded, both ways, interleaved; each way is timed by this thread's CPU time,
best of ``--samples``. Prints us per job for decoding and encoding, each way, the bytes of a
SUBMIT, and the ratio sealed / today. What it leaves out, and what a real SEALED_SUBMIT
would need: the worker's checks of the bin (it decodes each job on its own already,
``p.unseal``), a capability each side announces, and the broker's JOBS for a worker that
cannot read sealed jobs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec
from roles import PROMPT, SAMPLING, prompt_ids

from zmq_rollout import protocol as p
from zmq_rollout.codec import array_header
from zmq_rollout.submissions import encode_job, sampling_wire

BATCH = 64


class SealedJobProbe(msgspec.Struct, array_like=True, gc=False):
    """A job as a sealed SUBMIT could carry it (this probe's own type; not on any wire)."""

    job_id: Annotated[str, msgspec.Meta(min_length=1, max_length=p.MAX_JOB_ID)]
    sampling: msgspec.Raw
    job: memoryview
    session_id: str | None = None
    min_weight_version: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_staleness: Annotated[int, msgspec.Meta(ge=0)] | None = None
    on_stale: Literal["abort", "restart"] = "abort"
    stream: bool = False
    resubmitted: bool = False
    ack: bool = False


def submit_bodies(jobs: list[p.JobSpec], token_bins: bool) -> tuple[bytes, bytes]:
    """One SUBMIT body of ``jobs`` as the client sends it today, and the same sealed."""
    encoded = [encode_job(job, token_bins) for job in jobs]
    today = array_header(len(jobs)) + b"".join(encoded)
    sealed_jobs = [
        SealedJobProbe(job.job_id, sampling_wire(job.sampling), memoryview(raw), ack=job.ack)
        for job, raw in zip(jobs, encoded, strict=True)
    ]
    return today, msgspec.msgpack.encode(sealed_jobs)


def best(fn: Callable[[], Any], rounds: int, samples: int) -> float:
    """Best of ``samples`` of ``rounds`` calls of ``fn``, in us of this thread's CPU per job."""
    times = []
    for _ in range(samples):
        start = time.thread_time()
        for _ in range(rounds):
            fn()
        times.append(time.thread_time() - start)
    return min(times) / rounds / BATCH * 1e6


def measure(rounds: int, samples: int, prompt_tokens: int, token_bins: bool) -> dict[str, Any]:
    ids = prompt_ids(prompt_tokens)
    jobs = [
        p.JobSpec(f"j1234-{i}", SAMPLING, prompt_token_ids=ids, ack=False)
        if prompt_tokens
        else p.JobSpec(f"j1234-{i}", SAMPLING, PROMPT, ack=False)
        for i in range(BATCH)
    ]
    today, sealed = submit_bodies(jobs, token_bins)
    relays_of = msgspec.msgpack.Decoder(list[p.JobRelay]).decode
    sealed_of = msgspec.msgpack.Decoder(list[SealedJobProbe]).decode
    encode = msgspec.msgpack.Encoder().encode
    relays, probes = relays_of(today), sealed_of(sealed)
    assert [r.job_id for r in relays] == [s.job_id for s in probes]
    relay = p.AssignmentRelay
    out: dict[str, Any] = {"today_bytes": len(today), "sealed_bytes": len(sealed)}
    for way, decode, body, jobs_of in (
        ("today", relays_of, today, lambda: encode([relay(t, r) for t, r in enumerate(relays, 1000)])),
        ("sealed", sealed_of, sealed, lambda: encode([(t, s.job) for t, s in enumerate(probes, 1000)])),
    ):
        out[f"{way}_decode_us"] = best(lambda d=decode, b=body: d(b), rounds, samples)
        out[f"{way}_encode_us"] = best(jobs_of, rounds, samples)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3000, help="SUBMITs of 64 jobs per sample")
    parser.add_argument("--samples", type=int, default=7, help="samples per way; the best is kept")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="prompts of N token ids (0: 100 characters)")
    parser.add_argument("--token-bins", action="store_true", help="token ids as a token bin, as the client sends them")
    args = parser.parse_args()
    r = measure(args.rounds, args.samples, args.prompt_tokens, args.token_bins)
    today = r["today_decode_us"] + r["today_encode_us"]
    sealed = r["sealed_decode_us"] + r["sealed_encode_us"]
    r["sealed_over_today"] = round(sealed / today, 3)
    print(f"SUBMIT of {BATCH} jobs: {r['today_bytes']:,} bytes today, {r['sealed_bytes']:,} sealed (a design probe)")
    print(f"{'':8} {'decode SUBMIT':>14} {'encode JOBS':>12} {'both':>8}  (us/job, thread CPU, best of samples)")
    print(f"{'today':8} {r['today_decode_us']:14.3f} {r['today_encode_us']:12.3f} {today:8.3f}")
    print(f"{'sealed':8} {r['sealed_decode_us']:14.3f} {r['sealed_encode_us']:12.3f} {sealed:8.3f}")
    print(f"sealed / today: {r['sealed_over_today']:.3f}; saved {today - sealed:.3f} us/job of the broker's codec")
    print("RESULT " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))


if __name__ == "__main__":
    main()
