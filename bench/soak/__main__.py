"""Soak benchmark (issue 10): a server under steady mixed load for a long time must not grow,
leak KV blocks, or answer anything it should not.

    python -m bench.soak [FLAGS] [-- SERVE_FLAGS]         # make soak ARGS="..."

Launches ``headrace serve`` (the embedded model unless SERVE_FLAGS say otherwise; its
log at info level, for the start-up ``memory`` line) or uses ``--server`` (then
``--server-pid`` for RSS). Phases: idle (RSS at idle after start), a calibration burst
(unless ``--request-rate`` or ``--max-concurrency`` is given), ``--duration`` seconds of
load whose first ``--warmup`` seconds are the warm-up, a drain (the engine back to no
running/waiting requests), idle again. The load is a seeded mix of normal streamed
requests, cancellations, short deadlines, bad requests and oversized prompts
(soak_requests.py) at about half capacity:

- ``--request-rate auto`` (default): capacity = requests/s the server completes in an
  all-at-once burst of ``--calibrate-requests`` normal requests; the generating kinds
  (normal, cancel, deadline) then arrive at ``--load-fraction`` (0.5) of it.
- ``--request-rate R``: R requests/s of the whole mix (Poisson; ``--burstiness``).
- ``--max-concurrency C`` alone: a closed loop, C requests in flight back to back.

Writes ``bench/results/soak-<stamp>.json`` (machine, commit, settings, load, samples,
records, windows, summary) and a ``.png``; exits 1 when a goal fails. bench/README.md
describes every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.soak import summary
from bench.soak.client import drive
from bench.soak.flags import parse_args
from bench.soak.load import choose_load
from bench.soak.monitor import Monitor, read_counters, server_log_facts
from bench.soak.requests import Planner, Shape, parse_mix
from services.bench import command, report, workload
from services.bench.launch import launched_process

RESULTS = Path(__file__).resolve().parents[1] / "results"  # bench/results


class Phases:
    """Named [start, end] spans (seconds since t0) that also label the monitor's samples."""

    def __init__(self, monitor: Monitor, t0: float) -> None:
        self.monitor, self.t0, self.spans = monitor, t0, {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.monitor.phase = name
        start = time.perf_counter() - self.t0
        try:
            yield
        finally:
            self.spans[name] = [start, time.perf_counter() - self.t0]


def _progress(monitor: Monitor, t0: float, every: float):
    state = {"next": every, "done": 0, "unexpected": 0}

    def on_record(record) -> None:
        state["done"] += 1
        state["unexpected"] += not record.expected
        now = time.perf_counter() - t0
        if now >= state["next"]:
            state["next"] = now + every
            rss, kv = monitor.latest("rss_mib"), monitor.latest("kv_cache_usage")
            print(
                f"[soak] t={now:.0f}s done={state['done']} unexpected={state['unexpected']} "
                f"rss={rss} MiB kv={kv}",
                file=sys.stderr,
                flush=True,
            )

    return on_record


def wait_idle(monitor: Monitor, timeout: float) -> dict[str, Any]:
    """Sample until nothing runs or waits and the KV cache is empty (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        point = monitor.sample()
        if "running" not in point:
            return point  # no /metrics: nothing to wait for
        idle = point["running"] == 0 and point.get("waiting") == 0
        if (idle and point.get("kv_cache_usage") == 0) or time.monotonic() > deadline:
            return point
        time.sleep(0.5)


def _planner(args: argparse.Namespace, target: str, info: dict[str, Any]) -> Planner:
    tokenized = command.tokenized_pool(target)
    vocab = int(info.get("vocab_size", 0))
    pool = workload.token_pool(tokenized, vocab, info.get("eos_token_ids", []))
    shape = Shape(args.input_len, args.output_len, args.range_ratio, vocab, tuple(pool),
                  tokenized is not None, tuple(args.oversized_mib))  # fmt: skip
    return Planner(parse_mix(args.mix), shape, args.seed)


class Classifier:
    """Plans requests and remembers each variant's expectation, to classify its record."""

    def __init__(self, planner: Planner) -> None:
        self.planner, self.expectations = planner, {}

    def plan(self):
        planned = self.planner.next()
        self.expectations[f"{planned.kind}/{planned.variant}"] = planned.expect
        return planned

    def classify(self, record) -> None:
        expect = self.expectations[f"{record.kind}/{record.variant}"]
        record.expected = summary.classify(record, expect)

    def then(self, report_progress):
        """An on_record callback: classify, then report progress."""

        def on_record(record) -> None:
            self.classify(record)
            report_progress(record)

        return on_record


def run_soak(args, target: str, metrics_url: str | None, pid: int | None) -> dict[str, Any]:
    info = command.model_info(target)
    planner = _planner(args, target, info)
    t0 = time.perf_counter()
    monitor = Monitor(pid, metrics_url, args.sample_interval, t0)
    phase, kinds = Phases(monitor, t0), Classifier(planner)
    monitor.start()
    counters_before = read_counters(metrics_url)
    with phase("idle_start"):
        time.sleep(args.idle_seconds)
    with phase("calibrate"):
        load = choose_load(args, target, list(planner.shape.pool))
    rate = math.inf if load["request_rate"] == "inf" else load["request_rate"]
    print(f"[soak] load: {load['mode']}, {rate:.3g} req/s for {args.duration:g} s", file=sys.stderr)
    progress = kinds.then(_progress(monitor, t0, args.progress_every))
    with phase("load"):
        records = asyncio.run(drive(
            target, kinds.plan, args.duration, rate, args.burstiness, load["max_concurrency"],
            args.seed, t0, progress, finish_timeout=args.drain_timeout,
        ))  # fmt: skip
    for record in records:  # those given up on never reached on_record
        kinds.classify(record)
    with phase("drain"):
        final = wait_idle(monitor, args.drain_timeout)
    with phase("idle_end"):
        time.sleep(args.idle_seconds)
        monitor.sample()
    monitor.stop()
    spans = phase.spans
    start = spans["load"][0]
    spans |= {"warmup": [start, start + args.warmup], "load": [start, start + args.duration]}
    return {
        "server_info": info,
        "load": load,
        "phases": spans,
        "expectations": {k: asdict(v) for k, v in sorted(kinds.expectations.items())},
        "server_counters": {"before": counters_before, "after": read_counters(metrics_url)},
        "samples": monitor.samples,
        "final_sample": final,
        "records": [asdict(r) for r in records],
        **_summarize(args, records, monitor.samples, spans, final, info),
    }


def _summarize(args, records, samples, spans, final, info) -> dict[str, Any]:
    block = int(info.get("block_size", 0)) or None
    capacity = int(info.get("kv_cache_capacity_tokens", 0))
    num_blocks = capacity // block if block and capacity else None
    counts = summary.outcome_counts(records)
    rss = summary.rss_summary(samples, spans, min(args.rss_span, args.warmup))
    kv = summary.kv_after_load(final, num_blocks)
    latency = {k: summary.percentiles(v) for k, v in summary.latencies(records).items()}
    return {
        "windows": summary.windows(records, spans["load"][0], spans["idle_end"][1], args.window),
        "summary": {
            "requests": counts,
            "latency_all": latency,
            "seconds_by_kind": summary.seconds_by_kind(records),
            "rss": rss,
            "kv_after_load": kv,
            "goals": summary.goals(rss, kv, counts, args.rss_growth_limit),
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    with contextlib.ExitStack() as stack:
        target, url, pid, log_path = args.server, args.metrics_url, args.server_pid, args.server_log
        if not target:
            launched = stack.enter_context(
                launched_process(["--log-level", "info", *args.serve_args], args.ready_timeout)
            )
            target, url = launched.target, url or launched.metrics_url
            pid, log_path = launched.process.pid, launched.log_path
        url = (
            None if (url or "").lower() == "none" else (url or command.default_metrics_url(target))
        )
        result = run_soak(args, target, url, pid)
        result["server_log"] = server_log_facts(log_path)
    result["summary"]["memory"] = summary.memory(
        result["server_log"]["memory"], result["summary"]["rss"]
    )
    record = {
        "benchmark": "soak",
        "machine": report.machine(),
        "commit": report.commit(),
        "settings": vars(args) | {"server": target, "metrics_url": url, "server_pid": pid},
        **result,
    }
    out_dir = args.out_dir or RESULTS
    json_path = out_dir / f"{args.name}-{stamp}.json"
    report.write_json(json_path, record)
    from bench.soak.plot import plot

    plot(record, json_path.with_suffix(".png"))
    print_summary(record, json_path)
    return 0 if record["summary"]["goals"]["passed"] else 1


def print_summary(record: dict[str, Any], path: Path) -> None:
    s = record["summary"]
    shown = {k: s[k] for k in ("rss", "kv_after_load", "goals")}
    shown |= {"unexpected_by_code": s["requests"]["unexpected_by_code"], "memory": s["memory"]}
    print(json.dumps(shown, indent=2))
    print(f"wrote {path} and {path.with_suffix('.png').name}")


if __name__ == "__main__":
    sys.exit(main())
