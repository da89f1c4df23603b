"""Our codec (msgspec typed Structs) against the ``msgpack`` package plus Python validation.

    python benchmarks/codec.py [--quick]

Two messages: a SUBMIT of 64 jobs (100-byte prompts) and a FINAL of 64 results (one sample
each: 256 token ids and 256 logprobs, 32 prompt token ids). For each, the time per message
to encode and to decode it into something the receiver can act on:

  msgspec          ``zmq_rollout.codec``: Structs -> bytes; bytes -> validated Structs
                   (types by msgspec, ranges by the Structs' ``__post_init__``).
  msgpack, arrays  the same bytes (checked identical): ``msgpack.packb`` of equivalent
                   lists; ``msgpack.unpackb`` to lists, then the same checks in Python
                   (every field's type, every list element's type, the same range checks,
                   reusing the protocol's own helpers) building one dict per item.
  msgpack, maps    the same, with field names on the wire (dicts), as a schema-less
                   protocol would do it; more bytes.

Each figure is the best of several ``timeit`` repeats, which keeps other load on the
machine out of it. This backs the choice of msgspec stated in zmq_rollout/codec.py.
"""

from __future__ import annotations

import argparse
import json
import random
import timeit
from collections.abc import Callable
from typing import Any

import msgpack
import msgspec

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.protocol import _finite, _int


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


NUM_ITEMS = 64
PROMPT = ("Solve step by step: a train leaves at 9:40 and travels 210 km at 84 km/h. When?").ljust(100)
SAMPLING_FIELDS = list(p.SamplingParams.__struct_fields__)
JOB_FIELDS = list(p.JobSpec.__struct_fields__)


def make_messages() -> tuple[list[p.JobSpec], list[p.Result]]:
    rng = random.Random(0)
    sampling = p.SamplingParams(n=1, temperature=0.7, top_p=0.95, max_tokens=256, seed=1234)
    jobs = [p.JobSpec(f"5f3a9c-{i:x}", sampling, PROMPT) for i in range(NUM_ITEMS)]
    results = []
    for i in range(NUM_ITEMS):
        tokens = [rng.randrange(150_000) for _ in range(256)]
        logprobs = [-rng.random() * 5 for _ in range(256)]
        sample = p.Sample(0, tokens, logprobs, "length")
        prompt = [rng.randrange(150_000) for _ in range(32)]
        results.append(p.Result(f"5f3a9c-{i:x}", prompt, [sample], 7, "worker-3"))
    return jobs, results


# -- the msgpack side: the protocol's checks, in Python, on plain lists or dicts --------------
# Ranges go through the protocol's own helpers (``_int``, ``_finite``, ``_require``), so both
# sides pay the same for them; the type checks msgspec does in C are written out here.
def _ints(name: str, values: Any) -> list[int]:
    if not (isinstance(values, list) and all(type(v) is int for v in values)):
        raise ValueError(f"{name} must be a list of integers")
    return values


def _floats(name: str, values: Any) -> list[float]:
    if not (isinstance(values, list) and all(type(v) is float for v in values)):
        raise ValueError(f"{name} must be a list of floats")
    return values


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string")
    return value


def _sampling(raw: Any, named: bool) -> dict[str, Any]:
    s = dict(zip(SAMPLING_FIELDS, raw, strict=False)) if not named else dict(raw)
    defaults = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 16,
                "stop": [], "seed": None, "logprobs": 0, "ignore_eos": False}  # fmt: skip
    s = {**defaults, **s}
    _int("n", s["n"], 1, p.MAX_N)
    _finite("temperature", s["temperature"], 0.0, 100.0)
    _finite("top_p", s["top_p"], 0.0, 1.0, lo_open=True)
    _int("top_k", s["top_k"], -1, 1 << 20)
    _int("max_tokens", s["max_tokens"], 1, p.MAX_TOKENS)
    _require(isinstance(s["stop"], list) and len(s["stop"]) <= p.MAX_STOP, "stop: at most 16 strings")
    _require(all(isinstance(x, str) and x for x in s["stop"]), "stop strings must be non-empty")
    if s["seed"] is not None:
        _int("seed", s["seed"], 0, (1 << 63) - 1)
    _int("logprobs", s["logprobs"], 0, p.MAX_TOP_LOGPROBS)
    _require(isinstance(s["ignore_eos"], bool), "ignore_eos must be a bool")
    return s


def validate_job(raw: Any, named: bool) -> dict[str, Any]:
    _require(isinstance(raw, dict if named else list), "a job must be an array/map")
    j = dict(raw) if named else dict(zip(JOB_FIELDS, raw, strict=False))
    job_id = _str("job_id", j["job_id"])
    _require(0 < len(job_id) <= p.MAX_JOB_ID, "job_id must be 1..128 characters")
    j["sampling"] = _sampling(j.get("sampling", []), named)
    prompt, messages, ids = j.get("prompt"), j.get("messages"), j.get("prompt_token_ids")
    _require(sum(x is not None for x in (prompt, messages, ids)) == 1, "exactly one prompt form")
    if prompt is not None:
        _require(0 < len(_str("prompt", prompt)) <= p.MAX_PROMPT_CHARS, "prompt: 1..1 MiB characters")
    if messages is not None:
        _require(isinstance(messages, list) and 0 < len(messages) <= p.MAX_MESSAGES, "messages")
        for m in messages:
            _require(isinstance(m, list) and len(m) >= 2, "a message is [role, content]")
            _str("role", m[0])
            _str("content", m[1])
    if ids is not None:
        _require(0 < len(_ints("prompt_token_ids", ids)) <= p.MAX_PROMPT_TOKENS, "1..1M ids")
        _require(min(ids) >= 0, "prompt_token_ids must be non-negative")
    _require(isinstance(j.get("stream", False), bool), "stream must be a bool")
    _int("min_weight_version", j.get("min_weight_version", 0), 0, (1 << 63) - 1)
    return j


