"""Prefix-aware routing through SMG: round robin vs cache_aware on its approximate tree vs
cache_aware on the replicas' KV events, with one replica restarted midway.

Three headrace replicas behind ``smg launch``, which reaches them only over gRPC
(tests/support/fleet_stack.py: no tokenizer path, the replicas' files out of its sight,
so it fetches the tokenizer with GetTokenizer). The workload is multi-tenant chat: 16
long system prompts (``--prefix-words``), each followed by short user turns, sent in the
order prompt 0, 1, ..., 15, 0, 1, ... so that round robin over 3 replicas sends every
prompt to every replica (16 = 1 mod 3), with ``--concurrency`` in flight. Each replica's KV
cache (``--num-blocks``) holds about a third of the prompts: a router that keeps each
prompt on one replica can serve its turns from the cache; one that spreads them cannot.
Halfway through, the client pauses, replica B is restarted (its cache is empty after),
and the second half follows: the approximate tree still believes B holds its prompts,
the event-driven index was told B's cache is empty.

    round_robin  --policy round_robin                         (replicas with KV events)
    tree         --policy cache_aware, replicas run --no-kv-events: SMG's own radix tree
    events       --policy cache_aware --kv-index positional   (replicas with KV events)

Two replica sets (events on / off) are loaded once; before each run every replica's
cache is flushed (FlushCache) and a fresh gateway starts, so every run starts cold. The
systems alternate (A B C A B C ...). Per run: prefix-cache hit rate (cached prompt tokens
/ prompt tokens, from each response's usage), TTFT mean and p99, requests/s over the
time requests were in flight, and, for the prompts whose home was B before the restart,
where their turns went after it and whether they hit.

    .venv/bin/python -m bench.kv_routing --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import openai
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as worker_grpc

from bench.common import bar_panel, load_average, new_figure, publish, save_figure
from services.bench.stats import percentile
from tests.support.fleet_stack import Fleet, FleetReplica
from tests.support.gateway_stack import served_model
from tests.support.waiting import wait_until

SYSTEMS = {
    "round_robin": ("events", ("--policy", "round_robin")),
    "tree": ("no_events", ("--policy", "cache_aware")),
    "events": ("events", ("--policy", "cache_aware", "--kv-index", "positional")),
}
TOPICS = ("billing", "shipping", "returns", "warranty", "accounts", "security", "pricing", "travel")


def system_prompt(tenant: int, words: int) -> str:
    """A long, distinct system prompt per tenant (its rules numbered and worded apart)."""
    rules = [
        f"Rule {j}: for {TOPICS[(tenant + j) % len(TOPICS)]} questions from customers of "
        f"company {tenant}, answer in {j % 3 + 1} short sentences and cite policy {tenant}-{j}."
        for j in range(words // 20 + 1)
    ]
    head = f"You are the support assistant of company number {tenant}. "
    return head + " ".join(rules)


def workload(args: argparse.Namespace) -> list[tuple[int, list[dict]]]:
    """(tenant, chat messages) in sending order: tenant k % prompts for request k."""
    systems = [system_prompt(t, args.prefix_words) for t in range(args.prompts)]
    items = []
    for k in range(args.prompts * args.turns):
        tenant = k % args.prompts
        question = f"Question {k // args.prompts}: what does rule {k % 7} mean for my order?"
        messages = [
            {"role": "system", "content": systems[tenant]},
            {"role": "user", "content": question},
        ]
        items.append((tenant, messages))
    return items


async def send(api: openai.AsyncOpenAI, model: str, messages: list[dict], args) -> dict:
    """One streamed chat: where it went, TTFT, and its usage."""
    sent = time.perf_counter()
    raw = await api.chat.completions.with_raw_response.create(
        model=model, messages=messages, temperature=0, max_tokens=args.max_tokens,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    first, usage = None, None
    async for event in raw.parse():
        if first is None and event.choices and event.choices[0].delta.content:
            first = time.perf_counter()
        usage = event.usage or usage
    done = time.perf_counter()
    details = usage.prompt_tokens_details
    return {
        "worker": raw.headers.get("x-smg-routed-worker-id"),
        "ttft_s": (first or done) - sent,
        "e2e_s": done - sent,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": (details.cached_tokens if details else 0) or 0,
        "completion_tokens": usage.completion_tokens,
    }


async def phase(base: str, items: list[tuple[int, list[dict]]], args) -> tuple[list[dict], float]:
    """Send ``items`` in order with ``args.concurrency`` in flight; (records, wall seconds)."""
    api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=600, max_retries=0)
    model = served_model(base)
    queue: asyncio.Queue = asyncio.Queue()
    for index, item in enumerate(items):
        queue.put_nowait((index, item))
    records: list[dict] = [{} for _ in items]

    async def client() -> None:
        while not queue.empty():
            index, (tenant, messages) = queue.get_nowait()
            records[index] = {"tenant": tenant, **await send(api, model, messages, args)}

    start = time.perf_counter()
    try:
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
    finally:
        await api.close()
    return records, time.perf_counter() - start


def flush(replicas: list[FleetReplica]) -> None:
    for replica in replicas:
        with grpc.insecure_channel(replica.target) as channel:
            worker_grpc.VllmEngineStub(channel).FlushCache(
                common_pb2.FlushCacheRequest(), timeout=60
            )


def run_system(fleet: Fleet, name: str, replicas: list[FleetReplica], args) -> dict:
    """One cold run: a fresh gateway, half the workload, B restarted, the other half."""
    flush(replicas)
    gateway = fleet.gateway(replicas, *SYSTEMS[name][1])
    items = workload(args)
    half = len(items) // 2
    try:
        before, wall_before = asyncio.run(phase(gateway.base, items[:half], args))
        restarted = replicas[1]
        restarted.restart()
        wait_until(
            lambda: gateway.metric("smg_worker_health", worker=restarted.url) == 1,
            120,
            "the gateway routes to the restarted replica again",
        )
        after, wall_after = asyncio.run(phase(gateway.base, items[half:], args))
        branches = _gateway_branches(gateway)
    finally:
        fleet.stop_gateway(gateway)
    summary = summarize(before, after, wall_before + wall_after, restarted.url, gateway.isolated)
    return {**summary, "gateway_policy_branches": branches}


def _gateway_branches(gateway) -> dict[str, float]:
    """How SMG's cache_aware decided (event_hit: from the KV-event index; others: its tree,
    load or fallbacks), from its own counters."""
    name = "smg_cache_aware_policy_branch_total"
    return {
        dict(labels)["branch"]: value
        for (metric, labels), value in gateway.metrics().items()
        if metric == name and value
    }


def summarize(before: list[dict], after: list[dict], wall: float, restarted: str, isolated: bool):
    records = before + after
    ttft = [r["ttft_s"] for r in records]
    homes = {
        tenant: Counter(r["worker"] for r in before if r["tenant"] == tenant).most_common(1)[0][0]
        for tenant in {r["tenant"] for r in before}
    }
    orphans = [r for r in after if homes.get(r["tenant"]) == restarted]
    return {
        "hit_rate": _hit_rate(records),
        "hit_rate_before_restart": _hit_rate(before),
        "hit_rate_after_restart": _hit_rate(after),
        "ttft_mean_s": round(statistics.fmean(ttft), 4),
        "ttft_p50_s": round(percentile(ttft, 50), 4),
        "ttft_p99_s": round(percentile(ttft, 99), 4),
        "requests_s": round(len(records) / wall, 3),
        "output_tok_s": round(sum(r["completion_tokens"] for r in records) / wall, 2),
        "requests": len(records),
        "replicas_used_per_prompt": round(
            statistics.fmean(
                len({r["worker"] for r in records if r["tenant"] == t}) for t in homes
            ),
            2,
        ),
        "restarted_replica_prompts": {
            "prompts": sorted({r["tenant"] for r in orphans}),
            "turns_after_restart": len(orphans),
            "sent_to_restarted_replica": sum(r["worker"] == restarted for r in orphans),
            "hits": sum(r["cached_tokens"] > 0 for r in orphans),
            "hit_rate": _hit_rate(orphans),
            "in_order": [
                [r["tenant"], r["worker"] == restarted, r["cached_tokens"]] for r in orphans
            ],
        },
        "gateway_in_own_mount_namespace": isolated,
        "records": records,
    }


def _hit_rate(records: list[dict]) -> float:
    prompt = sum(r["prompt_tokens"] for r in records)
    return round(sum(r["cached_tokens"] for r in records) / prompt, 4) if prompt else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="runs of each system (alternated)")
    parser.add_argument("--prompts", type=int, default=16, help="tenants (system prompts)")
    parser.add_argument("--turns", type=int, default=6, help="user turns per system prompt")
    parser.add_argument("--prefix-words", type=int, default=200, help="words per system prompt")
    parser.add_argument("--max-tokens", type=int, default=8, help="new tokens per answer")
    parser.add_argument("--concurrency", type=int, default=3, help="requests in flight")
    parser.add_argument("--num-blocks", type=int, default=192, help="KV blocks per replica")
    parser.add_argument("--weights", default="quantized-int8", help="replicas' --weights")
    args = parser.parse_args()
    serve = ("--weights", args.weights, "--num-blocks", str(args.num_blocks))
    results: dict = {
        "load_average_before": load_average(),
        "other_test_processes_before": _other_tests(),
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as tmp, Fleet(Path(tmp)) as fleet:
        sets = {"events": [], "no_events": []}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            sets["events"] = list(pool.map(lambda _: fleet.replica(*serve), range(3)))
            no_events = (*serve, "--no-kv-events")
            sets["no_events"] = list(pool.map(lambda _: fleet.replica(*no_events), range(3)))
        for round_ in range(args.rounds):
            for name, (replica_set, _) in SYSTEMS.items():
                run = run_system(fleet, name, sets[replica_set], args)
                results["runs"].append({"system": name, "round": round_, **run})
                shown = {k: v for k, v in run.items() if k not in ("records",)}
                print(name, round_, shown, flush=True)
    results["load_average_after"] = load_average()
    results["other_test_processes_after"] = _other_tests()
    results["summary"] = summary_table(results["runs"])
    print(results["summary"], flush=True)
    publish("kv_routing", results, lambda stamp: plot(results, stamp, args), vars(args))


def _other_tests() -> int:
    """pytest processes on the machine (other developers' test runs make timings noisy)."""
    found = subprocess.run(["pgrep", "-fc", "pytest"], capture_output=True, text=True)
    return int(found.stdout.strip() or 0)


def summary_table(runs: list[dict]) -> dict[str, dict]:
    """Per system, the mean over its rounds of each headline number."""
    keys = ("hit_rate", "hit_rate_after_restart", "ttft_mean_s", "ttft_p99_s", "requests_s")
    table = {}
    for name in SYSTEMS:
        mine = [r for r in runs if r["system"] == name]
        table[name] = {k: round(statistics.fmean(r[k] for r in mine), 4) for k in keys}
        orphans = [r["restarted_replica_prompts"] for r in mine]
        table[name]["restarted_prompts_sent_there"] = sum(
            o["sent_to_restarted_replica"] for o in orphans
        )
        table[name]["restarted_prompts_turns"] = sum(o["turns_after_restart"] for o in orphans)
        table[name]["restarted_prompts_hit_rate"] = round(
            statistics.fmean(o["hit_rate"] for o in orphans), 4
        )
    return table


def plot(results: dict, stamp: str, args: argparse.Namespace) -> None:
    table = results["summary"]
    names = list(SYSTEMS)
    fig, axes = new_figure(4)
    panels = [
        ("hit_rate", 100, "%", "prefix-cache hit rate"),
        ("ttft_mean_s", 1000, "ms", "TTFT mean"),
        ("ttft_p99_s", 1000, "ms", "TTFT p99"),
        ("requests_s", 1, "req/s", "throughput"),
    ]
    for ax, (key, scale, unit, title) in zip(axes, panels, strict=True):
        bar_panel(ax, names, [table[n][key] * scale for n in names], unit, title)
    title = (
        f"{args.prompts} system prompts x {args.turns} turns, 3 replicas, B restarted midway, "
        f"{args.rounds} rounds"
    )
    save_figure(fig, "kv_routing", stamp, title)


if __name__ == "__main__":
    main()
