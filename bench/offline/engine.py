"""The offline benchmark's headrace side: the Engine driven step-wise over a workload, with
per-step KV accounting and per-token times, for the main run and the extra runs."""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from bench import common
from bench.offline.workload import Workload, int_list
from services.bench.stats import percentile


def load_engine(args: argparse.Namespace, max_num_seqs: int, prefill_interval: int):
    from compute.core.config import DeviceConfig, EngineConfig, SchedulerConfig
    from compute.engine import Engine

    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            prefill_interval=prefill_interval,
        ),
        device=DeviceConfig(device=args.device, dtype=args.dtype, num_threads=args.threads),
    )
    start = time.perf_counter()
    engine = Engine(config)
    return engine, time.perf_counter() - start


def warm_up_engine(engine: Any) -> None:
    """First steps pay one-time costs (allocator, kernels) that a serving engine pays once."""
    from compute.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * 2, params)


@dataclass
class StepLog:
    """Per step, on a clock that excludes the time spent sampling engine.stats()."""

    t: list[float]  # end of the step, seconds since all requests were added
    tokens: list[int]  # output tokens the step produced
    running: list[int]
    kv_allocated: list[int]
    kv_used: list[int]


def drive(engine: Any, workload: Workload, device: str) -> tuple[StepLog, dict[str, list[float]]]:
    """Add requests as they arrive, step until done; the step log and per-request token times."""
    from compute.core.sampling_params import SamplingParams

    log = StepLog([], [], [], [], [])
    token_times: dict[str, list[float]] = {f"r{i}": [] for i in range(len(workload.prompts))}
    start = time.perf_counter()
    instrumentation, next_i, n = 0.0, 0, len(workload.prompts)
    while next_i < n or engine.has_unfinished():
        now = time.perf_counter() - start - instrumentation
        while next_i < n and workload.arrivals[next_i] <= now:
            params = SamplingParams(
                temperature=0.0, max_tokens=workload.output_lens[next_i], ignore_eos=True
            )
            engine.add_request(f"r{next_i}", workload.prompts[next_i], params)
            next_i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, workload.arrivals[next_i] - now))  # idle until the next one
            continue
        outputs = engine.step()
        common.sync(device)
        now = time.perf_counter() - start - instrumentation
        produced = 0
        for out in outputs:
            token_times[out.request_id].extend(now for _ in out.new_token_ids)
            produced += len(out.new_token_ids)
        before_stats = time.perf_counter()
        stats = engine.stats()
        instrumentation += time.perf_counter() - before_stats
        log.t.append(now)
        log.tokens.append(produced)
        log.running.append(stats.num_running)
        log.kv_allocated.append(stats.kv_slots_allocated)
        log.kv_used.append(stats.kv_slots_used)
    return log, token_times


def latency_stats(token_times: dict[str, list[float]], arrivals: list[float]) -> dict[str, Any]:
    """Inter-token gaps within each request, and time to first token from its arrival."""
    gaps = [b - a for times in token_times.values() for a, b in pairwise(times)]
    ttft = [token_times[f"r{i}"][0] - t for i, t in enumerate(arrivals) if token_times[f"r{i}"]]
    ms = 1000.0
    return {
        "itl_mean_ms": round(statistics.mean(gaps) * ms, 2) if gaps else None,
        "itl_p50_ms": round(percentile(gaps, 50) * ms, 2) if gaps else None,
        "itl_p99_ms": round(percentile(gaps, 99) * ms, 2) if gaps else None,
        "itl_max_ms": round(max(gaps) * ms, 2) if gaps else None,
        "ttft_mean_s": round(statistics.mean(ttft), 3),
        "ttft_p99_s": round(percentile(ttft, 99), 3),
    }


def kv_waste(log: StepLog) -> float | None:
    """Unused share of allocated slots over all steps, weighted by allocation."""
    allocated = sum(log.kv_allocated)
    if not allocated:
        return None
    return (allocated - sum(log.kv_used)) / allocated


def run_headrace(
    args: argparse.Namespace, workload: Workload, max_num_seqs: int, prefill_interval: int
) -> dict[str, Any]:
    engine, load_s = load_engine(args, max_num_seqs, prefill_interval)
    warm_up_engine(engine)
    load_before = common.load_average()
    log, token_times = drive(engine, workload, args.device)
    produced = [len(token_times[f"r{i}"]) for i in range(len(workload.prompts))]
    if produced != workload.output_lens:
        raise RuntimeError("headrace produced other output lengths than requested")
    elapsed = log.t[-1]
    result = {
        "max_num_seqs": max_num_seqs,
        "prefill_interval": prefill_interval,
        "load_s": round(load_s, 2),
        "elapsed_s": round(elapsed, 3),
        "output_tokens": sum(produced),
        "output_tok_s": round(sum(produced) / elapsed, 2),
        "steps": len(log.t),
        "kv_waste": round(kv_waste(log), 5),
        "peak_running": max(log.running),
        "num_preemptions": engine.stats().num_preemptions,
        **latency_stats(token_times, workload.arrivals),
        "load_average": [load_before, common.load_average()],
    }
    del engine
    gc.collect()
    return result | {"_log": log}


def headrace_configs(args: argparse.Namespace) -> list[tuple[int, int]]:
    """Distinct (max_num_seqs, prefill_interval) runs; the main one first, none twice."""
    main = (args.max_num_seqs, args.prefill_interval)
    sweep = [(m, args.prefill_interval) for m in int_list(args.sweep_max_num_seqs)]
    compare = [(args.max_num_seqs, p) for p in int_list(args.compare_prefill_intervals)]
    return list(dict.fromkeys([main, *sweep, *compare]))


def run_all_headrace(args: argparse.Namespace, workload: Workload) -> dict[tuple[int, int], dict]:
    runs = {}
    for mns, interval in headrace_configs(args):
        print(f"headrace: max_num_seqs={mns} prefill_interval={interval} ...", flush=True)
        runs[(mns, interval)] = run_headrace(args, workload, mns, interval)
        r = runs[(mns, interval)]
        print(f"  {r['output_tok_s']:.1f} tok/s, kv waste {r['kv_waste']:.2%}", flush=True)
    return runs
