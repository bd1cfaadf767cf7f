"""headrace replicas behind the real SMG gateway (loopback, the default model).

Two ``headrace serve`` replicas and ``smg launch --policy cache_aware`` in front; the
official ``openai`` SDK talks to the gateway. The tests share one stack and run in
file order: the last ones SIGTERM and then kill replicas. Every wait is bounded; the
stack kills every process it started. Run alone with ``make test-gateway``.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections.abc import Iterator

import grpc
import jsonschema
import pytest

from services.client import client
from services.gen.headrace.v1 import generation_pb2_grpc
from tests.support.gateway_stack import Replica, Stack, served_model, smg_binary, terminate
from tests.support.schemas import PERSON, SCHEMAS, WEATHER_TOOL
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.gateway, pytest.mark.slow]
openai = pytest.importorskip("openai", reason="install the test extras: make setup")
if smg_binary() is None:
    pytest.skip("smg is not installed (make setup installs it)", allow_module_level=True)

CHAT = "What is the capital of France?"
PROMPT = "The capital of France is"
STRUCTURED_ASK = "Describe a person, an order or a place as the format asks."
LONG_PREFIX = " ".join(f"Rule {i}: always answer briefly and politely." for i in range(40))


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[tuple[Stack, list[Replica], str]]:
    workdir = tmp_path_factory.mktemp("gateway")
    tokenizer_dir = str(workdir / "tokenizer")
    with Stack(workdir) as running:
        args = ("--num-blocks", "256", "--max-pending", "3", "--tokenizer-dir", tokenizer_dir)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # load both models at once
            replicas = list(pool.map(lambda _: running.replica(*args), range(2)))
        base = running.gateway(replicas, "--policy", "cache_aware")
        yield running, replicas, base


@pytest.fixture(scope="module")
def sdk(stack) -> tuple[openai.OpenAI, str]:
    _, _, base = stack
    api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
    return api, served_model(base)


def _v1(replica: Replica, **kwargs) -> tuple[list[int], str, int]:
    """Token ids, text and prompt tokens of a greedy headrace.v1 Generate."""
    stub = generation_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(replica.target))
    request = client.generate_request(temperature=0, **kwargs)
    ids, text, prompt_tokens = [], "", 0
    for response in stub.Generate(request, timeout=120):
        if response.HasField("chunk"):
            ids += response.chunk.token_ids
            text += response.chunk.text
        else:
            prompt_tokens = response.complete.usage.prompt_tokens
    return ids, text, prompt_tokens


def _finished(replica: Replica) -> float:
    return sum(
        v for (name, _), v in replica.metrics().items()
        if name == "headrace_requests_finished_total"
    )  # fmt: skip


def test_streamed_chat_equals_headrace_v1(stack, sdk) -> None:
    _, replicas, _ = stack
    api, model = sdk
    stream = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": CHAT}], temperature=0,
        max_tokens=16, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    text, usage = "", None
    for event in stream:
        if event.choices and event.choices[0].delta.content:
            text += event.choices[0].delta.content
        usage = event.usage or usage
    ids, expected, prompt_tokens = _v1(replicas[0], chat=[("user", CHAT)], max_tokens=16)
    assert text == expected and "Paris" in text
    # The gateway tokenized the chat itself (exported tokenizer + template): same prompt ids.
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, len(ids))


def test_streamed_completion_equals_headrace_v1(stack, sdk) -> None:
    _, replicas, _ = stack
    api, model = sdk
    stream = api.completions.create(
        model=model, prompt=PROMPT, temperature=0, max_tokens=12, stream=True
    )
    text = "".join(event.choices[0].text for event in stream if event.choices)
    ids, expected, _ = _v1(replicas[1], prompt=PROMPT, max_tokens=12)
    assert text == expected and len(ids) == 12


def test_stop_strings_end_the_text_as_in_headrace_v1(stack, sdk) -> None:
    _, replicas, _ = stack
    api, model = sdk
    messages = [{"role": "user", "content": CHAT}]
    answer = api.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=16, stop=[" Paris"]
    )
    _, expected, _ = _v1(replicas[0], chat=[("user", CHAT)], max_tokens=16, stop=[" Paris"])
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].finish_reason == "stop" and "Paris" not in expected


def test_n_3_gives_three_choices(stack, sdk) -> None:
    api, model = sdk
    messages = [{"role": "user", "content": "Name a colour."}]
    answer = api.chat.completions.create(
        model=model, messages=messages, n=3, temperature=1.0, seed=5, max_tokens=8
    )
    assert sorted(c.index for c in answer.choices) == [0, 1, 2]
    assert all(c.message.content for c in answer.choices)
    assert answer.usage.completion_tokens >= 3  # the three samples' tokens
    completion = api.completions.create(
        model=model, prompt=PROMPT, n=3, temperature=1.0, seed=5, max_tokens=6
    )
    assert sorted(c.index for c in completion.choices) == [0, 1, 2]
    texts = {c.text for c in completion.choices}
    assert len(texts) > 1  # three samples, each its own stream (seed + index)


def test_n_3_streamed_carries_each_choice_index(stack, sdk) -> None:
    api, model = sdk
    stream = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": CHAT}], n=3, temperature=0,
        max_tokens=8, stream=True,
    )  # fmt: skip
    texts: dict[int, str] = {}
    finished = set()
    for event in stream:
        for choice in event.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert sorted(texts) == [0, 1, 2] and finished == {0, 1, 2}
    assert len(set(texts.values())) == 1 and "Paris" in texts[0]  # greedy: the same answer


def test_min_tokens_on_completions_reaches_the_worker(stack, sdk) -> None:
    # SMG 1.13 forwards min_tokens from /v1/completions (not from chat, nor logit_bias:
    # those are shown over headrace.v1 in test_sampling_api.py).
    api, model = sdk
    answered = (
        "<|im_start|>user\nWhat is 2+2? Answer with one digit.<|im_end|>\n<|im_start|>assistant\n4"
    )
    plain = api.completions.create(model=model, prompt=answered, temperature=0, max_tokens=10)
    assert plain.usage.completion_tokens == 1  # EOS at once
    held = api.completions.create(
        model=model, prompt=answered, temperature=0, max_tokens=10, extra_body={"min_tokens": 6}
    )
    assert held.usage.completion_tokens >= 6


def test_requests_land_on_both_replicas(stack, sdk) -> None:
    _, replicas, _ = stack
    api, model = sdk
    before = [_finished(r) for r in replicas]
    # Distinct prompts share no prefix, so cache_aware sends each to the worker with the
    # smaller prefix tree; long ones make the trees' order flip within a request or two,
    # whatever earlier tests left in them.
    for i in range(8):
        prompt = f"{i}: " + " ".join(f"word{i * 100 + j}" for j in range(60))
        api.completions.create(model=model, prompt=prompt, max_tokens=2)
    after = [_finished(r) for r in replicas]
    assert sum(a - b for a, b in zip(after, before, strict=True)) == 8
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_shared_long_prefix_lands_on_one_replica_with_cache_hits(stack, sdk) -> None:
    _, replicas, _ = stack
    api, model = sdk
    before = [(_finished(r), r.value("headrace_prefix_cache_hit_tokens_total")) for r in replicas]
    for i in range(5):
        api.completions.create(model=model, prompt=f"{LONG_PREFIX} Question {i}:", max_tokens=2)
    after = [(_finished(r), r.value("headrace_prefix_cache_hit_tokens_total")) for r in replicas]
    landed = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    hits = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    assert sorted(landed) == [0, 5], landed
    home = landed.index(5)
    assert hits[home] >= 4 * 256, hits  # the 4 followers reuse most of the ~400-token prefix
    assert hits[1 - home] == 0


def test_client_disconnect_frees_the_worker_kv(stack, sdk) -> None:
    _, replicas, _ = stack
    api, model = sdk
    stream = api.completions.create(
        model=model, prompt="Count slowly:", max_tokens=2000, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for _, _event in zip(range(3), stream, strict=False):
        pass
    assert sum(r.value("vllm:num_requests_running") for r in replicas) == 1
    aborted = sum(
        r.value("headrace_requests_finished_total", finish_reason="abort") for r in replicas
    )
    stream.close()  # the HTTP client goes away; SMG sends Abort(request_id) to the worker

    def freed() -> bool:
        return all(
            r.value("vllm:num_requests_running") == 0 and r.value("vllm:kv_cache_usage_perc") == 0
            for r in replicas
        )

    # 2000 tokens take a minute on this CPU: freed at all means the abort reached the engine.
    elapsed = wait_until(freed, 5.0, "KV freed after the client went away")
    print(f"KV freed {elapsed:.3f} s after the client disconnected")
    now = sum(r.value("headrace_requests_finished_total", finish_reason="abort") for r in replicas)
    assert now == aborted + 1


def test_overload_is_an_http_error_not_a_hang(stack, sdk) -> None:
    _, _, base = stack
    api, model = sdk
    fast = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)

    def one(i: int) -> int:
        try:
            fast.completions.create(
                model=model, prompt=f"Story {i}:", max_tokens=48, extra_body={"ignore_eos": True}
            )
            return 200
        except openai.APIStatusError as exc:
            return exc.status_code

    with concurrent.futures.ThreadPoolExecutor(16) as pool:  # 2 replicas x max-pending 3 = 6
        codes = list(pool.map(one, range(16)))
    assert 200 in codes
    assert {c for c in codes if c != 200} <= {429, 503} and set(codes) != {200}, codes


def _structured(sdk, seed: int, ask: str = STRUCTURED_ASK, temperature=0.7, **kwargs) -> str:
    api, model = sdk
    response = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": ask}], temperature=temperature,
        seed=seed, max_tokens=200, **kwargs,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    return choice.message.content


@pytest.mark.parametrize("name", ["person", "order", "weather_tool"])
def test_response_format_json_schema_validates(sdk, name: str) -> None:
    schema = SCHEMAS[name]
    response_format = {
        "type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True},
    }  # fmt: skip
    seeds = (1,) if name == "order" else (1, 2)  # ORDER's answers are long on one CPU thread
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        contents = list(
            pool.map(lambda s: _structured(sdk, s, response_format=response_format), seeds)
        )
    for content in contents:
        jsonschema.validate(json.loads(content), schema)


def test_response_format_json_object_parses(sdk) -> None:
    # Free JSON lets a 135M model ramble to max_tokens at a high temperature: ask for little.
    ask = "Return a JSON object with the keys city and country, for Paris."
    content = _structured(sdk, 3, ask, 0.3, response_format={"type": "json_object"})
    assert isinstance(json.loads(content), dict)


def test_regex_extra_matches_whole(sdk) -> None:
    pattern = r"(Paris|Lyon|Nice), [A-Z][a-z]{3,9} [0-9]{1,2}"
    for seed in (4, 5):
        content = _structured(sdk, seed, extra_body={"regex": pattern})
        assert re.fullmatch(pattern, content), content


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "The weather forecast for a place",
        "parameters": WEATHER_TOOL,
    },
}  # fmt: skip


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_call_arguments_validate(sdk, tool_choice) -> None:
    api, model = sdk
    response = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
        tools=[WEATHER], tool_choice=tool_choice, temperature=0.5, seed=7, max_tokens=200,
    )  # fmt: skip
    calls = response.choices[0].message.tool_calls
    assert calls, response.choices[0].message
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER_TOOL)


def test_invalid_schema_is_a_4xx_and_the_next_request_is_served(sdk) -> None:
    api, model = sdk
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.APIStatusError) as info:
        api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": CHAT}], max_tokens=8,
            response_format=bad,
        )  # fmt: skip
    assert 400 <= info.value.status_code < 500, info.value
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    jsonschema.validate(json.loads(_structured(sdk, 9, response_format=person)), PERSON)


def test_killed_replica_new_requests_still_succeed(stack, sdk) -> None:
    _, replicas, _ = stack
    api, model = sdk
    replicas[1].process.kill()
    replicas[1].process.wait(timeout=10)
    before = _finished(replicas[0])
    for i in range(4):  # the gateway retries a dead worker's requests on the other
        answer = api.completions.create(model=model, prompt=f"After {i}", max_tokens=2)
        assert answer.choices[0].text
    assert _finished(replicas[0]) - before == 4


def test_sigterm_drains_the_last_replica(stack, sdk) -> None:
    _, replicas, _ = stack
    api, model = sdk
    last = replicas[0]
    stub = generation_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(last.target))
    inflight = stub.Generate(client.generate_request(prompt="Once", max_tokens=40), timeout=120)
    next(inflight)
    assert terminate(last) == 0
    responses = list(inflight)  # the stream in flight ran to its end before the exit
    assert responses[-1].complete.usage.completion_tokens == 40
    with pytest.raises(openai.APIStatusError) as info:  # no worker left: an error, not a hang
        api.completions.create(model=model, prompt="Anyone?", max_tokens=2)
    assert info.value.status_code in (502, 503)
