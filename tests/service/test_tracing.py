"""W3C trace context and OpenTelemetry spans (services/telemetry/: trace_context, tracing).

Spans are checked with the SDK's in-memory exporter on an in-process server (both
services, with the status and drain interceptors in place); the OTLP/gRPC exporter is
checked end to end against a fake collector on loopback; tracing off is checked in a
fresh interpreter, where OpenTelemetry must never be imported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from smg_grpc_proto.generated import vllm_engine_pb2 as worker_pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as worker_grpc

from services.cli import cli, cli_flags
from services.gen.headrace.v1 import generation_pb2 as pb
from services.telemetry import log
from services.telemetry.log import LogConfig
from services.telemetry.trace_context import parse_traceparent
from services.telemetry.tracing import Tracing
from services.telemetry.tracing_config import TracingConfig, start_tracing
from tests.conftest import RunningServer, fake_engine, running_server

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 30
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
PHASES = ("tokenize", "queue", "prefill", "decode", "stream")
GENERATE_RPC = "/headrace.v1.GenerationService/Generate"


def _hex(n: int, digits: int) -> str:
    return format(n, f"0{digits}x")


def _request(max_tokens: int = 5, **kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(stopping=pb.StoppingCriteria(max_tokens=max_tokens), **kwargs)


def _trace_metadata() -> list[tuple[str, str]]:
    return [("traceparent", TRACEPARENT), ("tracestate", TRACESTATE)]


@pytest.fixture
def traced() -> Iterator[tuple[RunningServer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracing = Tracing(exporter, batch=False)  # exported as each span ends
    with running_server(fake_engine(), tracing=tracing) as running:
        yield running, exporter
    tracing.shutdown()


def _spans(exporter: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    """The finished spans, once ``count`` of them are (the RPC span ends after the reply)."""
    deadline = time.monotonic() + TIMEOUT
    while len(exporter.get_finished_spans()) < count:
        assert time.monotonic() < deadline, [s.name for s in exporter.get_finished_spans()]
        time.sleep(0.01)
    return list(exporter.get_finished_spans())


def _by_name(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


# -- traceparent -----------------------------------------------------------------------------


def test_traceparent_parsing_follows_w3c() -> None:
    parsed = parse_traceparent(TRACEPARENT)
    assert parsed is not None and parsed.sampled
    assert (parsed.trace_id, parsed.parent_id) == (TRACE_ID, PARENT_ID)
    assert not parse_traceparent(f"00-{TRACE_ID}-{PARENT_ID}-00").sampled
    # A later version may append fields; version 00 may not.
    assert parse_traceparent(f"01-{TRACE_ID}-{PARENT_ID}-01-extra") is not None
    for bad in (
        "",
        f"00-{TRACE_ID}-{PARENT_ID}-01-extra",
        f"ff-{TRACE_ID}-{PARENT_ID}-01",  # version ff is invalid
        f"00-{'0' * 32}-{PARENT_ID}-01",  # all-zero ids are invalid
        f"00-{TRACE_ID}-{'0' * 16}-01",
        f"00-{TRACE_ID.upper()}-{PARENT_ID}-01",  # lowercase hex only
        f"00-{TRACE_ID[:-1]}-{PARENT_ID}-01",
        "not a traceparent",
    ):
        assert parse_traceparent(bad) is None, bad


# -- spans of a request ----------------------------------------------------------------------


def test_request_spans_join_the_callers_trace(traced) -> None:
    running, exporter = traced
    responses = list(
        running.stub().Generate(
            _request(prompt="Hello", request_id="traced-1"),
            metadata=_trace_metadata(),
            timeout=TIMEOUT,
        )
    )
    complete = responses[-1].complete
    spans = _spans(exporter, 2 + len(PHASES))
    assert len(spans) == 2 + len(PHASES)
    named = _by_name(spans)
    rpc, request = named[GENERATE_RPC], named["generate"]
    assert {span.context.trace_id for span in spans} == {int(TRACE_ID, 16)}
    assert rpc.kind is SpanKind.SERVER and rpc.parent.span_id == int(PARENT_ID, 16)
    assert rpc.parent.is_remote and str(rpc.context.trace_state) != ""
    assert dict(rpc.context.trace_state) == {"congo": "t61rcWkgMzE", "rojo": "00f067aa0ba902b7"}
    assert rpc.attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
    assert request.parent.span_id == rpc.context.span_id
    assert request.attributes["headrace.request_id"] == "traced-1"
    assert request.attributes["gen_ai.usage.input_tokens"] == complete.usage.prompt_tokens == 1
    assert request.attributes["gen_ai.usage.output_tokens"] == 5
    assert request.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert request.status.status_code is StatusCode.UNSET
    phases = [named[name] for name in PHASES]
    assert all(p.parent.span_id == request.context.span_id for p in phases)
    # The pipeline's phases follow each other and lie within the request's span.
    tokenize, queue, prefill, decode, stream = phases
    assert request.start_time <= tokenize.start_time
    assert tokenize.end_time == queue.start_time and queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time and decode.end_time <= request.end_time
    assert stream.end_time <= request.end_time
    assert stream.attributes["headrace.stream.events"] == len(responses)


def test_invalid_argument_is_an_error_on_the_request_span(traced) -> None:
    running, exporter = traced
    stub = running.stub()
    cases = [
        _request(prompt="Hi", sampling=pb.SamplingParams(top_p=2.0)),  # refused by the servicer
        _request(token_ids=pb.TokenIds(ids=[10**6])),  # refused by the pipeline's tokenize stage
    ]
    for i, request in enumerate(cases):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, metadata=_trace_metadata(), timeout=TIMEOUT))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        spans = _spans(exporter, 2 * (i + 1))[2 * i :]
        named = _by_name(spans)
        assert set(named) == {GENERATE_RPC, "generate"}  # no phases for a failed request
        rpc, failed = named[GENERATE_RPC], named["generate"]
        assert failed.status.status_code is StatusCode.ERROR
        assert failed.status.description == f"INVALID_ARGUMENT: {info.value.details()}"
        assert failed.attributes["error.type"] == "INVALID_ARGUMENT"
        # The RPC span follows the gRPC conventions: the code, and no error for a
        # client's mistake.
        assert rpc.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert rpc.status.status_code is StatusCode.UNSET
        assert rpc.context.trace_id == failed.context.trace_id == int(TRACE_ID, 16)


def test_cancelled_request_span_has_an_event_and_no_phases() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(exporter, batch=False)
    with running_server(fake_engine(step_delay=0.02), tracing=tracing) as running:
        call = running.stub().Generate(
            _request(max_tokens=500, prompt="Hi"), metadata=_trace_metadata(), timeout=TIMEOUT
        )
        next(call), next(call)
        call.cancel()
        spans = _spans(exporter, 2)
    tracing.shutdown()
    assert [s.name for s in spans] == ["generate", GENERATE_RPC]
    request = spans[0]
    assert [e.name for e in request.events] == ["cancelled"]
    assert request.status.status_code is StatusCode.UNSET


def test_status_interceptors_still_map_errors_under_the_span(traced) -> None:
    running, exporter = traced
    # Bytes that do not parse: the status interceptor's own check answers, inside the span.
    call = running.channel().unary_stream(GENERATE_RPC)
    with pytest.raises(grpc.RpcError) as info:
        list(call(b"\xff\xff\xff", timeout=TIMEOUT))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    (rpc,) = _spans(exporter, 1)
    assert rpc.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # Draining: the drain gate's UNAVAILABLE is a server-side error on the RPC span.
    running.server._gate.draining = True
    with pytest.raises(grpc.RpcError) as info:
        list(running.stub().Generate(_request(prompt="Hi"), timeout=TIMEOUT))
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    rpc = _spans(exporter, 2)[1]
    assert rpc.status.status_code is StatusCode.ERROR
    assert rpc.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]


def test_batch_has_one_request_span_per_request(traced) -> None:
    running, exporter = traced
    batch = pb.GenerateBatchRequest(
        requests=[_request(prompt="a", request_id="a"), _request(prompt="b", request_id="b")]
    )
    list(running.stub().GenerateBatch(batch, metadata=_trace_metadata(), timeout=TIMEOUT))
    spans = _spans(exporter, 1 + 2 * (1 + len(PHASES)))
    (rpc,) = [s for s in spans if s.name == "/headrace.v1.GenerationService/GenerateBatch"]
    requests = [s for s in spans if s.name == "generate"]
    assert sorted(s.attributes["headrace.request_id"] for s in requests) == ["a", "b"]
    assert all(s.parent.span_id == rpc.context.span_id for s in requests)
    assert rpc.parent.span_id == int(PARENT_ID, 16)


def test_worker_protocol_generate_is_traced_and_its_polls_are_not(traced) -> None:
    running, exporter = traced
    stub = worker_grpc.VllmEngineStub(running.channel())
    request = worker_pb.GenerateRequest(
        request_id="w1",
        tokenized=worker_pb.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=worker_pb.SamplingParams(max_tokens=4),
        stream=True,
    )
    list(stub.Generate(request, metadata=_trace_metadata(), timeout=TIMEOUT))
    spans = _spans(exporter, 2 + len(PHASES))
    stub.GetLoads(worker_pb.GetLoadsRequest(), timeout=TIMEOUT)
    stub.HealthCheck(worker_pb.HealthCheckRequest(), timeout=TIMEOUT)
    health = health_pb2_grpc.HealthStub(running.channel())
    health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    named = _by_name(spans)
    rpc, request_span = named["/vllm.grpc.engine.VllmEngine/Generate"], named["generate"]
    assert rpc.parent.span_id == int(PARENT_ID, 16)
    assert request_span.parent.span_id == rpc.context.span_id
    assert request_span.attributes["headrace.request_id"] == "w1"
    assert request_span.attributes["gen_ai.usage.output_tokens"] == 4
    assert set(PHASES) <= set(named)
    time.sleep(0.2)  # a poll's span, if any, would have ended with its reply
    assert len(exporter.get_finished_spans()) == len(spans)


# -- log lines -------------------------------------------------------------------------------


def test_log_lines_carry_the_request_spans_ids(traced, capsys) -> None:
    running, exporter = traced
    log.configure(LogConfig(format="json"))
    list(running.stub().Generate(_request(prompt="Hi"), metadata=_trace_metadata()))
    with pytest.raises(grpc.RpcError):
        list(
            running.stub().Generate(
                _request(token_ids=pb.TokenIds(ids=[10**6])), metadata=_trace_metadata()
            )
        )
    requests = [s for s in _spans(exporter, 2 + len(PHASES) + 2) if s.name == "generate"]
    lines = _json_lines(capsys.readouterr().err)
    structlog.reset_defaults()  # the server's later lines must not go to capsys's closed file
    complete = next(e for e in lines if e["event"] == "request complete")
    failed = next(e for e in lines if e["event"] == "request failed")
    for line, span in zip((complete, failed), requests, strict=True):
        assert line["trace_id"] == TRACE_ID
        assert line["span_id"] == _hex(span.context.span_id, 16)


def test_a_request_without_traceparent_starts_a_trace(traced) -> None:
    running, exporter = traced
    list(running.stub().Generate(_request(prompt="Hi"), timeout=TIMEOUT))
    named = _by_name(_spans(exporter, 2 + len(PHASES)))
    assert named[GENERATE_RPC].parent is None
    assert named["generate"].context.trace_id == named[GENERATE_RPC].context.trace_id


# -- tracing off -----------------------------------------------------------------------------

OFF_SCRIPT = """
import json, sys
import grpc
from services.telemetry import log
from services.telemetry.log import LogConfig
from services.gen.headrace.v1 import generation_pb2 as pb
from tests.conftest import fake_engine, running_server

