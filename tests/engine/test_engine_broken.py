"""A broken engine stops the server instead of leaving a healthy-looking zombie.

A step that fails for the whole batch fails its requests and the loop goes on; the
MAX_FAILED_STEPS-th such step in a row stops the step loop. Then every health answer
(grpc.health.v1, HTTP /health, the worker protocol's HealthCheck) is NOT_SERVING, new
calls are UNAVAILABLE, and ``serve`` drains and returns 1 (``headrace serve`` exits 1).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as worker_pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as worker_grpc

from compute.core.messages import AddRequest, FailureKind, RequestFailed
from compute.core.sampling_params import SamplingParams
from compute.step_loop import MAX_FAILED_STEPS, StepLoop
from services.gen.headrace.v1 import generation_pb2 as pb
from services.gen.headrace.v1 import generation_pb2_grpc as pb_grpc
from services.pipeline.pipeline import Pipeline, PipelineConfig
from services.server.server import Server, serve
from services.server.server_config import ServerConfig
from services.telemetry.metrics import Metrics
from tests.conftest import fake_engine
from tests.support.waiting import wait_until

TIMEOUT = 30
POISON = 7  # a prompt holding this id makes the fake engine's step raise


def _generate(stub, ids: list[int]) -> grpc.StatusCode:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))
    request.stopping.max_tokens = 3
    try:
        list(stub.Generate(request, timeout=TIMEOUT))
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _health(channel: grpc.Channel) -> str:
    stub = health_pb2_grpc.HealthStub(channel)
    status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT).status
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def _http_health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_failed_step_between_good_ones_keeps_serving(serve) -> None:
    running = serve(fake_engine(poison_token=POISON))
    stub = running.stub()
    for _ in range(MAX_FAILED_STEPS - 1):  # one short of the limit, in a row
        assert _generate(stub, [POISON]) == grpc.StatusCode.INTERNAL
    assert running.pipeline.healthy
    assert _generate(stub, [5, 6]) == grpc.StatusCode.OK  # a good step resets the count
    for _ in range(2 * MAX_FAILED_STEPS):  # never MAX_FAILED_STEPS failures in a row
        assert _generate(stub, [POISON]) == grpc.StatusCode.INTERNAL
        assert _generate(stub, [5, 6]) == grpc.StatusCode.OK
    assert running.pipeline.healthy
    assert _health(running.channel()) == "SERVING"


def test_failed_steps_in_a_row_stop_the_step_loop_and_health_says_so(serve) -> None:
    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=0)
    running = serve(fake_engine(poison_token=POISON), config=config)
    stub = running.stub()
    assert _http_health(running.server.metrics_port) == 200
    for _ in range(MAX_FAILED_STEPS):
        assert _generate(stub, [POISON]) == grpc.StatusCode.INTERNAL
    wait_until(lambda: not running.pipeline.healthy)
    assert _http_health(running.server.metrics_port) == 503  # at once, no polling delay
    worker = worker_grpc.VllmEngineStub(running.channel())
    assert not worker.HealthCheck(worker_pb.HealthCheckRequest(), timeout=TIMEOUT).healthy
    wait_until(lambda: running.server.failed.is_set())
    assert _health(running.channel()) == "NOT_SERVING"
    assert _generate(stub, [5, 6]) == grpc.StatusCode.UNAVAILABLE  # refused, not hung


def test_serve_drains_and_returns_1_when_the_step_loop_dies() -> None:
    """``serve`` itself (what `headrace serve` runs), on this test's main thread."""
    pipeline = Pipeline(fake_engine(poison_token=POISON), PipelineConfig(), Metrics())
    pipeline.start()
    codes: list[grpc.StatusCode] = []

    def client(server: Server) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            codes.extend(_generate(stub, [POISON]) for _ in range(MAX_FAILED_STEPS))

    def on_ready(server: Server) -> None:
        threading.Thread(target=client, args=(server,), daemon=True).start()

    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=-1, grace_period=5)
    started = time.monotonic()
    try:
        status = asyncio.run(asyncio.wait_for(serve(pipeline, config, on_ready=on_ready), 60))
    finally:
        pipeline.stop()
    assert status == 1
    assert codes == [grpc.StatusCode.INTERNAL] * MAX_FAILED_STEPS
    assert time.monotonic() - started < 30


