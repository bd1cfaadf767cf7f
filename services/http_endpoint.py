"""The plain-HTTP side port: Prometheus ``/metrics`` and a ``/health`` probe.

``/health`` answers 200 ``SERVING`` or 503 ``NOT_SERVING`` (loading, draining), so
load balancers without gRPC health checks (HAProxy's ``option httpchk``, open-source
nginx, cloud L7 checks) stop sending a draining replica new streams. Every other path
serves the metrics, as prometheus_client's own server does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIServer, make_server

import prometheus_client
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

HEALTH_PATH = "/health"


def start_http(
    host: str, port: int, registry: prometheus_client.CollectorRegistry, serving: Callable[[], bool]
) -> WSGIServer:
    """Serve ``/metrics`` and ``/health`` on ``host:port`` (0 = any free port) in a thread."""
    metrics_app = prometheus_client.make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return metrics_app(environ, start_response)
        ok = serving()
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [b"SERVING\n" if ok else b"NOT_SERVING\n"]

    httpd = make_server(host, port, app, ThreadingWSGIServer, handler_class=_SilentHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd
