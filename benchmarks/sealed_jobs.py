"""What sealing a job (SEALED_SUBMIT, docs/protocol.md section 5.9) costs and saves, per job.

    python benchmarks/sealed_jobs.py [--rounds 3000] [--samples 7] [--prompt-tokens 0] [--token-bins]

A SUBMIT's job reaches the broker as a ``JobSpec``'s encoding, which the broker decodes into a
``JobRelay`` (fourteen fields, each checked; the prompt a new Python string; three ``Raw``
views; ``__post_init__`` in Python) and encodes again, field by field, into a worker's JOBS. A
SEALED_SUBMIT carries each job whole beside copies of the fields the broker reads
(``p.SealedJob``): the broker decodes the copies, steps over the job, and writes the job's
bytes into JOBS as they came (``AssignmentRelay(ticket, job bytes, cost)``). The client pays
for the copies.

Per round, 64 jobs (``roles.PROMPT``, 100 characters, or with ``--prompt-tokens N`` N token ids
(``roles.prompt_ids``), as a token bin with ``--token-bins``) are packed by the client
(``pack_submits``), decoded by the broker's decoder (``codec.BROKER_FROM_CLIENT``) and their 64
assignments encoded, each way (SUBMIT, SEALED_SUBMIT), interleaved; each step is timed by this
thread's CPU time, best of ``--samples``. Prints us per job per step, each way, the bytes of a
message, and the ratios sealed / SUBMIT for the broker's two steps and for the client's.
(Until the twenty-first session this was a design probe with a type of its own; its figures
are in benchmarks/README.md.)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import msgspec
from roles import PROMPT, SAMPLING, prompt_ids

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.submissions import pack_submits, submit_command

BATCH = 64
WAYS = {"submit": False, "sealed": True}


def best(fn: Callable[[], Any], rounds: int, samples: int) -> float:
    """Best of ``samples`` of ``rounds`` calls of ``fn``, in us of this thread's CPU per job."""
    times = []
    for _ in range(samples):
        start = time.thread_time()
        for _ in range(rounds):
            fn()
        times.append(time.thread_time() - start)
    return min(times) / rounds / BATCH * 1e6


def message(jobs: list[p.JobSpec], token_bins: bool, sealed: bool) -> list[Any]:
    """The client's message of ``jobs`` (packed form), sealed or not."""
    ((_, encoded),) = pack_submits(jobs, BATCH, 1 << 30, token_bins=token_bins, sealed=sealed)
    return codec.encode(submit_command(sealed), encoded, packed=True)


def assignments(body: list[Any]) -> list[p.AssignmentRelay]:
    """What dispatch makes of a decoded message's jobs (``Job.wire``; tickets from 1000)."""
    return [
        p.AssignmentRelay(t, job.job if type(job) is p.SealedJob else job, job.cost())
        for t, job in enumerate(body, 1000)
    ]


def measure(rounds: int, samples: int, prompt_tokens: int, token_bins: bool) -> dict[str, Any]:
    ids = prompt_ids(prompt_tokens)
    jobs = [
        p.JobSpec(f"j1234-{i}", SAMPLING, prompt_token_ids=ids, ack=False)
        if prompt_tokens
        else p.JobSpec(f"j1234-{i}", SAMPLING, PROMPT, ack=False)
        for i in range(BATCH)
    ]
    decode = codec.Decoder(codec.BROKER_FROM_CLIENT).decode
    encode = msgspec.msgpack.Encoder().encode
    opened = msgspec.msgpack.Decoder(list[p.SealedAssignment]).decode
    out: dict[str, Any] = {}
    forwarded = {}
    for way, sealed in WAYS.items():
        frames = message(jobs, token_bins, sealed)
        body = decode(frames).body
        forwarded[way] = [p.unseal(a) for a in opened(encode(assignments(body)))]
        out[f"{way}_bytes"] = len(frames[0])
        out[f"{way}_client_us"] = best(lambda s=sealed: message(jobs, token_bins, s), rounds, samples)
        out[f"{way}_decode_us"] = best(lambda f=frames: decode(f), rounds, samples)
        out[f"{way}_encode_us"] = best(lambda b=body: encode(assignments(b)), rounds, samples)
    if forwarded["submit"] != forwarded["sealed"] or forwarded["sealed"][0] != p.Assignment(1000, jobs[0]):
        raise RuntimeError("a worker would not get the same jobs both ways: the measurement is wrong")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3000, help="messages of 64 jobs per sample")
    parser.add_argument("--samples", type=int, default=7, help="samples per way; the best is kept")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="prompts of N token ids (0: 100 characters)")
    parser.add_argument("--token-bins", action="store_true", help="token ids as a token bin, as the client sends them")
    args = parser.parse_args()
    r = measure(args.rounds, args.samples, args.prompt_tokens, args.token_bins)
    broker = {way: r[f"{way}_decode_us"] + r[f"{way}_encode_us"] for way in WAYS}
    r["broker_sealed_over_submit"] = round(broker["sealed"] / broker["submit"], 3)
    r["client_sealed_over_submit"] = round(r["sealed_client_us"] / r["submit_client_us"], 3)
    print(f"{BATCH} jobs a message: {r['submit_bytes']:,} bytes as SUBMIT, {r['sealed_bytes']:,} as SEALED_SUBMIT")
    print(f"{'':8} {'client packs':>12} {'broker decodes':>15} {'encodes JOBS':>13} {'broker':>8}  (us/job, CPU)")
    for way in WAYS:
        print(f"{way:8} {r[f'{way}_client_us']:12.3f} {r[f'{way}_decode_us']:15.3f} {r[f'{way}_encode_us']:13.3f} "
              f"{broker[way]:8.3f}")  # fmt: skip
    print(f"sealed / submit: broker {r['broker_sealed_over_submit']:.3f} "
          f"(saves {broker['submit'] - broker['sealed']:.3f} us/job), client {r['client_sealed_over_submit']:.3f} "
          f"(costs {r['sealed_client_us'] - r['submit_client_us']:+.3f} us/job)")  # fmt: skip
    print("RESULT " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))


if __name__ == "__main__":
    main()
