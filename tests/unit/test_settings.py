"""Config from one source: every field of every config reaches the command line, the child
processes a parent starts, and ``--help``; the client never changes its caller's config."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import typing
from typing import Any

import pytest
from typer.testing import CliRunner

import zmq_rollout
from zmq_rollout.cli import app
from zmq_rollout.client import AsyncRolloutClient
from zmq_rollout.config import BrokerConfig, ClientConfig, WorkerConfig
from zmq_rollout.settings import field_docs, flag, to_argv
from zmq_rollout.workers.main import worker_command

CONFIGS = (BrokerConfig, WorkerConfig, ClientConfig)


def changed(cls: type) -> Any:
    """An instance of ``cls`` with every field away from its default (optional ones set)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        kind = hints[f.name]
        if kind is bool:
            values[f.name] = not f.default
        elif kind is int or kind == int | None:
            values[f.name] = 17 + i if "bytes" not in f.name else (1 << 20) + i
        elif kind is float or kind == float | None:
            values[f.name] = 0.25 + i  # not a default, and exact in binary
        else:
            values[f.name] = f"value-{f.name}"
    if cls is WorkerConfig:  # a GPU list the engines can be cut from
        values["gpus"] = ",".join(str(i) for i in range(2 * values["tensor_parallel_size"]))
    config = cls(**values)
    for f in dataclasses.fields(cls):
        assert getattr(config, f.name) != f.default, f.name
    return config


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_has_a_docstring_and_a_unit_in_its_name(cls: type) -> None:
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring (it is its --help)"
        if any(word in f.name for word in ("timeout", "interval", "expiry")):
            assert f.name.endswith("_s"), f"{cls.__name__}.{f.name}: a time setting names its unit"


def _captured(command: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The config the CLI command builds from ``command``, captured where it would run."""
    seen: list[Any] = []
    import zmq_rollout.broker.server as server
    import zmq_rollout.workers.main as workers_main

    class Captured(Exception):
        pass

    def capture(config: Any) -> Any:
        seen.append(config)
        raise Captured

    monkeypatch.setattr(workers_main, "run_worker", capture)
    monkeypatch.setattr(server, "Broker", capture)
    monkeypatch.setattr(zmq_rollout, "RolloutClient", capture)
    result = CliRunner().invoke(app, command)
    assert isinstance(result.exception, Captured), result.output
    (config,) = seen
    return config


@pytest.mark.parametrize(
    ("cls", "command"),
    [(BrokerConfig, ["broker"]), (WorkerConfig, ["worker"]), (ClientConfig, ["generate", "-i", "in", "-o", "out"])],
    ids=["broker", "worker", "client"],
)
def test_every_field_round_trips_through_the_cli(
    cls: type, command: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    config = changed(cls)
    if cls is ClientConfig:
        (tmp_path / "in").write_text('{"prompt": "hi"}\n')
        monkeypatch.chdir(tmp_path)
    assert _captured([*command, *to_argv(config)], monkeypatch) == config


def test_client_status_command_takes_the_client_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _captured(["status", "--address", "tcp://h:9", "--request-timeout-s", "2.5"], monkeypatch)
    assert config == ClientConfig(address="tcp://h:9", request_timeout_s=2.5)


def test_every_worker_field_reaches_a_child_process() -> None:
    """The exact command a ``--gpus`` parent or a LocalCluster starts, asked to print its settings."""
    config = changed(WorkerConfig)
    command = [*worker_command(config), "--print-config"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == dataclasses.asdict(config)


def test_every_broker_field_reaches_a_child_process() -> None:
    config = changed(BrokerConfig)
    command = [sys.executable, "-m", "zmq_rollout.cli", "broker", *to_argv(config), "--print-config"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == dataclasses.asdict(config)


@pytest.mark.parametrize(("command", "cls"), [("broker", BrokerConfig), ("worker", WorkerConfig)])
def test_help_shows_every_field_with_its_docstring(command: str, cls: type) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400"}, terminal_width=400)
    assert result.exit_code == 0
    text = " ".join(result.output.replace("│", " ").split())
    for f in dataclasses.fields(cls):
        assert flag(f.name) in text, f.name
        assert field_docs(cls)[f.name][:40] in text, f.name


def test_the_client_never_changes_its_callers_config() -> None:
    mine = ClientConfig(address="tcp://a:1", timeout_s=5.0)
    before = dataclasses.replace(mine)
    client = AsyncRolloutClient("tcp://b:2", mine, timeout_s=7.0, name="x")
    assert mine == before
    assert (client.config.address, client.config.timeout_s, client.config.name) == ("tcp://b:2", 7.0, "x")
    assert client.config is not mine


def test_unknown_and_invalid_client_settings_are_refused() -> None:
    with pytest.raises(TypeError, match=r"unknown ClientConfig setting\(s\) \['timeout'\]"):
        AsyncRolloutClient("tcp://a:1", timeout=5)
    with pytest.raises(ValueError, match=r"ClientConfig\.timeout_s must be a positive number"):
        ClientConfig(timeout_s=0)
    assert ClientConfig(timeout_s=math.inf).timeout_s == math.inf  # no limit


def test_to_argv_refuses_a_none_where_the_default_is_not() -> None:
    @dataclasses.dataclass
    class Odd:
        port: int | None = 5
        """A port."""

    with pytest.raises(ValueError, match=r"Odd\.port is None but defaults to 5"):
        to_argv(Odd(port=None))