log.configure(LogConfig(format="json"))
with running_server(fake_engine()) as running:
    request = pb.GenerateRequest(prompt="Hi", stopping=pb.StoppingCriteria(max_tokens=3))
    list(running.stub().Generate(request, metadata=[("traceparent", sys.argv[1])], timeout=30))
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
print(json.dumps({"opentelemetry_modules": loaded}))
"""


def test_tracing_off_imports_no_opentelemetry_and_logs_the_callers_ids() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-c", OFF_SCRIPT, TRACEPARENT],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {"opentelemetry_modules": []}
    (line,) = [e for e in _json_lines(result.stderr) if e["event"] == "request complete"]
    assert line["trace_id"] == TRACE_ID and line["parent_span_id"] == PARENT_ID
    assert "span_id" not in line


def test_tracing_off_without_traceparent_adds_nothing_to_the_log(served, capsys) -> None:
    log.configure(LogConfig(format="json"))
    list(served.stub().Generate(_request(prompt="Hi"), timeout=TIMEOUT))
    lines = _json_lines(capsys.readouterr().err)
    structlog.reset_defaults()  # the server's later lines must not go to capsys's closed file
    line = next(e for e in lines if e["event"] == "request complete")
    assert not {"trace_id", "span_id", "parent_span_id"} & line.keys()


# -- configuration ---------------------------------------------------------------------------


def test_otlp_endpoint_flag_env_twin_and_standard_variables() -> None:
    def parse(argv: list[str], environ: dict[str, str]) -> TracingConfig:
        args = cli.build_parser(environ).parse_args(["serve", *argv])
        return cli_flags.build_configs(args).tracing

    assert parse([], {}) == TracingConfig() and not TracingConfig().enabled({})
    env = {"HEADRACE_OTLP_ENDPOINT": "http://collector:4317"}
    assert parse([], env).otlp_endpoint == "http://collector:4317"
    flag = parse(["--otlp-endpoint", "https://other:4317"], env)
    assert flag.otlp_endpoint == "https://other:4317"
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        assert TracingConfig().enabled({name: "http://collector:4317"})
    assert start_tracing(TracingConfig(), {}) is None
    with pytest.raises(ValueError, match="otlp_endpoint must start with http://"):
        TracingConfig(otlp_endpoint="collector:4317")


def test_otlp_endpoint_without_opentelemetry_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "services.telemetry.tracing", None)  # import fails
    with pytest.raises(ValueError, match=r"headrace\[tracing\]"):
        start_tracing(TracingConfig(otlp_endpoint="http://127.0.0.1:4317"), {})
    # Only the standard variable: a warning, and the server runs untraced.
    assert start_tracing(TracingConfig(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}) is None


def test_service_name_defaults_to_headrace_and_follows_otel_service_name(monkeypatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    tracing = Tracing(InMemorySpanExporter(), batch=False)
    assert tracing.provider.resource.attributes["service.name"] == "headrace"
    tracing.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-replica")
    tracing = Tracing(InMemorySpanExporter(), batch=False)
    assert tracing.provider.resource.attributes["service.name"] == "llm-replica"
    tracing.shutdown()


# -- OTLP over gRPC, end to end ------------------------------------------------------------


class FakeCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps what it is sent."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) of everything received."""
        with self._lock:
            out = []
            for request in self.requests:
                for resource_spans in request.resource_spans:
                    attrs = {
                        a.key: a.value.string_value for a in resource_spans.resource.attributes
                    }
                    for scope in resource_spans.scope_spans:
                        out += [(attrs, span) for span in scope.spans]
            return out


