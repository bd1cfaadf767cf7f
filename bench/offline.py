"""Offline throughput: headrace continuous batching vs HF transformers static batching.

A seeded synthetic workload in the style of Anyscale's continuous-batching study: N requests,
all submitted at once, prompt lengths uniform in [prompt-min, prompt-max] (random token ids),
output lengths exponential with mean output-mean, capped at output-cap (EOS is ignored, so
every request produces exactly its length on every system). Measured in one run, on the same
model (embedded SmolLM2-135M GGUF, fp32) and the same torch thread count:

  headrace         Engine driven step-wise: all requests added, step() until done
  hf-static        HF ``generate`` on left-padded batches of --static-batch-size requests in
                   arrival order; a batch runs until its longest request is done, and only
                   each request's own tokens count as output
  hf-single        HF ``generate`` one request at a time

Also: KV waste of headrace (allocated-but-unused slots / allocated, from engine.stats() after
every step, weighted by allocation), a max_num_seqs sweep and a prefill_interval comparison
(throughput, inter-token latency) on the same workload. Writes
``bench/results/offline-<stamp>.json`` and a PNG. Run: ``make bench``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import common
import torch

SYSTEMS = ("headrace", "hf-static", "hf-single")


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]  # seconds after the start, ascending (all 0 = all at once)

    def describe(self) -> dict[str, Any]:
        plens = [len(p) for p in self.prompts]
        return {
            "num_requests": len(self.prompts),
            "prompt_tokens_total": sum(plens),
            "prompt_tokens_mean": round(statistics.mean(plens), 1),
            "output_tokens_total": sum(self.output_lens),
            "output_tokens_mean": round(statistics.mean(self.output_lens), 1),
            "output_tokens_max": max(self.output_lens),
            "last_arrival_s": round(self.arrivals[-1], 2),
        }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    w.add_argument("--prompt-min", type=int, default=16, help="shortest prompt (tokens)")
    w.add_argument("--prompt-max", type=int, default=256, help="longest prompt (tokens)")
    w.add_argument("--output-mean", type=float, default=64, help="mean of the exponential")
    w.add_argument("--output-cap", type=int, default=256, help="longest output (tokens)")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload generator")
    w.add_argument(
        "--arrival-rate",
        type=float,
        default=0.0,
        help="Poisson arrivals, requests/s (0 = all at t=0); headrace systems only, since "
        "the static baselines have no notion of arrival",
    )
    s = p.add_argument_group("systems")
    s.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of systems to run")
    s.add_argument("--max-num-seqs", type=int, default=64, help="headrace max_num_seqs")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="headrace budget")
    s.add_argument("--prefill-interval", type=int, default=0, help="headrace prefill_interval")
    s.add_argument("--static-batch-size", type=int, default=8, help="hf-static batch size")
    s.add_argument(
        "--single-requests",
        type=int,
        default=0,
        help="run hf-single on only the first K requests and extrapolate (0 = all; "
        "the JSON marks an extrapolated figure)",
    )
    s.add_argument("--threads", type=int, default=2, help="torch intra-op threads (all)")
    s.add_argument("--device", default="cpu", help="cpu or cuda (all systems)")
    s.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16"],
        help="weights and KV cache dtype (all systems); the CUDA kernels take float16/bfloat16",
    )
    x = p.add_argument_group("extra headrace runs (same workload)")
    x.add_argument(
        "--sweep-max-num-seqs", default="1,4,16,64", help="max_num_seqs values ('' = skip)"
    )
    x.add_argument(
        "--compare-prefill-intervals", default="0,4", help="prefill_interval values ('' = skip)"
    )
    p.add_argument("--name", default="offline", help="result file prefix in bench/results/")
    return p.parse_args(argv)


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """Seeded; the same arguments give the same requests on every machine."""
    rng = random.Random(args.seed)
    prompts, lens = [], []
    for _ in range(args.num_requests):
        n = rng.randint(args.prompt_min, args.prompt_max)
        prompts.append([rng.randrange(vocab_size) for _ in range(n)])
        length = round(rng.expovariate(1.0 / args.output_mean))
        lens.append(max(1, min(args.output_cap, length)))
    # A separate stream, so the same seed gives the same prompts with or without arrivals.
    gaps = random.Random(args.seed + 1)
    arrivals, t = [], 0.0
    for _ in range(args.num_requests):
        arrivals.append(t)
        if args.arrival_rate > 0:
            t += gaps.expovariate(args.arrival_rate)
    return Workload(prompts, lens, arrivals)


def model_vocab_size() -> int:
    """Read from the GGUF's metadata, so the workload exists before any system is loaded."""
    from transformers import AutoConfig

    gguf = common.default_gguf_path()
    return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).vocab_size


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- headrace ---------------------------------------------------------------------------


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
        sync(device)
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
        "itl_p50_ms": round(common.percentile(gaps, 50) * ms, 2) if gaps else None,
        "itl_p99_ms": round(common.percentile(gaps, 99) * ms, 2) if gaps else None,
        "itl_max_ms": round(max(gaps) * ms, 2) if gaps else None,
        "ttft_mean_s": round(statistics.mean(ttft), 3),
        "ttft_p99_s": round(common.percentile(ttft, 99), 3),
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


