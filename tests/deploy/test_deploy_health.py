"""What probes and balancers read from a replica: `headrace health` exit codes, the HTTP
/health endpoint beside /metrics, and the connection-age options of the grpc server."""

from __future__ import annotations

import contextlib
import socket
import time
import urllib.error
import urllib.request

from services.cli import cli
from services.server.server_config import ServerConfig
from tests.conftest import RunningServer, fake_engine


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed on exit: nothing listens there


def _http_health(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode().strip()


def test_health_exit_codes_serving_draining_unreachable(serve, capsys) -> None:
    running: RunningServer = serve(
        engine=fake_engine(step_delay=0.01),
        config=ServerConfig(host="127.0.0.1", port=0, metrics_port=0),
    )
    # Hold one stream open (~20 s) so the drain keeps the server up, answering NOT_SERVING.
    stream = running.stub().Generate(cli_request(max_tokens=2000), timeout=60)
    next(stream)
    assert cli.main(["health", "--server", running.target]) == 0
    assert _last_line(capsys) == "SERVING"
    assert _http_health(running.server.metrics_port) == (200, "SERVING")

    done = running.drain(grace_period=30)
    assert cli.main(["health", "--server", running.target]) == 1
    assert _last_line(capsys) == "NOT_SERVING"
    assert _http_health(running.server.metrics_port) == (503, "NOT_SERVING")
    stream.cancel()
    done.result(timeout=30)

    assert cli.main(["health", "--server", f"127.0.0.1:{_dead_port()}", "--timeout", "5"]) == 2
    assert _last_line(capsys).startswith("UNREACHABLE: UNAVAILABLE")


def test_unknown_service_is_not_serving_exit_1(served: RunningServer, capsys) -> None:
    assert cli.main(["health", "--server", served.target, "--service", "no.such.Svc"]) == 1
    assert _last_line(capsys).startswith("NOT_FOUND")


def test_health_help_documents_the_exit_codes(capsys) -> None:
    with contextlib.suppress(SystemExit):
        cli.main(["health", "--help"])
    text = capsys.readouterr().out
    for line in ("0  SERVING", "1  answered, but not SERVING", "2  no answer"):
        assert line in text


def test_metrics_paths_still_serve_prometheus_text(serve) -> None:
    running = serve(config=ServerConfig(host="127.0.0.1", port=0, metrics_port=0))
    url = f"http://127.0.0.1:{running.server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert "headrace_" in response.read().decode()


def test_connection_age_options() -> None:
    assert not any("connection_age" in name for name, _ in ServerConfig().grpc_options())
    options = dict(ServerConfig(max_connection_age=60, max_connection_age_grace=5).grpc_options())
    assert options["grpc.max_connection_age_ms"] == 60_000
    assert options["grpc.max_connection_age_grace_ms"] == 5_000


def test_connection_age_sends_goaway_and_streams_still_finish(serve) -> None:
    import grpc

    from services.gen.headrace.v1 import generation_pb2_grpc

    config = ServerConfig(
        host="127.0.0.1", port=0, metrics_port=-1, max_connection_age=1, max_connection_age_grace=30
    )
    running = serve(engine=fake_engine(step_delay=0.005), config=config)
    channel = grpc.insecure_channel(running.target)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    # A stream that outlives the connection's age completes inside the grace...
    responses = list(stub.Generate(cli_request(max_tokens=400), timeout=60))
    assert responses[-1].HasField("complete")
    # ...and the channel reconnects transparently for the next call after the GOAWAY.
    time.sleep(1.5)
    assert list(stub.Generate(cli_request(max_tokens=2), timeout=30))[-1].HasField("complete")
    channel.close()


def cli_request(max_tokens: int):
    from services.client import client

    return client.generate_request("hello", max_tokens=max_tokens)


def _last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]  # server logs share stdout
