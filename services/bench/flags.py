"""``headrace bench serve``'s flags (every one documented in --help) and their checks."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.bench.stats import parse_slos
from services.client import client_security

HELP = """Benchmark a headrace server the way `vllm bench serve` does: send a workload at a
request rate (or all at once), stream every response, and report request and token
throughput, TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99), goodput under
SLOs and errors by status code. Metrics follow vLLM's definitions, from client timestamps.
With --launch, flags after `--` go to `headrace serve`, e.g.
  headrace bench serve --launch --num-requests 64 --max-concurrency 16 -- --max-num-seqs 64"""


def add_parser(
    commands: argparse._SubParsersAction,
    default_server: str,
    environ: Mapping[str, str] | None = None,
) -> None:
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
    client_security.add_flags(p, os.environ if environ is None else environ)
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


# Plain options, (flag, type, default, help) in --help order.
_RANDOM = (
    ("--input-len", int, 128, "random prompt tokens (default 128)"),
    ("--output-len", int, 64, "max_tokens (default 64)"),
    ("--range-ratio", float, 0.0, "random lengths uniform in len*(1 +- ratio) (default 0)"),
    ("--prefix-len", int, 0, "tokens of shared prefix on every random prompt (prefix caching)"),
)
_SAMPLING = (
    ("--temperature", float, 0.0, "sampling temperature"),
    ("--seed", int, 0, "workload, arrivals and sampling seed"),
)
_LOAD = (
    ("--num-requests", int, 100, "measured requests per run"),
    ("--warmup", int, 2, "unmeasured requests first (default 2)"),
    ("--request-rate", float, math.inf, "mean requests/s (default inf: all at once)"),
    ("--burstiness", float, 1.0, "gamma shape of arrivals: 1 = Poisson, <1 burstier (default 1)"),
)


def add_rows(group: argparse._ArgumentGroup, rows: tuple[tuple[str, Any, Any, str], ...]) -> None:
    """Add plain ``(flag, type, default, help)`` options (type None: a string)."""
    for flag, kind, default, text in rows:
        group.add_argument(flag, type=kind, default=default, help=text)


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
    add_rows(g, _RANDOM)
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    add_rows(g, _SAMPLING)


def _add_load_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    add_rows(g, _LOAD)
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