def test_serve_exports_spans_over_otlp_grpc() -> None:
    from tests.support.loadbalancer_cluster import start_replica

    collector = FakeCollector()
    receiver = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, receiver)
    port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    replica = start_replica(("--otlp-endpoint", f"http://127.0.0.1:{port}"))
    try:
        with grpc.insecure_channel(replica.target) as channel:
            stub = worker_grpc.VllmEngineStub(channel)
            request = worker_pb.GenerateRequest(
                request_id="otlp-1",
                tokenized=worker_pb.TokenizedInput(input_ids=[1, 2, 3]),
                sampling_params=worker_pb.SamplingParams(max_tokens=3),
                stream=True,
            )
            list(stub.Generate(request, metadata=_trace_metadata(), timeout=120))
        replica.process.send_signal(signal.SIGTERM)  # shutting down exports what is batched
        assert replica.process.wait(timeout=60) == 0
    finally:
        if replica.process.poll() is None:
            replica.process.kill()
            replica.process.wait()
        receiver.stop(grace=None)
    received = collector.spans()
    names = {span.name for _, span in received}
    assert {"/vllm.grpc.engine.VllmEngine/Generate", "generate", *PHASES} <= names
    assert {span.trace_id.hex() for _, span in received} == {TRACE_ID}
    assert {attrs["service.name"] for attrs, _ in received} == {"headrace"}