def validate_result(raw: Any, named: bool) -> dict[str, Any]:
    r = dict(raw) if named else dict(zip(p.Result.__struct_fields__, raw, strict=False))
    _require(isinstance(r["key"], (str, int)), "key must be a string or an integer")
    _ints("prompt_token_ids", r["prompt_token_ids"])
    _require(isinstance(r["samples"], list), "samples must be a list")
    samples = []
    for raw_s in r["samples"]:
        s = dict(raw_s) if named else dict(zip(p.Sample.__struct_fields__, raw_s, strict=False))
        _int("index", s["index"], -(1 << 63), (1 << 63) - 1)
        _ints("token_ids", s["token_ids"])
        _floats("logprobs", s["logprobs"])
        _str("finish_reason", s["finish_reason"])
        _require(s.get("top_logprobs") is None or isinstance(s["top_logprobs"], list), "top_logprobs")
        samples.append(s)
    r["samples"] = samples
    _int("weight_version", r["weight_version"], -(1 << 63), (1 << 63) - 1)
    _str("worker_id", r["worker_id"])
    return r


def msgpack_decode(header: bytes, validate: Callable[[Any, bool], Any], named: bool) -> list[Any]:
    items = msgpack.unpackb(header, strict_map_key=False)
    _require(isinstance(items, list) and len(items) <= p.MAX_JOBS_PER_MESSAGE, "a list of items")
    return [validate(item, named) for item in items]


# -- measurement -------------------------------------------------------------------------------
def best_us(fn: Callable[[], Any], repeat: int) -> float:
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return min(timer.repeat(repeat, number)) / number * 1e6


def bench(name: str, command: bytes, items: list[Any], table: dict[bytes, Any],
          validate: Callable[[Any, bool], Any], repeat: int) -> dict[str, Any]:  # fmt: skip
    decoder = codec.Decoder(table)
    frames = codec.encode(command, items)
    as_arrays = msgspec.to_builtins(items)
    as_maps = msgspec.to_builtins([_named(i) for i in items])
    if msgpack.packb(as_arrays) != frames[2]:
        raise AssertionError("msgpack and msgspec disagree on the bytes")
    map_bytes = msgpack.packb(as_maps)
    keys = [decoded.get("job_id", decoded.get("key")) for decoded in msgpack_decode(map_bytes, validate, True)]
    if keys != [
        msgpack_decode(frames[2], validate, False)[i].get("job_id", as_arrays[i][0]) for i in range(len(items))
    ]:
        raise AssertionError("the two msgpack paths decode different items")
    rows = {
        "msgspec": (lambda: codec.encode(command, items), lambda: decoder.decode(frames), len(frames[2])),
        "msgpack, arrays": (lambda: [p.SIGNATURE, command, msgpack.packb(as_arrays)],
                            lambda: msgpack_decode(frames[2], validate, False), len(frames[2])),
        "msgpack, maps": (lambda: [p.SIGNATURE, command, msgpack.packb(as_maps)],
                          lambda: msgpack_decode(map_bytes, validate, True), len(map_bytes)),
    }  # fmt: skip
    out: dict[str, Any] = {
        "message": name,
        "bytes": {},
        "encode_us": {},
        "decode_us": {},
        "total_us": {},
    }
    for label, (enc, dec, size) in rows.items():
        out["bytes"][label] = size
        out["encode_us"][label] = round(best_us(enc, repeat), 1)
        out["decode_us"][label] = round(best_us(dec, repeat), 1)
        out["total_us"][label] = round(out["encode_us"][label] + out["decode_us"][label], 1)
    return out


def _named(item: Any) -> Any:
    """A Struct as nested dicts with field names (the 'maps' wire)."""
    if isinstance(item, msgspec.Struct):
        return {f: _named(getattr(item, f)) for f in item.__struct_fields__}
    if isinstance(item, list):
        return [_named(x) for x in item]
    return item


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke)")
    args = ap.parse_args()
    repeat = 3 if args.quick else 7
    jobs, results = make_messages()
    reports = [
        bench(f"SUBMIT, {NUM_ITEMS} jobs", p.SUBMIT, jobs, codec.FROM_CLIENT, validate_job, repeat),
        bench(f"FINAL, {NUM_ITEMS} results x 256 tokens", p.FINAL, results, codec.TO_CLIENT, validate_result, repeat),
    ]  # fmt: skip
    print(f"us per message, best of {repeat} repeats; ratio = msgpack path / msgspec (our codec)\n")
    print(f"{'message':<32} {'codec':<16} {'bytes':>7} {'encode':>8} {'decode':>8} {'total':>8} {'ratio':>6}")
    for r in reports:
        base = r["total_us"]["msgspec"]
        for label in r["total_us"]:
            enc, dec, total = r["encode_us"][label], r["decode_us"][label], r["total_us"][label]
            print(
                f"{r['message']:<32} {label:<16} {r['bytes'][label]:>7} {enc:>8.1f} {dec:>8.1f} {total:>8.1f} "
                f"{total / base:>5.1f}x"
            )
        r["ratio_total"] = {k: round(v / base, 2) for k, v in r["total_us"].items()}
        r["ratio_decode"] = {k: round(v / r["decode_us"]["msgspec"], 2) for k, v in r["decode_us"].items()}
    print("\ndecode = bytes -> validated objects the receiver can use; msgspec validates while decoding.")
    print("RESULT " + json.dumps({"repeat": repeat, "messages": reports}, separators=(",", ":")))


if __name__ == "__main__":
    main()
