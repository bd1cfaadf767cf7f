"""The vLLM worker protocol (vllm.grpc.engine.VllmEngine) in-process, over the fake engine.

Same server, pipeline, drain gate and status mapping as headrace.v1 (tests/service/test_server.py);
these tests pin what a gateway sees: token ids in and out, the protocol's defaults,
Abort by request id ending the stream, refusals naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from services.pipeline.pipeline import PipelineConfig
from services.worker.convert import sampling_params
from services.worker.servicer import SERVICE_NAME
from services.worker.tokenizer_export import export_tokenizer
from tests.conftest import SCRIPT_TEXT, RunningServer, fake_engine
from tests.support.waiting import wait_until

TIMEOUT = 30


def _stub(running: RunningServer) -> pb_grpc.VllmEngineStub:
    return pb_grpc.VllmEngineStub(running.channel())


def _request(request_id: str = "r1", ids=(1, 2, 3), stream: bool = True, **sampling):
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=list(ids)),
        sampling_params=pb.SamplingParams(**sampling),
        stream=stream,
    )


def _error(call: Callable) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_streamed_token_ids_and_final_complete(served: RunningServer) -> None:
    stub = _stub(served)
    responses = list(stub.Generate(_request(max_tokens=5, temperature=0), timeout=TIMEOUT))
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    assert [r.WhichOneof("response") for r in responses][-1] == "complete"
    ids = [t for c in chunks for t in c.token_ids]
    tokenizer = served.engine.tokenizer
    assert ids == tokenizer.encode(SCRIPT_TEXT)[:5]
    assert chunks[-1].completion_tokens == 5 and chunks[0].prompt_tokens == 3
    done = responses[-1].complete
    assert (done.finish_reason, done.completion_tokens, done.prompt_tokens) == ("length", 5, 3)
    assert list(done.output_ids) == []  # streamed: every token went out in a chunk


def test_unary_returns_every_token_in_the_complete(served: RunningServer) -> None:
    responses = list(_stub(served).Generate(_request(stream=False, max_tokens=4), timeout=TIMEOUT))
    assert len(responses) == 1
    done = responses[0].complete
    assert list(done.output_ids) == served.engine.tokenizer.encode(SCRIPT_TEXT)[:4]


def test_n_samples_answer_in_one_stream_with_their_index(served: RunningServer) -> None:
    expected = served.engine.tokenizer.encode(SCRIPT_TEXT)[:4]
    streamed = list(_stub(served).Generate(_request(n=3, max_tokens=4), timeout=TIMEOUT))
    completes = [r.complete for r in streamed if r.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1, 2]
    assert all(c.completion_tokens == 4 for c in completes)
    for i in range(3):
        ids = [
            t
            for r in streamed
            if r.HasField("chunk") and r.chunk.index == i
            for t in r.chunk.token_ids
        ]
        assert ids == expected
    unary = list(_stub(served).Generate(_request(n=2, max_tokens=4, stream=False), timeout=TIMEOUT))
    assert sorted(r.complete.index for r in unary) == [0, 1]
    assert all(list(r.complete.output_ids) == expected for r in unary)


def test_logit_bias_and_min_tokens_reach_the_sampling_params() -> None:
    params = sampling_params(_request(logit_bias={9: -100.0, 3: 2.5}, min_tokens=4))
    assert params.logit_bias == ((3, 2.5), (9, -100.0))
    assert params.min_tokens == 4


def test_abort_ends_every_sample(serve) -> None:
    running = serve(fake_engine(step_delay=0.01))
    stub = _stub(running)
    stream = stub.Generate(_request("gw-n", n=2, max_tokens=1000), timeout=TIMEOUT)
    next(stream)
    stub.Abort(pb.AbortRequest(request_ids=["gw-n"]), timeout=TIMEOUT)
    rest = [r.complete for r in stream if r.HasField("complete")]
    assert sorted((c.index, c.finish_reason) for c in rest) == [(0, "abort"), (1, "abort")]
    wait_until(lambda: running.pipeline.num_pending == 0 and not running.engine.has_unfinished())
    assert sum(r.startswith("gw-n#") for r in running.engine.aborted) == 2


def test_stop_string_is_reported_as_matched(served: RunningServer) -> None:
    responses = list(_stub(served).Generate(_request(stop=["fox"]), timeout=TIMEOUT))
    done = responses[-1].complete
    assert (done.finish_reason, done.matched_stop_str) == ("stop", "fox")


def test_protocol_defaults_and_optional_fields() -> None:
    defaults = sampling_params(_request())
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (1.0, 1.0, -1)
    assert (defaults.repetition_penalty, defaults.max_tokens, defaults.seed) == (1.0, None, None)
    greedy = sampling_params(_request(temperature=0, seed=0, max_tokens=7, logprobs=2))
    assert (greedy.temperature, greedy.seed, greedy.max_tokens) == (0.0, 0, 7)
    assert greedy.logprobs and greedy.top_logprobs == 2


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_request(min_tokens=3, max_tokens=2), "sampling_params.min_tokens"),
        (_request(n=1000), "sampling_params.n"),
        (_request(prompt_logprobs=1), "sampling_params.prompt_logprobs"),
        (_request(logit_bias={5: 100.5}), "sampling_params.logit_bias"),
        (_request(logit_bias={-1: 1.0}), "sampling_params.logit_bias"),
        (_request(logit_bias={60000: 1.0}), "sampling_params.logit_bias"),
        (_request(truncate_prompt_tokens=4), "sampling_params.truncate_prompt_tokens"),
        (_request(json_schema="{not json"), "sampling_params.json_schema"),
        (_request(regex="a(b"), "sampling_params.regex"),
        (_request(structural_tag="{}"), "sampling_params.structural_tag"),
        (_request(json_object=False), "sampling_params.json_object"),
        (_request(logprobs=-1), "sampling_params.logprobs"),
        (_request(top_p=1.5), "sampling_params.top_p"),
        (_request(temperature=-1), "sampling_params.temperature"),
        (_request(ids=()), "tokenized.input_ids"),
        (_request(request_id=""), "request_id"),
        (_request(ids=(10**6,)), "tokenized.input_ids"),
        (_request(max_tokens=10**6), "sampling_params.max_tokens"),
        (pb.GenerateRequest(request_id="x"), "input"),
    ],
)
def test_what_headrace_cannot_do_is_invalid_argument_naming_the_field(
    served: RunningServer, request_, field: str
) -> None:
    error = _error(lambda: list(_stub(served).Generate(request_, timeout=TIMEOUT)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert field in error.details(), error.details()
    assert served.pipeline.num_pending == 0


def test_abort_by_request_id_ends_the_stream_and_frees_the_request(serve) -> None:
    running = serve(fake_engine(step_delay=0.01))
    stub = _stub(running)
    stream = stub.Generate(_request("gw-1", max_tokens=1000), timeout=TIMEOUT)
    next(stream)
    stub.Abort(pb.AbortRequest(request_ids=["gw-1", "unknown"]), timeout=TIMEOUT)
    rest = list(stream)  # the gateway keeps reading after Abort: the stream must end
    assert rest[-1].complete.finish_reason == "abort"
    wait_until(lambda: any(r.startswith("gw-1#") for r in running.engine.aborted))
    wait_until(lambda: running.pipeline.num_pending == 0 and not running.engine.has_unfinished())


def test_stream_cancellation_aborts_the_request(serve) -> None:
    running = serve(fake_engine(step_delay=0.01))
    stream = _stub(running).Generate(_request("gone", max_tokens=1000), timeout=TIMEOUT)
    next(stream)
    stream.cancel()
    wait_until(lambda: any(r.startswith("gone#") for r in running.engine.aborted))
    wait_until(lambda: running.pipeline.num_pending == 0)


def test_overload_is_resource_exhausted(serve) -> None:
    running = serve(fake_engine(step_delay=0.02), pipeline_config=PipelineConfig(max_pending=1))
    stub = _stub(running)
    busy = stub.Generate(_request("a", max_tokens=500), timeout=TIMEOUT)
    next(busy)
    error = _error(lambda: list(stub.Generate(_request("b"), timeout=TIMEOUT)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    busy.cancel()


def test_drain_refuses_generate_and_reports_unhealthy(serve) -> None:
    running = serve(fake_engine(step_delay=0.01))
    stub = _stub(running)
    stream = stub.Generate(_request("inflight", max_tokens=40), timeout=TIMEOUT)
    next(stream)
    drained = running.drain(grace_period=20)
    wait_until(lambda: running.server.draining)
    assert not stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT).healthy
    health = health_pb2_grpc.HealthStub(running.channel())
    status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=TIMEOUT)
    assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
    error = _error(lambda: list(stub.Generate(_request("new"), timeout=TIMEOUT)))
    assert (error.code(), error.details()) == (grpc.StatusCode.UNAVAILABLE, "server is draining")
    assert list(stream)[-1].complete.completion_tokens == 40  # in flight: runs to its end
    drained.result(timeout=TIMEOUT)


def test_info_and_loads(served: RunningServer) -> None:
    stub = _stub(served)
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT).healthy
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
    model = served.pipeline.model_info()
    assert (info.served_model_name, info.vocab_size) == (model.model_name, model.vocab_size)
    assert info.max_context_length == model.max_model_len and info.is_generation
    assert info.model_type == model.architecture and list(info.architectures) == [
        model.architecture
    ]
    server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT)
    assert server.server_type == "vllm-grpc" and server.block_size == model.block_size
    assert server.kv_cache_dtype == model.kv_cache_dtype == "float32"  # never "auto"
    loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=TIMEOUT)
    assert loads.dp_rank_count == 1 and loads.loads[0].num_running_reqs == 0
    error = _error(lambda: stub.GetLoads(pb.GetLoadsRequest(dp_rank=1), timeout=TIMEOUT))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "dp_rank" in error.details()


def test_exported_tokenizer_loads_in_transformers_with_the_same_ids(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tests.support.fake_engine import smollm2_tokenizer

    ours = smollm2_tokenizer()
    export_tokenizer(ours, tmp_path, 2048)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    chat = [{"role": "user", "content": "What is the capital of France? Ünïcödé 123"}]
    expected = ours.encode(ours.apply_chat_template(chat, add_generation_prompt=True))
    got = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    got = got["input_ids"] if isinstance(got, dict) or hasattr(got, "keys") else got
    assert list(got) == expected
    assert theirs.encode("hello world 42", add_special_tokens=True) == ours.encode("hello world 42")


def test_rpcs_headrace_lacks_are_unimplemented_not_internal(served: RunningServer) -> None:
    stub = _stub(served)
    error = _error(lambda: stub.Embed(pb.EmbedRequest(), timeout=TIMEOUT))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED


def test_vllm_metric_aliases_mirror_the_headrace_gauges() -> None:
    from services.telemetry.metrics import Metrics

    metrics = Metrics()
    metrics.set_cache_config(16, 512)
    stats = dataclasses.replace(fake_engine().stats(), num_running=3, num_waiting=2, kv_usage=0.25)
    metrics.observe_engine_stats(stats)
    value = metrics.registry.get_sample_value
    assert value("vllm:num_requests_running") == value("headrace_requests_running") == 3
    assert value("vllm:num_requests_waiting") == value("headrace_requests_waiting") == 2
    assert value("vllm:kv_cache_usage_perc") == value("headrace_kv_cache_usage_ratio") == 0.25
    labels = {"block_size": "16", "num_gpu_blocks": "512"}
    assert value("vllm:cache_config_info", labels) == 1


@pytest.mark.slow
def test_export_tokenizer_command_writes_what_the_gateway_loads(tmp_path: Path) -> None:
    from services.cli import cli
    from services.worker.tokenizer_export import FILES

    assert cli.main(["export-tokenizer", str(tmp_path / "tok")]) == 0
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == sorted(FILES)
