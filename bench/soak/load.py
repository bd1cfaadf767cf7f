"""How hard the soak pushes: "about half capacity", measured or given.

Capacity is measured, not assumed: an all-at-once burst of ``--calibrate-requests``
normal-shaped requests (services/bench/runner.py, the ``headrace bench serve`` client)
and the requests/s the server completed over it. The soak's generating kinds (normal,
cancel, deadline) then arrive at ``--load-fraction`` of that rate; bad and oversized
requests ride on top (they are refused before the engine sees them). The burst doubles
as the first warm-up. With ``--request-rate`` or ``--max-concurrency`` no burst is sent
and the JSON says the load was given. For reference, the embedded model on the 2-core
development VM completes ~0.4 req/s of 128-token prompts and 64-token outputs at
concurrency 16 (bench/results/serve-cpu-c16.json), so half capacity is ~0.2 req/s.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from typing import Any

from bench.soak.requests import GENERATING, parse_mix, shares
from services.bench import runner, stats, workload


def calibrate(args: argparse.Namespace, target: str, pool: list[int]) -> dict[str, Any]:
    """Capacity: normal requests/s completed in one all-at-once burst."""
    spec = workload.RandomSpec(args.input_len, args.output_len, args.range_ratio)
    requests = workload.random_requests(spec, pool, args.calibrate_requests, args.seed + 1)
    settings = runner.RunSettings(math.inf, 1.0, None, False, 0.0, args.seed)
    offsets = [0.0] * len(requests)
    records, duration = asyncio.run(
        runner.run_workload(target, requests, offsets, settings, "soak-calibrate")
    )
    metrics = stats.summarize(records, duration)
    if not metrics["completed"]:
        raise RuntimeError(f"calibration: no request completed ({metrics['errors_by_code']})")
    return {"burst": metrics, "capacity_req_s": metrics["request_throughput"]}


def choose_load(args: argparse.Namespace, target: str, pool: list[int]) -> dict[str, Any]:
    """{mode, request_rate ("inf" for a closed loop), max_concurrency, how, ...}."""
    if args.request_rate != "auto":
        return {
            "mode": "given rate",
            "request_rate": float(args.request_rate),
            "max_concurrency": args.max_concurrency,
            "how": "--request-rate given (no capacity measured)",
        }
    if args.max_concurrency:
        return {
            "mode": "closed loop",
            "request_rate": "inf",
            "max_concurrency": args.max_concurrency,
            "how": "--max-concurrency given: that many requests back to back (no capacity "
            "measured)",
        }
    found = calibrate(args, target, pool)
    share = shares(parse_mix(args.mix), GENERATING)
    rate = args.load_fraction * found["capacity_req_s"] / share
    how = (
        f"{args.load_fraction:g} x capacity ({found['capacity_req_s']:.3f} req/s completed in "
        f"an all-at-once burst of {args.calibrate_requests}) / share of generating kinds "
        f"({share:.2f})"
    )
    return {
        "mode": "calibrated",
        "request_rate": rate,
        "max_concurrency": None,
        "how": how,
        **found,
    }
