"""The command line with TLS and tokens: ``headrace serve`` refusing bad flags at start-up and
warning when it listens openly, and ``headrace health``/``info``/``generate`` against a TLS +
token server (a ``headrace serve --model dummy:tiny`` subprocess; ``generate`` needs a
tokenizer, so it runs in-process against the fake engine's server)."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli import cli
from services.security.security_config import SecurityConfig
from services.server.server_config import ServerConfig
from tests.conftest import SCRIPT_TEXT
from tests.support.certs import issue, make_ca

ROOT = Path(__file__).resolve().parents[2]
HEADRACE = [sys.executable, "-m", "services.cli.cli"]
TOKEN = "cli-test-token-0123456789"
READY = re.compile(r"headrace ready: .* on (\S+):(\d+)")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cli-pki")
    ca = make_ca(d)
    server, client = issue(ca, d, "server"), issue(ca, d, "client", client=True)
    tokens = d / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    return {
        "ca": ca.cert,
        "cert": server.cert,
        "key": server.key,
        "tokens": tokens,
        "client_cert": client.cert,
        "client_key": client.key,
    }


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HEADRACE_")}
    return subprocess.run(
        [*HEADRACE, *argv],
        cwd=ROOT,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_refuses_bad_tls_and_auth_flags_before_loading(files, tmp_path: Path) -> None:
    cases = {
        "error: --tls-key given without --tls-cert": ["--tls-key", str(files["key"])],
        "error: --tls-cert: cannot read": [
            "--tls-cert",
            str(tmp_path / "nope.crt"),
            "--tls-key",
            str(files["key"]),
        ],
        "error: --auth-token-file: cannot read": ["--auth-token-file", str(tmp_path / "none")],
    }
    for expected, flags in cases.items():
        result = _run("serve", "--model", "dummy:tiny", "--port", "0", *flags)
        assert result.returncode == 2 and result.stderr.startswith(expected), result.stderr
    # The environment twin is checked the same way.
    result = _run("serve", "--model", "dummy:tiny", env={"HEADRACE_TLS_KEY": str(files["key"])})
    assert result.returncode == 2 and "--tls-key given without --tls-cert" in result.stderr


@pytest.fixture(scope="module")
def tls_server(files) -> Iterator[tuple[str, subprocess.Popen, str]]:
    """`headrace serve --model dummy:tiny` with TLS, tokens and --auth-metrics."""
    argv = [
        *HEADRACE,
        "serve",
        "--model",
        "dummy:tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--log-format",
        "json",
        "--tls-cert",
        str(files["cert"]),
        "--tls-key",
        str(files["key"]),
        "--auth-token-file",
        str(files["tokens"]),
        "--auth-metrics",
    ]
    server = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        ready = server.stdout.readline()
        assert READY.search(ready), ready + server.stderr.read()
        metrics = server.stdout.readline()
        yield f"localhost:{READY.search(ready).group(2)}", server, metrics
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_health_keeps_its_exit_codes_over_tls(tls_server, files) -> None:
    target, _, _ = tls_server
    ok = _run("health", "--server", target, "--tls-ca", str(files["ca"]))
    assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stderr
    plaintext = _run("health", "--server", target)
    assert plaintext.returncode == 2 and plaintext.stdout.startswith("UNREACHABLE")
    by_env = _run("health", "--server", target, env={"HEADRACE_CLIENT_TLS_CA": str(files["ca"])})
    assert by_env.returncode == 0, by_env.stdout + by_env.stderr
    unknown = _run("health", "--server", target, "--tls-ca", str(files["ca"]), "--service", "x")
    assert unknown.returncode == 1


def test_info_needs_the_token(tls_server, files) -> None:
    target, _, _ = tls_server
    ca = ["--server", target, "--tls-ca", str(files["ca"])]
    refused = _run("info", *ca)
    assert refused.returncode == 1
    assert "UNAUTHENTICATED: missing credentials" in refused.stderr
    by_file = _run("info", *ca, "--auth-token-file", str(files["tokens"]))
    assert by_file.returncode == 0 and '"model_name": "dummy-tiny"' in by_file.stdout, (
        by_file.stderr
    )
    by_env = _run("info", *ca, env={"HEADRACE_AUTH_TOKEN": TOKEN})
    assert by_env.returncode == 0, by_env.stderr
    wrong = _run("info", *ca, env={"HEADRACE_AUTH_TOKEN": "nope"})
    assert wrong.returncode == 1 and "UNAUTHENTICATED: invalid token" in wrong.stderr


def test_metrics_over_https_with_the_token(tls_server, files) -> None:
    _, _, line = tls_server
    url = re.search(r"(https://\S+/metrics)", line).group(1)
    context = ssl.create_default_context(cafile=str(files["ca"]))
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30, context=context) as response:
        assert "headrace_requests_running" in response.read().decode()
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url, timeout=30, context=context)
    assert info.value.code == 401


def test_serve_warns_when_listening_openly() -> None:
    argv = [
        *HEADRACE,
        "serve",
        "--model",
        "dummy:tiny",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--log-format",
        "json",
    ]
    server = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert READY.search(server.stdout.readline())
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        assert "without TLS or auth" in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_generate_over_mutual_tls_with_a_token(serve, files, capsys, monkeypatch) -> None:
    for name in [k for k in os.environ if k.startswith("HEADRACE_")]:
        monkeypatch.delenv(name)
    security = SecurityConfig(
        tls_cert=str(files["cert"]),
        tls_key=str(files["key"]),
        tls_client_ca=str(files["ca"]),
        auth_token_file=str(files["tokens"]),
    )
    running = serve(
        config=ServerConfig(host="127.0.0.1", port=0, metrics_port=-1, security=security)
    )
    argv = [
        "generate",
        "--server",
        f"localhost:{running.server.port}",
        "--tls-ca",
        str(files["ca"]),
        "--tls-cert",
        str(files["client_cert"]),
        "--tls-key",
        str(files["client_key"]),
        "--prompt",
        "Hi",
        "--max-tokens",
        "9",
    ]
    assert cli.main([*argv, "--auth-token-file", str(files["tokens"])]) == 0
    assert capsys.readouterr().out.endswith(SCRIPT_TEXT + "\n")  # after the server's log lines
    assert cli.main(argv) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    no_cert = [a for a in argv if a not in (str(files["client_cert"]), str(files["client_key"]))]
    no_cert = [a for a in no_cert if a not in ("--tls-cert", "--tls-key")]
    assert cli.main([*no_cert, "--auth-token-file", str(files["tokens"])]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_bench_serve_over_tls_with_a_token(serve, files, tmp_path: Path, monkeypatch) -> None:
    for name in [k for k in os.environ if k.startswith("HEADRACE_")]:
        monkeypatch.delenv(name)
    security = SecurityConfig(
        tls_cert=str(files["cert"]),
        tls_key=str(files["key"]),
        auth_token_file=str(files["tokens"]),
        auth_metrics=True,
    )
    running = serve(
        config=ServerConfig(host="127.0.0.1", port=0, metrics_port=0, security=security)
    )
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "serve",
        "--server",
        f"localhost:{running.server.port}",
        "--tls-ca",
        str(files["ca"]),
        "--auth-token-file",
        str(files["tokens"]),
        "--metrics-url",
        f"https://localhost:{running.server.metrics_port}/metrics",
        "--num-requests",
        "4",
        "--dataset",
        "fixed",
        "--output-len",
        "3",
        "--warmup",
        "0",
        "--no-progress",
        "--metrics-interval",
        "0.05",
        "--result-json",
        str(out),
    ]
    assert cli.main(argv) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["metrics"]["completed"] == 4 and run["metrics"]["failed"] == 0
    assert run["server_metrics"]["samples"] and not run["server_metrics"]["scrape_errors"]


def test_flags_and_env_twins_reach_the_configs(files) -> None:
    from services.cli.cli_flags import build_configs

    environ = {
        "HEADRACE_AUTH_TOKEN_FILE": str(files["tokens"]),
        "HEADRACE_AUTH_REFLECTION": "off",
        "HEADRACE_MAX_CONNECTION_IDLE": "7",
    }
    args = cli.build_parser(environ).parse_args(["serve", "--keepalive-timeout", "3"])
    server = build_configs(args).server
    assert server.security.auth_token_file == str(files["tokens"])
    assert server.security.auth_reflection is False
    assert server.connection.max_connection_idle == 7 and server.connection.keepalive_timeout == 3
    # The clients' --tls-cert/--tls-key/--auth-token-file never configure a server.
    argv = [
        "generate",
        "--tls-cert",
        str(files["client_cert"]),
        "--tls-key",
        str(files["client_key"]),
        "--auth-token-file",
        str(files["tokens"]),
    ]
    args = cli.build_parser({}).parse_args(argv)
    assert build_configs(args).server.security == SecurityConfig()
    assert args.client_tls_cert == str(files["client_cert"])
