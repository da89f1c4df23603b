"""CurveZMQ: keypairs, the broker's allow-list, and what each side sets on its socket.

A deployment with keys encrypts and authenticates every connection; without them nothing
changes (and the broker says at start that its ports are open)::

    zmq-rollout keys generate keys/ --name broker     # keys/broker.key, keys/broker.key_secret
    zmq-rollout keys generate allowed/ --name trainer  # one pair per client and per worker
    zmq-rollout keys generate allowed/ --name gpu-node-1
    zmq-rollout broker --curve-secret-key keys/broker.key_secret --allow-keys allowed/
    zmq-rollout worker --curve-server-key keys/broker.key \\
        --curve-secret-key allowed/gpu-node-1.key_secret ...
    RolloutClient(address, curve_server_key="keys/broker.key", curve_secret_key="allowed/trainer.key_secret")

Key files are ZeroMQ's own format (``zmq.auth``, czmq's ``.key`` / ``.key_secret``): the
public file may be shared; the secret file holds both keys and is written readable by its
owner only. The broker admits a peer whose public key is in one of the ``*.key`` files of
``allow_keys``; the folder is read again when it changes, so a key added (or removed) takes
effect without a restart for new connections.

The broker's ZAP handler (``ZapHandler``, a thread) decides with ``AllowList`` and logs each
refused key once. Handshake failures are counted from socket monitor events
(``handshake_failure``), on the broker's loop, as ``zmq_rollout_auth_failures_total``: reason
``key_not_allowed`` (a Curve peer whose key is not on the list) or ``handshake`` (a plaintext
peer, or one that holds the wrong broker key).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.utils import z85

from zmq_rollout.errors import ConfigError

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(frozen=True)
class Keypair:
    public: bytes
    """Z85 text, 40 bytes."""
    secret: bytes

    @classmethod
    def load(cls, path: str | os.PathLike[str], setting: str) -> Keypair:
        """The keypair in a ``.key_secret`` file; ``setting`` names the option in errors."""
        public, secret = _read_key_file(path, setting)
        if secret is None:
            raise ConfigError(
                f"{setting}: {path} holds only a public key; give the .key_secret file "
                "(zmq-rollout keys generate writes both)"
            )
        return cls(public, secret)


def load_public_key(path: str | os.PathLike[str], setting: str) -> bytes:
    """The public key in a ``.key`` (or ``.key_secret``) file."""
    return _read_key_file(path, setting)[0]


def _read_key_file(path: str | os.PathLike[str], setting: str) -> tuple[bytes, bytes | None]:
    if not os.path.isfile(path):
        raise ConfigError(f"{setting}: no key file at {path} (zmq-rollout keys generate DIR --name NAME writes one)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{setting}: {path} is not a ZeroMQ key file: {exc}") from None
    for key in (public, secret):
        if key is not None and len(key) != 40:
            raise ConfigError(f"{setting}: {path} holds a key of {len(key)} characters; Z85 keys have 40")
    return public, secret


def generate_keypair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (owner-only) into ``directory``;
    never overwrites an existing key."""
    if not name or os.sep in name or name.startswith("."):
        raise ConfigError(f"--name must be a plain file name, got {name!r}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise ConfigError(f"{path} exists; remove it first or choose another --name")
    old = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        zmq.auth.create_certificates(folder, name)
    finally:
        os.umask(old)
    public.chmod(0o644)
    return public, secret


class AllowList:
    """Public keys allowed in: the ``*.key`` files of a folder, read again when it changes."""

    def __init__(self, directory: str | os.PathLike[str], recheck_s: float = 1.0) -> None:
        if not os.path.isdir(directory):
            raise ConfigError(f"allow_keys: {directory} is not a folder of public key files")
        self.directory = str(directory)
        self.recheck_s = recheck_s
        self._stamp: float | None = None
        self._checked = -float("inf")
        self.keys: frozenset[bytes] = frozenset()
        self._reload(time.monotonic())
        if not self.keys:
            log.warning("allow_keys: %s holds no *.key file: every peer will be refused", self.directory)

    def _reload(self, now: float) -> None:
        self._checked = now
        stamp = os.stat(self.directory).st_mtime
        if stamp == self._stamp:
            return
        keys = set()
        for path in sorted(Path(self.directory).glob("*.key")):
            try:
                keys.add(load_public_key(path, "allow_keys"))
            except ConfigError as exc:
                log.error("%s (skipped)", exc)
        self.keys, self._stamp = frozenset(keys), stamp

    def allows(self, public_z85: bytes, now: float) -> bool:
        if now - self._checked >= self.recheck_s:  # a key added or removed counts within a second
            try:
                self._reload(now)
            except OSError as exc:
                log.error("allow_keys: cannot read %s: %s", self.directory, exc)
        return public_z85 in self.keys


class ZapHandler:
    """ZeroMQ's authentication hook for one context: admits Curve peers on the allow-list.

    libzmq asks it about every Curve handshake on a socket of its context (the broker's own);
    it answers 200 or 400 and logs each refused key once."""

    def __init__(self, context: zmq.Context[Any], allow: AllowList) -> None:
        self.allow = allow
        self._refused: set[bytes] = set()
        self._sock = context.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="zmq-rollout-zap", daemon=True)
        self._thread.start()

    def decide(self, request: list[bytes]) -> list[bytes]:
        """A ZAP 1.0 reply (RFC 27) to one request."""
        version, request_id, domain, address, _identity, mechanism, *credentials = request
        ok = False
        if version == b"1.0" and mechanism == b"CURVE" and len(credentials) == 1 and len(credentials[0]) == 32:
            key = z85.encode(credentials[0])
            ok = self.allow.allows(key, time.monotonic())
            if not ok and key not in self._refused:
                self._refused.add(key)
                log.warning(
                    "refused a %s peer at %s: its key %s is not in %s",
                    domain.decode(errors="replace"),
                    address.decode(errors="replace"),
                    key.decode(),
                    self.allow.directory,
                )
        if ok:
            return [b"1.0", request_id, b"200", b"OK", b"", b""]
        return [b"1.0", request_id, b"400", b"key not allowed", b"", b""]

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(100):
                    continue
                request = self._sock.recv_multipart()
                try:
                    reply = self.decide(request)
                except ValueError:  # not a ZAP request libzmq would send
                    reply = [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"bad request", b"", b""]
                self._sock.send_multipart(reply)
        except zmq.ZMQError:  # the context is being terminated
            pass
        finally:
            self._sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def serve_with_curve(sock: zmq.Socket[Any], keypair: Keypair, domain: str) -> None:
    """Make a bound socket a Curve server; its context's ZAP handler decides who gets in."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keypair.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keypair.secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())


def connect_with_curve(sock: zmq.Socket[Any], keypair: Keypair, server_public: bytes) -> None:
    """Make a connecting socket a Curve client of the server with ``server_public``."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keypair.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keypair.secret)


