"""``headrace bench serve``: flags, and one run (or a rate sweep) from workload to report."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc

from services.bench import workload
from services.bench.arrivals import arrival_offsets
from services.bench.runner import RequestRecord, RunSettings, run_workload
from services.bench.scrape import MetricsSampler
from services.bench.stats import parse_slos, summarize

HELP = """Benchmark a headrace server the way `vllm bench serve` does: send a workload at a
request rate (or all at once), stream every response, and report request and token
throughput, TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99), goodput under
SLOs and errors by status code. Metrics follow vLLM's definitions, from client timestamps.
With --launch, flags after `--` go to `headrace serve`, e.g.
  headrace bench serve --launch --num-requests 64 --max-concurrency 16 -- --max-num-seqs 64"""


def add_parser(commands: argparse._SubParsersAction, default_server: str) -> None:
    """Register ``bench`` with its ``serve`` subcommand on the ``headrace`` parser."""
    bench = commands.add_parser("bench", help="benchmarks against a server (bench serve)")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    p = kinds.add_parser(
        "serve",
        help="serving benchmark: TTFT/TPOT/ITL/goodput at a request rate",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_target_flags(p, default_server)
    _add_workload_flags(p)
    _add_load_flags(p)
    _add_output_flags(p)


def _add_target_flags(p: argparse.ArgumentParser, default_server: str) -> None:
    g = p.add_argument_group("server")
    g.add_argument(
        "--server",
        default=default_server,
        metavar="HOST:PORT",
        help=f"server to benchmark (default: {default_server})",
    )
    g.add_argument(
        "--launch",
        action="store_true",
        help="start `headrace serve` on free ports with the flags after `--`",
    )
    g.add_argument(
        "--metrics-url",
        help="its Prometheus endpoint (default: http://HOST:9400/metrics; 'none' to skip sampling)",
    )
    g.add_argument("--ready-timeout", type=float, default=600.0, help="--launch start wait (s)")
    g.add_argument("serve_args", nargs="*", metavar="-- SERVE_FLAGS", help=argparse.SUPPRESS)


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset",
        choices=("random", "fixed", "jsonl"),
        default="random",
        help="random: seeded token ids of the served model; fixed: --prompt "
        "every time; jsonl: --dataset-path (default: random)",
    )
    g.add_argument("--dataset-path", type=Path, help='JSONL: {"prompt"|"chat", "output_len"}')
    g.add_argument(
        "--prompt",
        default="Write a short story about a lighthouse keeper.",
        help="the fixed workload's prompt",
    )
    g.add_argument("--input-len", type=int, default=128, help="random prompt tokens (default 128)")
    g.add_argument("--output-len", type=int, default=64, help="max_tokens (default 64)")
    g.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random lengths uniform in len*(1 +- ratio) (default 0)",
    )
    g.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="tokens of shared prefix on every random prompt (prefix caching)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    g.add_argument("--seed", type=int, default=0, help="workload, arrivals and sampling seed")


def _add_load_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--num-requests", type=int, default=100, help="measured requests per run")
    g.add_argument("--warmup", type=int, default=2, help="unmeasured requests first (default 2)")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="mean requests/s (default inf: all at once)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of arrivals: 1 = Poisson, <1 burstier (default 1)",
    )
    g.add_argument(
        "--sweep-rate",
        metavar="R1,R2,...",
        help="one run per rate (inf allowed), same workload; overrides --request-rate",
    )
    g.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no cap)")
    g.add_argument(
        "--goodput",
        metavar="KEY:MS,...",
        help="SLOs for goodput, KEY in ttft, tpot, e2el, e.g. ttft:500,tpot:50",
    )


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--result-json", type=Path, help="write settings, machine, server and results")
    g.add_argument("--plot", type=Path, help="write a PNG: latency CDFs, throughput over time")
    g.add_argument("--label", default="", help="a name stored in the JSON and plot titles")
    g.add_argument("--metrics-interval", type=float, default=0.5, help="/metrics sampling period")
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when stderr is a terminal)",
    )


def check_args(args: argparse.Namespace) -> tuple[list[float], dict[str, float]]:
    """Validate the flags argparse cannot; (rates to run, SLOs)."""
    if args.serve_args and not args.launch:
        raise ValueError("flags after `--` are for --launch only")
    if args.num_requests < 1 or args.warmup < 0:
        raise ValueError("--num-requests must be >= 1 and --warmup >= 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.dataset == "jsonl" and args.dataset_path is None:
        raise ValueError("--dataset jsonl needs --dataset-path")
    text = args.sweep_rate
    rates = [float(r) for r in text.split(",") if r.strip()] if text else [args.request_rate]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError("--request-rate / --sweep-rate values must be > 0 (or inf)")
    return rates, parse_slos(args.goodput)


def default_metrics_url(target: str) -> str:
    host = target.rsplit(":", 1)[0] if ":" in target else target
    return f"http://{host or 'localhost'}:9400/metrics"


def main(args: argparse.Namespace) -> int:
    import contextlib

    from services.bench.launch import launched_server

    rates, slos = check_args(args)
    with contextlib.ExitStack() as stack:
        target, metrics_url = args.server, args.metrics_url
        if args.launch:
            target, launched_url = stack.enter_context(
                launched_server(args.serve_args, args.ready_timeout)
            )
            metrics_url = metrics_url or launched_url
        metrics_url = metrics_url or default_metrics_url(target)
        if metrics_url.lower() == "none":
            metrics_url = None
        record = benchmark(args, target, metrics_url, rates, slos)
    finish(args, record)
    return 0


def benchmark(
    args: argparse.Namespace,
    target: str,
    metrics_url: str | None,
    rates: list[float],
    slos: Mapping[str, float],
) -> dict[str, Any]:
    from services.bench.report import commit, machine, print_table

    info = _model_info(target)
    requests = build_workload(args, target, info)
    settings = _settings(args, rates)
    if args.warmup:
        warm = [requests[i % len(requests)] for i in range(args.warmup)]
        asyncio.run(run_workload(target, warm, [0.0] * len(warm), settings(math.inf), "warmup"))
    runs = []
    for rate in rates:
        run = one_run(args, target, metrics_url, requests, settings(rate), slos)
        print_table(_title(args, rate), run["metrics"], sys.stdout)
        runs.append(run)
    return {
        "benchmark": "headrace bench serve",
        "label": args.label,
        "settings": _jsonable(vars(args)) | {"server": target, "metrics_url": metrics_url},
        "machine": machine(),
        "commit": commit(),
        "server_info": info,
        "runs": runs,
    }


def _title(args: argparse.Namespace, rate: float) -> str:
    cap = args.max_concurrency or "-"
    return f"{args.label or 'bench serve'} rate={rate:g} max_concurrency={cap}"


def _settings(args: argparse.Namespace, rates: list[float]):
    def at(rate: float) -> RunSettings:
        return RunSettings(
            rate,
            args.burstiness,
            args.max_concurrency,
            args.ignore_eos,
            args.temperature,
            args.seed,
        )

    return at


def one_run(
    args: argparse.Namespace,
    target: str,
    metrics_url: str | None,
    requests: list[workload.BenchRequest],
    settings: RunSettings,
    slos: Mapping[str, float],
) -> dict[str, Any]:
    from tqdm import tqdm

    offsets = arrival_offsets(len(requests), settings.request_rate, settings.burstiness, args.seed)
    sampler = MetricsSampler(metrics_url, args.metrics_interval)
    disable = None if args.progress is None else not args.progress
    with tqdm(
        total=len(requests),
        desc=f"rate {settings.request_rate:g}",
        disable=disable,
        unit="req",
        file=sys.stderr,
    ) as bar:
        t0 = time.perf_counter()
        sampler.start(t0)
        try:
            records, duration = asyncio.run(
                run_workload(
                    target, requests, offsets, settings, on_done=lambda _: bar.update(), t0=t0
                )
            )
        finally:
            sampler.stop()
    return {
        "request_rate": settings.request_rate,
        "max_concurrency": settings.max_concurrency,
        "metrics": summarize(records, duration, slos),
        "server_metrics": sampler.report(),
        "requests": [_record_dict(r) for r in records],
    }


def _record_dict(r: RequestRecord) -> dict[str, Any]:
    return asdict(r) | {"chunks": [list(c) for c in r.chunks]}


def _model_info(target: str) -> dict[str, Any]:
    from google.protobuf import json_format

    from services.client import Client

    with Client(target, timeout=30) as remote:
        info = remote.model_info()
    return json_format.MessageToDict(info, preserving_proto_field_name=True)


def build_workload(
    args: argparse.Namespace, target: str, info: Mapping[str, Any]
) -> list[workload.BenchRequest]:
    n = args.num_requests
    if args.dataset == "fixed":
        return workload.fixed_requests(args.prompt, args.output_len, n)
    if args.dataset == "jsonl":
        return workload.jsonl_requests(args.dataset_path, args.output_len, n)
    spec = workload.RandomSpec(args.input_len, args.output_len, args.range_ratio, args.prefix_len)
    pool = workload.token_pool(
        _tokenized_pool(target), int(info.get("vocab_size", 0)), info.get("eos_token_ids", [])
    )
    return workload.random_requests(spec, pool, n, args.seed)


# A server without a tokenizer refuses text prompts with INVALID_ARGUMENT (naming "prompt").
_NO_TOKENIZER = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION,
)


def _tokenized_pool(target: str) -> list[int] | None:
    """The served model's own ids for a stock paragraph; None when it has no tokenizer."""
    from services.client import Client

    try:
        with Client(target, timeout=30) as remote:
            return list(remote.tokenize(workload._POOL_TEXT).token_ids)
    except grpc.RpcError as exc:
        if exc.code() in _NO_TOKENIZER:
            return None
        raise


def _jsonable(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in values.items()}


def finish(args: argparse.Namespace, record: dict[str, Any]) -> None:
    from services.bench.report import write_json

    if args.result_json:
        write_json(args.result_json, record)
        print(f"wrote {args.result_json}", file=sys.stderr)
    if args.plot:
        from services.bench.plot import plot

        plot(record, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