# -- HF transformers baselines ----------------------------------------------------------


def left_pad(prompts: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding keeps every row's last prompt token at the same position for generate."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def hf_generate(model: Any, prompts: list[list[int]], max_new: int, device: str) -> None:
    ids, mask = left_pad(prompts, device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, **common.hf_generate_kwargs(max_new))
    sync(device)
    if out.shape[1] != ids.shape[1] + max_new:
        raise RuntimeError(f"HF generated {out.shape[1] - ids.shape[1]} tokens, not {max_new}")


def static_kv_slots(prompts: list[list[int]], lens: list[int]) -> tuple[int, int]:
    """(allocated, used) slot-steps of one static batch, computed from its shapes.

    HF's cache holds batch x (longest prompt + step) slots at every step; a row's slots are
    useful only for its own prompt and the tokens it still needs.
    """
    width, steps = max(len(p) for p in prompts), max(lens)
    allocated = used = 0
    for s in range(1, steps + 1):
        allocated += len(prompts) * (width + s)
        used += sum(len(p) + min(s, n) for p, n in zip(prompts, lens, strict=True) if s <= n)
    return allocated, used


def run_hf_static(model: Any, workload: Workload, batch_size: int, device: str) -> dict:
    load_before = common.load_average()
    start = time.perf_counter()
    generated = allocated = used = 0
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        lens = workload.output_lens[first : first + batch_size]
        hf_generate(model, prompts, max(lens), device)
        generated += len(prompts) * max(lens)
        a, u = static_kv_slots(prompts, lens)
        allocated, used = allocated + a, used + u
    elapsed = time.perf_counter() - start
    useful = sum(workload.output_lens)
    return {
        "batch_size": batch_size,
        "elapsed_s": round(elapsed, 3),
        "output_tokens": useful,
        "output_tok_s": round(useful / elapsed, 2),
        "generated_tokens_incl_padding": generated,
        "useful_fraction": round(useful / generated, 4),
        "kv_waste_computed": round((allocated - used) / allocated, 4),
        "load_average": [load_before, common.load_average()],
    }


def run_hf_single(model: Any, workload: Workload, limit: int, device: str) -> dict:
    count = len(workload.prompts) if limit <= 0 else min(limit, len(workload.prompts))
    load_before = common.load_average()
    start = time.perf_counter()
    for prompt, n in zip(workload.prompts[:count], workload.output_lens[:count], strict=True):
        hf_generate(model, [prompt], n, device)
    elapsed = time.perf_counter() - start
    tokens = sum(workload.output_lens[:count])
    return {
        "requests_run": count,
        "extrapolated": count < len(workload.prompts),
        "elapsed_s": round(elapsed, 3),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / elapsed, 2),
        "load_average": [load_before, common.load_average()],
    }


