"""Shared Prometheus plumbing: an HTTP ``/metrics`` server over an own registry."""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


class MetricsServer:
    """A running ``/metrics`` endpoint; ``shutdown()`` stops it."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread
        self.port: int = server.server_address[1]

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` on ``addr:port`` (port 0 picks a free one) in a daemon thread."""
    server, thread = start_http_server(port, addr=addr, registry=registry)
    log.info("metrics on http://%s:%d/metrics", addr, server.server_address[1])
    return MetricsServer(server, thread)
