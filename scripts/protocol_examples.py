#!/usr/bin/env python3
"""Regenerate the parts of docs/protocol.md that come from the code, so they cannot drift.

Each generated part sits between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``:
hex examples (encoded by the reference codec, annotated field by field, checked to decode
back and to read the same with the plain ``msgpack`` package) and the tables of the
weight-sync Structs and steps (from their fields, defaults and docstrings).

    python scripts/protocol_examples.py          # rewrite docs/protocol.md
    python scripts/protocol_examples.py --check  # exit 1 if it is out of date (a unit test runs this)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import msgspec

from zmq_rollout import codec
from zmq_rollout import protocol as p
from zmq_rollout.settings import field_docs

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


# -- annotated hex ---------------------------------------------------------------------------
def _hex(data: bytes) -> str:
    return " ".join(f"{b:02x}" for b in data)


def _header(count: int) -> bytes:
    """The msgpack array header of ``count`` items."""
    return msgpack.packb([None] * count)[: -count or None] if count else msgpack.packb([])


def _type_name(value: Any) -> str:
    return type(value).__name__


def annotate(value: Any, label: str, depth: int = 0) -> list[tuple[bytes, int, str]]:
    """(bytes, depth, note) lines whose bytes concatenate to ``value``'s encoding."""
    if isinstance(value, msgspec.Struct):
        items = msgpack.unpackb(msgspec.msgpack.encode(value), strict_map_key=False)
        tag = value.__struct_config__.tag
        names = list(value.__struct_fields__)
        lines = [(_header(len(items)), depth, f"{label}: array({len(items)}), {_type_name(value)}")]
        if tag is not None:
            lines.append((msgspec.msgpack.encode(tag), depth + 1, f"tag: {json.dumps(tag)}"))
            items = items[1:]
        for name, _ in zip(names, items, strict=False):
            lines += annotate(getattr(value, name), name, depth + 1)
        return lines
    if isinstance(value, list) and value and isinstance(value[0], msgspec.Struct):
        lines = [(_header(len(value)), depth, f"{label}: array({len(value)})")]
        for i, item in enumerate(value):
            lines += annotate(item, f"[{i}]", depth + 1)
        return lines
    if isinstance(value, (bytes, memoryview)):
        shown = f"bin, {len(value)} bytes"
    else:
        shown = json.dumps(value).replace("null", "nil")
    return [(msgspec.msgpack.encode(value), depth, f"{label}: {shown}")]


def example(command: bytes, body: Any, table: dict[bytes, Any], title: str) -> str:
    """One message: its three frames, and frame 2 item by item."""
    frames = codec.encode(command, body)
    header = frames[2]
    decoded = codec.Decoder(table).decode(frames).body
    assert decoded == body, f"{title}: does not decode back"
    plain = msgspec.to_builtins(body, builtin_types=(bytes, memoryview))
    assert msgpack.unpackb(header, strict_map_key=False) == plain, title  # plain msgpack reads it
    lines = annotate(body, "body")
    assert b"".join(chunk for chunk, _, _ in lines) == header, f"{title}: the annotation does not add up"
    name = p.COMMAND_NAMES[command].upper()
    out = [f"{title}: `ZR1`, `{command.hex()}` ({name}), then frame 2 ({len(header)} bytes):", "", "```"]
    out += [f"{_hex(header[i : i + 30])}" for i in range(0, len(header), 30)]
    out += ["```", "", "Frame 2, item by item:", "", "```"]
    for chunk, depth, note in lines:
        text = _hex(chunk)
        if len(text) > 44:
            text = text[:41] + "..."
        out.append(f"{'  ' * depth}{text:<{46 - 2 * depth}} {note}")
    out += ["```", ""]
    return "\n".join(out)


def raw_example(header: Any, command: bytes, table: dict[bytes, Any], expect: Any, title: str) -> str:
    """A body written by hand as plain msgpack (defaults left out), as another language would."""
    data = msgpack.packb(header, use_bin_type=True)
    body = codec.Decoder(table).decode([p.SIGNATURE, command, data]).body
    assert body == expect, f"{title}: {body!r} != {expect!r}"
    shown = json.dumps(header).replace("null", "nil")
    return "\n".join([f"{title}, `{shown}`:", "", "```", _hex(data), "```", ""])


# -- the examples ------------------------------------------------------------------------------
JOB = p.JobSpec("job-1", p.SamplingParams(n=2, temperature=0.7, max_tokens=8), prompt="2+2=")
RESULT = p.Result(
    "job-1",
    [50, 43, 50, 61],
    [p.Sample(0, [52], [-0.25], "length"), p.Sample(1, [53], [-1.5], "length")],
    0,
    "w1",
)
BUCKET = p.Bucket(0, 268, [p.TensorMeta("a", "bfloat16", [4, 4], 0, 32), p.TensorMeta("b", "float32", [3], 256, 12)])


def submit() -> str:
    return "\n".join(
        [
            example(
                p.SUBMIT, [JOB], codec.FROM_CLIENT, 'The job `job-1` (n 2, temperature 0.7, 8 tokens, prompt "2+2=")'
            ),
            raw_example(
                [["job-1", [2, 0.7, 1.0, -1, 8], "2+2="]],
                p.SUBMIT,
                codec.FROM_CLIENT,
                [JOB],
                "The same job with the trailing defaults left out",
            ),
        ]
    )