def run_hf(args: argparse.Namespace, workload: Workload, systems: list[str]) -> dict:
    model, load_s = common.load_hf_model(common.default_gguf_path())
    model.to(args.device, getattr(torch, args.dtype))
    hf_generate(model, [[1, 2, 3], [4, 5, 6, 7]], 4, args.device)  # warm-up, untimed
    results: dict[str, Any] = {}
    if "hf-static" in systems:
        print(f"hf-static: batches of {args.static_batch_size} ...", flush=True)
        results["hf-static"] = run_hf_static(model, workload, args.static_batch_size, args.device)
        results["hf-static"]["load_s"] = round(load_s, 2)
    if "hf-single" in systems:
        print("hf-single: one request at a time ...", flush=True)
        results["hf-single"] = run_hf_single(model, workload, args.single_requests, args.device)
        results["hf-single"]["load_s"] = round(load_s, 2)
    del model
    gc.collect()
    return results


# -- orchestration, report, plot --------------------------------------------------------


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


def timeline(log: StepLog, max_bins: int = 60) -> dict[str, list[float]]:
    """Output tokens/s in equal time bins of about five steps or more (one step's rate is too
    spiky to read, and a bin narrower than a step shows gaps that are not there)."""
    bins = max(1, min(max_bins, len(log.t) // 5))
    width = log.t[-1] / bins
    counts = [0] * bins
    for t, n in zip(log.t, log.tokens, strict=True):
        counts[min(bins - 1, int(t / width))] += n
    return {
        "t_s": [round((i + 0.5) * width, 3) for i in range(bins)],
        "tok_s": [round(c / width, 2) for c in counts],
    }


def step_trace(log: StepLog) -> dict[str, list]:
    return {
        "t_s": [round(t, 4) for t in log.t],
        "tokens": log.tokens,
        "running": log.running,
        "kv_slots_allocated": log.kv_allocated,
        "kv_slots_used": log.kv_used,
    }


def assemble(args, workload, hf: dict, runs: dict) -> dict[str, Any]:
    """The JSON payload: systems, ratios, sweep, interleave comparison, main run's trace."""
    main_key = (args.max_num_seqs, args.prefill_interval)
    public = {k: {f: v for f, v in r.items() if f != "_log"} for k, r in runs.items()}
    systems = dict(hf)
    if main_key in runs:
        systems = {"headrace": public[main_key], **hf}
    payload: dict[str, Any] = {
        "settings": vars(args),
        "workload": workload.describe(),
        "systems": systems,
        "ratios": ratios(systems),
        "sweep_max_num_seqs": pick(
            public, [(m, args.prefill_interval) for m in int_list(args.sweep_max_num_seqs)]
        ),
        "prefill_interval_comparison": pick(
            public, [(args.max_num_seqs, p) for p in int_list(args.compare_prefill_intervals)]
        ),
    }
    if main_key in runs:
        payload["headrace_timeline"] = timeline(runs[main_key]["_log"])
        payload["headrace_steps"] = step_trace(runs[main_key]["_log"])
    return payload


def ratios(systems: dict[str, dict]) -> dict[str, float]:
    out = {}
    if "headrace" not in systems:
        return out
    for base in ("hf-static", "hf-single"):
        if base in systems:
            rate = systems["headrace"]["output_tok_s"] / systems[base]["output_tok_s"]
            out[f"headrace_over_{base.replace('-', '_')}"] = round(rate, 2)
    return out


def pick(runs: dict[tuple[int, int], dict], keys: list[tuple[int, int]]) -> list[dict]:
    return [runs[k] for k in keys if k in runs]


def report(payload: dict[str, Any]) -> None:
    print(f"\nworkload: {payload['workload']}")
    print(f"\n{'system':<11} {'output tok/s':>13} {'elapsed s':>10}  notes")
    for name, r in payload["systems"].items():
        notes = ""
        if name == "headrace":
            notes = f"kv waste {r['kv_waste']:.2%}, itl p99 {r['itl_p99_ms']} ms"
        elif name == "hf-static":
            notes = f"useful {r['useful_fraction']:.0%} of generated, kv waste (computed) "
            notes += f"{r['kv_waste_computed']:.0%}"
        elif r.get("extrapolated"):
            notes = f"EXTRAPOLATED from {r['requests_run']} requests"
        print(f"{name:<11} {r['output_tok_s']:>13.1f} {r['elapsed_s']:>10.1f}  {notes}")
    for key, value in payload["ratios"].items():
        print(f"{key}: {value:.2f}x")
    print("\nmax_num_seqs sweep:")
    for r in payload["sweep_max_num_seqs"]:
        print(f"  {r['max_num_seqs']:>4}: {r['output_tok_s']:8.1f} tok/s")
    print("\nprefill_interval comparison:")
    for r in payload["prefill_interval_comparison"]:
        print(
            f"  {r['prefill_interval']:>4}: {r['output_tok_s']:8.1f} tok/s, "
            f"itl mean {r['itl_mean_ms']} ms, p99 {r['itl_p99_ms']} ms, "
            f"ttft mean {r['ttft_mean_s']} s"
        )


def plot_timeline(ax, payload: dict[str, Any]) -> None:
    line = payload.get("headrace_timeline")
    if not line:
        ax.set_visible(False)
        return
    ax.plot(line["t_s"], line["tok_s"], color="tab:blue", label="output tokens/s")
    ax.set_xlabel("seconds since all requests were submitted")
    ax.set_ylabel("output tokens/s")
    ax.set_title("headrace over time", fontsize=10)
    steps = payload["headrace_steps"]
    running = ax.twinx()
    running.plot(steps["t_s"], steps["running"], color="tab:gray", alpha=0.6, lw=1)
    running.set_ylabel("running sequences", color="tab:gray")


def plot_sweep(ax, payload: dict[str, Any]) -> None:
    sweep = payload["sweep_max_num_seqs"]
    if not sweep:
        ax.set_visible(False)
        return
    xs = [r["max_num_seqs"] for r in sweep]
    ax.plot(xs, [r["output_tok_s"] for r in sweep], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("max_num_seqs")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("headrace throughput vs max_num_seqs", fontsize=10)


def plot_intervals(ax, payload: dict[str, Any]) -> None:
    runs = payload["prefill_interval_comparison"]
    if not runs:
        ax.set_visible(False)
        return
    labels = [f"interval {r['prefill_interval']}" for r in runs]
    common.bar_panel(
        ax, labels, [r["output_tok_s"] for r in runs], "output tokens/s", "prefill_interval"
    )
    for i, r in enumerate(runs):
        text = f"ITL mean {r['itl_mean_ms']:.0f} ms\np99 {r['itl_p99_ms']:.0f} ms"
        ax.text(i, r["output_tok_s"] * 0.5, text, ha="center", fontsize=8, color="white")


def plot(payload: dict[str, Any], stamp: str, name: str) -> None:
    fig, (ax_bar, ax_time, ax_sweep, ax_int) = common.new_figure(2, nrows=2)
    systems = payload["systems"]
    labels = [n + (" (extrap.)" if r.get("extrapolated") else "") for n, r in systems.items()]
    common.bar_panel(
        ax_bar,
        labels,
        [r["output_tok_s"] for r in systems.values()],
        "output tokens/s",
        f"{payload['workload']['num_requests']} requests, "
        + ("all at t=0" if payload["settings"]["arrival_rate"] == 0 else "Poisson arrivals"),
    )
    plot_timeline(ax_time, payload)
    plot_sweep(ax_sweep, payload)
    plot_intervals(ax_int, payload)
    load = payload["load_average_start"]
    common.save_figure(fig, name, stamp, title=f"offline throughput; load average at start {load}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; choose from {SYSTEMS}")
    if args.arrival_rate < 0:
        raise SystemExit("--arrival-rate: must be >= 0")
    if args.arrival_rate > 0 and set(systems) != {"headrace"}:
        raise SystemExit("--arrival-rate: only with --systems headrace (baselines run offline)")
    workload = make_workload(args, model_vocab_size())
    load_start = common.load_average()
    hf = run_hf(args, workload, systems) if {"hf-static", "hf-single"} & set(systems) else {}
    runs = run_all_headrace(args, workload) if "headrace" in systems else {}
    payload = assemble(args, workload, hf, runs)
    payload["load_average_start"] = load_start
    payload["load_average_end"] = common.load_average()
    stamp = common.timestamp()
    path = common.write_result(args.name, payload, stamp=stamp)
    plot(payload, stamp, args.name)
    report(payload)
    print(f"\nwrote {path} and {path.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