@dataclass(frozen=True)
class PeerKeys:
    """What a client or worker needs: the broker's public key and its own keypair."""

    server_public: bytes
    own: Keypair

    @classmethod
    def from_files(cls, server_key: str, secret_key: str, owner: str) -> PeerKeys | None:
        """From ``<owner>.curve_server_key`` / ``curve_secret_key``; None when neither is set."""
        if not server_key and not secret_key:
            return None
        if not (server_key and secret_key):
            raise ConfigError(f"{owner}: set both curve_server_key and curve_secret_key, or neither")
        return cls(
            load_public_key(server_key, f"{owner}.curve_server_key"),
            Keypair.load(secret_key, f"{owner}.curve_secret_key"),
        )

    def apply(self, sock: zmq.Socket[Any]) -> None:
        connect_with_curve(sock, self.own, self.server_public)


def monitor_socket(sock: zmq.Socket[Any], events: int) -> Any:
    """A PAIR socket that receives ``sock``'s monitor ``events`` (at a unique inproc address);
    of the same flavour as ``sock`` (an asyncio socket for an asyncio one)."""
    return sock.get_monitor_socket(events, addr=f"inproc://zmq-rollout-monitor-{uuid.uuid4().hex}")


def refusal(reason: str, address: str, curve: bool) -> str:
    """What a client or worker is told when its handshake with the broker at ``address`` fails."""
    if reason == "key_not_allowed":
        return (
            f"the broker at {address} refused this peer's CurveZMQ key: add its public key file "
            "(NAME.key) to the broker's allow_keys folder"
        )
    if curve:
        return (
            f"the CurveZMQ handshake with the broker at {address} failed: curve_server_key must be the broker's "
            "public key, and the broker must use CurveZMQ"
        )
    return (
        f"the broker at {address} requires CurveZMQ: set curve_server_key (the broker's public key file) "
        "and curve_secret_key (this peer's keypair)"
    )


def handshake_failure(event: int, value: int = 0) -> str | None:
    """The reason a monitor event stands for, or None if it is no handshake failure:
    ``key_not_allowed`` (the ZAP handler said no) or ``handshake`` (no common mechanism:
    a plaintext peer against Curve or the reverse, or the wrong server key)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "key_not_allowed"
    if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
        return "handshake"
    return None