def final() -> str:
    return example(p.FINAL, [RESULT], codec.TO_CLIENT, "Its result from a worker named `w1`, as the client gets it")


def sealed_final() -> str:
    sealed = p.seal(p.Result(1, RESULT.prompt_token_ids, RESULT.samples, RESULT.weight_version, RESULT.worker_id))
    body = bytes(sealed.result)
    text = example(p.SEALED_FINAL, [sealed], codec.FROM_WORKER, "The same result as worker `w1` seals it for ticket 1")
    return "\n".join(
        [
            text,
            f"The bin's {len(body)} bytes are the Result above with nil (`c0`) for its key:",
            f"`{_hex(body[:8])} ...`. The broker writes the job id in the nil's place.",
            "",
        ]
    )


def sync() -> str:
    reply = p.SyncReply(7, "begin", [p.WorkerAck("w1", True, 1), p.WorkerAck("w2", True, 1)], [], 3)
    return "\n".join(
        [
            example(p.SYNC, p.SyncStep(0, p.Begin("abort")), codec.FROM_CLIENT, "A round begins (pause mode abort)"),
            raw_example(
                [0, ["begin", "abort"]],
                p.SYNC,
                codec.FROM_CLIENT,
                p.SyncStep(0, p.Begin("abort")),
                "The same step without the default timeout",
            ),
            example(p.SYNC_REPLY, reply, codec.TO_CLIENT, "The broker's answer once two workers of one rank paused"),
            example(
                p.CONTROL,
                p.Control(7, p.LoadShm("zr-41-0", BUCKET, begin=True), 1, 3),
                codec.TO_WORKER,
                "A bucket over shared memory, as the broker sends it to the first of two workers",
            ),
            example(p.CONTROL_ACK, p.ControlAck(7, "load_shm", True, 3, "", 2), codec.FROM_WORKER, "Its answer"),
        ]
    )


# -- tables ----------------------------------------------------------------------------------
def _type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        return f"`[{_type(args[0]).strip('`')}]`"
    if origin is dict:
        return "map"
    if origin is typing.Union:
        names = [_type(a).strip("`") for a in args]
        return "one of " + ", ".join(names) if len(names) > 3 else " \\| ".join(names)
    if annotation is type(None):
        return "nil"
    return {int: "int", float: "float", str: "str", bool: "bool", bytes: "bin", Any: "any"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


def _default(field: Any) -> str:
    if field.required:
        return "req."
    value = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
    if isinstance(value, msgspec.Struct):
        return "all defaults"
    return (
        "`"
        + (repr(value) if not isinstance(value, str) else f'"{value}"')
        .replace("None", "nil")
        .replace("True", "true")
        .replace("False", "false")
        + "`"
    )


def struct_table(cls: type) -> str:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    fields = msgspec.structs.fields(cls)
    doc = " ".join((cls.__doc__ or "").split())
    tag = cls.__struct_config__.tag
    title = f"### {cls.__name__} ({len(fields)} fields)" + (f", tag `{tag}`" if tag else "")
    out = [title, "", doc, "", "| # | field | type | default | meaning |", "| --- | --- | --- | --- | --- |"]
    first = 1 if tag else 0
    if tag:
        out.append(f'| 0 | (tag) | str | req. | `"{tag}"` |')
    for i, f in enumerate(fields, first):
        out.append(f"| {i} | `{f.name}` | {_type(hints[f.name])} | {_default(f)} | {docs.get(f.name, '')} |")
    return "\n".join([*out, ""])


def messages() -> str:
    classes = (
        p.SyncStep,
        p.SyncReply,
        p.WorkerAck,
        p.Evicted,
        p.Control,
        p.ControlAck,
        p.NameCheck,
        p.Bucket,
        p.TensorMeta,
        p.CudaIpcHandle,
        p.IpcSource,
    )
    return "\n".join(struct_table(cls) for cls in classes)


def steps() -> str:
    out = [
        "| step (tag) | fields after the tag | what each worker does | `ControlAck.result` |",
        "| --- | --- | --- | --- |",
    ]
    for cls in p.SYNC_OPS:
        hints = typing.get_type_hints(cls)
        fields = ", ".join(
            f"`{f.name}`: {_type(hints[f.name])}" + ("" if f.required else f" = {_default(f)}")
            for f in msgspec.structs.fields(cls)
        )
        doc = " ".join((cls.__doc__ or "").split())
        out.append(f"| `{cls.__struct_config__.tag}` | {fields or '—'} | {doc} | {cls.RESULT} |")
    return "\n".join([*out, ""])


BLOCKS: dict[str, Callable[[], str]] = {
    "sync-messages": messages,
    "sync-steps": steps,
    "submit-example": submit,
    "final-example": final,
    "sealed-final-example": sealed_final,
    "sync-example": sync,
}


def render(text: str) -> str:
    seen = set()

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in BLOCKS:
            raise SystemExit(f"docs/protocol.md has a generated block {name!r} that this script does not know")
        seen.add(name)
        return match.group(1) + BLOCKS[name]() + match.group(4)

    out = BLOCK.sub(replace, text)
    missing = set(BLOCKS) - seen
    if missing:
        raise SystemExit(f"docs/protocol.md lacks the generated blocks {sorted(missing)}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/protocol.md is out of date")
    args = parser.parse_args()
    text = DOC.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print("docs/protocol.md is out of date: run python scripts/protocol_examples.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
