"""Load through the SMG gateway's OpenAI endpoint vs straight to one headrace replica.

Three modes, the same requests, the same client-side clock (one process, asyncio):

- ``direct``: headrace.v1 Generate over gRPC to replica A (no gateway);
- ``smg-1``: the OpenAI SDK (streaming completions) through ``smg launch`` with replica A;
- ``smg-2``: the same through a second gateway with replicas A and B (``--policy``).

Each request: a distinct prompt, greedy, ``--max-tokens`` new tokens with EOS ignored,
``--concurrency`` in flight. Per request, TTFT (send -> first token) and TPOT
((last - first token) / (tokens - 1)); per mode, output tokens/s over the wall time.
Replicas and gateways are started here (tests/support/gateway_stack.py) and killed at the end.
Writes ``bench/results/gateway-<stamp>.json`` and a PNG. guidellm was not used: it needs an
OpenAI endpoint on both sides, and ``direct`` has none (headrace speaks gRPC).

    .venv/bin/python -m bench.gateway --requests 32 --concurrency 8 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import openai

from bench.common import bar_panel, load_average, new_figure, publish, save_figure
from services.bench.stats import percentile
from services.client import client
from services.gen.headrace.v1 import generation_pb2_grpc
from tests.support.gateway_stack import Stack, served_model


def prompts(n: int) -> list[str]:
    return [f"Request {i}: write a short story about the number {i * 37 % 101}." for i in range(n)]


async def _bounded(n: int, concurrency: int, one) -> tuple[list[dict], float]:
    gate = asyncio.Semaphore(concurrency)

    async def run(i: int) -> dict:
        async with gate:
            return await one(i)

    start = time.perf_counter()
    results = await asyncio.gather(*(run(i) for i in range(n)))
    return results, time.perf_counter() - start


async def direct(target: str, texts: list[str], args) -> tuple[list[dict], float]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        async def one(i: int) -> dict:
            request = client.generate_request(
                prompt=texts[i], temperature=0, max_tokens=args.max_tokens
            )
            request.stopping.ignore_eos = True
            sent, stamps = time.perf_counter(), []
            async for response in stub.Generate(request, timeout=600):
                if response.HasField("chunk"):
                    stamps += [time.perf_counter()] * len(response.chunk.token_ids)
            return _record(sent, stamps)

        return await _bounded(len(texts), args.concurrency, one)


async def through_gateway(base: str, texts: list[str], args) -> tuple[list[dict], float]:
    api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=600, max_retries=0)
    model = served_model(base)

    async def one(i: int) -> dict:
        sent, stamps = time.perf_counter(), []
        stream = await api.completions.create(
            model=model, prompt=texts[i], temperature=0, max_tokens=args.max_tokens,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for event in stream:
            if event.choices and event.choices[0].text:
                stamps.append(time.perf_counter())
        return _record(sent, stamps)

    try:
        return await _bounded(len(texts), args.concurrency, one)
    finally:
        await api.close()


def _record(sent: float, stamps: list[float]) -> dict:
    # Through SMG a chunk is a text delta (a few tokens may share one); TPOT uses the
    # requested token count, which ignore_eos guarantees, so both modes divide alike.
    return {"ttft_s": stamps[0] - sent, "last_s": stamps[-1] - sent, "chunks": len(stamps)}


def summarize(results: list[dict], wall: float, args) -> dict:
    ttft = [r["ttft_s"] for r in results]
    tpot = [(r["last_s"] - r["ttft_s"]) / (args.max_tokens - 1) for r in results]
    return {
        "wall_s": round(wall, 3),
        "output_tok_s": round(len(results) * args.max_tokens / wall, 2),
        "requests_s": round(len(results) / wall, 3),
        "ttft_p50_s": round(percentile(ttft, 50), 4),
        "ttft_p90_s": round(percentile(ttft, 90), 4),
        "tpot_p50_s": round(percentile(tpot, 50), 4),
        "tpot_mean_s": round(statistics.fmean(tpot), 4),
        "load_average_after": load_average(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32, help="requests per mode")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument("--policy", default="cache_aware", help="smg-2's routing policy")
    parser.add_argument("--threads", default="1", help="torch threads per replica")
    args = parser.parse_args()
    texts = prompts(args.requests)
    serve = ("--threads", args.threads, "--num-blocks", "512", "--max-pending", "256")
    results: dict[str, dict] = {"load_average_before": load_average()}
    with tempfile.TemporaryDirectory() as tmp, Stack(Path(tmp)) as stack:
        a, b = (stack.replica(*serve) for _ in range(2))
        one_gateway = stack.gateway([a], "--policy", "round_robin")
        two_gateway = stack.gateway([a, b], "--policy", args.policy)
        warm = argparse.Namespace(**{**vars(args), "max_tokens": 4})
        asyncio.run(through_gateway(two_gateway, prompts(4), warm))  # untimed warm-up
        runs = {
            "direct": lambda: direct(a.target, texts, args),
            "smg-1": lambda: through_gateway(one_gateway, texts, args),
            "smg-2": lambda: through_gateway(two_gateway, texts, args),
        }
        for name, run in runs.items():
            measured, wall = asyncio.run(run())
            results[name] = summarize(measured, wall, args)
            print(name, results[name], flush=True)
    publish("gateway", {"results": results}, lambda stamp: plot(results, stamp, args), vars(args))


def plot(results: dict[str, dict], stamp: str, args: argparse.Namespace) -> None:
    modes = [m for m in results if m != "load_average_before"]
    fig, axes = new_figure(3)
    bar_panel(axes[0], modes, [results[m]["output_tok_s"] for m in modes], "tok/s", "throughput")
    bar_panel(axes[1], modes, [1000 * results[m]["ttft_p50_s"] for m in modes], "ms", "TTFT p50")
    bar_panel(axes[2], modes, [1000 * results[m]["tpot_p50_s"] for m in modes], "ms", "TPOT p50")
    save_figure(fig, "gateway", stamp, f"{args.requests} req, concurrency {args.concurrency}")


if __name__ == "__main__":
    main()
