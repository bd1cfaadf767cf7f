"""Serving benchmark: many concurrent Generate streams against one headrace server.

Starts ``python -m services.cli serve`` in a subprocess (or uses ``--server``), opens
``--concurrency`` streams at a time of fixed prompts with ``ignore_eos`` and a fixed
``max_tokens``, and reports output tokens/s, TTFT percentiles (client-side and as the
server measured them) and the step loop's idle fraction from /metrics: the share of
busy time the step loop waited for work, i.e. how well the CPU stages keep it fed.

Writes ``bench/results/serving-<stamp>.json`` (machine, commit, settings, results)
and a PNG beside it. Flags after ``--`` go to ``headrace serve``, e.g.:

    python -m bench.serving --concurrency 32 --max-tokens 128 -- --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

if __package__ in (None, ""):  # run as `python bench/serving.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    REPO_ROOT,
    new_figure,
    percentile,
    save_figure,
    timestamp,
    write_result,
)
from services.gen.headrace.v1 import generation_pb2 as pb  # noqa: E402
from services.gen.headrace.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle stays upright, step by step.",
    "List ten ideas for a rainy afternoon, with one sentence each.",
    "Describe the water cycle to a ten-year-old.",
    "What are the main differences between a violin and a viola?",
    "Summarize the plot of a heist movie you invent on the spot.",
    "Give a recipe for pancakes and explain why each ingredient matters.",
    "Write a letter from a cat to its owner about the new sofa.",
)
READY = re.compile(r"headrace ready: .* on (?P<host>[^\s:]+):(?P<port>\d+)")
METRICS = re.compile(r"metrics: (?P<url>http://\S+/metrics)")
IDLE_GAUGE = re.compile(r"^headrace_step_loop_idle_ratio (?P<value>\S+)$", re.MULTILINE)


@dataclass
class RequestResult:
    ttft: float | None  # client-side: send -> first chunk carrying tokens
    latency: float
    completion_tokens: int
    server_ttft: float | None
    server_queue: float | None
    error: str | None = None


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", help="HOST:PORT of a running server (default: start one)")
    parser.add_argument("--metrics-url", help="its /metrics URL (with --server)")
    parser.add_argument("--concurrency", type=int, default=32, help="streams open at once")
    parser.add_argument("--requests", type=int, help="requests in all (default: concurrency)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests first")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="server start wait")
    parser.add_argument("--name", default="serving", help="result file name prefix")
    args = parser.parse_args(argv)
    args.requests = args.requests or args.concurrency
    return args, serve_args


@contextlib.contextmanager
def launched_server(serve_args: list[str], ready_timeout: float) -> Iterator[tuple[str, str]]:
    """``headrace serve`` on free ports; yields (grpc target, metrics URL); SIGTERM after."""
    cmd = [sys.executable, "-m", "services.cli", "serve", "--host", "127.0.0.1",
           "--port", "0", "--metrics-port", "0", "--log-level", "warning", *serve_args]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "server.log"
        with log_path.open("w") as log_file:
            proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT, env=os.environ
            )
        try:
            yield _wait_ready(proc, log_path, ready_timeout)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_ready(proc: subprocess.Popen, log_path: Path, timeout: float) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text()
        ready, metrics = READY.search(text), METRICS.search(text)
        if ready and metrics:
            return f"{ready['host']}:{ready['port']}", metrics["url"]
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{text[-4000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"server not ready after {timeout:.0f}s:\n{log_path.read_text()[-4000:]}")


def build_request(i: int, args: argparse.Namespace, tag: str = "bench") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"{tag}-{i}",
        prompt=PROMPTS[i % len(PROMPTS)],
        sampling=pb.SamplingParams(temperature=args.temperature, seed=i),
        stopping=pb.StoppingCriteria(max_tokens=args.max_tokens, ignore_eos=True),
    )


async def one_request(
    stub: pb_grpc.GenerationServiceStub, req: pb.GenerateRequest
) -> RequestResult:
    start = time.perf_counter()
    ttft, complete = None, None
    try:
        async for response in stub.Generate(req):
            if response.HasField("complete"):
                complete = response.complete
            elif ttft is None and response.chunk.token_ids:
                ttft = time.perf_counter() - start
    except grpc.aio.AioRpcError as exc:
        return RequestResult(ttft, time.perf_counter() - start, 0, None, None, exc.code().name)
    return RequestResult(
        ttft=ttft,
        latency=time.perf_counter() - start,
        completion_tokens=complete.usage.completion_tokens if complete else 0,
        server_ttft=complete.timing.time_to_first_token_seconds if complete else None,
        server_queue=complete.timing.queue_seconds if complete else None,
        error=None if complete else "no Complete",
    )


async def run_load(
    target: str, requests: list[pb.GenerateRequest], concurrency: int
) -> tuple[list[RequestResult], float]:
    """All requests, at most ``concurrency`` in flight; (results, wall seconds)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        gate = asyncio.Semaphore(concurrency)

        async def gated(req: pb.GenerateRequest) -> RequestResult:
            async with gate:
                return await one_request(stub, req)

        start = time.perf_counter()
        results = await asyncio.gather(*(gated(r) for r in requests))
        return list(results), time.perf_counter() - start


