"""Shared service-test fixtures: an in-process gRPC server on an ephemeral loopback port.

The server runs on its own event loop in a background thread, so tests stay plain
synchronous functions that talk to it through ordinary (blocking) grpc channels.
Behind it is the real Pipeline over tests/support/fake_engine.py's FakeEngine (with the real
SmolLM2 tokenizer), or over the real engine for the tests that need KV accounting.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import pytest
import structlog
import torch

from services.server.server_config import ServerConfig

if TYPE_CHECKING:  # imported when used, so that a broken service never breaks collection
    from services.gen.headrace.v1 import generation_pb2_grpc
    from services.pipeline.pipeline import Pipeline, PipelineConfig
    from services.server.server import Server
    from services.telemetry.metrics import Metrics
    from tests.support.fake_engine import FakeEngine

_TORCH_THREADS = torch.get_num_threads()  # torch's own default, before any test changes it


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """An Engine built with ``num_threads`` (or a benchmark's ``--threads``) sets torch's
    thread count for the whole process: put it back after every test, so that one test's
    setting never slows (or changes the numerics of) every test after it."""
    yield
    if torch.get_num_threads() != _TORCH_THREADS:
        torch.set_num_threads(_TORCH_THREADS)


# What the fake engine "generates", cycled: whole words, so chunks are readable text.
SCRIPT_TEXT = " the quick brown fox jumps over the lazy dog"


@dataclass
class RunningServer:
    """A started Server on a background loop, the pipeline behind it, and ways to reach it."""

    server: Server
    loop: asyncio.AbstractEventLoop
    pipeline: Pipeline
    engine: Any  # FakeEngine or compute.engine.Engine
    metrics: Metrics
    offline_reference: Any = None  # what a test precomputed on the engine, if anything

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def stub(self) -> generation_pb2_grpc.GenerationServiceStub:
        from services.gen.headrace.v1 import generation_pb2_grpc

        return generation_pb2_grpc.GenerationServiceStub(self.channel())

    def drain(self, grace_period: float | None = None) -> Future:
        """Start a drain; the returned future resolves once the server has stopped."""
        return asyncio.run_coroutine_threadsafe(self.server.drain(grace_period), self.loop)


@contextlib.contextmanager
def running_server(
    engine: Any,
    config: ServerConfig | None = None,
    pipeline_config: PipelineConfig | None = None,
    tracing: Any = None,  # a services.telemetry.tracing.Tracing, or None (off)
) -> Iterator[RunningServer]:
    """Pipeline + Server around ``engine``, started; stopped and joined on exit."""
    from services.pipeline.pipeline import Pipeline, PipelineConfig
    from services.server.server import Server
    from services.telemetry.metrics import Metrics

    config = config or ServerConfig(host="127.0.0.1", port=0, metrics_port=-1)
    metrics = Metrics()
    pipeline = Pipeline(engine, pipeline_config or PipelineConfig(), metrics)
    pipeline.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-grpc-server", daemon=True)
    thread.start()

    async def start() -> Server:
        server = Server(pipeline, config, metrics, tracing=tracing)
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    try:
        yield RunningServer(server, loop, pipeline, engine, metrics)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=30)
        pipeline.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


def fake_engine(step_delay: float = 0.001, **kwargs: Any) -> FakeEngine:
    """A FakeEngine with the real SmolLM2 tokenizer that "generates" SCRIPT_TEXT, cycled."""
    from tests.support.fake_engine import FakeEngine, smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    script = tokenizer.encode(SCRIPT_TEXT)
    return FakeEngine(tokenizer, script, step_delay=step_delay, **kwargs)


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    """CLI tests configure structlog globally; give every test the defaults back."""
    yield
    structlog.reset_defaults()


@pytest.fixture
def serve() -> Iterator[Callable[..., RunningServer]]:
    """A factory: ``serve(engine=..., config=..., pipeline_config=...)``, torn down after."""
    with contextlib.ExitStack() as stack:

        def make(
            engine: Any = None,
            config: ServerConfig | None = None,
            pipeline_config: PipelineConfig | None = None,
        ) -> RunningServer:
            engine = engine if engine is not None else fake_engine()
            return stack.enter_context(running_server(engine, config, pipeline_config))

        yield make


@pytest.fixture
def served(serve: Callable[..., RunningServer]) -> RunningServer:
    """A server over a fast FakeEngine."""
    return serve()
