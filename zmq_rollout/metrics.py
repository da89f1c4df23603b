"""Shared Prometheus plumbing: an HTTP ``/metrics`` server over an own registry.

It always answers in the Prometheus text format 0.0.4, whatever the scraper asks for: a
Prometheus 2.x asks for OpenMetrics first, and prometheus_client (0.26) writes OpenMetrics
with the ``:`` of a sample name (vLLM's ``vllm:`` families, on a worker's ``/metrics``)
turned into ``_`` but not in its ``# TYPE`` line, and Prometheus then stores nothing of
the scrape. Every Prometheus reads 0.0.4, in which the names are as registered.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger(__name__)

TEXT_FORMAT = "text/plain; version=0.0.4"


class MetricsServer:
    """A running ``/metrics`` endpoint; ``shutdown()`` stops it."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread
        self.port: int = server.server_address[1]

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No log line per scrape."""


def start_metrics_server(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` on ``addr:port`` (port 0 picks a free one) in a daemon thread."""
    app = make_wsgi_app(registry)

    def text_format(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        environ["HTTP_ACCEPT"] = TEXT_FORMAT
        return app(environ, start_response)

    class Server(ThreadingWSGIServer):
        address_family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]

    server = make_server(addr, port, text_format, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    log.info("metrics on http://%s:%d/metrics", addr, server.server_address[1])
    return MetricsServer(server, thread)