def scrape_idle_ratio(metrics_url: str | None) -> float | None:
    if not metrics_url:
        return None
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        match = IDLE_GAUGE.search(response.read().decode())
    return float(match["value"]) if match else None


def summarize(results: list[RequestResult], wall: float) -> dict[str, object]:
    ok = [r for r in results if r.error is None]
    tokens = sum(r.completion_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    server_ttfts = [r.server_ttft for r in ok if r.server_ttft is not None]
    queues = [r.server_queue for r in ok if r.server_queue is not None]
    return {
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error}),
        "wall_seconds": wall,
        "output_tokens": tokens,
        "output_tokens_per_second": tokens / wall if wall > 0 else None,
        "ttft_p50_seconds": percentile(ttfts, 50),
        "ttft_p99_seconds": percentile(ttfts, 99),
        "server_ttft_p50_seconds": percentile(server_ttfts, 50),
        "server_ttft_p99_seconds": percentile(server_ttfts, 99),
        "server_queue_p50_seconds": percentile(queues, 50),
        "latency_p50_seconds": percentile([r.latency for r in ok], 50),
    }


def plot(results: list[RequestResult], summary: dict[str, object], stamp: str, name: str) -> Path:
    fig, (ax_ttft, ax_rate) = new_figure(2)
    ok = [r for r in results if r.error is None]
    ax_ttft.hist([r.ttft for r in ok if r.ttft is not None], bins=30)
    ax_ttft.set_xlabel("client TTFT (s)")
    ax_ttft.set_ylabel("requests")
    rates = [
        r.completion_tokens / (r.latency - (r.ttft or 0)) for r in ok if r.latency > (r.ttft or 0)
    ]
    ax_rate.hist(rates, bins=30)
    ax_rate.set_xlabel("per-request decode rate (tokens/s)")
    title = (
        f"{summary['output_tokens_per_second']:.0f} output tok/s, "
        f"step-loop idle {summary.get('step_loop_idle_ratio')}"
    )
    return save_figure(fig, name, stamp, title)


def main(argv: list[str] | None = None) -> int:
    args, serve_args = parse_args(argv)
    requests = [build_request(i, args) for i in range(args.requests)]
    warmup = [build_request(i, args, "warmup") for i in range(args.warmup)]
    with contextlib.ExitStack() as stack:
        if args.server:
            target, metrics_url = args.server, args.metrics_url
        else:
            target, metrics_url = stack.enter_context(
                launched_server(serve_args, args.ready_timeout)
            )
        if warmup:
            asyncio.run(run_load(target, warmup, args.concurrency))
        results, wall = asyncio.run(run_load(target, requests, args.concurrency))
        summary = summarize(results, wall)
        summary["step_loop_idle_ratio"] = scrape_idle_ratio(metrics_url)
    stamp = timestamp()
    settings = {k: v for k, v in vars(args).items() if k != "name"} | {"serve_args": serve_args}
    payload = {"results": summary, "requests": [asdict(r) for r in results]}
    path = write_result(args.name, payload, stamp, settings)
    plot(results, summary, stamp, args.name)
    print(f"wrote {path}")
    for key, value in summary.items():
        print(f"  {key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