def _gated_broken_engine():
    """A fake engine whose every step fails; the last allowed one waits for the test."""
    engine = fake_engine()
    engine.entered, engine.release, engine.failed_steps = threading.Event(), threading.Event(), 0

    def step():
        engine.failed_steps += 1
        if engine.failed_steps == MAX_FAILED_STEPS:
            engine.entered.set()
            engine.release.wait(TIMEOUT)
        raise RuntimeError("broken engine")

    engine.step = step
    return engine


def test_requests_queued_when_the_engine_breaks_are_answered() -> None:
    engine, inbox, sent = _gated_broken_engine(), queue.Queue(), []
    loop = StepLoop(engine, inbox, sent.append, lambda: None)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()

    def add(rid: str) -> None:
        inbox.put(AddRequest(rid, (5,), SamplingParams(max_tokens=2), 0, time.monotonic()))

    for i in range(MAX_FAILED_STEPS - 1):
        add(f"bad{i}")
        wait_until(lambda i=i: f"bad{i}" in engine.aborted)
    add("last")
    assert engine.entered.wait(TIMEOUT)  # the third failing step is running
    add("queued")  # arrives while it runs: no step will ever take it
    engine.release.set()
    thread.join(TIMEOUT)
    assert not thread.is_alive() and loop.crashed
    failures = {m.request_id: m.kind for m in sent if isinstance(m, RequestFailed)}
    assert failures["last"] is FailureKind.ENGINE_FAULT
    assert failures["queued"] is FailureKind.UNAVAILABLE


def _stream_code(running, request_id: str, max_tokens: int = 3) -> tuple[str, str]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]))
    request.stopping.max_tokens = max_tokens
    metadata = (("x-request-id", request_id),)
    try:
        list(running.stub().Generate(request, timeout=TIMEOUT, metadata=metadata))
    except grpc.RpcError as exc:
        return exc.code().name, exc.details()
    return "OK", ""


def test_an_output_stage_fault_fails_only_its_request(serve, monkeypatch) -> None:
    from services.pipeline.request_state import RequestState

    on_output = RequestState.on_output

    def faulty(self, output, step_start, now):
        if output.request_id.startswith("bad"):
            raise RuntimeError("a detokenizer bug")
        return on_output(self, output, step_start, now)

    monkeypatch.setattr(RequestState, "on_output", faulty)
    running = serve(fake_engine(step_delay=0.005))
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(_stream_code, running, "good", 40)
        bad = pool.submit(_stream_code, running, "bad", 1000)  # aborted long before its end
        assert bad.result(TIMEOUT) == ("INTERNAL", "the server failed while streaming this request")
        assert good.result(TIMEOUT) == ("OK", "")
    wait_until(lambda: any(r.startswith("bad") for r in running.engine.aborted))
    assert running.pipeline.healthy and _health(running.channel()) == "SERVING"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_output_worker_fails_its_requests_and_stops_the_server(serve, monkeypatch):
    from services.pipeline.output_stage import OutputStage

    on_step = OutputStage._on_step

    def dying(self, step, deliveries):
        if any(o.request_id.startswith("bad") for o in step.outputs):
            raise RuntimeError("an output-stage bug outside any one request")
        return on_step(self, step, deliveries)

    monkeypatch.setattr(OutputStage, "_on_step", dying)
    running = serve(fake_engine(step_delay=0.005))
    assert _stream_code(running, "first") == ("OK", "")
    assert _stream_code(running, "bad")[0] == "INTERNAL"  # ended at once, not left hanging
    wait_until(lambda: running.server.failed.is_set())
    assert not running.pipeline.healthy and _health(running.channel()) == "NOT_SERVING"
    assert _stream_code(running, "after")[0] == "UNAVAILABLE"
