"""``headrace bench serve``: flags, and one run (or a rate sweep) from workload to report."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc

from services.bench import workload
from services.bench.arrivals import arrival_offsets
from services.bench.flags import check_args
from services.bench.runner import RequestRecord, RunSettings, run_workload
from services.bench.scrape import MetricsSampler
from services.bench.stats import summarize
from services.client.client_security import ClientSecurity


def default_metrics_url(target: str, tls: bool = False) -> str:
    host = target.rsplit(":", 1)[0] if ":" in target else target
    return f"{'https' if tls else 'http'}://{host or 'localhost'}:9400/metrics"


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
        metrics_url = metrics_url or default_metrics_url(target, _security(args).tls)
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

    info = model_info(target, _security(args))
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
            _security(args),
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
    sampler = MetricsSampler(metrics_url, args.metrics_interval, settings.security)
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
        "request_rate": json_rate(settings.request_rate),
        "max_concurrency": settings.max_concurrency,
        "metrics": summarize(records, duration, slos),
        "server_metrics": sampler.report(),
        "requests": [_record_dict(r) for r in records],
    }


def _record_dict(r: RequestRecord) -> dict[str, Any]:
    return asdict(r) | {"chunks": [list(c) for c in r.chunks]}


def _security(args: argparse.Namespace) -> ClientSecurity:
    """TLS and token options (``--tls-ca``, ``--auth-token-file``...; none = plaintext)."""
    if not hasattr(args, "client_tls"):  # a namespace built without those flags
        return ClientSecurity()
    return ClientSecurity.from_args(args, os.environ)


def model_info(target: str, security: ClientSecurity | None = None) -> dict[str, Any]:
    from google.protobuf import json_format

    from services.client.client import Client

    with Client(target, 30, security) as remote:
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
        tokenized_pool(target, _security(args)),
        int(info.get("vocab_size", 0)),
        info.get("eos_token_ids", []),
    )
    return workload.random_requests(spec, pool, n, args.seed)


# A server without a tokenizer refuses text prompts with INVALID_ARGUMENT (naming "prompt").
_NO_TOKENIZER = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION,
)


def tokenized_pool(target: str, security: ClientSecurity | None = None) -> list[int] | None:
    """The served model's own ids for a stock paragraph; None when it has no tokenizer."""
    from services.client.client import Client

    try:
        with Client(target, 30, security) as remote:
            return list(remote.tokenize(workload.POOL_TEXT).token_ids)
    except grpc.RpcError as exc:
        if exc.code() in _NO_TOKENIZER:
            return None
        raise


def json_rate(rate: float) -> float | str:
    """JSON has no Infinity: "inf" (as vLLM writes it) for all-at-once runs."""
    return "inf" if math.isinf(rate) else rate


def _jsonable(values: Mapping[str, Any]) -> dict[str, Any]:
    def plain(v: Any) -> Any:
        if isinstance(v, Path):
            return str(v)
        return json_rate(v) if isinstance(v, float) else v

    return {k: plain(v) for k, v in values.items()}


def finish(args: argparse.Namespace, record: dict[str, Any]) -> None:
    from services.bench.report import write_json

    if args.result_json:
        write_json(args.result_json, record)
        print(f"wrote {args.result_json}", file=sys.stderr)
    if args.plot:
        from services.bench.plot import plot

        plot(record, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
