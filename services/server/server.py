"""The gRPC server: GenerationService, health, reflection, /metrics + /health, drain.

TLS, mutual TLS and token auth come from services/security/security.py; connection limits and
keepalive from services/server/connection_config.py (both through ServerConfig).

``Server`` wires a started pipeline into a grpc.aio server. On SIGTERM or
SIGINT, ``serve`` drains: health turns NOT_SERVING, new GenerationService calls
get UNAVAILABLE "server is draining", streams in flight get ``grace_period``
seconds to finish, then the server stops (a second signal skips the wait).

When a pipeline stage dies (the step loop, compute/step_loop.py: a bug, or an engine
that failed several steps in a row; or an output worker), every health answer turns
NOT_SERVING at once and
``serve`` drains and returns 1, so that ``headrace serve`` exits non-zero and its
supervisor (Docker's restart policy, Kubernetes) starts a fresh process instead of a
balancer sending requests to one that can only fail them.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as worker_grpc

from kernels.log import get_logger
from services import rpc
from services.api.servicer import GenerationServicer
from services.domain import Unavailable
from services.gen.headrace.v1 import generation_pb2 as pb
from services.gen.headrace.v1 import generation_pb2_grpc as pb_grpc
from services.pipeline.thread_profiler import ThreadProfiler
from services.rpc import Continuation
from services.security.security import ServerSecurity
from services.server.http_endpoint import start_http
from services.server.server_config import ServerConfig
from services.server.status import StatusInterceptor, wrap_handler
from services.telemetry.metrics import NO_METRICS, Metrics
from services.worker.servicer import SERVICE_NAME as WORKER_SERVICE_NAME
from services.worker.servicer import WorkerServicer

if TYPE_CHECKING:
    from compute.core.config import EngineConfig
    from services.pipeline.pipeline import Pipeline, PipelineConfig
    from services.telemetry.tracing import Tracing
    from services.telemetry.tracing_config import TracingConfig

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name

log = get_logger(__name__)

PIPELINE_CHECK_S = 0.25  # how often the server looks for a dead pipeline stage


class DrainGate(grpc.aio.ServerInterceptor):
    """Counts GenerationService calls in flight; refuses new ones once draining."""

    def __init__(self, metrics: Metrics = NO_METRICS) -> None:
        self.draining = False
        self._metrics = metrics
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if not rpc.gated(details.method):
            return handler  # health, reflection and Abort keep answering while draining
        return wrap_handler(handler, self._admit)

    @contextlib.asynccontextmanager
    async def _admit(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        if self.draining:
            self._metrics.observe_rejected("draining")
            raise Unavailable("server is draining")
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no call is in flight; False when ``timeout`` seconds pass first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


class Server:
    """A started pipeline behind a grpc.aio server (must be used on one event loop)."""

    def __init__(
        self,
        pipeline: Pipeline,
        config: ServerConfig | None = None,
        metrics: Metrics = NO_METRICS,
        tokenizer_path: str = "",  # what the worker protocol's GetModelInfo reports
        tracing: Tracing | None = None,  # OpenTelemetry spans; None = off
    ) -> None:
        self.config = config or ServerConfig()
        self.tokenizer_path = tokenizer_path
        self._tracing = tracing
        self.port = 0  # the bound gRPC port, known after start()
        self.metrics_port: int | None = None  # the bound metrics port, when serving metrics
        self._pipeline = pipeline
        self._metrics = metrics
        self._gate = DrainGate(metrics)
        self._security = ServerSecurity(self.config.security)
        self._health = health.aio.HealthServicer()
        self._http: WSGIServer | None = None
        self._hurry = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self.failed = asyncio.Event()  # set when a pipeline stage died: serve() then stops
        self._watch: asyncio.Task | None = None
        # StartProfile/StopProfile write here; without --profile-dir they are refused.
        profile_dir = self.config.profile_dir
        self._profiler = ThreadProfiler(profile_dir) if profile_dir else None

    def serving(self) -> bool:
        """What every health answer reports: not draining, and a live pipeline."""
        return not self._gate.draining and self._pipeline.healthy

    async def start(self) -> None:
        """Bind, start answering, report SERVING, and start the metrics endpoint."""
        if self._profiler is not None:  # an unusable --profile-dir stops start-up
            self._profiler.directory.mkdir(parents=True, exist_ok=True)
        self._pipeline.kv_events.attach(asyncio.get_running_loop())
        self._server = self._grpc_server()
        self.port = self._security.bind(self._server, self.config.address)
        await self._server.start()
        for service in ("", SERVICE_NAME, WORKER_SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._start_metrics()
        self._watch = asyncio.create_task(self._watch_pipeline())
        log.info("serving", address=self.config.address, port=self.port)
        self._security.log_posture(self.config.host)

    def _grpc_server(self) -> grpc.aio.Server:
        """The server with its interceptors and every service added, not yet bound."""
        # First = outermost: auth (when on) before anything else runs, so a refused call
        # never reaches tracing or a handler; the span of a call sees the status the
        # mapping gives it.
        interceptors = [StatusInterceptor(), self._gate]
        tracer = None
        if self._tracing is not None:
            interceptors.insert(0, self._tracing.interceptor)
            tracer = self._tracing.requests
        server = grpc.aio.server(
            interceptors=[*self._security.interceptors(self._metrics), *interceptors],
            options=self.config.grpc_options(),  # message size, connection limits, keepalive
        )
        limits, batch = self.config.limits, self.config.max_batch_requests
        api = GenerationServicer(
            self._pipeline, limits, batch, self._metrics, tracer, self.config.isolation
        )
        pb_grpc.add_GenerationServiceServicer_to_server(api, server)
        worker = WorkerServicer(
            self._pipeline,
            self.tokenizer_path,
            self.serving,
            self._metrics,
            tracer,
            isolation=self.config.isolation,
            profiler=self._profiler,
            kv_events=self.config.kv_events,
        )
        worker_grpc.add_VllmEngineServicer_to_server(worker, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, WORKER_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
            server,
        )
        return server

    def _start_metrics(self) -> None:
        if not self._metrics.enabled or self.config.metrics_port < 0:
            return
        self._http = start_http(
            self.config.host,
            self.config.metrics_port,
            self._metrics.registry,
            serving=self.serving,
            tls=self._security.http_tls,
            authorize=self._security.http_authorize,
        )
        self.metrics_port = self._http.server_port

    async def _watch_pipeline(self) -> None:
        while self._pipeline.healthy:
            await asyncio.sleep(PIPELINE_CHECK_S)
        log.error(
            "a pipeline stage stopped: reporting NOT_SERVING and shutting down, so that the "
            "supervisor starts a fresh server"
        )
        await self._health.enter_graceful_shutdown()
        self.failed.set()

    async def drain(self, grace_period: float | None = None) -> None:
        """NOT_SERVING, refuse new calls, let calls in flight finish (bounded), then stop."""
        grace = self.config.grace_period if grace_period is None else grace_period
        await self._health.enter_graceful_shutdown()
        self._gate.draining = True
        log.info("draining", in_flight=self._gate.in_flight, grace_period=grace)
        hurry = asyncio.create_task(self._hurry.wait())
        idle = asyncio.create_task(self._gate.wait_idle(grace))
        await asyncio.wait((hurry, idle), return_when=asyncio.FIRST_COMPLETED)
        hurry.cancel()
        if not (idle.done() and idle.result()):
            idle.cancel()
            log.warning("grace period over, cancelling calls", in_flight=self._gate.in_flight)
        await self.stop()

    def hurry(self) -> None:
        """Cut a drain's grace period short (a second SIGTERM/SIGINT)."""
        self._hurry.set()

    async def stop(self) -> None:
        """Stop at once: calls still open are cancelled (their requests aborted)."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._server is not None:
            await self._server.stop(grace=None)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        log.info("stopped")

    @property
    def draining(self) -> bool:
        return self._gate.draining


async def serve(
    pipeline: Pipeline,
    config: ServerConfig,
    metrics: Metrics = NO_METRICS,
    on_ready: Callable[[Server], None] | None = None,
    tokenizer_path: str = "",
    tracing: Tracing | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (then drain and return 0) or until a pipeline stage dies
    (then drain and return 1)."""
    server = Server(pipeline, config, metrics, tokenizer_path, tracing)
    await server.start()
    signalled = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if signalled.is_set():
            server.hurry()
        signalled.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    if on_ready is not None:
        on_ready(server)
    waits = [asyncio.create_task(signalled.wait()), asyncio.create_task(server.failed.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    await server.drain()
    return 1 if server.failed.is_set() else 0


def run(
    engine_config: EngineConfig,
    pipeline_config: PipelineConfig,
    server_config: ServerConfig,
    on_ready: Callable[[Server], None] | None = None,
    tracing_config: TracingConfig | None = None,
) -> int:
    """Load the engine, start the pipeline, serve until a signal, drain, shut down.

    Returns the exit status: 0 after a signal, 1 when a pipeline stage died."""
    from compute.engine import Engine
    from services.pipeline.pipeline import Pipeline
    from services.telemetry.metrics import Metrics
    from services.telemetry.tracing_config import TracingConfig, start_tracing

    tracing = start_tracing(tracing_config or TracingConfig())  # before the slow model load
    metrics = Metrics()
    engine = Engine(engine_config)
    metrics.set_cache_config(engine.block_size, engine.num_blocks)
    tokenizer_path = _export_tokenizer(engine, server_config.tokenizer_dir)
    pipeline = Pipeline(engine, pipeline_config, metrics)
    pipeline.start()
    try:
        return asyncio.run(
            serve(pipeline, server_config, metrics, on_ready, tokenizer_path, tracing)
        )
    finally:
        pipeline.stop()
        if tracing is not None:
            tracing.shutdown()  # exports the spans still buffered


def _export_tokenizer(engine, directory: str) -> str:
    """Write the tokenizer where gateways read it (GetModelInfo.tokenizer_path); "" if none."""
    import tempfile

    from services.worker.tokenizer_export import export_tokenizer

    if engine.tokenizer is None:  # dummy weights: gateways must be given --tokenizer-path
        return ""
    directory = directory or tempfile.mkdtemp(prefix="headrace-tokenizer-")
    path = export_tokenizer(engine.tokenizer, directory, engine.max_model_len)
    log.info("tokenizer exported", path=str(path.resolve()))
    if not engine.tokenizer.chat_template:
        log.warning(
            "the model has no chat template: chats get INVALID_ARGUMENT here and an error "
            "at gateways; give one with --chat-template FILE"
        )
    return str(path.resolve())
