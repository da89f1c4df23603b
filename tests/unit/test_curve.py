"""CurveZMQ on by configuration: keys from the CLI, an allow-list enforced on both ports,
refused peers counted and told why, plaintext peers kept out, and clear errors for bad
settings. The workers here are echo doubles; tests/integration/test_curve_worker.py runs a
real vLLM worker over Curve."""

from __future__ import annotations

import logging
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
import zmq
from helpers import poll_until
from typer.testing import CliRunner

from zmq_rollout import AuthenticationError, ConfigError, RolloutClient, SamplingParams, codec
from zmq_rollout import protocol as p
from zmq_rollout.broker.server import Broker
from zmq_rollout.cli import app
from zmq_rollout.config import BrokerConfig
from zmq_rollout.curve import AllowList, Keypair, PeerKeys, ZapHandler, generate_keypair, load_public_key


class Keys:
    """A broker pair, an allow-list folder with a trainer's and a worker's pairs, and a
    stranger's pair outside it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        _, self.broker_secret = generate_keypair(root / "broker", "broker")
        self.broker_public = root / "broker" / "broker.key"
        self.allowed = root / "allowed"
        for name in ("trainer", "worker"):
            generate_keypair(self.allowed, name)
        generate_keypair(root / "strangers", "stranger")

    def secret(self, name: str) -> str:
        folder = self.root / ("strangers" if name == "stranger" else "allowed")
        return str(folder / f"{name}.key_secret")

    def peer(self, name: str) -> PeerKeys:
        keys = PeerKeys.from_files(str(self.broker_public), self.secret(name), "test")
        assert keys is not None
        return keys

    def client_settings(self, name: str) -> dict[str, str]:
        return {"curve_server_key": str(self.broker_public), "curve_secret_key": self.secret(name)}


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path)


@pytest.fixture
def curve_broker(start_broker: Any, keys: Keys) -> Any:
    broker = start_broker(curve_secret_key=str(keys.broker_secret), allow_keys=str(keys.allowed))
    broker.curve = keys.peer("trainer")  # the fixture's STATUS probe is an allowed client
    return broker


def auth_failures(broker: Any) -> dict[tuple[str, str], int]:
    prefix = "zmq_rollout_auth_failures_total{"
    out = {}
    for key, value in broker.metrics().items():
        if key.startswith(prefix):
            labels = dict(part.split("=") for part in key[len(prefix) : -1].split(","))
            out[(labels["port"], labels["reason"])] = int(value)
    return out


def test_keys_generate_writes_a_pair_the_secret_owner_only_and_never_overwrites(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["keys", "generate", str(tmp_path / "k"), "--name", "trainer"])
    assert result.exit_code == 0, result.output
    public, secret = tmp_path / "k" / "trainer.key", tmp_path / "k" / "trainer.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pair = Keypair.load(secret, "test")
    assert load_public_key(public, "test") == pair.public and len(pair.secret) == 40
    again = CliRunner().invoke(app, ["keys", "generate", str(tmp_path / "k"), "--name", "trainer"])
    assert again.exit_code == 2 and "exists" in again.output
    assert Keypair.load(secret, "test") == pair  # untouched


def test_allowed_client_and_worker_run_jobs_over_curve(curve_broker: Any, start_double: Any, keys: Keys) -> None:
    start_double(curve_broker, curve=keys.peer("worker"))
    with RolloutClient(curve_broker.frontend, **keys.client_settings("trainer")) as client:
        rollouts = client.generate([[5, 6, 7]] * 3, SamplingParams(n=2, max_tokens=4))
    assert [r.token_ids for r in rollouts] == [[5, 6, 7]] * 6
    assert set(auth_failures(curve_broker).values()) == {0}


def test_a_client_key_not_on_the_list_is_refused_told_why_and_counted(curve_broker: Any, keys: Keys) -> None:
    with RolloutClient(curve_broker.frontend, **keys.client_settings("stranger")) as stranger:
        with pytest.raises(AuthenticationError, match="allow_keys"):
            stranger.generate(["hi"])
        with pytest.raises(AuthenticationError):  # and every call after it, at once
            stranger.status()
    assert auth_failures(curve_broker)[("frontend", "key_not_allowed")] >= 1
    status = curve_broker.status()
    assert status.totals.submitted == 0 and not any(c.name.startswith("client-") for c in status.clients)


def test_a_worker_key_not_on_the_list_never_gets_a_job(curve_broker: Any, start_double: Any, keys: Keys) -> None:
    stranger = start_double(curve_broker, registered=False, curve=keys.peer("stranger"), name="stranger")
    poll_until(lambda: auth_failures(curve_broker)[("backend", "key_not_allowed")] >= 1, what="the refusal")
    start_double(curve_broker, curve=keys.peer("worker"), name="allowed")
    with RolloutClient(curve_broker.frontend, **keys.client_settings("trainer")) as client:
        client.generate([[1, 2]] * 20, SamplingParams(max_tokens=2))
    assert [w.name for w in curve_broker.status().workers] == ["allowed"]
    assert stranger.received == []


def test_plaintext_peers_cannot_talk_to_a_curve_broker(curve_broker: Any, raw_socket: Any) -> None:
    with RolloutClient(curve_broker.frontend) as plain, pytest.raises(AuthenticationError, match="requires CurveZMQ"):
        plain.generate(["hi"])
    worker = raw_socket(zmq.DEALER)
    worker.connect(curve_broker.backend)
    worker.send_multipart(codec.encode(p.READY, p.WorkerInfo("plain", "m", 4)))
    poll_until(lambda: auth_failures(curve_broker)[("backend", "handshake")] >= 1, what="the plaintext worker")
    assert curve_broker.status().workers == [] and not worker.poll(0)
    assert auth_failures(curve_broker)[("frontend", "handshake")] >= 1


def test_a_wrong_broker_key_fails_the_handshake_with_a_clear_error(curve_broker: Any, keys: Keys) -> None:
    settings = {"curve_server_key": str(keys.allowed / "worker.key"), "curve_secret_key": keys.secret("trainer")}
    with RolloutClient(curve_broker.frontend, **settings) as client, pytest.raises(AuthenticationError) as info:
        client.generate(["hi"])
    assert "curve_server_key must be the broker's public key" in str(info.value)


def test_the_allow_list_follows_its_folder(keys: Keys) -> None:
    allow = AllowList(keys.allowed, recheck_s=1.0)
    stranger = load_public_key(keys.root / "strangers" / "stranger.key", "test")
    assert len(allow.keys) == 2 and not allow.allows(stranger, now=0.0)
    shutil.copy(keys.root / "strangers" / "stranger.key", keys.allowed / "stranger.key")
    assert not allow.allows(stranger, now=allow._checked + 0.5)  # rechecked at most once a second
    assert allow.allows(stranger, now=allow._checked + 1.0)
    (keys.allowed / "stranger.key").unlink()
    assert not allow.allows(stranger, now=allow._checked + 1.0)


def test_the_zap_handler_admits_only_curve_keys_on_the_list(keys: Keys) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        handler = ZapHandler(ctx, AllowList(keys.allowed))
        trainer = zmq.utils.z85.decode(load_public_key(keys.allowed / "trainer.key", "test"))
        stranger = zmq.utils.z85.decode(load_public_key(keys.root / "strangers" / "stranger.key", "test"))

        def status(mechanism: bytes, *credentials: bytes) -> bytes:
            return handler.decide([b"1.0", b"7", b"frontend", b"10.0.0.1", b"", mechanism, *credentials])[2]

        assert status(b"CURVE", trainer) == b"200"
        assert status(b"CURVE", stranger) == b"400"
        assert status(b"PLAIN", b"user", b"password") == b"400"
        assert status(b"CURVE", b"short") == b"400"
        handler.close()
    finally:
        ctx.term()


def test_bad_key_settings_are_config_errors_that_name_the_setting(keys: Keys, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="set both curve_secret_key and allow_keys"):
        Broker(BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", allow_keys=str(keys.allowed)))
    with pytest.raises(ConfigError, match="curve_secret_key: no key file at /nowhere"):
        Broker(BrokerConfig(curve_secret_key="/nowhere", allow_keys=str(keys.allowed)))
    with pytest.raises(ConfigError, match="holds only a public key"):
        Keypair.load(keys.broker_public, "curve_secret_key")
    with pytest.raises(ConfigError, match="is not a folder"):
        AllowList(tmp_path / "missing")
    with pytest.raises(ConfigError, match="set both curve_server_key and curve_secret_key"):
        RolloutClient("tcp://127.0.0.1:1", curve_server_key=str(keys.broker_public))
    (tmp_path / "junk.key_secret").write_text("not a key\n")
    with pytest.raises(ConfigError, match="not a ZeroMQ key file"):
        Keypair.load(tmp_path / "junk.key_secret", "curve_secret_key")


def test_the_cli_says_what_is_wrong_with_a_key_setting(keys: Keys) -> None:
    broker = CliRunner().invoke(app, ["broker", "--curve-secret-key", "/nowhere", "--allow-keys", str(keys.allowed)])
    assert broker.exit_code == 1 and "curve_secret_key: no key file at /nowhere" in broker.output
    assert "Traceback" not in broker.output
    worker = CliRunner().invoke(app, ["worker", "--model", "m", "--curve-server-key", str(keys.broker_public)])
    assert worker.exit_code == 1 and "set both curve_server_key and curve_secret_key" in worker.output


def test_a_broker_without_keys_warns_once_that_its_ports_are_open(
    start_broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="zmq_rollout.broker.server"):
        start_broker()
    warnings = [r for r in caplog.records if "no CurveZMQ keys" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
