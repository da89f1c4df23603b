"""The command line's own behaviour: input files checked line by line before anything is sent,
errors as one line instead of a traceback, status without its own connection."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from zmq_rollout import protocol as p
from zmq_rollout.cli import app, read_prompts

GOOD = ['{"prompt": "hi"}', '{"prompt_token_ids": [1, 2, 3]}', '{"messages": [{"role": "user", "content": "x"}]}']
BAD = {
    '{"prompt": 5}': "prompt: a prompt is a string",
    "not json": "not JSON",
    '{"text": "hi"}': "exactly one of prompt, messages, prompt_token_ids",
    '{"prompt": "a", "messages": []}': "exactly one of",
    '{"prompt_token_ids": [-1]}': "non-negative",
    "[1, 2]": "needs an object",
}


def write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_read_prompts_names_every_bad_line(tmp_path: Path) -> None:
    path = write(tmp_path, [*GOOD, "", *BAD])
    prompts, problems = read_prompts(path, p.SamplingParams())
    assert [lineno for lineno, _ in prompts] == [1, 2, 3]
    assert len(problems) == len(BAD)
    for (lineno, problem), wanted in zip(enumerate(problems, 5), BAD.values(), strict=True):
        assert problem.startswith(f"{path}:{lineno}: ") and wanted in problem, problem


def test_generate_with_bad_lines_sends_nothing_and_exits_2(tmp_path: Path, start_broker: Any) -> None:
    broker = start_broker()
    path = write(tmp_path, [*GOOD, '{"prompt": 5}'])
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["generate", "-i", str(path), "-o", str(out), "--address", broker.frontend])
    assert result.exit_code == 2
    assert f"{path}:4: prompt: a prompt is a string" in result.output
    assert "Traceback" not in result.output and not out.exists()
    assert broker.jobs("submitted") == 0


def test_generate_skip_invalid_goes_on_and_lists_them(tmp_path: Path, start_broker: Any, start_double: Any) -> None:
    broker = start_broker()
    start_double(broker)
    path = write(tmp_path, ['{"prompt": 5}', *GOOD])
    out = tmp_path / "out.jsonl"
    args = ["generate", "-i", str(path), "-o", str(out), "--address", broker.frontend, "--n", "2", "--skip-invalid"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["line"], r["index"]) for r in rows) == [(2, 0), (2, 1), (3, 0), (3, 1), (4, 0), (4, 1)]
    assert f"skipped {path}:1: prompt" in result.output and "skipped 1 invalid line" in result.output


def test_an_error_of_ours_is_one_line_and_verbose_shows_the_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    dead = "tcp://127.0.0.1:9"  # nothing listens: the call times out
    args = ["generate", "-i", str(path), "-o", str(tmp_path / "o"), "--address", dead, "--timeout-s", "0.2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    assert result.output.count("\n") <= 3 and "error:" in result.output and "ClientConfig.timeout_s" in result.output
    verbose = CliRunner().invoke(app, [*args, "--verbose"])
    assert verbose.exit_code != 0 and verbose.exception is not None  # raised, so a traceback is shown


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["status", "--request-timeout-s", "0"], "request_timeout_s must be a positive number"),
        (["worker", "--model", "/m", "--gpus", "0,0"], "names a GPU twice"),
        (["generate", "-i", "x", "-o", "y", "--temperature", "-1"], "temperature"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_status_does_not_list_its_own_connection(start_broker: Any, start_client: Any) -> None:
    broker = start_broker()
    start_client(broker.frontend, name="trainer").status()  # another client, known to the broker
    result = CliRunner().invoke(app, ["status", "--address", broker.frontend])
    assert result.exit_code == 0, result.output
    clients = [line.split()[0] for line in result.output.split("CLIENT")[1].splitlines()[1:] if line.strip()][:-2]
    assert len(clients) == 1 and clients[0].startswith("trainer-"), result.output
