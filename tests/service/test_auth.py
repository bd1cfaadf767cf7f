"""Token auth on a real in-process server: Generate, the worker protocol, reflection per
flag, health always open, /metrics per flag, the token file re-read on change, and the
start-up line that warns about an open server."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as worker_pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as worker_grpc
from structlog.testing import capture_logs

from services.gen.headrace.v1 import generation_pb2 as pb
from services.security import auth_tokens
from services.security.auth import INVALID, MALFORMED, MISSING, bearer_token, refusal
from services.security.auth_tokens import TokenFile, read_tokens
from services.security.security_config import SecurityConfig
from services.server.server_config import ServerConfig
from tests.conftest import RunningServer

TIMEOUT = 30
TOKEN, OTHER = "s3cret-token-AAAA", "second-token-BBBB"


def _token_file(path: Path, *tokens: str) -> Path:
    staging = path.with_suffix(".new")
    staging.write_text("# accepted tokens\n\n" + "".join(f"{t}\n" for t in tokens))
    os.replace(staging, path)  # atomically, as a mounted secret changes
    return path


def _serve(serve, tmp_path: Path, metrics_port: int = -1, **security) -> RunningServer:
    tokens = _token_file(tmp_path / "tokens", TOKEN, OTHER)
    config = SecurityConfig(auth_token_file=str(tokens), **security)
    return serve(
        config=ServerConfig(host="127.0.0.1", port=0, metrics_port=metrics_port, security=config)
    )


def _auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _generate_error(running: RunningServer, metadata) -> grpc.RpcError | None:
    request = pb.GenerateRequest(prompt="Hi", stopping=pb.StoppingCriteria(max_tokens=2))
    try:
        responses = list(running.stub().Generate(request, timeout=TIMEOUT, metadata=metadata))
    except grpc.RpcError as exc:
        return exc
    assert responses[-1].complete.usage.completion_tokens == 2
    return None


def test_generate_needs_a_valid_bearer_token(serve, tmp_path: Path) -> None:
    running = _serve(serve, tmp_path)
    assert _generate_error(running, _auth(TOKEN)) is None
    assert _generate_error(running, _auth(OTHER)) is None  # any token of the file
    assert _generate_error(running, [("authorization", f"bearer   {TOKEN} ")]) is None
    refused = {
        MISSING: None,
        INVALID: _auth("s3cret-token-AAAB"),
        MALFORMED: [("authorization", TOKEN)],  # no scheme
    }
    for message, metadata in refused.items():
        error = _generate_error(running, metadata)
        assert error is not None and error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error.details() == message
    # Only the first authorization entry counts: no guessing many tokens per call.
    error = _generate_error(running, [*_auth("wrong"), *_auth(TOKEN)])
    assert error is not None and error.code() == grpc.StatusCode.UNAUTHENTICATED
    registry = running.metrics.registry
    rejected = {"reason": "unauthenticated"}
    assert registry.get_sample_value("headrace_requests_rejected_total", rejected) == 4
    # Refused before anything else looks at the call: unparsable bytes still get
    # UNAUTHENTICATED, not the parser's INVALID_ARGUMENT.
    raw = running.channel().unary_stream("/headrace.v1.GenerationService/Generate")
    with pytest.raises(grpc.RpcError) as info:
        list(raw(b"\xff\xff\xff", timeout=TIMEOUT))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_worker_protocol_is_gated_too(serve, tmp_path: Path) -> None:
    running = _serve(serve, tmp_path)
    stub = worker_grpc.VllmEngineStub(running.channel())
    with pytest.raises(grpc.RpcError) as info:
        stub.GetModelInfo(worker_pb.GetModelInfoRequest(), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    request = worker_pb.GenerateRequest(
        request_id="w", tokenized=worker_pb.TokenizedInput(input_ids=[1, 2, 3]), stream=True
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=TIMEOUT, metadata=_auth("nope")))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (
        stub.GetModelInfo(
            worker_pb.GetModelInfoRequest(), timeout=TIMEOUT, metadata=_auth(TOKEN)
        ).model_path
        is not None
    )
    responses = list(stub.Generate(request, timeout=TIMEOUT, metadata=_auth(TOKEN)))
    assert responses[-1].HasField("complete")


def test_health_stays_open(serve, tmp_path: Path) -> None:
    running = _serve(serve, tmp_path)
    stub = health_pb2_grpc.HealthStub(running.channel())
    response = stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()


def _list_services(running: RunningServer, metadata=None) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(running.channel())
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    responses = stub.ServerReflectionInfo(iter([request]), timeout=TIMEOUT, metadata=metadata)
    return [s.name for r in responses for s in r.list_services_response.service]


@pytest.mark.parametrize("auth_reflection", [True, False])
def test_reflection_per_flag(serve, tmp_path: Path, auth_reflection: bool) -> None:
    running = _serve(serve, tmp_path, auth_reflection=auth_reflection)
    assert "headrace.v1.GenerationService" in _list_services(running, _auth(TOKEN))
    if auth_reflection:
        with pytest.raises(grpc.RpcError) as info:
            _list_services(running)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    else:
        assert "headrace.v1.GenerationService" in _list_services(running)


def _http(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=TIMEOUT
        ) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("auth_metrics", [True, False])
def test_metrics_per_flag_and_health_open(serve, tmp_path: Path, auth_metrics: bool) -> None:
    running = _serve(serve, tmp_path, metrics_port=0, auth_metrics=auth_metrics)
    base = f"http://127.0.0.1:{running.server.metrics_port}"
    assert _http(base + "/health") == 200
    assert _http(base + "/metrics", TOKEN) == 200
    assert _http(base + "/metrics") == (401 if auth_metrics else 200)
    assert _http(base + "/metrics", "wrong") == (401 if auth_metrics else 200)


def test_token_file_is_reread_when_it_changes(serve, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(auth_tokens, "CHECK_INTERVAL", 0.0)
    running = _serve(serve, tmp_path)
    assert _generate_error(running, _auth(TOKEN)) is None
    _token_file(tmp_path / "tokens", "rotated-token-CCCC")
    assert _generate_error(running, _auth("rotated-token-CCCC")) is None
    assert _generate_error(running, _auth(TOKEN)).code() == grpc.StatusCode.UNAUTHENTICATED
    (tmp_path / "tokens").write_text("")  # fail closed: an empty file accepts nothing
    error = _generate_error(running, _auth("rotated-token-CCCC"))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_token_parsing_and_file_errors(tmp_path: Path) -> None:
    assert bearer_token("Bearer abc") == "abc" and bearer_token("BEARER  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token("Bearer ") is None
    tokens = TokenFile(_token_file(tmp_path / "t", TOKEN))
    assert refusal([("x-request-id", "1")], tokens) == MISSING
    assert refusal(_auth(TOKEN), tokens) is None
    assert not tokens.accepts(TOKEN + "x") and not tokens.accepts("")
    (tmp_path / "spaces").write_text("two words\n")
    (tmp_path / "blank").write_text("# only a comment\n\n")
    errors = {
        tmp_path / "missing": "--auth-token-file: cannot read",
        tmp_path / "spaces": "--auth-token-file: line 1 of",
        tmp_path / "blank": "--auth-token-file: ",
    }
    for path, expected in errors.items():
        with pytest.raises(ValueError) as info:
            read_tokens(path)
        assert str(info.value).startswith(expected)
        assert "words" not in str(info.value)  # token text never echoed
    with pytest.raises(ValueError, match="--auth-metrics needs --auth-token-file"):
        SecurityConfig(auth_metrics=True)


@pytest.mark.parametrize(
    ("host", "security", "warned"),
    [("0.0.0.0", {}, True), ("127.0.0.1", {}, False), ("0.0.0.0", {"auth": True}, False)],
)
def test_warning_when_listening_openly(serve, tmp_path: Path, host, security, warned) -> None:
    config = SecurityConfig(
        auth_token_file=str(_token_file(tmp_path / "t", TOKEN)) if security else ""
    )
    with capture_logs() as logs:
        serve(config=ServerConfig(host=host, port=0, metrics_port=-1, security=config))
    warnings = [e for e in logs if e["log_level"] == "warning" and "without TLS" in e["event"]]
    assert bool(warnings) == warned
