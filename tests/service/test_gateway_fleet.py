"""Three headrace replicas behind the real SMG, which reaches them only over gRPC.

The gateway runs with the event-driven KV index and no tokenizer path, unable to read any
replica's files (tests/support/fleet_stack.py: their tokenizer directories deleted, and
the gateway in a mount namespace with an empty /tmp where the machine allows one), so
everything it knows comes over the worker protocol: the tokenizer (GetTokenizer), the
replicas' caches (SubscribeKvEvents), their load and their silence (EngineLoad). The tests
share one fleet and run in file order. Run alone with ``make test-gateway``.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import grpc
import pytest

from services.client import client
from services.gen.headrace.v1 import generation_pb2_grpc
from tests.support.fleet_stack import Fleet, FleetReplica, Gateway
from tests.support.gateway_stack import served_model, smg_binary
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.gateway, pytest.mark.slow]
openai = pytest.importorskip("openai", reason="install the test extras: make setup")
if smg_binary() is None:
    pytest.skip("smg is not installed (make setup installs it)", allow_module_level=True)

CHAT = "What is the capital of France?"
LONG_PREFIX = " ".join(f"Rule {i}: answer briefly, politely and in English." for i in range(30))
CLIENT_DEADLINE_S = 60.0  # the in-flight request's, while its replica is stalled


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[tuple[Fleet, list[FleetReplica], Gateway]]:
    with Fleet(tmp_path_factory.mktemp("fleet")) as running:
        args = ("--weights", "quantized-int8", "--num-blocks", "256", "--max-pending", "8")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # load the models at once
            replicas = list(pool.map(lambda _: running.replica(*args), range(3)))
        gateway = running.gateway(replicas, "--policy", "cache_aware", "--kv-index", "positional")
        yield running, replicas, gateway


@pytest.fixture(scope="module")
def sdk(fleet) -> tuple[openai.OpenAI, str]:
    _, _, gateway = fleet
    api = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", timeout=120, max_retries=0)
    return api, served_model(gateway.base)


def complete(sdk, prompt: str, max_tokens: int = 2, timeout: float = 120.0) -> tuple[str, int]:
    """(the worker the gateway routed to, cached prompt tokens) of one completion."""
    api, model = sdk
    raw = api.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, timeout=timeout,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    usage = raw.parse().usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return raw.headers["x-smg-routed-worker-id"], cached or 0


def test_chats_are_served_with_the_tokenizer_fetched_from_the_workers(fleet, sdk) -> None:
    _, replicas, gateway = fleet
    api, model = sdk
    answer = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": CHAT}], temperature=0, max_tokens=12
    )
    stub = generation_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(replicas[0].target))
    request = client.generate_request(chat=[("user", CHAT)], temperature=0, max_tokens=12)
    expected = "".join(r.chunk.text for r in stub.Generate(request, timeout=120))
    assert answer.choices[0].message.content == expected and expected  # same ids, same text
    print(f"gateway in its own mount namespace: {gateway.isolated}")


def test_kv_events_send_a_shared_prefix_where_its_blocks_are(fleet, sdk) -> None:
    _, replicas, gateway = fleet
    hits_before = gateway.metric("smg_cache_aware_policy_branch_total", branch="event_hit")
    routed = [complete(sdk, f"{LONG_PREFIX} Question {i}:") for i in range(5)]
    assert len({worker for worker, _ in routed}) == 1, routed
    assert routed[0][1] == 0 and all(cached >= 256 for _, cached in routed[1:]), routed
    assert gateway.metric("smg_kv_event_blocks_total", op="stored") > 0
    assert gateway.metric("smg_cache_aware_policy_branch_total", branch="event_hit") > hits_before
    home = next(r for r in replicas if r.url == routed[0][0])
    assert gateway.metric("smg_kv_index_blocks", worker=home.url) > 0


def test_flush_cache_through_the_admin_api_empties_every_cache(fleet, sdk) -> None:
    _, replicas, gateway = fleet
    answer = gateway.post("/flush_cache")
    assert answer["status"] == "success" and answer["workers_flushed"] == 3, answer
    wait_until(
        lambda: all(gateway.metric("smg_kv_index_blocks", worker=r.url) == 0 for r in replicas),
        30,
        "the gateway's index emptied by the removals",
    )
    assert gateway.metric("smg_kv_event_blocks_total", op="removed") > 0
    _, cached = complete(sdk, f"{LONG_PREFIX} Question 0:")
    assert cached == 0


def test_a_stalled_replica_is_vetoed_through_its_silence_and_taken_back(fleet, sdk) -> None:
    _, replicas, gateway = fleet
    victim = replicas[1]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        in_flight = None
        for k in range(12):  # a long request that lands on the victim
            future = pool.submit(
                complete, sdk, f"Story {k}: once upon a time", 160, CLIENT_DEADLINE_S
            )
            wait_until(lambda: sum(r.value("vllm:num_requests_running") for r in replicas) >= 1, 30)
            if victim.value("vllm:num_requests_running") >= 1:
                in_flight = future
                break
            future.result()
        assert in_flight is not None, "no request landed on the victim"
        victim.stall()
        stalled_at = time.monotonic()
        wedged = {"worker": victim.url, "reason": "wedged"}
        wait_until(
            lambda: gateway.metric("smg_worker_stalled", **wedged) == 1,
            CLIENT_DEADLINE_S / 2,
            "the gateway vetoes the silent replica",
        )
        vetoed_after = time.monotonic() - stalled_at
        assert not in_flight.done()  # before its client's deadline
        routed = [complete(sdk, f"Elsewhere {i}: " + "x " * 20)[0] for i in range(6)]
        assert victim.url not in routed, routed
        victim.resume()
        worker, _ = in_flight.result()  # it finishes after all, within its deadline
        assert worker == victim.url
    print(f"vetoed {vetoed_after:.1f} s after the step loop stopped")
    wait_until(lambda: gateway.metric("smg_worker_stalled", **wedged) == 0, 30, "taken back")
    routed = [complete(sdk, f"Back {i}: " + "y " * 20)[0] for i in range(9)]
    assert victim.url in routed, routed


def test_a_restarted_replica_is_resynced_not_taken_for_its_old_self(fleet, sdk) -> None:
    _, replicas, gateway = fleet
    restarted = replicas[2]
    for i in range(3):  # give it blocks the gateway indexes
        complete(sdk, f"Restart {i}: " + "z " * 40)
    resyncs = gateway.metric("smg_kv_event_resyncs_total", worker=restarted.url)
    restarted.restart()
    wait_until(
        lambda: gateway.metric("smg_kv_event_resyncs_total", worker=restarted.url) > resyncs,
        60,
        "the gateway resyncs the restarted replica",
    )
    assert gateway.metric("smg_kv_index_blocks", worker=restarted.url) == 0
    complete(sdk, "After the restart: hello")  # and the fleet serves on
