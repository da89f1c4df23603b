"""The broker's CurveZMQ side (docs/security.md): its keypair, the ZAP handler that admits
peers by the allow-list, and a monitor on each port whose failed handshakes are counted
(``zmq_rollout_auth_failures_total``) and logged once a minute per port and kind.

A ZeroMQ context has one ZAP handler: a broker given no context gets a context of its own
for it, closed with the broker.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import zmq

from zmq_rollout.config import BrokerConfig
from zmq_rollout.curve import (
    HANDSHAKE_EVENTS,
    AllowList,
    Keypair,
    ZapHandler,
    handshake_failure,
    monitor_socket,
    serve_with_curve,
)
from zmq_rollout.errors import ConfigError

from .stats import BrokerStats

log = logging.getLogger(__name__)

PORTS = ("frontend", "backend")
REASONS = ("key_not_allowed", "handshake")
LOG_EVERY_S = 60.0
"""A kind of failed handshake on a port is logged at most once in this many seconds."""


class CurvePorts:
    """Keys on the broker's ports. ``setup`` makes one, or None for a broker without keys."""

    def __init__(
        self, keypair: Keypair, allow: AllowList, context: zmq.Context[Any] | None, stats: BrokerStats
    ) -> None:
        self.keypair = keypair
        self.own_context: zmq.Context[Any] | None = None
        """The context made for the ZAP handler when the broker was given none; closed here."""
        if context is None:
            context = self.own_context = zmq.Context()
        self.context: zmq.Context[Any] = context
        self._zap = ZapHandler(self.context, allow)
        self._stats = stats
        self.monitors: dict[zmq.Socket[Any], str] = {}
        """A monitor socket per port, and the port's name: what the loop polls and ``read``s."""
        self._logged: dict[tuple[str, str], float] = {}
        stats.auth_failures.update({(port, reason): 0 for port in PORTS for reason in REASONS})
        log.info("CurveZMQ on: %d allowed keys in %s", len(allow.keys), allow.directory)

    @classmethod
    def setup(cls, config: BrokerConfig, context: zmq.Context[Any] | None, stats: BrokerStats) -> CurvePorts | None:
        """The broker's keys as ``config`` sets them; None when it sets neither key setting."""
        if not (config.curve_secret_key or config.allow_keys):
            return None
        if not (config.curve_secret_key and config.allow_keys):
            raise ConfigError("BrokerConfig: set both curve_secret_key and allow_keys, or neither")
        keypair = Keypair.load(config.curve_secret_key, "curve_secret_key")
        return cls(keypair, AllowList(config.allow_keys), context, stats)

    def serve(self, sock: zmq.Socket[Any], port: str) -> None:
        """Require keys on ``sock`` (before it binds) and watch its handshakes."""
        serve_with_curve(sock, self.keypair, domain=port)
        self.monitors[monitor_socket(sock, HANDSHAKE_EVENTS)] = port

    def read(self, monitor: zmq.Socket[Any], now: float, limit: int) -> None:
        """Count the failed handshakes among up to ``limit`` waiting events of ``monitor``:
        a refused key, a plaintext peer or a wrong broker key (the ZAP handler logs each
        refused key once)."""
        from zmq.utils.monitor import recv_monitor_message

        port = self.monitors[monitor]
        failures = self._stats.auth_failures
        for _ in range(limit):
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            reason = handshake_failure(event["event"], event["value"])
            if reason is None:
                continue
            key = (port, reason)
            failures[key] = failures.get(key, 0) + 1
            if now - self._logged.get(key, -math.inf) >= LOG_EVERY_S:
                self._logged[key] = now
                log.warning(
                    "%s: a peer failed the CurveZMQ handshake (%s; %d so far)",
                    port,
                    "its key is not allowed" if reason == "key_not_allowed" else "plaintext, or a wrong broker key",
                    failures[key],
                )

    def unwatch(self, sock: zmq.Socket[Any]) -> None:
        """Stop monitoring ``sock`` (before it closes)."""
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()

    def close(self) -> None:
        """Close the monitors, the ZAP handler and an own context (after the ports closed)."""
        for monitor in self.monitors:
            monitor.close(linger=0)
        self._zap.close()
        if self.own_context is not None:
            self.own_context.term()
