"""The HTTP side port: Prometheus ``/metrics`` and a ``/health`` probe.

``/health`` answers 200 ``SERVING`` or 503 ``NOT_SERVING`` (loading, draining), so
load balancers without gRPC health checks (HAProxy's ``option httpchk``, open-source
nginx, cloud L7 checks) stop sending a draining replica new streams. Every other path
serves the metrics, as prometheus_client's own server does.

With TLS on (services/security/tls.py), the port speaks HTTPS with the gRPC port's certificate
(reloaded with it) and asks for no client certificate, so probes and scrapers that
cannot present one still work. With ``--auth-metrics`` the metrics need the bearer
token; ``/health`` never does.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIServer, make_server

import prometheus_client
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

HEALTH_PATH = "/health"
HANDSHAKE_TIMEOUT = 10.0  # seconds a client gets to finish the TLS handshake


class TLSWSGIServer(ThreadingWSGIServer):
    """The threaded WSGI server with each accepted connection wrapped in TLS.

    The handshake runs in the connection's own thread (``finish_request``), not in the
    accept loop, so a client that stalls it cannot block other connections.
    """

    tls: Callable[[], ssl.SSLContext]  # set by start_http before serving

    def get_request(self) -> tuple[socket.socket, object]:
        sock, address = super().get_request()
        wrapped = self.tls().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return wrapped, address

    def finish_request(self, request, client_address) -> None:
        request.settimeout(HANDSHAKE_TIMEOUT)
        try:
            request.do_handshake()
        except (OSError, ssl.SSLError):
            return  # not TLS, or gave up: the connection is closed by the caller
        request.settimeout(None)
        super().finish_request(request, client_address)


def _unauthorized(start_response: Callable) -> list[bytes]:
    start_response(
        "401 Unauthorized",
        [("Content-Type", "text/plain; charset=utf-8"), ("WWW-Authenticate", "Bearer")],
    )
    return [b"missing or invalid bearer token\n"]


def start_http(
    host: str,
    port: int,
    registry: prometheus_client.CollectorRegistry,
    serving: Callable[[], bool],
    tls: Callable[[], ssl.SSLContext] | None = None,
    authorize: Callable[[str | None], bool] | None = None,
) -> WSGIServer:
    """Serve ``/metrics`` and ``/health`` on ``host:port`` (0 = any free port) in a thread.

    ``tls`` gives the current server context (HTTPS when set); ``authorize`` checks the
    Authorization header of a metrics request (open when None).
    """
    metrics_app = prometheus_client.make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            if authorize is not None and not authorize(environ.get("HTTP_AUTHORIZATION")):
                return _unauthorized(start_response)
            return metrics_app(environ, start_response)
        ok = serving()
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [b"SERVING\n" if ok else b"NOT_SERVING\n"]

    server_class = ThreadingWSGIServer if tls is None else TLSWSGIServer
    httpd = make_server(host, port, app, server_class, handler_class=_SilentHandler)
    if tls is not None:
        httpd.tls = tls
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd
