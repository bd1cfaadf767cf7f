"""The bundled client (``headrace generate/info/health``): blocking calls over one channel.

``generate_request`` builds a GenerateRequest from plain arguments; ``Client``
sends it to a server; ``OfflineClient`` runs the same request through an
in-process engine and pipeline, yielding the same responses, for use without
a server; ``print_responses`` renders either stream for the terminal.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api import convert
from services.client.client_security import ClientSecurity
from services.gen.headrace.v1 import generation_pb2 as pb
from services.gen.headrace.v1 import generation_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from compute.core.config import EngineConfig
    from services.pipeline.pipeline import PipelineConfig

DEFAULT_SERVER = "localhost:50051"
# Keepalive pings every 10 s keep long streams alive through proxies and NATs; the
# server accepts pings that often (services/server/connection_config.py CLIENT_PING_OPTIONS).
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
]


def generate_request(
    prompt: str | None = None,
    *,
    chat: Sequence[tuple[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    max_tokens: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    request_id: str = "",
    n: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest for one of prompt / chat ((role, content) pairs) / token_ids."""
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    request = pb.GenerateRequest(
        request_id=request_id,
        sampling=pb.SamplingParams(
            **{k: v for k, v in sampling.items() if v is not None}, logit_bias=logit_bias
        ),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, stop=stop, min_tokens=min_tokens),
        n=n,
    )
    if prompt is not None:
        request.prompt = prompt
    elif chat is not None:
        messages = [pb.ChatMessage(role=role, content=content) for role, content in chat]
        request.chat.CopyFrom(pb.Chat(messages=messages))
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    return request


class Client:
    """A GenerationService client on one channel; use as a context manager."""

    def __init__(
        self,
        target: str = DEFAULT_SERVER,
        timeout: float | None = None,
        security: ClientSecurity | None = None,  # TLS and token; default plaintext, none
    ) -> None:
        security = security or ClientSecurity()
        self._channel = security.channel(target, CHANNEL_OPTIONS)
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._call = {"timeout": timeout, "metadata": security.metadata}

    def generate(self, request: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        """The response stream; stop iterating (or call .cancel()) to abort the request."""
        return self._stub.Generate(request, **self._call)

    def generate_batch(self, requests: Sequence[pb.GenerateRequest]) -> Iterator:
        return self._stub.GenerateBatch(pb.GenerateBatchRequest(requests=requests), **self._call)

    def tokenize(self, prompt: str) -> pb.TokenizeResponse:
        return self._stub.Tokenize(pb.TokenizeRequest(prompt=prompt), **self._call)

    def model_info(self) -> pb.GetModelInfoResponse:
        return self._stub.GetModelInfo(pb.GetModelInfoRequest(), **self._call)

    def health(self, service: str = "") -> str:
        """The grpc.health.v1 status name of ``service`` ("" = the whole server)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        request = health_pb2.HealthCheckRequest(service=service)
        response = stub.Check(request, timeout=self._call["timeout"] or 5.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OfflineClient:
    """Client.generate without a server: the engine and pipeline run in this process."""

    def __init__(self, engine_config: EngineConfig, pipeline_config: PipelineConfig) -> None:
        from compute.engine import Engine  # torch and the model load only when asked
        from services.pipeline.pipeline import Pipeline

        self._runner = asyncio.Runner()
        self._pipeline = Pipeline(Engine(engine_config), pipeline_config)
        self._pipeline.start()

    def generate(self, request: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        """Same responses as Client.generate; errors raise ``RequestError``."""
        inp = convert.to_input(request, request.request_id or str(uuid.uuid4()))
        events = self._pipeline.generate(inp)
        try:
            while True:
                try:
                    event = self._runner.run(_next(events))
                except StopAsyncIteration:
                    return
                yield pb.GenerateResponse(request_id=inp.request_id, **convert.event_fields(event))
        finally:
            self._runner.run(_close(events))

    def model_info(self) -> pb.GetModelInfoResponse:
        return convert.model_info_to_pb(self._pipeline.model_info())

    def close(self) -> None:
        self._pipeline.stop()
        self._runner.close()

    def __enter__(self) -> OfflineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def print_responses(responses: Iterable[pb.GenerateResponse], stream: bool, n: int = 1) -> None:
    """Text to stdout (as it comes when streaming), a one-line summary to stderr. With
    n > 1 the samples' chunks interleave, so each sample is printed whole once the call
    ends, after a ``[sample i]`` line, with its own summary."""
    if n > 1:
        _print_samples(responses)
        return
    parts, complete = [], None
    for response in responses:
        if response.HasField("complete"):
            complete = response.complete
        elif stream:
            sys.stdout.write(response.chunk.text)
            sys.stdout.flush()
        else:
            parts.append(response.chunk.text)
    sys.stdout.write("".join(parts) + "\n")
    sys.stdout.flush()
    if complete is not None:
        print(_summary(complete), file=sys.stderr)


def _print_samples(responses: Iterable[pb.GenerateResponse]) -> None:
    parts: dict[int, list[str]] = {}
    completes: dict[int, pb.Complete] = {}
    for response in responses:
        if response.HasField("complete"):
            completes[response.complete.sample_index] = response.complete
        else:
            parts.setdefault(response.chunk.sample_index, []).append(response.chunk.text)
    for index in sorted(parts.keys() | completes.keys()):
        sys.stdout.write(f"[sample {index}]\n" + "".join(parts.get(index, ())) + "\n")
        sys.stdout.flush()
        if index in completes:
            print(f"sample {index}: {_summary(completes[index])}", file=sys.stderr)


def _summary(complete: pb.Complete) -> str:
    usage, timing = complete.usage, complete.timing
    reason = pb.FinishReason.Name(complete.finish_reason).removeprefix("FINISH_REASON_")
    return (
        f"[{reason.lower()}; {usage.prompt_tokens} prompt + {usage.completion_tokens} "
        f"completion tokens ({usage.cached_prompt_tokens} cached); "
        f"ttft {timing.time_to_first_token_seconds:.3f} s, total {timing.total_seconds:.3f} s]"
    )


# asyncio.Runner.run takes coroutines only, not the awaitables anext()/aclose() return.
async def _next(events: AsyncIterator) -> object:
    return await anext(events)


async def _close(events: AsyncGenerator) -> None:
    await events.aclose()
